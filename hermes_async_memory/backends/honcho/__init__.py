"""A replica backend on Honcho (plastic-labs), through honcho-ai's async SDK (``honcho.aio``).

The local SQLite store stays the system of record; this backend copies committed turns into
Honcho and may answer recalls from it. One module per concern, in the order a turn meets them:

- ``config``: ``HonchoConfig``, where the server is and how to talk to it (``HONCHO_*``);
- ``mapping``: local sessions, users and turns as Honcho ids, peers and tagged messages, and
  session lifecycle records as what they do to a Honcho session (metadata, delete);
- ``breaker``: the circuit breaker in front of every call;
- ``client``: the SDK client; every call through the breaker, its errors sorted into
  retry or give up, retries with backoff (``Retry-After`` honoured);
- ``replication``: ``write``, per session in order, batches of at most 100 messages, exactly
  once (a resend first waits out the server's in-flight time, then asks what it holds),
  refused batches bisected;
- ``recall``: one source per ``recall_mode``, under a deadline, the local store as fallback;
- ``backend``: ``HonchoBackend``, which puts them together.

The SDK (and pydantic, httpx) are imported when the backend starts, not when this package is
imported: the pipeline imports the backends package, and most deployments never use Honcho.
"""

from __future__ import annotations

from .backend import HonchoBackend
from .breaker import CircuitBreaker
from .client import CircuitOpenError, HonchoWriteError
from .config import (
    ENV_PREFIX,
    PRODUCTION_URL,
    REASONING_LEVELS,
    RECALL_MODES,
    HonchoConfig,
    ReasoningLevel,
    RecallMode,
    is_loopback_url,
)
from .mapping import INDEX_FIELD, KEY_FIELD, USER_FIELD, honcho_id

__all__ = [
    "ENV_PREFIX",
    "INDEX_FIELD",
    "KEY_FIELD",
    "PRODUCTION_URL",
    "REASONING_LEVELS",
    "RECALL_MODES",
    "USER_FIELD",
    "CircuitBreaker",
    "CircuitOpenError",
    "HonchoBackend",
    "HonchoConfig",
    "HonchoWriteError",
    "ReasoningLevel",
    "RecallMode",
    "honcho_id",
    "is_loopback_url",
]
