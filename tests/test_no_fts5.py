"""A SQLite without FTS5: the store runs without its full-text indexes (every write goes on,
stored as given; searches raise a typed error; recalls find nothing; health says so), and
the next open by a SQLite with FTS5 rebuilds every index from what was written meanwhile.

Two faults, each SQLite's own refusal: a connection that refuses to make an FTS5 table with
the message of a SQLite built without the module (``_NoFts5``), and a file whose FTS5 tables
name a module this SQLite does not have (``_rename_module``), as the file's existing indexes
look to such a SQLite.
"""
# ruff: noqa: RUF001 (Chinese text writes its comma full-width: meant)

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiosqlite
import pytest

from hermes_async_memory import FullTextUnavailableError, MemoryPipeline, Settings, cli
from hermes_async_memory.outbox.log import OutboxBusyError
from hermes_async_memory.sessions import SessionReads, SessionWrites
from hermes_async_memory.sessions.reads import open_session_reads
from hermes_async_memory.sessions.transfer import export_sessions, import_sessions
from hermes_async_memory.store.text_index import INDEX_TRIGGERS, has_cjk
from hermes_async_memory.supervisor import FULL_TEXT_UNAVAILABLE

from .helpers import file_rows as _rows
from .sqlite_faults import refusing_connection

_CONNECT = aiosqlite.connect  # as imported: a SQLite with FTS5
CALLS = [{"id": "c1", "type": "function",
          "function": {"name": "kubectl_rollout", "arguments": '{"service": "billing"}'}}]


# A connection to a SQLite built without FTS5: making an FTS5 table (or its vocabulary
# table) fails with that SQLite's message; everything else is the same.
_NoFts5 = refusing_connection("USING fts5", "no such module: fts5")


@pytest.fixture
def without_fts5(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Every connection the store opens from now on is ``_NoFts5``'s (undone with
    ``monkeypatch.undo()``)."""
    real = aiosqlite.connect

    def connect(database: Any, **kw: Any) -> aiosqlite.Connection:
        return real(database, factory=_NoFts5, **kw)

    monkeypatch.setattr(aiosqlite, "connect", connect)
    yield monkeypatch


def _rename_module(db: Path, *, missing: bool) -> None:
    """Make the file's FTS5 tables name modules no SQLite has (``missing``), or their own
    again: SQLite itself then refuses every use of them, with "no such module: fts5_missing"."""
    pairs = [("USING fts5vocab(", "USING fts5vocab_missing("),
             ("USING fts5(", "USING fts5_missing(")]
    conn = sqlite3.connect(db)
    try:
        conn.execute("PRAGMA writable_schema = ON")
        for old, new in pairs:
            a, b = (old, new) if missing else (new, old)
            conn.execute("UPDATE sqlite_master SET sql = replace(sql, ?, ?) "
                         "WHERE type = 'table'", (a, b))
        conn.commit()
    finally:
        conn.close()


def _index_triggers(db: Path) -> set[str]:
    return {r[0] for r in _rows(db, "SELECT name FROM sqlite_master WHERE type = 'trigger'")
            } & set(INDEX_TRIGGERS)


def _assert_indexes_hold_exactly_the_rows(db: Path) -> None:
    """Each full-text index holds exactly the rows it is for, and FTS5 finds it sound."""
    ids = {r[0] for r in _rows(db, "SELECT id FROM messages")}
    assert {r[0] for r in _rows(db, "SELECT id FROM messages_fts_docsize")} == ids
    assert {r[0] for r in _rows(db, "SELECT id FROM messages_tools_docsize")} == {
        r[0] for r in _rows(db, "SELECT id FROM messages WHERE tool_text IS NOT NULL")}
    assert {r[0] for r in _rows(db, "SELECT id FROM messages_trgm_docsize")} == {
        r[0] for r in _rows(db, "SELECT id, content FROM messages") if r[1] and has_cjk(r[1])}
    assert {r[0] for r in _rows(db, "SELECT id FROM memories_fts_docsize")} == {
        r[0] for r in _rows(db, "SELECT id FROM memories")}
    # Against every row of their content (rank 1) where they index every row; the others
    # hold some rows only, so they are checked without it (text_index).
    _rows(db, "INSERT INTO messages_fts (messages_fts, rank) VALUES ('integrity-check', 1)")
    _rows(db, "INSERT INTO memories_fts (memories_fts, rank) VALUES ('integrity-check', 1)")
    _rows(db, "INSERT INTO messages_tools (messages_tools) VALUES ('integrity-check')")
    _rows(db, "INSERT INTO messages_trgm (messages_trgm) VALUES ('integrity-check')")


async def _sessions_found(mem: MemoryPipeline, query: str) -> set[str]:
    return {h.session_id for h in await SessionReads(mem).search(query, user_id="ann")}


def _write_first(mem: MemoryPipeline) -> None:
    mem.sync_turn("the alpha deploy of billing went out", "noted: alpha deploy done",
                  session_id="s1", user_id="ann")
    mem.sync_turn("roll back bravo please", "bravo rollback started", session_id="s2",
                  user_id="ann")


def _write_second(mem: MemoryPipeline) -> None:
    mem.sync_turn("deploy charlie next", "charlie deploy queued", session_id="s3",
                  user_id="ann")
    mem.sync_turn("restart the billing rollout", "the rollout restarted", messages=[
        {"role": "user", "content": "restart the billing rollout"},
        {"role": "assistant", "content": "", "tool_calls": CALLS},
        {"role": "tool", "tool_call_id": "c1", "name": "kubectl_rollout", "content": "ok"},
        {"role": "assistant", "content": "the rollout restarted"},
    ], session_id="s4", user_id="ann")
    mem.sync_turn("大别山项目计划书已经发给你了", "好的，收到", session_id="zh", user_id="ann")


async def test_a_new_store_without_fts5_keeps_every_write_says_so_and_is_indexed_later(
        tmp_path: Path, without_fts5: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "m.db"
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        health = mem.health()
        assert health.ok and FULL_TEXT_UNAVAILABLE in health.conditions
        assert "FTS5" in health.conditions[FULL_TEXT_UNAVAILABLE]
        _write_first(mem)
        _write_second(mem)
        await mem.memory.store("ann", "shell", "zsh with starship")
        await mem.memory.store("ann", "editor", "helix")
        await mem.flush()
        # Stored as given, every message of every shape.
        got = await mem.get_messages("s4")
        assert [(m["role"], m["content"]) for m in got] == [
            ("user", "restart the billing rollout"), ("assistant", ""),
            ("tool", "ok"), ("assistant", "the rollout restarted")]
        assert got[1]["tool_calls"] == CALLS
        # Deletes go on: of a session, of a memory; and the other paths that fill the
        # indexes: an import (s2 exported, deleted, imported again), a replacement.
        writes = SessionWrites(mem)
        lines = [line async for line in export_sessions(mem, session_id="s2")]
        await writes.delete("s2", user_id="ann")
        await mem.flush()
        assert await mem.get_messages("s2") == []
        assert (await import_sessions(mem, lines)).messages == 2
        writes.replace_messages_nowait("zh", [
            {"role": "user", "content": "换成了黄山旅游攻略"},
            {"role": "assistant", "content": "黄山旅游攻略已保存"}], user_id="ann")
        await writes.delete("s3", user_id="ann")
        await mem.memory.delete("ann", "editor")
        await mem.flush()
        assert [m["content"] for m in await mem.get_messages("s2")] == [
            "roll back bravo please", "bravo rollback started"]
        assert await mem.get_messages("s3") == []
        assert [m["content"] for m in await mem.get_messages("zh")] == [
            "换成了黄山旅游攻略", "黄山旅游攻略已保存"]
        assert (await mem.memory.retrieve("ann", "shell")).value == "zsh with starship"
        assert await mem.memory.retrieve("ann", "editor") is None
        # A search cannot run: said, typed; a recall finds nothing.
        with pytest.raises(FullTextUnavailableError, match="no FTS5"):
            await SessionReads(mem).search("deploy", user_id="ann")
        with pytest.raises(FullTextUnavailableError):
            await mem.memory.query("ann", "starship")
        assert await mem.search("deploy", user_id="ann") == ""
    assert _rows(db, "SELECT name FROM sqlite_master WHERE sql LIKE '%USING fts5%'") == []
    assert _index_triggers(db) == set()
    assert _rows(db, "SELECT count(*) FROM text_index_off") == [(1,)]  # marked not kept
    capsys.readouterr()
    assert cli.main(["status", "--db", str(db), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["full_text_off_since"] is not None

    without_fts5.undo()  # a SQLite with FTS5 opens it: every index made from the rows
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        assert FULL_TEXT_UNAVAILABLE not in mem.health().conditions
        _assert_indexes_hold_exactly_the_rows(db)
        assert _rows(db, "SELECT count(*) FROM text_index_off") == [(0,)]
        capsys.readouterr()
        assert cli.main(["status", "--db", str(db), "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["full_text_off_since"] is None
        assert _index_triggers(db) == {"messages_fts_delete", "messages_trgm_delete",
                                       "messages_tools_delete", "memories_fts_insert",
                                       "memories_fts_update", "memories_fts_delete"}
        assert await _sessions_found(mem, "deploy") == {"s1"}  # s3 was deleted
        assert await _sessions_found(mem, "bravo") == {"s2"}  # imported
        assert await _sessions_found(mem, "kubectl_rollout") == {"s4"}  # the tool index
        assert await _sessions_found(mem, "黄山旅游") == {"zh"}  # the trigram index
        assert await _sessions_found(mem, "大别山") == set()  # replaced
        assert [e.key for e in await mem.memory.query("ann", "starship")] == ["shell"]
        assert "alpha deploy" in await mem.search("alpha deploy", user_id="ann")


async def test_a_store_opened_once_without_fts5_is_rebuilt_by_the_next_open_with_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "m.db"
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        _write_first(mem)
        await mem.memory.store("ann", "shell", "zsh with starship")
        await mem.flush()
        assert await _sessions_found(mem, "deploy") == {"s1"}

    # Where SQLite has no FTS5: the file's indexes are unreadable there, new ones cannot be
    # made. Writes and deletes go on; the indexes are left as they were.
    _rename_module(db, missing=True)
    with monkeypatch.context() as patched:
        real = aiosqlite.connect
        patched.setattr(aiosqlite, "connect",
                        lambda database, **kw: real(database, factory=_NoFts5, **kw))
        async with MemoryPipeline(Settings(db_path=db)) as mem:
            assert FULL_TEXT_UNAVAILABLE in mem.health().conditions
            _write_second(mem)
            await SessionWrites(mem).delete("s2", user_id="ann")
            await mem.memory.store("ann", "editor", "helix")
            await mem.memory.delete("ann", "shell")
            await mem.flush()
            assert [m["content"] for m in await mem.get_messages("s3")] == [
                "deploy charlie next", "charlie deploy queued"]
            assert await mem.get_messages("s2") == []
            with pytest.raises(FullTextUnavailableError):
                await SessionReads(mem).search("deploy", user_id="ann")
            assert await mem.search("deploy", user_id="ann") == ""
        assert _index_triggers(db) == set()  # nothing keeps the indexes now

    _rename_module(db, missing=False)
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        _assert_indexes_hold_exactly_the_rows(db)
        assert await _sessions_found(mem, "deploy") == {"s1", "s3"}
        assert await _sessions_found(mem, "rollback") == set()  # s2 was deleted meanwhile
        assert await _sessions_found(mem, "kubectl_rollout") == {"s4"}
        assert await _sessions_found(mem, "大别山") == {"zh"}
        assert [e.key for e in await mem.memory.query("ann", "helix")] == ["editor"]
        assert await mem.memory.query("ann", "starship") == []
        # And kept from now on: a delete leaves every index.
        await SessionWrites(mem).delete("s3", user_id="ann")
        await mem.flush()
        assert await _sessions_found(mem, "deploy") == {"s1"}
        _assert_indexes_hold_exactly_the_rows(db)


async def test_a_reader_whose_sqlite_cannot_read_the_indexes_says_so_typed(
        tmp_path: Path) -> None:
    """A read-only opener (the inspector, the CLI) beside a writer that keeps the indexes:
    where its own SQLite lacks the module, a search is refused with the typed error, and
    every other read works."""
    db = tmp_path / "m.db"
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        _write_first(mem)
        await mem.flush()
    _rename_module(db, missing=True)
    async with open_session_reads(db) as reads:
        with pytest.raises(FullTextUnavailableError, match="no FTS5"):
            await reads.search("deploy", user_id="ann")
        assert {s.id for s in await reads.list_sessions(user_id="ann")} == {"s1", "s2"}
    _rename_module(db, missing=False)
    async with open_session_reads(db) as reads:
        assert {h.session_id for h in await reads.search("deploy", user_id="ann")} == {"s1"}


def _no_fts5_connect(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aiosqlite, "connect",
                        lambda database, **kw: _CONNECT(database, factory=_NoFts5, **kw))


@pytest.mark.parametrize("writer_has_fts5", [True, False])
async def test_only_the_committing_process_settles_the_indexes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, writer_has_fts5: bool) -> None:
    """Beside a running writer, a start whose SQLite differs from the writer's (one that
    fails on the outbox's lock, as `hermes-memory` commands try first; or a producer)
    leaves the indexes as the writer keeps them: every delete and update of the writer
    after it still reaches them (or, without FTS5, none of them fails)."""
    db = tmp_path / "m.db"
    if not writer_has_fts5:
        _no_fts5_connect(monkeypatch)
    async with MemoryPipeline(Settings(db_path=db)) as writer:
        _write_first(writer)
        await writer.memory.store("ann", "editor", "helix")
        await writer.flush()
        triggers = _index_triggers(db)
        assert bool(triggers) is writer_has_fts5
        with monkeypatch.context() as other:
            if writer_has_fts5:
                _no_fts5_connect(other)
            else:
                other.setattr(aiosqlite, "connect", _CONNECT)
            with pytest.raises(OutboxBusyError):
                await MemoryPipeline(Settings(db_path=db)).start()
            async with MemoryPipeline(Settings(db_path=db, role="producer")) as producer:
                # Its own SQLite lacks FTS5, or the writer's does: no search here.
                assert FULL_TEXT_UNAVAILABLE in producer.health().conditions
            assert _index_triggers(db) == triggers
        await SessionWrites(writer).delete("s1", user_id="ann")
        await writer.memory.store("ann", "editor", "vim")
        await writer.flush()
        assert await writer.get_messages("s1") == []
        if writer_has_fts5:
            _assert_indexes_hold_exactly_the_rows(db)
            assert await _sessions_found(writer, "deploy") == set()
            assert [e.value for e in await writer.memory.query("ann", "vim")] == ["vim"]
            assert await writer.memory.query("ann", "helix") == []
    monkeypatch.undo()
    if not writer_has_fts5:  # the next writer with FTS5 finds them to rebuild
        async with MemoryPipeline(Settings(db_path=db)) as mem:
            _assert_indexes_hold_exactly_the_rows(db)
            assert await _sessions_found(mem, "bravo") == {"s2"}
            assert [e.value for e in await mem.memory.query("ann", "vim")] == ["vim"]
