"""Waiting for the pipeline's loop from another thread: what the blocking forms of the
library's async reads share (``BlockingKeyValueMemory``, ``BlockingSessionReads``)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, TypeVar

from .errors import PipelineClosedError

if TYPE_CHECKING:
    from .pipeline import MemoryPipeline

T = TypeVar("T")


def run_blocking(pipeline: MemoryPipeline, coro: Coroutine[Any, Any, T], timeout_s: float
                 ) -> T:
    """Run ``coro`` on the pipeline's loop from another thread and wait for its result.

    Raises:
        PipelineClosedError: the pipeline has no running loop.
        RuntimeError: called on the loop's own thread (waiting there would deadlock).
        TimeoutError: no answer within ``timeout_s``; the coroutine is cancelled.
    """
    loop = pipeline.loop
    if loop is None or loop.is_closed():
        coro.close()
        raise PipelineClosedError("the pipeline is not open")
    if threading.get_ident() == pipeline.loop_thread:
        coro.close()
        raise RuntimeError("a blocking read on the pipeline's own loop would deadlock; "
                           "await the async method instead")
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result(timeout_s)
    except concurrent.futures.TimeoutError:  # TimeoutError itself from Python 3.11
        future.cancel()
        raise TimeoutError(f"no answer from the pipeline within {timeout_s} s") from None
