"""Shared jobs in PostgreSQL: queued by any process, claimed by worker processes on any
machine under a lease, finished once.

A claim takes queued jobs whose time has come, and running jobs whose lease has expired (a
worker that crashed or hung), with ``FOR UPDATE SKIP LOCKED``: workers claiming at once
never wait for each other nor get the same job. Leases are measured on the database's clock
(``now()``), the one clock every machine shares. Only the worker that holds a job's lease
can finish it: a worker whose lease expired and was taken over gets ``LeaseLostError``, so a
job is completed once. Queuing a job sends a NOTIFY on ``JOBS_CHANNEL`` at commit, which a
worker LISTENs to rather than polling; ``next_due`` tells an idle worker when the next job
becomes claimable without one (a delayed job's time, another worker's lease running out).

A lease is one claim: its owner and the job's ``attempts`` at that claim. A worker that
claims its own job again after its lease expired holds a new lease, and the old run can no
longer finish, renew or release it.

A job's effect and its completion commit together when the handler calls ``complete_in``
inside the transaction that writes the effect: a run whose lease was taken over then
rolls back, so the job is done once however many workers ran it.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError, LeaseLostError

if TYPE_CHECKING:
    from asyncpg import Pool, Record

# A connection of the pool's, or one of its own: what ``complete_in`` is given.
Conn = Any

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
           OR (status = 'running' AND lease_until < now())
           OR (status = 'running' AND lease_owner = $3 AND NOT id = ANY($5::bigint[])))
    ORDER BY id
    LIMIT $2
    FOR UPDATE SKIP LOCKED
)
UPDATE jobs SET status = 'running', lease_owner = $3,
       lease_until = now() + make_interval(secs => $4),
       attempts = jobs.attempts + CASE WHEN jobs.status = 'running' AND jobs.lease_owner = $3
                                       AND jobs.lease_until >= now() THEN 0 ELSE 1 END,
       updated_at = now()
FROM picked WHERE jobs.id = picked.id
RETURNING jobs.id, jobs.kind, jobs.key, jobs.payload, jobs.attempts, jobs.lease_until
"""


_INSERT = ("INSERT INTO jobs (kind, key, payload, run_after) "
           "VALUES ($1, $2, $3, now() + make_interval(secs => $4)) ")
_ONCE = _INSERT + "ON CONFLICT (key) DO NOTHING RETURNING id"
# The same key queued again with replace: the job takes the new payload. A queued one keeps
# the earlier of the two times; a dead one is queued anew, its attempts forgotten; a running
# one keeps running, and its completion queues it again for the new payload
# (``complete_in``).
_REPLACE = _INSERT + """ON CONFLICT (key) DO UPDATE SET
    payload = EXCLUDED.payload, updated_at = now(),
    status = CASE WHEN jobs.status = 'dead' THEN 'queued' ELSE jobs.status END,
    attempts = CASE WHEN jobs.status = 'dead' THEN 0 ELSE jobs.attempts END,
    run_after = CASE jobs.status WHEN 'queued' THEN least(jobs.run_after, EXCLUDED.run_after)
                                 WHEN 'dead' THEN EXCLUDED.run_after
                                 ELSE jobs.run_after END
WHERE jobs.kind = EXCLUDED.kind
RETURNING id"""
# Whether this lease (owner and claim) still holds the job, its row locked until the
# transaction ends: a concurrent replace waits for the outcome.
_LOCK_LEASED = ("SELECT payload FROM jobs WHERE id = $1 AND status = 'running' "
                "AND lease_owner = $2 AND attempts = $3 FOR UPDATE")
_REQUEUE = ("UPDATE jobs SET status = 'queued', lease_owner = NULL, lease_until = NULL, "
            "attempts = 0, run_after = now(), updated_at = now() WHERE id = $1")
# Seconds from now (the database's clock) to the earliest moment a claim of ``kinds`` could
# get something it cannot get now: a queued job's time, or a lease other than ``owner``'s
# running out (its own are renewed while they run).
_NEXT_DUE = """
SELECT extract(epoch FROM least(
    (SELECT min(run_after) FROM jobs WHERE kind = ANY($1::text[]) AND status = 'queued'),
    (SELECT min(lease_until) FROM jobs
     WHERE kind = ANY($1::text[]) AND status = 'running' AND lease_owner IS DISTINCT FROM $2)
) - clock_timestamp())::float8
"""


async def enqueue(pool: Pool[Record], kind: str, payload: str = "{}", *,
                  key: str | None = None, delay_s: float = 0.0,
                  replace: bool = False) -> int | None:
    """Queue a job of ``kind``, to run ``delay_s`` from now; returns its id.

    A job with the same ``key`` queued, running or dead already: without ``replace``, this
    returns None and changes nothing (the work is asked for once); with ``replace``, that
    job takes this ``payload`` and its id is returned: queued, it runs with the new payload
    (at the earlier of the two times); dead, it is queued again with its attempts reset;
    running, it is queued again with the new payload once the current run completes (the
    latest request wins, and is never dropped). None when that job is of another kind.

    Raises:
        asyncpg.PostgresError, OSError: the database failed (``pool.database_errors``).
    """
    sql = _REPLACE if replace and key is not None else _ONCE
    async with pool.acquire() as conn, conn.transaction():
        job_id: int | None = await conn.fetchval(sql, kind, key, payload, float(delay_s))
        if job_id is not None:
            await conn.execute("SELECT pg_notify($1, $2)", JOBS_CHANNEL, kind)
    return job_id


async def claim(pool: Pool[Record], owner: str, kinds: Sequence[str], *, lease_s: float,
                limit: int = 1, held: Sequence[int] = ()) -> list[Job]:
    """Up to ``limit`` jobs of ``kinds`` for ``owner`` (unique per worker process), each
    leased for ``lease_s``: queued ones whose time has come, running ones whose lease
    expired, and running ones leased to ``owner`` already but not in ``held`` (the jobs it
    runs): a claim whose answer a lost connection never delivered is taken again at once,
    not after its lease, and without counting a claim. Oldest first; empty when none.

    Raises:
        ConfigurationError: ``lease_s`` or ``limit`` is not positive.
        asyncpg.PostgresError, OSError: the database failed.
    """
    if lease_s <= 0 or limit <= 0:
        raise ConfigurationError(f"lease_s and limit must be positive, got {lease_s}, {limit}")
    async with pool.acquire() as conn:
        rows = await conn.fetch(_CLAIM, list(kinds), limit, owner, float(lease_s),
                                [int(i) for i in held])
    return [Job(id=r["id"], kind=r["kind"], key=r["key"], payload=r["payload"],
                attempts=r["attempts"], owner=owner, lease_until=r["lease_until"])
            for r in sorted(rows, key=lambda r: int(r["id"]))]


async def complete(pool: Pool[Record], job: Job) -> bool:
    """Finish ``job``: it is removed (its key can be queued again). Returns True; False when
    it was queued again with a new payload while it ran (``enqueue(replace=True)``): it is
    then queued again to run with that payload.

    Raises:
        LeaseLostError: another worker claimed it after this one's lease expired, or it is
            finished already; the other worker's run is the one that counts.
        asyncpg.PostgresError, OSError: the database failed.
    """
    async with pool.acquire() as conn, conn.transaction():
        return await complete_in(conn, job)


async def complete_in(conn: Conn, job: Job) -> bool:
    """``complete`` inside the caller's transaction on ``conn``: call it in the transaction
    that writes the job's effect, so the effect and the completion commit together or not
    at all. A lease that was lost raises, and the transaction rolls back: the job's effect
    is then the other worker's only.

    Raises:
        LeaseLostError: as ``complete`` (let it leave the transaction's block).
        asyncpg.PostgresError, OSError: the database failed.
    """
    payload = await conn.fetchval(_LOCK_LEASED, job.id, job.owner, job.attempts)
    if payload is None:
        raise LeaseLostError(f"job {job.id} ({job.kind}) is no longer leased to {job.owner}")
    if payload != job.payload:
        await conn.execute(_REQUEUE, job.id)
        await conn.execute("SELECT pg_notify($1, $2)", JOBS_CHANNEL, job.kind)
        finished = False
    else:
        await conn.execute("DELETE FROM jobs WHERE id = $1", job.id)
        finished = True
    _note_completed(job)
    return finished


async def renew(pool: Pool[Record], job: Job, lease_s: float) -> datetime:
    """Extend ``job``'s lease to ``lease_s`` from now (the database's clock), while its
    handler runs; returns the new ``lease_until``.

    Raises:
        ConfigurationError: ``lease_s`` is not positive.
        LeaseLostError: the lease expired and another claim holds the job (or it is done).
        asyncpg.PostgresError, OSError: the database failed.
    """
    if lease_s <= 0:
        raise ConfigurationError(f"lease_s must be positive, got {lease_s}")
    async with pool.acquire() as conn:
        until: datetime | None = await conn.fetchval(
            "UPDATE jobs SET lease_until = now() + make_interval(secs => $4), "
            "updated_at = now() "
            "WHERE id = $1 AND status = 'running' AND lease_owner = $2 AND attempts = $3 "
            "RETURNING lease_until", job.id, job.owner, job.attempts, float(lease_s))
    if until is None:
        raise LeaseLostError(f"job {job.id} ({job.kind}) is no longer leased to {job.owner}")
    return until


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
            "WHERE id = $1 AND status = 'running' AND lease_owner = $2 AND attempts = $6 "
            "RETURNING status",
            job.id, job.owner, max_attempts, float(retry_in_s), error, job.attempts)
    if status is None:
        raise LeaseLostError(f"job {job.id} ({job.kind}) is no longer leased to {job.owner}")
    return bool(status == "queued")


async def give_back(pool: Pool[Record], jobs: Sequence[Job]) -> int:
    """Queue ``jobs`` again now, their claims not counted (a worker stopping before it ran
    them to the end): another worker takes them at once rather than after their leases.
    Those no longer leased to their owner are left as they are. Returns how many went back.

    Raises:
        asyncpg.PostgresError, OSError: the database failed.
    """
    if not jobs:
        return 0
    async with pool.acquire() as conn, conn.transaction():
        kinds = await conn.fetch(
            "UPDATE jobs SET status = 'queued', attempts = greatest(jobs.attempts - 1, 0), "
            "run_after = now(), lease_owner = NULL, lease_until = NULL, updated_at = now() "
            "FROM unnest($1::bigint[], $2::text[], $3::int[]) AS j(id, owner, attempts) "
            "WHERE jobs.id = j.id AND jobs.status = 'running' AND jobs.lease_owner = j.owner "
            "AND jobs.attempts = j.attempts RETURNING jobs.kind",
            [j.id for j in jobs], [j.owner for j in jobs], [j.attempts for j in jobs])
        for kind in sorted({r["kind"] for r in kinds}):
            await conn.execute("SELECT pg_notify($1, $2)", JOBS_CHANNEL, kind)
    return len(kinds)


async def next_due(pool: Pool[Record], kinds: Sequence[str], *, owner: str | None = None
                   ) -> float | None:
    """Seconds until a claim of ``kinds`` could find a job it cannot find now, on the
    database's clock: the earliest queued job's time, or the earliest lease of another
    owner than ``owner`` running out. None when there is neither; 0 or less: now.

    Raises:
        asyncpg.PostgresError, OSError: the database failed.
    """
    async with pool.acquire() as conn:
        seconds: float | None = await conn.fetchval(_NEXT_DUE, list(kinds), owner)
    return seconds


@dataclass(frozen=True, slots=True)
class QueueRow:
    """Jobs of one kind in one status, and how long ago the oldest of them was queued."""

    kind: str
    status: str  # "queued", "running" or "dead"
    jobs: int
    oldest_age_s: float  # on the database's clock


JOB_STATUSES = ("queued", "running", "dead")
_QUEUE = """
SELECT kind, status, count(*) AS jobs,
       greatest(extract(epoch FROM now() - min(created_at)), 0)::float8 AS oldest_age_s
FROM jobs GROUP BY kind, status ORDER BY kind, status
"""


async def queue_summary(pool: Pool[Record]) -> list[QueueRow]:
    """The job queue now: per kind and status (queued, running, dead), how many jobs and
    the age of the oldest; kinds and statuses with no job are left out.

    Raises:
        asyncpg.PostgresError, OSError: the database failed.
    """
    rows = await pool.fetch(_QUEUE)
    return [QueueRow(r["kind"], r["status"], int(r["jobs"]), float(r["oldest_age_s"]))
            for r in rows]


@dataclass(slots=True)
class RunNote:
    """A job run's state its handler's calls leave for the runner."""

    job: Job
    completed: bool = False  # complete_in ran (its transaction commits if the handler returns)


# The run of a job this task is in, as ``postgres.worker`` sets it: ``complete_in`` notes
# there that the handler completed its job, so the runner does not complete it again.
current_run: ContextVar[RunNote | None] = ContextVar("hermes_job_run", default=None)


def _note_completed(job: Job) -> None:
    note = current_run.get()
    if note is not None and note.job.id == job.id and note.job.attempts == job.attempts:
        note.completed = True
