"""Running the shared jobs (``postgres.jobs``): a ``JobRunner`` claims what its handlers can
run, up to its free capacity, and runs each under a lease it renews; ``JobWorker`` is a
worker process's runner with its pool and its LISTEN connection, as one supervised part.

    NOTIFY hermes_jobs ──┐
    (re)connect ─────────┼─► claim (FOR UPDATE SKIP LOCKED, up to the free slots)
    next_due elapses ────┘        │
                                  ▼
               handler(pool, job) ── lease renewed every lease_s / 3 ── lost: cancelled
                                  │
           returns ──► completed (by complete_in in its own transaction, else complete)
           raises  ──► released: queued again after a backoff, dead after max_attempts

No busy polling. An idle runner sleeps until a NOTIFY on ``JOBS_CHANNEL`` (queued work),
a (re)connect of its listener (notifications sent meanwhile are lost), or the earliest
moment a claim could find something it cannot find now: a delayed job's time, another
worker's lease running out (``jobs.next_due``, on the database's clock), never longer than
``MAX_IDLE_S``.

Exactly once. A job's effect is committed with its completion when the handler calls
``jobs.complete_in`` in the transaction that writes it: a run whose lease was taken over
(a worker that hung past its lease, or was killed) then rolls back, and only the run that
holds the lease counts. A handler that does not is run at least once.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import anyio
import structlog
from anyio.abc import TaskGroup

from ..errors import (
    ConfigurationError,
    DatabaseError,
    DatabaseUnavailableError,
    LeaseLostError,
    SchemaVersionError,
    describe,
)
from ..retry import Backoff
from ..settings import Settings
from ..supervisor import Conditions
from .dsn import redact_dsn, settings_dsn
from .jobs import (
    JOBS_CHANNEL,
    Job,
    QueueRow,
    RunNote,
    claim,
    complete,
    current_run,
    give_back,
    next_due,
    queue_summary,
    release,
    renew,
)
from .listen import Listener
from .pool import UnclassifiedErrors, close_pool, create_pool, database_errors, is_outage
from .schema import check

if TYPE_CHECKING:
    from asyncpg import Pool, Record

log = structlog.get_logger(__name__)

T = TypeVar("T")
Handler = Callable[["Pool[Record]", Job], Awaitable[None]]

# The longest an idle runner sleeps without a notification: a bound, should a NOTIFY go
# missing in a way the listener does not see.
MAX_IDLE_S = 30.0
# Jobs one claim takes at most (fewer when fewer slots are free).
CLAIM_BATCH = 32
# A statement of the runner's own (claim, renew, complete...) that takes longer than this
# counts as the database being unreachable.
DB_TIMEOUT_S = 10.0
# Added to the wait for a job's time: a claim just after it finds the job.
DUE_SLACK_S = 0.005
# Something is due, yet the claim found nothing (a row locked by another worker's claim or
# completion): the next look is this long after, doubling up to the cap.
RECHECK_S = 0.05
RECHECK_CAP_S = 1.0
# A stopping runner gives its unfinished jobs back within this long.
GIVE_BACK_S = 2.0
MAX_ATTEMPTS = 5
# How often a worker reads the whole job queue for its /metrics gauges (one cheap GROUP BY).
QUEUE_READ_S = 10.0
# The health condition while the job runner cannot reach the database.
JOBS_UNAVAILABLE = "jobs_database_unavailable"
# The counters ``stats()`` reports.
COUNTERS = ("claims", "claimed", "completed", "failed", "leases_lost", "dead", "given_back",
            "cut_short")


def default_owner() -> str:
    """A lease owner unique to this process: host, pid and a random part (a pid is used
    again after a restart)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"


def default_handlers(settings: Settings | None = None) -> dict[str, Handler]:
    """The handlers a worker process runs, by job kind: recall jobs
    (``postgres.recall_jobs``, with ``settings``' recall options) and the derived work
    (``postgres.derived``: procedural patterns, template statistics)."""
    from .derived import DERIVED_HANDLERS
    from .recall_jobs import RECALL_KIND, recall_handler  # it imports this module

    return {**DERIVED_HANDLERS, RECALL_KIND: recall_handler(settings or Settings())}


@dataclass(eq=False, slots=True)
class _Run:
    job: Job
    note: RunNote
    lost: bool = False  # a renewal found the lease taken over
    settled: bool = False  # completed, released or counted lost


_OK = object()


class JobRunner:
    """Claims and runs the jobs ``handlers`` know, up to ``concurrency`` at once (module
    doc). ``run`` until cancelled; a stopped runner gives back the jobs it had not
    finished. Wakes on ``listener``'s notifications and connects (subscribed here)."""

    def __init__(self, pool: Pool[Record], handlers: Mapping[str, Handler], *, owner: str,
                 lease_s: float, concurrency: int, max_attempts: int = MAX_ATTEMPTS,
                 backoff: Backoff | None = None, listener: Listener | None = None,
                 dsn: str | None = None, max_idle_s: float = MAX_IDLE_S,
                 counts: Counter[str] | None = None,
                 conditions: Conditions | None = None) -> None:
        """Raises ConfigurationError: no handler, or a bound that is not positive."""
        if not handlers:
            raise ConfigurationError("a job runner needs at least one handler")
        if not lease_s > 0 or concurrency < 1 or max_attempts < 1 or not max_idle_s > 0:
            raise ConfigurationError(
                f"lease_s, concurrency, max_attempts and max_idle_s must be positive, got "
                f"{lease_s}, {concurrency}, {max_attempts}, {max_idle_s}")
        self._pool = pool
        self._handlers = dict(handlers)
        self._kinds = sorted(self._handlers)
        self.owner = owner
        self._lease_s = float(lease_s)
        self._concurrency = concurrency
        self._max_attempts = max_attempts
        self._backoff = backoff or Backoff()
        self._dsn = dsn or ""
        self._max_idle_s = max_idle_s
        self.counts: Counter[str] = Counter() if counts is None else counts
        # Health shows JOBS_UNAVAILABLE while the database cannot be reached.
        self._conditions = conditions or Conditions()
        self._running: set[_Run] = set()
        self._abandoned: list[Job] = []
        # Jobs whose run an outage cut short: handed back (their claims not counted) as soon
        # as the database answers again, not left to their leases.
        self._hand_back: list[Job] = []
        self._wake = asyncio.Event()
        self._freed = asyncio.Event()
        self._rechecks = 0
        # Waiting for work: nothing was claimable at its last look.
        self.idle = False
        self._quiet = asyncio.Event()  # idle, and no job running
        self._unclassified = UnclassifiedErrors()
        if listener is not None:
            listener.subscribe(JOBS_CHANNEL, self._notified)
            listener.on_connect(self.wake)
            # A claim now finds out whether the database is down, and health says so.
            listener.on_lost(self.wake)

    def wake(self) -> None:
        """Look for work now (a job was queued, or notifications may have been missed)."""
        self._wake.set()
        self._quiet.clear()  # until it has looked

    def _notified(self, kind: str) -> None:
        if kind in self._handlers:
            self.wake()

    @property
    def running(self) -> int:
        return len(self._running)

    async def wait_quiet(self) -> None:
        """Return once the runner waits for work with no job running (its counters then
        hold every job it ran)."""
        await self._quiet.wait()

    def _note_quiet(self) -> None:
        if self.idle and not self._running and not self._wake.is_set():
            self._quiet.set()
        else:
            self._quiet.clear()

    def stats(self) -> dict[str, int]:
        return {**{name: self.counts[name] for name in COUNTERS}, "running": self.running}

    # -- the claim loop ------------------------------------------------------------------

    async def run(self) -> None:
        """Claim and run jobs until cancelled.

        Raises:
            DatabaseError: the database refused a claim for a reason waiting will not mend
                (an outage is waited out here, on a backoff).
        """
        failures = 0
        try:
            async with anyio.create_task_group() as tg:
                while True:
                    free = self._concurrency - len(self._running)
                    if free <= 0:
                        self._freed.clear()
                        await self._freed.wait()
                        continue
                    self._wake.clear()  # before the claim: a NOTIFY during it is kept
                    limit = min(free, CLAIM_BATCH)
                    try:
                        await self._hand_back_cut()
                        held = [r.job.id for r in self._running]
                        jobs = await self._db(claim(self._pool, self.owner, self._kinds,
                                                    lease_s=self._lease_s, limit=limit,
                                                    held=held))
                        self.counts["claims"] += 1
                        for job in jobs:
                            self._start(tg, job)
                        if len(jobs) == limit:
                            continue  # there may be more
                        due = await self._db(
                            next_due(self._pool, self._kinds, owner=self.owner))
                    except DatabaseUnavailableError as exc:
                        failures += 1
                        self._conditions.set(JOBS_UNAVAILABLE, describe(exc))
                        await self._wait_out(failures, exc)
                        continue
                    failures = 0
                    self._conditions.clear(JOBS_UNAVAILABLE)
                    await self._idle(self._sleep_for(due))
        finally:
            await self._give_back()

    async def _hand_back_cut(self) -> None:
        if not self._hand_back:
            return
        jobs = list(self._hand_back)
        n = await self._db(give_back(self._pool, jobs))
        del self._hand_back[:len(jobs)]
        self.counts["given_back"] += n
        log.info("jobs_handed_back", jobs=n, owner=self.owner, reason="database_outage")

    def _sleep_for(self, due: float | None) -> float:
        if due is None:
            self._rechecks = 0
            return self._max_idle_s
        if due > 0:
            self._rechecks = 0
            return min(due + DUE_SLACK_S, self._max_idle_s)
        # Due now, and not claimed: locked by another worker's statement for a moment.
        self._rechecks += 1
        return float(min(RECHECK_S * 2 ** min(self._rechecks - 1, 10), RECHECK_CAP_S))

    async def _idle(self, seconds: float) -> None:
        self.idle = True
        self._note_quiet()
        try:
            with anyio.move_on_after(seconds):
                await self._wake.wait()
        finally:
            self.idle = False
            self._note_quiet()

    async def _wait_out(self, failures: int, exc: BaseException) -> None:
        delay = self._backoff.delay(failures)
        if failures == 1:
            log.warning("jobs_database_unavailable", owner=self.owner, error=describe(exc),
                        retry_in_s=round(delay, 3))
        with anyio.move_on_after(delay):
            # A (re)connect of the listener says the database answers again.
            await self._wake.wait()

    async def _db(self, call: Awaitable[T]) -> T:
        """``call`` (one of ``jobs``' functions) with the driver's errors as ours and a
        time-out, past which the database counts as unreachable."""
        async with database_errors(self._dsn, self._unclassified):
            with anyio.fail_after(DB_TIMEOUT_S):
                return await call

    # -- one job ---------------------------------------------------------------------------

    def _start(self, tg: TaskGroup, job: Job) -> None:
        run = _Run(job, RunNote(job))
        self._running.add(run)
        self.counts["claimed"] += 1
        tg.start_soon(self._execute, run, name=f"hermes-job-{job.kind}-{job.id}")

    async def _execute(self, run: _Run) -> None:
        try:
            outcome = await self._attempt(run)
            await self._settle(run, outcome)
        finally:
            if not run.settled:
                self._abandoned.append(run.job)  # cancelled: the runner is stopping
            self._running.discard(run)
            self._freed.set()
            self._note_quiet()

    async def _attempt(self, run: _Run) -> object:
        """Run the handler while the lease is renewed; ``_OK``, the handler's exception, or
        None when its lease was lost (the handler is cancelled then)."""
        handler = self._handlers[run.job.kind]
        outcome: object = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._keep_lease, run, tg.cancel_scope)
            token = current_run.set(run.note)
            try:
                await handler(self._pool, run.job)
                outcome = _OK
            except Exception as exc:  # the per-job boundary: released, counted, logged
                outcome = exc
            finally:
                current_run.reset(token)
            tg.cancel_scope.cancel()  # the renewals stop
        return None if run.lost else outcome

    async def _keep_lease(self, run: _Run, handler_scope: anyio.CancelScope) -> None:
        every = self._lease_s / 3
        while True:
            await anyio.sleep(every)
            try:
                await self._db(renew(self._pool, run.job, self._lease_s))
            except LeaseLostError:
                if run.note.completed:
                    return  # its handler completed it in its transaction: no lease to keep
                run.lost = True
                handler_scope.cancel()
                return
            except DatabaseError as exc:  # the next renewal tries again; the lease may run out
                log.warning("job_lease_renew_failed", job=run.job.id, kind=run.job.kind,
                            error=describe(exc))

    async def _settle(self, run: _Run, outcome: object) -> None:
        job = run.job
        if outcome is None or isinstance(outcome, LeaseLostError):
            self._lost(run)
        elif outcome is _OK:
            if run.note.completed or await self._complete(run):
                run.settled = True
                self.counts["completed"] += 1
        elif isinstance(outcome, BaseException) and is_outage(outcome):
            self._cut_short(run, outcome)
        else:
            assert isinstance(outcome, BaseException)
            await self._release(run, outcome)
        if not run.settled:  # its lease runs out, and it runs again then
            run.settled = True
            log.error("job_left_leased", job=job.id, kind=job.kind, attempts=job.attempts)

    def _cut_short(self, run: _Run, exc: BaseException) -> None:
        """An outage cut the job's run: it goes back, its claim not counted, once the
        database answers (the claim loop hands it back before its next claim)."""
        run.settled = True
        self._hand_back.append(run.job)
        self.counts["cut_short"] += 1
        log.warning("job_cut_short", job=run.job.id, kind=run.job.kind, error=describe(exc))
        self.wake()

    def _lost(self, run: _Run) -> None:
        run.settled = True
        self.counts["leases_lost"] += 1
        log.warning("job_lease_lost", job=run.job.id, kind=run.job.kind, owner=self.owner,
                    attempts=run.job.attempts)

    async def _complete(self, run: _Run) -> bool:
        """Complete the job of a handler that returned; whether it is done (a lost lease
        is counted, and so settled)."""
        tries = 0
        while True:
            try:
                await self._db(complete(self._pool, run.job))
                return True
            except LeaseLostError:
                self._lost(run)
                return False
            except DatabaseUnavailableError as exc:
                # Waited out: the lease may run out meanwhile, and the completion then
                # finds it taken over (counted lost; the other run counts).
                tries += 1
                if tries == 1:
                    log.warning("job_complete_waiting", job=run.job.id, error=describe(exc))
                await anyio.sleep(self._backoff.delay(tries))
            except DatabaseError as exc:
                log.error("job_complete_failed", job=run.job.id, error=describe(exc))
                return False
        return False

    async def _release(self, run: _Run, exc: BaseException) -> None:
        job = run.job
        self.counts["failed"] += 1
        retry_in = self._backoff.delay(job.attempts)
        try:
            again = await self._db(release(self._pool, job, describe(exc),
                                           retry_in_s=retry_in, max_attempts=self._max_attempts))
        except LeaseLostError:
            self._lost(run)
            return
        except DatabaseError as release_exc:
            log.warning("job_failed", job=job.id, kind=job.kind, attempts=job.attempts,
                        error=describe(exc), release_error=describe(release_exc),
                        exc_info=exc)
            if is_outage(release_exc):
                self._cut_short(run, release_exc)
            return
        run.settled = True
        if again:
            log.warning("job_failed", job=job.id, kind=job.kind, attempts=job.attempts,
                        retry_in_s=round(retry_in, 3), error=describe(exc), exc_info=exc)
        else:
            self.counts["dead"] += 1
            log.error("job_dead", job=job.id, kind=job.kind, attempts=job.attempts,
                      error=describe(exc), exc_info=exc)
        self.wake()  # its new time may be the next one due

    async def _give_back(self) -> None:
        jobs, self._abandoned = self._abandoned + self._hand_back, []
        self._hand_back = []
        if not jobs:
            return
        with anyio.CancelScope(shield=True), anyio.move_on_after(GIVE_BACK_S):
            try:
                n = await self._db(give_back(self._pool, jobs))
            except Exception as exc:  # their leases run out instead
                log.warning("jobs_give_back_failed", jobs=len(jobs), error=describe(exc))
                return
            self.counts["given_back"] += n
            log.info("jobs_given_back", jobs=n, owner=self.owner)


@dataclass
class JobWorker:
    """A worker process's runner of the shared jobs: its own pool and LISTEN connection,
    opened by ``run`` (a supervised part), which waits while the database cannot be reached
    and while its schema is not upgraded yet."""

    settings: Settings
    handlers: Mapping[str, Handler]
    owner: str = field(default_factory=default_owner)
    max_attempts: int = MAX_ATTEMPTS
    backoff: Backoff = field(default_factory=Backoff)
    counts: Counter[str] = field(default_factory=Counter)
    runner: JobRunner | None = None
    conditions: Conditions = field(default_factory=Conditions)
    # The whole queue (every worker's jobs) as last read, every QUEUE_READ_S: for /metrics.
    queue: tuple[QueueRow, ...] = ()

    def queue_rows(self) -> list[tuple[str, str, int, float]]:
        return [(r.kind, r.status, r.jobs, r.oldest_age_s) for r in self.queue]

    async def _read_queue(self, pool: Pool[Record]) -> None:
        dsn = settings_dsn(self.settings)
        while True:
            try:
                async with database_errors(dsn):
                    with anyio.fail_after(DB_TIMEOUT_S):
                        self.queue = tuple(await queue_summary(pool))
            except DatabaseUnavailableError:
                pass  # the runner waits the outage out and health shows it; read next time
            await anyio.sleep(QUEUE_READ_S)

    def stats(self) -> dict[str, int]:
        return {**{name: self.counts[name] for name in COUNTERS},
                "running": 0 if self.runner is None else self.runner.running}

    async def run(self) -> None:
        """Run jobs until cancelled.

        Raises:
            DatabaseError: the database refused us for a reason waiting will not mend.
        """
        s = self.settings
        concurrency = s.postgres_job_concurrency
        # Each running job: its handler's connection and its renewals'; and the claims.
        size = max(s.postgres_pool_max_size, 2 * concurrency + 1)
        pool = await open_when_reachable(s.replace(postgres_pool_max_size=size),
                                         self.backoff, part="jobs",
                                         conditions=self.conditions)
        try:
            listener = Listener(s, backoff=self.backoff)
            self.runner = JobRunner(
                pool, self.handlers, owner=self.owner, lease_s=s.postgres_job_lease_s,
                concurrency=concurrency, max_attempts=self.max_attempts,
                backoff=self.backoff, listener=listener, dsn=settings_dsn(s),
                counts=self.counts, conditions=self.conditions)
            log.info("jobs_started", owner=self.owner, kinds=sorted(self.handlers),
                     concurrency=concurrency, lease_s=s.postgres_job_lease_s)
            async with anyio.create_task_group() as tg:
                tg.start_soon(listener.run, name="hermes-jobs-listen")
                tg.start_soon(self.runner.run, name="hermes-jobs-run")
                tg.start_soon(self._read_queue, pool, name="hermes-jobs-queue")
        finally:
            await close_pool(pool)


async def open_when_reachable(settings: Settings, backoff: Backoff, *, part: str,
                              conditions: Conditions | None = None) -> Pool[Record]:
    """A pool to the database with this library's schema, once there is one: while the
    server cannot be reached, or its schema is not upgraded yet, waits on ``backoff`` (and
    says so once; ``conditions`` shows ``JOBS_UNAVAILABLE`` meanwhile).

    Raises:
        DatabaseError: the server refused us for a reason waiting will not mend.
    """
    dsn = settings_dsn(settings)
    unclassified = UnclassifiedErrors()
    conditions = conditions or Conditions()
    failures = 0
    while True:
        try:
            pool = await create_pool(settings)
        except DatabaseUnavailableError as exc:
            failures += 1
            conditions.set(JOBS_UNAVAILABLE, describe(exc))
            if failures == 1:
                log.warning("postgres_unavailable", part=part, dsn=redact_dsn(dsn),
                            error=describe(exc))
            await anyio.sleep(backoff.delay(failures))
            continue
        try:
            async with database_errors(dsn, unclassified):
                await check(pool)
        except (DatabaseUnavailableError, SchemaVersionError) as exc:
            await close_pool(pool)
            failures += 1
            conditions.set(JOBS_UNAVAILABLE, describe(exc))
            if failures == 1:
                if isinstance(exc, SchemaVersionError):
                    log.error("postgres_schema_mismatch", part=part, error=describe(exc))
                else:
                    log.warning("postgres_unavailable", part=part, dsn=redact_dsn(dsn),
                                error=describe(exc))
            await anyio.sleep(backoff.delay(failures))
            continue
        except BaseException:
            await close_pool(pool)
            raise
        if failures:
            log.info("postgres_reachable", part=part, dsn=redact_dsn(dsn))
        conditions.clear(JOBS_UNAVAILABLE)
        return pool
