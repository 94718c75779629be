"""Seed 000's ``agent.memory.honcho_backend``: the library's Honcho memory, blocking."""

from __future__ import annotations

from hermes_async_memory.memory.standalone import StandaloneMemory

from . import MemoryBackend


class HonchoBackend(MemoryBackend):
    """A ``StandaloneMemory`` mirrored to the Honcho that ``HONCHO_*`` configure; without a
    usable configuration (no ``HONCHO_API_KEY`` for a remote server) it is not available."""

    def __init__(self) -> None:
        super().__init__(StandaloneMemory.from_env(backend="honcho", kv_backend="honcho"))
