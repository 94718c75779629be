"""Replica backends: where committed turns go after the local store has them."""

from __future__ import annotations

from .base import Backend, RecallRequest
from .memory import InMemoryBackend
from .null import NullBackend

__all__ = ["Backend", "InMemoryBackend", "NullBackend", "RecallRequest"]
