"""The memory pipeline: accept turns without waiting, commit them in batches, recall ahead.

    sync_turn ──► outbox (durable append) ──► writer ──► sink: the store, or (a producer) the
                                                │         shared inbox a worker commits from
                                                ├─► commit barrier (flush, per session too)
                                                ├─► prefetch cache (recent turns)
                                                └─► replicator ──► replica backend
    queue_prefetch ──► recall service ──► recaller ──► prefetch cache ◄── prefetch (a lookup)

This class only composes the parts (see the modules named above, ``shared/`` for the
several-processes parts, ``maintenance`` and ``supervisor``) and holds the public calls. The
role in ``Settings`` picks the writer's sources and sink and the recaller; nothing else
depends on it. Every background part runs under the supervisor: a transient failure restarts
it, any other puts the pipeline in its failed state (``health()``, ``flush()``).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import anyio
import structlog

from .backends import Backend, NullBackend
from .barrier import CommitBarrier
from .errors import (
    ConfigurationError,
    DiskFullError,
    FlushTimeoutError,
    InvalidTurnError,
    PipelineClosedError,
    PipelineFailedError,
    describe,
)
from .fence import Fence
from .memory.backends import memory_for
from .message_rows import CHECKED_IDS, check_id
from .metrics import PipelineObserver
from .outbox.destroyed import DESTROYED_FILE, OUTBOX_DESTROYED
from .parts import Parts, build_parts, collect_stats
from .procedural.api import ProceduralMemory
from .recall.cache import PrefetchStatus, RecallCache
from .retry import Backoff
from .sessions.api import SessionStore
from .settings import Settings
from .stats import Meter, PipelineStats
from .store import SqliteStore, ToolLogConfig
from .supervisor import DISK_FULL, Conditions, Health
from .templates.store import TemplateStore
from .turns import Receipt, encode_turn
from .waker import LoopWaker

_new_tuple = tuple.__new__
log = structlog.get_logger(__name__)

NEW, OPEN, CLOSING, CLOSED = "new", "open", "closing", "closed"


class MemoryPipeline:
    """Use as ``async with MemoryPipeline(settings) as mem:``.

    ``sync_turn``, ``queue_prefetch``, ``warm``, ``prefetch`` and ``prefetch_status`` never
    wait on I/O and may be called from any thread; ``flush``, ``get_messages``, ``search``
    and ``aclose`` are awaitable.
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
            if s.honcho is None:
                raise ConfigurationError("backend 'honcho' needs Settings.honcho (a HonchoConfig;"
                                         " Settings.from_env() reads it from HONCHO_*)")
            from .backends.honcho import HonchoBackend

            backend = HonchoBackend(s.honcho)
        if backend is None and s.backend == "postgres":
            from .postgres.backend import PostgresBackend

            backend = PostgresBackend(s)
        self.backend = backend or NullBackend()
        self.store = store or SqliteStore(
            s.db_path, readers=s.recall_workers, busy_timeout_ms=s.busy_timeout_ms,
            source=s.source,
        )
        if not isinstance(self.backend, NullBackend) and s.role != "producer":
            self.store.replica = self.backend.name  # each commit queues its turns for it
            if self.backend.mirrors_kv:  # and its key-value writes
                self.store.replica_kv = True
            if self.backend.mirrors_templates:  # and its template records
                self.store.replica_templates = True
        if s.tool_log:  # each commit logs its turns' tool calls
            self.store.tool_log = ToolLogConfig(s.tool_outcome_rules, s.tool_log_max_per_user,
                                                s.tool_fix_window_s)
        self.clock = clock
        self._backoff = Backoff(base_s=s.commit_retry_base_s)
        self.conditions = Conditions(clock)
        self.barrier = CommitBarrier()
        # The tags stored text may not hold in what the agent is shown (fence.py).
        self.fence = Fence(s.fence_tags)
        self.cache = RecallCache(max_sessions=s.cache_max_sessions, recent_turns=s.recent_turns,
                                 recent_chars=s.recent_chars, clock=clock, fence=self.fence)
        self.meter = Meter()
        self._changed = asyncio.Event()  # set, and replaced, after each change: wait_until()
        self.cache.on_change = self.changed
        self._fresh = self.cache.fresh  # prefetch's warm path (RecallCache.fresh)
        # Key-value memory per user, through the same outbox as turns (see ``memory``).
        self.memory = memory_for(self)
        # The session store: its reads, and its lifecycle writes through the same outbox.
        self.procedural = ProceduralMemory(self.store)  # the tool-call log's reads
        self.sessions = SessionStore(self)
        # Warm-start templates, their writes through the same outbox (``templates.store``).
        self.templates = TemplateStore(self)
        self._parts: Parts | None = None
        self._state = NEW
        self._failure: PipelineFailedError | None = None
        self._failed = asyncio.Event()
        self._closed = asyncio.Event()
        self._key_prefix = os.urandom(6).hex()
        self._key_counter = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._runner: asyncio.Task[None] | None = None
        self._waker: LoopWaker | None = None
        self.sanitized = 0

    # -- life cycle --------------------------------------------------------------------

    async def __aenter__(self) -> MemoryPipeline:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Open the store and the outbox, recover what an earlier run left, start the parts.

        Raises:
            StoreError: the store or the outbox cannot be used (CorruptStoreError,
                StoreAccessError, DiskFullError name the cause). A full disk only stops a
                start that cannot open the store: the outbox opens without a new segment,
                and what an earlier run left is committed.
            PipelineClosedError: the pipeline was already started.
        """
        if self._state != NEW:
            raise PipelineClosedError(f"the pipeline is {self._state}; start() runs once")
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        started = time.perf_counter()
        parts = await build_parts(self, self._key_prefix, self._backoff, self._on_failure)
        self.store.on_corrupt = lambda exc: self._on_failure(PipelineFailedError("store", exc))
        self._parts = parts
        self._runner = asyncio.create_task(parts.supervisor.run(), name="hermes-memory")
        waker = LoopWaker(self._loop)
        waker.start()
        self._waker = waker
        self._state = OPEN
        log.info("pipeline_started", db=str(self.settings.db_path), role=self.settings.role,
                 recovered_turns=parts.recovery.records,
                 quarantined_bytes=parts.recovery.quarantined_bytes,
                 duration_ms=round((time.perf_counter() - started) * 1000, 2))

    def _on_failure(self, error: PipelineFailedError) -> None:
        if self._failure is not None:
            return
        self._failure = error
        self.barrier.fail(error)
        self._failed.set()
        self.changed()
        # Accepted turns stay durable in the outbox; the next start commits them.
        log.critical("pipeline_failed", part=error.part, error=describe(error.cause))

    @property
    def state(self) -> str:
        """"new", "open", "failed", "closing" or "closed"."""
        return "failed" if self._failure is not None and self._state == OPEN else self._state

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the pipeline runs on, once started."""
        return self._loop

    @property
    def loop_thread(self) -> int:
        """The ident of the thread that runs ``loop``."""
        return self._loop_thread

    @property
    def outbox_dir(self) -> Path | None:
        """The outbox folder this pipeline accepts into (a producer's own slot), once open."""
        return None if self._parts is None else self._parts.outbox.directory

    @property
    def failure(self) -> PipelineFailedError | None:
        """Why the pipeline failed, or None."""
        return self._failure

    worker_error = failure  # the name an earlier version used

    async def wait_failed(self) -> PipelineFailedError:
        """Return the failure once the pipeline fails (never, while it works)."""
        await self._failed.wait()
        assert self._failure is not None
        return self._failure

    def health(self) -> Health:
        """Whether the pipeline works, and what troubles it meanwhile (``/healthz``)."""
        directory = self.outbox_dir
        if (directory is not None and OUTBOX_DESTROYED in self.conditions
                and not (directory / DESTROYED_FILE).exists()):
            self.conditions.clear(OUTBOX_DESTROYED)  # `outbox clear-destroyed` removed it
            if self._parts is not None:
                self._parts.outbox.destroyed_turns = 0
        conditions = self.conditions.snapshot()
        if self._failure is not None:
            return Health(self.state, False, str(self._failure), conditions)
        if self._state != OPEN:
            return Health(self._state, False, f"pipeline {self._state}", conditions)
        full = self.conditions.disk_full()
        if full is not None:
            return Health(OPEN, False, f"disk full: {full}", conditions)
        return Health(OPEN, True, None, conditions)

    async def aclose(self, deadline_s: float | None = None) -> None:
        """The shutdown hook: stop accepting, drain within the deadline, close. Idempotent.

        What the deadline leaves uncommitted stays durable in the outbox and is committed by
        the next start. Returns within the deadline (and ~0.1 s) whatever state it is in.
        """
        if self._state == NEW:
            self._state = CLOSED
            self._closed.set()
            return
        if self._state in (CLOSING, CLOSED):
            await self._closed.wait()
            return
        self._state = CLOSING
        deadline = self.settings.shutdown_deadline_s if deadline_s is None else deadline_s
        parts = self._parts
        assert parts is not None and self._runner is not None
        with anyio.CancelScope(shield=True):
            try:
                await parts.shut_down(self._runner, deadline, drain=self._failure is None)
            finally:
                waker, self._waker = self._waker, None
                if waker is not None:
                    await anyio.to_thread.run_sync(waker.stop, abandon_on_cancel=True)
                self._state = CLOSED
                self._closed.set()

    # -- accept (any thread, no I/O) -----------------------------------------------------

    def sync_turn(
        self, user_content: str, assistant_content: str, *, session_id: str,
        user_id: str | None = None, messages: Sequence[Mapping[str, Any]] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Receipt:
        """Accept a finished turn. Durable when this returns; never waits on I/O.

        A pipeline whose parts failed still accepts while its outbox can make the turn
        durable: the next start commits it.

        Raises:
            InvalidTurnError: the turn can never be stored (types, size, nesting, token
                counts); nothing was stored.
            QueueFullError: the backlog is full and the overflow policy is "reject".
            DiskFullError: no space to make the turn durable; nothing was stored.
            PipelineClosedError: the pipeline is not open.
        """
        parts = self._accepting()
        if not (type(session_id) is str and session_id in CHECKED_IDS and (
                user_id is None or (type(user_id) is str and user_id in CHECKED_IDS))):
            _check_ids(session_id, user_id)  # a new id (a session's first turn, mostly)
        key = f"{self._key_prefix}-{next(self._key_counter):x}"  # new_key(), inlined
        accepted_at = time.time()
        data, n_messages, normalized = encode_turn(
            key, session_id, user_id, accepted_at, user_content, assistant_content, messages,
            metadata, self.settings.max_turn_bytes)
        receipt = self._append(parts, key, session_id, accepted_at, data, n_messages)
        self.sanitized += normalized
        return receipt

    def new_key(self) -> str:
        """A fresh record key: unique to this pipeline and process."""
        return f"{self._key_prefix}-{next(self._key_counter):x}"

    def accept_record(self, key: str, lane: str, accepted_at: float, data: bytes,
                      n_messages: int = 0) -> Receipt:
        """Append an encoded record (a turn, or an operation in its lane) to the outbox:
        durable when this returns. Any thread; the ids were checked by the caller.

        Raises:
            QueueFullError, DiskFullError, PipelineClosedError: as ``sync_turn``.
        """
        return self._append(self._accepting(), key, lane, accepted_at, data, n_messages)

    def _append(self, parts: Parts, key: str, lane: str, accepted_at: float, data: bytes,
                n_messages: int) -> Receipt:
        try:
            seq, deferred, first_id = parts.outbox.append(data, n_messages)
        except DiskFullError as exc:
            self.conditions.set(DISK_FULL, describe(exc))
            raise
        self.barrier.note_accepted(lane, seq)
        self._on_loop(parts.writer.wake)
        # The tuple made directly: Receipt's generated __new__ is one more Python call.
        return _new_tuple(Receipt, (key, lane, seq, accepted_at, deferred, first_id))

    def queue_prefetch(self, query: str, *, session_id: str, user_id: str | None = None
                       ) -> None:
        """Ask for a recall for the session's next turn. Never waits; any thread.

        A newer query replaces an older one for the same (user, session) not yet started.

        Raises:
            InvalidTurnError: an id is not a non-empty string, or the query is not a string.
            PipelineClosedError: the pipeline is not open.
        """
        parts = self._accepting()
        _check_ids(session_id, user_id)
        if not isinstance(query, str):
            raise InvalidTurnError(f"query must be a string, got {type(query).__name__}")
        if query.strip():
            self._on_loop(parts.recall.queue, user_id, session_id, query)

    def warm(self, session_id: str, *, user_id: str | None = None) -> None:
        """Load a session's stored recent turns into the prefetch cache, in the background,
        if the cache does not hold them (a session resumed after a restart, or in another
        process). Never waits; any thread. Past ``max_pending_warms`` it is shed, counted.

        Raises:
            InvalidTurnError: an id is not a non-empty string.
            PipelineClosedError: the pipeline is not open.
        """
        parts = self._accepting()
        _check_ids(session_id, user_id)
        if self.cache.needs_warm(user_id, session_id):
            self._on_loop(parts.recall.warm, user_id, session_id)

    def prefetch(self, query: str = "", *, session_id: str, user_id: str | None = None) -> str:
        """The (user, session)'s cached memory block, or "". A dict lookup: no I/O; any
        thread.

        Raises:
            InvalidTurnError: an id is not a non-empty string.
        """
        try:  # the warm path: one lookup in the cache's unchanged blocks
            text = self._fresh.get((user_id, session_id))
        except TypeError:  # an id that is not hashable is not an id: checked below
            text = None
        if text is not None:  # only checked ids have blocks: no check needed
            self.cache.hits += 1
            return text
        check_id("session_id", session_id)
        if user_id is not None:
            check_id("user_id", user_id)
        return self.cache.get(user_id, session_id)

    def prefetch_status(self, session_id: str, *, user_id: str | None = None
                        ) -> PrefetchStatus:
        """How fresh the (user, session)'s cached block is and which turn it reflects."""
        _check_ids(session_id, user_id)
        return self.cache.status(user_id, session_id)

    def _accepting(self) -> Parts:
        parts = self._parts
        if self._state != OPEN or parts is None:
            raise PipelineClosedError(f"the pipeline is {self._state}")
        return parts

    def _on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the pipeline's loop: now if this is its thread, else soon."""
        if threading.get_ident() == self._loop_thread:
            fn(*args)
            return
        waker = self._waker
        if waker is not None:  # see waker: the caller never hands the GIL to the loop here
            waker.call(fn, *args)
            return
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the loop closed meanwhile: what was accepted is durable in the outbox

    # -- barriers and reads --------------------------------------------------------------

    def pending(self) -> bool:
        """Whether anything accepted here is not yet settled (committed, or dead-lettered).
        Any thread; no I/O."""
        return self.uncommitted() > 0

    def uncommitted(self) -> int:
        """How many records accepted here are not yet settled (committed, or dead-lettered):
        two counters read, for a caller that checks its backlog often (``stats()`` builds a
        whole snapshot, ~0.3 ms). Any thread; no I/O."""
        parts = self._parts
        return 0 if parts is None else max(0, parts.outbox.accepted() - self.barrier.settled)

    async def flush(self, session_id: str | None = None,
                    timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Return once everything accepted before this call (with ``session_id``: that
        session's turns only) is settled: committed and recallable, or dead-lettered.

        Raises:
            FlushTimeoutError: ``timeout`` passed first; the turns stay durable.
            PipelineFailedError: the pipeline failed (at once, or while waiting).
            PipelineClosedError: the pipeline is not open, or closed while waiting.
        """
        if session_id is not None:
            check_id("session_id", session_id)
        await self.flush_lane(session_id, timeout)

    async def flush_lane(self, lane: str | None, timeout: float | None = None  # noqa: ASYNC109
                         ) -> None:
        """``flush``, for a session or an operations' lane (unchecked), or everything."""
        if self._failure is not None:
            raise self._failure
        parts = self._accepting()
        target = parts.outbox.accepted() if lane is None else self.barrier.session_target(lane)
        if self.barrier.settled >= target:
            return
        parts.writer.hurry()
        try:
            with anyio.fail_after(timeout):
                await self.barrier.wait(target)
        except TimeoutError as exc:
            raise FlushTimeoutError(
                f"flush did not finish within {timeout} s; "
                f"{target - self.barrier.settled} turns are still pending") from exc
        finally:
            if not self.barrier.waiting and self._state == OPEN:
                parts.writer.hurry(False)

    async def committed(self, receipts: Sequence[Receipt], timeout: float | None = None  # noqa: ASYNC109
                        ) -> None:
        """Return once the records of ``receipts`` are settled in the store, for every reader
        of it: committed (or dead-lettered) by this pipeline's writer; for a producer, by
        the worker that claims them from the shared inbox (a producer's ``flush`` only hands
        them over).

        Raises:
            FlushTimeoutError, PipelineFailedError, PipelineClosedError: as ``flush``.
        """
        deadline = _deadline(timeout)
        for lane in dict.fromkeys(r.session_id for r in receipts):
            await self.flush_lane(lane, _left(deadline))
        if self.settings.role != "producer" or not receipts:
            return
        keys = {r.key for r in receipts}

        async def uncommitted() -> int:
            nonlocal keys
            keys -= await self.store.done_keys(keys)
            return len(keys)

        await self._worker_commits(uncommitted, deadline, timeout)

    async def lane_committed(self, lane: str, timeout: float | None = None  # noqa: ASYNC109
                             ) -> None:
        """``committed`` for everything accepted here in ``lane`` (unchecked) before the call;
        for a producer, until no record of the lane waits in the shared inbox.

        Raises:
            FlushTimeoutError, PipelineFailedError, PipelineClosedError: as ``flush``.
        """
        deadline = _deadline(timeout)
        await self.flush_lane(lane, _left(deadline))
        if self.settings.role != "producer":
            return

        async def uncommitted() -> int:
            return len(await self.store.lane_records(lane))

        await self._worker_commits(uncommitted, deadline, timeout)

    async def _worker_commits(self, uncommitted: Callable[[], Awaitable[int]],
                              deadline: float | None, waited: float | None) -> None:
        """Wait until ``uncommitted()`` counts none, polling: no signal crosses processes."""
        poll_s = self.settings.shared_poll_ms / 1000
        left = 0
        with anyio.move_on_after(_left(deadline)):
            while left := await uncommitted():  # noqa: ASYNC110
                await anyio.sleep(poll_s)
            return
        raise FlushTimeoutError(f"the worker did not commit {left} records within {waited} "
                                "s; they stay in the shared inbox")

    async def get_messages(self, session_id: str) -> list[dict[str, Any]]:
        """The session's stored messages, in order.

        Raises:
            InvalidTurnError: the id is not a valid session id.
            PipelineClosedError: the pipeline is not open.
        """
        self._reading()
        check_id("session_id", session_id)
        return await self.store.get_messages(session_id)

    async def search(self, query: str, *, user_id: str | None = None,
                     session_id: str | None = None, limit: int | None = None) -> str:
        """Run a recall now and return its block ("" when nothing matches).

        Raises:
            InvalidTurnError: an id is invalid, or neither is given.
            PipelineClosedError: the pipeline is not open.
        """
        parts = self._reading()
        if session_id is not None:
            check_id("session_id", session_id)
        if user_id is not None:
            check_id("user_id", user_id)
        return await parts.search(query, user_id, session_id, limit)

    def _reading(self) -> Parts:
        if self._state not in (OPEN, CLOSING) or self._parts is None:
            raise PipelineClosedError(f"the pipeline is {self._state}")
        return self._parts

    def changed(self) -> None:
        """Wake ``wait_until`` callers: something the pipeline holds changed (a commit, its
        records settled, a recall, a warm-up, a replica write, a failure). Event-loop
        thread."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait_until(self, predicate: Callable[[], bool],
                         timeout: float | None = None) -> None:  # noqa: ASYNC109
        """Return once ``predicate()`` is true, checked now and after every change the
        pipeline makes: no polling. For tests, examples and hosts that need to know when a
        recall or a warm-up has landed.

        Raises:
            TimeoutError: ``timeout`` passed first.
            PipelineFailedError: the pipeline failed before the predicate held.
        """
        with anyio.fail_after(timeout):
            while not predicate():
                if self._failure is not None:
                    raise self._failure
                await self._changed.wait()

    def change_mark(self) -> asyncio.Event:
        """A mark of now, for ``next_change(since=…)``: take it BEFORE a check that awaits,
        so a change made during the check is not missed."""
        return self._changed

    async def next_change(self, timeout: float | None = None,  # noqa: ASYNC109
                          since: asyncio.Event | None = None) -> None:
        """Return at the pipeline's next change (see ``changed``) after ``since`` (a
        ``change_mark()``; None: after now), for a caller whose own check must await (a
        store read)::

            while True:
                mark = pipeline.change_mark()
                if await done():
                    break
                await pipeline.next_change(timeout, since=mark)

        Raises:
            TimeoutError: ``timeout`` passed first.
            PipelineFailedError: the pipeline failed.
        """
        if self._failure is not None:
            raise self._failure
        with anyio.fail_after(timeout):
            await (self._changed if since is None else since).wait()

    # -- stats -------------------------------------------------------------------------

    def stats(self) -> PipelineStats:
        """A snapshot of the queues, the bounded structures, the counters and the state."""
        return collect_stats(self, self._parts)


def _check_ids(session_id: str, user_id: str | None) -> None:
    check_id("session_id", session_id)
    if user_id is not None:
        check_id("user_id", user_id)


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
