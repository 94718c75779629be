"""Shared jobs in PostgreSQL: queued by any process, claimed by worker processes on any
machine under a lease, finished once.

A claim takes queued jobs whose time has come, and running jobs whose lease has expired (a
worker that crashed or hung), with ``FOR UPDATE SKIP LOCKED``: workers claiming at once
never wait for each other nor get the same job. Leases are measured on the database's clock
(``now()``), the one clock every machine shares. Only the worker that holds a job's lease
can finish it: a worker whose lease expired and was taken over gets ``LeaseLostError``, so a
job is completed once. Queuing a job sends a NOTIFY on ``JOBS_CHANNEL`` at commit, which a
worker LISTENs to rather than polling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

from ..errors import ConfigurationError, LeaseLostError

if TYPE_CHECKING:
    from asyncpg import Pool, Record

JOBS_CHANNEL = "hermes_jobs"  # its payload is the job's kind


@dataclass(frozen=True, slots=True)
class Job:
    """A claimed job: this worker's until ``lease_until`` (the database's clock)."""

    id: int
    kind: str
    key: str | None
    payload: str  # JSON, as queued
    attempts: int  # claims so far, this one included
    owner: str
    lease_until: datetime


_CLAIM = """
WITH picked AS (
    SELECT id FROM jobs
    WHERE kind = ANY($1::text[])
      AND ((status = 'queued' AND run_after <= now())
           OR (status = 'running' AND lease_until < now()))
    ORDER BY id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE jobs SET status = 'running', lease_owner = $3,
       lease_until = now() + make_interval(secs => $4), attempts = jobs.attempts + 1,
       updated_at = now()
FROM picked WHERE jobs.id = picked.id
RETURNING jobs.id, jobs.kind, jobs.key, jobs.payload, jobs.attempts, jobs.lease_until
"""


async def enqueue(pool: Pool[Record], kind: str, payload: str = "{}", *,
                  key: str | None = None, delay_s: float = 0.0) -> int | None:
    """Queue a job of ``kind``, to run ``delay_s`` from now; returns its id, or None when a
    job with the same ``key`` is queued or running already (the work is asked for once).

    Raises:
        asyncpg.PostgresError, OSError: the database failed (``pool.database_errors``).
    """
    async with pool.acquire() as conn, conn.transaction():
        job_id: int | None = await conn.fetchval(
            "INSERT INTO jobs (kind, key, payload, run_after) "
            "VALUES ($1, $2, $3, now() + make_interval(secs => $4)) "
            "ON CONFLICT (key) DO NOTHING RETURNING id",
            kind, key, payload, float(delay_s))
        if job_id is not None:
            await conn.execute("SELECT pg_notify($1, $2)", JOBS_CHANNEL, kind)
    return job_id


async def claim(pool: Pool[Record], owner: str, kinds: Sequence[str], *, lease_s: float,
                limit: int = 1) -> list[Job]:
    """Up to ``limit`` jobs of ``kinds`` for ``owner`` (unique per worker process), each
    leased for ``lease_s``: queued ones whose time has come and running ones whose lease
    expired, oldest first. Empty when there is none.

    Raises:
        ConfigurationError: ``lease_s`` or ``limit`` is not positive.
        asyncpg.PostgresError, OSError: the database failed.
    """
    if lease_s <= 0 or limit <= 0:
        raise ConfigurationError(f"lease_s and limit must be positive, got {lease_s}, {limit}")
    async with pool.acquire() as conn:
        rows = await conn.fetch(_CLAIM, list(kinds), limit, owner, float(lease_s))
    return [Job(id=r["id"], kind=r["kind"], key=r["key"], payload=r["payload"],
                attempts=r["attempts"], owner=owner, lease_until=r["lease_until"])
            for r in sorted(rows, key=lambda r: int(r["id"]))]


async def complete(pool: Pool[Record], job: Job) -> None:
    """Finish ``job``: it is removed (its key can be queued again).

    Raises:
        LeaseLostError: another worker claimed it after this one's lease expired, or it is
            finished already; the other worker's run is the one that counts.
        asyncpg.PostgresError, OSError: the database failed.
    """
    async with pool.acquire() as conn:
        done = await conn.fetchval(
            "DELETE FROM jobs WHERE id = $1 AND status = 'running' AND lease_owner = $2 "
            "RETURNING id", job.id, job.owner)
    if done is None:
        raise LeaseLostError(f"job {job.id} ({job.kind}) is no longer leased to {job.owner}")


async def release(pool: Pool[Record], job: Job, error: str, *, retry_in_s: float,
                  max_attempts: int) -> bool:
    """Give ``job`` back after a failure: queued again in ``retry_in_s``, or dead (kept, with
    ``error``) once it has had ``max_attempts`` claims. Returns whether it will run again.

    Raises:
        LeaseLostError: another worker holds it now.
        asyncpg.PostgresError, OSError: the database failed.
    """
    async with pool.acquire() as conn:
        status = await conn.fetchval(
            "UPDATE jobs SET status = CASE WHEN attempts >= $3 THEN 'dead' ELSE 'queued' END, "
            "run_after = now() + make_interval(secs => $4), lease_owner = NULL, "
            "lease_until = NULL, last_error = $5, updated_at = now() "
            "WHERE id = $1 AND status = 'running' AND lease_owner = $2 RETURNING status",
            job.id, job.owner, max_attempts, float(retry_in_s), error)
    if status is None:
        raise LeaseLostError(f"job {job.id} ({job.kind}) is no longer leased to {job.owner}")
    return bool(status == "queued")
