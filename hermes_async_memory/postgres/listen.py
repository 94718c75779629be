"""LISTEN on the shared store's channels over one connection of its own, kept open.

PostgreSQL delivers a notification to the sessions listening when it is sent, at its
transaction's commit, and to no one else: one sent while this connection was away is gone.
So every (re)connect calls the ``on_connect`` callbacks, which catch up on whatever they
follow by reading it again (a prefetch cache refreshes its blocks; a job worker claims).

The connection is watched: closed by the server (a restart, ``pg_terminate_backend``) it
reports itself; a connection that went silent (a cut network) is found by a ``SELECT 1``
every ``KEEPALIVE_S``. Either way the listener connects again, on a backoff while the
server cannot be reached. A failure that waiting will not mend (a wrong password) is raised
to the supervisor, which restarts the part and reports it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from ..errors import DatabaseUnavailableError, describe
from ..retry import Backoff
from ..settings import Settings
from .dsn import redact_dsn, settings_dsn
from .pool import UnclassifiedErrors, connect, database_errors

if TYPE_CHECKING:
    from asyncpg import Connection, Record

log = structlog.get_logger(__name__)

# How often a quiet connection is asked whether it is still there, and how long it has to
# answer.
KEEPALIVE_S = 5.0
KEEPALIVE_TIMEOUT_S = 5.0


class Listener:
    """One LISTEN connection for several channels; a supervised part (``run``)."""

    def __init__(self, settings: Settings, *, backoff: Backoff) -> None:
        self._settings = settings
        self._dsn = settings_dsn(settings)
        self._backoff = backoff
        self._channels: dict[str, list[Callable[[str], None]]] = {}
        self._on_connect: list[Callable[[], None]] = []
        self._on_lost: list[Callable[[], None]] = []
        self.connected = False
        self.connects = 0
        self.notifications = 0
        self._unclassified = UnclassifiedErrors()

    def subscribe(self, channel: str, callback: Callable[[str], None]) -> None:
        """Call ``callback(payload)`` on the event loop for each notification on
        ``channel``. Subscribe before ``run`` starts (or it takes effect at the next
        connect)."""
        self._channels.setdefault(channel, []).append(callback)

    def on_connect(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` after each connect, once its channels are listened to."""
        self._on_connect.append(callback)

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` each time the connection is lost (the database may be
        down: a part idle until a notification learns of it now, not at its next call)."""
        self._on_lost.append(callback)

    async def run(self) -> None:
        """Listen until cancelled, connecting again after each loss.

        Raises:
            DatabaseError: the server refused us for a reason waiting will not mend.
        """
        failures = 0
        while True:
            try:
                conn = await connect(self._settings)
            except DatabaseUnavailableError as exc:
                failures += 1
                wait = self._backoff.delay(failures)
                if failures == 1:
                    log.warning("postgres_listen_unavailable", dsn=redact_dsn(self._dsn),
                                retry_in_s=round(wait, 3), error=describe(exc))
                await anyio.sleep(wait)
                continue
            failures = 0
            try:
                await self._listen(conn)
            finally:
                self.connected = False
                conn.terminate()
            for callback in self._on_lost:
                _call(callback)

    async def _listen(self, conn: Connection[Record]) -> None:
        lost = asyncio.Event()
        conn.add_termination_listener(lambda _conn: lost.set())
        try:
            async with database_errors(self._dsn, self._unclassified):
                for channel, callbacks in self._channels.items():
                    await conn.add_listener(channel, self._dispatch(callbacks))
        except DatabaseUnavailableError as exc:
            log.warning("postgres_listen_lost", error=describe(exc))
            return
        self.connected = True
        self.connects += 1
        log.info("postgres_listening", channels=sorted(self._channels),
                 connects=self.connects)
        for callback in self._on_connect:
            _call(callback)
        while not lost.is_set():
            with anyio.move_on_after(KEEPALIVE_S):
                await lost.wait()
            if lost.is_set():
                break
            try:
                with anyio.fail_after(KEEPALIVE_TIMEOUT_S):
                    await conn.execute("SELECT 1")
            except Exception as exc:  # lost, or silent: connect again either way
                log.warning("postgres_listen_lost", error=describe(exc))
                return
        log.warning("postgres_listen_lost", error="connection closed")

    def _dispatch(self, callbacks: list[Callable[[str], None]]
                  ) -> Callable[[Any, int, str, object], None]:
        def on_notification(_conn: Any, _pid: int, _channel: str, payload: object) -> None:
            self.notifications += 1
            for callback in callbacks:
                _call(callback, str(payload))
        return on_notification


def _call(callback: Callable[..., None], *args: Any) -> None:
    """A subscriber's callback; its failure is logged, never the listener's end."""
    try:
        callback(*args)
    except Exception as exc:
        log.error("postgres_listen_callback_failed", error=describe(exc), exc_info=exc)
