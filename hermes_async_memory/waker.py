"""Calls from other threads onto the pipeline's event loop, without the caller paying for it.

``loop.call_soon_threadsafe`` writes a byte to the loop's wake-up socket. That send releases
the GIL, and the loop thread (committing, or just woken) takes it: the calling thread then
waits for the loop to give it back, hundreds of microseconds at the tail, inside
``sync_turn`` (measured by bench_hermes_state: 80-86 % of the slowest 1 % of appends). So a
call from another thread goes into a queue, and a small thread of this part's own hands the
queued calls to the loop, in order, one wake for all of them: the caller only appends to a
deque and sets an event (no system call while it holds the GIL beyond the event's own), and
the hand-over happens once the caller lets the GIL go.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from typing import Any

JOIN_TIMEOUT_S = 2.0


class LoopWaker:
    """Runs callables on ``loop``, in the order they were given, from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._calls: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = (
            collections.deque())
        self._event = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="hermes-memory-waker",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()

    def call(self, fn: Callable[..., None], *args: Any) -> None:
        """Queue ``fn(*args)`` for the loop. Any thread; never waits."""
        self._calls.append((fn, args))
        if not self._event.is_set():
            self._event.set()

    def stop(self) -> None:
        """End the thread; calls still queued are handed over first, if the loop runs."""
        self._stopping = True
        self._event.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(JOIN_TIMEOUT_S)

    def _run(self) -> None:
        while True:
            self._event.wait()
            self._event.clear()
            calls = []
            while self._calls:
                calls.append(self._calls.popleft())
            if calls:
                try:
                    self._loop.call_soon_threadsafe(_apply, calls)
                except RuntimeError:
                    return  # the loop closed: what was accepted is durable in the outbox
            if self._stopping:
                return


def _apply(calls: list[tuple[Callable[..., None], tuple[Any, ...]]]) -> None:
    """Schedule each call as its own callback, in order: one failing (reported by the loop's
    exception handler, as ``call_soon_threadsafe`` would have it) does not hold back the
    rest."""
    loop = asyncio.get_running_loop()
    for fn, args in calls:
        loop.call_soon(fn, *args)
