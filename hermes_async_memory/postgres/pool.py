"""The connection pool to the PostgreSQL store, and the one place the driver's errors become
ours (``DatabaseError``, ``DatabaseUnavailableError``) with the DSN redacted.

asyncpg's own errors may carry what they were given: a DSN that does not parse is echoed
back, password and all. So the text of an error of the driver's is scrubbed of every form of
the password before it becomes our message, and the driver's error is kept as ``__cause__``
(printed with a traceback) only when its own text holds none of them.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
import structlog
from asyncpg import Pool, Record

from ..errors import ConfigurationError, DatabaseError, DatabaseUnavailableError, describe
from ..settings import Settings
from .dsn import dsn_secrets, redact_dsn, scrub, settings_dsn

log = structlog.get_logger(__name__)

APPLICATION_NAME = "hermes-memory"  # what pg_stat_activity shows for our connections
# Closing the pool waits this long for connections in use to come back, then cuts them.
CLOSE_TIMEOUT_S = 5.0

# The driver's failures: a server's error, the client's, the network's.
DRIVER_ERRORS: tuple[type[BaseException], ...] = (
    asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError,
    asyncio.TimeoutError)
# And at connect, where a DSN the driver cannot read is a ValueError (a port not a number).
CONNECT_ERRORS: tuple[type[BaseException], ...] = (*DRIVER_ERRORS, ValueError)
# Those that say the server cannot be reached now, rather than that something is wrong:
# refused or lost connections (an OSError: asyncpg joins the errors of several addresses in
# a plain one), time-outs, a server shutting down or starting up, or out of connection
# slots. The outage path waits and tries again; the rest are reported.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    OSError, TimeoutError, asyncio.TimeoutError,
    asyncpg.PostgresConnectionError, asyncpg.AdminShutdownError, asyncpg.CrashShutdownError,
    asyncpg.CannotConnectNowError, asyncpg.TooManyConnectionsError)
# OSErrors that waiting will not mend: a certificate the server's does not verify against, a
# root certificate file that is missing or unreadable.
LASTING_OS_ERRORS: tuple[type[BaseException], ...] = (
    ssl.SSLError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def database_error(exc: BaseException, dsn: str) -> DatabaseError:
    """``exc`` (an error of the driver's) as ours, naming the database by its redacted DSN;
    ``DatabaseUnavailableError`` when it says the server cannot be reached now."""
    shown = redact_dsn(dsn)
    unavailable = (isinstance(exc, UNAVAILABLE_ERRORS)
                   and not isinstance(exc, LASTING_OS_ERRORS))
    kind = DatabaseUnavailableError if unavailable else DatabaseError
    error = kind(f"PostgreSQL at {shown}: {scrub(describe(exc), dsn)}", dsn=shown)
    leaks = f"{exc} {exc.args!r}"
    error.__cause__ = None if any(s in leaks for s in dsn_secrets(dsn)) else exc
    # Not the driver's error as the context either: a traceback prints one or the other.
    error.__suppress_context__ = True
    return error


@asynccontextmanager
async def database_errors(dsn: str) -> AsyncIterator[None]:
    """Within: the driver's errors are raised as ``database_error(exc, dsn)``.

    Raises:
        DatabaseUnavailableError: the server cannot be reached now.
        DatabaseError: any other failure of the driver or the server.
    """
    try:
        yield
    except DRIVER_ERRORS as exc:
        raise database_error(exc, dsn)  # noqa: B904 (its cause is chosen in database_error)


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
    except CONNECT_ERRORS as exc:
        raise database_error(exc, dsn)  # noqa: B904 (its cause is chosen in database_error)
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
    except CONNECT_ERRORS as exc:
        raise database_error(exc, dsn)  # noqa: B904 (its cause is chosen in database_error)
    return conn


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
