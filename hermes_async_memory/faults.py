"""What kind of failure an exception is: the store's passing trouble, the data's fault, or
an end.

    TRANSIENT  busy or locked, I/O, a full disk, out of memory: retry with backoff; nothing
               acknowledged is lost, and health shows it while it lasts
    DATA       anything else raised while one batch is written: bisect the batch down to the
               one record, dead-letter it with its reason, commit the rest
    FATAL      the store cannot be used any more (damaged, not a database, read-only, gone):
               the pipeline enters its failed state, naming the cause

A batch is never retried for a reason it cannot outlive.
"""

from __future__ import annotations

import enum
import errno
import sqlite3
import sys

from .errors import (
    CorruptStoreError,
    DatabaseUnavailableError,
    DiskFullError,
    LeaseLostError,
    StoreAccessError,
)

if sys.version_info < (3, 11):  # pragma: no cover - the backport anyio brings along
    from exceptiongroup import BaseExceptionGroup


class Fault(enum.Enum):
    TRANSIENT = "transient"
    DATA = "data"
    FATAL = "fatal"


# Primary SQLite result codes (the low byte of an extended code).
SQLITE_PERM = 3
SQLITE_BUSY = 5
SQLITE_LOCKED = 6
SQLITE_NOMEM = 7
SQLITE_READONLY = 8
SQLITE_INTERRUPT = 9
SQLITE_IOERR = 10
SQLITE_CORRUPT = 11
SQLITE_FULL = 13
SQLITE_CANTOPEN = 14
SQLITE_PROTOCOL = 15
SQLITE_NOTADB = 26

_TRANSIENT_CODES = frozenset({
    SQLITE_BUSY, SQLITE_LOCKED, SQLITE_NOMEM, SQLITE_INTERRUPT, SQLITE_IOERR, SQLITE_FULL,
    SQLITE_PROTOCOL,
})
_FATAL_CODES = frozenset({
    SQLITE_PERM, SQLITE_READONLY, SQLITE_CORRUPT, SQLITE_CANTOPEN, SQLITE_NOTADB,
})
_TRANSIENT_ERRNOS = frozenset({
    errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EAGAIN, errno.EINTR, errno.ENOMEM,
    errno.EBUSY,
})
# Messages of the sqlite3 module's errors that carry no result code (older Pythons).
_TRANSIENT_TEXT = ("database is locked", "database table is locked", "disk i/o error",
                   "database or disk is full", "unable to open database file")


def sqlite_code(exc: BaseException) -> int | None:
    """The primary SQLite result code an error carries, if any."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code & 0xFF if isinstance(code, int) else None


def unwrap(exc: BaseException) -> BaseException:
    """The one exception a task group's exception group holds (at any depth), or ``exc``."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def classify(exc: BaseException) -> Fault:
    """Which kind of failure ``exc`` is, for a write to the store or the outbox. A group of
    failures (from a task group) is the worst of its members."""
    if isinstance(exc, BaseExceptionGroup):
        kinds = {classify(e) for e in exc.exceptions}
        return next(k for k in (Fault.FATAL, Fault.DATA, Fault.TRANSIENT) if k in kinds)
    if isinstance(exc, (DiskFullError, LeaseLostError, DatabaseUnavailableError)):
        return Fault.TRANSIENT
    if isinstance(exc, (CorruptStoreError, StoreAccessError)):
        return Fault.FATAL
    if isinstance(exc, sqlite3.Error):
        code = sqlite_code(exc)
        if code in _TRANSIENT_CODES:
            return Fault.TRANSIENT
        if code in _FATAL_CODES:
            return Fault.FATAL
        if code is None and isinstance(exc, sqlite3.OperationalError):
            text = str(exc).lower()
            if any(t in text for t in _TRANSIENT_TEXT):
                return Fault.TRANSIENT
        if isinstance(exc, sqlite3.ProgrammingError):
            return Fault.FATAL  # a closed connection, a misuse: no batch would fare better
        return Fault.DATA
    if isinstance(exc, OSError):
        return Fault.TRANSIENT if exc.errno in _TRANSIENT_ERRNOS else Fault.FATAL
    if isinstance(exc, MemoryError):
        return Fault.TRANSIENT
    return Fault.DATA


def is_disk_full(exc: BaseException) -> bool:
    if isinstance(exc, DiskFullError):
        return True
    if isinstance(exc, sqlite3.Error):
        return sqlite_code(exc) == SQLITE_FULL
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)
