"""Replica backends: where committed turns go after the local store has them."""

from __future__ import annotations

from .base import (
    Backend,
    BackendUnavailableError,
    BackendWriteError,
    RecallRequest,
    TurnFailure,
    WriteNotice,
)
from .honcho import CircuitOpenError, HonchoBackend, HonchoConfig, HonchoWriteError
from .memory import InMemoryBackend
from .null import NullBackend

__all__ = [
    "Backend",
    "BackendUnavailableError",
    "BackendWriteError",
    "CircuitOpenError",
    "HonchoBackend",
    "HonchoConfig",
    "HonchoWriteError",
    "InMemoryBackend",
    "NullBackend",
    "RecallRequest",
    "TurnFailure",
    "WriteNotice",
]
