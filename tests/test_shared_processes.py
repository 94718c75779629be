"""Three producer processes and one worker process on one store file, for real.

The worker is SIGKILLed while a batch of inbox turns is inside its transaction (holding the
file's write lock), then a new worker is started. Invariants, checked on every turn: each
turn a producer acknowledged is stored exactly once, in its session's accept order; no
producer's caller ever sees an error ("database is locked" included).
"""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import textwrap
from pathlib import Path

import anyio

from .helpers import stored_turns
from .processes import Spawn, Worker

PRODUCERS = 3
TURNS = 1500  # per producer
SESSIONS = 10  # per producer
WAIT_S = 120.0  # generous for a busy CI machine; nothing waits this long when things work

# A producer: accepts turns in bursts, as a gateway would, and prints each acknowledged key.
PRODUCER = textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    from hermes_async_memory import MemoryPipeline, Settings
    from hermes_async_memory.logs import configure_logging

    db, name, turns, sessions = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

    async def main():
        settings = Settings(db_path=db, role="producer", shared_poll_ms=5.0)
        async with MemoryPipeline(settings) as mem:
            for i in range(turns):
                try:
                    r = mem.sync_turn(f"{name} question {i}", f"answer {i}",
                                      session_id=f"{name}-s{i % sessions}", user_id=name)
                except Exception as exc:
                    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
                    raise
                print(json.dumps({"key": r.key, "session": r.session_id}), flush=True)
                if i % 50 == 49:
                    await asyncio.sleep(0)  # the gateway's other work: the writer runs
            await mem.flush(timeout=300)
        print(json.dumps({"done": turns}), flush=True)

    configure_logging(json=True)
    asyncio.run(main())
    """
)

# A worker whose third commit of inbox turns stops inside its transaction and says so.
STUCK_WORKER = textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    from hermes_async_memory import Settings
    from hermes_async_memory.logs import configure_logging
    from hermes_async_memory.store import SqliteStore
    from hermes_async_memory.worker.main import run

    commit = SqliteStore._commit_transaction
    calls = 0

    async def stuck_commit(self):
        global calls
        calls += 1
        if calls == 3:
            print(json.dumps({"in_commit": True}), flush=True)
            await asyncio.Event().wait()  # SIGKILL comes here: the transaction is open
        await commit(self)

    SqliteStore._commit_transaction = stuck_commit
    configure_logging(json=True)
    settings = Settings(db_path=Path(sys.argv[1]), role="worker", shared_poll_ms=5.0)
    asyncio.run(run(settings))
    """
)


async def read_producer(worker: Worker) -> tuple[list[tuple[str, str]], list[str], bool]:
    """(acknowledged (key, session) in order, errors, finished) from a producer's stdout."""
    assert worker.proc.stdout is not None
    acked: list[tuple[str, str]] = []
    errors: list[str] = []
    done = False
    async for line in worker.proc.stdout:
        rec = json.loads(line)
        if "key" in rec:
            acked.append((rec["key"], rec["session"]))
        elif "error" in rec:
            errors.append(rec["error"])
        elif "done" in rec:
            done = True
    return acked, errors, done


def count(db: Path, sql: str) -> int:
    conn = sqlite3.connect(db, timeout=30)
    try:
        return int(conn.execute(sql).fetchone()[0])
    finally:
        conn.close()


async def test_three_producers_one_worker_killed_mid_batch_lose_nothing(
    spawn: Spawn, tmp_path: Path
) -> None:
    db = tmp_path / "memory.db"
    (tmp_path / "producer.py").write_text(PRODUCER)
    (tmp_path / "stuck_worker.py").write_text(STUCK_WORKER)

    first = await spawn(str(tmp_path / "stuck_worker.py"), str(db))
    await first.log_line("worker_ready")
    producers = [
        await spawn(str(tmp_path / "producer.py"), str(db), f"p{n}", str(TURNS), str(SESSIONS))
        for n in range(PRODUCERS)
    ]
    readers = [asyncio.ensure_future(read_producer(p)) for p in producers]

    with anyio.fail_after(WAIT_S):
        assert first.proc.stdout is not None
        line = await first.proc.stdout.readline()
    assert json.loads(line) == {"in_commit": True}, "the worker stopped inside a commit"
    first.proc.send_signal(signal.SIGKILL)
    await first.proc.wait()

    second = await spawn("-m", "workers", "--db", str(db), "--log-format", "json")
    await second.log_line("worker_ready")
    with anyio.fail_after(WAIT_S):
        results = await asyncio.gather(*readers)
        for p in producers:
            assert await p.proc.wait() == 0
    acked = [pair for a, _, _ in results for pair in a]
    errors = [e for _, e, _ in results for e in e]
    assert errors == [], "no producer's caller saw an error"
    assert all(done for _, _, done in results)
    assert len(acked) == PRODUCERS * TURNS

    with anyio.fail_after(WAIT_S):  # the second worker drains what the producers handed in
        while count(db, "SELECT count(*) FROM inbox") > 0:  # noqa: ASYNC110 - another process
            await anyio.sleep(0.05)
    second.signal(signal.SIGTERM)
    assert await second.finish() == 0
    # The killed worker's claims were taken back at once (its process is gone), not after
    # the lease ran out.
    assert "inbox_leases_reclaimed" in second.events()

    stored = stored_turns(db)
    expected: dict[str, list[str]] = {}
    for key, session in acked:
        expected.setdefault(session, []).append(key)
    assert set(stored) == set(expected)
    for session, keys in expected.items():
        rows = stored[session]
        assert [k for k, role, _ in rows if role == "user"] == keys, (
            f"session {session}: each acknowledged turn once, in accept order"
        )
        assert [k for k, role, _ in rows if role == "assistant"] == keys
    assert count(db, "SELECT count(*) FROM outbox WHERE status = 'dead'") == 0
