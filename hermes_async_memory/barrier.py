"""The commit barrier: ``flush()`` for everything, or for one session.

Records are settled (committed, found already stored, or dead-lettered) strictly in accept
order, so "everything accepted so far is settled" is a count, and "this session's turns are
settled" is the count at the session's latest accepted record. Waiters are futures in a heap
by target; each settle releases those it reached. When the pipeline fails or closes, every
waiter is told at once.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading

from .errors import PipelineClosedError, PipelineFailedError

# The per-session map is pruned of settled sessions once it grows past this (and then past
# twice what it held after the last pruning): amortised O(1) per accept.
_PRUNE_AT = 4096


class CommitBarrier:
    """Counts settled records and wakes the waiters whose target they reach."""

    def __init__(self) -> None:
        self._settled = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._ids = itertools.count()
        self._latest: dict[str, int] = {}  # session -> its latest accepted record
        self._latest_lock = threading.Lock()  # accepts come from any thread
        self._prune_at = _PRUNE_AT
        self._ended: BaseException | None = None

    @property
    def settled(self) -> int:
        return self._settled

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def note_accepted(self, session_id: str, seq: int) -> None:
        """Record ``seq`` as the session's latest accepted record. Any thread."""
        with self._latest_lock:
            latest = self._latest
            if seq > latest.get(session_id, 0):
                latest[session_id] = seq
            if len(latest) > self._prune_at:
                settled = self._settled
                for key, value in list(latest.items()):
                    if value <= settled:
                        del latest[key]
                self._prune_at = max(_PRUNE_AT, 2 * len(latest))

    def session_target(self, session_id: str) -> int:
        """The count at which the session's accepted records are all settled."""
        return self._latest.get(session_id, 0)

    def session_pending(self, session_id: str) -> bool:
        return self._latest.get(session_id, 0) > self._settled

    async def wait(self, target: int) -> None:
        """Return once ``target`` records are settled.

        Raises:
            PipelineFailedError: the pipeline failed (at once, or while waiting).
            PipelineClosedError: the pipeline closed before the target was reached.
        """
        if self._settled >= target:
            return
        if self._ended is not None:
            raise self._ended
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (target, next(self._ids), fut))
        try:
            await fut
        finally:
            if not fut.done():
                fut.cancel()

    def settle(self, upto: int) -> None:
        """Records up to number ``upto`` are settled. Event-loop thread."""
        if upto <= self._settled:
            return
        self._settled = upto
        waiters = self._waiters
        while waiters and waiters[0][0] <= upto:
            _, _, fut = heapq.heappop(waiters)
            if not fut.done():
                fut.set_result(None)

    def fail(self, error: PipelineFailedError | PipelineClosedError) -> None:
        """Every waiter, now and later, gets ``error``."""
        if self._ended is None or isinstance(error, PipelineFailedError):
            self._ended = error
        waiters, self._waiters = self._waiters, []
        for _, _, fut in waiters:
            if not fut.done():
                fut.set_exception(error)
                fut.exception()  # retrieved: a waiter may be gone
