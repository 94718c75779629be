"""Time-sliced cooperation for Python work on the event loop.

The writer's Python work (decoding records, building a batch's parameters, refreshing the
cache, settling) runs in steps of ``CHUNK`` records, and ``maybe_yield()`` between steps hands
the loop back once the task has held it for ``SLICE_S``: few yields when the work is quick
(each may wait behind a long callback of the host's), never a long stall when it is not. The
slice is the task's, whatever function the step is in: consecutive steps of different parts
(a listener, then the settle, then the next read) share one budget. ``begin()`` starts a
fresh slice after an await that really waited (I/O).
"""

from __future__ import annotations

import time
from contextvars import ContextVar

import anyio.lowlevel

CHUNK = 100
SLICE_S = 0.0005

_deadline: ContextVar[float] = ContextVar("hermes_memory_slice_deadline", default=0.0)


def begin() -> None:
    """The task just got the loop back from real waiting: a full slice from now."""
    _deadline.set(time.perf_counter() + SLICE_S)


async def maybe_yield() -> None:
    """Let the loop run other callbacks if this task's slice is used up."""
    if time.perf_counter() >= _deadline.get():
        await anyio.lowlevel.checkpoint()
        _deadline.set(time.perf_counter() + SLICE_S)
