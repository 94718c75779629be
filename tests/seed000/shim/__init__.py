"""Seed 000's ``agent.memory``, mapped onto this library's public API.

Each name is a thin mapping, no feature of its own: the behaviour is the library's
(``hermes_async_memory.memory``: ``MemoryEntry``; ``StandaloneMemory``, a blocking key-value
memory over a real store file; ``StandaloneMemory.from_env``, the seed's choice from
``HERMES_MEMORY_BACKEND`` and ``HONCHO_API_KEY``; the evaluation). What the shim adds is the
seed's calling convention: ``store`` and ``delete`` answer True or False instead of a receipt
(Honcho's ``BackendLimitError`` on delete is False), ``query`` names its text ``query_text``,
and ``get_memory_backend()`` caches its answer process-wide (the library has no process-wide
backend, by design), until ``reset_backend()``, which also closes it.

``tests/seed000/conftest.py`` registers this package as ``agent.memory`` (and its modules as
``agent.memory.local_backend``, ``.honcho_backend``, ``.evaluation``) for the seed's tests
only: ``agent`` is Hermes Agent's real package, which has no ``memory``.
"""

from __future__ import annotations

import weakref
from typing import Any

from hermes_async_memory import Settings
from hermes_async_memory.memory import BackendLimitError, MemoryEntry
from hermes_async_memory.memory.standalone import StandaloneMemory

__all__ = ["MemoryBackend", "MemoryEntry", "NullBackend", "get_memory_backend",
           "reset_backend"]

# Every backend made here, so the tests' teardown closes what the seed's tests leave open.
OPENED: weakref.WeakSet[MemoryBackend] = weakref.WeakSet()


class MemoryBackend:
    """The seed's backend interface over a ``StandaloneMemory``."""

    def __init__(self, memory: StandaloneMemory) -> None:
        self.memory = memory
        OPENED.add(self)

    @classmethod
    def around(cls, memory: StandaloneMemory) -> MemoryBackend:
        """An instance of ``cls`` over a memory made elsewhere (``get_memory_backend``)."""
        backend = cls.__new__(cls)
        MemoryBackend.__init__(backend, memory)
        return backend

    @property
    def backend_name(self) -> str:
        return self.memory.backend_name

    @property
    def is_cloud(self) -> bool:
        return self.memory.is_cloud

    def is_available(self) -> bool:
        return self.memory.is_available()

    def store(self, user_id: str, key: str, value: str,
              metadata: dict[str, Any] | None = None) -> bool:
        self.memory.store(user_id, key, value, metadata)
        return True

    def retrieve(self, user_id: str, key: str) -> MemoryEntry | None:
        return self.memory.retrieve(user_id, key)

    def query(self, user_id: str, query_text: str, limit: int = 10) -> list[MemoryEntry]:
        return self.memory.query(user_id, query_text, limit)

    def list_keys(self, user_id: str) -> list[str]:
        return self.memory.list_keys(user_id)

    def delete(self, user_id: str, key: str) -> bool:
        try:
            self.memory.delete(user_id, key)
        except BackendLimitError:
            return False
        return True

    def close(self) -> None:
        self.memory.close()


class NullBackend(MemoryBackend):
    def __init__(self) -> None:
        super().__init__(StandaloneMemory(Settings(kv_backend="null")))


_backend: MemoryBackend | None = None


def get_memory_backend() -> MemoryBackend:
    global _backend
    if _backend is None:
        from .honcho_backend import HonchoBackend
        from .local_backend import LocalBackend

        memory = StandaloneMemory.from_env()
        kinds: dict[str, type[MemoryBackend]] = {
            "local": LocalBackend, "honcho": HonchoBackend, "null": NullBackend}
        _backend = kinds[memory.kind].around(memory)
    return _backend


def reset_backend() -> None:
    global _backend
    backend, _backend = _backend, None
    if backend is not None:
        backend.close()
