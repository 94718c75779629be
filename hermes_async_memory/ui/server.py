"""Running the memory inspector: its own event loop and read-only store, and the server.

``Inspector`` owns a thread with an event loop (anyio's blocking portal) on which a
read-only store of the file is open (``InspectorReads``); the HTTP server's request threads
hand their reads to that loop. A worker mounts ``Inspector.app`` beside /healthz and
/metrics (``hermes-memory worker --http``), with ``live`` reading the pipeline's health and
stats; ``serve_inspector`` serves it alone for a store file (``hermes-memory ui``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

import structlog
from anyio.from_thread import start_blocking_portal

from ..settings import Settings
from ..worker.wsgi import WsgiServer, serve_wsgi
from .access import Access
from .app import PREFIX, InspectorApp, JobsQueue, Live
from .reads import open_inspector_reads
from .series import DEFAULT_INTERVAL_S, Sampler, Series

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment

log = structlog.get_logger(__name__)


class Inspector:
    """The inspector of the store at ``settings.db_path``; ``close()`` when done.

    Raises (from the constructor):
        StoreError: the file is not a readable store.
    """

    def __init__(self, settings: Settings, access: Access, *, live: Live | None = None,
                 sample_interval_s: float = DEFAULT_INTERVAL_S,
                 jobs_queue: JobsQueue | None = None) -> None:
        self._stack = contextlib.ExitStack()
        try:
            portal = self._stack.enter_context(start_blocking_portal())
            reads = self._stack.enter_context(portal.wrap_async_context_manager(
                open_inspector_reads(settings.db_path, settings)))
            series = None
            if live is not None:
                series = Series(sample_interval_s)
                sampler = Sampler(series, lambda: live()[1]).start()
                self._stack.callback(sampler.close)
            self.app = InspectorApp(reads, portal, access, live=live, series=series,
                                    jobs_queue=jobs_queue)
        except BaseException:
            self._stack.close()
            raise

    def close(self) -> None:
        self._stack.close()


class _Standalone:
    """``/ui`` and below from the inspector; ``/`` leads there; anything else is a 404."""

    def __init__(self, app: InspectorApp) -> None:
        self._app = app

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse
                 ) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if self._app.handles(path):
            return self._app(environ, start_response)
        if path in ("", "/"):
            start_response("302 Found", [("Location", PREFIX), ("Content-Length", "0")])
            return [b""]
        body = f"no such page: {path} (the inspector is at {PREFIX})\n".encode()
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8"),
                                         ("Content-Length", str(len(body)))])
        return [body]


def serve_inspector(settings: Settings, host: str, port: int, access: Access) -> WsgiServer:
    """Serve the inspector of ``settings.db_path`` alone, at ``http://host:port/ui``.

    Raises:
        StoreError: the file is not a readable store. OSError: the address cannot be bound.
    """
    inspector = Inspector(settings, access)
    try:
        server, thread = serve_wsgi(_Standalone(inspector.app), host, port,
                                    name="hermes-memory-ui")
    except BaseException:
        inspector.close()
        raise
    return WsgiServer(server, thread, inspector.close)
