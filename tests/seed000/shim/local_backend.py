"""Seed 000's ``agent.memory.local_backend``: the library's local store, blocking."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hermes_async_memory.memory.standalone import StandaloneMemory

from . import MemoryBackend


class LocalBackend(MemoryBackend):
    """A ``StandaloneMemory`` on the local SQLite store: ``db_path``, else the configured one
    (``HERMES_MEMORY_DB_PATH``, else the user data directory)."""

    def __init__(self, db_path: Path | None = None) -> None:
        where: dict[str, Any] = {} if db_path is None else {"db_path": Path(db_path)}
        super().__init__(StandaloneMemory.from_env(kv_backend="local", **where))
