"""A dead part is never invisible: a transient failure restarts it, any other puts the pipeline
in a failed state that health, stats, flush and every waiter report at once; the pipeline
still closes within its deadline, and what it accepted stays durable for the next start."""

from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

import anyio
import pytest

from hermes_async_memory import MemoryPipeline, PipelineFailedError, Settings
from hermes_async_memory.faults import Fault, classify
from hermes_async_memory.retry import Backoff
from hermes_async_memory.supervisor import Conditions, Supervisor

from .helpers import stored_turns


def corrupt_store(db: Path) -> None:
    """Overwrite every page of the store file but the first, as a failing disk would, after
    a write from another connection (so the pipeline's connections cannot trust their
    caches)."""
    other = sqlite3.connect(db, isolation_level=None)
    try:
        other.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        other.execute("CREATE TABLE IF NOT EXISTS poke (x)")
        other.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        other.close()
    size = db.stat().st_size
    with db.open("r+b") as f:
        f.seek(4096)
        f.write(os.urandom(size - 4096))


async def test_a_store_gone_bad_fails_the_pipeline_loudly_and_nothing_accepted_is_lost(
    tmp_path: Path,
) -> None:
    """Before: the writer died, sync_turn kept acknowledging, flush() waited for ever,
    aclose() raised an ExceptionGroup. Now the failed state names the part and the cause."""
    settings = Settings(db_path=tmp_path / "m.db", shutdown_deadline_s=0.5)
    async with MemoryPipeline(settings) as mem:
        for i in range(200):
            mem.sync_turn(f"before {i}", "r", session_id=f"s{i % 4}", user_id="u")
        await mem.flush()
        corrupt_store(settings.db_path)
        for i in range(50):
            mem.sync_turn(f"after {i}", "r", session_id="s0", user_id="u")
        with anyio.fail_after(10):
            failure = await mem.wait_failed()
        assert failure.part == "writer"
        assert classify(failure.cause) is Fault.FATAL
        assert mem.state == "failed"
        health = mem.health()
        assert not health.ok and "writer" in (health.reason or "")
        assert "malformed" in (health.reason or "")
        stats = mem.stats()
        assert stats.state == "failed" and stats.failure == str(failure)
        with anyio.fail_after(1), pytest.raises(PipelineFailedError):
            await mem.flush()
        with anyio.fail_after(1), pytest.raises(PipelineFailedError):
            await mem.flush(session_id="s1")
        # The outbox still makes a turn durable: it is accepted, for the next start.
        late = mem.sync_turn("late", "r", session_id="s0", user_id="u")
        assert late.seq == 251
        started = time.perf_counter()
    assert time.perf_counter() - started < 0.6, "aclose kept its deadline"
    assert mem.state == "closed"
    assert list(settings.outbox_dir.glob("*.seg"))


async def test_flush_waiters_are_told_at_once_when_the_pipeline_fails(tmp_path: Path) -> None:
    settings = Settings(db_path=tmp_path / "m.db")
    async with MemoryPipeline(settings) as mem:
        mem.sync_turn("first", "r", session_id="s")
        await mem.flush()
        corrupt_store(settings.db_path)
        outcome: list[BaseException] = []

        async def waiter() -> None:
            try:
                await mem.flush()
            except PipelineFailedError as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            tg.start_soon(waiter)
            for i in range(20):
                mem.sync_turn(f"more {i}", "r", session_id="s")
            with anyio.fail_after(10):
                await mem.wait_failed()
        assert len(outcome) == 2 and all(e is mem.failure for e in outcome)


def locked_db(tmp_path: Path) -> tuple[Path, sqlite3.Connection]:
    """A database file, and a connection holding its write lock (a real SQLITE_BUSY)."""
    db = tmp_path / "busy.db"
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("PRAGMA journal_mode = WAL")
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")
    return db, holder


async def run_until(supervisor: Supervisor, done: anyio.Event) -> None:
    """Run the supervisor's parts until ``done``."""
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(supervisor.run)
            await done.wait()
            tg.cancel_scope.cancel()


async def test_a_part_failing_for_a_transient_cause_is_restarted_with_backoff(
    tmp_path: Path,
) -> None:
    """A part that hits a locked database (a real SQLITE_BUSY) is restarted, not lost; one
    that fails for any other cause fails the pipeline, named."""
    db, holder = locked_db(tmp_path)
    tries: list[float] = []
    done = anyio.Event()
    failures: list[PipelineFailedError] = []
    conditions = Conditions()

    async def writes() -> None:
        tries.append(time.monotonic())
        conn = sqlite3.connect(db, isolation_level=None, timeout=0)
        try:
            if len(tries) == 3:
                holder.execute("COMMIT")  # the lock goes away: the third try succeeds
            conn.execute("INSERT INTO t VALUES (1)")
        finally:
            conn.close()
        done.set()

    async def breaks() -> None:
        raise KeyError("a bug")

    supervisor = Supervisor(backoff=Backoff(base_s=0.02, cap_s=0.1), conditions=conditions,
                            on_failure=failures.append)
    supervisor.add("writes", writes)
    supervisor.add("breaks", breaks)
    await run_until(supervisor, done)
    holder.close()
    assert supervisor.restarts["writes"] == 2
    assert tries[1] - tries[0] >= 0.01 and tries[2] - tries[1] >= 0.02, "it backed off"
    assert "writes_restarting" in conditions
    assert [f.part for f in failures] == ["breaks"]
    assert isinstance(failures[0].cause, KeyError)


async def test_a_part_with_a_task_group_of_its_own_is_judged_by_what_failed_inside_it(
    tmp_path: Path,
) -> None:
    """A part that runs a task group raises an exception group. A busy store inside one is
    still transient (restarted), and a failure names the error inside, not the group: the
    recall server's locked-store error once failed the whole worker as an "ExceptionGroup"."""
    db, holder = locked_db(tmp_path)
    tries: list[int] = []
    done = anyio.Event()
    failures: list[PipelineFailedError] = []

    async def insert() -> None:
        conn = sqlite3.connect(db, isolation_level=None, timeout=0)
        try:
            conn.execute("INSERT INTO t VALUES (1)")
        finally:
            conn.close()

    async def grouped_writes() -> None:
        tries.append(1)
        if len(tries) == 2:
            holder.execute("COMMIT")
        async with anyio.create_task_group() as tg:
            tg.start_soon(insert)
        done.set()

    async def grouped_bug() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(corrupt_read, db)

    supervisor = Supervisor(backoff=Backoff(base_s=0.01, cap_s=0.05), conditions=Conditions(),
                            on_failure=failures.append)
    supervisor.add("grouped_writes", grouped_writes)
    supervisor.add("grouped_bug", grouped_bug)
    await run_until(supervisor, done)
    holder.close()
    assert supervisor.restarts["grouped_writes"] == 1
    assert [f.part for f in failures] == ["grouped_bug"]
    assert isinstance(failures[0].cause, sqlite3.DatabaseError)
    assert "file is not a database" in str(failures[0]), "the error inside, named"


async def corrupt_read(db: Path) -> None:
    """A read that meets a damaged file, as a part would."""
    bad = db.with_name("bad.db")
    bad.write_bytes(b"SQLite format 3\x00" + os.urandom(8192))
    conn = sqlite3.connect(bad)
    try:
        conn.execute("SELECT * FROM sqlite_master").fetchall()
    finally:
        conn.close()


async def test_the_next_start_commits_what_a_failed_pipeline_accepted(tmp_path: Path) -> None:
    settings = Settings(db_path=tmp_path / "m.db", shutdown_deadline_s=0.2)
    async with MemoryPipeline(settings) as mem:
        kept = mem.sync_turn("kept", "r", session_id="s").key
        await mem.flush()
        backup = sqlite3.connect(tmp_path / "backup.db")
        source = sqlite3.connect(settings.db_path)
        source.backup(backup)  # the operator's backup, taken while it works
        source.close()
        backup.close()
        corrupt_store(settings.db_path)
        key = mem.sync_turn("accepted while failing", "r", session_id="s").key
        with anyio.fail_after(10):
            await mem.wait_failed()
    # The operator restores the store from the backup; the outbox still holds the turn.
    for extra in settings.db_path.parent.glob(settings.db_path.name + "-*"):
        extra.unlink()
    (tmp_path / "backup.db").replace(settings.db_path)
    async with MemoryPipeline(settings) as again:
        await again.flush()
    stored = stored_turns(settings.db_path)
    assert [k for k, role, _ in stored["s"] if role == "user"] == [kept, key]
