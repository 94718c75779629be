"""Hermes Agent's own session store (its ``state.db``) brought into this library's store:
``hermes-memory hermes import-state``. The file is left untouched.

    state.db ──► a snapshot in a temporary folder (SQLite's online backup from a read-only
                 connection: consistent even while Hermes writes it, and nothing of the file
                 changed, no journal mode switched)
             ──► Hermes's own ``SessionDB`` opens the snapshot: a file of an older Hermes is
                 brought up to date there, by Hermes's own migrations, in the copy
             ──► each session as Hermes exports it, with every message, the inactive ones
                 (rewound, compacted) too
             ──► this store's import (``sessions.transfer``), parents before children, in
                 parts that each commit whole

What Hermes hands over is stored as given (``hermes.import_lines.hermes_session_line``, the
conversion Hermes's own import payloads take through the facade, without its bounds: a
session of any size comes over). A session whose id the store holds already is skipped, so
a run cut short is finished by running it again, and a second run imports nothing.

Hermes's own module is used, not a copy of its SQL: when this library stands in for
``hermes_state`` (``hermes-memory hermes install --session-store``), Hermes's is loaded from
the installed hermes-agent by its file (``hermes_own_state``).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import sqlite3
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import quote

import anyio

from ..errors import ConfigurationError, StoreError
from ..pipeline import MemoryPipeline
from ..sessions.transfer import ImportLimits, import_sessions
from .import_lines import hermes_session_line

# One part of the import: this many sessions, or this many bytes of lines, whichever comes
# first (a part is one atomic import, held in memory once).
PART_SESSIONS = 200
PART_BYTES = 32 * 1024 * 1024
# No bound on one session: what Hermes holds comes over whole.
_UNBOUNDED = 2**62


@dataclass
class StateImport:
    """What an import of Hermes's ``state.db`` did: sessions found in it, imported, skipped
    (the store had them), messages imported, sessions imported without their parent (it
    was not in the file), and the parts it took."""

    found: int = 0
    imported: int = 0
    skipped: int = 0
    messages: int = 0
    detached: list[str] = field(default_factory=list)
    parts: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"found": self.found, "imported": self.imported, "skipped": self.skipped,
                "messages": self.messages, "detached": list(self.detached),
                "parts": self.parts}


def hermes_own_state() -> ModuleType:
    """Hermes Agent's own ``hermes_state`` module, even where this library stands in for it.

    Raises:
        ConfigurationError: hermes-agent is not installed in this Python.
    """
    try:
        module = importlib.import_module("hermes_state")
    except ImportError:
        module = None
    if module is not None and not getattr(module, "__name__", "").startswith(
            "hermes_async_memory"):
        return module
    try:
        path = Path(str(importlib.metadata.distribution("hermes-agent")
                        .locate_file("hermes_state.py")))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ConfigurationError(
            "reading Hermes's state.db takes Hermes Agent's own hermes_state module: install "
            "hermes-agent in this Python (the one Hermes runs in)")
    spec = importlib.util.spec_from_file_location("_hermes_agent_state", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def snapshot(source: Path, copy: Path) -> None:
    """Copy the SQLite file ``source`` to ``copy`` as one consistent state, through a
    read-only connection. Immutable (no locks, no -shm made beside it) only for a file in
    WAL mode with no write-ahead log there, which no process is writing; else it takes
    SQLite's shared lock, so a writer (Hermes falls back to a rollback journal where WAL
    does not work) cannot change it under the copy.

    Raises:
        StoreError: ``source`` is missing or cannot be read as SQLite.
    """
    if not source.is_file():
        raise StoreError(f"no Hermes session store at {source}")
    try:
        with source.open("rb") as f:
            header = f.read(20)
    except OSError as exc:
        raise StoreError(f"cannot read {source}: {exc}") from exc
    wal_mode = len(header) == 20 and header[18] == 2  # the file format's write version
    idle = wal_mode and not source.with_name(source.name + "-wal").exists()
    uri = f"file:{quote(str(source.resolve()))}?mode=ro{'&immutable=1' if idle else ''}"
    try:
        src = sqlite3.connect(uri, uri=True, timeout=30.0)
        try:
            dst = sqlite3.connect(copy)
            try:
                src.backup(dst)
            finally:
                dst.close()
        finally:
            src.close()
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read {source} as a Hermes session store: {exc}") from exc


def _check_hermes_file(copy: Path, source: Path) -> None:
    """That the snapshot of ``source`` holds Hermes's session store: its sessions and
    messages, and none of this library's own tables.

    Raises:
        StoreError: it does not (says what it is).
    """
    conn = sqlite3.connect(copy)
    try:
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master "
                                             "WHERE type = 'table'")}
    finally:
        conn.close()
    if "outbox" in tables:
        raise StoreError(f"{source} is a hermes-async-memory store, not Hermes's own session "
                         "store: nothing to import")
    if not {"sessions", "messages"} <= tables:
        raise StoreError(f"{source} is not Hermes's session store (no sessions and messages "
                         "tables)")


def parents_first(rows: Iterable[tuple[str, str | None]]) -> list[str]:
    """Session ids, each after its parent's when the parent is among them (in the given
    order otherwise; a cycle is cut where it closes): an import then finds every parent
    stored or beside it."""
    parent = dict(rows)
    order: list[str] = []
    placed: set[str] = set()
    for sid in parent:
        chain: list[str] = []
        seen: set[str] = set()
        node: str | None = sid
        while node is not None and node in parent and node not in placed and node not in seen:
            seen.add(node)
            chain.append(node)
            node = parent[node]
        for node in reversed(chain):
            placed.add(node)
            order.append(node)
    return order


def _parts(lines: Iterable[str]) -> Iterator[list[str]]:
    part: list[str] = []
    size = 0
    for line in lines:
        n = len(line.encode("utf-8", "surrogatepass"))
        if part and (len(part) >= PART_SESSIONS or size + n > PART_BYTES):
            yield part
            part, size = [], 0
        part.append(line)
        size += n
    if part:
        yield part


async def import_hermes_state(pipeline: MemoryPipeline, source: Path, *,
                              progress: Callable[[int, int], None] | None = None
                              ) -> StateImport:
    """Import every session of Hermes's session store at ``source`` into ``pipeline``'s
    store (see above); ``progress(done, found)`` after each part. Returns once every part
    is committed and counted in the store.

    Raises:
        StoreError: ``source`` cannot be read as Hermes's session store; a part could not
            be imported (what came before it is stored; running again goes on from there).
        ConfigurationError: hermes-agent is not installed.
        InvalidImportError: Hermes's export of a session is not one this store can hold
            (says which).
    """
    hermes = hermes_own_state()
    report = StateImport()
    with tempfile.TemporaryDirectory(prefix="hermes-state-import-") as folder:
        copy = Path(folder) / "state.db"
        await anyio.to_thread.run_sync(snapshot, source, copy)
        await anyio.to_thread.run_sync(_check_hermes_file, copy, source)
        try:
            db = await anyio.to_thread.run_sync(lambda: hermes.SessionDB(db_path=copy))
        except Exception as exc:  # Hermes's own open of the copy: whatever it raises
            raise StoreError(f"Hermes's SessionDB cannot open a copy of {source}: "
                             f"{type(exc).__name__}: {exc}") from exc
        try:
            conn = sqlite3.connect(copy)
            try:
                rows = conn.execute("SELECT id, parent_session_id FROM sessions "
                                    "ORDER BY started_at, id").fetchall()
            finally:
                conn.close()
            order = parents_first((str(r[0]), None if r[1] is None else str(r[1]))
                                  for r in rows)
            report.found = len(order)

            def exported() -> Iterator[str]:
                for sid in order:
                    session = db.get_session(sid)
                    if session is None:
                        continue
                    raw = {**session,
                           "messages": db.get_messages(sid, include_inactive=True)}
                    try:
                        line, _, _ = hermes_session_line(raw, sid, (), max_messages=None,
                                                         max_bytes=None, as_stored=True)
                    except ValueError as exc:
                        raise StoreError(f"session {sid!r} of {source} cannot be "
                                         f"imported: {exc}") from exc
                    yield line

            limits = ImportLimits(max_sessions=PART_SESSIONS, max_bytes=_UNBOUNDED,
                                  max_session_messages=_UNBOUNDED,
                                  max_session_bytes=_UNBOUNDED)
            parts = _parts(exported())
            while True:
                part = await anyio.to_thread.run_sync(next, parts, None)
                if part is None:
                    break
                result = await import_sessions(pipeline, part, limits=limits)
                report.imported += result.imported
                report.skipped += result.skipped
                report.messages += result.messages
                report.detached += result.detached
                report.parts += 1
                if progress is not None:
                    progress(report.imported + report.skipped, report.found)
        finally:
            await anyio.to_thread.run_sync(db.close)
    return report


__all__ = ["PART_BYTES", "PART_SESSIONS", "StateImport", "hermes_own_state",
           "import_hermes_state", "parents_first", "snapshot"]
