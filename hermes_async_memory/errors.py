"""The project's exception tree.

    HermesMemoryError
    ├── ConfigurationError        a setting or environment value is invalid
    ├── InvalidTurnError          a turn that cannot be stored (too large, wrong types)
    ├── QueueFullError            the bounded queue is full and the policy is "reject"
    ├── PipelineClosedError       the pipeline is closed or closing: nothing is accepted
    ├── FlushTimeoutError         flush() did not reach its barrier in time (also a TimeoutError)
    ├── StoreError                the SQLite store failed; the turn stays durable in the outbox
    │   └── CorruptOutboxError    an outbox segment cannot be read back
    └── BackendError              a replica backend failed
"""

from __future__ import annotations


class HermesMemoryError(Exception):
    """Root of every error this library raises on purpose."""


class ConfigurationError(HermesMemoryError, ValueError):
    """A setting or an environment value is invalid."""


class InvalidTurnError(HermesMemoryError, ValueError):
    """A turn was refused before it was accepted; nothing was stored."""


class QueueFullError(HermesMemoryError):
    """The bounded queue is full and the overflow policy is ``"reject"``; nothing was stored."""


class PipelineClosedError(HermesMemoryError):
    """The pipeline is not open (not started yet, closing, or closed)."""


class FlushTimeoutError(HermesMemoryError, TimeoutError):
    """``flush()`` ran out of time; what was accepted stays durable and is committed later."""


class StoreError(HermesMemoryError):
    """The SQLite store failed."""


class CorruptOutboxError(StoreError):
    """An outbox segment holds bytes that are not a record this library wrote."""


class BackendError(HermesMemoryError):
    """A replica backend failed."""
