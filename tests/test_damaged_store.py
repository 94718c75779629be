"""A damaged store file: a start that fails raises a typed error and leaves nothing behind
(the process exits when its main returns), read-only opens never keep a process alive, and
the worker prints one line and exits 1 for every kind of damage. Each in a real subprocess,
with a deadline: a process left hanging is the failure these tests look for."""

from __future__ import annotations

import os
import sqlite3
import textwrap
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from hermes_async_memory import CorruptStoreError, MemoryPipeline, PipelineFailedError, Settings

from .processes import Spawn

# A process that has nothing left to do exits in well under a second; this only bounds a hang.
EXIT_DEADLINE_S = 30.0


async def store_with_turns(db: Path, turns: int = 300) -> None:
    """A real store holding ``turns`` committed turns, its WAL folded into the file (so the
    pages overwritten next are the ones that hold them)."""
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        for i in range(turns):
            mem.sync_turn(f"question {i} about zebras in lisbon " * 8, f"answer {i} " * 20,
                          session_id=f"s{i % 5}", user_id="u")
        await mem.flush()
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        conn.close()


def garbage_pages(db: Path) -> None:
    """Every page after the first holds random bytes; the header and schema page are intact."""
    size = db.stat().st_size
    with db.open("r+b") as f:
        f.seek(4096)
        f.write(os.urandom(size - 4096))


def garbage_header(db: Path) -> None:
    with db.open("r+b") as f:
        f.write(os.urandom(100))


def truncated(db: Path) -> None:
    os.truncate(db, db.stat().st_size // 3)


def truncated_inside_first_page(db: Path) -> None:
    os.truncate(db, 1000)


def foreign(db: Path) -> None:
    db.unlink()
    conn = sqlite3.connect(db)
    try:
        conn.execute("CREATE TABLE notes (id INTEGER PRIMARY KEY, body TEXT)")
        conn.execute("INSERT INTO notes (body) VALUES ('not a memory store')")
        conn.commit()
    finally:
        conn.close()


def a_directory(db: Path) -> None:
    db.unlink()
    db.mkdir()


def garbage_table(db: Path, table: str) -> int:
    """Random bytes over every page of ``table`` (per SQLite's dbstat); how many pages."""
    conn = sqlite3.connect(db)
    try:
        page_bytes = conn.execute("PRAGMA page_size").fetchone()[0]
        pages = [r[0] for r in conn.execute("SELECT pageno FROM dbstat WHERE name = ?",
                                            (table,))]
    finally:
        conn.close()
    with db.open("r+b") as f:
        for page in pages:
            f.seek((page - 1) * page_bytes)
            f.write(os.urandom(page_bytes))
    return len(pages)


def garbage_word_index(db: Path) -> None:
    """Only the word index's pages: the schema, the migrations and the highest ids read
    fine; the start fails later, at its read of the frequent terms."""
    assert garbage_table(db, "messages_fts_data") > 5


@pytest.mark.parametrize("damage", ["every page after the first", "the word index"])
async def test_a_start_that_fails_on_damaged_pages_raises_typed_and_the_process_exits(
    spawn: Spawn, tmp_path: Path, damage: str
) -> None:
    """Before: start() raised a raw sqlite3.DatabaseError and the process never exited (the
    store's connection threads outlived it). Now CorruptStoreError, and once main returns
    no thread of the library is left: the interpreter exits by itself. The word index case
    fails late in the start (the frequent-terms read), after every connection was open."""
    db = tmp_path / "m.db"
    await store_with_turns(db)
    (garbage_pages if damage == "every page after the first" else garbage_word_index)(db)
    script = textwrap.dedent(f"""
        import asyncio, threading
        from hermes_async_memory import MemoryPipeline, Settings

        async def main():
            mem = MemoryPipeline(Settings(db_path={str(db)!r}))
            try:
                await mem.start()
            except Exception as exc:
                print("raised", type(exc).__module__, type(exc).__name__, exc, flush=True)
            else:
                print("started", flush=True)
            print("state", mem.state, flush=True)

        asyncio.run(main())
        # A closed connection's thread ends a moment after its close returned: wait for
        # each with a deadline; one still alive then would never end.
        left = [t for t in threading.enumerate()
                if t is not threading.main_thread() and not t.daemon]
        for t in left:
            t.join(timeout=10)
        print("threads", [t.name for t in left if t.is_alive()], flush=True)
    """)
    child = await spawn("-c", script)
    assert await child.finish(EXIT_DEADLINE_S) == 0
    lines = child.stdout.splitlines()
    assert lines[0].startswith("raised hermes_async_memory.errors CorruptStoreError "), lines
    assert "malformed" in lines[0]
    assert lines[1] == "state new"  # nothing opened: a later start() may try again
    # Only anyio's idle worker thread may remain (it ends with the interpreter).
    assert lines[2] in ("threads []", "threads ['AnyIO worker thread']"), lines[2]


def garbage_message_leaves(db: Path) -> int:
    """Random bytes over the middle half of the messages table's leaf pages: pages a start
    does not read. Returns how many pages."""
    conn = sqlite3.connect(db)
    try:
        page_bytes = conn.execute("PRAGMA page_size").fetchone()[0]
        leaves = [r[0] for r in conn.execute(
            "SELECT pageno FROM dbstat WHERE name = 'messages' AND pagetype = 'leaf' "
            "ORDER BY pageno")]
    finally:
        conn.close()
    chosen = leaves[len(leaves) // 4 : len(leaves) * 3 // 4]
    with db.open("r+b") as f:
        for page in chosen:
            f.seek((page - 1) * page_bytes)
            f.write(os.urandom(page_bytes))
    return len(chosen)


async def test_damage_a_start_does_not_read_fails_the_pipeline_at_the_first_read(
    tmp_path: Path
) -> None:
    """A start reads what it needs, not every page (a full check costs ~16 s a GB cold; see
    docs/how-it-works.md). Damaged pages it did not read are found by the first read that
    reaches them: the read raises CorruptStoreError, typed, and the pipeline goes to its
    failed state with the cause, instead of answering reads with raw sqlite3 errors while
    health says all is well."""
    db = tmp_path / "m.db"
    await store_with_turns(db, turns=1500)
    assert garbage_message_leaves(db) >= 10
    async with MemoryPipeline(Settings(db_path=db, shutdown_deadline_s=1.0)) as mem:
        assert mem.health().ok
        with pytest.raises(CorruptStoreError, match="malformed"):
            for session in range(5):
                await mem.get_messages(f"s{session}")
        assert mem.state == "failed"
        health = mem.health()
        assert not health.ok and "malformed" in (health.reason or "")
        with anyio.fail_after(5), pytest.raises(PipelineFailedError):
            await mem.flush()


@pytest.mark.parametrize("opener", ["store", "session_reads", "store_reader"])
async def test_a_read_only_open_left_open_never_keeps_the_process_alive(
    spawn: Spawn, tmp_path: Path, opener: str
) -> None:
    """A tool opens the store read-only and returns without closing it: the process still
    exits (the read-only connections' threads are daemons)."""
    db = tmp_path / "m.db"
    await store_with_turns(db, turns=5)
    script = textwrap.dedent(f"""
        import asyncio, sys
        from pathlib import Path
        from hermes_async_memory.sessions import open_session_reads
        from hermes_async_memory.store import SqliteStore
        from hermes_async_memory.store.inspect import StoreReader

        KEEP = []  # strongly referenced: nothing closes them

        async def main():
            path = Path({str(db)!r})
            if {opener!r} == "store":
                store = SqliteStore(path, readers=2)
                await store.open_readonly()
                KEEP.append(store)
                async with store.reader() as conn:
                    async with conn.execute("SELECT count(*) FROM messages") as cur:
                        print("messages", (await cur.fetchone())[0], flush=True)
            elif {opener!r} == "session_reads":
                opened = open_session_reads(path)
                reads = await opened.__aenter__()
                KEEP.extend([opened, reads])
                print("messages", (await reads.counts()).messages, flush=True)
            else:
                reader = StoreReader(path)
                KEEP.append(reader)
                print("messages", reader.status().messages, flush=True)

        asyncio.run(main())
    """)
    child = await spawn("-c", script)
    assert await child.finish(EXIT_DEADLINE_S) == 0, child.logs
    assert child.stdout.split() == ["messages", "10"]


DAMAGE: dict[str, Callable[[Path], None]] = {
    "pages hold random bytes": garbage_pages,
    "header holds random bytes": garbage_header,
    "truncated to a third": truncated,
    "truncated inside its first page": truncated_inside_first_page,
    "another program's SQLite database": foreign,
    "a directory": a_directory,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
async def test_the_worker_prints_one_line_and_exits_1_for_a_damaged_store(
    spawn: Spawn, tmp_path: Path, damage: str
) -> None:
    db = tmp_path / "m.db"
    await store_with_turns(db, turns=100)
    DAMAGE[damage](db)
    child = await spawn("-m", "hermes_async_memory.cli", "worker", "--db", str(db),
                        "--log-format", "json")
    assert await child.finish(EXIT_DEADLINE_S) == 1
    plain = [rec["raw"] for rec in child.logs if rec["event"] is None]
    assert len(plain) == 1, child.logs
    assert plain[0].startswith("hermes-memory worker: error: ")
    assert str(db) in plain[0]
    assert "Traceback" not in "".join(str(rec) for rec in child.logs)
