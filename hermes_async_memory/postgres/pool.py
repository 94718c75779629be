"""The connection pool to the PostgreSQL store, and the one place the driver's errors become
ours (``DatabaseError``, ``DatabaseUnavailableError``) with the DSN redacted.

asyncpg's own errors may carry what they were given: a DSN that does not parse is echoed
back, password and all. So the text of an error of the driver's is scrubbed of every form of
the password before it becomes our message, and the driver's error is kept as ``__cause__``
(printed with a traceback) only when its own text holds none of them.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import asyncpg
import structlog
from asyncpg import Pool, Record

from ..errors import (
    ConfigurationError,
    DatabaseError,
    DatabaseUnavailableError,
    HermesMemoryError,
    describe,
)
from ..settings import Settings
from .dsn import dsn_secrets, redact_dsn, scrub, settings_dsn

log = structlog.get_logger(__name__)

APPLICATION_NAME = "hermes-memory"  # what pg_stat_activity shows for our connections
# Closing the pool waits this long for connections in use to come back, then cuts them.
CLOSE_TIMEOUT_S = 5.0

# What a driver's error means, for what to do about it:
#   UNAVAILABLE  the server cannot be reached now (refused, timed out, shutting down or
#                starting up, out of connection slots or other resources): wait, try again
#   LOST         a connection broke under an operation (closed, reset, left in a state it
#                cannot leave): the pool replaces it; wait, try again
#   REFUSED      the server or the driver refused what was asked (bad data, a wrong
#                password, a certificate that does not verify): waiting will not mend it
#   UNCLASSIFIED raised from inside the driver with none of those meanings: an outage for
#                ``UNCLASSIFIED_LIMIT_S`` of failures without a success between, then refused
UNAVAILABLE = "unavailable"
LOST = "lost"
REFUSED = "refused"
UNCLASSIFIED = "unclassified"
# Errors of no known meaning count as an outage for this long without a success between.
UNCLASSIFIED_LIMIT_S = 60.0
# SQLSTATE classes and codes that mean "not now" rather than "no": connection exceptions,
# insufficient resources (no connection slot, disk full, out of memory), and a server
# shutting down, crashed, or starting up (admin_shutdown, crash_shutdown,
# cannot_connect_now) or that ended an idle session.
_UNAVAILABLE_SQLSTATE_CLASSES = ("08", "53")
_UNAVAILABLE_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "57P05"})
# OSErrors that waiting will not mend: a certificate the server's does not verify against, a
# root certificate file that is missing or unreadable.
LASTING_OS_ERRORS: tuple[type[BaseException], ...] = (
    ssl.SSLError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
# The driver's own errors that say what was asked cannot be done with this server or these
# options (InterfaceError's other subclasses mean the connection broke under the call).
_REFUSED_INTERFACE_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.exceptions.ClientConfigurationError,
    asyncpg.exceptions.UnsupportedClientFeatureError,
    asyncpg.exceptions.UnsupportedServerFeatureError)
# Where the driver's code lives: an error raised from there is the driver's.
_DRIVER_DIR = os.path.dirname(asyncpg.__file__) + os.sep
# The driver's failures that ``database_errors`` turns into ours: its own errors (server's,
# client's), the network's and time-outs; anything else raised from inside the driver is
# classified by where it came from (``classify``).
DRIVER_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.PostgresError, asyncpg.InterfaceError, asyncpg.InternalClientError, OSError,
    TimeoutError, asyncio.TimeoutError)


def classify(exc: BaseException) -> str | None:
    """What the driver's error ``exc`` means: ``UNAVAILABLE``, ``LOST``, ``REFUSED`` or
    ``UNCLASSIFIED`` (see above); None when it is not the driver's (raised by other code,
    which handles it)."""
    if isinstance(exc, HermesMemoryError):
        return None  # ours, raised on purpose (a lease lost, a schema too old)
    if isinstance(exc, LASTING_OS_ERRORS):
        return REFUSED
    if isinstance(exc, (OSError, TimeoutError, asyncio.TimeoutError)):
        return UNAVAILABLE  # ConnectionError (refused, reset) included
    if isinstance(exc, asyncpg.PostgresError):
        state = str(getattr(exc, "sqlstate", None) or "")
        if isinstance(exc, asyncpg.PostgresConnectionError) or state.startswith("08"):
            return LOST if isinstance(exc, asyncpg.ConnectionDoesNotExistError) else UNAVAILABLE
        if state[:2] in _UNAVAILABLE_SQLSTATE_CLASSES or state in _UNAVAILABLE_SQLSTATES:
            return UNAVAILABLE
        return REFUSED if len(state) == 5 else UNCLASSIFIED
    if isinstance(exc, asyncpg.InterfaceError):
        return REFUSED if isinstance(exc, _REFUSED_INTERFACE_ERRORS) else LOST
    if isinstance(exc, asyncpg.exceptions.TargetServerAttributeNotMatched):
        return UNAVAILABLE  # a failover: no server of the kind asked for, yet
    if isinstance(exc, asyncpg.InternalClientError):
        # "cannot switch to state 15; another operation is in progress": a connection
        # released while an operation on it was cut by the server going away.
        return LOST
    if _raised_in_driver(exc):
        return UNCLASSIFIED
    return None


def _raised_in_driver(exc: BaseException) -> bool:
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith(_DRIVER_DIR):
            return True
        tb = tb.tb_next
    return False


def is_outage(exc: BaseException) -> bool:
    """Whether ``exc`` (ours or the driver's) says the database cannot be used now, rather
    than that it refused something: waiting mends it."""
    if isinstance(exc, DatabaseUnavailableError):
        return True
    return classify(exc) in (UNAVAILABLE, LOST)


class UnclassifiedErrors:
    """How long the driver's errors of no known meaning have gone on with no success
    between: an outage while that is under ``limit_s``, refused after. One per part that
    waits out outages (``database_errors(..., unclassified=)``)."""

    def __init__(self, limit_s: float = UNCLASSIFIED_LIMIT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit_s = limit_s
        self._clock = clock
        self._since: float | None = None

    def succeeded(self) -> None:
        self._since = None

    def failed(self) -> bool:
        """Note one more; whether it still counts as an outage."""
        now = self._clock()
        if self._since is None:
            self._since = now
        return now - self._since < self.limit_s


def database_error(exc: BaseException, dsn: str, *, meaning: str | None = None
                   ) -> DatabaseError:
    """``exc`` (an error of the driver's) as ours, naming the database by its redacted DSN;
    ``DatabaseUnavailableError`` when it means the server cannot be used now (``meaning``,
    else ``classify(exc)``: unavailable, or a connection lost)."""
    shown = redact_dsn(dsn)
    meaning = meaning or classify(exc)
    kind = DatabaseUnavailableError if meaning in (UNAVAILABLE, LOST) else DatabaseError
    error = kind(f"PostgreSQL at {shown}: {scrub(describe(exc), dsn)}", dsn=shown)
    leaks = f"{exc} {exc.args!r}"
    error.__cause__ = None if any(s in leaks for s in dsn_secrets(dsn)) else exc
    # Not the driver's error as the context either: a traceback prints one or the other.
    error.__suppress_context__ = True
    return error


@asynccontextmanager
async def database_errors(dsn: str, unclassified: UnclassifiedErrors | None = None
                          ) -> AsyncIterator[None]:
    """Within: the driver's errors are raised as ``database_error(exc, dsn)``, by what they
    mean (``classify``). Those of no known meaning count as an outage while ``unclassified``
    says so (without one, always: the caller tries once).

    Raises:
        DatabaseUnavailableError: the server cannot be reached now, or the connection broke.
        DatabaseError: any other failure of the driver or the server.
    """
    try:
        yield
    except Exception as exc:
        meaning = classify(exc)
        if meaning is None:
            raise
        if meaning == UNCLASSIFIED:
            outage = unclassified is None or unclassified.failed()
            if outage:
                log.warning("postgres_error_unclassified", error=describe(exc),
                            exc_info=exc)
            meaning = LOST if outage else REFUSED
        raise database_error(exc, dsn, meaning=meaning)  # noqa: B904 (cause chosen there)
    if unclassified is not None:
        unclassified.succeeded()


def _checked_dsn(settings: Settings) -> str:
    dsn = settings_dsn(settings)
    root = settings.postgres_sslrootcert
    if root is not None and not root.is_file():
        # The driver would say "No such file or directory", and not which.
        raise ConfigurationError(f"postgres_sslrootcert {root} is not a file")
    return dsn


async def create_pool(settings: Settings) -> Pool[Record]:
    """A pool of connections to ``settings.postgres_dsn`` (its TLS options applied), with
    ``postgres_pool_min_size`` connections opened now. Close it with ``pool.close()``, or use
    ``open_pool``.

    Raises:
        ConfigurationError: no DSN is configured, or ``postgres_sslrootcert`` is no file.
        DatabaseUnavailableError: the server cannot be reached (refused, timed out).
        DatabaseError: it refused the connection (wrong password, no such database, TLS
            required...) or the DSN does not parse.
    """
    dsn = _checked_dsn(settings)
    started = time.perf_counter()
    try:
        pool: Pool[Record] = await asyncpg.create_pool(
            dsn, min_size=settings.postgres_pool_min_size,
            max_size=settings.postgres_pool_max_size,
            timeout=settings.postgres_connect_timeout_s,
            server_settings={"application_name": APPLICATION_NAME})
    except Exception as exc:
        raise _connect_error(exc, dsn)  # noqa: B904 (its cause is chosen in database_error)
    log.info("postgres.pool_open", dsn=redact_dsn(dsn),
             min_size=settings.postgres_pool_min_size,
             max_size=settings.postgres_pool_max_size,
             duration_ms=round((time.perf_counter() - started) * 1000, 1))
    return pool


async def connect(settings: Settings) -> asyncpg.Connection[Record]:
    """One connection of its own (not the pool's) to ``settings.postgres_dsn``: a LISTEN
    needs a connection that stays with its listener. Close it with ``close()``.

    Raises:
        ConfigurationError, DatabaseUnavailableError, DatabaseError: as ``create_pool``.
    """
    dsn = _checked_dsn(settings)
    try:
        conn: asyncpg.Connection[Record] = await asyncpg.connect(
            dsn, timeout=settings.postgres_connect_timeout_s,
            server_settings={"application_name": APPLICATION_NAME})
    except Exception as exc:
        raise _connect_error(exc, dsn)  # noqa: B904 (its cause is chosen in database_error)
    return conn


def _connect_error(exc: Exception, dsn: str) -> Exception:
    """What a failed connect raises: a DSN the driver cannot read (a ValueError, a port not
    a number) is refused; the driver's other errors by what they mean; the rest as is."""
    meaning = classify(exc)
    if isinstance(exc, ValueError) and meaning in (None, UNCLASSIFIED):
        meaning = REFUSED
    if meaning is None:
        return exc
    return database_error(exc, dsn, meaning=LOST if meaning == UNCLASSIFIED else meaning)


@asynccontextmanager
async def open_pool(settings: Settings) -> AsyncIterator[Pool[Record]]:
    """``create_pool(settings)``, closed at the end (within ``CLOSE_TIMEOUT_S``).

    Raises:
        ConfigurationError, DatabaseUnavailableError, DatabaseError: as ``create_pool``.
    """
    pool = await create_pool(settings)
    try:
        yield pool
    finally:
        await close_pool(pool)


async def close_pool(pool: Pool[Record]) -> None:
    """Close ``pool``: wait up to ``CLOSE_TIMEOUT_S`` for its connections in use, then cut
    them. Shielded: a cancelled caller does not stop the close half-way."""
    try:
        await asyncio.shield(asyncio.wait_for(pool.close(), CLOSE_TIMEOUT_S))
    except (asyncio.TimeoutError, TimeoutError):
        pool.terminate()
