"""Shared jobs run by job runners against a real server: every job completed exactly once
among concurrent runners and across a worker process SIGKILLed while it held leases; an
idle runner does not poll, a NOTIFY wakes it and a delayed job is claimed at its time; a
lease taken over stops the handler that lost it; and a gateway's recalls answered by a
worker from PostgreSQL, the latest query winning while queued, the local recall answering
while the database is down."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
from asyncpg import Pool, Record

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.postgres import open_pool
from hermes_async_memory.postgres.jobs import JOBS_CHANNEL, Job, complete_in, enqueue
from hermes_async_memory.postgres.listen import Listener
from hermes_async_memory.postgres.recall_jobs import (
    RECALL_KIND,
    RECALLS_CHANNEL,
    JobRecaller,
    recall_key,
    recall_payload,
)
from hermes_async_memory.postgres.worker import Handler, JobRunner, default_handlers
from hermes_async_memory.retry import Backoff

from .pg_server import PostgresServer, free_port, upgraded_pool
from .processes import Spawn, Worker

WAIT_S = 30.0
IDLE_S = 30.0  # an idle runner's longest sleep here: far longer than any wait below

FINISHED = """
CREATE TABLE finished (
    job_id bigint PRIMARY KEY,  -- a second completion of a job is an error
    owner text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE starts (
    job_id bigint NOT NULL,
    owner text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""


async def scrape_until(url: str, wanted: str) -> str:
    """The worker's /metrics once it holds ``wanted``: scraped again, a scrape apart, until
    it does (a metric moves just after what a test can wait on), within WAIT_S."""
    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return str(answer.read().decode())

    with anyio.fail_after(WAIT_S):
        while True:
            metrics = await anyio.to_thread.run_sync(scrape)
            if wanted in metrics:
                return metrics
            await anyio.sleep(0.05)


@pytest.fixture
async def db(pg_dsn: str) -> AsyncIterator[Pool[Record]]:
    """The test's database, upgraded, with a pool for the test's own look into it."""
    async with upgraded_pool(pg_dsn, FINISHED) as pool:
        yield pool


async def queued(pool: Pool[Record], kind: str, payload: str) -> int:
    job_id = await enqueue(pool, kind, payload)
    assert job_id is not None
    return job_id


async def finish(pool: Pool[Record], job: Job) -> None:
    """A handler's effect, committed with the job's completion."""
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("INSERT INTO finished (job_id, owner) VALUES ($1, $2)",
                           job.id, job.owner)
        await complete_in(conn, job)


@asynccontextmanager
async def runner(dsn: str, handlers: Mapping[str, Handler], *, owner: str,
                 lease_s: float = 30.0, concurrency: int = 4) -> AsyncIterator[JobRunner]:
    """A runner with its own pool and listener (as another process would have), running
    and listening when entered; stopped at the end."""
    settings = Settings(postgres_dsn=dsn, postgres_pool_max_size=12)
    async with open_pool(settings) as pool:
        listener = Listener(settings, backoff=Backoff())
        connected = asyncio.Event()
        listener.on_connect(connected.set)
        jobs = JobRunner(pool, handlers, owner=owner, lease_s=lease_s,
                         concurrency=concurrency, listener=listener, max_idle_s=IDLE_S)
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.run)
            tg.start_soon(jobs.run)
            with anyio.fail_after(WAIT_S):
                await connected.wait()
            yield jobs
            tg.cancel_scope.cancel()


async def until(check: Callable[[], Awaitable[bool]], event: asyncio.Event) -> None:
    """Wait until ``check()`` holds, looked at again each time ``event`` is set."""
    with anyio.fail_after(WAIT_S):
        while True:
            event.clear()
            if await check():
                return
            await event.wait()


async def test_two_runners_complete_each_of_200_jobs_exactly_once(
        pg_dsn: str, db: Pool[Record]) -> None:
    """The invariant: every job queued is completed exactly once, whoever claimed it. Its
    effect (a row in ``finished``, primary key the job id, so a second completion would
    fail) is there for every job id and no other, each handler ran once, and no job is
    left in the table."""
    runs: Counter[int] = Counter()
    done = asyncio.Event()

    async def handler(pool: Pool[Record], job: Job) -> None:
        runs[job.id] += 1
        await anyio.sleep(0.01)  # the work: long enough for both runners to take part
        await finish(pool, job)
        if len(runs) == 200:
            done.set()

    async with runner(pg_dsn, {"work": handler}, owner="a") as a, \
            runner(pg_dsn, {"work": handler}, owner="b") as b:
        ids = [await queued(db, "work", json.dumps({"n": n})) for n in range(200)]
        with anyio.fail_after(WAIT_S):
            await done.wait()
            await a.wait_quiet()
            await b.wait_quiet()

    rows = await db.fetch("SELECT job_id, owner FROM finished")
    assert sorted(r["job_id"] for r in rows) == sorted(ids)
    assert set(runs) == set(ids) and set(runs.values()) == {1}
    assert await db.fetchval("SELECT count(*) FROM jobs") == 0
    assert {r["owner"] for r in rows} == {"a", "b"}  # both took part
    for r in (a, b):
        assert (r.counts["failed"], r.counts["leases_lost"], r.counts["dead"]) == (0, 0, 0)
    assert a.counts["claimed"] + b.counts["claimed"] == 200


async def test_an_idle_runner_does_not_poll_and_a_notify_wakes_it(
        pg_dsn: str, db: Pool[Record]) -> None:
    handled = asyncio.Event()

    async def handler(pool: Pool[Record], job: Job) -> None:
        await finish(pool, job)
        handled.set()

    async with runner(pg_dsn, {"work": handler}, owner="idle") as r:
        with anyio.fail_after(WAIT_S):
            await r.wait_quiet()
        claims = r.counts["claims"]
        # An observation window, not a synchronisation: a poller would claim in it.
        await anyio.sleep(1.0)
        assert r.counts["claims"] == claims

        started = time.monotonic()
        await enqueue(db, "work")
        with anyio.fail_after(WAIT_S):
            await handled.wait()
        # Woken by the NOTIFY, not by its 30 s bound.
        assert time.monotonic() - started < 2.0
        assert r.counts["claims"] - claims <= 2


async def test_a_delayed_job_is_claimed_at_its_time_without_a_notification(
        pg_dsn: str, db: Pool[Record]) -> None:
    ran_at: list[Any] = []
    handled = asyncio.Event()

    async def handler(pool: Pool[Record], job: Job) -> None:
        ran_at.append(await pool.fetchval("SELECT clock_timestamp()"))
        await finish(pool, job)
        handled.set()

    async with runner(pg_dsn, {"later": handler}, owner="w") as r:
        job_id = await enqueue(db, "later", delay_s=1.5)
        due = await db.fetchval("SELECT run_after FROM jobs WHERE id = $1", job_id)
        with anyio.fail_after(WAIT_S):
            await handled.wait()
            await r.wait_quiet()
        # The one NOTIFY was the enqueue's, 1.5 s early; the claim came at the job's time.
        assert r.counts["claims"] <= 4
    lateness = (ran_at[0] - due).total_seconds()
    assert 0 <= lateness < 1.0


async def test_a_lease_taken_over_cancels_the_handler_that_lost_it(
        pg_dsn: str, db: Pool[Record]) -> None:
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def handler(pool: Pool[Record], job: Job) -> None:
        if job.owner == "stuck":
            started.set()
            try:
                await anyio.sleep_forever()  # hangs (its lease renewed meanwhile)
            finally:
                cancelled.set()
        await finish(pool, job)

    # One slot: it hears the NOTIFY below too, but has no room to claim its own job back.
    async with runner(pg_dsn, {"work": handler}, owner="stuck", lease_s=1.5,
                      concurrency=1) as stuck:
        job_id = await enqueue(db, "work")
        with anyio.fail_after(WAIT_S):
            await started.wait()
        async with runner(pg_dsn, {"work": handler}, owner="other") as other:
            # The database's clock passes the lease (as if the renewals had stopped), and a
            # NOTIFY tells the other runner to look.
            await db.execute("UPDATE jobs SET lease_until = now() - interval '1 second'")
            await db.execute("SELECT pg_notify($1, 'work')", JOBS_CHANNEL)
            with anyio.fail_after(WAIT_S):
                await cancelled.wait()
                await other.wait_quiet()
                await stuck.wait_quiet()
        assert stuck.counts["leases_lost"] == 1 and stuck.counts["completed"] == 0
        assert other.counts["completed"] == 1
    rows = await db.fetch("SELECT job_id, owner FROM finished")
    assert [(r["job_id"], r["owner"]) for r in rows] == [(job_id, "other")]


async def test_a_handler_longer_than_its_lease_keeps_its_job(
        pg_dsn: str, db: Pool[Record]) -> None:
    started = asyncio.Event()
    handled = asyncio.Event()

    async def handler(pool: Pool[Record], job: Job) -> None:
        started.set()
        await anyio.sleep(2.5)  # the work: over twice the lease
        await finish(pool, job)
        handled.set()

    async with runner(pg_dsn, {"work": handler}, owner="slow", lease_s=1.0) as slow:
        await enqueue(db, "work")
        with anyio.fail_after(WAIT_S):
            await started.wait()
        # Another runner, ready to take the job over should the lease run out.
        async with runner(pg_dsn, {"work": handler}, owner="idle") as idle:
            with anyio.fail_after(WAIT_S):
                await handled.wait()
                await slow.wait_quiet()
    assert slow.counts["completed"] == 1 and slow.counts["leases_lost"] == 0
    assert idle.counts["claimed"] == 0
    assert [r["owner"] for r in await db.fetch("SELECT owner FROM finished")] == ["slow"]


# A worker process: a runner whose handler records its start, and its finish with the job's
# completion; with "hold", the jobs of odd n stop inside that transaction, uncommitted.
CHILD = r"""
import asyncio, json, os, sys
import anyio
from hermes_async_memory import Settings
from hermes_async_memory.logs import configure_logging
from hermes_async_memory.postgres import open_pool
from hermes_async_memory.postgres.jobs import complete_in
from hermes_async_memory.postgres.listen import Listener
from hermes_async_memory.postgres.worker import JobRunner
from hermes_async_memory.retry import Backoff

dsn = os.environ["TEST_DSN"]
owner, mode, lease_s = sys.argv[1], sys.argv[2], float(sys.argv[3])

def say(event, job):
    print(json.dumps({"event": event, "job": job}), flush=True)

async def slow(pool, job):
    n = json.loads(job.payload)["n"]
    await pool.execute("INSERT INTO starts (job_id, owner) VALUES ($1, $2)", job.id, owner)
    say("started", job.id)
    async with pool.acquire() as conn, conn.transaction():
        await conn.execute("INSERT INTO finished (job_id, owner) VALUES ($1, $2)",
                           job.id, owner)
        if mode == "hold" and n % 2:
            say("holding", job.id)
            await anyio.sleep_forever()
        await complete_in(conn, job)
    say("finished", job.id)

async def main():
    settings = Settings(postgres_dsn=dsn, postgres_pool_max_size=20)
    async with open_pool(settings) as pool:
        listener = Listener(settings, backoff=Backoff())
        runner = JobRunner(pool, {"slow": slow}, owner=owner, lease_s=lease_s,
                           concurrency=8, listener=listener)
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.run)
            tg.start_soon(runner.run)

configure_logging(json=True)
asyncio.run(main())
"""


async def events(worker: Worker, want: Callable[[Counter[str]], bool]) -> Counter[str]:
    """Read the worker's stdout lines until the counts of their events satisfy ``want``."""
    seen: Counter[str] = Counter()
    while not want(seen):
        seen[(await worker.stdout_json(WAIT_S))["event"]] += 1
    return seen


async def test_a_sigkilled_worker_s_jobs_are_finished_once_by_another_after_its_leases(
        pg_dsn: str, db: Pool[Record], spawn: Spawn) -> None:
    """Worker A claims 8 jobs, finishes the even ones and stops the odd ones inside their
    transaction (their finish written, not committed), holding their leases; it is
    SIGKILLed. Worker B takes the odd ones over once the leases run out and finishes them.
    Every job is finished exactly once (``finished`` holds one row per job: a second
    completion would be an error there), none is lost, and none A finished runs again."""
    ids = [await queued(db, "slow", json.dumps({"n": n})) for n in range(8)]
    a = await spawn("-c", CHILD, "A", "hold", "1.5", env={"TEST_DSN": pg_dsn})
    await events(a, lambda seen: seen["finished"] == 4 and seen["holding"] == 4)
    held = await db.fetch("SELECT id, lease_owner, lease_until FROM jobs ORDER BY id")
    assert [r["lease_owner"] for r in held] == ["A"] * 4
    a.signal(signal.SIGKILL)
    assert await a.finish() == -signal.SIGKILL

    b = await spawn("-c", CHILD, "B", "finish", "1.5", env={"TEST_DSN": pg_dsn})
    await events(b, lambda seen: seen["finished"] == 4)

    finished = {r["job_id"]: r for r in await db.fetch("SELECT * FROM finished")}
    assert sorted(finished) == sorted(ids)
    odd = [r["id"] for r in held]
    assert sorted(odd) == ids[1::2]
    assert {j: finished[j]["owner"] for j in ids} == {
        j: ("B" if j in odd else "A") for j in ids}
    b_starts = await db.fetch("SELECT job_id, at FROM starts WHERE owner = 'B'")
    assert sorted(r["job_id"] for r in b_starts) == sorted(odd)  # A's finished never again
    # Taken over after the leases A held when it was killed (they were renewed up to then).
    leased = {r["id"]: r["lease_until"] for r in held}
    assert all(r["at"] >= leased[r["job_id"]] for r in b_starts)
    assert await db.fetchval("SELECT count(*) FROM jobs") == 0


async def test_the_worker_process_runs_jobs_beside_its_pipeline(
        tmp_path: Path, pg_dsn: str, pg_server: PostgresServer, db: Pool[Record],
        spawn: Spawn) -> None:
    """``hermes-memory worker`` with backend "postgres" runs the derived work a gateway's
    write queued (its tool call stops being pending) and a queued recall job (its result
    and NOTIFY), gives its counters at stop, exits 0, and shows no password."""
    msgs: list[dict[str, Any]] = [
            {"role": "user", "content": "build it"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "terminal", "arguments": '{"command": "make"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": '{"exit_code": 0}'},
            {"role": "assistant", "content": "built"}]
    async with MemoryPipeline(gateway(tmp_path, pg_dsn, "g")) as gw:
        gw.sync_turn("build it", "built", session_id="s0", user_id="alice", messages=msgs)
        await replicated(gw)
    assert await db.fetchval("SELECT count(*) FROM tool_calls WHERE pending") == 1
    [derived] = await db.fetch("SELECT id, kind FROM jobs")
    assert derived["kind"] == "procedural"

    # One job at a time, oldest first: the recall's answer comes after the derived job.
    env = {"HERMES_MEMORY_BACKEND": "postgres", "HERMES_MEMORY_POSTGRES_DSN": pg_dsn,
           "HERMES_MEMORY_POSTGRES_JOB_CONCURRENCY": "1"}
    worker = await spawn("-m", "workers", "--db", str(tmp_path / "w" / "memory.db"),
                         "--http", "127.0.0.1:0", env=env)
    await worker.until(lambda: any(
        rec.get("event") == "postgres_listening" and JOBS_CHANNEL in rec.get("channels", ())
        for rec in worker.logs), WAIT_S)
    [started] = [rec for rec in worker.logs if rec.get("event") == "jobs_started"]
    assert started["kinds"] == ["procedural", "recall", "template_stats"]
    answers: asyncio.Queue[str] = asyncio.Queue()

    def heard(_conn: Any, _pid: int, _channel: str, payload: object) -> None:
        answers.put_nowait(str(payload))

    async with db.acquire() as conn:
        await conn.add_listener(RECALLS_CHANNEL, heard)
        await enqueue(db, RECALL_KIND, recall_payload("alice", "s1", "lanterns", "gw"),
                      key=recall_key("alice", "s1"), replace=True)
        with anyio.fail_after(WAIT_S):
            notice = json.loads(await answers.get())
        await conn.remove_listener(RECALLS_CHANNEL, heard)
    assert notice == {"origin": "gw", "user_id": "alice", "session_id": "s1"}
    row = await db.fetchrow("SELECT user_id, session_id, query FROM recall_results")
    assert row is not None and tuple(row) == ("alice", "s1", "lanterns")
    assert await db.fetchval("SELECT count(*) FROM tool_calls WHERE pending") == 0
    assert await db.fetchval("SELECT count(*) FROM jobs") == 0

    await worker.until(lambda: any(rec.get("event") == "http_listening"
                                   for rec in worker.logs), WAIT_S)
    [listening] = [rec for rec in worker.logs if rec.get("event") == "http_listening"]
    url = f"http://127.0.0.1:{listening['port']}/metrics"
    # The counter moves just after the completion commits (which the NOTIFY above tells);
    # the process gives no event for it.
    metrics = await scrape_until(url, "hermes_memory_jobs_completed_total 2.0")
    assert "hermes_memory_jobs_failed_total 0.0" in metrics
    assert "hermes_memory_jobs_running 0.0" in metrics

    worker.signal(signal.SIGTERM)
    assert await worker.finish() == 0
    [stopped] = [rec for rec in worker.logs if rec.get("event") == "worker_stopped"]
    assert stopped["jobs"]["completed"] == 2 and stopped["jobs"]["failed"] == 0
    pg_server.assert_no_password(json.dumps(worker.logs) + worker.stdout)


# -- recall jobs ------------------------------------------------------------------------


def gateway(tmp_path: Path, dsn: str, name: str, **more: Any) -> Settings:
    return Settings(db_path=tmp_path / name / "memory.db", backend="postgres",
                    postgres_dsn=dsn, **more)


async def replicated(mem: MemoryPipeline) -> None:
    """Everything accepted is committed, and in PostgreSQL (checked at each change)."""
    await mem.flush(timeout=WAIT_S)
    with anyio.fail_after(WAIT_S):
        while True:
            mark = mem.change_mark()
            if (await mem.store.replica_counts("postgres"))[0] == 0:
                return
            await mem.next_change(since=mark)


def job_recaller(mem: MemoryPipeline) -> JobRecaller:
    recaller = mem._parts.recall.recaller  # type: ignore[union-attr]
    assert isinstance(recaller, JobRecaller)
    return recaller


async def queued_query(db: Pool[Record]) -> list[tuple[int, str]]:
    rows = await db.fetch("SELECT id, payload FROM jobs WHERE kind = $1", RECALL_KIND)
    return [(r["id"], json.loads(r["payload"])["query"]) for r in rows]


async def test_a_gateway_s_recall_is_answered_by_a_worker_from_postgres_latest_query_wins(
        tmp_path: Path, pg_dsn: str, db: Pool[Record]) -> None:
    # Another machine wrote alice's memory: this gateway's own store has none of it.
    async with MemoryPipeline(gateway(tmp_path, pg_dsn, "b")) as other:
        other.sync_turn("the harbour lanterns are lit at dusk", "noted", session_id="b1",
                        user_id="alice")
        await replicated(other)

    settings = gateway(tmp_path, pg_dsn, "a", postgres_recall_jobs=True)
    async with MemoryPipeline(settings) as mem:
        recaller = job_recaller(mem)
        await mem.wait_until(lambda: recaller.ready, timeout=WAIT_S)

        async def asked(query: str) -> list[tuple[int, str]]:
            """Queue a prefetch; wait until its job is in the table (no worker runs)."""
            mem.queue_prefetch(query, session_id="a1", user_id="alice")
            with anyio.fail_after(WAIT_S):
                while True:
                    mark = mem.change_mark()  # the recall service's change after it queued
                    jobs = await queued_query(db)
                    if jobs and jobs[0][1] == query:
                        return jobs
                    await mem.next_change(since=mark)

        [(first_id, _)] = await asked("zebra crossings")
        # Asked again while queued: the same job, the latest query.
        assert await asked("harbour lanterns") == [(first_id, "harbour lanterns")]
        assert mem.prefetch(session_id="a1", user_id="alice") == ""

        async with runner(pg_dsn, default_handlers(settings), owner="worker") as w:
            await mem.wait_until(
                lambda: mem.prefetch_status("a1", user_id="alice").recall_query
                == "harbour lanterns", timeout=WAIT_S)
            with anyio.fail_after(WAIT_S):
                await w.wait_quiet()
        status = mem.prefetch_status("a1", user_id="alice")
        assert (status.source, status.stale) == ("postgres", False)
        block = mem.prefetch(session_id="a1", user_id="alice")
        assert "the harbour lanterns are lit at dusk" in block
        assert w.counts["completed"] == 1  # one run: the first query never ran
        assert recaller.fallbacks == 0
    # The gateway took its answer: nothing is left behind, no job and no result row.
    assert await db.fetchval("SELECT count(*) FROM recall_results") == 0
    assert await db.fetchval("SELECT count(*) FROM jobs") == 0


async def test_while_the_database_is_down_the_local_recall_answers(
        tmp_path: Path, pg_server: PostgresServer) -> None:
    nowhere = pg_server.dsn("hermes", port=free_port())  # nothing listens there
    async with MemoryPipeline(gateway(tmp_path, nowhere, "a",
                                      postgres_recall_jobs=True)) as mem:
        mem.sync_turn("the harbour lanterns are lit at dusk", "noted", session_id="s0",
                      user_id="alice")
        await mem.flush(timeout=WAIT_S)
        mem.queue_prefetch("harbour lanterns", session_id="s1", user_id="alice")
        await mem.wait_until(
            lambda: mem.prefetch_status("s1", user_id="alice").recall_query
            == "harbour lanterns", timeout=WAIT_S)
        assert "the harbour lanterns are lit at dusk" in mem.prefetch(
            session_id="s1", user_id="alice")
        assert mem.prefetch_status("s1", user_id="alice").source == "local"
        assert job_recaller(mem).fallbacks == 1 and not job_recaller(mem).ready


async def test_the_worker_s_metrics_show_the_job_queue_by_kind_and_status(
        tmp_path: Path, pg_dsn: str, db: Pool[Record], spawn: Spawn) -> None:
    """/metrics shows the whole job queue (every worker's jobs, of kinds this one does not
    run too): per kind and status, how many and the oldest one's age."""
    for n in range(3):
        await enqueue(db, "elsewhere", key=f"e{n}")  # a kind no handler here runs
    await db.execute("UPDATE jobs SET created_at = now() - interval '2 minutes'")
    env = {"HERMES_MEMORY_BACKEND": "postgres", "HERMES_MEMORY_POSTGRES_DSN": pg_dsn}
    worker = await spawn("-m", "workers", "--db", str(tmp_path / "w" / "memory.db"),
                         "--http", "127.0.0.1:0", env=env)
    listening = await worker.log_line("http_listening", WAIT_S)
    url = f"http://127.0.0.1:{listening['port']}/metrics"
    # The queue is read as the runner starts, beside the server (the process logs no event
    # for its first read).
    metrics = await scrape_until(
        url, 'hermes_memory_jobs_queue{kind="elsewhere",status="queued"} 3.0')
    [age] = [line for line in metrics.splitlines() if line.startswith(
        'hermes_memory_jobs_queue_oldest_age_seconds{kind="elsewhere",status="queued"}')]
    assert 120 <= float(age.split()[-1]) < 120 + WAIT_S
    worker.signal(signal.SIGTERM)
    assert await worker.finish() == 0
