"""``hermes-memory ui``: the memory inspector for a store file, with no worker running.

    hermes-memory ui [--db PATH] [--host HOST] [--port PORT] [--open]

Serves the inspector's pages (``hermes_async_memory.ui``) at ``http://HOST:PORT/ui`` until
Ctrl-C or SIGTERM. The file is read read-only, so a worker may be writing it meanwhile;
replaying dead letters, the one write, needs ``HERMES_MEMORY_UI_TOKEN``. A host other
machines can reach needs the token too: without it the command refuses to start.
"""

from __future__ import annotations

import argparse
from typing import Any

from .common import EXIT_OK, db_option

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8088


def register(commands: Any) -> None:
    ui = commands.add_parser(
        "ui", parents=[db_option()], help="open the memory inspector for a store file",
        description="Serve the memory inspector (users, sessions, search, prefetch preview, "
                    "key-value memory, tools, templates, dead letters) for a store file, "
                    "without a running worker, until Ctrl-C.",
    )
    ui.add_argument("--host", default=DEFAULT_HOST,
                    help=f"the address to listen on (default {DEFAULT_HOST}; any other needs "
                         "HERMES_MEMORY_UI_TOKEN)")
    ui.add_argument("--port", type=int, default=DEFAULT_PORT,
                    help=f"the port (default {DEFAULT_PORT}; 0 picks a free one)")
    ui.add_argument("--open", action="store_true", help="open the page in a web browser")
    ui.set_defaults(handler=_ui)


def _ui(args: argparse.Namespace) -> int:
    import os
    import signal
    import threading

    from ..extras import require
    from ..logs import configure_logging
    from ..ui.access import Access, token_from_env
    from .common import settings_of

    require("jinja2", "ui", "hermes-memory ui")
    configure_logging(json=False, level="info")
    access = Access.for_bind(args.host, token_from_env(os.environ))
    settings = settings_of(args)
    from ..ui.server import serve_inspector

    server = serve_inspector(settings, args.host, args.port, access)
    url = f"{server.url}/ui"
    # One line a person or a script can read the address from.
    print(f"memory inspector for {settings.db_path} at {url} (Ctrl-C to stop)", flush=True)
    if args.open:
        import webbrowser

        webbrowser.open(url)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
    return EXIT_OK
