"""The tool-call log when a record is not a whole turn (Hermes's session store appends one
message at a time; ``sessions.append_nowait``; a turn split across two ``sync_turn`` calls):
a call's answer in a later record, of the same batch or a later one, is its answer; a call
without an answer yet awaits it, read by nothing, until its answer, a closing message (a
user message, the model's reply) or the session's end settles it; fixes come out as a whole
turn's do."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.hermes.state import SessionDB

from .test_procedural_log import SESSION, call, turn

Message = dict[str, Any]


def rows(db: Path) -> dict[str, tuple[Any, ...]]:
    """The log by call id: (ok, awaiting, error type, result)."""
    with sqlite3.connect(db) as conn:
        return {r[0]: tuple(r[1:]) for r in conn.execute(
            "SELECT call_id, ok, awaiting, error_type, result FROM tool_calls")}


def logged(db: Path) -> dict[tuple[str, str], tuple[Any, ...]]:
    """Everything the log says of each call, by (session, call id), its fix links by the
    call ids they point to."""
    with sqlite3.connect(db) as conn:
        found = conn.execute(
            "SELECT id, session_id, call_id, tool, arguments, result, ok, awaiting, error_type, "
            "error_message, duration_ms, goal, fixes, fixed_by FROM tool_calls").fetchall()
    names = {r[0]: r[2] for r in found}
    return {(r[1], r[2]): (*r[3:12], names.get(r[12]), names.get(r[13])) for r in found}


def append_each(mem: MemoryPipeline, session: str, messages: Sequence[Message], user: str
                ) -> None:
    """Each message its own record, as Hermes's session store writes them."""
    for m in messages:
        mem.sessions.append_nowait(session, [m], user_id=user)


def user(text: str) -> Message:
    return {"role": "user", "content": text}


def calling(*calls: dict[str, Any]) -> Message:
    return {"role": "assistant", "content": "", "tool_calls": list(calls)}


def answer(cid: str, content: Any) -> Message:
    return {"role": "tool", "tool_call_id": cid,
            "content": content if isinstance(content, str) else json.dumps(content)}


def reply(text: str = "done") -> Message:
    return {"role": "assistant", "content": text}


FAILED = {"error": "FileNotFoundError: [Errno 2] No such file or directory: 'src/mian.py'",
          "duration_ms": 12}


@pytest.mark.parametrize("flush_between", [False, True], ids=["one-batch", "two-batches"])
async def test_a_call_and_its_answer_in_separate_records_are_one_logged_call(
        tmp_path: Path, flush_between: bool) -> None:
    db = tmp_path / "m.db"
    async with MemoryPipeline(Settings(db_path=db, max_wait_ms=0)) as mem:
        append_each(mem, "s", [user("open the entry point"),
                               calling(call("a1", "read_file", path="src/mian.py"))], "ann")
        if flush_between:
            await mem.flush()
            assert rows(db) == {"a1": (1, 1, None, "")}  # awaiting its answer
            assert await mem.procedural.search("ann") == []  # read by nothing yet
            assert await mem.procedural.stats("ann") == []
        append_each(mem, "s", [answer("a1", FAILED)], "ann")
        await mem.flush()
        [c] = await mem.procedural.search("ann")
        [stats] = await mem.procedural.stats("ann")
    assert (c.call_id, c.ok, c.error_type, c.duration_ms) == ("a1", False, "FileNotFoundError",
                                                              12)
    assert c.result.startswith('{"error"') and c.goal == "open the entry point"
    assert (stats.calls, stats.failures) == (1, 1)
    assert rows(db)["a1"][:2] == (0, 0)


async def test_a_call_never_answered_fails_once_the_next_user_message_comes(
        tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        append_each(mem, "s", [user("read it"), calling(call("r1", "read_file", path="a"))],
                    "ann")
        await mem.flush()
        # The model asked again (another call) without being answered: still awaiting.
        append_each(mem, "s", [calling(call("r2", "terminal", command="ls"))], "ann")
        await mem.flush()
        assert {k: v[1] for k, v in rows(db).items()} == {"r1": 1, "r2": 1}
        append_each(mem, "s", [user("and now?")], "ann")
        await mem.flush()
        calls = {c.call_id: c for c in await mem.procedural.search("ann")}
        [read] = await mem.procedural.stats("ann", ["read_file"])
    assert {k: (c.ok, c.error_type) for k, c in calls.items()} == {
        "r1": (False, "no_result"), "r2": (False, "no_result")}
    assert calls["r1"].error_message == "the call was never answered"
    assert calls["r1"].result == "" and calls["r1"].goal == "read it"
    assert (read.calls, read.success_rate) == (1, 0.0)


async def test_a_call_left_awaiting_by_an_earlier_run_is_settled_by_the_next(
        tmp_path: Path) -> None:
    """What awaits its answer is the store's, not the process's: a plain message of the
    next run (no tool call in its batch) still settles it."""
    db = tmp_path / "m.db"
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        append_each(mem, "s", [user("go"), calling(call("w1", "terminal", command="a"),
                                                   call("w2", "terminal", command="b"))],
                    "ann")
        mem.sync_turn("hello", "hi", session_id="other", user_id="ann")  # plain
        await mem.flush()
    assert {k: v[1] for k, v in rows(db).items()} == {"w1": 1, "w2": 1}
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        append_each(mem, "s", [answer("w2", {"exit_code": 0})], "ann")
        await mem.flush()
        assert {k: v[1] for k, v in rows(db).items()} == {"w1": 1, "w2": 0}
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        mem.sync_turn("and now?", "ok", session_id="s", user_id="ann")  # plain: closes
        await mem.flush()
    assert {k: v[:3] for k, v in rows(db).items()} == {
        "w1": (0, 0, "no_result"), "w2": (1, 0, None)}


async def test_the_models_reply_and_the_sessions_end_settle_a_call_never_answered(
        tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        append_each(mem, "s", [user("go"), calling(call("x1", "terminal", command="a"),
                                                   call("x2", "terminal", command="b")),
                               answer("x1", {"exit_code": 0})], "ann")
        await mem.flush()
        append_each(mem, "s", [reply("gave up on b")], "ann")  # the model's reply closes
        append_each(mem, "t", [user("go"), calling(call("y1", "terminal", command="c"))], "ann")
        await mem.flush()
        assert rows(db)["y1"][1] == 1
        await mem.sessions.end("t", "user_exit")  # so does the session's end
        await mem.flush()
    assert {k: v[:3] for k, v in rows(db).items()} == {
        "x1": (1, 0, None), "x2": (0, 0, "no_result"), "y1": (0, 0, "no_result")}


async def test_an_answer_the_log_never_saw_a_call_for_logs_nothing(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        append_each(mem, "s", [user("hi"), answer("ghost", {"error": "boom"}), reply()], "ann")
        await mem.flush()
        # A second answer to a settled call, and one for a call of another session.
        append_each(mem, "s", [user("go"), calling(call("k1", "terminal", command="a")),
                               answer("k1", {"exit_code": 0})], "ann")
        append_each(mem, "t", [answer("k1", {"exit_code": 3})], "ann")
        await mem.flush()
        append_each(mem, "s", [answer("k1", {"exit_code": 9}), reply()], "ann")
        await mem.flush()
        assert mem.stats().dead_letters == 0
        assert [(c.call_id, c.ok) for c in await mem.procedural.search("ann")] == [("k1", True)]
    assert rows(db) == {"k1": (1, 0, None, '{"exit_code": 0}')}


async def test_a_reused_call_id_answers_only_the_call_of_its_own_turn(tmp_path: Path) -> None:
    """Some models number their calls per reply ("call_0"): an answer after a closing
    message is not the answer of a call before it."""
    db = tmp_path / "m.db"
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        append_each(mem, "s", [user("one"), calling(call("call_0", "terminal", command="a"))],
                    "ann")
        await mem.flush()
        append_each(mem, "s", [user("two"), calling(call("call_0", "terminal", command="b"))],
                    "ann")
        append_each(mem, "s", [answer("call_0", {"exit_code": 0}), reply()], "ann")
        await mem.flush()
        found = {c.arguments["command"]: (c.ok, c.error_type, c.goal)
                 for c in await mem.procedural.search("ann")}
    assert found == {"a": (False, "no_result", "one"), "b": (True, None, "two")}


async def test_a_fix_across_records_and_batches_is_found(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        append_each(mem, "s", [user("open the entry point"),
                               calling(call("a1", "read_file", path="src/mian.py"))], "ann")
        await mem.flush()
        append_each(mem, "s", [answer("a1", FAILED),
                               calling(call("a2", "read_file", path="src/main.py"))], "ann")
        await mem.flush()
        append_each(mem, "s", [answer("a2", {"content": "def main(): ..."}), reply()], "ann")
        await mem.flush()
        [fix] = await mem.procedural.fix_for("ann", "FileNotFoundError")
    assert (fix.failed.call_id, fix.fixed.call_id) == ("a1", "a2")
    assert dict(fix.delta.changed) == {"path": ("src/mian.py", "src/main.py")}


async def test_calls_answered_out_of_order_get_the_fixes_of_a_whole_turn(
        tmp_path: Path) -> None:
    """Two calls of one message: the second answered (a success) before the first (a
    failure), and a third call never answered, closed by the reply after a success of its
    tool. The fixes are the whole turn's, whichever batches the records commit in."""
    messages = [user("read both"),
                calling(call("p1", "read_file", path="a"), call("p2", "read_file", path="b"),
                        call("p3", "terminal", command="x")),
                answer("p2", {"content": "b"}), answer("p1", {"error": "EACCES"}),
                calling(call("p4", "terminal", command="y")), answer("p4", {"exit_code": 0}),
                reply()]
    whole = tmp_path / "whole.db"
    async with MemoryPipeline(Settings(db_path=whole)) as mem:
        mem.sync_turn("read both", "done", session_id="s", user_id="ann", messages=messages)
        await mem.flush()
    expected = logged(whole)
    assert (expected["s", "p2"][-2], expected["s", "p4"][-2]) == ("p1", "p3")
    for cut in range(1, len(messages)):
        split = tmp_path / f"split{cut}.db"
        async with MemoryPipeline(Settings(db_path=split)) as mem:
            append_each(mem, "s", messages[:cut], "ann")
            await mem.flush()
            append_each(mem, "s", messages[cut:], "ann")
            await mem.flush()
        assert logged(split) == expected, cut


async def test_a_recorded_session_appended_message_by_message_logs_as_whole_turns(
        tmp_path: Path) -> None:
    """test_procedural_log.SESSION (fixes, a failure never fixed, a call never answered),
    each message its own record, committed in batches of every size: the same log as the
    session committed turn by turn, and the same stats."""
    whole = tmp_path / "whole.db"
    async with MemoryPipeline(Settings(db_path=whole)) as mem:
        for msgs in SESSION:
            mem.sync_turn(msgs[0]["content"], msgs[-1]["content"], session_id="s",
                          user_id="ann", messages=msgs)
        await mem.flush()
        expected_stats = await mem.procedural.stats("ann")
    expected = logged(whole)
    assert expected["s", "d2"][3:6] == (0, 0, "no_result")  # its turn's reply came
    messages = [m for msgs in SESSION for m in msgs]
    for every in (1, 3, len(messages)):
        split = tmp_path / f"each{every}.db"
        async with MemoryPipeline(Settings(db_path=split)) as mem:
            for i, m in enumerate(messages):
                mem.sessions.append_nowait("s", [m], user_id="ann")
                if i % every == every - 1:
                    await mem.flush()
            await mem.flush()
            stats = await mem.procedural.stats("ann")
        assert logged(split) == expected, every
        assert summary(stats) == summary(expected_stats)


def summary(stats: Sequence[Any]) -> list[tuple[Any, ...]]:
    return [(s.tool, s.calls, s.successes, s.avg_duration_ms,
             [(e.error_type, e.count, e.typical_fix) for e in s.errors],
             [(h.arguments, h.count, h.goal) for h in s.hints]) for s in stats]


async def test_a_turn_split_across_two_sync_turns_is_logged_once_with_its_answers(
        tmp_path: Path) -> None:
    msgs = turn("run the tests", [call("b1", "terminal", command="pytest")],
                {"b1": {"exit_code": 4, "duration_ms": 812}})
    db = tmp_path / "m.db"
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        mem.sync_turn("run the tests", "", session_id="s", user_id="ann", messages=msgs[:2])
        mem.sync_turn("", "ok", session_id="s", user_id="ann", messages=msgs[2:])
        await mem.flush()
        [c] = await mem.procedural.search("ann")
    assert (c.ok, c.error_type, c.duration_ms, c.goal) == (False, "exit_code", 812,
                                                           "run the tests")


def test_hermes_session_store_message_by_message_has_the_right_success_rate(
        tmp_path: Path) -> None:
    """Hermes's session store, as its agent loop calls it: one append_message per message.
    Three calls succeed and one fails; none is counted a failure for its answer coming
    later."""
    path = tmp_path / "state.db"
    db = SessionDB(db_path=path)
    try:
        db.create_session("h1", "cli", user_id="ann")
        db.append_message("h1", role="user", content="fix the build")
        for n, (command, code) in enumerate([("make", 2), ("make -j1", 0), ("make test", 0),
                                             ("make lint", 0)]):
            cid = f"call_{n}"
            db.append_message("h1", role="assistant", content=None, tool_calls=[
                {"id": cid, "type": "function",
                 "function": {"name": "terminal", "arguments": json.dumps(
                     {"command": command})}}])
            db.append_message("h1", role="tool", content=json.dumps(
                {"output": "", "exit_code": code}), tool_call_id=cid, tool_name="terminal")
        db.append_message("h1", role="assistant", content="the build passes")
        db.end_session("h1", "user_exit")
    finally:
        db.close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT count(*) FROM tool_calls WHERE awaiting = 1").fetchone() == (
            0,)

    async def read() -> tuple[Any, Any]:
        async with MemoryPipeline(Settings(db_path=path)) as mem:
            return (await mem.procedural.stats("ann"),
                    await mem.procedural.fix_for("ann", "exit_code"))

    import asyncio

    [stats], [fix] = asyncio.run(read())
    assert (stats.tool, stats.calls, stats.successes) == ("terminal", 4, 3)
    assert stats.success_rate == pytest.approx(0.75)
    assert [e.error_type for e in stats.errors] == ["exit_code"]
    assert dict(fix.delta.changed) == {"command": ("make", "make -j1")}
    assert fix.failed.goal == fix.fixed.goal == "fix the build"


async def test_a_version_10_stores_log_gets_its_awaiting_column_at_open(
        tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        mem.sync_turn(SESSION[0][0]["content"], "ok", session_id="s", user_id="ann",
                      messages=SESSION[0])
        await mem.flush()
    with sqlite3.connect(db) as conn:
        conn.executescript("""
            DROP INDEX idx_tool_calls_awaiting;
            ALTER TABLE tool_calls DROP COLUMN awaiting;
            UPDATE schema_version SET version = 10;""")
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        append_each(mem, "s", [user("again"), calling(call("z1", "read_file", path="x"))],
                    "ann")
        await mem.flush()
        assert rows(db)["z1"][1] == 1
        append_each(mem, "s", [answer("z1", {"content": "x"})], "ann")
        await mem.flush()
        assert [c.call_id for c in await mem.procedural.search("ann")] == ["z1", "a1"]


async def test_answers_found_in_the_store_and_the_batchs_own_are_each_judged_as_theirs(
        tmp_path: Path) -> None:
    """A batch judges its own answers as it is built; an answer it finds in the store (one an
    earlier commit stored without settling its call) is judged in the transaction. Both in one
    commit: each call gets its own answer's outcome."""
    db = tmp_path / "m.db"
    async with MemoryPipeline(Settings(db_path=db, max_wait_ms=0)) as mem:
        append_each(mem, "s", [user("open it"),
                               calling(call("w1", "read_file", path="src/mian.py"))], "ann")
        await mem.flush()
        # A commit that wrongly believes no call awaits its answer stores the answer and
        # settles nothing (a commit that told it so, then rolled back, leaves it so).
        awaiting = mem.store.tool_log.awaiting  # type: ignore[union-attr]
        awaiting.possible = False
        append_each(mem, "s", [answer("w1", FAILED)], "ann")
        await mem.flush()
        assert rows(db)["w1"][:2] == (1, 1)  # still awaiting
        awaiting.possible = True
        mem.sync_turn("", "", session_id="s", user_id="ann", messages=[
            user("try the tests"),
            calling(call("b1", "terminal", command="pytest"),
                    call("b2", "terminal", command="ls")),
            answer("b1", {"output": "", "exit_code": 2}),
            answer("b2", {"output": "a b", "exit_code": 0, "duration_ms": 7}),
            reply()])
        await mem.flush()
    got = logged(db)  # (tool, arguments, result, ok, awaiting, type, message, ms, goal, ...)
    assert {cid: got[("s", cid)][3:8] for cid in ("w1", "b1", "b2")} == {
        "w1": (0, 0, "FileNotFoundError", FAILED["error"], 12.0),
        "b1": (0, 0, "exit_code", "exit code 2", None),
        "b2": (1, 0, None, None, 7.0),
    }
