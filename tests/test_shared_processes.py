"""Three producer processes and one worker process on one store file, for real.

The worker is SIGKILLed while a batch of inbox turns is inside its transaction (holding the
file's write lock), then a new worker is started. Invariants, checked on every turn: each
turn a producer acknowledged is stored exactly once, in its session's accept order; no
producer's caller ever sees an error ("database is locked" included).
"""

from __future__ import annotations

import asyncio
import json
import random
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

    # The second worker drains what the producers handed in.
    await second.until(lambda: count(db, "SELECT count(*) FROM inbox") == 0, WAIT_S)
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


# A gateway that goes on with its sessions where an earlier run of it left off: each run
# numbers its turns from its own block, so stored turns show their accept order. With a
# kill point, it SIGKILLs itself there, as a crash would, with turns still in its slot.
RESTARTING_PRODUCER = textwrap.dedent(
    """
    import asyncio, json, os, signal, sys
    from pathlib import Path
    from hermes_async_memory import MemoryPipeline, Settings
    from hermes_async_memory.logs import configure_logging

    db, name, first, turns, sessions, kill_at = (
        Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]),
        int(sys.argv[6]))

    async def main():
        settings = Settings(db_path=db, role="producer", shared_poll_ms=5.0)
        async with MemoryPipeline(settings) as mem:
            print(json.dumps({"slot": str(mem.outbox_dir)}), flush=True)
            for i in range(first, first + turns):
                if i - first == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                r = mem.sync_turn(f"{name} turn {i}", f"answer {i}",
                                  session_id=f"{name}-s{i % sessions}", user_id=name)
                print(json.dumps({"session": r.session_id, "i": i}), flush=True)
                if i % 20 == 19:
                    await asyncio.sleep(0)  # the gateway's other work: the writer runs
            await mem.flush(timeout=300)
        print(json.dumps({"done": turns}), flush=True)

    configure_logging(json=True, level="warning")  # stderr; nobody reads it until the end
    asyncio.run(main())
    """
)
ROUNDS = 5
ROUND_TURNS = 600
BLOCK = 100_000  # turn numbers of run r start at r * BLOCK


async def run_producer(proc: Worker) -> tuple[str, list[tuple[str, int]], int, int]:
    """(its slot, the acknowledged (session, turn number) in order, its exit code, the turns
    it handed in from slots that gone producers left)."""
    slot = str((await proc.stdout_json())["slot"])
    assert proc.proc.stdout is not None
    acked = []
    async for line in proc.proc.stdout:
        rec = json.loads(line)
        if "i" in rec:
            acked.append((rec["session"], rec["i"]))
    code = await proc.finish()
    handed = sum(int(r.get("turns", 0)) for r in proc.logs
                 if r.get("event") == "producer_slot_adopted")
    return slot, acked, code, handed


async def test_per_session_order_holds_across_producer_kills_and_restarts_into_any_slot(
    spawn: Spawn, tmp_path: Path
) -> None:
    """Invariant, checked on every session: the stored turns are in accept order, and every
    acknowledged turn is stored exactly once. Each round every producer SIGKILLs itself at a
    random point, with turns still in its slot, and all restart at once: a restarted producer
    lands in another slot while its old slot is handed in."""
    rng = random.Random(9)
    db = tmp_path / "memory.db"
    script = tmp_path / "producer.py"
    script.write_text(RESTARTING_PRODUCER)
    worker = await spawn("-m", "workers", "--db", str(db), "--log-format", "json")
    await worker.log_line("worker_ready")

    acked: dict[str, list[int]] = {}  # session -> acknowledged turn numbers, in accept order
    slots: dict[str, list[str]] = {f"p{n}": [] for n in range(PRODUCERS)}
    handed_in = 0
    for round_ in range(ROUNDS + 1):
        last = round_ == ROUNDS
        running = [
            await spawn(str(script), str(db), name, str(round_ * BLOCK), str(ROUND_TURNS),
                        str(SESSIONS), str(-1 if last else rng.randrange(50, ROUND_TURNS)))
            for name in slots
        ]
        with anyio.fail_after(WAIT_S):
            results = await asyncio.gather(*(run_producer(p) for p in running))
        for name, (slot, turns, code, handed) in zip(slots, results, strict=True):
            slots[name].append(slot)
            handed_in += handed
            assert code == (0 if last else -signal.SIGKILL)
            for session, i in turns:
                acked.setdefault(session, []).append(i)
    moved = [name for name, seen in slots.items() if len(set(seen)) > 1]
    assert moved, f"some producer restarted into another slot: {slots}"
    assert handed_in, "restarted producers handed in turns their killed runs left"

    # The worker drains what was handed in.
    await worker.until(lambda: count(db, "SELECT count(*) FROM inbox") == 0, WAIT_S)
    worker.signal(signal.SIGTERM)
    assert await worker.finish() == 0

    stored = stored_turns(db)
    for session, numbers in acked.items():
        got = [int(text.rsplit(" ", 1)[1]) for _, role, text in stored[session]
               if role == "user"]
        assert got == sorted(got) and len(got) == len(set(got)), (
            f"session {session}: stored in accept order, each once: {got}")
        assert set(numbers) <= set(got), f"session {session}: acknowledged turns lost"
