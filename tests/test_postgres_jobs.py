"""Shared jobs against a real server: claimed once among concurrent workers, taken over after
a lease expires, finished by the lease holder only, and announced by NOTIFY."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import anyio
import asyncpg
import pytest
from asyncpg import Pool, Record

from hermes_async_memory import Settings, cli
from hermes_async_memory.errors import LeaseLostError
from hermes_async_memory.postgres import open_pool, upgrade
from hermes_async_memory.postgres.jobs import JOBS_CHANNEL, claim, complete, enqueue, release

from .pg_server import PostgresServer

LEASE_S = 60.0
WAIT_S = 30.0


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[Pool[Record]]:
    async with open_pool(Settings(postgres_dsn=pg_dsn, postgres_pool_max_size=8)) as p:
        await upgrade(p)
        yield p


async def expire_leases(pool: Pool[Record]) -> None:
    """The database's clock passing every lease (a worker that stopped renewing)."""
    await pool.execute("UPDATE jobs SET lease_until = now() - interval '1 second' "
                       "WHERE status = 'running'")


async def test_concurrent_workers_claim_each_job_once(pool: Pool[Record]) -> None:
    ids = [await enqueue(pool, "recall", f'{{"n": {n}}}') for n in range(40)]

    async def worker(name: str) -> list[int]:
        got: list[int] = []
        while batch := await claim(pool, name, ["recall"], lease_s=LEASE_S, limit=3):
            for job in batch:
                await complete(pool, job)
                got.append(job.id)
        return got

    with anyio.fail_after(WAIT_S):
        claimed = await asyncio.gather(*(worker(f"w{i}") for i in range(4)))

    everything = [job_id for got in claimed for job_id in got]
    assert sorted(everything) == sorted(i for i in ids if i is not None)  # none lost, none twice
    assert await pool.fetchval("SELECT count(*) FROM jobs") == 0


async def test_an_expired_lease_is_taken_over_and_the_first_worker_cannot_finish(
        pool: Pool[Record]) -> None:
    await enqueue(pool, "template_stats", key="stats:code")
    [first] = await claim(pool, "crashed", ["template_stats"], lease_s=LEASE_S)
    assert await claim(pool, "other", ["template_stats"], lease_s=LEASE_S) == []

    await expire_leases(pool)
    [taken] = await claim(pool, "other", ["template_stats"], lease_s=LEASE_S)

    assert taken.id == first.id and taken.attempts == 2
    with pytest.raises(LeaseLostError):
        await complete(pool, first)
    await complete(pool, taken)
    with pytest.raises(LeaseLostError):
        await complete(pool, taken)


async def test_the_same_work_queued_twice_is_one_job(pool: Pool[Record]) -> None:
    first = await enqueue(pool, "procedural", key="user:alice")
    assert first is not None
    assert await enqueue(pool, "procedural", key="user:alice") is None
    [job] = await claim(pool, "w", ["procedural"], lease_s=LEASE_S)
    await complete(pool, job)
    # Once done, the same work can be asked for again.
    assert await enqueue(pool, "procedural", key="user:alice") is not None


async def test_a_failed_job_runs_again_later_then_is_dead(pool: Pool[Record]) -> None:
    await enqueue(pool, "recall")
    [job] = await claim(pool, "w", ["recall"], lease_s=LEASE_S)
    assert await release(pool, job, "boom", retry_in_s=0, max_attempts=2) is True
    [again] = await claim(pool, "w", ["recall"], lease_s=LEASE_S)
    assert await release(pool, again, "boom again", retry_in_s=0, max_attempts=2) is False
    assert await claim(pool, "w", ["recall"], lease_s=LEASE_S) == []
    row = await pool.fetchrow("SELECT status, last_error FROM jobs WHERE id = $1", job.id)
    assert row is not None
    assert (row["status"], row["last_error"]) == ("dead", "boom again")


async def test_a_delayed_job_is_not_claimed_before_its_time(pool: Pool[Record]) -> None:
    await enqueue(pool, "recall", delay_s=3600)
    assert await claim(pool, "w", ["recall"], lease_s=LEASE_S) == []


async def test_queuing_a_job_notifies_listeners(pool: Pool[Record], pg_dsn: str) -> None:
    heard: asyncio.Queue[str] = asyncio.Queue(maxsize=10)
    listener = await asyncpg.connect(pg_dsn)
    try:
        await listener.add_listener(
            JOBS_CHANNEL, lambda _conn, _pid, _channel, payload: heard.put_nowait(payload))
        await enqueue(pool, "procedural")
        with anyio.fail_after(WAIT_S):
            assert await heard.get() == "procedural"
    finally:
        await listener.close()


async def test_db_jobs_shows_the_queue_by_kind_and_status(
        pool: Pool[Record], pg_dsn: str, pg_server: PostgresServer,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        clean_env: None) -> None:
    """``hermes-memory db jobs``: per kind, the queued, running and dead jobs and the age of
    the oldest of each; ``--json`` the same as data; no password in either."""
    for n in range(3):
        await enqueue(pool, "recall", key=f"r{n}")
    await enqueue(pool, "procedural", key="p0")
    await enqueue(pool, "procedural", key="p1")
    [running] = await claim(pool, "w1", ["procedural"], lease_s=30.0)
    [failing] = await claim(pool, "w2", ["procedural"], lease_s=30.0)
    assert not await release(pool, failing, "boom", retry_in_s=0.0, max_attempts=1)
    await pool.execute("UPDATE jobs SET created_at = now() - interval '90 seconds' "
                       "WHERE key = 'r0'")
    monkeypatch.setenv("DATABASE_URL", pg_dsn)

    # Run in a thread: the command runs its own event loop.
    code = await anyio.to_thread.run_sync(cli.main, ["db", "jobs", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    report = json.loads(out.out)
    assert report["total"] == {"queued": 3, "running": 1, "dead": 1}
    recall, procedural = report["kinds"]["recall"], report["kinds"]["procedural"]
    assert (recall["queued"], recall["running"], recall["dead"]) == (3, 0, 0)
    assert 90 <= recall["oldest_queued_age_s"] < 90 + 30
    assert recall["oldest_running_age_s"] is None
    assert (procedural["queued"], procedural["running"], procedural["dead"]) == (0, 1, 1)

    code = await anyio.to_thread.run_sync(cli.main, ["db", "jobs"])
    out = capsys.readouterr()
    assert code == 0, out.err
    header, *lines = out.out.splitlines()
    assert header.split()[:4] == ["kind", "queued", "running", "dead"]
    assert [line.split()[:4] for line in lines] == [
        ["procedural", "0", "1", "1"], ["recall", "3", "0", "0"]]
    pg_server.assert_no_password(out.out + out.err)
    assert running.kind == "procedural"


async def test_a_claim_whose_answer_was_lost_is_taken_again_at_once(
        pool: Pool[Record]) -> None:
    """A worker whose claim committed but whose connection dropped before the answer came
    holds a job it does not know of: its next claim takes it again at once (not after the
    lease), without counting a claim; jobs it runs (``held``) are left to it."""
    job_id = await enqueue(pool, "probe", key="lost-answer")
    [first] = await claim(pool, "w1", ["probe"], lease_s=LEASE_S)  # the answer "lost"
    assert await claim(pool, "w1", ["probe"], lease_s=LEASE_S, held=[first.id]) == []
    assert await claim(pool, "w2", ["probe"], lease_s=LEASE_S) == []  # leased to w1
    [again] = await claim(pool, "w1", ["probe"], lease_s=LEASE_S)
    assert (again.id, again.attempts) == (job_id, first.attempts) == (job_id, 1)
    assert await complete(pool, again)
