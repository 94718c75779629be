"""Time-sliced cooperation for Python work on the event loop.

The writer's Python work (decoding records, building a batch's parameters, refreshing the
cache, settling) runs in steps of ``CHUNK`` records, and ``maybe_yield()`` between steps hands
the loop back once the task has held it for ``SLICE_S``: few yields when the work is quick
(each may wait behind a long callback of the host's), never a long stall when it is not. The
slice is the task's, whatever function the step is in: consecutive steps of different parts
(a listener, then the settle, then the next read) share one budget. ``begin()`` starts a
fresh slice after an await that really waited (I/O).

While the store's thread commits a batch, a slice ends with a short nap that releases the
GIL (``HANDOFF_S``). SQLite runs each statement with the GIL released, but the thread takes
the GIL back between statements, and a waiting thread only gets it from a busy one after the
interpreter's switch interval (5 ms) passes with no hand-over. Every loop iteration releases
and retakes it within microseconds, which restarts that wait: a commit's statement boundaries
then waited out the loop's whole busy spell (settling one batch and reading the next), and
the store's work and the loop's were serialized. The nap costs the loop at most a fifth of
its time, only while a commit runs (+10 % turns/s in bench_throughput all the same).

A slice of 0.25 ms keeps each of the writer's steps near 1 ms of CPU at worst (the slice,
plus the one step of work that cannot be split: settling or reading a chunk), well inside
the 2 ms the loop may stall. A chunk is 50 records: with 100, one chunk's decoding plus a
generation-1 collection falling inside it reached 2.0 ms in bench_loop_lag; with 50 the
longest step measured 1.1 ms.

Decoding a record, judging its tool answers and adding it to a batch cost in proportion to
its size, so those steps also end at ``CHUNK_BYTES`` of records (``runs``): 50 turns with
five tool calls each (3.6 KB apiece) took 2.2 ms to decode and a step through decoding and
judging reached 4.7 ms of CPU; 32 KiB of them decode in ~0.4 ms.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import anyio.lowlevel

CHUNK = 50
CHUNK_BYTES = 32_768
SLICE_S = 0.00025
HANDOFF_S = 0.00005

_deadline: ContextVar[float] = ContextVar("hermes_memory_slice_deadline", default=0.0)
_committing = 0  # commits running on a store thread (the event-loop thread counts them)


def runs(sizes: Sequence[int]) -> Iterator[tuple[int, int]]:
    """The (start, end) runs of consecutive items, one step's work each, given each item's
    size in bytes: ``CHUNK`` items, or fewer that reach ``CHUNK_BYTES`` (one at least)."""
    start = total = 0
    for i, size in enumerate(sizes):
        total += size
        if i + 1 - start >= CHUNK or total >= CHUNK_BYTES:
            yield start, i + 1
            start, total = i + 1, 0
    if start < len(sizes):
        yield start, len(sizes)


def begin() -> None:
    """The task just got the loop back from real waiting: a full slice from now."""
    _deadline.set(time.perf_counter() + SLICE_S)


@contextmanager
def committing() -> Iterator[None]:
    """A store thread is committing meanwhile: slices end with a GIL hand-off."""
    global _committing
    _committing += 1
    try:
        yield
    finally:
        _committing -= 1


async def maybe_yield() -> None:
    """Let the loop run other callbacks if this task's slice is used up."""
    if time.perf_counter() >= _deadline.get():
        if _committing:
            # Blocking on purpose: 50 µs with the GIL released, long enough for a waiting thread.
            time.sleep(HANDOFF_S)  # noqa: ASYNC251
        await anyio.lowlevel.checkpoint()
        _deadline.set(time.perf_counter() + SLICE_S)
