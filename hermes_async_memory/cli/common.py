"""What the commands that look into a memory file share: options, settings, the read-only
store, and plain-text output.

Every such command takes ``--db PATH`` (default: ``Settings.from_env().db_path``). Reads go
through ``store.inspect.StoreReader`` (status, dead letters) or the session store's reads on
the file (``session_reads``); both open the file read-only and take no lock, so they work
beside a running worker. Writes go through the durable path (``sessions``), or the store's
own transactions (``dead-letters replay``). Only argparse and the standard library are
imported here at start-up; a command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from . import EXIT_FAILURE, EXIT_USAGE, PROG, fail

if TYPE_CHECKING:
    from ..pipeline import MemoryPipeline
    from ..sessions.reads import FileSessionReads
    from ..settings import Settings
    from ..store.inspect import StoreReader
    from ..templates.store import TemplateReads

EXIT_OK = 0
ERROR_PREVIEW_CHARS = 100

Handler = Callable[[argparse.Namespace], int]


def db_option() -> argparse.ArgumentParser:
    """A parent parser with ``--db PATH``."""
    db = argparse.ArgumentParser(add_help=False)
    db.add_argument(
        "--db", type=Path, metavar="PATH",
        help="the store file (default: $HERMES_MEMORY_DB_PATH, else memory.db in the user "
             "data directory)",
    )
    return db


def json_option() -> argparse.ArgumentParser:
    """A parent parser with ``--json``."""
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON")
    return as_json


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def guarded(handler: Handler) -> Handler:
    """``handler``, quiet when the reader of its output goes away (``... | head``)."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except BrokenPipeError:
            # Point stdout at /dev/null, so the interpreter's last flush does not fail again.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return EXIT_FAILURE

    return run


def usage_error(message: str) -> int:
    return fail(PROG, ValueError(message), EXIT_USAGE)


def store_error(message: str) -> Exception:
    from ..errors import StoreError

    return StoreError(message)


def settings_of(args: argparse.Namespace) -> Settings:
    """The settings from the environment, ``--db`` first.

    Raises:
        ConfigurationError: an environment variable does not parse.
    """
    from ..settings import Settings

    if args.db is not None:
        return Settings.from_env(db_path=args.db)
    return Settings.from_env()


def open_reader(settings: Settings) -> StoreReader:
    """The store file, read-only, checked to be a store of ours.

    Raises:
        StoreError: no such file, not an SQLite file, or not a hermes-memory store.
    """
    from ..store.inspect import StoreReader

    if not settings.db_path.exists():
        raise store_error(f"no memory store at {settings.db_path} (give --db PATH or set "
                          "HERMES_MEMORY_DB_PATH)")
    return StoreReader(settings.db_path, busy_timeout_ms=settings.busy_timeout_ms)


def session_reads(settings: Settings) -> AbstractAsyncContextManager[FileSessionReads]:
    """The session store's reads on the store file, read-only (``open_session_reads``).

    Raises:
        StoreError: no such file, not a store of ours, another version, unreadable.
    """
    from ..sessions.reads import open_session_reads

    if not settings.db_path.exists():
        raise store_error(f"no memory store at {settings.db_path} (give --db PATH or set "
                          "HERMES_MEMORY_DB_PATH)")
    return open_session_reads(settings.db_path, busy_timeout_ms=settings.busy_timeout_ms)


def template_reads(settings: Settings) -> AbstractAsyncContextManager[TemplateReads]:
    """The templates' reads on the store file, read-only (``open_template_reads``).

    Raises:
        StoreError: no such file, not a store of ours, another version, unreadable.
    """
    from ..templates.store import open_template_reads

    if not settings.db_path.exists():
        raise store_error(f"no memory store at {settings.db_path} (give --db PATH or set "
                          "HERMES_MEMORY_DB_PATH)")
    return open_template_reads(settings.db_path, settings.templates,
                               busy_timeout_ms=settings.busy_timeout_ms)


@asynccontextmanager
async def writing(settings: Settings) -> AsyncIterator[MemoryPipeline]:
    """The store's pipeline for a write; when a worker process holds the store's outbox, a
    producer that hands the write to that worker through the shared inbox."""
    from ..outbox.log import OutboxBusyError
    from ..pipeline import MemoryPipeline

    try:
        pipeline = MemoryPipeline(settings)
        await pipeline.start()
    except OutboxBusyError:
        pipeline = MemoryPipeline(settings.replace(role="producer"))
        await pipeline.start()
    try:
        yield pipeline
    finally:
        await pipeline.aclose()


def when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ts))


def age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def one_line(text: str | None, width: int) -> str:
    flat = " ".join((text or "").split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def print_json(value: object) -> None:
    print(json.dumps(value, ensure_ascii=False, indent=2))


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Columns padded to their widest cell; the last column is left as it is."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=False)] + [row[-1]]
        print("  ".join(cells).rstrip())
