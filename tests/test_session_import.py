"""Importing sessions (issue: an import that reported success had stored nothing).

Every line is checked before any record is accepted; a session's parent that is itself,
missing or closing a cycle is dropped and said so; once committed, the store is read back
and what it lacks is an error that names the sessions; every column and every message comes
back as exported, NUL and lone surrogates included; limits are named; an import cut short is
finished by importing the same lines again."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from hermes_async_memory import MemoryPipeline, Settings, cli
from hermes_async_memory.errors import ConfigurationError, QueueFullError
from hermes_async_memory.ops import (
    IMPORTED_ROW_COLUMNS,
    encode_session_op,
    parse_session_record,
)
from hermes_async_memory.sessions import (
    ImportIncompleteError,
    ImportLimitError,
    ImportLimits,
    ImportResult,
    InvalidImportError,
)
from hermes_async_memory.store.schema import SESSION_COLUMNS

Message = dict[str, Any]


def call(cid: str, name: str, **args: object) -> Message:
    return {"id": cid, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


async def export(mem: MemoryPipeline, **kw: str) -> list[str]:
    return [line async for line in mem.sessions.export(**kw)]


async def delete_all(mem: MemoryPipeline) -> None:
    for line in await export(mem):
        mem.sessions.delete_nowait(json.loads(line)["id"])
    await mem.flush()
    assert await export(mem) == []


def sql(db: Path, statement: str, *params: object) -> list[tuple[Any, ...]]:
    with sqlite3.connect(db) as conn:
        return conn.execute(statement, params).fetchall()


def raw_messages(db: Path, sid: str) -> list[tuple[Any, ...]]:
    """A session's message rows as stored, every column but the ids and the time of commit."""
    return sql(db, "SELECT turn_key, ordinal, role, content, tool_calls, tool_call_id, "
                   "tool_name, timestamp, user_id, scope, metadata, token_count, fields, "
                   "active FROM messages WHERE session_id = ? ORDER BY id", sid)


def line_of(sid: str, *, started: float = 1000.0, messages: list[Message] | None = None,
            **row: object) -> str:
    """A hand-made export line (an earlier version's shape: no ``message`` needed)."""
    return json.dumps({"id": sid, "source": "cli", "started_at": started,
                       "updated_at": started, **row, "messages": messages or []}) + "\n"


def plain(i: int, turn: str, role: str = "user", text: str = "hi") -> Message:
    return {"id": i, "turn_key": turn, "role": role, "content": text, "timestamp": 1000.0 + i}


# -- 1. NUL and lone surrogates, anywhere a message may hold them ----------------------------

ODD_TEXT: dict[str, dict[str, Any]] = {
    "NUL in content": {"messages": [{"role": "user", "content": "a\x00b"},
                                    {"role": "assistant", "content": "ok"}]},
    "NUL in metadata": {"metadata": {"note": "a\x00b", "deep": ["\x00"]}},
    "NUL in tool-call arguments": {"messages": [
        {"role": "user", "content": "run it"},
        {"role": "assistant", "content": "", "tool_calls": [call("c1", "sh", cmd="a\x00b")]},
        {"role": "tool", "tool_call_id": "c1", "content": "done"}]},
    "NUL in fields": {"messages": [
        {"role": "assistant", "content": "x", "reasoning": "r\x00s", "custom": {"k": "\x00"}},
        {"role": "tool", "tool_call_id": "c\x00d", "name": "n\x00m", "content": "y"}]},
    "lone surrogate in content": {"messages": [{"role": "user", "content": "a\ud800b"}]},
    "lone surrogate in metadata": {"metadata": {"note": "a\udfffb"}},
    "lone surrogate in fields": {"messages": [
        {"role": "assistant", "content": "x", "reasoning": "\ud800", "\udc00key": 1}]},
}


@pytest.mark.parametrize("case", list(ODD_TEXT))
async def test_nul_and_lone_surrogates_import_and_read_back_exactly(
        tmp_path: Path, case: str) -> None:
    kw = ODD_TEXT[case]
    async with MemoryPipeline(Settings(db_path=tmp_path / "a.db")) as a:
        a.sync_turn("q", "a", session_id="s", user_id="ann", **kw)
        await a.flush()
        given = await a.get_messages("s")
        lines = await export(a)
        stored = raw_messages(a.settings.db_path, "s")
    for line in lines:
        line.encode("utf-8")  # a line is UTF-8 text, whatever the messages hold
    # Into another store, and into the same one after a delete.
    async with MemoryPipeline(Settings(db_path=tmp_path / "b.db")) as b:
        result = await b.sessions.import_lines(lines)
        assert result == ImportResult(imported=1, skipped=0, messages=len(given))
        got = await b.get_messages("s")
        assert [m["message"] for m in got] == [m["message"] for m in given]
        assert [m["metadata"] for m in got] == [m["metadata"] for m in given]
        assert await export(b) == lines
        assert b.stats().dead_letters == 0
        # Normalized as on the accept path: the same columns, the same fields.
        assert raw_messages(b.settings.db_path, "s") == stored
    async with MemoryPipeline(Settings(db_path=tmp_path / "a.db")) as a:
        await delete_all(a)
        assert (await a.sessions.import_lines(lines)).messages == len(given)
        assert await export(a) == lines


# -- 2. a count reported is a count stored ---------------------------------------------------


@pytest.fixture
async def two_sessions(tmp_path: Path) -> list[str]:
    async with MemoryPipeline(Settings(db_path=tmp_path / "source.db")) as src:
        for i in range(2):
            src.sync_turn(f"fine {i}", "ok", session_id="fine", user_id="ann")
        src.sync_turn("doomed words", "ok", session_id="doomed", user_id="ann")
        await src.flush()
        return await export(src)


async def test_a_dead_lettered_import_is_an_error_naming_its_session(
        mem: MemoryPipeline, two_sessions: list[str]) -> None:
    db = mem.settings.db_path
    sql(db, "CREATE TRIGGER refuse BEFORE INSERT ON messages WHEN NEW.session_id = 'doomed' "
            "BEGIN SELECT RAISE(ABORT, 'refused by the test'); END")
    with pytest.raises(ImportIncompleteError, match="doomed") as caught:
        await mem.sessions.import_lines(two_sessions)
    err = caught.value
    assert list(err.sessions) == ["doomed"]
    assert err.sessions["doomed"].startswith("dead-lettered:")
    assert "refused by the test" in err.sessions["doomed"]
    assert err.result == ImportResult(imported=1, skipped=0, messages=4)  # what is stored
    assert [json.loads(line)["id"] for line in await export(mem)] == ["fine"]
    assert await export(mem, session_id="fine") == two_sessions[:1]


async def test_a_session_stored_meanwhile_under_another_start_is_an_error(
        mem: MemoryPipeline, two_sessions: list[str]) -> None:
    """The row goes in, and changes before the messages do: what a session of that id that
    another process stored between the check and the commit does to the import."""
    sql(mem.settings.db_path,
        "CREATE TRIGGER restart AFTER INSERT ON sessions WHEN NEW.id = 'doomed' "
        "BEGIN UPDATE sessions SET started_at = NEW.started_at + 1 WHERE id = NEW.id; END")
    with pytest.raises(ImportIncompleteError, match="another start") as caught:
        await mem.sessions.import_lines(two_sessions)
    assert list(caught.value.sessions) == ["doomed"]
    assert caught.value.result == ImportResult(imported=1, skipped=0, messages=4)
    assert await mem.get_messages("doomed") == []


# -- 3. all lines or none ----------------------------------------------------------------------

GOOD = [line_of("g1", messages=[plain(1, "t1")]), line_of("g2", messages=[plain(2, "t2")])]
BAD: dict[str, tuple[str, str]] = {
    "not JSON": ("{", "not JSON"),
    "not an object": ("[1]", "not a JSON object"),
    "bad id": (line_of(""), "id must be"),
    "bad user": (line_of("s", user_id="u\x00"), "user_id holds a NUL"),
    "mistyped column": (line_of("s", message_count="3"), "message_count must be an integer"),
    "null in a column that cannot be": (line_of("s", api_call_count=None), "cannot be null"),
    "unknown column": (line_of("s", colour="red"), "'colour' is not a column"),
    "infinite cost": ('{"id": "s", "started_at": 1, "estimated_cost_usd": Infinity, '
                      '"messages": []}', "estimated_cost_usd must be a number"),
    "model_config not JSON": (line_of("s", model_config="{temperature"),
                              "model_config is not JSON"),
    "model_config not an object": (line_of("s", model_config="[1, 2]"),
                                   "model_config must be a mapping"),
    "model_config with NaN": (line_of("s", model_config='{"t": NaN}'),
                              "model_config is not storable JSON"),
    "model_config with NUL": (line_of("s", model_config='{"t": "\\u0000"}'),
                              "model_config holds a NUL"),
    "session text with NUL": (line_of("s", title="a\x00b"), "title holds a NUL"),
    "session text with a lone surrogate": (line_of("s", end_reason="\ud800"),
                                           "end_reason holds a lone surrogate"),
    "bad message id": (line_of("s", messages=[{**plain(1, "t"), "id": 2**63}]),
                       "id must be a positive integer"),
    "bad turn key": (line_of("s", messages=[plain(1, "")]), "turn_key must be"),
    "infinite timestamp": (line_of("s", messages=[{**plain(1, "t"), "timestamp": 1e400}]),
                           "timestamp must be a number"),
    "bad active flag": (line_of("s", messages=[{**plain(1, "t"), "active": 2}]),
                        "active must be 0 or 1"),
    "message without a role": (line_of("s", messages=[{**plain(1, "t"), "message": {}}]),
                               "has no role"),
    "message with another role": (
        line_of("s", messages=[{**plain(1, "t"), "message": {"role": "tool"}}]),
        "its message's role is not"),
    "duplicate session": (GOOD[0], "session 'g1' is on line 1 too"),
}


@pytest.mark.parametrize("case", list(BAD))
async def test_a_bad_line_refuses_the_whole_import_and_nothing_is_accepted(
        mem: MemoryPipeline, case: str) -> None:
    bad, why = BAD[case]
    with pytest.raises(InvalidImportError, match=why) as caught:
        await mem.sessions.import_lines([*GOOD, "\n", bad, line_of("after")])
    assert caught.value.line == 4 and str(caught.value).startswith("line 4")
    assert mem.stats().accepted_turns == 0  # not one record, not even the good lines'
    await mem.flush()
    assert await export(mem) == []


async def test_a_file_that_is_not_utf8_is_refused_whole(
        mem: MemoryPipeline, tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes("".join(GOOD).encode() + b'{"id": "\xff"}\n')
    with path.open(encoding="utf-8") as f, pytest.raises(InvalidImportError,
                                                          match="not UTF-8") as caught:
        await mem.sessions.import_lines(f)
    assert caught.value.line is None  # a text stream decodes ahead of its lines
    assert mem.stats().accepted_turns == 0
    await mem.aclose()
    refused = await run_cli("sessions", "import", str(path), "--db", str(mem.settings.db_path))
    assert refused.code == 2 and "line 3: not UTF-8 text" in refused.err  # the CLI reads bytes
    assert (await run_cli("sessions", "list", "--db", str(mem.settings.db_path),
                          "--json")).out.strip() == "[]"


def make_accept_fail(monkeypatch: pytest.MonkeyPatch, after: int) -> list[int]:
    """The pipeline's appends fail from the ``after + 1``-th on, as a full backlog under the
    "reject" policy would."""
    calls = [0]
    real = MemoryPipeline.accept_record

    def accept(self: MemoryPipeline, *args: Any, **kw: Any) -> Any:
        calls[0] += 1
        if calls[0] > after:
            raise QueueFullError("the backlog is full (the test's)")
        return real(self, *args, **kw)

    monkeypatch.setattr(MemoryPipeline, "accept_record", accept)
    return calls


async def test_an_import_whose_first_append_fails_accepted_nothing(
        mem: MemoryPipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    make_accept_fail(monkeypatch, after=0)
    with pytest.raises(QueueFullError):
        await mem.sessions.import_lines(GOOD)
    monkeypatch.undo()
    await mem.flush()
    assert await export(mem) == []


async def test_an_import_cut_short_is_finished_by_importing_the_lines_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A session larger than a record goes in parts; an append that fails after the first
    part leaves that part to commit (here across a restart), and the same import again
    adds the other parts, once, and the sessions not accepted."""
    settings = Settings(db_path=tmp_path / "m.db", max_turn_bytes=4096)
    async with MemoryPipeline(settings) as mem:
        for i in range(6):
            mem.sync_turn(f"question {i} " + "x" * 1200, f"answer {i}", session_id="big",
                          user_id="ann")
        mem.sync_turn("small", "talk", session_id="small", user_id="ann")
        await mem.flush()
        lines = await export(mem)
        await delete_all(mem)
        make_accept_fail(monkeypatch, after=1)
        with pytest.raises(ImportIncompleteError, match="import the same lines again") as caught:
            await mem.sessions.import_lines(lines)
        monkeypatch.undo()
    err = caught.value
    assert err.result is None and err.accepted == ()
    assert err.sessions["big"].startswith("1 of its ")
    assert err.sessions["small"].startswith("not accepted")
    async with MemoryPipeline(settings) as mem:
        await mem.flush()
        part = len(await mem.get_messages("big"))
        assert 0 < part < 12  # the first part committed, alone
        result = await mem.sessions.import_lines(lines)
        assert result == ImportResult(imported=2, skipped=0, messages=12 - part + 2)
        assert await export(mem) == lines  # every message once, in order, ids as exported
        assert await mem.sessions.import_lines(lines) == ImportResult(0, 2, 0)


async def test_an_import_larger_than_a_rejecting_backlog_is_refused_before_it_starts(
        tmp_path: Path) -> None:
    settings = Settings(db_path=tmp_path / "m.db", overflow="reject", max_queued_turns=2)
    async with MemoryPipeline(settings) as mem:
        with pytest.raises(ImportLimitError, match="max_queued_turns") as caught:
            await mem.sessions.import_lines([*GOOD, line_of("g3")])
        assert caught.value.limit == "max_queued_turns"
        assert mem.stats().accepted_turns == 0


# -- 4. parents --------------------------------------------------------------------------------


async def test_missing_self_and_cyclic_parents_are_detached_and_said_so(
        tmp_path: Path) -> None:
    async with MemoryPipeline(Settings(db_path=tmp_path / "a.db")) as a:
        for sid in ("root", "kid", "orphan", "self", "x", "y", "local-kid", "z"):
            a.sync_turn(f"text of {sid}", "ok", session_id=sid, user_id="ann")
        for sid, parent in (("kid", "root"), ("orphan", "gone"), ("x", "y"), ("y", "x"),
                            ("local-kid", "local-parent"), ("z", "s")):
            a.sessions.describe_nowait(sid, parent_session_id=parent)
        await a.flush()
        sql(a.settings.db_path, "UPDATE sessions SET parent_session_id = id WHERE id = 'self'")
        lines = await export(a)
    async with MemoryPipeline(Settings(db_path=tmp_path / "b.db")) as b:
        b.sync_turn("here", "ok", session_id="local-parent", user_id="ann")
        b.sync_turn("here", "ok", session_id="s", user_id="ann")
        b.sessions.describe_nowait("s", parent_session_id="z")  # z -> s -> z: a cycle
        await b.flush()
        result = await b.sessions.import_lines(lines)
        assert (result.imported, result.messages) == (8, 16)
        # x's link would close x -> y -> x (the first in line order gives way), z's z -> s -> z.
        assert sorted(result.detached) == ["orphan", "self", "x", "z"]
        parents = {s: p for s, p in sql(b.settings.db_path,
                                        "SELECT id, parent_session_id FROM sessions")}
    assert parents == {"root": None, "kid": "root", "orphan": None, "self": None, "x": None,
                       "y": "x", "local-kid": "local-parent", "z": None, "local-parent": None,
                       "s": "z"}
    assert result.as_dict()["detached"] == list(result.detached)


# -- 5. model_config and limits ----------------------------------------------------------------


async def test_model_config_is_checked_as_describe_checks_it_and_kept_as_exported(
        mem: MemoryPipeline) -> None:
    result = await mem.sessions.import_lines([
        line_of("text", model_config='{"temperature": 0.5, "tools": ["a"]}'),
        line_of("object", model_config={"temperature": 0.5, "tools": ["a"]})])
    assert result.imported == 2
    configs = dict(sql(mem.settings.db_path, "SELECT id, model_config FROM sessions"))
    assert configs == {"text": '{"temperature": 0.5, "tools": ["a"]}',  # the text, as it was
                       "object": '{"temperature":0.5,"tools":["a"]}'}  # as describe writes it


LIMITED: dict[str, tuple[ImportLimits, list[str], int]] = {
    "max_sessions": (ImportLimits(max_sessions=2), [*GOOD, line_of("g3")], 3),
    "max_bytes": (ImportLimits(max_bytes=len(GOOD[0]) + 10), GOOD, 2),
    "max_session_messages": (
        ImportLimits(max_session_messages=1),
        [GOOD[0], line_of("two", messages=[plain(5, "t5"), plain(6, "t5")])], 2),
    "max_session_bytes": (ImportLimits(max_session_bytes=200),
                          [GOOD[0], line_of("long", title="t" * 200)], 2),
}


@pytest.mark.parametrize("limit", list(LIMITED))
async def test_each_limit_refuses_the_import_naming_itself(
        mem: MemoryPipeline, limit: str) -> None:
    limits, lines, line = LIMITED[limit]
    with pytest.raises(ImportLimitError, match=f"line {line}: .*{limit}") as caught:
        await mem.sessions.import_lines(lines, limits=limits)
    assert (caught.value.limit, caught.value.value) == (limit, getattr(limits, limit))
    assert caught.value.line == line
    assert mem.stats().accepted_turns == 0
    # Within the default limits the same lines go in.
    assert (await mem.sessions.import_lines(lines)).imported == len(lines)


def test_limits_must_be_positive() -> None:
    with pytest.raises(ConfigurationError, match="max_sessions"):
        ImportLimits(max_sessions=0)


# -- 6. every column, every message flag -------------------------------------------------------


def test_the_import_row_names_every_column_of_the_sessions_table(tmp_path: Path) -> None:
    async def make() -> None:
        async with MemoryPipeline(Settings(db_path=tmp_path / "m.db")):
            pass

    anyio.run(make)
    kinds = {"TEXT": str, "INTEGER": int, "REAL": float}
    table = {name: (kinds[decl], not notnull) for _, name, decl, notnull, _, _ in
             sql(tmp_path / "m.db", "PRAGMA table_info(sessions)") if name != "id"}
    assert IMPORTED_ROW_COLUMNS == table


async def test_every_session_column_and_message_flag_round_trips(mem: MemoryPipeline) -> None:
    db = mem.settings.db_path
    mem.sync_turn("", "", session_id="h", user_id="ann", messages=[
        {"role": "user", "content": "rewound question"}, {"role": "assistant", "content": "no"},
        {"role": "user", "content": "kept question"}, {"role": "assistant", "content": "yes"}])
    mem.sessions.describe_nowait("h", model="m-1", model_config={"t": 1},
                                 system_prompt="Be brief.")
    mem.sessions.end_nowait("h", "done")
    await mem.flush()
    values = {"TEXT": "ünï-{}", "INTEGER NOT NULL DEFAULT 0": 7, "INTEGER DEFAULT 0": 1,
              "REAL": 2.5}
    sets = {name: values[decl].format(name) if isinstance(values[decl], str) else values[decl]
            for _, name, decl in SESSION_COLUMNS}
    sql(db, f"UPDATE sessions SET {', '.join(f'{n} = ?' for n in sets)} WHERE id = 'h'",
        *sets.values())
    sql(db, "UPDATE messages SET active = 0 WHERE session_id = 'h' AND content LIKE 'rew%' "
            "OR content = 'no'")
    sql(db, "UPDATE messages SET compacted = 1 WHERE session_id = 'h' AND content = 'no'")
    before = await export(mem)
    row = json.loads(before[0])
    assert all(row[name] == value for name, value in sets.items())
    assert [m["active"] for m in row["messages"]] == [0, 0, 1, 1]
    assert [m.get("compacted") for m in row["messages"]] == [None, 1, None, None]
    await delete_all(mem)
    assert await mem.sessions.import_lines(before) == ImportResult(1, 0, 4)
    assert await export(mem) == before
    assert sql(db, "SELECT active, compacted FROM messages WHERE session_id = 'h' "
                   "ORDER BY id") == [(0, 0), (0, 1), (1, 0), (1, 0)]


async def test_an_earlier_versions_line_still_imports(mem: MemoryPipeline) -> None:
    """Without ``message``, ``active`` or Hermes's columns: from its columns, with the
    table's defaults; exported again, it is the line this version writes."""
    mem.sync_turn("", "", session_id="old", user_id="ann", messages=[
        {"role": "user", "content": "what time is it?"},
        {"role": "assistant", "content": "", "tool_calls": [call("c1", "clock")]},
        {"role": "tool", "tool_call_id": "c1", "content": "12:00"}])
    await mem.flush()
    [line] = await export(mem)
    await delete_all(mem)
    doc = json.loads(line)
    hermes = {name for _, name, _ in SESSION_COLUMNS}
    old = {k: v for k, v in doc.items() if k not in hermes}
    old["messages"] = [{k: v for k, v in m.items() if k not in ("message", "active", "fields")}
                       for m in doc["messages"]]
    assert (await mem.sessions.import_lines([json.dumps(old)])).messages == 3
    assert await export(mem) == [line]


async def test_an_id_from_far_above_does_not_move_the_stores_counter(tmp_path: Path) -> None:
    settings = Settings(db_path=tmp_path / "m.db")
    async with MemoryPipeline(settings) as mem:
        mem.sync_turn("before", "ok", session_id="here")
        await mem.flush()
        far = [{**plain(2**62 + i, "t"), "role": role} for i, role in
               enumerate(("user", "assistant"))]
        assert (await mem.sessions.import_lines([line_of("far", messages=far)])).messages == 2
    async with MemoryPipeline(settings) as mem:
        receipt = mem.sync_turn("after", "ok", session_id="here")
        await mem.flush()
    assert receipt.first_id is not None and receipt.first_id < 100


# -- the CLI -----------------------------------------------------------------------------------


@dataclass
class Run:
    code: int
    out: str
    err: str


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Iterator[Callable[..., Any]]:
    async def run(*argv: str) -> Run:
        capsys.readouterr()
        code = await anyio.to_thread.run_sync(cli.main, list(argv))
        out, err = capsys.readouterr()
        return Run(code, out, err)

    # The pipeline's log lines would otherwise land on the stdout the commands print to.
    with capture_logs():
        yield run


async def test_the_cli_round_trips_odd_text_and_refuses_a_bad_file_whole(
        tmp_path: Path, run_cli: Callable[..., Any]) -> None:
    settings = Settings(db_path=tmp_path / "m.db")
    async with MemoryPipeline(settings) as mem:
        mem.sync_turn("", "", session_id="odd", user_id="ann", metadata={"k": "\x00\ud800"},
                      messages=ODD_TEXT["NUL in fields"]["messages"]
                      + ODD_TEXT["lone surrogate in content"]["messages"])
        mem.sync_turn("", "", session_id="kid", user_id="ann",
                      messages=[{"role": "user", "content": "hi"}],
                      metadata={"parent_session_id": "not-exported"})
        await mem.flush()
    db, first, second = str(settings.db_path), tmp_path / "1.jsonl", tmp_path / "2.jsonl"
    assert (await run_cli("sessions", "export", "-o", str(first), "--db", db)).code == 0
    for sid in ("odd", "kid"):
        assert (await run_cli("sessions", "delete", sid, "--db", db)).code == 0
    bad = tmp_path / "bad.jsonl"
    bad.write_text(first.read_text(encoding="utf-8").splitlines()[0] + "\n{oops\n",
                   encoding="utf-8")
    refused = await run_cli("sessions", "import", str(bad), "--db", db)
    assert refused.code == 2 and "line 2: not JSON" in refused.err
    assert (await run_cli("sessions", "list", "--db", db, "--json")).out.strip() == "[]"
    imported = await run_cli("sessions", "import", str(first), "--db", db, "--json")
    assert imported.code == 0, imported.err
    assert json.loads(imported.out) == {"imported": 2, "skipped": 0, "messages": 4,
                                        "detached": ["kid"]}
    assert (await run_cli("sessions", "export", "-o", str(second), "--db", db)).code == 0
    kid = json.loads(second.read_text(encoding="utf-8").splitlines()[1])
    assert kid["id"] == "kid" and kid["parent_session_id"] is None
    # Apart from the parent dropped, the same bytes.
    assert second.read_bytes().splitlines()[0] == first.read_bytes().splitlines()[0]
    again = await run_cli("sessions", "import", str(first), "--db", db)
    assert again.out.strip() == "imported 0 sessions (0 messages); 2 already there, skipped"


@pytest.mark.parametrize("n", [1, 13, 14, 15, 40])
def test_an_import_record_with_nul_in_any_message_is_refused_when_read(n: int) -> None:
    """A record handed in by hand (the library writes U+0000 as U+FFFD in a column) whose
    message text holds U+0000 is refused where it is read, whatever its messages' count:
    SQLite's JSON functions would cut the text there. Rows of 12 to 15 fields (the versions
    before) are all read."""
    def row(i: int, size: int) -> list[Any]:
        base = [i + 1, f"t{i}", 0, "user", f"text {i}", None, None, None, 1.0, "ann", None,
                None, None, 1, 1]
        return base[:size]

    for size in (12, 13, 14, 15):
        messages = [row(i, size) for i in range(n)]
        ok = encode_session_op("k", "s", "ann", 1.0, "import", row=None, messages=messages,
                               started_at=1.0)
        assert parse_session_record(ok) is not None
        messages[-1][4] = "cut\x00here"
        bad = encode_session_op("k", "s", "ann", 1.0, "import", row=None, messages=messages,
                                started_at=1.0)
        with pytest.raises(ValueError, match="U\\+0000"):
            parse_session_record(bad)
