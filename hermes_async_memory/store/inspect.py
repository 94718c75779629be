"""A read-only look into a store file's state (status, dead letters), for the admin CLI.

``StoreReader`` is synchronous: a command-line tool runs one read at a time, and an event
loop would only add a thread hop per read. It opens the file with ``mode=ro``, so it never
creates a file, never adds tables or columns to one (``SqliteStore.open`` does both), and
takes no write lock: it works beside a running worker. Reads inside ``snapshot()`` see one
consistent state of the store however long they take; each method that returns several
figures takes its own snapshot.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

from ..errors import StoreError
from .schema import REQUIRED_TABLES, SCHEMA_VERSION
from .sql import KEY_CHUNK
from .text_index import Reindex

# The tables every store has had; the inbox and replica outbox came later and may be missing.


@dataclass
class StoreStatus:
    """The store's counts, read in one snapshot."""

    messages: int
    sessions: int
    outbox_table: dict[str, int]  # the outbox table's rows by status ('done', 'dead', ...)
    settled_keys: set[str]  # of the keys asked about, those stored, dead or in the inbox
    inbox_turns: int = 0
    inbox_oldest: float | None = None  # when the oldest inbox turn was accepted
    # Per replica backend: {"pending": turns it lacks, "dead": its dead letters}.
    replicas: dict[str, dict[str, int]] = field(default_factory=dict)
    # The word index's rebuild after an upgrade (text_index), while one is under way.
    reindex: Reindex | None = None
    # Since when the full-text indexes are not kept (a process without FTS5 committed the
    # store: text_index), or None while they are.
    full_text_off_since: float | None = None


class StoreReader:
    """A read-only connection to a store file, checked to be a store of ours.

    Use it as a context manager (``with StoreReader(path) as reader:``) or ``close()`` it.
    Every method raises ``StoreError`` when the file cannot be read.
    """

    def __init__(self, path: Path, *, busy_timeout_ms: int = 10_000) -> None:
        """Open ``path`` read-only.

        Raises:
            StoreError: no such file, not an SQLite file, or not a hermes-memory store.
        """
        self.path = Path(path)
        if not self.path.exists():
            raise StoreError(f"no memory store at {self.path}")
        if not self.path.is_file():
            raise StoreError(f"{self.path} is not a file")
        uri = "file:" + quote(str(self.path.resolve())) + "?mode=ro"
        try:
            self._conn = sqlite3.connect(uri, uri=True, isolation_level=None)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot open {self.path}: {exc}") from exc
        self._conn.row_factory = sqlite3.Row  # rows read as dicts by column name
        try:
            with self._reading():
                self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout_ms)}")
                self._tables = {r[0] for r in self._conn.execute(
                    "SELECT name FROM sqlite_master")}
                missing = [t for t in REQUIRED_TABLES if t not in self._tables]
                if missing:
                    raise StoreError(f"{self.path} is not a hermes-memory store (no table "
                                     f"{', '.join(missing)})")
                row = self._conn.execute("SELECT max(version) FROM schema_version").fetchone()
                if row and row[0] is not None and row[0] > SCHEMA_VERSION:
                    raise StoreError(f"{self.path} has schema version {row[0]}; this version "
                                     f"of hermes-memory knows {SCHEMA_VERSION}")
        except BaseException:
            self._conn.close()
            raise

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    @contextlib.contextmanager
    def _reading(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read {self.path}: {exc}") from exc

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[None]:
        """Reads inside see one consistent state of the store (nested: the outer one's)."""
        if self._conn.in_transaction:
            yield
            return
        with self._reading():
            self._conn.execute("BEGIN")
        try:
            yield
        except BaseException:
            # A read transaction has nothing to undo: a failed ROLLBACK loses nothing, and
            # the error in flight is the one to report.
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")
            raise
        with self._reading():
            self._conn.execute("COMMIT")

    def _rows(self, sql: str, params: Sequence[object] = ()) -> list[dict[str, Any]]:
        with self._reading():
            return [dict(r) for r in self._conn.execute(sql, params)]

    def _value(self, sql: str, params: Sequence[object] = ()) -> Any:
        with self._reading():
            row = self._conn.execute(sql, params).fetchone()
        return None if row is None else row[0]

    # -- status --------------------------------------------------------------------------

    def status(self, keys: Sequence[str] = ()) -> StoreStatus:
        """The counts, and which of ``keys`` (turn keys found in an outbox) are settled: all
        in one snapshot, so a turn is never counted both as waiting and as stored."""
        with self.snapshot(), self._reading():
            by_status = {str(r[0]): int(r[1]) for r in self._conn.execute(
                "SELECT status, count(*) FROM outbox GROUP BY status")}
            status = StoreStatus(
                messages=int(self._value("SELECT count(*) FROM messages")),
                sessions=int(self._value("SELECT count(*) FROM sessions")),
                outbox_table=by_status, settled_keys=self._settled(list(keys)))
            # Turns producers handed to the shared inbox wait there for a worker.
            if "inbox" in self._tables:
                row = self._conn.execute(
                    "SELECT count(*), min(accepted_at) FROM inbox").fetchone()
                status.inbox_turns, status.inbox_oldest = int(row[0]), row[1]
            if "replica_outbox" in self._tables:
                for backend, state, n in self._conn.execute(
                        "SELECT backend, status, count(*) FROM replica_outbox "
                        "GROUP BY backend, status ORDER BY backend"):
                    status.replicas.setdefault(backend, {"pending": 0, "dead": 0})[state] = n
            if "index_rebuild" in self._tables:
                row = self._conn.execute(
                    "SELECT indexed, total, started_at FROM index_rebuild "
                    "WHERE name = 'messages_fts'").fetchone()
                if row is not None:
                    status.reindex = Reindex(int(row[0]), int(row[1]), float(row[2]))
            if "text_index_off" in self._tables:
                since = self._value("SELECT min(since) FROM text_index_off")
                status.full_text_off_since = None if since is None else float(since)
        return status

    def _settled(self, keys: list[str]) -> set[str]:
        """Which of these keys the store holds as done or dead, or holds in its inbox."""
        tables = ["outbox"] + (["inbox"] if "inbox" in self._tables else [])
        found: set[str] = set()
        for i in range(0, len(keys), KEY_CHUNK):
            chunk = keys[i : i + KEY_CHUNK]
            marks = ",".join("?" * len(chunk))
            for table in tables:
                found.update(r[0] for r in self._conn.execute(
                    f"SELECT key FROM {table} WHERE key IN ({marks})", chunk))
        return found

    # -- dead letters --------------------------------------------------------------------

    def dead_letters(self, limit: int) -> tuple[int, list[dict[str, Any]]]:
        """How many turns the store dead-lettered, and the oldest ``limit`` of them."""
        with self.snapshot():
            total = int(self._value("SELECT count(*) FROM outbox WHERE status = 'dead'"))
            rows = self._rows(
                "SELECT key, session_id, attempts, last_error, accepted_at, updated_at "
                "FROM outbox WHERE status = 'dead' ORDER BY updated_at, key LIMIT ?", (limit,))
        return total, rows

    def dead_letter_keys(self) -> list[str]:
        """Every dead-lettered turn's key, oldest first."""
        return [r["key"] for r in self._rows(
            "SELECT key FROM outbox WHERE status = 'dead' ORDER BY updated_at, key")]

    def replica_dead_letters(self, backend: str, limit: int
                             ) -> tuple[int, list[dict[str, Any]]]:
        """How many turns ``backend`` refused or never took, and the first ``limit``."""
        if "replica_outbox" not in self._tables:
            return 0, []
        where = "FROM replica_outbox WHERE status = 'dead' AND backend = ?"
        with self.snapshot():
            total = int(self._value(f"SELECT count(*) {where}", (backend,)))
            rows = self._rows(
                f"SELECT turn_key AS key, session_id, attempts, last_error, updated_at {where} "
                "ORDER BY id LIMIT ?", (backend, limit))
        return total, rows

    def replica_dead_counts(self) -> list[tuple[str, int]]:
        """Dead letters per replica backend, by name (none in a store from before replica
        outboxes)."""
        if "replica_outbox" not in self._tables:
            return []
        return [(str(r["backend"]), int(r["n"])) for r in self._rows(
            "SELECT backend, count(*) AS n FROM replica_outbox WHERE status = 'dead' "
            "GROUP BY backend ORDER BY backend")]

