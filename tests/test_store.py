"""The store under faults: a locked file is retried, a poison turn is dead-lettered alone."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import aiosqlite
import anyio
import pytest
from structlog.testing import capture_logs

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.store import SCHEMA_VERSION, Batch, SqliteStore
from hermes_async_memory.store.connections import rollback
from hermes_async_memory.turns import Turn

from .helpers import count_rows, stored_turns


async def test_a_locked_store_is_retried_and_nothing_is_dead_lettered(tmp_path: Path) -> None:
    settings = Settings(db_path=tmp_path / "m.db", busy_timeout_ms=20, commit_retry_base_s=0.005)
    hit_lock = anyio.Event()

    class Observed(SqliteStore):
        async def commit_batch(self, batch: Batch) -> None:
            try:
                await super().commit_batch(batch)
            except sqlite3.OperationalError:
                hit_lock.set()
                raise

    store = Observed(settings.db_path, busy_timeout_ms=settings.busy_timeout_ms)
    async with MemoryPipeline(settings, store=store) as mem:
        mem.sync_turn("before", "lock", session_id="s")
        await mem.flush()
        other = sqlite3.connect(settings.db_path, isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another process holds the write lock
        try:
            for i in range(100):
                mem.sync_turn(f"during {i}", "lock", session_id="s")
            with anyio.fail_after(10):
                await hit_lock.wait()
        finally:
            other.execute("COMMIT")
            other.close()
        await mem.flush()
        stats = mem.stats()
        assert stats.commit_retries >= 1
        assert stats.dead_letters == 0
    users = [c for _, role, c in stored_turns(settings.db_path)["s"] if role == "user"]
    assert users == ["before"] + [f"during {i}" for i in range(100)]


async def test_a_poison_turn_is_dead_lettered_and_its_session_goes_on(tmp_path: Path) -> None:
    settings = Settings(db_path=tmp_path / "m.db", commit_retry_base_s=0.001)

    class Picky(SqliteStore):
        """Rejects one turn the way a constraint or a driver would; a fault we cannot cause."""

        async def commit_batch(self, batch: Batch) -> None:
            if any("POISON" in t.user_text for t in batch.turns):
                raise sqlite3.DataError("value rejected by the store")
            await super().commit_batch(batch)

    async with MemoryPipeline(settings, store=Picky(settings.db_path)) as mem:
        for i in range(300):
            text = "POISON" if i == 150 else f"turn {i}"
            mem.sync_turn(text, "r", session_id=f"s{i % 3}")
        with anyio.fail_after(30):
            await mem.flush()
        assert mem.stats().dead_letters == 1
        dead = await mem.store.dead_letters()
        assert len(dead) == 1
        assert dead[0].session_id == "s0" and "value rejected" in dead[0].last_error
        assert dead[0].attempts == 1, "refused for a cause of its own: dead-lettered at once"
    stored = stored_turns(settings.db_path)
    for s in range(3):
        users = [c for _, role, c in stored[f"s{s}"] if role == "user"]
        assert users == [f"turn {i}" for i in range(300) if i % 3 == s and i != 150]
    assert count_rows(settings.db_path, "SELECT count(*) FROM outbox WHERE status = 'dead'") == 1
    # Settled: the next start does not retry it.
    async with MemoryPipeline(settings) as again:
        await again.flush()
        assert again.stats().committed_turns == 0


async def test_opening_something_that_is_not_a_store_is_a_clear_error(tmp_path: Path) -> None:
    from hermes_async_memory import CorruptStoreError

    bogus = tmp_path / "notes.db"
    bogus.write_bytes(b"this is not a database" * 100)
    with pytest.raises(CorruptStoreError, match="not a SQLite database") as caught:
        async with MemoryPipeline(Settings(db_path=bogus)):
            pass
    assert caught.value.path == bogus
    assert bogus.read_bytes() == b"this is not a database" * 100, "left as it was"


def _replica_turn(i: int) -> Turn:
    """Turn ``i``, in one of five sessions, with 1 to 3 messages (a tool call in every
    third), so that turns differ in size and sessions interleave."""
    messages: list[tuple[str, str, str | None, str | None, str | None]] = [
        ("user", f"question {i}", None, None, None)]
    if i % 3 == 0:
        messages.append(("assistant", "", f'[{{"id": "c{i}", "name": "look"}}]', None, None))
        messages.append(("tool", f"result {i}", None, f"c{i}", "look"))
    elif i % 3 == 1:
        messages.append(("assistant", f"answer {i}", None, None, None))
    return Turn.build(key=f"k{i}", session_id=f"s{i % 5}", user_id=f"u{i % 2}",
                      accepted_at=1_700_000_000.0 + i, messages=messages,
                      metadata={"model": "m", "i": i} if i % 4 == 0 else None)


async def test_replica_turns_rebuilds_exactly_the_turns_asked_for(tmp_path: Path) -> None:
    """Invariant: every replica row asked for comes back as its whole turn (every message,
    in order, with its metadata), in the order asked; no turn between them comes back."""
    store = SqliteStore(tmp_path / "m.db")
    store.replica = "b"
    await store.open()
    try:
        committed = [_replica_turn(i) for i in range(300)]
        for start in range(0, len(committed), 70):  # several batches
            await store.commit(committed[start : start + 70])
        rows = await store.replica_pending("b", sessions=5, limit=1000)
        assert [r.turn_key for r in rows] == [t.key for t in committed]
        # Sparse and across batches: rows far apart, with many pending turns between them.
        wanted = [rows[i] for i in (0, 1, 57, 58, 140, 211, 299)]
        turns = await store.replica_turns(wanted)
        by_key = {t.key: t for t in committed}
        assert [t.key for t in turns] == [r.turn_key for r in wanted]
        for row, turn in zip(wanted, turns, strict=True):
            assert turn.seq == row.id and turn.first_id == row.first_id
            # all messages, in order, under the ids they were committed with
            assert turn.payload == by_key[row.turn_key].with_first_id(row.first_id).payload
        assert await store.replica_turns([]) == []
    finally:
        await store.aclose()


async def test_a_rollback_with_nothing_open_is_silent(tmp_path: Path) -> None:
    # BEGIN failed (the file was locked, say): the error that says so is the caller's to
    # raise; the ROLLBACK after it must neither raise nor log.
    async with aiosqlite.connect(tmp_path / "m.db", isolation_level=None) as db:
        with capture_logs() as logs:
            await rollback(db)
    assert logs == []


async def test_a_rollback_that_leaves_a_transaction_open_is_logged_with_its_traceback(
        tmp_path: Path) -> None:
    class StuckRollback:
        """A connection whose ROLLBACK fails inside an open transaction: a fault SQLite
        does not let a test cause."""

        in_transaction = True

        async def execute(self, sql: str) -> None:
            raise sqlite3.OperationalError(f"cannot {sql}")

    with capture_logs() as logs:
        await rollback(StuckRollback())  # type: ignore[arg-type]
    assert [(e["event"], e["log_level"], e.get("exc_info")) for e in logs] == [
        ("store_rollback_failed", "error", True)]


async def test_a_version_1_store_is_brought_up_to_date_at_open(tmp_path: Path) -> None:
    """Version 1 keyed recall requests and results by session alone; its rows are passing
    state, so the upgrade makes the tables anew, keyed by (session, user). Version 3 adds the
    key-value memory's tables."""
    db = tmp_path / "m.db"
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        mem.sync_turn("kept", "as is", session_id="s", user_id="u")
    conn = sqlite3.connect(db, isolation_level=None)
    conn.executescript("""
        DROP TABLE recall_requests; DROP TABLE recall_results;
        CREATE TABLE recall_requests (session_id TEXT PRIMARY KEY, user_id TEXT,
            query TEXT NOT NULL, after_id INTEGER NOT NULL, requested_at REAL NOT NULL);
        CREATE TABLE recall_results (session_id TEXT PRIMARY KEY, user_id TEXT,
            query TEXT NOT NULL, block TEXT NOT NULL, version INTEGER NOT NULL,
            updated_at REAL NOT NULL);
        INSERT INTO recall_requests VALUES ('default', 'a', 'q', 0, 0);
        DROP TABLE memories; DROP TABLE memories_fts;
        UPDATE schema_version SET version = 1;
    """)
    conn.close()

    store = SqliteStore(db)
    await store.open()
    try:
        await store.request_recall("default", "a", "first")
        await store.request_recall("default", "b", "second")
        await store.request_recall("default", None, "third")
        taken = await store.take_recall_requests(10)
        assert sorted((q, s, u) for s, u, q, _ in taken) == [
            ("first", "default", "a"), ("second", "default", "b"), ("third", "default", None)]
        assert [m["content"] for m in await store.get_messages("s")] == ["kept", "as is"]
        assert await store.memory_counts() == (0, 0)
    finally:
        await store.aclose()
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT version FROM schema_version").fetchone() == (SCHEMA_VERSION,)
    conn.close()


async def test_a_batch_whose_turns_took_their_ids_out_of_order_indexes_every_message(
        tmp_path: Path) -> None:
    """Turns whose message ids come out of order, overlapping none, with gaps (a producer's
    turns, an earlier run's) in one batch: every message is in the word index once, the
    CJK ones in the trigram index once, and no id the batch did not use is claimed."""
    firsts = [500, 10, 12, 300, 14, 16, 200, 700, 18]  # 2 messages each
    turns = [Turn.build(key=f"k{n}", session_id=f"s{n % 3}", user_id="u", accepted_at=1.0 + n,
                        messages=[("user", f"word{n} 質問{n}" if n % 2 else f"word{n}",
                                   None, None, None),
                                  ("assistant", f"reply{n}", None, None, None)],
                        metadata=None
                        ).with_first_id(first)
             for n, first in enumerate(firsts)]
    store = SqliteStore(tmp_path / "m.db")
    await store.open()
    try:
        await store.commit_batch(Batch.of(turns, store.source))
    finally:
        await store.aclose()
    db = tmp_path / "m.db"
    for n, first in enumerate(firsts):
        word = f"SELECT rowid FROM messages_fts WHERE messages_fts MATCH 'word{n} OR reply{n}'"
        assert sorted(r[0] for r in _rows(db, word)) == [first, first + 1], n
        cjk = f"SELECT rowid FROM messages_trgm WHERE messages_trgm MATCH '質問{n}'"
        assert [r[0] for r in _rows(db, cjk)] == ([first] if n % 2 else []), n
    assert _rows(db, "SELECT high FROM message_id_high") == [(701,)]


def _rows(db: Path, sql: str) -> list[tuple[object, ...]]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()
