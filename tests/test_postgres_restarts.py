"""A PostgreSQL restart is a non-event: a real server stopped (``pg_ctl stop -m fast``) and
started again, over and over, under load, while a gateway writes through the library, a
``hermes-memory worker`` process runs the shared jobs, and a job runner finishes probe jobs
in its handlers' transactions.

Invariants, checked on every item at the end:
- turns: every accepted turn is stored in PostgreSQL once, in its session's accept order
  (0 lost, 0 duplicated, 0 out of order), with no replica attempt spent on an outage;
- jobs: every probe job completes exactly once (its effect row is there once), and the job
  queue is empty (no job left queued, running or dead);
- processes: no pipeline part failed, the worker process never exited (it exits 0 on
  SIGTERM at the end), and every line it wrote to stderr is one JSON object.

Between restarts the test waits on state (a probe job started; the parts resumed), never on
a timer.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import signal
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from asyncpg import Pool, Record
from structlog.testing import capture_logs

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.postgres.jobs import Job, complete_in, enqueue
from hermes_async_memory.postgres.worker import JobWorker

from .pg_server import PostgresServer, upgraded_pool
from .processes import Worker

Spawn = Callable[..., Awaitable[Worker]]

WAIT_S = 60.0
RESTARTS = 20
SESSIONS = 6
PROBES_PER_CYCLE = 4
PROBE = "restart_probe"
# The probe's work inside its transaction: long enough for a stop to catch a job mid-run.
PROBE_WORK_S = 0.2
FINISHED = """CREATE TABLE IF NOT EXISTS probe_done (
    key text NOT NULL, owner text NOT NULL, at timestamptz NOT NULL DEFAULT now())"""


@pytest.fixture
async def db(pg_dsn: str) -> AsyncIterator[Pool[Record]]:
    """The test's database, upgraded, with a pool for the test's own look into it."""
    async with upgraded_pool(pg_dsn, FINISHED) as pool:
        yield pool


class Load:
    """The gateway's writers: rounds of one turn per session, each round committed locally
    before the next (``flush``), until stopped or ``limit`` rounds; what was accepted, per
    session, in order."""

    def __init__(self, mem: MemoryPipeline) -> None:
        self.mem = mem
        self.sent: dict[str, list[str]] = {f"s{i}": [] for i in range(SESSIONS)}
        self.rounds = 0
        self.stop = asyncio.Event()
        self.limit: int | None = None

    async def run(self) -> None:
        for i in itertools.count():
            if self.stop.is_set() or (self.limit is not None and self.rounds >= self.limit):
                return
            for s, texts in self.sent.items():
                text = f"{s} turn {i} about harbour lanterns"
                self.mem.sync_turn(text, f"reply {i}", session_id=s, user_id="alice")
                texts.append(text)
            if i % 5 == 0:  # a recall, a shared job the worker process answers
                self.mem.queue_prefetch(f"lanterns {i}", session_id="s0", user_id="alice")
            await self.mem.flush(timeout=WAIT_S)
            self.rounds += 1


class Probes:
    """Probe jobs: each handler run does its work and records its effect in the transaction
    that completes the job, so a job's effect is there once or not at all."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.started: set[str] = set()  # keys of jobs whose handler ran
        self.changed = asyncio.Event()

    async def handler(self, pool: Pool[Record], job: Job) -> None:
        self.started.add(str(job.key))
        self.changed.set()
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute("SELECT pg_sleep($1)", PROBE_WORK_S)
            await conn.execute("INSERT INTO probe_done (key, owner) VALUES ($1, $2)",
                               job.key, job.owner)
            await complete_in(conn, job)
        self.changed.set()

    async def queue(self, pool: Pool[Record], cycle: int) -> None:
        for n in range(PROBES_PER_CYCLE):
            key = f"probe-{cycle}-{n}"
            assert await enqueue(pool, PROBE, "{}", key=key) is not None
            self.keys.append(key)


async def on_state(check: Callable[[], Awaitable[bool]], *events: asyncio.Event,
                   timeout_s: float = WAIT_S) -> None:
    """Wait until ``check()`` holds, looked at again each time one of ``events`` is set
    (or a change of the pipeline's wakes them)."""
    with anyio.fail_after(timeout_s):
        while True:
            for e in events:
                e.clear()
            if await check():
                return
            waits = [asyncio.ensure_future(e.wait()) for e in events]
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()


async def pg(fn: Callable[[], None]) -> None:
    """``pg_ctl`` blocks: run it in a thread, so the parts keep running meanwhile."""
    await anyio.to_thread.run_sync(fn)


def listening_since(worker: Worker, mark: int) -> bool:
    """The worker process's job runner listens again since its log line ``mark``."""
    return any(rec.get("event") == "postgres_listening" and "hermes_jobs" in rec.get(
        "channels", ()) for rec in worker.logs[mark:])


async def start_worker(spawn: Spawn, tmp_path: Path, dsn: str) -> Worker:
    env = {"HERMES_MEMORY_BACKEND": "postgres", "HERMES_MEMORY_POSTGRES_DSN": dsn}
    worker = await spawn("-m", "hermes_async_memory.cli", "worker",
                         "--db", str(tmp_path / "w" / "memory.db"), "--log-format", "json",
                         "--http", "127.0.0.1:0", env=env)
    await worker.until(lambda: listening_since(worker, 0), WAIT_S)
    return worker


def gateway_settings(tmp_path: Path, dsn: str) -> Settings:
    # Few attempts: an outage that spent them would make dead letters, and lose turns.
    return Settings(db_path=tmp_path / "g" / "memory.db", backend="postgres",
                    postgres_dsn=dsn, postgres_recall_jobs=True, replica_max_attempts=3,
                    postgres_job_lease_s=30.0)


async def replicated(mem: MemoryPipeline) -> None:
    await mem.flush(timeout=WAIT_S)
    with anyio.fail_after(WAIT_S):
        while True:
            mark = mem.change_mark()
            if (await mem.store.replica_counts("postgres")) == (0, 0):
                return
            await mem.next_change(since=mark)


async def check_turns(db: Pool[Record], sent: dict[str, list[str]]) -> None:
    """0 lost, 0 duplicated, 0 out of order: each session's stored user texts are exactly
    what was accepted, in accept order."""
    rows = await db.fetch("SELECT session_id, content FROM messages WHERE role = 'user' "
                          "ORDER BY session_id, seq, ordinal")
    stored: dict[str, list[str]] = {}
    for r in rows:
        stored.setdefault(r["session_id"], []).append(r["content"])
    lost = dup = disorder = 0
    for s, texts in sent.items():
        got = stored.get(s, [])
        counts = Counter(got)
        lost += sum(1 for t in texts if t not in counts)
        dup += sum(n - 1 for n in counts.values() if n > 1)
        firsts = [t for t in dict.fromkeys(got) if t in set(texts)]
        disorder += sum(1 for a, b in zip(firsts, [t for t in texts if t in counts],
                                          strict=True) if a != b)
    assert (lost, dup, disorder) == (0, 0, 0), (lost, dup, disorder)
    assert stored.keys() == sent.keys()
    assert sum(map(len, sent.values())) == len(rows)


async def check_jobs(db: Pool[Record], probes: Probes) -> None:
    """Every probe job's effect is there exactly once, and nothing is left in the queue."""
    done = Counter(r["key"] for r in await db.fetch("SELECT key FROM probe_done"))
    assert set(done) == set(probes.keys), set(probes.keys) ^ set(done)
    assert [k for k, n in done.items() if n != 1] == []
    left = await db.fetch("SELECT kind, status, count(*) AS n FROM jobs GROUP BY 1, 2")
    assert [tuple(r) for r in left] == []


def check_worker_logs(worker: Worker) -> None:
    raw = [rec["raw"] for rec in worker.logs if rec.get("event") is None]
    assert raw == [], raw[:5]  # every stderr line is one JSON object
    events = Counter(worker.events())
    for bad in ("pipeline_part_failed", "replica_write_failed", "job_dead", "job_left_leased",
                "worker_failed"):
        assert events[bad] == 0, [r for r in worker.logs if r.get("event") == bad][:3]


def worker_health(worker: Worker) -> dict[str, Any]:
    [listening] = [rec for rec in worker.logs if rec.get("event") == "http_listening"]
    url = f"http://127.0.0.1:{listening['port']}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return dict(json.loads(answer.read().decode()))
    except urllib.error.HTTPError as exc:  # 503 while not ok: the body says why
        return dict(json.loads(exc.read().decode()))


@pytest.mark.slow
async def test_twenty_restarts_under_load_lose_nothing_and_fail_nothing(
        tmp_path: Path, pg_server: PostgresServer, pg_dsn: str, db: Pool[Record],
        spawn: Spawn) -> None:
    worker = await start_worker(spawn, tmp_path, pg_dsn)
    probes = Probes()
    jobs = JobWorker(Settings(postgres_dsn=pg_dsn, postgres_job_concurrency=4),
                     {PROBE: probes.handler})
    durations: list[float] = []
    with capture_logs() as logs:
        async with MemoryPipeline(gateway_settings(tmp_path, pg_dsn)) as mem, \
                anyio.create_task_group() as tg:
            load = Load(mem)
            tg.start_soon(load.run)
            tg.start_soon(jobs.run)
            changed = asyncio.Event()
            mem_changes = asyncio.ensure_future(_pipeline_changes(mem, changed))

            async def resumed(cycle: int) -> bool:
                # Every probe queued before this cycle is done (the runner resumed, and
                # handed back what the stop cut short), the gateway replicated turns
                # accepted since the restart, and the worker process listens again.
                done = await db.fetchval("SELECT count(*) FROM probe_done")
                return (done >= cycle * PROBES_PER_CYCLE and mem.backend.available()
                        and mem.stats().replicated_turns > replicated_before
                        and listening_since(worker, worker_mark))

            for cycle in range(RESTARTS):
                await probes.queue(db, cycle)
                # Stop while a probe of this cycle runs: its job is cut short mid-run.
                await on_state(functools.partial(_any_started, probes, cycle), probes.changed)
                replicated_before = mem.stats().replicated_turns
                worker_mark = len(worker.logs)
                started = time.monotonic()
                await pg(lambda: pg_server.stop(mode="fast"))
                await pg(pg_server.start)
                await on_state(functools.partial(resumed, cycle + 1), probes.changed, changed)
                durations.append(time.monotonic() - started)
                assert mem.failure is None and mem.health().ok, mem.health()
                assert worker.proc.returncode is None, worker.logs[-5:]
            load.stop.set()
            await replicated(mem)
            await on_state(lambda: _all_done(db, probes), probes.changed, changed)
            await on_state(lambda: _queue_empty(db), probes.changed, changed)
            mem_changes.cancel()
            assert mem.failure is None
            stats = mem.stats()
            tg.cancel_scope.cancel()
    assert stats.replica_dead == 0
    gateway_events = Counter(e["event"] for e in logs)
    assert gateway_events["replica_write_failed"] == 0
    assert gateway_events["pipeline_part_failed"] == 0
    assert gateway_events["postgres_down"] >= 1  # the outages were seen
    await check_turns(db, load.sent)
    await check_jobs(db, probes)
    assert jobs.counts["completed"] >= len(probes.keys)
    assert jobs.counts["cut_short"] >= 1  # stops did catch jobs mid-run
    assert jobs.counts["failed"] == 0 and jobs.counts["dead"] == 0

    assert worker.proc.returncode is None  # never exited
    worker.signal(signal.SIGTERM)
    assert await worker.finish() == 0
    check_worker_logs(worker)
    [stopped] = [r for r in worker.logs if r.get("event") == "worker_stopped"]
    assert stopped["jobs"]["failed"] == 0 and stopped["jobs"]["dead"] == 0
    pg_server.assert_no_password(json.dumps(worker.logs))
    print(f"\n{RESTARTS} restarts, {load.rounds} rounds of {SESSIONS} turns; restart to "
          f"resumed: median {sorted(durations)[len(durations) // 2]:.2f} s, "
          f"max {max(durations):.2f} s; probe jobs cut short by a stop and handed back: "
          f"{jobs.counts['cut_short']}")


async def _any_started(probes: Probes, cycle: int) -> bool:
    return any(k.startswith(f"probe-{cycle}-") for k in probes.started)


async def _all_done(db: Pool[Record], probes: Probes) -> bool:
    return bool(await db.fetchval("SELECT count(*) FROM probe_done") >= len(probes.keys))


async def _queue_empty(db: Pool[Record]) -> bool:
    return bool(await db.fetchval("SELECT count(*) FROM jobs") == 0)


async def _pipeline_changes(mem: MemoryPipeline, changed: asyncio.Event) -> None:
    """Set ``changed`` on each change of the pipeline (a commit, a replica write)."""
    while True:
        mark = mem.change_mark()
        await mem.next_change(since=mark)
        changed.set()


OUTAGE_S = 60.0
OUTAGE_ROUNDS = 300


@pytest.mark.slow
async def test_a_sixty_second_outage_is_waited_out_and_shown_in_health(
        tmp_path: Path, pg_server: PostgresServer, pg_dsn: str, db: Pool[Record],
        spawn: Spawn) -> None:
    """For a minute without the database: the gateway keeps accepting and committing
    locally, health shows the outage in both processes (ok all along), nothing fails or
    exits; once the server is back, everything resumes by itself and nothing is lost."""
    worker = await start_worker(spawn, tmp_path, pg_dsn)
    probes = Probes()
    jobs = JobWorker(Settings(postgres_dsn=pg_dsn), {PROBE: probes.handler})
    with capture_logs() as logs:
        async with MemoryPipeline(gateway_settings(tmp_path, pg_dsn)) as mem, \
                anyio.create_task_group() as tg:
            load = Load(mem)
            tg.start_soon(load.run)
            tg.start_soon(jobs.run)
            await probes.queue(db, 0)
            await on_state(functools.partial(_any_started, probes, 0), probes.changed)
            mark = len(worker.logs)
            await pg(lambda: pg_server.stop(mode="fast"))
            try:
                # The outage itself lasts a minute (the load runs all along); the checks
                # below wait on state.
                # Writes go on meanwhile, committed locally (a bounded number: the backlog
                # is replicated after, within the test's time).
                load.limit = load.rounds + OUTAGE_ROUNDS
                await mem.wait_until(lambda: "replica_unavailable" in mem.health().conditions,
                                     timeout=WAIT_S)
                await anyio.sleep(OUTAGE_S)
                assert load.rounds == load.limit  # accepted and committed locally
                health = mem.health()
                assert health.ok and "replica_unavailable" in health.conditions, health
                await worker.until(lambda: any(
                    r.get("event") == "condition_raised"
                    and r.get("condition") == "jobs_database_unavailable"
                    for r in worker.logs[mark:]), WAIT_S)
                seen = await anyio.to_thread.run_sync(worker_health, worker)
                assert seen["status"] == "ok" and seen["state"] == "open", seen
                assert "jobs_database_unavailable" in seen["conditions"], seen
                assert worker.proc.returncode is None and mem.failure is None
            finally:
                await pg(pg_server.start)
            await worker.until(lambda: listening_since(worker, mark), WAIT_S)
            await worker.until(lambda: any(
                r.get("event") == "condition_cleared"
                and r.get("condition") == "jobs_database_unavailable"
                for r in worker.logs[mark:]), WAIT_S)
            load.stop.set()
            await replicated(mem)
            changed = asyncio.Event()
            mem_changes = asyncio.ensure_future(_pipeline_changes(mem, changed))
            await on_state(lambda: _all_done(db, probes), probes.changed, changed)
            await on_state(lambda: _queue_empty(db), probes.changed, changed)
            mem_changes.cancel()
            assert mem.failure is None
            assert "replica_unavailable" not in mem.health().conditions
            stats = mem.stats()
            tg.cancel_scope.cancel()
    assert stats.replica_dead == 0
    assert Counter(e["event"] for e in logs)["replica_write_failed"] == 0
    await check_turns(db, load.sent)
    await check_jobs(db, probes)
    seen = await anyio.to_thread.run_sync(worker_health, worker)
    assert "jobs_database_unavailable" not in seen["conditions"], seen
    worker.signal(signal.SIGTERM)
    assert await worker.finish() == 0
    check_worker_logs(worker)


GATEWAY_STARTS = 5


async def test_a_restart_while_a_gateway_starts_does_not_fail_it(
        tmp_path: Path, pg_server: PostgresServer, pg_dsn: str, db: Pool[Record]) -> None:
    """The server restarts while a gateway opens (its pool, its schema check, its
    listeners): the gateway starts all the same, accepts at once, and replicates every
    turn once in order when the server is back; five starts, each racing a restart."""
    sent: dict[str, list[str]] = {}
    for start in range(GATEWAY_STARTS):
        restart = asyncio.ensure_future(
            anyio.to_thread.run_sync(pg_server.restart))
        try:
            async with MemoryPipeline(gateway_settings(tmp_path, pg_dsn)) as mem:
                for i in range(20):
                    text = f"start {start} turn {i} about harbour lanterns"
                    mem.sync_turn(text, "noted", session_id=f"g{start % 2}", user_id="alice")
                    sent.setdefault(f"g{start % 2}", []).append(text)
                await restart
                assert mem.failure is None and mem.health().ok, mem.health()
                await replicated(mem)
                assert mem.failure is None
        finally:
            await restart
    await check_turns(db, sent)
