"""The writer: one loop that reads batches from its sources and writes them to its sink.

    sources (the local outbox; a worker also has the shared inbox) ──► Writer ──► sink
                                                     (commit to the store, or forward a
                                                      producer's batch to the worker)

The process's role only picks the sources and the sink; the loop is the same. A batch keeps
accept order (so per-session order), is bounded by turns and by bytes, and closes after the
group-commit window unless a flush or shutdown is waiting.

A failed write is classified (faults.py): a transient one (busy, I/O, full disk) is retried
with backoff, the batch whole; one caused by the data is bisected down to the record that
causes it, which goes to the dead letters with its reason while every other record commits;
a fatal one ends the loop and the supervisor fails the pipeline, the batch left durable in
the outbox for the next start.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, cast, runtime_checkable

import anyio
import anyio.lowlevel
import structlog

from .errors import LeaseLostError, describe
from .faults import Fault, classify, is_disk_full
from .metrics import PipelineObserver
from .ops import OP_SESSION
from .retry import Backoff
from .slices import CHUNK, begin, maybe_yield
from .supervisor import DISK_FULL_STORE, Conditions
from .turns import Turn

log = structlog.get_logger(__name__)

T = TypeVar("T")
# After a chore's step failed for a passing reason (the store busy, the disk full).
CHORE_RETRY_S = 5.0

@dataclass(frozen=True, slots=True)
class Unreadable:
    """A record whose bytes are intact but do not decode as a turn: a dead letter as is."""

    seq: int
    key: str
    session_id: str
    payload: bytes
    error: str


@dataclass
class Work:
    """One batch from a source, in its order."""

    items: list[Turn | Unreadable] = field(default_factory=list)
    # Records an earlier run left: the store may hold some already (a crash after a commit).
    replay: bool = False


class Source(Protocol):
    name: str
    # Whether new work can arrive without a wake-up (another process's inbox): poll it.
    polls: bool
    lease_owner: str | None

    def waiting(self) -> int:
        """Records ready to be taken now (0 when unknown)."""

    async def take(self, max_turns: int, max_bytes: int) -> Work | None:
        """The next batch, or None when there is nothing to do."""

    async def settle(self, items: Sequence[Turn | Unreadable], *, committed: bool) -> None:
        """These records are done with: committed, found already stored, or dead-lettered."""


class Sink(Protocol):
    name: str

    async def commit(self, turns: Sequence[Turn], lease_owner: str | None) -> int:
        """Write ``turns`` in one transaction; returns the messages written.

        Raises:
            LeaseLostError: the lease on these inbox turns was taken over.
            Exception: anything else, classified by the writer.
        """

    async def held(self, keys: Sequence[str]) -> set[str]:
        """Which of these keys the destination already holds (or has waiting)."""

    async def dead_letter(self, item: Turn | Unreadable, reason: str,
                          lease_owner: str | None) -> None:
        """Keep a record that cannot be written, with why."""


@dataclass(slots=True)
class _Committed:
    source: Source
    turns: list[Turn]
    rows: int
    attempts: int
    duration_s: float


@runtime_checkable
class ReadsAhead(Protocol):
    """A source that can read its next batch while the writer commits the current one."""

    async def read_ahead(self, max_turns: int, max_bytes: int) -> None:
        """Read (and decode) the next batch now; cancellable at any await, losing nothing."""

    def rewind(self) -> None:
        """The next take() offers every record taken and not settled again (a restarted
        writer)."""


Listener = Callable[[Sequence[Turn], Source], Awaitable[None]]


class _Stopping(BaseException):
    """Shutdown reached a write that is retrying a failing store: leave the batch durable
    and unsettled, so nothing after it is written out of order."""


class Writer:
    """The one writer loop; supervised, restartable (a source re-offers what it did not
    settle)."""

    def __init__(
        self, sources: Sequence[Source], sink: Sink, *, max_batch: int, max_batch_bytes: int,
        max_wait_s: float, backoff: Backoff, conditions: Conditions,
        observer: PipelineObserver, listeners: Sequence[Listener] = (),
        clock: Callable[[], float] = time.monotonic,
        chore: Callable[[], Awaitable[bool]] | None = None,
        settled: Callable[[], None] = lambda: None,
    ) -> None:
        self._sources = list(sources)
        # Told after each settle (the backlog shrank: committed, found stored, or
        # dead-lettered), so that a ``wait_until`` on it wakes then, not at the next change.
        self._settled = settled
        # Upkeep of the sink that needs its write connection (a rebuild of an index, in
        # slices): one step between batches, steps back to back while no work waits;
        # returns whether more is left.
        self._chore = chore
        self._chore_left = chore is not None
        self._chore_after = 0.0
        self._sink = sink
        self._max_batch = max_batch
        self._max_bytes = max_batch_bytes
        self._max_wait_s = max_wait_s
        self._backoff = backoff
        self._conditions = conditions
        self._observer = observer
        self._listeners = list(listeners)
        self.stopped = asyncio.Event()  # set when run() returns
        self._clock = clock
        self._wake = asyncio.Event()
        self._rush = asyncio.Event()
        self._stop = asyncio.Event()
        self._stopping = False
        self._poll_s = 0.02
        self._hurry = False
        # A committed batch whose listeners and settle still have to run: they run while the
        # next batch commits (or before the writer waits), so that the loop's work on one
        # batch is not serialized with SQLite's on the next.
        self._behind: _Committed | None = None
        # That work, and the source reading its next batch, while a commit runs.
        self._meanwhile: asyncio.Task[None] | None = None
        self.retries = 0
        self.dead_letters = 0
        self.leases_lost = 0
        self.batches = 0

    # -- control (event-loop thread) ---------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    def hurry(self, on: bool = True) -> None:
        """A flush or shutdown waits: close the group-commit window at once."""
        self._hurry = on
        if on:
            self._rush.set()
            self._wake.set()
        else:
            self._rush.clear()

    def add_listener(self, listener: Listener) -> None:
        """``await listener(turns, source)`` after each commit."""
        self._listeners.append(listener)

    def stop(self) -> None:
        """Finish the write in progress (or give up its retries) and return."""
        self._stopping = True
        self._stop.set()
        self.hurry()

    # -- the loop ----------------------------------------------------------------------

    async def run(self) -> None:
        self.stopped.clear()
        try:
            # A restart: settle what the last run committed, then take again what it had not.
            await self._finish_behind()
            for source in self._sources:
                if isinstance(source, ReadsAhead):
                    source.rewind()
            while not self._stopping:
                found = await self._round()
                if self._chore_left and self._clock() >= self._chore_after \
                        and not self._stopping:
                    await self._finish_behind()
                    await self._chore_step()
                    continue
                if not found:
                    await self._finish_behind()
                    await self._idle()
            await self._finish_behind()
        except _Stopping:
            await self._finish_behind()
            return
        except asyncio.CancelledError:
            # Shutdown: the work started beside the commit stops with the loop that started
            # it (reading ahead loses nothing; a settle not run leaves its records durable,
            # found stored at the next start). After a failure it runs on instead, and the
            # restarted loop waits for it first.
            if self._meanwhile is not None:
                self._meanwhile.cancel()
            raise
        finally:
            self.stopped.set()

    async def _round(self) -> bool:
        """One pass over the sources; whether any had work."""
        found = False
        for source in self._sources:
            if self._stopping:
                return found
            waiting = source.waiting()
            if (waiting and not self._hurry and self._max_wait_s > 0
                    and waiting < self._max_batch):
                # Not saturated: settle the last batch now, its flush waiters go at once.
                await self._finish_behind()
                # The group-commit window; a flush or shutdown ends it at once.
                with anyio.move_on_after(self._max_wait_s):
                    await self._rush.wait()
            await self._meanwhile_done()
            work = await self._retrying(
                functools.partial(source.take, self._max_batch, self._max_bytes))
            if work is None or not work.items:
                continue
            found = True
            await self._process(source, work)
        return found

    async def _chore_step(self) -> None:
        assert self._chore is not None
        try:
            self._chore_left = await self._chore()
        except Exception as exc:  # the store's passing trouble waits; anything else is loud
            if classify(exc) is not Fault.TRANSIENT:
                raise
            self._chore_after = self._clock() + CHORE_RETRY_S
            log.warning("writer_chore_retry", error=describe(exc))

    async def _idle(self) -> None:
        self._wake.clear()
        if any(s.waiting() for s in self._sources) or self._stopping:
            return
        poll = any(s.polls for s in self._sources)
        with anyio.move_on_after(self._poll_s if poll else None):
            await self._wake.wait()
        begin()

    def set_poll_interval(self, seconds: float) -> None:
        self._poll_s = seconds

    # -- one batch ---------------------------------------------------------------------

    async def _process(self, source: Source, work: Work) -> None:
        items = work.items
        if work.replay:
            items = await self._drop_held(source, items)
        run: list[Turn] = []
        # A lifecycle event's statements run after its batch's messages, so a record of the
        # same session behind it must commit in a later transaction (a deleted session's next
        # turn starts it anew, it is not deleted too; a later turn's model outranks an earlier
        # describe's): the event ends its batch when its session has a record after it.
        last: dict[str, int] = {}
        if await _has_lifecycle(items):
            last = {t.session_id: i for i, t in enumerate(items) if isinstance(t, Turn)}
        for i, item in enumerate(items):
            if i % CHUNK == CHUNK - 1:  # a pass over a whole batch is several steps
                await maybe_yield()
            if isinstance(item, Turn):
                run.append(item)
                if item.kind == OP_SESSION and last[item.session_id] > i:
                    await self._write(source, run)
                    run = []
                continue
            if run:
                await self._write(source, run)
                run = []
            await self._dead_letter(source, item, item.error)
        if run:
            await self._write(source, run)

    async def _drop_held(self, source: Source, items: list[Turn | Unreadable]
                         ) -> list[Turn | Unreadable]:
        """Settle the records the destination already holds (a replay); return the rest."""
        await self._finish_behind()  # settles stay in order
        keys = [t.key for t in items if isinstance(t, Turn)]
        held = await self._retrying(lambda: self._sink.held(keys)) if keys else set()
        if not held:
            return items
        skipped = [t for t in items if isinstance(t, Turn) and t.key in held]
        log.info("replay_skipped", turns=len(skipped), source=source.name)
        await self._settle(source, skipped, committed=False)
        return [t for t in items if not (isinstance(t, Turn) and t.key in held)]

    async def _write(self, source: Source, turns: list[Turn]) -> None:
        """Commit ``turns`` in order; isolate and dead-letter what the data makes fail."""
        started = self._clock()
        attempt = 0
        while True:
            try:
                rows = await self._commit(source, turns)
                break
            except LeaseLostError:
                # Our claim expired and another worker took these turns: they are its now.
                self.leases_lost += len(turns)
                log.warning("inbox_lease_lost", turns=len(turns))
                return
            except Exception as exc:  # the per-batch boundary: classify and route
                fault = classify(exc)
                if fault is Fault.FATAL:
                    raise
                if fault is Fault.TRANSIENT:
                    attempt += 1
                    await self._transient(exc, attempt, len(turns))
                    continue
                await self._isolate(source, turns, exc)
                return
        self._conditions.clear("store_retrying")
        self._conditions.clear(DISK_FULL_STORE)
        now = self._clock()
        self.batches += 1
        self._observer.batch_committed(len(turns), rows, now - started)
        # Its listeners and settle run while the next batch commits, or before the writer
        # waits or stops.
        await self._finish_behind()
        self._behind = _Committed(source, turns, rows, attempt + 1, now - started)

    async def _settle_committed(self, done: _Committed) -> None:
        source, turns = done.source, done.turns
        for listener in self._listeners:  # before the barrier moves: a flush then finds them
            await listener(turns, source)
            await maybe_yield()
        await self._settle(source, turns, committed=True)
        await maybe_yield()
        # The turns go a chunk at a step: the last reference to a 2,000-turn batch, dropped
        # at once, frees every turn in one ~1 ms step of the loop. The copy holds them while
        # the batch's own list goes (its other holders are done with it by now).
        n, sessions = len(turns), set()
        held, done.turns = list(turns), []
        del turns
        while held:
            sessions.update([t.session_id for t in held[-CHUNK:]])
            del held[-CHUNK:]
            await maybe_yield()
        log.info(
            f"batch_{self._sink.name}", turns=n, rows=done.rows, source=source.name,
            sessions=len(sessions), attempts=done.attempts,
            duration_ms=round(done.duration_s * 1000, 2), waiting=source.waiting(),
        )

    async def _finish_behind(self) -> None:
        """Run the listeners and the settle of the last committed batch, if still due."""
        await self._meanwhile_done()
        done, self._behind = self._behind, None
        if done is not None:
            await self._settle_committed(done)

    async def _commit(self, source: Source, turns: list[Turn]) -> int:
        """``sink.commit``; meanwhile the last batch is settled and the source reads and
        decodes its next one. The store works on its own thread with the GIL released, so
        the loop's share of the work is no longer serialized with SQLite's."""
        await self._meanwhile_done()
        reads_ahead = isinstance(source, ReadsAhead) and not self._stopping
        done, self._behind = self._behind, None
        if done is not None or reads_ahead:
            self._meanwhile = asyncio.get_running_loop().create_task(
                self._meanwhile_work(done, source if reads_ahead else None),
                name="hermes-memory-writer-meanwhile")
        # On failure the work meanwhile goes on; the next commit or take waits for it. The
        # sink marks the span its store's thread works in (slices.committing).
        rows = await self._sink.commit(turns, source.lease_owner)
        begin()  # back from the store's thread: a fresh slice for the bookkeeping
        await self._meanwhile_done()  # finished already, as a rule
        return rows

    async def _meanwhile_work(self, done: _Committed | None, source: Source | None) -> None:
        if done is not None:
            await self._settle_committed(done)
        if source is not None:
            await cast(ReadsAhead, source).read_ahead(self._max_batch, self._max_bytes)

    async def _meanwhile_done(self) -> None:
        """Wait for the work started beside the last commit; raise its error here."""
        task = self._meanwhile
        if task is None:
            return
        if not task.done():
            await asyncio.wait({task})
        self._meanwhile = None
        if not task.cancelled():
            task.result()

    async def _transient(self, exc: BaseException, attempt: int, turns: int) -> None:
        self.retries += 1
        self._observer.commit_retried()
        condition = DISK_FULL_STORE if is_disk_full(exc) else "store_retrying"
        self._conditions.set(condition, describe(exc))
        delay = self._backoff.delay(attempt)
        log.warning("batch_retry", turns=turns, attempt=attempt, retry_in_s=round(delay, 3),
                    error=describe(exc))
        if not self._stopping:
            with anyio.move_on_after(delay):
                await self._stop.wait()
        if self._stopping:
            raise _Stopping from exc  # shutdown: the batch stays in the outbox

    async def _isolate(self, source: Source, turns: list[Turn], exc: Exception) -> None:
        """Split a batch the data makes fail until the failing record is alone."""
        await self._finish_behind()
        held = await self._retrying(lambda: self._sink.held([t.key for t in turns]))
        if held:  # a replayed record the store has already: not the data's fault
            await self._settle(source, [t for t in turns if t.key in held], committed=False)
            rest = [t for t in turns if t.key not in held]
            if rest:
                await self._write(source, rest)
            return
        if len(turns) == 1:
            await self._dead_letter(source, turns[0], describe(exc))
            return
        mid = len(turns) // 2
        log.info("batch_bisect", turns=len(turns), error=describe(exc))
        await self._write(source, turns[:mid])
        await self._write(source, turns[mid:])

    async def _dead_letter(self, source: Source, item: Turn | Unreadable, reason: str) -> None:
        await self._finish_behind()
        await self._retrying(lambda: self._sink.dead_letter(item, reason, source.lease_owner))
        self.dead_letters += 1
        log.error("record_dead_lettered", key=item.key, session_id=item.session_id,
                  source=source.name, error=reason)
        await self._settle(source, [item], committed=False)

    async def _settle(self, source: Source, items: Sequence[Turn | Unreadable], *,
                      committed: bool) -> None:
        await source.settle(items, committed=committed)
        self._settled()

    async def _retrying(self, op: Callable[[], Awaitable[T]]) -> T:
        """Run a call on the store until it answers, while its failures are transient."""
        attempt = 0
        while True:
            try:
                return await op()
            except Exception as exc:  # classified: only transient failures are retried
                if classify(exc) is not Fault.TRANSIENT:
                    raise
                attempt += 1
                await self._transient(exc, attempt, 0)


async def _has_lifecycle(items: Sequence[Turn | Unreadable]) -> bool:
    """Whether a lifecycle event is among ``items`` (see ``Writer._process``); scanned a
    chunk a step, as the batch's other passes are."""
    for i in range(0, len(items), CHUNK):
        if i:
            await maybe_yield()
        if any([isinstance(t, Turn) and t.kind == OP_SESSION for t in items[i : i + CHUNK]]):
            return True
    return False
