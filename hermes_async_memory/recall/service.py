"""The recall service: queued recalls and cache warm-ups, each a bounded queue with a bounded
number of workers.

- ``queue(user, session, query)``: the latest query per (user, session) wins; past
  ``max_pending_recalls`` the oldest request is shed and counted. A recall first waits (up to
  ``RECALL_BARRIER_S``) for the turns accepted before it, so a session asking right after its
  own sync_turn finds that turn.
- ``warm(user, session)``: load a resumed session's stored recent turns into the cache;
  past ``max_pending_warms`` new requests are shed and counted.
- A ``Recaller`` runs the recall: locally (``LocalRecaller``: the backend's recall when it
  has one, else a scoped BM25 search of the store; identical recalls in flight share one
  search), or, in a producer, as a request the worker answers.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import anyio
import structlog

from ..backends import Backend, NullBackend, RecallRequest, WriteNotice
from ..barrier import CommitBarrier
from ..errors import describe
from ..fence import DEFAULT_FENCE, Fence
from ..metrics import PipelineObserver
from ..procedural.api import ProceduralMemory
from ..procedural.context import session_block
from ..procedural.format import ContextSettings
from ..store import Hit, SqliteStore, StoredTurn
from ..turns import scope_token_for
from .cache import CacheKey, RecallCache
from .query import (
    fill_lines,
    match_expression,
    pool_size,
    query_terms,
    rank_windows,
    render_hits,
    shown_size,
    with_procedural,
)

log = structlog.get_logger(__name__)

# A recall waits at most this long for the turns accepted before it was queued.
RECALL_BARRIER_S = 1.0
# A warm-up reads this many times recent_turns of the session's last stored turns, and keeps
# the user's own: another user may send the same session id.
WARM_LOOKBACK = 4


@dataclass(frozen=True, slots=True)
class Recalled:
    block: str
    source: str  # "local", or the backend's name
    fallback: bool  # the backend was asked and failed; the local store answered


class Recaller(Protocol):
    async def recall(self, query: str, user_id: str | None, session_id: str
                     ) -> Recalled | None:
        """The block for the session's next prefetch, or None when it arrives later (a
        producer's request, which the worker answers)."""


class LocalRecaller:
    """Answers recalls in this process: the backend first when it recalls, else the store."""

    def __init__(self, store: SqliteStore, backend: Backend, *, limit: int, max_terms: int,
                 chars_per_hit: int, observer: PipelineObserver,
                 procedural: ContextSettings | None = None,
                 fence: Fence = DEFAULT_FENCE) -> None:
        self._store = store
        self._fence = fence
        # The procedural block appended for the session (its tools' record in the log).
        self._procedural = (ProceduralMemory(store), procedural) if procedural else None
        self._backend = backend
        self._limit = limit
        self._max_terms = max_terms
        self._chars_per_hit = chars_per_hit
        self._observer = observer
        self._inflight: dict[tuple[str, tuple[str, ...], str], asyncio.Future[Recalled]] = {}
        self.runs = 0
        self.shared = 0

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    async def recall(self, query: str, user_id: str | None, session_id: str) -> Recalled:
        recalled = await self._recall(query, user_id, session_id)
        if self._procedural is None:
            return recalled
        memory, settings = self._procedural
        try:
            extra = await session_block(memory, user_id, session_id, settings)
        except Exception as exc:  # the recall stands without it
            log.warning("procedural_block_failed", session_id=session_id, error=describe(exc),
                        exc_info=exc)
            extra = ""
        if not extra:
            return recalled
        return Recalled(with_procedural(recalled.block, extra), recalled.source,
                        recalled.fallback)

    async def _recall(self, query: str, user_id: str | None, session_id: str) -> Recalled:
        scope = scope_token_for(user_id, session_id)
        terms = tuple(query_terms(query, self._store.frequent_terms, self._max_terms,
                                  stems=self._store.word_index_stems))
        # One user's identical recalls share one search; a backend's recall is per session.
        key = (scope, terms, session_id if self._backend.recalls else "")
        running = self._inflight.get(key)
        if running is not None:
            self.shared += 1
            return await asyncio.shield(running)
        fut: asyncio.Future[Recalled] = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        try:
            recalled = await self._run(query, user_id, session_id, terms, scope)
        except BaseException as exc:
            fut.set_exception(exc)
            fut.exception()  # retrieved: waiters may be gone
            raise
        else:
            fut.set_result(recalled)
            return recalled
        finally:
            del self._inflight[key]

    async def _run(self, query: str, user_id: str | None, session_id: str,
                   terms: tuple[str, ...], scope: str) -> Recalled:
        self.runs += 1
        started = time.perf_counter()
        try:
            recalled = await self._answer(query, user_id, session_id, terms, scope)
        except Exception:
            self._observer.recall_done(time.perf_counter() - started, False)
            raise
        self._observer.recall_done(time.perf_counter() - started, True)
        return recalled

    async def _answer(self, query: str, user_id: str | None, session_id: str,
                      terms: tuple[str, ...], scope: str) -> Recalled:
        """The backend's block when it answers; else the local store's, marked as a
        fallback when the backend was asked and failed (an error, or its deadline)."""
        fallback = False
        backend = self._backend
        if not isinstance(backend, NullBackend):
            request = RecallRequest(query, session_id, user_id, self._limit)
            try:
                remote = await backend.recall(request)
            except Exception as exc:  # the backend's trouble: the local store answers
                log.warning("backend_recall_failed", backend=backend.name, error=describe(exc),
                            exc_info=exc)
                remote = None
            if remote is not None:
                return Recalled(remote, backend.name, False)
            fallback = backend.recalls
        return Recalled(await self.search(terms, scope, self._limit), "local", fallback)

    async def search(self, terms: Sequence[str], scope: str, limit: int) -> str:
        return render_hits(await search_hits(self._store, terms, scope, limit=limit,
                                             chars_per_hit=self._chars_per_hit),
                           fence=self._fence)


async def search_hits(store: SqliteStore, terms: Sequence[str], scope: str, *, limit: int,
                      chars_per_hit: int) -> list[Hit]:
    """The local recall's search: the scope's messages matching any of ``terms`` (none when
    there are no terms), best first by their window's score (``query.rank_windows``), each
    with the messages beside it that fit in ``chars_per_hit * limit`` characters
    (``query.fill_lines``)."""
    if not terms:
        return []
    shown = shown_size(limit)
    pool, texts = await store.recall_pool(match_expression(terms, scope), pool_size(limit),
                                          shown)
    if not pool:
        return []
    ranked = rank_windows(pool)[:shown]
    return fill_lines(ranked, texts, terms, limit=limit, budget=chars_per_hit * limit)


async def stored_recent_turns(store: SqliteStore, user_id: str | None, session_id: str,
                              recent_turns: int) -> list[StoredTurn]:
    """What a warm-up loads into the cache for the (user, session): the user's own turns
    among the session's last ``recent_turns * WARM_LOOKBACK`` stored turns, the newest
    ``recent_turns`` of them (at least one), oldest first."""
    n = max(1, recent_turns)
    turns = await store.recent_stored_turns(session_id, n * WARM_LOOKBACK)
    return [t for t in turns if t.user_id == user_id][-n:]


class RecallService:
    """The queues of recalls and warm-ups, and the workers that drain them."""

    def __init__(
        self, *, recaller: Recaller, cache: RecallCache, barrier: CommitBarrier,
        store: SqliteStore, target: Callable[[], int], max_pending: int, max_warms: int,
        recent_turns: int, clock: Callable[[], float] = time.monotonic,
        changed: Callable[[], None] = lambda: None,
    ) -> None:
        self._changed = changed  # after each recall and warm-up: wakes wait_until()
        self.recaller = recaller
        self._cache = cache
        self._barrier = barrier
        self._store = store
        self._target = target
        self._max_pending = max_pending
        self._max_warms = max_warms
        self._recent_turns = max(1, recent_turns)
        self._clock = clock
        self._pending: OrderedDict[CacheKey, tuple[str, int]] = OrderedDict()
        self._warms: OrderedDict[CacheKey, None] = OrderedDict()
        self._warming: set[CacheKey] = set()
        self._recall_work = asyncio.Event()
        self._warm_work = asyncio.Event()
        self.recalls_shed = 0
        self.recall_errors = 0
        self.warms_shed = 0
        self.sessions_warmed = 0
        self.warm_errors = 0
        self.refreshes_queued = 0

    # -- requests (event-loop thread) --------------------------------------------------

    def queue(self, user_id: str | None, session_id: str, query: str) -> None:
        key = (user_id, session_id)
        pending = self._pending
        if key in pending:
            pending.move_to_end(key)
        elif len(pending) >= self._max_pending:
            pending.popitem(last=False)  # the oldest request; counted, never silent
            self.recalls_shed += 1
        # The recall runs once the turns accepted before it are settled.
        pending[key] = (query, self._target())
        self._recall_work.set()

    def refresh(self, notice: WriteNotice) -> None:
        """Another machine wrote these users' memory (a shared backend's notice): recall
        again, with its last query, each cached session whose block may now be out of date.
        A refresh takes only free room in the queue: it never sheds an agent's request (the
        agent's next queue_prefetch asks again anyway)."""
        pending = self._pending
        for user_id, session_id, query in self._cache.followed(notice):
            key = (user_id, session_id)
            if key in pending:
                continue  # a recall is queued already, and will read the new writes
            if len(pending) >= self._max_pending:
                break
            pending[key] = (query, self._target())
            self.refreshes_queued += 1
        if pending:
            self._recall_work.set()

    def warm(self, user_id: str | None, session_id: str) -> None:
        key = (user_id, session_id)
        if key in self._warms or key in self._warming or not self._cache.needs_warm(*key):
            return
        if len(self._warms) >= self._max_warms:
            self.warms_shed += 1
            return
        self._warms[key] = None
        self._warm_work.set()

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def warm_backlog(self) -> int:
        return len(self._warms) + len(self._warming)

    # -- workers -----------------------------------------------------------------------

    async def run_recaller(self) -> None:
        pending = self._pending
        while True:
            if not pending:
                self._recall_work.clear()
                await self._recall_work.wait()
                continue
            (user_id, session_id), (query, target) = pending.popitem(last=False)
            if self._barrier.settled < target:
                with anyio.move_on_after(RECALL_BARRIER_S):
                    await self._barrier.wait(target)
            if self._cache.needs_warm(user_id, session_id):
                await self._warm_now((user_id, session_id))  # a resumed session: its turns first
            epoch = self._cache.epoch()
            try:
                recalled = await self.recaller.recall(query, user_id, session_id)
            except Exception as exc:  # the per-recall boundary
                self.recall_errors += 1
                log.warning("recall_failed", session_id=session_id, error=describe(exc),
                            exc_info=exc)
                self._changed()
                continue
            if recalled is not None:
                self._cache.set_recall(user_id, session_id, query, recalled.block,
                                       source=recalled.source, fallback=recalled.fallback,
                                       epoch=epoch)
            self._changed()

    async def run_warmer(self) -> None:
        warms = self._warms
        while True:
            if not warms:
                self._warm_work.clear()
                await self._warm_work.wait()
                continue
            key, _ = warms.popitem(last=False)
            await self._warm_now(key)
            self._changed()

    async def _warm_now(self, key: CacheKey) -> None:
        if key in self._warming:
            return
        self._warming.add(key)
        user_id, session_id = key
        epoch = self._cache.epoch()
        try:
            turns = await stored_recent_turns(self._store, user_id, session_id,
                                              self._recent_turns)
        except Exception as exc:  # the per-job boundary: a cold cache is not an error
            self.warm_errors += 1
            log.warning("cache_warm_failed", session_id=session_id, error=describe(exc),
                        exc_info=exc)
            return
        finally:
            self._warming.discard(key)
        mine = [(t.key, t.user_text, t.assistant_text) for t in turns]
        if self._cache.warm(user_id, session_id, mine, self._clock(), epoch=epoch):
            self.sessions_warmed += 1
