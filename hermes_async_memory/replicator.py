"""The replicator: committed turns go on to the replica backend (Honcho), from its own outbox.

Each commit also queues its turns in the backend's ``replica_outbox`` table, in the same
transaction. The replicator sends them oldest first, a whole session backlog per write (a
backend takes messages per session), and a turn leaves the table once the backend has it.
One the backend refuses, or that fails ``replica_max_attempts`` sends, stays there as the
backend's dead letter with the reason; the session's later turns go on. While the backend is
unavailable (its circuit open) no attempt is counted, and a turn that was never part of a
failed send uses up none either.

A session's lifecycle events (describe, end, delete, import) wait in the same table, in the
session's lane, each carrying its own record (``store.lifecycle``): the backend gets them in
order with the session's turns, and a delete reaches it however many of the session's turns
it removed unsent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence

import anyio
import structlog

from .backends import Backend
from .backends.base import BackendUnavailableError, BackendWriteError
from .errors import describe
from .retry import Backoff, retry_transient
from .store import ReplicaRow, SqliteStore
from .supervisor import REPLICA_UNAVAILABLE, Conditions
from .turns import Turn

log = structlog.get_logger(__name__)

# One backend write: the whole backlog of up to this many sessions, up to this many turns.
REPLICA_SESSIONS = 256
REPLICA_TURNS = 5000
# A replayed dead letter has no wake-up of its own: look for it this often.
REPLICA_POLL_S = 1.0


class Replicator:
    """Sends the replica outbox of one backend; a supervised part."""

    def __init__(self, store: SqliteStore, backend: Backend, *, max_attempts: int,
                 backoff: Backoff, on_progress: Callable[[], None] = lambda: None,
                 conditions: Conditions | None = None) -> None:
        self._on_progress = on_progress
        self._conditions = conditions or Conditions()
        self._store = store
        self._backend = backend
        self._name = backend.name
        self._max_attempts = max_attempts
        self._backoff = backoff
        self._work = asyncio.Event()
        self._wait = 0.0  # after a failed write: how long until the next
        self._unsure_upto: int | None = None
        # The outbox was found empty and nothing was committed since: nothing waits (the
        # maintenance's counts lag by up to a round).
        self.idle = False
        # The keys of the records the last whole read took (every pending one then): a commit
        # of only those has nothing new to send. While a read is under way, the keys commits
        # announce wait in ``_announced`` to be checked against what it took.
        self._taken: set[str] | None = None
        self._announced: list[str] | None = None
        self.replicated = 0
        self.errors = 0
        self.dead = 0
        self.unavailable = 0

    def wake(self, keys: Collection[str] | None = None) -> None:
        """New records are committed (``keys``: theirs, when known). A commit lands in the
        database before it is announced here, so the read under way or the last one may
        already have taken its records: then there is nothing new, and the replicator may
        still say it is idle once its write is done."""
        if keys is not None:
            if self._announced is not None:
                # Busy until the read says whether it took them: stats count them meanwhile.
                self.idle = False
                self._announced.extend(keys)
                return
            if self._taken is not None and self._taken.issuperset(keys):
                return
        self.idle = False
        self._work.set()

    async def run(self) -> None:
        failures = 0
        while True:
            if self._unsure_upto is None:
                # Rows an earlier run left may have reached the backend before it stopped.
                self._unsure_upto = await self._store.replica_last_id(self._name)
            self._work.clear()  # set again by a commit from here on
            self._taken, self._announced = None, []
            try:
                rows = await self._store.replica_pending(self._name, REPLICA_SESSIONS,
                                                         REPLICA_TURNS)
            finally:
                announced, self._announced = self._announced, None
            # Every waiting record was read (fewer than a full read's worth).
            whole = (len(rows) < REPLICA_TURNS
                     and len({r.session_id for r in rows}) < REPLICA_SESSIONS)
            self._taken = {r.turn_key for r in rows} if whole else None
            if announced:
                self.wake(announced)
            if not rows:
                was_idle, self.idle = self.idle, not self._work.is_set()
                if self.idle and not was_idle:
                    self._on_progress()  # stats say 0 pending from now: wake their waiters
                with anyio.move_on_after(REPLICA_POLL_S):
                    await self._work.wait()
                continue
            turns = await self._store.replica_turns(rows)
            # Tried before (even while the backend was unavailable) or left by an earlier
            # run: the backend first checks what it already holds.
            maybe_sent = any(r.tried or r.id <= self._unsure_upto for r in rows)
            failed = await self._replicate(rows, turns, maybe_sent, failures)
            # Every waiting record was in this write, none is to be tried again, and nothing
            # new was committed since the read: the outbox is empty now.
            self.idle = whole and not failed and not self._work.is_set()
            self._on_progress()
            failures = failures + 1 if failed else 0
            if failures:
                await anyio.sleep(self._wait)

    async def _replicate(self, rows: Sequence[ReplicaRow], turns: list[Turn],
                         maybe_sent: bool, failures: int) -> bool:
        """One backend write and its bookkeeping; whether it failed (then ``_wait`` says how
        long to wait before the next)."""
        store = self._store
        try:
            await self._backend.write(turns, maybe_sent=maybe_sent)
        except BackendUnavailableError as exc:
            self.unavailable += 1
            marks = [(r.id, describe(exc), False) for r in rows]  # tried, counted as nothing
            await retry_transient(lambda: store.replica_failed(marks, counted=False),
                                  self._backoff)
            self._wait = exc.retry_after_s or self._backoff.delay(failures + 1)
            self._conditions.set(REPLICA_UNAVAILABLE, f"{self._name}: {describe(exc)}")
            log.warning("replica_unavailable", backend=self._name, turns=len(rows),
                        retry_in_s=round(self._wait, 3), error=describe(exc))
            return True
        except Exception as exc:  # the per-write boundary: every failure is kept
            return await self._failed(rows, exc)
        self._conditions.clear(REPLICA_UNAVAILABLE)
        ids = [r.id for r in rows]
        await retry_transient(lambda: store.replica_done(ids), self._backoff)
        self.replicated += len(rows)
        return False

    async def _failed(self, rows: Sequence[ReplicaRow], exc: Exception) -> bool:
        store = self._store
        # Failing because the backend went unavailable meanwhile (its breaker opened): an
        # outage, in which no turn is given up; only a refusal makes a dead letter then.
        outage = not self._backend.available()
        named = {f.key: f for f in exc.failures} if isinstance(exc, BackendWriteError) else None
        written: list[int] = []
        counted: list[tuple[int, str, bool]] = []
        uncounted: list[tuple[int, str, bool]] = []
        for r in rows:
            f = named.get(r.turn_key) if named is not None else None
            if named is not None and f is None:
                written.append(r.id)
                continue
            reason = f.reason if f is not None else describe(exc)
            permanent = f.permanent if f is not None else False
            # Only a turn that was part of a failed send uses up an attempt: not one held
            # back behind an earlier failed batch of its session, or by an open circuit.
            attempted = f.attempted if f is not None else True
            if permanent:
                counted.append((r.id, reason, True))
            elif outage or not attempted:
                uncounted.append((r.id, reason, False))
            else:
                counted.append((r.id, reason, r.attempts + 1 >= self._max_attempts))
        await retry_transient(lambda: store.replica_done(written), self._backoff)
        if counted:
            await retry_transient(lambda: store.replica_failed(counted, counted=True),
                                  self._backoff)
        if uncounted:
            await retry_transient(lambda: store.replica_failed(uncounted, counted=False),
                                  self._backoff)
        dead = sum(1 for _, _, d in counted if d)
        self.replicated += len(written)
        self.errors += len(counted) + len(uncounted) - dead
        self.dead += dead
        log.warning("replica_write_failed", backend=self._name, turns=len(rows),
                    written=len(written), failed=len(counted) + len(uncounted), dead=dead,
                    error=describe(exc))
        retry = [r for r in (*counted, *uncounted) if not r[2]]
        if not retry:
            return False
        self._wait = self._backoff.delay(max((r.attempts for r in rows), default=0) + 1)
        return True
