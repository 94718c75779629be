"""A pipeline on its own event-loop thread, shared by every provider on one store file.

Hermes Agent builds a provider per agent, and a gateway keeps several agents at once; a
store file admits one pipeline (its outbox is locked), so the providers of a process share
one ``Runtime`` per file, counted: the last ``release`` closes it.

    Hermes threads ──► pipeline.sync_turn / queue_prefetch / prefetch   (thread-safe, no hop)
                  ──► Runtime.call(coroutine) ──► the loop thread        (flush, search)
    interpreter exit without shutdown() ──► atexit: close every runtime within its deadline

Why a daemon loop thread closed from ``atexit`` (CPython 3.11's exit order is: the main
thread ends; ``threading._shutdown`` runs ``threading._register_atexit`` callbacks, then joins
every non-daemon thread, without a timeout; then ``atexit`` handlers run, daemon threads
still running normally; only then are daemon threads frozen and the interpreter torn down):

- A non-daemon loop thread would be joined before any ``atexit`` handler could ask it to
  stop: exit would hang. Stopping it from ``threading._register_atexit`` instead would close
  the store while the host's own non-daemon threads may still be writing turns (they are
  joined after those callbacks), and a drain that overran its deadline would hold the
  unbounded join forever.
- The ``atexit`` handler runs after every non-daemon thread has finished, so every turn they
  produced is accepted; it drains within the deadline and joins the loop thread with a
  bound. The threads the loop starts (aiosqlite's connections, anyio's workers) inherit the
  daemon flag, and they have all ended when the join returns, so no thread of ours is left
  for the interpreter to freeze mid-write (the "could not acquire lock ... possibly due to
  daemon threads" abort). If the drain overruns, exit goes on regardless: what is left is
  durable in the outbox, and the next start commits it.
- Hermes's CLI runs its own cleanup (flush_pending, on_session_end, shutdown) from an
  ``atexit`` handler as a fallback, and ``atexit`` runs the newest handler first, so ours may
  run before it. A turn that arrives after the exit close is then written through a
  short-lived pipeline of its own (``_late_sync_turn``): nothing is refused at exit.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import contextvars
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import structlog

from ..errors import PipelineClosedError, StoreError
from ..pipeline import MemoryPipeline
from ..settings import Settings
from ..turns import Receipt

log = structlog.get_logger(__name__)

T = TypeVar("T")

_NEW, _OPEN, _CLOSING, _CLOSED = "new", "open", "closing", "closed"
# Opening the store and scanning what an earlier run left in the outbox.
START_TIMEOUT_S = 30.0
# On top of the drain deadline and one SQLite busy timeout (the writer finishing the statement
# it is in): closing the connections and the loop.
CLOSE_MARGIN_S = 2.0
# How long a call waits past its own timeout for the loop to hand the result over.
CALL_MARGIN_S = 1.0


class Runtime:
    """One started ``MemoryPipeline`` and the daemon thread whose event loop runs it."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.pipeline: MemoryPipeline | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.users = 0
        # Set by the exit hook: a turn that finds the runtime closed takes the late path.
        self.closed_at_exit = False
        self._state = _NEW
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._finished = threading.Event()
        self._stop: asyncio.Event | None = None
        self._start_error: BaseException | None = None
        self._deadline_s = settings.shutdown_deadline_s
        self._thread: threading.Thread | None = None

    @property
    def is_open(self) -> bool:
        return self._state == _OPEN

    def start(self, context: contextvars.Context) -> None:
        """Start the loop thread in ``context`` (the caller's contextvars) and open the pipeline.

        Raises:
            StoreError: the store or its outbox cannot be opened (or did not open in time).
            ConfigurationError: the settings are unusable.
        """
        thread = threading.Thread(
            target=context.run, args=(self._main,), name="hermes-memory-loop", daemon=True,
        )
        self._thread = thread
        thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            self.close(0.0)
            raise StoreError(
                f"the memory pipeline on {self.settings.db_path} did not start within "
                f"{START_TIMEOUT_S} s"
            )
        if self._start_error is not None:
            thread.join(CLOSE_MARGIN_S)
            with self._lock:
                self._state = _CLOSED
            raise self._start_error
        with self._lock:
            self._state = _OPEN

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        finally:
            self._ready.set()
            self._finished.set()

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        pipeline = MemoryPipeline(self.settings)
        try:
            await pipeline.start()
        except Exception as exc:
            self._start_error = exc
            return
        self.pipeline = pipeline
        self._ready.set()
        await self._stop.wait()
        await pipeline.aclose(self._deadline_s)

    # -- calls from other threads ------------------------------------------------------

    def call(self, make: Callable[[MemoryPipeline], Coroutine[Any, Any, T]],
             timeout_s: float) -> T:
        """Run ``make(pipeline)`` on the loop and wait for it, at most ``timeout_s``.

        Raises:
            PipelineClosedError: the runtime is not open.
            TimeoutError: no result in time (the coroutine is cancelled).
            RuntimeError: called from the loop thread itself, which would deadlock.
            whatever the coroutine raises.
        """
        pipeline, loop = self.pipeline, self.loop
        if self._state != _OPEN or pipeline is None or loop is None:
            raise PipelineClosedError(f"the memory pipeline on {self.settings.db_path} is closed")
        if threading.current_thread() is self._thread:
            raise RuntimeError("a blocking call cannot run on the memory loop's own thread")
        coro = make(pipeline)
        try:
            fut = asyncio.run_coroutine_threadsafe(coro, loop)
        except RuntimeError as exc:  # the loop closed in between
            coro.close()
            raise PipelineClosedError(f"the memory pipeline on {self.settings.db_path} "
                                      "is closed") from exc
        try:
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError as exc:
            fut.cancel()
            raise TimeoutError(f"the memory call did not finish within {timeout_s} s") from exc

    def flush(self, timeout_s: float) -> None:
        """Wait until every turn accepted so far is committed.

        Raises:
            FlushTimeoutError: ``timeout_s`` passed first; the turns stay durable.
            PipelineClosedError: the runtime is not open.
        """
        self.call(lambda p: p.flush(timeout=timeout_s), timeout_s + CALL_MARGIN_S)

    def sync_turn(
        self, user_content: str, assistant_content: str, *, session_id: str,
        user_id: str | None, messages: Sequence[Mapping[str, Any]] | None,
        metadata: Mapping[str, Any] | None,
    ) -> Receipt:
        """``MemoryPipeline.sync_turn``, or the late path once the exit hook closed the runtime.

        Raises what ``MemoryPipeline.sync_turn`` raises.
        """
        pipeline = self.pipeline
        if pipeline is not None and self._state == _OPEN:
            try:
                return pipeline.sync_turn(
                    user_content, assistant_content, session_id=session_id, user_id=user_id,
                    messages=messages, metadata=metadata,
                )
            except (PipelineClosedError, StoreError):
                if not self.closed_at_exit:  # raced the exit close: take the late path
                    raise
        elif not self.closed_at_exit:
            raise PipelineClosedError(f"the memory pipeline on {self.settings.db_path} is closed")
        return _late_sync_turn(
            self, user_content, assistant_content, session_id=session_id, user_id=user_id,
            messages=messages, metadata=metadata,
        )

    # -- closing -----------------------------------------------------------------------

    def close(self, deadline_s: float) -> bool:
        """Drain within ``deadline_s``, close the pipeline, end the loop thread. Idempotent.

        Returns whether the loop thread ended within the bound; if not, what is left stays
        durable in the outbox for the next start.
        """
        with self._lock:
            first = self._state in (_NEW, _OPEN)
            if first:
                self._state = _CLOSING
        loop, stop = self.loop, self._stop
        if first and loop is not None and stop is not None:
            self._deadline_s = deadline_s
            with contextlib.suppress(RuntimeError):  # the loop has already ended
                loop.call_soon_threadsafe(stop.set)
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return False
        bound = deadline_s + self.settings.busy_timeout_ms / 1000 + CLOSE_MARGIN_S
        thread.join(bound)
        if thread.is_alive():
            log.warning("memory_runtime_close_overran", db=str(self.settings.db_path),
                        bound_s=round(bound, 3))
            return False
        with self._lock:
            self._state = _CLOSED
        return True

    def wait_finished(self, timeout_s: float) -> bool:
        return self._finished.wait(timeout_s)


# -- the process-wide registry ---------------------------------------------------------------

# Process-wide on purpose: Hermes instantiates providers itself (one per agent), and a store
# file admits one pipeline, so the runtime cannot be passed in by a caller.
_registry_lock = threading.Lock()
_runtimes: dict[Path, Runtime] = {}
_exit_hook_installed = False
_late_lock = threading.Lock()


def acquire(settings: Settings, context: contextvars.Context) -> Runtime:
    """The open runtime on ``settings.db_path``, started (in ``context``) if there is none.

    Raises:
        StoreError: the store or its outbox cannot be opened.
        ConfigurationError: the settings are unusable.
    """
    global _exit_hook_installed
    key = _key(settings.db_path)
    with _registry_lock:
        runtime = _runtimes.get(key)
        if runtime is None or not runtime.is_open:
            runtime = Runtime(settings)
            runtime.start(context)
            _runtimes[key] = runtime
            if not _exit_hook_installed:
                atexit.register(close_all_at_exit)
                _exit_hook_installed = True
        runtime.users += 1
        return runtime


def release(runtime: Runtime, deadline_s: float) -> None:
    """Drop one user: the last one closes the runtime, the others flush (both bounded)."""
    key = _key(runtime.settings.db_path)
    with _registry_lock:
        runtime.users -= 1
        last = runtime.users <= 0
        if last and _runtimes.get(key) is runtime:
            del _runtimes[key]
    if last:
        runtime.close(deadline_s)
        return
    try:
        runtime.flush(deadline_s)
    except (TimeoutError, PipelineClosedError) as exc:
        log.warning("memory_release_flush_incomplete", error=str(exc))


def close_all_at_exit() -> None:
    """The ``atexit`` hook: close every runtime nobody shut down, each within its deadline."""
    with _registry_lock:
        runtimes = list(_runtimes.values())
        _runtimes.clear()
    for runtime in runtimes:
        runtime.closed_at_exit = True
        runtime.close(runtime.settings.shutdown_deadline_s)


def _late_sync_turn(
    runtime: Runtime, user_content: str, assistant_content: str, *, session_id: str,
    user_id: str | None, messages: Sequence[Mapping[str, Any]] | None,
    metadata: Mapping[str, Any] | None,
) -> Receipt:
    """A turn after the exit close: open the store once more on a private loop, accept the
    turn (durable), drain and close. Costs a store open per turn; only happens at exit."""
    settings = runtime.settings

    async def once() -> Receipt:
        async with MemoryPipeline(settings) as mem:
            return mem.sync_turn(
                user_content, assistant_content, session_id=session_id, user_id=user_id,
                messages=messages, metadata=metadata,
            )

    with _late_lock:  # one pipeline per store file: late turns take turns
        runtime.wait_finished(
            settings.shutdown_deadline_s + settings.busy_timeout_ms / 1000 + CLOSE_MARGIN_S
        )
        receipt = asyncio.run(once())
    log.info("memory_late_turn_stored", session_id=session_id, key=receipt.key)
    return receipt


def _key(path: Path) -> Path:
    return path.expanduser().resolve()
