"""The memory pipeline: accept turns without waiting, commit them in batches, recall ahead.

    sync_turn ──► outbox (durable append, bounded queue) ──► writer ──► SQLite store
                                                              │  one transaction per batch
                                                              ├─► prefetch cache (recent turns)
                                                              └─► replica backend (optional)
    queue_prefetch ──► pending recalls (latest per session) ──► recallers ──► prefetch cache
    prefetch ──► prefetch cache (a dict lookup)

Several processes can share one store file (``Settings.role``): a "producer" (a gateway)
runs the same accept path, but its writer hands batches to the file's inbox table and its
recalls are requests that a "worker" (python -m workers) serves. The worker's writer claims
inbox turns under an expiring lease and commits them like its own; it writes recall results
to a table the producers poll into their prefetch caches.

Workers run in an anyio task group owned by one supervisor task, so the pipeline can be
opened in one task and closed from another (pytest fixtures, signal handlers).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import os
import random
import socket
import sqlite3
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, NamedTuple

import anyio
import anyio.lowlevel
import structlog
from anyio.abc import TaskStatus

from .backends import Backend, NullBackend, RecallRequest
from .backends.base import BackendUnavailableError, BackendWriteError
from .cache import PrefetchStatus, RecallCache
from .errors import (
    FlushTimeoutError,
    InvalidTurnError,
    PipelineClosedError,
    StoreError,
)
from .metrics import PipelineObserver
from .outbox import Outbox
from .recall import match_expression, query_terms, render_hits
from .settings import Settings
from .stats import Meter, PipelineStats, percentile
from .store import Batch, ReplicaRow, SqliteStore
from .turns import (
    Receipt,
    Turn,
    check_id,
    has_lone_surrogate,
    sanitize,
    scope_token_for,
    turn_messages,
)

log = structlog.get_logger(__name__)


class _Slice:
    """Time-sliced cooperation for a run of Python work on the event loop."""

    __slots__ = ("_until",)

    def __init__(self) -> None:
        self._until = time.perf_counter() + _SLICE_S

    async def maybe_yield(self) -> None:
        if time.perf_counter() >= self._until:
            await anyio.lowlevel.checkpoint()
            self._until = time.perf_counter() + _SLICE_S


class _Recalled(NamedTuple):
    block: str
    source: str  # "local", or the backend's name
    fallback: bool  # the backend was asked and failed; the local store answered


class _Stopping(BaseException):
    """Shutdown reached a writer that is retrying a failing store: leave the batch durable
    in the outbox, unsettled, so nothing after it is committed out of order."""

_NEW, _OPEN, _CLOSING, _CLOSED = "new", "open", "closing", "closed"
# The writer's Python work (unpacking, building parameters, refreshing the cache) runs in
# steps of _CHUNK turns and yields to the loop once a slice of _SLICE_S has been used: few
# yields when the work is quick (each yield may wait behind a long callback of the host's),
# and never a long stall of the loop when it is not.
_CHUNK = 100
_SLICE_S = 0.0005
# A recall waits at most this long for the turns accepted before it was queued.
_RECALL_BARRIER_S = 1.0
_RETRY_CAP_S = 5.0
# One backend write: the whole backlog of up to this many sessions, up to this many turns.
_REPLICA_SESSIONS = 256
_REPLICA_TURNS = 5000
_REPLICA_POLL_S = 1.0
_MAINTAIN_EVERY_S = 1.0
_PRODUCER_SLOTS = 64
_LEASE_SWEEP_S = 1.0  # how often a worker looks for claims of workers that are gone
_ADOPT_EVERY_S = 30.0  # how often a worker hands in what gone producers left in their slots
_INBOX_KEYS_KEPT_S = 7 * 24 * 3600.0  # done keys of inbox turns: the duplicate guard's memory


class MemoryPipeline:
    """Use as ``async with MemoryPipeline(settings) as mem:``.

    ``sync_turn``, ``queue_prefetch`` and ``prefetch`` never wait on I/O; ``flush``,
    ``get_messages`` and ``aclose`` are awaitable.
    """

    def __init__(
        self,
        settings: Settings | None = None,
        backend: Backend | None = None,
        *,
        store: SqliteStore | None = None,
        clock: Callable[[], float] = time.monotonic,
        observer: PipelineObserver | None = None,
    ) -> None:
        self.settings = s = settings or Settings()
        self.observer = observer or PipelineObserver()
        if backend is None and s.backend == "honcho":
            from .backends.honcho import HonchoBackend, HonchoConfig

            backend = HonchoBackend(s.honcho or HonchoConfig.from_env())
        self.backend = backend or NullBackend()
        self.store = store or SqliteStore(
            s.db_path, readers=s.recall_workers, busy_timeout_ms=s.busy_timeout_ms,
            source=s.source,
        )
        if not isinstance(self.backend, NullBackend) and s.role != "producer":
            # Every commit also queues its turns in this backend's own outbox table.
            self.store.replica = self.backend.name
        self._clock = clock
        self._outbox = Outbox(
            s.outbox_dir,
            segment_bytes=s.outbox_segment_bytes,
            max_queued_turns=s.max_queued_turns,
            max_queued_bytes=s.max_queued_bytes,
            overflow=s.overflow,
            clock=clock,
        )
        self._cache = RecallCache(
            max_sessions=s.cache_max_sessions, recent_turns=s.recent_turns,
            recent_chars=s.recent_chars, clock=clock,
        )
        self._state = _NEW
        self._key_prefix = os.urandom(6).hex()
        # This process as a lease owner: host, pid (so a worker on the same host can tell a
        # gone owner at once) and this pipeline's key prefix.
        self._owner = f"{socket.gethostname()}:{os.getpid()}:{self._key_prefix}"
        self._role = s.role
        self._next_sweep = 0.0
        self._recall_version = 0
        self._inbox_counts: tuple[int, float | None] = (0, None)
        self._replica_counts = (0, 0)  # (pending, dead), refreshed by the maintainer
        self._key_counter = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._work: asyncio.Event | None = None
        self._recall_work: asyncio.Event | None = None
        self._stop: asyncio.Event | None = None
        self._runner: asyncio.Task[None] | None = None
        self._writer_done: asyncio.Event | None = None
        self._closed: asyncio.Event | None = None
        self._writer_stop = False
        self._worker_error: BaseException | None = None
        self._hurry = False
        self._rush: asyncio.Event | None = None  # set with _hurry: ends a group-commit window
        # Flush barrier: turns are processed strictly in accept order, so "the first N
        # accepted are done" is a count.
        self._recovered = 0
        self._processed = 0  # settled: committed, found already stored, or dead-lettered
        self._committed = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._waiter_ids = itertools.count()
        self._pending_recalls: dict[str, tuple[str, str | None, int]] = {}
        self._warming: set[str] = set()
        # A producer's recalls the worker has not answered yet (a set kept in order).
        self._requested: dict[str, None] = {}  # insertion order: the oldest goes first
        self._warm_tasks: set[asyncio.Future[None]] = set()
        self._inflight: dict[tuple[str, tuple[str, ...], str], asyncio.Future[_Recalled]] = {}
        self._replica_work: asyncio.Event | None = None
        self._meter = Meter()
        self._rows_since_vocab = 0
        self._vocab_next = 0.0
        self._counts = {
            "recalls_run": 0, "recalls_shared": 0, "recalls_shed": 0, "recall_errors": 0,
            "commit_retries": 0, "dead_letters": 0, "sanitized": 0, "replica_errors": 0,
            "replicated": 0, "replica_dead": 0, "replica_unavailable": 0, "inbox_committed": 0,
            "leases_lost": 0, "leases_reclaimed": 0,
            "recalls_served": 0, "sessions_warmed": 0,
        }

    # -- life cycle --------------------------------------------------------------------

    async def __aenter__(self) -> MemoryPipeline:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Open the store and the outbox, recover what an earlier run left, start workers.

        Raises:
            StoreError: the store or the outbox cannot be opened.
            PipelineClosedError: the pipeline was already started.
        """
        if self._state != _NEW:
            raise PipelineClosedError(f"the pipeline is {self._state}; start() runs once")
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._work = asyncio.Event()
        self._rush = asyncio.Event()
        self._recall_work = asyncio.Event()
        self._replica_work = asyncio.Event()
        self._stop = asyncio.Event()
        self._writer_done = asyncio.Event()
        self._closed = asyncio.Event()
        started = time.perf_counter()
        await self.store.open()
        try:
            first_segment = await self.store.next_segment()
            if self._role == "producer":
                self._recovered = self._open_producer_outbox(first_segment)
                await self._adopt_free_slots()
                self._recall_version = await self.store.recall_version()
            else:
                self._recovered = self._outbox.open(first_segment)
                await self._refresh_vocab()
            await self._prefault()
            await self.backend.startup()
        except BaseException:
            self._outbox.close()
            await self.store.aclose()
            raise
        ready = asyncio.Event()
        self._runner = asyncio.create_task(self._run(ready), name="hermes-memory-supervisor")
        self._runner.add_done_callback(self._runner_done)
        waiter = asyncio.create_task(ready.wait())
        await asyncio.wait({waiter, self._runner}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.is_set():
            waiter.cancel()
            self._outbox.close()
            await self.store.aclose()
            self._runner.result()  # re-raises what stopped the workers
        self._state = _OPEN
        log.info(
            "pipeline_started", db=str(self.settings.db_path), recovered_turns=self._recovered,
            duration_ms=round((time.perf_counter() - started) * 1000, 2),
        )

    def _slot_outbox(self, slot: int) -> Outbox:
        s = self.settings
        return Outbox(
            s.producer_outbox_dir(slot), segment_bytes=s.outbox_segment_bytes,
            max_queued_turns=s.max_queued_turns, max_queued_bytes=s.max_queued_bytes,
            overflow=s.overflow, clock=self._clock,
        )

    async def _adopt_free_slots(self) -> None:
        """Hand in what producers that are gone left in their slots.

        A restarted producer takes the lowest free slot and commits what was left there; a
        slot nobody restarts into would keep its acknowledged turns for ever. So a producer
        at start, and a worker now and then, read every free slot's turns into the inbox
        (skipping what the store already holds or has waiting) and let the slot go.
        """
        s = self.settings
        own = getattr(self._outbox, "_dir", None)
        first_segment = await self.store.next_segment()
        for slot in range(_PRODUCER_SLOTS):
            directory = s.producer_outbox_dir(slot)
            if directory == own or not directory.is_dir():
                continue
            outbox = self._slot_outbox(slot)
            try:
                found = outbox.open(first_segment)
            except StoreError:
                continue  # a live producer holds it (or it is unusable: its owner's concern)
            handed = 0
            try:
                while found:
                    step = outbox.refill(_CHUNK * 10, s.max_queued_bytes)
                    if not step.turns:
                        break
                    held = await self._retry(lambda: self.store.done_keys(
                        (t.key for t in step.turns), waiting=True))  # noqa: B023
                    todo = [t for t in step.turns if t.key not in held]
                    if todo:
                        batch = Batch.of(todo, self.store.source)
                        await self._retry(lambda: self.store.forward_batch(batch))  # noqa: B023
                        handed += len(todo)
                    outbox.mark_done(step.turns)
            finally:
                outbox.close()
            if handed:
                log.warning("producer_slot_adopted", slot=slot, turns=handed)

    def _open_producer_outbox(self, first_segment: int) -> int:
        """Take the first free producer slot; what a dead producer left there is ours now."""
        s = self.settings
        for slot in range(_PRODUCER_SLOTS):
            outbox = self._slot_outbox(slot)
            try:
                recovered = outbox.open(first_segment)
            except StoreError as exc:
                if isinstance(exc.__cause__, BlockingIOError):
                    continue  # another live producer holds this slot
                raise
            self._outbox = outbox
            log.info("producer_slot", slot=slot, outbox=str(s.producer_outbox_dir(slot)))
            return recovered
        raise StoreError(f"all {_PRODUCER_SLOTS} producer slots of {s.db_path} are in use")

    def _runner_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None and self._state == _OPEN:
            # Accepted turns stay durable in the outbox; the next start commits them.
            self._worker_error = task.exception()
            log.critical("pipeline_workers_failed", error=repr(task.exception()))

    @property
    def state(self) -> str:
        """"new", "open", "closing" or "closed"."""
        return self._state

    @property
    def worker_error(self) -> BaseException | None:
        """What stopped the background workers, if they died; None while they are healthy."""
        return self._worker_error

    async def _run(self, ready: asyncio.Event) -> None:
        assert self._stop is not None
        async with anyio.create_task_group() as tg:
            await tg.start(self._writer)
            for i in range(self.settings.recall_workers):
                await tg.start(self._recaller, i)
            await tg.start(self._replicator)
            tg.start_soon(self._maintainer)
            if self._role == "worker":
                tg.start_soon(self._recall_server)
            elif self._role == "producer":
                tg.start_soon(self._recall_results_poller)
            ready.set()
            await self._stop.wait()
            tg.cancel_scope.cancel()

    async def aclose(self, deadline_s: float | None = None) -> None:
        """The shutdown hook: stop accepting, drain within the deadline, close. Idempotent.

        What the deadline leaves uncommitted stays durable in the outbox and is committed by
        the next start.
        """
        if self._state == _NEW:
            self._state = _CLOSED
            return
        assert self._closed is not None
        if self._state in (_CLOSING, _CLOSED):
            await self._closed.wait()
            return
        self._state = _CLOSING
        deadline = self.settings.shutdown_deadline_s if deadline_s is None else deadline_s
        started = time.perf_counter()
        with anyio.CancelScope(shield=True):
            try:
                target = self._target()
                self._hurry = True
                assert self._rush is not None
                self._rush.set()
                with anyio.move_on_after(deadline):
                    await self._wait_processed(target)
                try:
                    await self._stop_workers()
                finally:
                    # Even when the workers died of an error: the connections' threads are
                    # not daemons, so a store left open would keep the process alive.
                    left = self._target() - self._processed
                    await self._close_resources()
                log.info(
                    "pipeline_closed", committed=self._processed, left_in_outbox=left,
                    duration_ms=round((time.perf_counter() - started) * 1000, 2),
                )
            finally:
                self._state = _CLOSED
                self._closed.set()

    async def _stop_workers(self) -> None:
        assert self._work is not None and self._writer_done is not None and self._stop
        self._writer_stop = True
        self._work.set()
        # The writer stops after the statement it is in; one busy timeout bounds that.
        with anyio.move_on_after(self.settings.busy_timeout_ms / 1000 + 1.0):
            await self._writer_done.wait()
        self._stop.set()
        if self._runner is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._runner
        for _, _, fut in self._waiters:
            if not fut.done():
                fut.set_exception(PipelineClosedError("the pipeline closed before the flush"))
        self._waiters.clear()

    async def _close_resources(self) -> None:
        with contextlib.suppress(Exception):
            await self.backend.aclose()
        await self.store.aclose()
        self._outbox.close()

    # -- accept ------------------------------------------------------------------------

    def sync_turn(
        self,
        user_content: str,
        assistant_content: str,
        *,
        session_id: str,
        user_id: str | None = None,
        messages: Sequence[Mapping[str, Any]] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Receipt:
        """Accept a finished turn. Durable when this returns; never waits on I/O.

        Safe to call from any thread.

        Raises:
            InvalidTurnError: the turn cannot be stored (types, size); nothing was stored.
            QueueFullError: the queue is full and the overflow policy is "reject".
            PipelineClosedError: the pipeline is not open.
            StoreError: the outbox cannot grow (disk full).
        """
        self._check_request(session_id, user_id)
        if metadata is not None and not isinstance(metadata, Mapping):
            raise InvalidTurnError("metadata must be a mapping")
        rows = turn_messages(user_content, assistant_content, messages)
        key = f"{self._key_prefix}-{next(self._key_counter):x}"
        accepted_at = time.time()
        md = dict(metadata) if metadata else None
        if has_lone_surrogate(rows, md):
            # Lone surrogates cannot be stored as UTF-8 anywhere: keep the turn, with U+FFFD.
            rows, md = sanitize(rows), sanitize(md)
            self._counts["sanitized"] += 1
        try:
            turn = Turn.build(key=key, session_id=session_id, user_id=user_id,
                              accepted_at=accepted_at, messages=rows, metadata=md,
                              accepted_mono=self._clock())
        except (TypeError, ValueError) as exc:
            raise InvalidTurnError(f"metadata is not JSON-serialisable: {exc}") from exc
        payload = turn.encode()
        if len(payload) > self.settings.max_turn_bytes:
            raise InvalidTurnError(
                f"the turn is {len(payload)} bytes encoded; the limit (max_turn_bytes) is "
                f"{self.settings.max_turn_bytes}"
            )
        turn, deferred = self._outbox.put(turn, payload)
        self._notify(self._work)
        return Receipt(turn.key, session_id, turn.seq, turn.accepted_at, deferred)

    def queue_prefetch(self, query: str, *, session_id: str, user_id: str | None = None) -> None:
        """Ask for a recall for the session's next turn. Never waits; any thread.

        A newer query replaces an older one for the same session that has not started.

        Raises:
            InvalidTurnError: an id is not a non-empty string.
            PipelineClosedError: the pipeline is not open.
        """
        self._check_request(session_id, user_id)
        if not isinstance(query, str):
            raise InvalidTurnError(f"query must be a string, got {type(query).__name__}")
        if not query.strip():
            return
        self._on_loop(self._queue_recall, query, session_id, user_id)

    def warm(self, session_id: str) -> None:
        """Load a session's stored recent turns into the prefetch cache, in the background,
        if the cache does not hold it (a session resumed after a restart, or in another
        process). Never waits; any thread. A queued recall does this too.

        Raises:
            InvalidTurnError: an id is not a non-empty string.
            PipelineClosedError: the pipeline is not open.
        """
        self._check_request(session_id, None)
        if self._cache.needs_warm(session_id):
            self._on_loop(self._start_warm, session_id)

    def _check_request(self, session_id: str, user_id: str | None) -> None:
        if self._state != _OPEN:
            raise PipelineClosedError(f"the pipeline is {self._state}")
        _check_clean_id("session_id", session_id)
        if user_id is not None:
            _check_clean_id("user_id", user_id)

    def _on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the pipeline's loop: now if this is its thread, else soon."""
        if threading.get_ident() == self._loop_thread:
            fn(*args)
            return
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            self._loop.call_soon_threadsafe(fn, *args)

    def _start_warm(self, session_id: str) -> None:
        if session_id in self._warming or not self._cache.needs_warm(session_id):
            return
        self._warming.add(session_id)
        task = asyncio.ensure_future(self._warm(session_id))
        self._warm_tasks.add(task)  # the loop keeps only a weak reference

        def done(t: asyncio.Future[None]) -> None:
            self._warming.discard(session_id)
            self._warm_tasks.discard(t)

        task.add_done_callback(done)

    async def _warm(self, session_id: str) -> None:
        try:
            turns = await self.store.recent_turns(session_id, max(1, self.settings.recent_turns))
        except Exception as exc:  # the per-job boundary: a cold cache is not an error
            log.warning("cache_warm_failed", session_id=session_id, error=str(exc))
            return
        if self._cache.warm(session_id, turns, self._clock()):
            self._counts["sessions_warmed"] += 1

    def _queue_recall(self, query: str, session_id: str, user_id: str | None) -> None:
        pending = self._pending_recalls
        if session_id not in pending and len(pending) >= self.settings.max_pending_recalls:
            pending.pop(next(iter(pending)))  # the oldest request; counted, never silent
            self._counts["recalls_shed"] += 1
        # The recall runs once the turns accepted before it are committed: a session asking
        # right after its own sync_turn finds that turn.
        pending[session_id] = (query, user_id, self._target())
        assert self._recall_work is not None
        self._recall_work.set()

    def prefetch(self, query: str = "", *, session_id: str) -> str:
        """The session's cached memory block, or "". A dict lookup: no I/O; any thread."""
        return self._cache.get(session_id)

    def prefetch_status(self, session_id: str) -> PrefetchStatus:
        """How fresh the session's cached block is and which turn it reflects."""
        return self._cache.status(session_id)

    def _notify(self, event: asyncio.Event | None) -> None:
        if event is None or event.is_set():
            return
        if threading.get_ident() == self._loop_thread:
            event.set()
        else:
            assert self._loop is not None
            with contextlib.suppress(RuntimeError):  # the loop closed: the turn is durable
                self._loop.call_soon_threadsafe(event.set)

    # -- barriers and reads ------------------------------------------------------------

    def _target(self) -> int:
        return self._recovered + self._outbox.accepted()

    async def flush(
        self, session_id: str | None = None, timeout: float | None = None  # noqa: ASYNC109
    ) -> None:
        """Return once everything accepted before this call is committed and recallable.

        Turns are committed in accept order, so one barrier serves every session.

        Raises:
            FlushTimeoutError: ``timeout`` passed first; the turns stay durable.
            PipelineClosedError: the pipeline is not open.
        """
        if self._state != _OPEN:
            raise PipelineClosedError(f"the pipeline is {self._state}")
        try:
            with anyio.fail_after(timeout):
                await self._wait_processed(self._target())
        except TimeoutError as exc:
            raise FlushTimeoutError(
                f"flush did not finish within {timeout} s; "
                f"{self._target() - self._processed} turns are still pending"
            ) from exc

    async def _wait_processed(self, target: int) -> None:
        if self._processed >= target:
            return
        assert self._loop is not None and self._work is not None
        fut: asyncio.Future[None] = self._loop.create_future()
        heapq.heappush(self._waiters, (target, next(self._waiter_ids), fut))
        self._hurry = True
        assert self._rush is not None
        self._rush.set()
        self._work.set()
        try:
            await fut
        finally:
            if not fut.done():
                fut.cancel()

    def _release_waiters(self) -> None:
        waiters = self._waiters
        while waiters and waiters[0][0] <= self._processed:
            _, _, fut = heapq.heappop(waiters)
            if not fut.done():
                fut.set_result(None)
        if not waiters and self._state == _OPEN:
            self._hurry = False
            if self._rush is not None:
                self._rush.clear()

    async def get_messages(self, session_id: str) -> list[dict[str, Any]]:
        """The session's stored messages, in order.

        Raises:
            PipelineClosedError: the pipeline is not open.
        """
        if self._state not in (_OPEN, _CLOSING):
            raise PipelineClosedError(f"the pipeline is {self._state}")
        return await self.store.get_messages(session_id)

    async def search(
        self, query: str, *, user_id: str | None = None, session_id: str | None = None,
        limit: int | None = None,
    ) -> str:
        """Run a recall now and return its block ("" when nothing matches)."""
        if self._state not in (_OPEN, _CLOSING):
            raise PipelineClosedError(f"the pipeline is {self._state}")
        return await self._recall_local(query, user_id, session_id, limit)

    # -- stats -------------------------------------------------------------------------

    def stats(self) -> PipelineStats:
        now = self._clock()
        counts = self._outbox.counts()
        oldest = 0.0 if counts.oldest_accepted_mono is None else now - counts.oldest_accepted_mono
        batches_s, rows_s = self._meter.rates(now)
        lat = list(self._meter.latencies_s)
        c = self._counts
        return PipelineStats(
            accepted_turns=self._target(),
            committed_turns=self._committed,
            queued_turns=counts.queued_turns,
            queued_bytes=counts.queued_bytes,
            deferred_turns=counts.deferred_turns,
            oldest_pending_age_s=max(0.0, oldest),
            batches_committed=self._meter.batches,
            rows_committed=self._meter.rows,
            batches_per_s=batches_s,
            rows_per_s=rows_s,
            recall_hits=self._cache.hits,
            recall_misses=self._cache.misses,
            recalls_run=c["recalls_run"],
            recalls_shared=c["recalls_shared"],
            recalls_shed=c["recalls_shed"],
            recall_errors=c["recall_errors"],
            write_to_recallable_p50_ms=percentile(lat, 0.50) * 1000,
            write_to_recallable_p99_ms=percentile(lat, 0.99) * 1000,
            commit_retries=c["commit_retries"],
            dead_letters=c["dead_letters"],
            sanitized_turns=c["sanitized"],
            outbox_segments=counts.segments,
            role=self._role,
            inbox_turns=self._inbox_counts[0],
            inbox_oldest_age_s=(0.0 if self._inbox_counts[1] is None
                                else max(0.0, time.time() - self._inbox_counts[1])),
            inbox_committed_turns=c["inbox_committed"],
            replicated_turns=c["replicated"],
            replica_pending=self._replica_counts[0],
            replica_errors=c["replica_errors"],
            replica_dead=self._replica_counts[1],
        )

    # -- the writer --------------------------------------------------------------------

    async def _writer(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        assert self._work is not None and self._writer_done is not None
        task_status.started()
        s = self.settings
        try:
            while True:
                if not self._outbox.has_work():
                    if self._writer_stop:
                        return
                    if self._role == "worker":
                        try:
                            if await self._drain_inbox():
                                continue
                        except _Stopping:
                            return
                    self._work.clear()
                    if not self._outbox.has_work() and not self._writer_stop:
                        if self._role == "worker":  # the inbox has no wake-up: poll it
                            with anyio.move_on_after(s.shared_poll_ms / 1000):
                                await self._work.wait()
                        else:
                            await self._work.wait()
                    continue
                if (
                    not self._hurry
                    and s.max_wait_ms > 0
                    and self._outbox.queued() < s.max_batch
                    and self._outbox.deferred() == 0
                ):
                    # The group-commit window; a flush or shutdown ends it at once.
                    assert self._rush is not None
                    with anyio.move_on_after(s.max_wait_ms / 1000):
                        await self._rush.wait()
                turns, recovered = await self._next_batch()
                if turns:
                    try:
                        await self._write_batch(turns, recovered)
                    except _Stopping:
                        return
                if self._writer_stop:
                    return  # shutdown: what is left stays in the outbox
        finally:
            self._writer_done.set()

    async def _next_batch(self) -> tuple[list[Turn], bool]:
        s = self.settings
        turns: list[Turn] = []
        slice_ = _Slice()
        while len(turns) < s.max_batch:
            chunk = self._outbox.take(min(_CHUNK, s.max_batch - len(turns)))
            if not chunk:
                break
            turns.extend(chunk)
            await slice_.maybe_yield()
        if turns:
            return turns, False
        # The queue is empty but turns wait on disk (deferred, or left by an earlier run).
        recovered = False
        while len(turns) < s.max_batch:
            step = self._outbox.refill(min(_CHUNK, s.max_batch - len(turns)),
                                       s.max_queued_bytes)
            if not step.turns:
                break
            recovered = step.recovered
            turns.extend(step.turns)
            await anyio.lowlevel.checkpoint()
            if recovered and not self._outbox.recovering():
                break  # recovered turns get their own batch: they need a done-keys check
        return turns, recovered

    async def _drain_inbox(self) -> bool:
        """A worker's turn at the shared inbox: claim a batch under a lease and commit it.
        Returns whether it found turns."""
        s = self.settings
        if self._clock() >= self._next_sweep:
            self._next_sweep = self._clock() + _LEASE_SWEEP_S
            await self._sweep_gone_leases()
        rows = await self._retry(
            lambda: self.store.claim_inbox(self._owner, s.lease_s, s.max_batch)
        )
        if not rows:
            return False
        turns: list[Turn] = []
        now = self._clock()
        slice_ = _Slice()
        for inbox_id, key, session_id, accepted_at, record in rows:
            try:
                turn = Turn.decode(record.encode("utf-8"), accepted_mono=now)
            except Exception as exc:  # the per-record boundary: a bad record is not fatal
                # Not a record a producer of ours wrote: keep it as a dead letter, go on.
                stub = Turn.unpack((key, inbox_id, session_id, None, accepted_at, "", 0, 0, now,
                                    0, 0, "", "", None, None, None, 0, 0, False))
                await self._dead_letter_unreadable(stub, record, exc)
                continue
            turns.append(turn._replace(seq=inbox_id))
            await slice_.maybe_yield()
        if turns:
            await self._commit(turns, inbox=True)
        return True

    async def _dead_letter_unreadable(self, stub: Turn, record: str, exc: Exception) -> None:
        error = f"unreadable inbox record: {type(exc).__name__}: {exc}"
        payload = record.encode("utf-8", "replace")
        await self._retry(lambda: self.store.dead_letter(stub, error, 1, payload))
        await self._retry(lambda: self.store.delete_inbox([stub.seq]))
        self._counts["dead_letters"] += 1
        log.error("inbox_record_unreadable", key=stub.key, error=error)

    async def _sweep_gone_leases(self) -> None:
        """Take back the claims of workers on this host whose process is gone: their turns
        need not wait out the lease."""
        host = socket.gethostname()
        for owner in await self._retry(self.store.lease_owners):
            if owner == self._owner:
                continue
            owner_host, _, rest = owner.partition(":")
            pid_text = rest.partition(":")[0]
            if owner_host != host or not pid_text.isdigit() or _process_alive(int(pid_text)):
                continue
            released = await self._retry(lambda: self.store.release_leases(owner))  # noqa: B023
            self._counts["leases_reclaimed"] += released
            log.warning("inbox_leases_reclaimed", owner=owner, turns=released)

    async def _write_batch(self, turns: list[Turn], recovered: bool) -> None:
        if recovered:
            turns = await self._drop_stored(turns)
            if not turns:
                return
        await self._commit(turns)

    async def _drop_stored(self, turns: list[Turn], inbox: bool = False) -> list[Turn]:
        """Settle the turns the store already holds (a replay); return the rest."""
        waiting = self._role == "producer"  # handed to the inbox counts as held
        done = await self._retry(
            lambda: self.store.done_keys((t.key for t in turns), waiting=waiting)
        )
        if not done:
            return turns
        skipped = [t for t in turns if t.key in done]
        log.info("outbox_replay_skipped", turns=len(skipped), inbox=inbox)
        await self._settle(skipped, committed=False, inbox=inbox)
        return [t for t in turns if t.key not in done]

    async def _commit(self, turns: list[Turn], inbox: bool = False) -> None:
        """Commit ``turns`` in order; isolate and dead-letter what cannot be stored.

        ``inbox``: the turns were claimed from the shared inbox (their ``seq`` is the inbox
        row), not accepted here. A producer's commit hands the batch to the inbox instead.
        """
        started = self._clock()
        batch = Batch(self.store.source)
        if inbox:
            batch.inbox_ids = [t.seq for t in turns]
            batch.lease_owner = self._owner
        write = self.store.forward_batch if self._role == "producer" else self.store.commit_batch
        slice_ = _Slice()
        for i in range(0, len(turns), _CHUNK):
            if i:
                await slice_.maybe_yield()
            batch.add(turns[i : i + _CHUNK])
        # Building the batch's SQL (about a megabyte for 2,000 turns) starts a new slice.
        await anyio.lowlevel.checkpoint()
        attempt = 0
        while True:
            try:
                await write(batch)
                break
            except sqlite3.OperationalError as exc:
                # Busy, locked, I/O, disk full: the store's trouble, not the turns'. Retry the
                # whole batch; never dead-letter good turns for it.
                attempt += 1
                self._counts["commit_retries"] += 1
                self.observer.commit_retried()
                log.warning("batch_retry", turns=len(turns), attempt=attempt, error=str(exc))
                if self._writer_stop:
                    raise _Stopping from exc  # shutdown: the batch stays in the outbox
                await anyio.sleep(self._backoff(attempt))
            except sqlite3.IntegrityError as exc:
                if inbox and "held" in str(exc):
                    # Our lease ran out and another worker took these turns: they are its.
                    self._counts["leases_lost"] += len(turns)
                    log.warning("inbox_lease_lost", turns=len(turns))
                    return
                remaining = await self._drop_stored(turns, inbox)
                if len(remaining) < len(turns):
                    if remaining:
                        await self._commit(remaining, inbox)
                    return
                await self._isolate(turns, exc, inbox)
                return
            except Exception as exc:  # the per-job boundary: route, count, log
                await self._isolate(turns, exc, inbox)
                return
        now = self._clock()
        rows = batch.n_messages
        self._meter.record_batch(now, len(turns), rows)
        self.observer.batch_committed(len(turns), rows, now - started)
        self._rows_since_vocab += rows
        await self._settle(turns, committed=True, inbox=inbox)
        self._outbox.prepare_spare()
        await self._prefault()
        if self._role != "producer":
            self._hand_to_replica(turns)
        log.info(
            "batch_forwarded" if self._role == "producer" else "batch_committed",
            turns=len(turns), rows=rows, inbox=inbox,
            sessions=batch.session_count(),
            duration_ms=round((now - started) * 1000, 2), attempts=attempt + 1,
            queued=self._outbox.queued(), deferred=self._outbox.deferred(),
        )

    async def _isolate(self, turns: list[Turn], exc: BaseException, inbox: bool = False) -> None:
        """Split a failing batch until the turn that fails is alone, then dead-letter it."""
        if len(turns) > 1:
            mid = len(turns) // 2
            await self._commit(turns[:mid], inbox)
            await self._commit(turns[mid:], inbox)
            return
        turn = turns[0]
        error = f"{type(exc).__name__}: {exc}"
        for attempt in range(1, self.settings.commit_max_attempts):
            await anyio.sleep(self._backoff(attempt))
            try:
                if inbox:
                    batch = Batch.of(turns, self.store.source)
                    batch.inbox_ids, batch.lease_owner = [turn.seq], self._owner
                    await self.store.commit_batch(batch)
                else:
                    await self.store.commit(turns)
            except sqlite3.OperationalError:
                raise  # not this turn's fault after all; the caller's loop retries
            except Exception as again:  # the per-job boundary
                if inbox and "held" in str(again):
                    self._counts["leases_lost"] += 1  # another worker has the turn now
                    log.warning("inbox_lease_lost", turns=1)
                    return
                error = f"{type(again).__name__}: {again}"
                continue
            await self._settle(turns, committed=True, inbox=inbox)
            return
        payload = _safe_payload(turn)
        await self._retry(
            lambda: self.store.dead_letter(turn, error, self.settings.commit_max_attempts, payload)
        )
        self._counts["dead_letters"] += 1
        log.error("turn_dead_lettered", key=turn.key, session_id=turn.session_id, error=error)
        await self._settle(turns, committed=False, inbox=inbox)

    async def _retry(self, op: Callable[[], Any]) -> Any:
        """Run a store call until the store answers; its failures are the store's, not data's."""
        attempt = 0
        while True:
            try:
                return await op()
            except sqlite3.OperationalError as exc:
                attempt += 1
                self._counts["commit_retries"] += 1
                self.observer.commit_retried()
                log.warning("store_retry", attempt=attempt, error=str(exc))
                if self._writer_stop:
                    raise _Stopping from exc
                await anyio.sleep(self._backoff(attempt))

    def _backoff(self, attempt: int) -> float:
        base = float(self.settings.commit_retry_base_s) * 2.0 ** min(attempt, 10)
        return min(_RETRY_CAP_S, base) * (0.5 + random.random() / 2)

    async def _settle(self, turns: list[Turn], *, committed: bool, inbox: bool = False) -> None:
        """These turns are done with (stored, found stored, or dead-lettered), in order."""
        if inbox and not committed:  # a commit removes its inbox rows; else do it here
            await self._retry(lambda: self.store.delete_inbox([t.seq for t in turns]))
        slice_ = _Slice()
        for i in range(0, len(turns), _CHUNK):
            if i:
                await slice_.maybe_yield()
            chunk = turns[i : i + _CHUNK]
            if inbox:
                if committed:
                    self._counts["inbox_committed"] += len(chunk)
            else:
                self._outbox.mark_done(chunk)
                self._processed += len(chunk)
            if committed:
                self._committed += len(chunk)
                now = self._clock()
                wall = time.time()
                lat = self._meter.latencies_s
                note = self._cache.note_commit
                for t in chunk:
                    note(t.session_id, t.user_id, t.key, t.user_text, t.assistant_text, now)
                    lat.append(wall - t.accepted_at)
            self._release_waiters()

    # -- replication -------------------------------------------------------------------

    def _hand_to_replica(self, turns: list[Turn]) -> None:
        if self.store.replica is not None:
            self._notify(self._replica_work)  # their rows are in the replica outbox

    async def _replicator(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
                          ) -> None:
        """Send committed turns to the backend from its outbox table, oldest first.

        A turn leaves the table once the backend has it. One the backend refuses, or that
        fails ``replica_max_attempts`` times, stays there as the backend's dead letter; the
        session's later turns go on. While the backend is unavailable nothing counts.
        """
        assert self._replica_work is not None
        task_status.started()
        name = self.store.replica
        if name is None:
            return
        unsure_upto: int | None = None
        failures_in_row = 0
        while True:
            try:
                if unsure_upto is None:
                    # Rows an earlier run left may have reached the backend before it stopped.
                    unsure_upto = await self.store.replica_last_id(name)
                rows = await self.store.replica_pending(name, _REPLICA_SESSIONS, _REPLICA_TURNS)
                if not rows:
                    self._replica_work.clear()
                    with anyio.move_on_after(_REPLICA_POLL_S):  # a replayed dead letter
                        await self._replica_work.wait()
                    continue
                turns = await self.store.replica_turns(rows)
                # Tried before (even while the backend was unavailable) or left by an earlier
                # run: the backend first checks what it already holds.
                maybe_sent = any(r.tried or r.id <= unsure_upto for r in rows)
                wait = await self._replicate(name, rows, turns, maybe_sent, failures_in_row)
            except _Stopping:
                return  # shutdown while the store is busy: the rows stay for the next run
            except Exception as exc:  # the per-job boundary: the store failed; try again
                wait = self._backoff(failures_in_row + 1)
                log.warning("replica_store_failed", backend=name, error=str(exc))
            failures_in_row = failures_in_row + 1 if wait else 0
            if wait:
                await anyio.sleep(wait)

    async def _replicate(self, name: str, rows: Sequence[ReplicaRow], turns: list[Turn],
                         maybe_sent: bool, failures_in_row: int) -> float:
        """One backend write and its bookkeeping; returns how long to wait before the next."""
        try:
            await self.backend.write(turns, maybe_sent=maybe_sent)
        except BackendUnavailableError as exc:
            self._counts["replica_unavailable"] += 1
            marks = [(r.id, str(exc), False) for r in rows]  # tried, and counted as nothing
            await self._retry(lambda: self.store.replica_failed(marks, counted=False))
            wait = exc.retry_after_s or self._backoff(failures_in_row + 1)
            log.warning("replica_unavailable", backend=name, turns=len(rows),
                        retry_in_s=round(wait, 3), error=str(exc))
            return wait
        except Exception as exc:  # the per-job boundary: every failure is kept
            return await self._replica_failed(name, rows, exc)
        ids = [r.id for r in rows]
        await self._retry(lambda: self.store.replica_done(ids))
        self._counts["replicated"] += len(rows)
        return 0.0

    async def _replica_failed(self, name: str, rows: Sequence[ReplicaRow],
                              exc: Exception) -> float:
        """Keep what a failed write says; returns how long to wait before the next."""
        limit = self.settings.replica_max_attempts
        # Failing because the backend went unavailable meanwhile (its breaker opened): an
        # outage, in which no turn is given up; only a refusal makes a dead letter then.
        counted = self.backend.available()
        named = {f.key: f for f in exc.failures} if isinstance(exc, BackendWriteError) else None
        written, failed = [], []
        for r in rows:
            f = named.get(r.turn_key) if named is not None else None
            if named is not None and f is None:
                written.append(r.id)
                continue
            reason = f.reason if f is not None else f"{type(exc).__name__}: {exc}"
            permanent = f.permanent if f is not None else False
            failed.append((r.id, reason, permanent or (counted and r.attempts + 1 >= limit)))
        await self._retry(lambda: self.store.replica_done(written))
        await self._retry(lambda: self.store.replica_failed(failed, counted=counted))
        dead = sum(1 for _, _, d in failed if d)
        self._counts["replicated"] += len(written)
        self._counts["replica_errors"] += len(failed) - dead
        self._counts["replica_dead"] += dead
        log.warning("replica_write_failed", backend=name, turns=len(rows), written=len(written),
                    failed=len(failed), dead=dead, error=str(exc))
        retry = [r for r in failed if not r[2]]
        if not retry:
            return 0.0
        return self._backoff(max((r.attempts for r in rows), default=0) + 1)

    # -- recall ------------------------------------------------------------------------

    async def _recaller(self, index: int, *,
                        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        assert self._recall_work is not None
        task_status.started()
        pending = self._pending_recalls
        while True:
            if not pending:
                self._recall_work.clear()
                await self._recall_work.wait()
                continue
            session_id = next(iter(pending))
            query, user_id, target = pending.pop(session_id)
            if self._processed < target:
                with anyio.move_on_after(_RECALL_BARRIER_S):
                    await self._wait_processed(target)
            if self._cache.needs_warm(session_id) and session_id not in self._warming:
                await self._warm(session_id)  # a resumed session: its own turns first
            user_id = user_id or self._cache.user_of(session_id)
            if self._role == "producer":
                try:  # the worker runs it; the results poller brings the block back
                    self._requested[session_id] = None  # before the request: no race
                    await self.store.request_recall(session_id, user_id, query)
                    while len(self._requested) > self.settings.max_pending_recalls:
                        self._requested.pop(next(iter(self._requested)))
                except Exception as exc:  # the per-job boundary
                    self._counts["recall_errors"] += 1
                    log.warning("recall_request_failed", session_id=session_id, error=str(exc))
                continue
            try:
                recalled = await self._recall_shared(query, user_id, session_id)
            except Exception as exc:  # the per-job boundary
                self._counts["recall_errors"] += 1
                log.warning("recall_failed", session_id=session_id, error=str(exc))
                continue
            self._cache.set_recall(session_id, user_id, query, recalled.block,
                                   source=recalled.source, fallback=recalled.fallback)

    async def _recall_shared(self, query: str, user_id: str | None, session_id: str
                             ) -> _Recalled:
        scope = scope_token_for(user_id, session_id)
        terms = tuple(query_terms(query, self.store.frequent_terms, self.settings.recall_max_terms))
        # One user's identical recalls share one search; a backend's recall is per session.
        key = (scope, terms, session_id if self.backend.recalls else "")
        running = self._inflight.get(key)
        if running is not None:
            self._counts["recalls_shared"] += 1
            return await asyncio.shield(running)
        assert self._loop is not None
        fut: asyncio.Future[_Recalled] = self._loop.create_future()
        self._inflight[key] = fut
        try:
            block = await self._recall_block(query, user_id, session_id, terms, scope)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: waiters may be gone
            raise
        else:
            fut.set_result(block)
            return block
        finally:
            del self._inflight[key]

    async def _recall_block(self, query: str, user_id: str | None, session_id: str,
                            terms: tuple[str, ...], scope: str) -> _Recalled:
        self._counts["recalls_run"] += 1
        started = time.perf_counter()
        try:
            block = await self._recall_block_from(query, user_id, session_id, terms, scope)
        except Exception:
            self.observer.recall_done(time.perf_counter() - started, False)
            raise
        self.observer.recall_done(time.perf_counter() - started, True)
        return block

    async def _recall_block_from(self, query: str, user_id: str | None, session_id: str,
                                 terms: tuple[str, ...], scope: str) -> _Recalled:
        """The backend's block when it answers; else the local store's, marked as a
        fallback when the backend was asked and failed (an error, or its deadline)."""
        fallback = False
        if not isinstance(self.backend, NullBackend):
            request = RecallRequest(query, session_id, user_id, self.settings.recall_limit)
            try:
                remote = await self.backend.recall(request)
            except Exception as exc:  # the backend's trouble: the local store answers
                log.warning("backend_recall_failed", backend=self.backend.name, error=str(exc))
                remote = None
            if remote is not None:
                return _Recalled(remote, self.backend.name, False)
            fallback = self.backend.recalls
        local = await self._search_terms(terms, scope, self.settings.recall_limit)
        return _Recalled(local, "local", fallback)

    async def _recall_local(self, query: str, user_id: str | None, session_id: str | None,
                            limit: int | None) -> str:
        scope = scope_token_for(user_id, session_id)
        terms = query_terms(query, self.store.frequent_terms, self.settings.recall_max_terms)
        return await self._search_terms(terms, scope, limit or self.settings.recall_limit)

    async def _search_terms(self, terms: Sequence[str], scope: str, limit: int) -> str:
        if not terms:
            return ""
        hits = await self.store.search(
            match_expression(terms, scope), limit=limit,
            snippet_tokens=self.settings.recall_snippet_tokens,
        )
        return render_hits(hits)

    async def _recall_server(self) -> None:
        """A worker serves the producers' recall requests and writes the blocks back."""
        poll = self.settings.shared_poll_ms / 1000
        while True:
            try:
                requests = await self.store.take_recall_requests(64)
            except Exception as exc:  # the per-job boundary
                log.warning("recall_requests_unreadable", error=str(exc))
                requests = []
            if not requests:
                await anyio.sleep(poll)
                continue
            for session_id, user_id, query, after_id in requests:
                try:
                    # The turns handed in before the request first, as for a local recall.
                    with anyio.move_on_after(_RECALL_BARRIER_S):
                        # Another process's progress: there is no event to wait on.
                        while await self.store.inbox_holds(after_id):  # noqa: ASYNC110
                            await anyio.sleep(poll)
                    recalled = await self._recall_shared(query, user_id, session_id)
                    await self.store.put_recall_result(
                        session_id, user_id, query, recalled.block, recalled.source,
                        recalled.fallback)
                    self._counts["recalls_served"] += 1
                except Exception as exc:  # the per-job boundary
                    self._counts["recall_errors"] += 1
                    log.warning("recall_serve_failed", session_id=session_id, error=str(exc))

    async def _recall_results_poller(self) -> None:
        """A producer copies the recall blocks a worker wrote into its prefetch cache."""
        poll = self.settings.shared_poll_ms / 1000
        while True:
            await anyio.sleep(poll)
            try:
                rows = await self.store.recall_results_since(self._recall_version)
            except Exception as exc:  # the per-job boundary
                log.warning("recall_results_unreadable", error=str(exc))
                continue
            for session_id, user_id, query, block, version, source, fallback in rows:
                self._recall_version = version
                # Only the sessions this gateway serves: another gateway's would crowd its
                # cache out (and keep a resumed session from being warmed).
                asked = session_id in self._requested
                if asked:
                    del self._requested[session_id]
                elif session_id not in self._cache:
                    continue
                self._cache.set_recall(session_id, user_id, query, block, source=source,
                                       fallback=fallback)

    # -- upkeep ------------------------------------------------------------------------

    async def _maintainer(self) -> None:
        """Off the accept path: the next outbox segment, frequent terms, old outbox keys."""
        last_pruned = 0
        next_adoption = 0.0
        while True:
            await anyio.sleep(_MAINTAIN_EVERY_S)
            try:
                self._outbox.prepare_spare()
                await self._prefault()
                if self._role == "producer":
                    continue  # the worker keeps the store; done keys guard every producer
                oldest = self._outbox.oldest_segment()
                if oldest > last_pruned:
                    await self.store.prune_outbox(oldest)
                    last_pruned = oldest
                if self._rows_since_vocab and self._clock() >= self._vocab_next:
                    await self._refresh_vocab()
                if self._role == "worker":
                    self._inbox_counts = await self.store.inbox_counts()
                    if self._clock() >= next_adoption:
                        next_adoption = self._clock() + _ADOPT_EVERY_S
                        await self._adopt_free_slots()
                        await self.store.prune_inbox_keys(time.time() - _INBOX_KEYS_KEPT_S)
                if self.store.replica is not None:
                    self._replica_counts = await self.store.replica_counts(self.store.replica)
            except Exception as exc:  # the per-job boundary
                log.warning("maintenance_failed", error=str(exc))

    async def _prefault(self) -> None:
        plan = self._outbox.prefault_plan()
        if plan:
            await anyio.to_thread.run_sync(Outbox.prefault, plan)

    async def _refresh_vocab(self) -> None:
        """Re-read the frequent terms; the scan grows with the store, so its own duration
        spaces the next one out (at most ~1 % of one reader's time)."""
        s = self.settings
        self._rows_since_vocab = 0
        started = self._clock()
        terms = await self.store.refresh_frequent_terms(s.frequent_term_rows, s.frequent_term_ratio)
        took = self._clock() - started
        self._vocab_next = self._clock() + max(s.frequent_terms_refresh_s, took * 100)
        log.debug("frequent_terms_refreshed", terms=len(terms), duration_ms=round(took * 1e3, 2))


def _check_clean_id(name: str, value: object) -> None:
    check_id(name, value)
    assert isinstance(value, str)
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidTurnError(f"{name} holds a lone surrogate") from exc


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, someone else's
    return True


def _safe_payload(turn: Turn) -> bytes:
    try:
        return turn.encode()
    except (UnicodeEncodeError, TypeError, ValueError):
        return repr(turn.messages).encode("utf-8", "backslashreplace")
