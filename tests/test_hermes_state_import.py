"""Hermes Agent's own session store (a real ``state.db`` written by the installed
hermes-agent's ``hermes_state.SessionDB``) imported into our store: every session and every
message as Hermes holds them, parents kept, the file left byte for byte as it was, and a
second run importing nothing. Through the command a user runs, and from an older Hermes's
file format."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

hermes_state = pytest.importorskip("hermes_state")

from hermes_async_memory import MemoryPipeline, Settings  # noqa: E402
from hermes_async_memory.hermes import migrate  # noqa: E402
from hermes_async_memory.hermes import state as ours_state  # noqa: E402
from hermes_async_memory.hermes.migrate import (  # noqa: E402
    hermes_own_state,
    import_hermes_state,
    parents_first,
)
from hermes_async_memory.sessions import SessionReads  # noqa: E402

CALLS = [{"id": "call_1", "type": "function",
          "function": {"name": "terminal", "arguments": '{"command": "ls -la"}'}}]
# The message fields Hermes keeps, compared one by one (ids and row bookkeeping aside).
FIELDS = ("role", "content", "tool_call_id", "tool_calls", "tool_name", "timestamp",
          "token_count", "finish_reason", "reasoning", "reasoning_content", "active",
          "compacted")
SESSION_FIELDS = ("id", "source", "user_id", "model", "parent_session_id", "started_at",
                  "ended_at", "end_reason", "title", "input_tokens", "output_tokens",
                  "message_count", "tool_call_count", "rewind_count", "cwd", "git_branch")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _hermes_store(path: Path) -> dict[str, Any]:
    """A state.db as Hermes writes it; returns what Hermes exports of it (every message)."""
    db = hermes_state.SessionDB(db_path=path)
    try:
        db.create_session(session_id="root", source="cli", model="gpt-4o", user_id="ann")
        db.set_session_title("root", "Deploying billing")
        db.append_message("root", role="user", content="deploy billing to staging",
                          timestamp=1_700_000_000.0)
        db.append_message("root", role="assistant", content="", tool_calls=CALLS,
                          reasoning="list the folder first", finish_reason="tool_calls",
                          timestamp=1_700_000_001.0)
        db.append_message("root", role="tool", content="total 0", tool_call_id="call_1",
                          tool_name="terminal", timestamp=1_700_000_002.0)
        db.append_message("root", role="assistant", content="Deployed. 大别山项目 noted.",
                          token_count=17, finish_reason="stop", timestamp=1_700_000_003.0)
        db.update_token_counts("root", input_tokens=1234, output_tokens=567, model="gpt-4o")
        db.end_session("root", "compression")
        db.create_session(session_id="a-child", source="cli", parent_session_id="root",
                          user_id="ann")
        db.append_message("a-child", role="user",
                          content=[{"type": "text", "text": "what is in this image?"},
                                   {"type": "image_url",
                                    "image_url": {"url": "data:image/png;base64,AAAA"}}])
        db.append_message("a-child", role="assistant", content="a cat")
        again = db.append_message("a-child", role="user", content="and now?")
        db.append_message("a-child", role="assistant", content="still a cat")
        db.rewind_to_message("a-child", again)  # the last two kept, inactive
        db.create_session(session_id="other", source="telegram", user_id="bob")
        db.append_message("other", role="system", content="you are terse")
        db.append_message("other", role="user", content="the quarterly okapi numbers")
        db.append_message("other", role="assistant", content="they went up")
        # A compaction: the three set aside as compacted (still found by search).
        db.archive_and_compact("other", [{"role": "user", "content": "summary: numbers up"}])
        return {sid: {**db.get_session(sid),
                      "messages": db.get_messages(sid, include_inactive=True)}
                for sid in ("root", "a-child", "other")}
    finally:
        db.close()


def _ours(path: Path) -> Iterator[Any]:
    db = ours_state.SessionDB(db_path=path)
    try:
        yield db
    finally:
        db.close()


def _assert_same(hermes: dict[str, Any], ours: Any) -> None:
    for sid, exported in hermes.items():
        got = ours.get_session(sid)
        assert got is not None, sid
        for name in SESSION_FIELDS:
            assert got.get(name) == exported.get(name), (sid, name)
        mine = ours.get_messages(sid, include_inactive=True)
        assert len(mine) == len(exported["messages"]), sid
        for theirs, m in zip(exported["messages"], mine, strict=True):
            for name in FIELDS:
                assert m.get(name) == theirs.get(name), (sid, name, theirs.get(name))


def test_hermes_state_db_comes_over_whole_and_is_left_untouched(tmp_path: Path) -> None:
    source = tmp_path / "state.db"
    exported = _hermes_store(source)
    before = {p.name: _digest(p) for p in tmp_path.iterdir()}
    target = tmp_path / "ours.db"
    run = [sys.executable, "-m", "hermes_async_memory.cli", "hermes", "import-state",
           "--from", str(source), "--db", str(target), "--json"]
    done = subprocess.run(run, capture_output=True, text=True, timeout=120, check=True)
    report = json.loads(done.stdout)
    assert (report["found"], report["imported"], report["skipped"]) == (3, 3, 0)
    assert report["messages"] == sum(len(e["messages"]) for e in exported.values())
    assert report["detached"] == []
    # The file as it was: the same bytes, no -wal or -shm made beside it.
    assert {p.name: _digest(p) for p in tmp_path.iterdir()
            if not p.name.startswith("ours.db")} == before
    for db in _ours(target):
        _assert_same(exported, db)
        # Found by search (the word index and the trigram index), inactive ones aside.
        assert [h["session_id"] for h in db.search_messages("staging")] == ["root"]
        assert [h["session_id"] for h in db.search_messages("大别山")] == ["root"]
        assert [h["session_id"] for h in db.search_messages("okapi")] == ["other"]
        assert [m["content"] for m in db.get_messages_as_conversation("other")] == [
            "summary: numbers up"]
        assert [{"role": m["role"], "content": m["content"]}
                for m in db.get_messages_as_conversation("a-child")] == [
            {"role": "user", "content": [
                {"type": "text", "text": "what is in this image?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]},
            {"role": "assistant", "content": "a cat"}]
    again = subprocess.run(run, capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(again.stdout)["imported"] == 0
    assert json.loads(again.stdout)["skipped"] == 3
    for db in _ours(target):
        assert len(db.get_messages("root")) == 4  # nothing twice


def test_an_older_hermes_file_is_brought_up_to_date_in_a_copy_only(tmp_path: Path) -> None:
    """A state.db of Hermes's schema version 2 (no titles, no billing, no FTS): Hermes's own
    migrations run on the snapshot; the file keeps its old form."""
    source = tmp_path / "old_state.db"
    conn = sqlite3.connect(source)
    conn.executescript("""
        CREATE TABLE schema_version (version INTEGER NOT NULL);
        INSERT INTO schema_version VALUES (2);
        CREATE TABLE sessions (
            id TEXT PRIMARY KEY, source TEXT NOT NULL, user_id TEXT, model TEXT,
            model_config TEXT, system_prompt TEXT, parent_session_id TEXT,
            started_at REAL NOT NULL, ended_at REAL, end_reason TEXT,
            message_count INTEGER DEFAULT 0, tool_call_count INTEGER DEFAULT 0,
            input_tokens INTEGER DEFAULT 0, output_tokens INTEGER DEFAULT 0);
        CREATE TABLE messages (
            id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL, role TEXT NOT NULL,
            content TEXT, tool_call_id TEXT, tool_calls TEXT, tool_name TEXT,
            timestamp REAL NOT NULL, token_count INTEGER, finish_reason TEXT);
        INSERT INTO sessions (id, source, started_at, message_count)
            VALUES ('old-1', 'cli', 1600000000.0, 2);
        INSERT INTO messages (session_id, role, content, timestamp)
            VALUES ('old-1', 'user', 'hello from 2020', 1600000000.5),
                   ('old-1', 'assistant', 'hi there', 1600000001.0);
    """)
    conn.commit()
    conn.close()
    digest = _digest(source)
    target = tmp_path / "ours.db"
    done = subprocess.run(
        [sys.executable, "-m", "hermes_async_memory.cli", "hermes", "import-state",
         "--from", str(source), "--db", str(target), "--json"],
        capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(done.stdout)["imported"] == 1
    assert _digest(source) == digest
    assert sqlite3.connect(source).execute("SELECT version FROM schema_version").fetchone() == (2,)
    for db in _ours(target):
        assert [(m["role"], m["content"], m["timestamp"]) for m in db.get_messages("old-1")] == [
            ("user", "hello from 2020", 1600000000.5), ("assistant", "hi there", 1600000001.0)]
        assert db.get_session("old-1")["started_at"] == 1600000000.0


async def test_a_child_started_before_its_parent_keeps_it_across_parts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each part of the import commits whole, and a parent must be stored or in the same
    part: a child that Hermes's file lists first (an earlier started_at) still comes after
    its parent, one session a part."""
    source = tmp_path / "state.db"
    _hermes_store(source)
    conn = sqlite3.connect(source)
    conn.execute("UPDATE sessions SET started_at = started_at + 3600 WHERE id = 'root'")
    conn.commit()
    conn.close()
    monkeypatch.setattr(migrate, "PART_SESSIONS", 1)
    async with MemoryPipeline(Settings(db_path=tmp_path / "ours.db")) as mem:
        report = await import_hermes_state(mem, source)
        assert (report.found, report.imported, report.parts, report.detached) == (3, 3, 3, [])
        child = await SessionReads(mem).get_session("a-child")
        assert child is not None and child.parent_session_id == "root"


def test_hermes_own_module_is_found_where_ours_stands_in_for_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``--session-store``, ``import hermes_state`` gives ours: Hermes's own is loaded
    from the installed hermes-agent by its file."""
    monkeypatch.setitem(sys.modules, "hermes_state", ours_state)
    module = hermes_own_state()
    assert module is not ours_state
    assert module.SessionDB.__module__ != ours_state.SessionDB.__module__
    assert hasattr(module.SessionDB, "_execute_write")  # Hermes's own internals


def test_parents_come_before_their_children_and_a_cycle_is_cut() -> None:
    order = parents_first([("c", "b"), ("b", "a"), ("x", None), ("a", None),
                           ("p", "q"), ("q", "p"), ("orphan", "gone")])
    assert order.index("a") < order.index("b") < order.index("c")
    assert sorted(order) == sorted(["a", "b", "c", "x", "p", "q", "orphan"])


async def test_a_state_db_hermes_has_open_comes_over_as_it_stands(tmp_path: Path) -> None:
    """Hermes running: its last writes are in the write-ahead log, not yet in the file; the
    snapshot reads them through SQLite, and the file itself is not changed."""
    source = tmp_path / "state.db"
    live = hermes_state.SessionDB(db_path=source)
    try:
        live.create_session(session_id="live", source="cli")
        for i in range(30):
            live.append_message("live", role="user" if i % 2 == 0 else "assistant",
                                content=f"message {i}")
        assert source.with_name("state.db-wal").exists()
        digest = _digest(source)
        async with MemoryPipeline(Settings(db_path=tmp_path / "ours.db")) as mem:
            report = await import_hermes_state(mem, source)
            assert (report.imported, report.messages) == (1, 30)
            got = await mem.get_messages("live")
            assert [m["content"] for m in got] == [f"message {i}" for i in range(30)]
        assert _digest(source) == digest
        live.append_message("live", role="user", content="Hermes goes on")  # unharmed
        assert len(live.get_messages("live")) == 31
    finally:
        live.close()


def test_what_is_not_hermes_state_db_is_refused_saying_what_it_is(tmp_path: Path) -> None:
    """A missing file, a file that is not SQLite, another program's database, or a store
    of ours: one line each, exit status 1, and no store made for a missing one."""
    ours = tmp_path / "ours.db"
    conn = sqlite3.connect(tmp_path / "other.db")
    conn.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
    conn.commit()
    conn.close()
    (tmp_path / "text.db").write_text("not a database")
    for db in _ours(ours):
        db.create_session(session_id="mine", source="cli")
    cases = {"missing.db": "no Hermes session store at",
             "text.db": "file is not a database",
             "other.db": "is not Hermes's session store",
             "ours.db": "is a hermes-async-memory store"}
    for name, said in cases.items():
        target = tmp_path / f"into-{name}"
        done = subprocess.run(
            [sys.executable, "-m", "hermes_async_memory.cli", "hermes", "import-state",
             "--from", str(tmp_path / name), "--db", str(target)],
            capture_output=True, text=True, timeout=120)
        assert done.returncode == 1, (name, done.stderr)
        assert said in done.stderr, (name, done.stderr)
    assert not (tmp_path / "into-missing.db").exists()
