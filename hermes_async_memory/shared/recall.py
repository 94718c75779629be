"""Recall across processes: a producer asks, a worker answers, the producer caches.

    producer: RemoteRecaller ──► recall_requests ──► worker: RecallServer (concurrent,
              ResultsPoller ◄── recall_results  ◄──         bounded) ──► LocalRecaller

The worker waits (up to the recall barrier) for the turns a producer handed in before its
request, as a local recall waits for its own. Results older than ``RESULTS_KEPT_S`` are
pruned by the worker's maintenance.
"""

from __future__ import annotations

from collections import OrderedDict

import anyio
import structlog

from ..errors import describe
from ..recall.cache import CacheKey, RecallCache
from ..recall.service import RECALL_BARRIER_S, LocalRecaller, Recalled
from ..retry import Backoff, retry_transient
from ..store import SqliteStore

log = structlog.get_logger(__name__)

REQUESTS_PER_ROUND = 64
TAKE_RETRIES = 8  # transient failures in a row taking requests before the part restarts
RESULTS_KEPT_S = 600.0


class RemoteRecaller:
    """A producer's recaller: a request the worker answers into ``recall_results``."""

    def __init__(self, store: SqliteStore, max_pending: int) -> None:
        self._store = store
        self._max_pending = max_pending
        # The requests not answered yet, oldest first: their results are cached when they
        # come, and only theirs (or a session this gateway already caches).
        self.requested: OrderedDict[CacheKey, None] = OrderedDict()

    async def recall(self, query: str, user_id: str | None, session_id: str) -> None:
        key = (user_id, session_id)
        self.requested[key] = None  # before the request: the answer cannot come first
        self.requested.move_to_end(key)
        while len(self.requested) > self._max_pending:
            self.requested.popitem(last=False)
        await self._store.request_recall(session_id, user_id, query)


class ResultsPoller:
    """A producer copies the blocks a worker wrote into its prefetch cache."""

    def __init__(self, store: SqliteStore, cache: RecallCache, recaller: RemoteRecaller,
                 poll_s: float) -> None:
        self._store = store
        self._cache = cache
        self._recaller = recaller
        self._poll_s = poll_s
        self.version = 0

    async def start(self) -> None:
        self.version = await self._store.recall_version()

    async def run(self) -> None:
        while True:
            # Another process's progress: there is nothing to wait on but time.
            await anyio.sleep(self._poll_s)
            rows = await self._store.recall_results_since(self.version)
            requested = self._recaller.requested
            for session_id, user_id, query, block, version, source, fallback in rows:
                self.version = version
                key = (user_id, session_id)
                if key in requested:
                    del requested[key]
                elif key not in self._cache:
                    continue  # another gateway's session: it would crowd this cache out
                self._cache.set_recall(user_id, session_id, query, block, source=source,
                                       fallback=fallback)


class RecallServer:
    """A worker serves the producers' recall requests, up to ``concurrency`` at once.

    Requests are taken as slots free up, not in rounds: one request waiting out its barrier
    (turns handed in before it, still uncommitted behind a write backlog) holds one slot,
    never the requests behind it.
    """

    def __init__(self, store: SqliteStore, recaller: LocalRecaller, *, poll_s: float,
                 concurrency: int) -> None:
        self._store = store
        self._recaller = recaller
        self._poll_s = poll_s
        self._slots = anyio.Semaphore(concurrency)
        self._backoff = Backoff()
        self.served = 0
        self.errors = 0
        self.in_flight = 0  # requests being served, their barrier waits included
        self.peak_in_flight = 0
        self.waiting = 0  # of those, the ones waiting out their barrier

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            while True:
                await self._slots.acquire()
                # This slot, and every other one free now: never more than can start at once.
                free = 1 + self._slots.value
                limit = min(free, REQUESTS_PER_ROUND)
                # A write lock held past the statement's busy wait is retried here, the
                # requests being served going on; a lasting one restarts the part (loudly),
                # which cancels them.
                requests = await retry_transient(
                    lambda: self._store.take_recall_requests(limit),  # noqa: B023
                    self._backoff, max_failures=TAKE_RETRIES)
                if not requests:
                    self._slots.release()
                    await anyio.sleep(self._poll_s)  # another process's progress: poll it
                    continue
                for i, request in enumerate(requests):
                    if i:
                        self._slots.acquire_nowait()  # free a moment ago, and only we take
                    tg.start_soon(self._serve, *request)

    async def _serve(self, session_id: str, user_id: str | None, query: str,
                     after_id: int) -> None:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            # The turns handed in before the request first, as for a local recall.
            self.waiting += 1
            try:
                with anyio.move_on_after(RECALL_BARRIER_S):
                    while await self._store.inbox_holds(after_id):  # noqa: ASYNC110
                        await anyio.sleep(self._poll_s)
            finally:
                self.waiting -= 1
            recalled: Recalled = await self._recaller.recall(query, user_id, session_id)
            await self._store.put_recall_result(
                session_id, user_id, query, recalled.block, recalled.source,
                recalled.fallback)
            self.served += 1
        except Exception as exc:  # the per-request boundary: count, log, go on
            self.errors += 1
            log.warning("recall_serve_failed", session_id=session_id, error=describe(exc),
                        exc_info=exc)
        finally:
            self.in_flight -= 1
            self._slots.release()
