"""A small threaded WSGI server (the standard library's wsgiref), for the worker's endpoints
and the memory inspector: one daemon thread per request, request lines logged at debug
through structlog, IPv4 or IPv6 as the address says, and a ``close()`` that returns once the
port is free."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import anyio.to_thread
import structlog

if TYPE_CHECKING:
    from _typeshed.wsgi import WSGIApplication

log = structlog.get_logger(__name__)

# serve_forever() notices a shutdown request once per poll: this bounds close().
_POLL_INTERVAL_S = 0.1


class _Server(ThreadingMixIn, WSGIServer):
    """One daemon thread per request: a stuck client never holds up shutdown."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        # The default prints a traceback to stderr, which would break the JSON log stream.
        log.debug("http_connection_error", client=str(client_address), exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """Request lines go to structlog at debug, not to stderr."""

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        log.debug("http_request", method=self.command, path=self.path, status=str(code),
                  bytes=str(size))

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http_message", client=self.client_address[0], message=format % args)


class WsgiServer:
    """A running server; ``close()`` (or ``await aclose()``) stops it, then runs
    ``on_close``. Both are idempotent."""

    def __init__(self, server: WSGIServer, thread: threading.Thread,
                 on_close: Callable[[], None] | None = None) -> None:
        self._server = server
        self._thread = thread
        self._on_close = on_close
        self._lock = threading.Lock()
        self._closed = False
        self.host = str(server.server_address[0])
        self.port = int(server.server_address[1])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def close(self) -> None:
        """Stop serving and release the port. Blocks up to ~0.1 s: not on the event loop."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
        finally:
            if self._on_close is not None:
                self._on_close()
        log.info("http_closed", host=self.host, port=self.port)

    async def aclose(self) -> None:
        """``close()`` in a worker thread, so the event loop keeps running."""
        await anyio.to_thread.run_sync(self.close)


def serve_wsgi(app: WSGIApplication, host: str, port: int, *, name: str
               ) -> tuple[WSGIServer, threading.Thread]:
    """Bind ``host:port`` (0: a free port) and serve ``app`` from a daemon thread.

    Raises:
        OSError: the address cannot be bound (in use, not local, unknown host).
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    server_class = _Server6 if family[0][0] == socket.AF_INET6 else _Server
    server = make_server(host, port, app, server_class=server_class,
                         handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever,
                              kwargs={"poll_interval": _POLL_INTERVAL_S}, name=name,
                              daemon=True)
    thread.start()
    return server, thread
