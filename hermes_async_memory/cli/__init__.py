"""The ``hermes-memory`` command.

    hermes-memory worker [--db PATH] [--deadline SECONDS] [--demo] [--log-format json|console]
    hermes-memory status                                      (cli.status)
    hermes-memory search                                      (cli.search)
    hermes-memory sessions list | show | conversation | chain | counts | export | import |
                           end | delete | prune               (cli.sessions)
    hermes-memory templates list | extract | show | test | delete | stats | export |
                            import                    (cli.templates)
    hermes-memory dead-letters list | replay                  (cli.dead_letters)
    hermes-memory eval                                        (cli.evaluate)
    hermes-memory db upgrade | status                         (cli.db)
    hermes-memory ui [--db PATH] [--host HOST] [--port PORT]  (cli.ui)
    hermes-memory hermes install                              (hermes.install)

Subcommands other than ``worker`` come from the modules in ``_COMMAND_MODULES``: each has a
``register(commands)`` that adds its parsers and sets ``handler`` (args -> exit code) as
their default. Those modules import only argparse at the top; what a command needs is
imported when it runs. Errors are one line on stderr: exit 2 for a usage or configuration
error (an invalid id or search included), 1 for a store or file-system error.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence

from ..errors import ConfigurationError, HermesMemoryError, InvalidTurnError

PROG = "hermes-memory"
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="An asyncio memory pipeline for AI agents: never blocks a turn, never "
                    "loses a turn.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    # The worker parses its own options (worker.main.build_parser), so they are defined once
    # for both `python -m workers` and `hermes-memory worker`.
    commands.add_parser(
        "worker", add_help=False,
        help="run the long-lived worker process (see: hermes-memory worker --help)",
        description="Run the long-lived worker process.",
    )
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``hermes-memory``; returns the exit code."""
    parser = build_parser()
    try:
        args, rest = parser.parse_known_args(argv)
        if args.command not in _FORWARDING and rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        if args.command in _FORWARDING:
            return _worker(args, rest)
        handler: Callable[[argparse.Namespace], int] = args.handler
        return handler(args)
    except SystemExit as exc:  # --help, or a usage error argparse has already printed
        return exit_code(exc)
    except (ConfigurationError, InvalidTurnError) as exc:  # what was asked cannot be done
        return fail(PROG, exc, EXIT_USAGE)
    except (HermesMemoryError, OSError) as exc:
        return fail(PROG, exc, EXIT_FAILURE)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def _worker(args: argparse.Namespace, rest: list[str]) -> int:
    from ..worker.main import main as worker_main

    return worker_main(rest, prog=f"{PROG} worker")


_COMMAND_MODULES = (
    "hermes_async_memory.cli.status",
    "hermes_async_memory.cli.search",
    "hermes_async_memory.cli.sessions",
    "hermes_async_memory.cli.templates",
    "hermes_async_memory.cli.dead_letters",
    "hermes_async_memory.cli.outbox",
    "hermes_async_memory.cli.evaluate",
    "hermes_async_memory.cli.db",
    "hermes_async_memory.cli.ui",
    "hermes_async_memory.hermes.install",
)
# Commands that hand their remaining arguments to a parser of their own.
_FORWARDING = frozenset({"worker"})


def fail(prog: str, exc: BaseException, code: int) -> int:
    """Print ``exc`` as one line on stderr and return ``code``."""
    message = " ".join(str(exc).split()) or type(exc).__name__
    print(f"{prog}: error: {message}", file=sys.stderr)
    return code


def exit_code(exc: SystemExit) -> int:
    """The exit status a ``SystemExit`` stands for."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return EXIT_FAILURE
