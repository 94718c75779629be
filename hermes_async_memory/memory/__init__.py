"""Key-value memory per user (seed 000's ``MemoryBackend``) on the pipeline's durable path:
``entries`` (the data and its checks), ``api`` (the local store's async and blocking
operations), ``backends`` (Honcho and null beside it, and the choice of one), ``standalone``
(the same as plain calls, for code with no pipeline of its own), ``tool`` (the
``memory_backend`` tool a model calls)."""

from __future__ import annotations

from .api import BlockingKeyValueMemory, KeyValueMemory
from .backends import BackendLimitError, HonchoMemory, Memory, NullMemory, memory_for
from .entries import InvalidEntryError, MemoryEntry
from .standalone import StandaloneMemory
from .tool import MEMORY_SCHEMA, MEMORY_TOOL, call_memory_tool

__all__ = ["MEMORY_SCHEMA", "MEMORY_TOOL", "BackendLimitError", "BlockingKeyValueMemory",
           "HonchoMemory", "InvalidEntryError", "KeyValueMemory", "Memory", "MemoryEntry",
           "NullMemory", "StandaloneMemory", "call_memory_tool", "memory_for"]
