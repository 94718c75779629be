"""PostgreSQL as the shared store of several machines (the ``postgres`` extra: asyncpg).

    dsn      which DSN applies, its TLS options, and its redacted form (no driver import)
    pool     the asyncpg pool, sized by settings; the driver's errors become ours
    schema   numbered migrations, ``upgrade`` (``hermes-memory db upgrade``) and ``check``
    jobs     shared jobs: claimed with FOR UPDATE SKIP LOCKED under expiring leases

The SQLite file stays the embedded default; this package is what a user picks when one
machine is not enough.
"""

from __future__ import annotations

from .dsn import redact_dsn
from .pool import create_pool, database_errors, open_pool
from .schema import SCHEMA_VERSION, check, status, upgrade

__all__ = [
    "SCHEMA_VERSION",
    "check",
    "create_pool",
    "database_errors",
    "open_pool",
    "redact_dsn",
    "status",
    "upgrade",
]
