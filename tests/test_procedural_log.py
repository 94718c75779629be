"""The tool-call log (procedural memory) on a real store file: every tool call of a committed
turn logged once, judged by the stated rules, fixes found with their argument delta, the
per-user bound, and the query API."""

from __future__ import annotations

import gc
import json
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from hermes_async_memory import ConfigurationError, MemoryPipeline, Settings
from hermes_async_memory.procedural.extract import OutcomeRules, calls_in, judge

from .test_outbox import run_child_until


def call(cid: str, name: str, **args: Any) -> dict[str, Any]:
    return {"id": cid, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def turn(goal: str, calls: list[dict[str, Any]], answers: dict[str, Any], reply: str = "ok"
         ) -> list[dict[str, Any]]:
    """A Hermes turn: the user's goal, the assistant's tool calls, the tools' answers."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": goal},
                                  {"role": "assistant", "content": "", "tool_calls": calls}]
    for cid, content in answers.items():
        msgs.append({"role": "tool", "tool_call_id": cid,
                     "content": content if isinstance(content, str) else json.dumps(content)})
    msgs.append({"role": "assistant", "content": reply})
    return msgs


# A recorded session: a file read fails on a typo and is fixed; a command fails with an exit
# code and is fixed by another command; a search raises and is never fixed; one call is
# never answered.
SESSION = [
    turn("open the entry point", [call("a1", "read_file", path="src/mian.py")],
         {"a1": {"error": "FileNotFoundError: [Errno 2] No such file or directory: "
                          "'src/mian.py'"}}),
    turn("open the entry point", [call("a2", "read_file", path="src/main.py")],
         {"a2": {"content": "def main(): ..."}}),
    turn("run the tests", [call("b1", "terminal", command="pytest tests", timeout=60)],
         {"b1": {"output": "ERROR: file not found: tests", "exit_code": 4,
                 "duration_ms": 812}}),
    turn("run the tests", [call("b2", "terminal", command="python -m pytest -q")],
         {"b2": {"output": "12 passed", "exit_code": 0, "duration_ms": 2400}}),
    turn("find the docs", [call("c1", "web_search", query="hermes memory docs")],
         {"c1": "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
                "TimeoutError: search timed out"}),
    turn("read the readme", [call("d1", "read_file", path="README.md"),
                             call("d2", "read_file", path="CHANGES.md")],
         {"d1": {"content": "# hermes"}}),
]


async def write(mem: MemoryPipeline, turns: list[list[dict[str, Any]]], *,
                session: str = "s1", user: str | None = "ann") -> None:
    for msgs in turns:
        mem.sync_turn(msgs[0]["content"], msgs[-1]["content"], session_id=session,
                      user_id=user, messages=msgs)
    await mem.flush()


async def test_every_call_is_logged_with_its_outcome_goal_and_duration(tmp_path: Path) -> None:
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db", max_wait_ms=0)) as mem:
        await write(mem, SESSION)
        calls = {c.call_id: c for c in await mem.procedural.search("ann", limit=50)}
    assert set(calls) == {"a1", "a2", "b1", "b2", "c1", "d1", "d2"}
    assert (calls["a1"].ok, calls["a1"].error_type) == (False, "FileNotFoundError")
    assert calls["a1"].arguments == {"path": "src/mian.py"}
    assert calls["a1"].goal == "open the entry point"
    assert (calls["b1"].ok, calls["b1"].error_type) == (False, "exit_code")
    assert "exit code 4" in (calls["b1"].error_message or "")
    assert calls["b1"].duration_ms == 812 and calls["b2"].duration_ms == 2400
    assert (calls["c1"].ok, calls["c1"].error_type) == (False, "TimeoutError")
    assert calls["c1"].error_message == "TimeoutError: search timed out"
    assert (calls["d2"].ok, calls["d2"].error_type) == (False, "no_result")
    assert calls["a2"].ok and calls["b2"].ok and calls["d1"].ok
    assert calls["a2"].result.startswith('{"content"')


async def test_a_fix_is_found_with_its_argument_delta(tmp_path: Path) -> None:
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db")) as mem:
        # One turn at a time and all at once: both commit orders must find the same fixes.
        await write(mem, SESSION, session="one-by-one", user="ann")
        await write(mem, SESSION, session="s2", user="bob")
        for user in ("ann", "bob"):
            [read_fix] = await mem.procedural.fix_for(user, "FileNotFoundError")
            assert read_fix.failed.arguments == {"path": "src/mian.py"}
            assert read_fix.fixed.arguments == {"path": "src/main.py"}
            assert dict(read_fix.delta.changed) == {"path": ("src/mian.py", "src/main.py")}
            [cmd_fix] = await mem.procedural.fix_for(user, "exit_code", tool="terminal")
            assert dict(cmd_fix.delta.changed) == {
                "command": ("pytest tests", "python -m pytest -q")}
            assert dict(cmd_fix.delta.removed) == {"timeout": 60}
            assert await mem.procedural.fix_for(user, "TimeoutError") == []  # never fixed
            # The text of an error finds it too.
            [by_text] = await mem.procedural.fix_for(user, "No such file")
            assert by_text.fixed.call_id == "a2"
            # The failure knows what fixed it; the fix knows what it fixed, and its delta.
            [failed] = await mem.procedural.search(user, tool="read_file", ok=False,
                                                   text="mian")
            assert failed.fixed_by == read_fix.fixed.id
            [fixing] = await mem.procedural.search(user, text="src/main.py")
            assert fixing.fixes == failed.id and fixing.delta == read_fix.delta


async def test_no_fix_for_the_same_arguments_other_users_or_outside_the_window(
        tmp_path: Path) -> None:
    retry = [turn("open", [call("x1", "read_file", path="a.py")], {"x1": {"error": "busy"}}),
             turn("open", [call("x2", "read_file", path="a.py")], {"x2": {"content": "ok"}})]
    other_user = [turn("open", [call("y1", "read_file", path="b.py")],
                       {"y1": {"content": "ok"}})]
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db")) as mem:
        await write(mem, retry, user="ann")  # same arguments: a retry, not a fix
        await write(mem, [turn("open", [call("z1", "read_file", path="c.py")],
                               {"z1": {"error": "nope"}})], user="cy")
        await write(mem, other_user, user="dan")  # dan's success fixes nothing of cy's
        assert await mem.procedural.fix_for("ann", "error") == []
        assert await mem.procedural.fix_for("cy", "error") == []
    async with MemoryPipeline(Settings(db_path=tmp_path / "w.db", tool_fix_window_s=0)) as mem:
        await write(mem, SESSION[:2])
        assert await mem.procedural.fix_for("ann", "FileNotFoundError") == []


async def test_stats_error_patterns_and_success_hints(tmp_path: Path) -> None:
    reads = [turn("open the config", [call(f"r{i}", "read_file", path="conf.toml",
                                          encoding="utf-8")], {f"r{i}": {"content": "x"}})
             for i in range(3)]
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db")) as mem:
        await write(mem, SESSION + reads)
        stats = {s.tool: s for s in await mem.procedural.stats("ann")}
        read = stats["read_file"]
        assert (read.calls, read.successes, read.failures) == (7, 5, 2)
        assert read.success_rate == pytest.approx(5 / 7)
        # Equally frequent: the latest first.
        assert [e.error_type for e in read.errors] == ["no_result", "FileNotFoundError"]
        missing = read.errors[1]
        assert missing.count == 1 and "src/mian.py" in missing.message
        assert missing.typical_fix is not None
        assert dict(missing.typical_fix.changed) == {"path": ("src/mian.py", "src/main.py")}
        assert read.hints[0].arguments == {"path": "conf.toml", "encoding": "utf-8"}
        assert stats["terminal"].avg_duration_ms == pytest.approx((812 + 2400) / 2)
        assert next(iter(stats)) == "read_file"  # most called first
        [hint] = await mem.procedural.arguments_for("ann", "open the config file",
                                                    tool="read_file")
        assert hint.arguments == {"path": "conf.toml", "encoding": "utf-8"}
        assert hint.count == 3
        assert await mem.procedural.stats("nobody") == []


async def test_outcome_rules_are_settings(tmp_path: Path) -> None:
    rules = OutcomeRules(status_keys=("outcome",), failure_statuses=("bad",),
                         exit_code_keys=())
    msgs = turn("go", [call("k1", "deploy", env="prod"), call("k2", "deploy", env="dev")],
                {"k1": {"outcome": "bad", "why": "no quota"},
                 "k2": {"exit_code": 3}})
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db",
                                       tool_outcome_rules=rules)) as mem:
        await write(mem, [msgs])
        got = {c.call_id: c.ok for c in await mem.procedural.search("ann")}
    assert got == {"k1": False, "k2": True}  # exit codes are not a rule here
    assert [c.outcome.ok for c in calls_in(msgs)] == [True, False]  # the default rules



async def test_a_pattern_of_ones_own_without_a_type_group_judges_failures(
        tmp_path: Path) -> None:
    """A user's exception pattern need not name a group "type": a matching answer is a
    failure (its type read from the text, else "exception"). Before, every match raised
    inside the judge and was logged as a success."""
    rules = OutcomeRules(exception_pattern=r"(?m)^FATAL\b")
    msgs = turn("back up", [call("f1", "backup", disk="a"), call("f2", "backup", disk="b")],
                {"f1": "FATAL disk full", "f2": "copied 3 files"})
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db",
                                       tool_outcome_rules=rules)) as mem:
        await write(mem, [msgs])
        got = {c.call_id: (c.ok, c.error_type) for c in await mem.procedural.search("ann")}
    assert got == {"f1": (False, "exception"), "f2": (True, None)}



async def test_an_answer_a_rule_raises_on_is_logged_and_counted_not_lost(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in judging (a fault no input here can cause: a mock) costs neither the turn nor
    its calls: the call is logged as a success, the other answers are judged as usual, and
    stats() counts the error."""
    import hermes_async_memory.store.tool_log as tool_log

    real = tool_log.judge

    def judge(content: Any, rules: OutcomeRules) -> Any:
        if "BOOM" in str(content):
            raise RuntimeError("a bug in a rule")
        return real(content, rules)

    monkeypatch.setattr(tool_log, "judge", judge)
    msgs = turn("tidy up", [call("b1", "clean", path="a"), call("b2", "clean", path="b")],
                {"b1": "BOOM", "b2": {"error": "PermissionError: denied"}})
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db")) as mem:
        assert mem.stats().tool_judge_errors == 0
        await write(mem, [msgs])
        got = {c.call_id: c.ok for c in await mem.procedural.search("ann")}
        assert mem.stats().tool_judge_errors == 1
        assert len(await mem.get_messages("s1")) == len(msgs)
    assert got == {"b1": True, "b2": False}

@pytest.mark.parametrize(("rules", "field"), [
    (OutcomeRules(exception_pattern="(unclosed"), "exception_pattern"),
    (OutcomeRules(status_keys="status"), "status_keys"),  # type: ignore[arg-type]
    (OutcomeRules(error_keys=("error", 3)), "error_keys"),  # type: ignore[arg-type]
])
def test_outcome_rules_that_cannot_judge_are_refused_at_settings(
        tmp_path: Path, rules: OutcomeRules, field: str) -> None:
    """A pattern that does not compile, or a key list given as one string (read letter by
    letter), is a typed error when the settings are made, naming the field."""
    with pytest.raises(ConfigurationError, match=f"tool_outcome_rules.{field}"):
        Settings(db_path=tmp_path / "m.db", tool_outcome_rules=rules)


def test_default_rules_each_kind_of_answer() -> None:
    assert judge('{"status": "failed", "message": "x"}').ok is False
    assert judge('{"status": "ok", "error": "ignored when the status says ok"}').ok is True
    assert judge('{"success": false}').ok is False
    assert judge('{"error": {"type": "QuotaError", "message": "over"}}').error_type == (
        "QuotaError")
    assert judge('{"error": null, "output": "fine", "exit_code": 0}').ok is True
    assert judge("ValueError: bad literal").error_type == "ValueError"
    assert judge("all good, no Error: here").ok is True  # not at a line start
    assert judge("").ok is True
    hermes = judge('{"error": "File not found: notes.txt", "similar_files": ["notes.md"]}')
    assert (hermes.ok, hermes.error_type) == (False, "File not found")
    assert judge('{"error": "/tmp/x: gone"}').error_type == "error"  # a path is no type
    inside = judge(json.dumps({"output": "Traceback (most recent call last):\n  File \"a\"\n"
                                         "KeyError: 'x'"}))
    assert (inside.ok, inside.error_type) == (False, "KeyError")


def test_a_judged_turns_answers_leave_the_collectors_walks() -> None:
    """The writer holds thousands of judged tool turns in flight, and every collection on
    the event loop walks what the collector tracks: a turn's answers, with their outcomes,
    are plain tuples of plain values, which the collector lets go of once it has seen them
    (outcomes were lists, each tracked for as long as it lived, as was the pair the batch
    kept of each)."""
    from hermes_async_memory.message_rows import turn_messages
    from hermes_async_memory.store.tool_log import outcome_row
    from hermes_async_memory.turns import Turn

    messages = [
        {"role": "user", "content": "read the notes"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{i}", "type": "function",
             "function": {"name": "read_file", "arguments": json.dumps({"path": f"n{i}"})}}
            for i in range(3)]},
        {"role": "tool", "tool_call_id": "c0", "content": '{"output": "notes", "exit_code": 0}'},
        {"role": "tool", "tool_call_id": "c1", "content": "FileNotFoundError: n1"},
        {"role": "tool", "tool_call_id": "c2",
         "content": '{"output": "", "error": "timed out", "duration_ms": 812.5}'},
        {"role": "assistant", "content": "done"},
    ]
    turn = Turn.build(key="k", session_id="s", user_id="u", accepted_at=1.0,
                      messages=turn_messages("read the notes", "done", messages), metadata=None)
    rules = OutcomeRules()
    judged = turn.with_outcomes(lambda content: outcome_row(content, rules))
    for _ in range(3):  # a tuple is let go once all it holds is: a level a collection at worst
        gc.collect()

    assert [(i, o) for i, _, o in judged.answers] == [
        (2, None), (3, (0, "FileNotFoundError", "FileNotFoundError: n1", None)),
        (4, (0, "error", "timed out", 812.5))]
    assert not gc.is_tracked(judged.answers)


async def test_malformed_tool_calls_never_fail_the_turns_commit(tmp_path: Path) -> None:
    odd: list[dict[str, Any]] = [
        {"role": "user", "content": "odd"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "n1", "type": "function", "function": {"name": "t", "arguments": "not json"}},
            {"id": "n2", "type": "function", "function": {"arguments": "{}"}},  # no name
            {"id": "n3", "type": "function", "function": {"name": "t", "arguments": None}},
            "a string", 7]},
        {"role": "tool", "tool_call_id": "n1", "content": None},
        {"role": "tool", "tool_call_id": "n3", "content": "x" * 5000},
        {"role": "assistant", "content": "done"}]
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db")) as mem:
        await write(mem, [odd, SESSION[0]])
        calls = {c.call_id: c for c in await mem.procedural.search("ann")}
        assert mem.stats().dead_letters == 0
        assert await mem.sessions.counts() is not None
    assert set(calls) == {"n1", "n3", "a1"}
    assert calls["n1"].arguments == "not json" and calls["n3"].arguments == {}
    assert len(calls["n3"].result) == 500


@pytest.mark.parametrize("reported", ['"duration_s": 1e308', '"duration_ms": 1e999',
                                      '"elapsed": 1e400'])
async def test_a_duration_past_a_floats_range_never_fails_the_turns_commit(
        tmp_path: Path, reported: str) -> None:
    """An answer that reports an infinite duration (or one that overflows in milliseconds)
    is logged without one: its turn was dead-lettered ("malformed JSON") before."""
    msgs = turn("time it", [call("t1", "terminal", command="sleep 1")], {})
    msgs.insert(2, {"role": "tool", "tool_call_id": "t1",
                    "content": '{"output": "done", "exit_code": 0, ' + reported + "}"})
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db")) as mem:
        await write(mem, [msgs])
        assert mem.stats().dead_letters == 0
        (logged,) = await mem.procedural.search("ann")
        assert len(await mem.sessions.messages("s1")) == 4
    assert (logged.call_id, logged.ok, logged.duration_ms) == ("t1", True, None)


async def test_each_users_log_is_bounded_oldest_first(tmp_path: Path) -> None:
    turns = [turn(f"step {i}", [call(f"c{i}", "terminal", command=f"echo {i}")],
                  {f"c{i}": {"exit_code": 0}}) for i in range(60)]
    settings = Settings(db_path=tmp_path / "m.db", tool_log_max_per_user=20, max_batch=7)
    async with MemoryPipeline(settings) as mem:
        await write(mem, turns, user="ann")
        await write(mem, turns[:5], user="bob", session="s2")
        kept = [c.call_id for c in await mem.procedural.search("ann", limit=100)]
        assert 20 <= len(kept) <= 22  # trimmed once past the bound by a tenth
        assert kept == [f"c{i}" for i in range(59, 59 - len(kept), -1)]  # the newest
        assert len(await mem.procedural.search("bob", limit=100)) == 5


async def test_deleting_a_session_deletes_its_calls(tmp_path: Path) -> None:
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db")) as mem:
        await write(mem, SESSION[:2], session="gone")
        await write(mem, SESSION[2:4], session="kept")
        await mem.sessions.delete("gone")
        await mem.flush()
        assert {c.session_id for c in await mem.procedural.search("ann")} == {"kept"}


async def test_sigkill_keeps_every_acknowledged_call_exactly_once(tmp_path: Path) -> None:
    """Invariant: for every acknowledged turn i both its calls are logged, once each, with
    their outcome (c<i>a fails on odd i); no call is logged twice."""
    db = tmp_path / "m.db"
    receipts = run_child_until(db, "tools", acks=1500)
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        await mem.flush()
    rows = sqlite3.connect(db).execute("SELECT call_id, ok, tool FROM tool_calls").fetchall()
    seen = Counter(cid for cid, _, _ in rows)
    assert all(n == 1 for n in seen.values()), "a call was logged twice"
    ok = {cid: bool(flag) for cid, flag, _ in rows}
    for _, _, i in receipts:
        assert ok[f"c{i}a"] is (i % 2 == 0), f"turn {i}: read_file's outcome"
        assert ok[f"c{i}b"] is True, f"turn {i}: terminal lost"
    assert len(rows) <= 2 * (len(receipts) + 1)  # at most the turn the kill fell on besides


async def test_the_next_prefetch_carries_guidance_for_a_tool_that_just_failed(
        tmp_path: Path) -> None:
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db")) as mem:
        await write(mem, SESSION[:2], session="earlier")  # a read_file typo, then its fix
        failing = turn("open the entry point", [call("e1", "read_file", path="src/mian.py")],
                       {"e1": {"error": "FileNotFoundError: [Errno 2] No such file or "
                                        "directory: 'src/mian.py'"}})
        await write(mem, [failing], session="now")
        mem.queue_prefetch("open the entry point", session_id="now", user_id="ann")
        await mem.wait_until(
            lambda: "<procedural" in mem.prefetch("", session_id="now", user_id="ann"),
            timeout=10)
        block = mem.prefetch("", session_id="now", user_id="ann")
        assert "<procedural_guidance" in block and "FileNotFoundError" in block
        assert "src/main.py" in block  # what fixed it before
        assert "<procedural_memory>" in block and "read_file" in block
        settings = Settings().procedural_context
        assert settings is not None
        tail = block[block.index("<procedural_guidance"):]
        assert len(tail) <= settings.budget + 2  # both blocks within the budget
        # Another user's session sees nothing of ann's tools.
        mem.queue_prefetch("open the entry point", session_id="now", user_id="bob")
        await mem.wait_until(
            lambda: mem.prefetch_status("now", user_id="bob").recall_query is not None,
            timeout=10)
        assert "<procedural" not in mem.prefetch("", session_id="now", user_id="bob")


async def test_no_procedural_block_when_it_is_off(tmp_path: Path) -> None:
    settings = Settings(db_path=tmp_path / "m.db", procedural_context=None)
    async with MemoryPipeline(settings) as mem:
        await write(mem, SESSION[:1], session="now")
        mem.queue_prefetch("entry point", session_id="now", user_id="ann")
        await mem.wait_until(
            lambda: mem.prefetch_status("now", user_id="ann").recall_query is not None,
            timeout=10)
        assert "<procedural" not in mem.prefetch("", session_id="now", user_id="ann")
        assert await mem.procedural.search("ann")  # still logged


async def test_an_imported_sessions_calls_are_logged_with_their_fixes(tmp_path: Path) -> None:
    async with MemoryPipeline(Settings(db_path=tmp_path / "a.db")) as mem:
        await write(mem, SESSION, session="moved")
        lines = [line async for line in mem.sessions.export()]
        before = sorted((c.call_id, c.ok, c.fixes is not None)
                        for c in await mem.procedural.search("ann", limit=50))
    async with MemoryPipeline(Settings(db_path=tmp_path / "b.db")) as mem:
        await mem.sessions.import_lines(lines)
        await mem.sessions.import_lines(lines)  # a second import changes nothing
        calls = await mem.procedural.search("ann", limit=50)
        assert sorted((c.call_id, c.ok, c.fixes is not None) for c in calls) == before
        [fix] = await mem.procedural.fix_for("ann", "FileNotFoundError")
        assert dict(fix.delta.changed) == {"path": ("src/mian.py", "src/main.py")}


async def test_a_version_4_stores_calls_are_logged_and_counted_at_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Turns committed before the log existed (schema 4) get their calls logged at the
    upgrade, oldest first and with their fixes, as if they had been logged at commit; the
    sessions' tool call counts (which counted tool messages too) are recounted."""
    from hermes_async_memory.store import schema

    monkeypatch.setattr(schema, "BACKFILL_TURNS", 3)  # several groups, split inside a session
    db = tmp_path / "m.db"
    filler = [turn(f"step {i}", [call(f"e{i}", "terminal", command=f"echo {i}")],
                   {f"e{i}": {"exit_code": 0}}) for i in range(30)]
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        await write(mem, SESSION, session="s1", user="ann")
        await write(mem, filler, session="s2", user="bob")
    with sqlite3.connect(db) as conn:
        conn.executescript("""
            DROP TABLE tool_calls; DROP TABLE tool_log_counts;
            DROP TABLE templates; DROP TABLE template_sessions;
            UPDATE sessions SET tool_call_count = 99;
            UPDATE schema_version SET version = 4;""")
    settings = Settings(db_path=db, tool_log_max_per_user=20)
    async with MemoryPipeline(settings) as mem:
        calls = {c.call_id: c for c in await mem.procedural.search("ann", limit=50)}
        assert set(calls) == {"a1", "a2", "b1", "b2", "c1", "d1", "d2"}
        assert (calls["d2"].ok, calls["d2"].error_type) == (False, "no_result")
        [read_fix] = await mem.procedural.fix_for("ann", "FileNotFoundError")
        assert dict(read_fix.delta.changed) == {"path": ("src/mian.py", "src/main.py")}
        kept = [c.call_id for c in await mem.procedural.search("bob", limit=100)]
        assert kept == [f"e{i}" for i in range(29, 29 - len(kept), -1)]  # the newest
        assert 20 <= len(kept) <= 22
        counts = {s: (await mem.store.get_session(s) or {})["tool_call_count"]
                  for s in ("s1", "s2")}
        assert counts == {"s1": 7, "s2": 30}
        # Logging goes on from there, once per call.
        await write(mem, [turn("again", [call("z1", "read_file", path="x")],
                               {"z1": {"content": "x"}})], session="s1", user="ann")
        assert len(await mem.procedural.search("ann", limit=50)) == 8
    assert sqlite3.connect(db).execute("SELECT version FROM schema_version").fetchone() == (
        schema.SCHEMA_VERSION,)


async def test_a_backlog_read_ahead_is_judged_as_a_single_turn_is(tmp_path: Path) -> None:
    """The writer judges the tool answers of the batch it reads ahead while the last one
    commits, and a batch judges what was not: every call of a long backlog, in many
    batches, gets the outcome its answer gets alone."""
    answers = [{"output": "ok", "exit_code": 0}, {"error": "PermissionError: denied"},
               {"output": "", "exit_code": 3, "duration_ms": 5}, "Traceback (most recent "
               "call last):\n  ...\nKeyError: 'x'", {"status": "timeout"}, "plain text"]
    turns = []
    for n in range(300):
        calls = [call(f"c{n}-{k}", "terminal", command=f"run {n} {k}") for k in range(3)]
        turns.append(turn(f"goal {n}", calls, {
            f"c{n}-{k}": answers[(n + k) % len(answers)] for k in range(3)}))
    db = tmp_path / "m.db"
    async with MemoryPipeline(Settings(db_path=db, max_batch=40, max_wait_ms=0)) as mem:
        for msgs in turns:  # accepted before the writer runs: a backlog of many batches
            mem.sync_turn(msgs[0]["content"], msgs[-1]["content"], session_id="s1",
                          user_id="ann", messages=msgs)
        await mem.flush()
        assert mem.stats().batches_committed >= 300 // 40
    with sqlite3.connect(db) as conn:
        got = {r[0]: tuple(r[1:]) for r in conn.execute(
            "SELECT call_id, ok, error_type, error_message, duration_ms FROM tool_calls")}
    want = {}
    for msgs in turns:
        for m in msgs:
            if m["role"] == "tool":
                o = judge(m["content"])
                want[m["tool_call_id"]] = (int(o.ok), o.error_type, o.error_message,
                                           o.duration_ms)
    assert len(got) == 900 and got == want
