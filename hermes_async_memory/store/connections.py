"""The store's connections: opening the file (mode 0600, pragmas, typed errors), one writer
for the batches, an auxiliary writer for small writes beside them, a pool of readers, and a
close that keeps its deadline.

Every await on aiosqlite is a hop to its connection thread: callers send a batch as a
handful of statements, never one await per row.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiosqlite
import anyio
import structlog

from ..errors import (
    CorruptStoreError,
    DiskFullError,
    ForeignStoreError,
    FullTextUnavailableError,
    StoreAccessError,
    StoreError,
)
from ..faults import (
    SQLITE_CANTOPEN,
    SQLITE_CORRUPT,
    SQLITE_FULL,
    SQLITE_NOTADB,
    SQLITE_PERM,
    SQLITE_READONLY,
    sqlite_code,
)
from ..message_ids import MessageIds
from .schema import check_current, check_tables, migrate, settle_text_indexes
from .text_index import (
    TEXT_SINKS,
    Reindex,
    is_missing_fts5,
    text_indexes_kept,
    word_reindex_state,
)
from .tool_log import OUTCOME_FUNCTION, ToolLogConfig, outcome_function

log = structlog.get_logger(__name__)

# The pipeline's writing connections wait this long for the write lock per statement, then
# the pipeline retries with backoff itself: SQLite's interrupt() does not break a busy wait,
# so a long busy timeout would hold every shutdown deadline hostage.
STATEMENT_BUSY_MS = 100
_SQLITE_MAGIC = b"SQLite format 3\x00"


# The messages' full-text indexes (``text_index``), as ``optimize_text_indexes`` merges them.
MESSAGE_INDEXES = ("messages_fts", "messages_tools", "messages_trgm")

# The tables a store of ours has; a SQLite file with tables but not these is someone else's.
_OUR_TABLES = ("schema_version", "outbox", "sessions", "messages")


def check_store_file(path: Path) -> None:
    """Refuse a SQLite file that is not a store of ours (Hermes Agent's own state.db, say),
    without changing it: read-only, no journal mode switched, nothing created.

    Raises:
        ForeignStoreError: the file holds tables and is not a store of ours.
        CorruptStoreError: it is not a SQLite database at all.
    """
    try:
        if not path.is_file() or path.stat().st_size == 0:
            return
        with path.open("rb") as f:
            head = f.read(len(_SQLITE_MAGIC))
    except OSError as exc:
        raise _os_error(path, exc) from exc
    if head != _SQLITE_MAGIC:
        raise CorruptStoreError(path, "the file is not a SQLite database")
    # Read-only, and immutable when no write-ahead log is there: even a read-only connection
    # to a database in WAL mode creates its -wal and -shm files otherwise.
    wal = path.with_name(path.name + "-wal").exists()
    try:
        conn = sqlite3.connect(f"file:{quote(str(path))}?mode=ro{'' if wal else '&immutable=1'}",
                               uri=True, timeout=10.0)
        try:
            tables = {r[0] for r in conn.execute(
                "SELECT name FROM sqlite_master WHERE type IN ('table', 'view')")}
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise CorruptStoreError(path, str(exc)) from exc
    if tables and not all(t in tables for t in _OUR_TABLES):
        what = ("Hermes Agent's own session store" if {"state_meta", "sessions", "messages"}
                <= tables else "another program's SQLite database")
        hint = (f"; `hermes-memory hermes import-state --from {path}` brings its sessions "
                "into a store of ours" if what.startswith("Hermes") else "")
        raise ForeignStoreError(
            f"{path} is {what}, not a hermes-async-memory store; it was left untouched "
            f"(choose another file for the store{hint})")


class Connections:
    """The connections to one store file, and the settings every part of the store shares.
    ``open()`` before use, ``aclose()`` after."""

    def __init__(self, path: Path, *, readers: int = 2, busy_timeout_ms: int = 10_000,
                 source: str = "api", statement_busy_ms: int = STATEMENT_BUSY_MS,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self._readers_n = readers
        self._busy_timeout_ms = busy_timeout_ms
        self._statement_busy_ms = min(statement_busy_ms, busy_timeout_ms)
        self.now = wall_clock
        self.source = source
        self._writer: aiosqlite.Connection | None = None
        # Small autocommit writes beside the writer's batches (recall requests and results),
        # so they never land inside a batch's open transaction.
        self._aux: aiosqlite.Connection | None = None
        self._aux_lock = asyncio.Lock()
        self._readers: asyncio.Queue[aiosqlite.Connection] = asyncio.Queue()
        self._all_readers: list[aiosqlite.Connection] = []
        self.frequent_terms: frozenset[str] = frozenset()
        self._frequent_args: tuple[int, float] | None = None
        # Whether the word index the searches read stems its words (version 12); until then
        # the rebuild under way (``text_index``), else None.
        self.word_index_stems = True
        self.reindex: Reindex | None = None
        # Whether the full-text indexes are kept (False: this SQLite has no FTS5, or, for a
        # reader, the writer's has none; ``text_index``): searches then raise
        # FullTextUnavailableError, recalls find nothing.
        self.full_text = True
        # The replica backend whose outbox each commit fills (None: no backend).
        self.replica: str | None = None
        # Whether key-value records go to that backend too (the Honcho key-value backend).
        self.replica_kv = False
        # Whether template records go to that backend too (``Backend.mirrors_templates``).
        self.replica_templates = False
        # What commits do with tool calls (procedural memory); None: they are not logged.
        # Set before open(): the writer connection registers its outcome function.
        self.tool_log: ToolLogConfig | None = None
        # The message ids of this store's commits (and, through the outbox, of its accepts):
        # set above the highest stored at open.
        self.ids = MessageIds()
        # Told when a read finds the file damaged (the pipeline goes to its failed state).
        self.on_corrupt: Callable[[CorruptStoreError], None] | None = None

    # -- life cycle --------------------------------------------------------------------

    async def open(self, *, commits: bool = True) -> None:
        """Create or open the file (mode 0600), its schema and its full-text indexes
        (``schema.settle_text_indexes``). ``commits``: this process commits the store; a
        pipeline opens with False, and calls ``settle_text_indexes`` once it holds the
        outbox's lock (a producer never does).

        Raises:
            StoreError: the file cannot be opened or is not a store of ours.
        """
        try:
            _check_folder(self.path)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.is_dir():
                raise StoreAccessError(f"cannot use the store {self.path}: it is a directory")
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                head = os.read(fd, len(_SQLITE_MAGIC))
            finally:
                os.close(fd)
            if head and not _SQLITE_MAGIC.startswith(head[: len(_SQLITE_MAGIC)]):
                raise CorruptStoreError(self.path, "the file is not a SQLite database")
            os.chmod(self.path, 0o600)
        except OSError as exc:
            raise _os_error(self.path, exc) from exc
        await anyio.to_thread.run_sync(check_store_file, self.path)
        try:
            # The whole busy timeout while the schema is brought up to date: a writer another
            # process (or an abandoned close of this one) still has in a transaction holds
            # the file for a moment, which a start waits out. Its statements get the short one.
            self._writer = await self._connect()
            if self.tool_log is not None:
                log_config = self.tool_log
                await self._writer.create_function(
                    OUTCOME_FUNCTION, 1, outcome_function(log_config.rules, log_config.errors),
                    deterministic=True)
            await migrate(self._writer, self.path, self.tool_log)
            await self._settle_indexes(commits=commits)
            for _ in range(self._readers_n):
                conn = await self._connect(readonly=True)
                self._all_readers.append(conn)
                self._readers.put_nowait(conn)
            await check_tables(self._writer)
            async with self._writer.execute(
                    "SELECT max(coalesce((SELECT max(id) FROM messages), 0), "
                    "coalesce((SELECT max(high) FROM message_id_high), 0))") as cur:
                row = await cur.fetchone()
            self.ids.start_after(int(row[0]) if row else 0)
            await self._writer.execute(f"PRAGMA busy_timeout = {int(self._statement_busy_ms)}")
        except (sqlite3.Error, OSError) as exc:
            await self.aclose()
            code = sqlite_code(exc)
            if code in (SQLITE_CORRUPT, SQLITE_NOTADB):
                raise CorruptStoreError(self.path, str(exc)) from exc
            if code == SQLITE_FULL:
                raise DiskFullError(f"no space left for the store {self.path}: {exc}") from exc
            if isinstance(exc, OSError):
                raise _os_error(self.path, exc) from exc
            if code in (SQLITE_READONLY, SQLITE_CANTOPEN, SQLITE_PERM) or (
                    code is None and isinstance(exc, sqlite3.OperationalError) and any(
                        t in str(exc) for t in ("readonly", "unable to open", "read-only"))):
                raise StoreAccessError(f"cannot write the store {self.path}: {exc}") from exc
            raise StoreError(f"cannot open the store {self.path}: {exc}") from exc
        except BaseException:
            await self.aclose()
            raise

    async def settle_text_indexes(self) -> None:
        """For the process that commits the store, once it holds the outbox's lock: bring
        the full-text indexes in line with this SQLite (``schema.settle_text_indexes``).

        Raises:
            StoreError: the file cannot be read or written.
        """
        if self.full_text:
            return  # made and kept already, at open
        try:
            await self._settle_indexes(commits=True)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot set up the full-text indexes of {self.path}: "
                             f"{exc}") from exc

    async def _settle_indexes(self, *, commits: bool) -> None:
        self.full_text = await settle_text_indexes(self.writer, commits=commits)
        if not self.full_text and commits:
            log.warning("store_full_text_unavailable", db=str(self.path),
                        reason="this SQLite has no FTS5 module: writes go on, searches "
                               "and recalls find nothing until a process with FTS5 commits "
                               "the store (it rebuilds the indexes)")
        self.reindex = await word_reindex_state(self.writer)
        self.word_index_stems = self.reindex is None

    async def open_readonly(self) -> None:
        """Open the file for reads only: its readers (``mode=ro``), no writer, no migration,
        no lock, so a tool can read beside the pipeline or worker that writes it. The file
        must be a store of this version (an older one is brought up to date by the next
        ``open()``).

        Raises:
            StoreError: no such file, not a store of ours, another version, or unreadable.
        """
        if not self.path.is_file():
            raise StoreError(f"no memory store at {self.path}")
        uri = "file:" + quote(str(self.path.resolve())) + "?mode=ro"
        try:
            for _ in range(self._readers_n):
                conn = await connect_daemon(uri, uri=True, isolation_level=None)
                self._all_readers.append(conn)
                self._readers.put_nowait(conn)
                await conn.execute(f"PRAGMA busy_timeout = {int(self._busy_timeout_ms)}")
            await check_current(self._all_readers[0], self.path)
            self.full_text = await text_indexes_kept(self._all_readers[0])
            self.reindex = await word_reindex_state(self._all_readers[0])
            self.word_index_stems = self.reindex is None
        except sqlite3.Error as exc:
            await self.aclose()
            if sqlite_code(exc) in (SQLITE_CORRUPT, SQLITE_NOTADB):
                raise CorruptStoreError(self.path, str(exc)) from exc
            raise StoreError(f"cannot read the store {self.path}: {exc}") from exc
        except BaseException:
            await self.aclose()
            raise

    async def _connect(self, *, readonly: bool = False, busy_ms: int | None = None
                       ) -> aiosqlite.Connection:
        conn = await aiosqlite.connect(self.path, isolation_level=None)
        try:
            busy = self._busy_timeout_ms if busy_ms is None else busy_ms
            await conn.execute(f"PRAGMA busy_timeout = {int(busy)}")
            await conn.execute("PRAGMA journal_mode = WAL")
            await conn.execute("PRAGMA synchronous = NORMAL")
            # Temporary tables and sorts in memory: a batch's tool-call log fills and empties
            # its temporary tables every commit (on a file they took ~10 % of its time).
            await conn.execute("PRAGMA temp_store = MEMORY")
            if readonly:
                await conn.execute("PRAGMA query_only = 1")
            elif not self.full_text:  # its fills go nowhere, as the writer's
                await conn.executescript(TEXT_SINKS)
        except BaseException:
            # Its thread is not a daemon: left open, it would keep the process alive. The
            # error that brought us here is the one raised; a failed close is only logged.
            try:
                await conn.close()
            except (sqlite3.Error, ValueError):
                log.warning("store_connect_cleanup_failed", db=str(self.path), exc_info=True)
            raise
        return conn

    async def checkpoint(self) -> bool:
        """Copy the WAL into the database and truncate it: gives back the space the WAL grew
        to (after a full disk, say). Returns False when a reader kept it from finishing."""
        async with self.writer.execute("PRAGMA wal_checkpoint(TRUNCATE)") as cur:
            row = await cur.fetchone()
        return row is not None and row[0] == 0

    async def set_autocheckpoint(self, pages: int) -> None:
        """Checkpoint the WAL after each commit that leaves it ``pages`` long (SQLite's own
        default is 1,000: 4 MiB, more than a nearly full disk may hold)."""
        await self.writer.execute(f"PRAGMA wal_autocheckpoint = {int(pages)}")

    async def optimize_text_indexes(self) -> list[str]:
        """Merge each full-text index of the messages (the word, tool and trigram indexes
        this file has) into one segment: FTS5's ``optimize``, layout only (what a search
        finds is unchanged). On a connection of its own, each index in a transaction of
        its own: the writer's commits wait for one, then go on. Returns the indexes merged.

        Raises:
            sqlite3.Error: the file cannot be written.
        """
        merged: list[str] = []
        if not self.full_text:
            return merged
        conn = await self._connect()
        try:
            for name in MESSAGE_INDEXES:
                async with conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' "
                                        "AND name = ?", (name,)) as cur:
                    if await cur.fetchone() is None:
                        continue
                async with conn.execute(f"INSERT INTO {name} ({name}) VALUES ('optimize')"):
                    merged.append(name)
        finally:
            await conn.close()
        return merged

    async def vacuum(self) -> None:
        """Rewrite the file to give back the space deletes left (a WAL checkpoint, then
        VACUUM), on a connection of its own: the writer's commits wait meanwhile (their
        retries ride it out), then go on.

        Raises:
            sqlite3.Error: the file cannot be rewritten (another connection's transaction
                kept it busy past the busy timeout, a full disk).
        """
        conn = await self._connect()
        try:
            for statement in ("PRAGMA wal_checkpoint(TRUNCATE)", "VACUUM"):
                async with conn.execute(statement) as cur:  # done with before the next
                    await cur.fetchall()
        finally:
            await conn.close()

    async def aclose(self, timeout_s: float | None = None) -> None:
        """Stop what runs (``interrupt``), close readers, then the writers, within
        ``timeout_s`` in all. Idempotent.

        A connection whose close does not finish in time is left to finish on its own
        thread (it ends once the statement it is in does; a busy wait lasts at most
        ``statement_busy_ms``).
        """
        conns = [*reversed(self._all_readers), self._aux, self._writer]
        self._all_readers, self._aux, self._writer = [], None, None
        open_conns = [c for c in conns if c is not None]
        for conn in open_conns:
            # A running statement stops now. Best effort, safe to ignore: a connection whose
            # sqlite3 handle is already gone (ValueError, ProgrammingError) runs nothing to
            # stop, and the close below reports any real trouble with it.
            with contextlib.suppress(sqlite3.Error, ValueError):
                await conn.interrupt()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for conn in open_conns:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            with anyio.move_on_after(left) as scope:
                try:
                    await conn.close()
                except (sqlite3.Error, ValueError):
                    log.warning("store_close_failed", db=str(self.path), exc_info=True)
            if scope.cancelled_caught:
                log.warning("store_close_abandoned", db=str(self.path),
                            detail="a statement is still running on its thread")

    async def aux(self) -> aiosqlite.Connection:
        """The connection for small writes outside the writer's batches (opened on first use)."""
        if self._writer is None:
            raise StoreError("the store is not open")
        async with self._aux_lock:  # two first callers must not open two connections
            if self._aux is None:
                self._aux = await self._connect(busy_ms=self._statement_busy_ms)
        return self._aux

    @property
    def writer(self) -> aiosqlite.Connection:
        if self._writer is None:
            raise StoreError("the store is not open")
        return self._writer

    @contextlib.asynccontextmanager
    async def reader(self) -> AsyncIterator[aiosqlite.Connection]:
        if not self._all_readers:
            raise StoreError("the store is not open")
        conn = await self._readers.get()
        try:
            yield conn
        except sqlite3.OperationalError as exc:
            if not is_missing_fts5(exc):  # kept by a writer with FTS5, not readable here
                raise
            raise FullTextUnavailableError(self._no_full_text()) from exc
        except sqlite3.DatabaseError as exc:
            # Pages a start did not read can be damaged: the first read of one says so,
            # typed, and fails the pipeline with the cause (``on_corrupt``).
            if sqlite_code(exc) not in (SQLITE_CORRUPT, SQLITE_NOTADB):
                raise
            error = CorruptStoreError(self.path, str(exc))
            if self.on_corrupt is not None:
                self.on_corrupt(error)
            raise error from exc
        finally:
            self._readers.put_nowait(conn)

    def require_full_text(self) -> None:
        """For a search: raise unless the full-text indexes are kept.

        Raises:
            FullTextUnavailableError: they are not (``full_text``).
        """
        if not self.full_text:
            raise FullTextUnavailableError(self._no_full_text())

    def _no_full_text(self) -> str:
        return (f"the store {self.path} has no full-text index to search: no FTS5 module in "
                "this SQLite, or in the one of the process that last committed it (the next "
                "process with FTS5 to commit the store rebuilds the indexes)")

    async def _commit_transaction(self) -> None:
        await self.writer.execute("COMMIT")


async def rollback(db: aiosqlite.Connection) -> None:
    """Undo the open transaction while an error propagates. Raises nothing of its own: the
    caller re-raises the error that brought it here, which must not be masked.

    A ROLLBACK that fails with no transaction open is expected and says nothing (BEGIN itself
    failed, or SQLite already rolled back after an I/O error or a full disk). One that leaves
    a transaction open is not: it is logged with its traceback.
    """
    try:
        await db.execute("ROLLBACK")
    except (sqlite3.Error, ValueError):
        try:
            still_open = db.in_transaction
        except ValueError:  # the connection is closed: nothing is open on it
            still_open = False
        if still_open:
            log.error("store_rollback_failed", exc_info=True)


async def connect_daemon(database: str, **kwargs: Any) -> aiosqlite.Connection:
    """``aiosqlite.connect`` on a daemon thread: a read-only connection its opener forgot to
    close never keeps the process alive (aiosqlite's own thread is not a daemon, so the
    interpreter would wait for it forever at exit). For reads only: a writer's thread must
    finish its statement, so the pipeline closes its writers itself.

    Raises:
        sqlite3.Error: the file cannot be opened.
    """
    conn = aiosqlite.connect(database, **kwargs)
    # aiosqlite makes the thread in the constructor and starts it when awaited (0.17 to
    # 0.22); a version that does otherwise fails here loudly rather than leaking threads.
    thread = conn._thread
    if not isinstance(thread, threading.Thread) or thread.is_alive():
        raise RuntimeError("aiosqlite no longer starts its thread on await: "
                           "connect_daemon needs updating")
    thread.daemon = True
    return await conn


def _check_folder(path: Path) -> None:
    """Raises StoreAccessError when the nearest existing folder above ``path`` is a file."""
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise StoreAccessError(
                    f"cannot use the store {path}: {parent} is not a directory")
            return


def _os_error(path: Path, exc: OSError) -> StoreError:
    """The typed error for a file-system failure at open."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(f"no space left for the store {path}: {exc.strerror}")
    return StoreAccessError(f"cannot use the store {path}: {exc.strerror or exc}")
