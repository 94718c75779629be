"""The project's exception tree.

    HermesMemoryError
    ├── ConfigurationError        a setting or environment value is invalid
    ├── InvalidTurnError          input that cannot be stored; refused before it is accepted
    ├── QueueFullError            the backlog is full and the overflow policy is "reject"
    ├── PipelineClosedError       the pipeline is not open (not started, closing, or closed)
    ├── PipelineFailedError       a background part failed for good; ``cause`` says why
    ├── FlushTimeoutError         flush() did not reach its barrier in time (also a TimeoutError)
    ├── StoreError                the store or the outbox failed; what was accepted stays durable
    │   ├── DiskFullError         no space left to make a turn durable or to commit it
    │   ├── StoreAccessError      the store's file or folder cannot be used (read-only, missing)
    │   ├── CorruptStoreError     the store file is damaged or is not a SQLite database
    │   ├── ForeignStoreError     the file is another program's SQLite database (Hermes's own
    │   │                         state.db, say): refused, left untouched
    │   ├── CorruptOutboxError    an outbox segment cannot be used at all
    │   ├── LeaseLostError        another worker took over inbox turns (or a shared job) this
    │   │                         one had claimed
    │   └── DatabaseError         the PostgreSQL store failed; the DSN shown has no password
    │       ├── DatabaseUnavailableError  it cannot be reached now (refused, timed out, down)
    │       └── SchemaVersionError        its schema is older or newer than this library
    └── BackendError              a replica backend failed
"""

from __future__ import annotations

from pathlib import Path


class HermesMemoryError(Exception):
    """Root of every error this library raises on purpose."""


class ConfigurationError(HermesMemoryError, ValueError):
    """A setting or an environment value is invalid."""


class InvalidTurnError(HermesMemoryError, ValueError):
    """Input was refused before it was accepted; nothing was stored."""


class QueueFullError(HermesMemoryError):
    """The backlog is full and the overflow policy is ``"reject"``; nothing was stored."""


class PipelineClosedError(HermesMemoryError):
    """The pipeline is not open (not started yet, closing, or closed)."""


class PipelineFailedError(HermesMemoryError):
    """A background part of the pipeline stopped for a cause it cannot outlive.

    Turns accepted before stay durable in the outbox; the next start commits them.
    ``part`` names the part, ``cause`` is the exception that stopped it.
    """

    def __init__(self, part: str, cause: BaseException) -> None:
        self.part = part
        self.cause = cause
        super().__init__(f"the pipeline's {part} failed: {describe(cause)}")


class FlushTimeoutError(HermesMemoryError, TimeoutError):
    """``flush()`` ran out of time; what was accepted stays durable and is committed later."""


class StoreError(HermesMemoryError):
    """The store or the outbox failed."""


class DiskFullError(StoreError):
    """No space is left on the device: a turn cannot be made durable, or not committed."""


class StoreAccessError(StoreError):
    """The store's file or folder cannot be used: read-only, not writable, or missing."""


class CorruptStoreError(StoreError):
    """The store file is damaged, or is not a SQLite store of ours."""

    def __init__(self, path: Path | str, detail: str) -> None:
        self.path = Path(path)
        super().__init__(f"the store {self.path} is damaged or not a memory store: {detail}")


class ForeignStoreError(StoreError):
    """The file is another program's SQLite database, not a store of ours: it is refused and
    left as it was (no table added, no journal mode switched)."""


class FullTextUnavailableError(StoreError):
    """A search cannot run: the store's full-text indexes are not kept, because the SQLite
    that writes the store (or the one reading it) has no FTS5 module. Writes go on; a
    SQLite with FTS5 rebuilds the indexes when it next opens the store."""


class CorruptOutboxError(StoreError):
    """An outbox segment cannot be used at all (damaged records are quarantined instead)."""


class LeaseLostError(StoreError):
    """A worker's claim on inbox turns expired and another worker holds them now."""


class DatabaseError(StoreError):
    """The PostgreSQL store failed. ``dsn`` is where, with its password replaced by ``***``;
    neither it nor the message ever holds the password."""

    def __init__(self, message: str, *, dsn: str | None = None) -> None:
        self.dsn = dsn
        super().__init__(message)


class DatabaseUnavailableError(DatabaseError):
    """The PostgreSQL store cannot be reached now (connection refused or lost, timed out,
    shutting down): what was accepted stays durable locally; try again later."""


class SchemaVersionError(DatabaseError):
    """The database's schema is not the one this library uses: ``found`` is its version,
    ``expected`` this library's. Older: run ``hermes-memory db upgrade``."""

    def __init__(self, message: str, *, found: int, expected: int,
                 dsn: str | None = None) -> None:
        self.found = found
        self.expected = expected
        super().__init__(message, dsn=dsn)


class BackendError(HermesMemoryError):
    """A replica backend failed."""


def describe(exc: BaseException) -> str:
    """``exc`` as one line: its type and its message."""
    text = " ".join(str(exc).split())
    name = type(exc).__name__
    return f"{name}: {text}" if text else name
