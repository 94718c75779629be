"""Key-value memory per user (seed 000's ``MemoryBackend``) on the pipeline's durable path:
``entries`` (the data and its checks), ``api`` (the async and the blocking operations),
``tool`` (the ``memory`` tool a model calls)."""

from __future__ import annotations

from .api import BlockingKeyValueMemory, KeyValueMemory
from .entries import InvalidEntryError, MemoryEntry
from .tool import MEMORY_SCHEMA, MEMORY_TOOL, call_memory_tool

__all__ = ["MEMORY_SCHEMA", "MEMORY_TOOL", "BlockingKeyValueMemory", "InvalidEntryError",
           "KeyValueMemory", "MemoryEntry", "call_memory_tool"]
