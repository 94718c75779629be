"""hermes-async-memory: an asyncio background-worker memory pipeline for AI agents.

It never blocks a turn, never loses a turn, and recalls ahead of the next one.
"""

from __future__ import annotations

from .backends import Backend, InMemoryBackend, NullBackend
from .cache import PrefetchStatus
from .errors import (
    BackendError,
    ConfigurationError,
    CorruptOutboxError,
    FlushTimeoutError,
    HermesMemoryError,
    InvalidTurnError,
    PipelineClosedError,
    QueueFullError,
    StoreError,
)
from .pipeline import MemoryPipeline
from .settings import Settings
from .stats import PipelineStats
from .turns import Receipt

__all__ = [
    "Backend",
    "BackendError",
    "ConfigurationError",
    "CorruptOutboxError",
    "FlushTimeoutError",
    "HermesMemoryError",
    "InMemoryBackend",
    "InvalidTurnError",
    "MemoryPipeline",
    "NullBackend",
    "PipelineClosedError",
    "PipelineStats",
    "PrefetchStatus",
    "QueueFullError",
    "Receipt",
    "Settings",
    "StoreError",
]

__version__ = "0.1.0"
