"""hermes-async-memory: an asyncio background-worker memory pipeline for AI agents.

It never blocks a turn, never loses a turn, and recalls ahead of the next one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .backends import Backend, HonchoBackend, HonchoConfig, InMemoryBackend, NullBackend
from .errors import (
    BackendError,
    ConfigurationError,
    CorruptOutboxError,
    CorruptStoreError,
    DatabaseError,
    DatabaseUnavailableError,
    DiskFullError,
    FlushTimeoutError,
    ForeignStoreError,
    FullTextUnavailableError,
    HermesMemoryError,
    InvalidTurnError,
    PipelineClosedError,
    PipelineFailedError,
    QueueFullError,
    SchemaVersionError,
    StoreAccessError,
    StoreError,
)
from .metrics import PipelineObserver
from .pipeline import MemoryPipeline
from .recall.cache import PrefetchStatus
from .settings import Settings
from .stats import PipelineStats
from .supervisor import Health
from .turns import Receipt

if TYPE_CHECKING:
    from .hermes.provider import HermesMemoryProvider

__all__ = [
    "Backend",
    "BackendError",
    "ConfigurationError",
    "CorruptOutboxError",
    "CorruptStoreError",
    "DatabaseError",
    "DatabaseUnavailableError",
    "DiskFullError",
    "FlushTimeoutError",
    "ForeignStoreError",
    "FullTextUnavailableError",
    "Health",
    "HermesMemoryError",
    "HermesMemoryProvider",
    "HonchoBackend",
    "HonchoConfig",
    "InMemoryBackend",
    "InvalidTurnError",
    "MemoryPipeline",
    "NullBackend",
    "PipelineClosedError",
    "PipelineFailedError",
    "PipelineObserver",
    "PipelineStats",
    "PrefetchStatus",
    "QueueFullError",
    "Receipt",
    "SchemaVersionError",
    "Settings",
    "StoreAccessError",
    "StoreError",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # Lazy: importing the library must not import hermes-agent (the provider's base class).
    if name == "HermesMemoryProvider":
        from .hermes.provider import HermesMemoryProvider

        globals()[name] = HermesMemoryProvider
        return HermesMemoryProvider
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
