"""The one retry policy: exponential backoff with jitter, capped.

The writer, the supervisor, the replicator and the Honcho client all wait by it, so a failing
store or backend is never hammered and never waited on for longer than the cap.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio

from .faults import Fault, classify

T = TypeVar("T")

DEFAULT_BASE_S = 0.05
DEFAULT_CAP_S = 5.0


@dataclass(frozen=True, slots=True)
class Backoff:
    """``delay(n)``: how long to wait before attempt ``n + 1`` after ``n`` failures in a row.

    The delay doubles from ``base_s`` up to ``cap_s``; the jitter keeps a random share of it
    (``jitter=0.5``: between half and all of it), so many waiters do not retry in step.
    """

    base_s: float = DEFAULT_BASE_S
    cap_s: float = DEFAULT_CAP_S
    jitter: float = 0.5

    def delay(self, failures: int, *, rng: random.Random | None = None) -> float:
        if failures <= 0:
            return 0.0
        raw = min(self.cap_s, self.base_s * 2.0 ** min(failures - 1, 30))
        r = (rng or _RNG).random()
        return raw * (1.0 - self.jitter + self.jitter * r)


_RNG = random.Random()


async def retry_transient(
    op: Callable[[], Awaitable[T]], backoff: Backoff, *,
    on_retry: Callable[[BaseException, int, float], None] | None = None,
    max_failures: int | None = None,
) -> T:
    """Run ``op`` until it succeeds, waiting by ``backoff`` after each transient failure
    (faults.classify); any other failure, and the transient one past ``max_failures`` in a
    row, is raised."""
    failures = 0
    while True:
        try:
            return await op()
        except Exception as exc:  # classified: only transient failures are retried
            if classify(exc) is not Fault.TRANSIENT or failures == max_failures:
                raise
            failures += 1
            delay = backoff.delay(failures)
            if on_retry is not None:
                on_retry(exc, failures, delay)
            await anyio.sleep(delay)
