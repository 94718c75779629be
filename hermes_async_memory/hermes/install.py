"""``hermes-memory hermes install``: write the plugin folder Hermes Agent loads, and with
``--session-store`` make this library Hermes's session store too.

    hermes-memory hermes install [--hermes-home DIR] [--force]
                                 [--session-store | --no-session-store]
    hermes-memory hermes import-state [--hermes-home DIR] [--from PATH] [--db PATH] [--json]

writes ``$HERMES_HOME/plugins/hermes_async_memory/{__init__.py,plugin.yaml}``. Hermes loads it
when ``memory.provider: hermes_async_memory`` is set in ``$HERMES_HOME/config.yaml``. Its
loader wants, in ``__init__.py``, the text ``MemoryProvider`` or ``register_memory_provider``
within the first 8 KB, and a ``register(ctx)`` function (or a ``MemoryProvider`` subclass);
``plugin.yaml`` gives the description ``hermes memory setup`` lists, and ``kind: exclusive``
keeps Hermes's general plugin manager from loading the folder as an ordinary plugin.

``--session-store`` points every ``import hermes_state`` of this Python environment at
``hermes_async_memory.hermes.state``: a one-line ``.pth`` file in its site-packages puts
``$HERMES_HOME/session_store/`` first on ``sys.path`` at start-up, and the ``hermes_state.py``
there hands the import over to our module. Hermes's own module is left installed;
``--no-session-store`` removes the ``.pth`` file and Hermes uses it again.

Only argparse is imported at start-up; the command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
from typing import Any

# Written into the generated __init__.py; a folder whose __init__.py lacks it is not ours.
MARKER = "Written by `hermes-memory hermes install`"

INIT_TEMPLATE = '''"""hermes-async-memory as a Hermes Agent memory provider.

{marker} (hermes-async-memory {version}); reinstall to refresh.
Enable it with ``memory.provider: {name}`` in $HERMES_HOME/config.yaml. The package must be
installed in the Python environment Hermes Agent runs in.
"""

from hermes_async_memory.hermes.plugin import HermesMemoryProvider, register

__all__ = ["HermesMemoryProvider", "register"]  # register(ctx) -> ctx.register_memory_provider
'''

YAML_TEMPLATE = """# {marker} (hermes-async-memory {version})
name: {name}
version: {version}
description: >-
  hermes-async-memory: local SQLite memory; turns are durable without blocking the
  agent, group-committed, with BM25 recall prefetched before each turn.
kind: exclusive
pip_dependencies:
  - hermes-async-memory
hooks:
  - on_turn_start
  - on_session_end
  - on_session_switch
  - on_pre_compress
  - on_delegation
  - on_memory_write
"""


# The session store's switch: a .pth file in site-packages, and the module it puts first.
PTH_NAME = "hermes_async_memory_session_store.pth"
STATE_TEMPLATE = '''"""Hermes Agent's session store, answered by hermes-async-memory.

{marker} --session-store (hermes-async-memory {version}); remove with
`hermes-memory hermes install --no-session-store`.
"""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("hermes_async_memory.hermes.state")
'''
PTH_TEMPLATE = "import sys; sys.path.insert(0, {folder!r})  # {marker} --session-store\n"


def register(commands: Any) -> None:
    """Add ``hermes`` to ``commands`` (argparse sub-parsers)."""
    hermes = commands.add_parser(
        "hermes", help="Hermes Agent integration (install the memory-provider plugin)",
        description="Hermes Agent integration.",
    ).add_subparsers(dest="hermes_command", metavar="ACTION", required=True)
    install = hermes.add_parser(
        "install", help="write the memory-provider plugin folder into HERMES_HOME",
        description="Write $HERMES_HOME/plugins/hermes_async_memory/ (__init__.py and "
                    "plugin.yaml). Then set memory.provider: hermes_async_memory in "
                    "$HERMES_HOME/config.yaml (hermes config set memory.provider "
                    "hermes_async_memory).",
    )
    install.add_argument(
        "--hermes-home", metavar="DIR", default=None,
        help="the Hermes home (default: as Hermes Agent resolves it: $HERMES_HOME, else "
             "~/.hermes)",
    )
    install.add_argument(
        "--force", action="store_true",
        help="replace a plugin folder of the same name that this command did not write",
    )
    store = install.add_mutually_exclusive_group()
    store.add_argument(
        "--session-store", dest="session_store", action="store_const", const=True,
        help="also make hermes-async-memory Hermes's session store (hermes_state.SessionDB) "
             "in this Python environment",
    )
    store.add_argument(
        "--no-session-store", dest="session_store", action="store_const", const=False,
        help="give Hermes its own session store back in this Python environment",
    )
    install.add_argument(
        "--site-packages", metavar="DIR", default=None,
        help="where the session store's .pth file goes (default: this Python's site-packages)",
    )
    install.set_defaults(handler=_install, session_store=None)
    state = hermes.add_parser(
        "import-state", help="bring Hermes's own session store (state.db) into this store",
        description="Import every session of Hermes Agent's own session store (its state.db, "
                    "of any version Hermes 0.19 opens) into this library's store, which "
                    "Hermes uses after `hermes-memory hermes install --session-store`. The "
                    "state.db is left untouched (read through a snapshot); sessions the store "
                    "has already are skipped, so running it again finishes a run cut short.",
    )
    state.add_argument(
        "--hermes-home", metavar="DIR", default=None,
        help="the Hermes home (default: $HERMES_HOME, else ~/.hermes)",
    )
    state.add_argument(
        "--from", dest="source", metavar="PATH", default=None,
        help="Hermes's session store (default: state.db in the Hermes home)",
    )
    state.add_argument(
        "--db", metavar="PATH", default=None,
        help="this library's store (default: the one Hermes's sessions live in with "
             "--session-store, memory/hermes_async_memory.db in the Hermes home)",
    )
    state.add_argument("--json", action="store_true", help="print JSON")
    state.set_defaults(handler=_import_state)


def _import_state(args: argparse.Namespace) -> int:
    import sys
    from pathlib import Path

    import anyio

    from ..cli.common import print_json, writing
    from ..errors import StoreError
    from ..logs import configure_logging
    from ..settings import Settings
    from .config import DEFAULT_DB, default_hermes_home
    from .migrate import import_hermes_state

    configure_logging(level="warning")  # stdout is the report's; warnings go to stderr
    home = Path(args.hermes_home).expanduser() if args.hermes_home else default_hermes_home()
    source = Path(args.source).expanduser() if args.source else home / "state.db"
    target = Path(args.db).expanduser() if args.db else home / DEFAULT_DB
    if not source.is_file():  # before the store is made or opened
        raise StoreError(f"no Hermes session store at {source} (give --from PATH)")
    show = sys.stderr.isatty() and not args.json

    def progress(done: int, found: int) -> None:
        if show:
            print(f"\r{done:,} of {found:,} sessions", end="", file=sys.stderr, flush=True)

    async def run() -> dict[str, object]:
        async with writing(Settings.from_env(db_path=target)) as mem:
            return (await import_hermes_state(mem, source, progress=progress)).as_dict()

    done = anyio.run(run)
    if show:
        print(file=sys.stderr)
    if args.json:
        print_json({**done, "from": str(source), "db": str(target)})
        return 0
    detached = done["detached"]
    assert isinstance(detached, list)
    print(f"imported {done['imported']} of {done['found']} sessions ({done['messages']} "
          f"messages) from {source} into {target}; {done['skipped']} already there, "
          f"skipped; {source} is unchanged"
          + (f"; {len(detached)} imported without their parent (not in the file): "
             f"{', '.join(detached)}" if detached else ""))
    return 0


def _install(args: argparse.Namespace) -> int:
    import importlib.util
    import os
    import sys
    from pathlib import Path

    from .. import __version__
    from ..errors import ConfigurationError
    from .config import PROVIDER_NAME, default_hermes_home

    home = Path(args.hermes_home).expanduser() if args.hermes_home else default_hermes_home()
    if home.exists() and not home.is_dir():
        raise ConfigurationError(f"the Hermes home {home} is not a directory")
    folder = home / "plugins" / PROVIDER_NAME
    init_file, yaml_file = folder / "__init__.py", folder / "plugin.yaml"
    if init_file.exists() and not args.force:
        head = init_file.read_text(encoding="utf-8", errors="replace")[:8192]
        if MARKER not in head:
            raise ConfigurationError(
                f"{init_file} exists and was not written by this command; use --force to "
                "replace it"
            )
    fields = {"marker": MARKER, "version": __version__, "name": PROVIDER_NAME}
    folder.mkdir(parents=True, exist_ok=True)
    for path, text in ((init_file, INIT_TEMPLATE), (yaml_file, YAML_TEMPLATE)):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text.format(**fields), encoding="utf-8")
        os.replace(tmp, path)  # Hermes never reads half a file
    print(f"wrote {init_file}")
    print(f"wrote {yaml_file}")
    print(f"enable it: set memory.provider: {PROVIDER_NAME} in {home / 'config.yaml'}")
    print(f"  (or: HERMES_HOME={home} hermes config set memory.provider {PROVIDER_NAME})")
    if args.session_store is not None:
        _session_store(home, fields, on=args.session_store, site_packages=args.site_packages)
    if importlib.util.find_spec("hermes_constants") is None:  # a top-level module of hermes-agent
        print(
            f"note: hermes-agent is not installed in this Python ({sys.executable}); "
            "hermes-async-memory must be installed where Hermes Agent runs",
            file=sys.stderr,
        )
    return 0


def _session_store(home: Any, fields: dict[str, str], *, on: bool,
                   site_packages: str | None = None) -> None:
    """Write (or remove) the switch that hands ``import hermes_state`` to our module."""
    import os
    import sysconfig
    from pathlib import Path

    from .config import DEFAULT_DB, PROVIDER_NAME

    site = Path(site_packages) if site_packages else Path(sysconfig.get_paths()["purelib"])
    pth = site / PTH_NAME
    if not on:
        pth.unlink(missing_ok=True)
        print(f"removed {pth}: Hermes uses its own session store (state.db) again")
        return
    folder = Path(home) / "session_store"
    folder.mkdir(parents=True, exist_ok=True)
    for path, text in ((folder / "hermes_state.py", STATE_TEMPLATE.format(**fields)),
                       (pth, PTH_TEMPLATE.format(folder=str(folder), **fields))):
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
        print(f"wrote {path}")
    print(f"Hermes's sessions now live in {Path(home) / DEFAULT_DB} (with the "
          f"{PROVIDER_NAME} memory); its own state.db is left as it was")
