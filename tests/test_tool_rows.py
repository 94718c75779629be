"""The tool log's rows worked out on the event loop (``tool_rows``) against the SQL way
(``tool_log.INSERT_CALLS``): the same turns, committed through two real pipelines, one of
them made to log every call the SQL way, must leave the same log, row for row: ids, fixes,
outcomes, goals, arguments and all. The turns cover every shape the loop works out and
every doubt it hands to SQL."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory import turns as turns_module
from hermes_async_memory.store import batch as batch_module

from .test_procedural_log import SESSION, call

Msgs = list[dict[str, Any]]


def calls_turn(goal: Any, calls: list[Any], answers: list[tuple[str, Any]],
               reply: str = "done") -> Msgs:
    """A turn with ``calls`` as given and the tool messages ``answers`` (call id, content)."""
    msgs: Msgs = [{"role": "user", "content": goal},
                  {"role": "assistant", "content": "", "tool_calls": calls}]
    msgs += [{"role": "tool", "tool_call_id": cid, "name": "t", "content": content}
             for cid, content in answers]
    msgs.append({"role": "assistant", "content": reply})
    return msgs


def fn(name: Any, arguments: Any = "{}", **extra: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}, **extra}


LONG = "lorem ipsum dolor sit amet " * 40  # over the 500 characters a result keeps
# Groups of turns, each group committed as one batch: (session, user, turns).
WHOLE: list[tuple[str, str | None, list[Msgs]]] = [
    ("s-fix", "ann", SESSION[:5]),  # failures, fixes, durations, every outcome kind
    ("s-odd", "ann", [
        # no id ('#n'), a duplicate id in one message (the first is logged), no name, not
        # objects, arguments absent, null, not JSON, JSON with spaces (minified), quotes
        calls_turn("it's odd", [
            fn("read_file"), fn("read_file", '{"path":  "a.py" }', id="dup"),
            fn("write_file", id="dup"), {"type": "function", "function": {"arguments": "{}"}},
            "a string", 7, {"id": "noargs", "type": "function", "function": {"name": "t"}},
            fn("t", None, id="nullargs"), fn("t", "not json ' quoted", id="bad"),
            fn("t's", "[1, 2.50, 1e3, \"x\"]", id="q'uote")],
            [("#0", '{"output": "zero"}'), ("dup", None), ("noargs", LONG),
             ("nullargs", '{"error": "PermissionError: denied"}'), ("bad", "ok"),
             ("q'uote", "it's fine"), ("dup", "a second answer, not the first")]),
        # text past ASCII everywhere, a goal past 500 characters, a user without content
        calls_turn("ünïcödé 😀 " + LONG, [fn("搜索", '{"q": "日本語 😀"}', id="u1")],
                   [("u1", '{"output": "résultat 😀", "duration_s": 1.25}')]),
        calls_turn(None, [fn("t", id="nogoal")], [("nogoal", "ok")]),
        # two user messages: the goal is the first
        [*calls_turn("the first", [fn("t", id="twice")], [("twice", "ok")])[:3],
         {"role": "user", "content": "the second"}, {"role": "assistant", "content": "ok"}],
    ]),
    ("s-nouser", None, [  # a turn without a user: fixes within the session
        calls_turn("go", [fn("run", '{"a": 1}', id="f1")], [("f1", '{"exit_code": 1}')]),
        calls_turn("go", [fn("run", '{"a": 2}', id="f2")], [("f2", '{"exit_code": 0}')]),
    ]),
    ("s-stamped", "bob", [  # messages with their own time
        [{"role": "user", "content": "when", "timestamp": 1_700_000_000.5},
         {"role": "assistant", "content": "", "timestamp": 1_700_000_001.25,
          "tool_calls": [call("st1", "clock")]},
         {"role": "tool", "tool_call_id": "st1", "content": "noon",
          "timestamp": 1_700_000_002},
         {"role": "assistant", "content": "noon"}],
    ]),
    # U+0000 in texts (their columns hold a U+FFFD copy, and so do the goal and the result),
    # or the six characters \\u0000: the batch binds its messages one by one and runs its
    # statements one at a time, cut at each ';' outside a literal (arguments hold many)
    ("s-nul", "ann", [calls_turn("x\x00y", [call("z", "t")], [("z", "ok\x00")])]),
    ("s-escaped-nul", "ann", [calls_turn('printf("\\u0000")',
                                         [fn("sh", '{"c": "cd a; ls; make"}', id="e")],
                                         [("e", "ok; done")])]),
]
# Batches the loop cannot work out; each is logged the SQL way, whole.
DOUBTFUL: list[tuple[str, str | None, list[Msgs]]] = [
    ("s-late", "ann", [SESSION[5]]),  # a call never answered in its record
    ("s-int-id", "ann", [calls_turn("x", [fn("t", id=5)], [("5", "ok")])]),
    ("s-dict-args", "ann", [calls_turn("x", [fn("t", {"k": 1.5}, id="d")], [("d", "ok")])]),
    ("s-answer-before", "ann", [  # an answer before its call is not its answer
        [{"role": "user", "content": "x"},
         {"role": "tool", "tool_call_id": "early", "content": "too soon"},
         {"role": "assistant", "content": "", "tool_calls": [call("early", "t")]},
         {"role": "assistant", "content": "never mind"}]]),
    ("s-no-user", "ann", [  # no user message in the record: the goal is the session's last
        [{"role": "assistant", "content": "", "tool_calls": [call("nu", "t")]},
         {"role": "tool", "tool_call_id": "nu", "content": "ok"}]]),
    # a tool whose name holds U+0000, which no SQL literal can
    ("s-nul-name", "ann", [calls_turn("x", [fn("t\x00", id="zn")], [("zn", "ok")])]),
    ("s-wait", "ann", [  # a call left awaiting its answer: later batches settle it
        [{"role": "user", "content": "wait"},
         {"role": "assistant", "content": "", "tool_calls": [call("w1", "t")]}]]),
]
# A whole turn whose user message closes the awaiting call (never answered), committed while
# the store holds an awaiting call: worked out on the loop beside the settling.
SETTLING = ("s-wait", "ann", [calls_turn("again", [call("w2", "t")],
                                         [("w1", "late"), ("w2", "ok")])])
WHOLE_SESSIONS = {"s-fix", "s-odd", "s-nouser", "s-stamped", "s-nul", "s-escaped-nul"}


async def commit_all(path: Path) -> None:
    async with MemoryPipeline(Settings(db_path=path, tool_fix_window_s=1e9)) as mem:
        for groups in (WHOLE, DOUBTFUL, [*WHOLE[:1], SETTLING]):
            for sid, user, turns in groups:
                for msgs in turns:
                    first_user = next((m["content"] for m in msgs if m["role"] == "user"), "")
                    mem.sync_turn(first_user if isinstance(first_user, str) else "",
                                  msgs[-1].get("content") or "", session_id=sid, user_id=user,
                                  messages=msgs)
                await mem.flush()
        assert mem.stats().dead_letters == 0


def log_of(path: Path) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """Every column of every logged call but its time, in id order; and each call's time
    beside its message's."""
    conn = sqlite3.connect(path)
    try:
        columns = [r[1] for r in conn.execute("PRAGMA table_info(tool_calls)") if r[1] != "at"]
        rows = conn.execute(f"SELECT {', '.join(columns)} FROM tool_calls ORDER BY id").fetchall()
        times = conn.execute("SELECT c.at, m.timestamp FROM tool_calls AS c "
                             "JOIN messages AS m ON m.id = c.message_id").fetchall()
        return rows, times
    finally:
        conn.close()


async def test_the_loops_rows_are_the_sql_ways_row_for_row(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The rows the loop worked out, as the commits hand them to SQLite (LOG_ROWS' VALUES).
    worked_out: list[str] = []
    statements = batch_module.Batch.statements

    def recording(self: batch_module.Batch, **kwargs: Any) -> list[str]:
        script = statements(self, **kwargs)
        worked_out.extend(text.split("VALUES ", 1)[1].split(";\nINSERT INTO tool_calls")[0]
                          for text in script if "INSERT INTO temp.tool_rows" in text)
        return script

    monkeypatch.setattr(batch_module.Batch, "statements", recording)
    await commit_all(tmp_path / "loop.db")
    # Every batch the SQL way: the values are worked out as a turn's answers are judged
    # (turns.Turn.with_outcomes), or as its batch is built when its ids were not known then.
    for module in (turns_module, batch_module):
        monkeypatch.setattr(module, "values", lambda *args: None)
    worked_out_before = len(worked_out)
    await commit_all(tmp_path / "sql.db")
    assert len(worked_out) == worked_out_before

    loop_rows, loop_times = log_of(tmp_path / "loop.db")
    sql_rows, sql_times = log_of(tmp_path / "sql.db")
    assert loop_rows == sql_rows
    # Every call of the whole turns' batches was worked out on the loop, none of the others.
    on_loop = sum(r.count("),(") + 1 for r in worked_out)
    # (One more: the second call of one message with the same id, inserted and ignored.)
    assert on_loop == 1 + sum(1 for r in loop_rows if r[3] in WHOLE_SESSIONS or r[2] == "w2")
    assert on_loop < len(loop_rows)
    settled = {r[2]: r[8:10] for r in loop_rows if r[3] == "s-wait"}
    assert settled == {"w1": (0, "no_result"), "w2": (1, None)}
    for times in (loop_times, sql_times):
        assert times and all(at == stamp for at, stamp in times)
    by_call = {r[2]: r for r in loop_rows}  # call_id is the third column
    assert by_call["#0"][5:7] == ("read_file", "{}")
    assert by_call["dup"][5:7] == ("read_file", '{"path":"a.py"}')
    assert by_call["q'uote"][5:7] == ("t's", '[1,2.50,1e3,"x"]')
    assert json.loads(by_call["bad"][6]) == "not json ' quoted"
    assert by_call["u1"][12] == ("ünïcödé 😀 " + LONG)[:500]
    assert by_call["twice"][12] == "the first"


def test_the_plan_is_left_to_sql_where_the_record_leaves_a_doubt() -> None:
    from hermes_async_memory.tool_rows import read_calls

    rows = [["user", "g", None, None, None, None, None, None],
            ["assistant", "", "[]", None, None, None, None, None]]
    assert read_calls(rows, [(1, "[]")]) == (0, (0, ()))
    # NaN reads in Python, not in SQLite: counted, left to SQL.
    nan = '[{"id": "a", "function": {"name": "t", "arguments": NaN}}]'
    assert read_calls(rows, [(1, nan)]) == (1, False)
    # Not a list: SQLite would walk an object's members.
    assert read_calls(rows, [(1, '{"id": "a"}')]) == (0, False)
    # A call id that is not text, in a record no version writes: left to SQL, not raised.
    odd = [*rows, ["tool", "ok", None, ["a"], None, None, None, None]]
    assert read_calls(odd, [(1, '[{"id": "a", "function": {"name": "t"}}]')]) == (1, False)
