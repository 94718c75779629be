"""The embedded SQLite store: sessions, messages with an FTS5 index, and the outbox table.

One writer connection commits whole batches; reader connections serve recalls and reads.
Every await on aiosqlite is a hop to its connection thread, so a batch is a handful of
``executemany`` calls, never one await per row. The FTS5 index has external content and no
insert trigger: the writer fills it once per batch from the rows it just inserted.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import sqlite3
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import aiosqlite
import anyio
import structlog

from .errors import (
    CorruptStoreError,
    DiskFullError,
    LeaseLostError,
    StoreAccessError,
    StoreError,
)
from .faults import SQLITE_CORRUPT, SQLITE_FULL, SQLITE_NOTADB, sqlite_code
from .turns import Turn

log = structlog.get_logger(__name__)

SCHEMA_VERSION = 1
_KEY_CHUNK = 500

SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    source TEXT NOT NULL,
    user_id TEXT,
    model TEXT,
    parent_session_id TEXT,
    started_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    ended_at REAL,
    end_reason TEXT,
    message_count INTEGER NOT NULL DEFAULT 0,
    tool_call_count INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS idx_sessions_user ON sessions(user_id);
CREATE INDEX IF NOT EXISTS idx_sessions_parent ON sessions(parent_session_id);
CREATE INDEX IF NOT EXISTS idx_sessions_started ON sessions(started_at DESC);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    session_id TEXT NOT NULL,
    turn_key TEXT NOT NULL,
    ordinal INTEGER NOT NULL,
    role TEXT NOT NULL,
    content TEXT,
    tool_calls TEXT,
    tool_call_id TEXT,
    tool_name TEXT,
    timestamp REAL NOT NULL,
    user_id TEXT,
    scope TEXT NOT NULL,
    metadata TEXT
);
CREATE INDEX IF NOT EXISTS idx_messages_session ON messages(session_id, id);
CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts USING fts5(
    content, scope,
    content='messages', content_rowid='id',
    tokenize='unicode61 remove_diacritics 2'
);
CREATE VIRTUAL TABLE IF NOT EXISTS messages_vocab USING fts5vocab(messages_fts, 'col');
CREATE TRIGGER IF NOT EXISTS messages_fts_delete AFTER DELETE ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content, scope)
    VALUES ('delete', old.id, old.content, old.scope);
END;
CREATE TABLE IF NOT EXISTS outbox (
    key TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    segment INTEGER NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'leased', 'done', 'dead')),
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    payload BLOB,
    accepted_at REAL NOT NULL,
    updated_at REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idx_outbox_segment ON outbox(segment);
CREATE INDEX IF NOT EXISTS idx_outbox_open ON outbox(status) WHERE status != 'done';
-- Several processes, one memory: producers hand turns to the inbox, a worker claims them
-- under a lease and commits them; producers ask for recalls, the worker answers.
CREATE TABLE IF NOT EXISTS inbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL UNIQUE,
    session_id TEXT NOT NULL,
    payload TEXT NOT NULL,
    accepted_at REAL NOT NULL,
    lease_owner TEXT,
    lease_until REAL
);
CREATE INDEX IF NOT EXISTS idx_inbox_session ON inbox(session_id, id);
CREATE TABLE IF NOT EXISTS recall_requests (
    session_id TEXT PRIMARY KEY,
    user_id TEXT,
    query TEXT NOT NULL,
    after_id INTEGER NOT NULL,
    requested_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS recall_results (
    session_id TEXT PRIMARY KEY,
    user_id TEXT,
    query TEXT NOT NULL,
    block TEXT NOT NULL,
    version INTEGER NOT NULL,
    updated_at REAL NOT NULL,
    source TEXT NOT NULL DEFAULT 'local',
    fallback INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS idx_recall_results_version ON recall_results(version);
-- Each replica backend's own outbox: a row per committed turn, written in the turn's commit
-- transaction, removed once the backend has the turn; 'dead' with the reason when it cannot.
CREATE TABLE IF NOT EXISTS replica_outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    backend TEXT NOT NULL,
    turn_key TEXT NOT NULL,
    session_id TEXT NOT NULL,
    first_id INTEGER NOT NULL,
    n_messages INTEGER NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'dead')),
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    updated_at REAL,
    UNIQUE (backend, turn_key)
);
CREATE INDEX IF NOT EXISTS idx_replica_outbox_open ON replica_outbox(backend, status, id);
CREATE INDEX IF NOT EXISTS idx_replica_outbox_session
    ON replica_outbox(backend, status, session_id, id);
"""
_ADDED_COLUMNS = (
    ("recall_results", "source", "TEXT NOT NULL DEFAULT 'local'"),
    ("recall_results", "fallback", "INTEGER NOT NULL DEFAULT 0"),
    # A turn a producer could not write, handed in with why: the worker dead-letters it.
    ("inbox", "error", "TEXT"),
)
# The pipeline's writing connections wait this long for the write lock per statement, then
# the pipeline retries with backoff itself: SQLite's interrupt() does not break a busy wait,
# so a long busy timeout would hold every shutdown deadline hostage.
STATEMENT_BUSY_MS = 100
_SQLITE_MAGIC = b"SQLite format 3\x00"
# Set on the writer connection: a batch of inbox turns commits only while its lease holds.
_LEASE_GUARD = """
CREATE TEMP TABLE IF NOT EXISTS lease_guard (held INTEGER NOT NULL CHECK (held));
"""
# A producer's batch: the turns' records as they are, unless a worker already committed them
# (a producer replaying its outbox after a crash) or they are already waiting.
_FORWARD = """
INSERT INTO inbox (key, session_id, accepted_at, payload)
SELECT v.column1, v.column2, v.column3, v.column4 FROM (VALUES {rows}) AS v
WHERE NOT EXISTS (SELECT 1 FROM outbox o WHERE o.key = v.column1)
ON CONFLICT (key) DO NOTHING;
"""
# The oldest unclaimed inbox turns, never one whose session has an earlier turn still under
# another worker's live claim: per-session order holds across workers and restarts.
_CLAIM = """
UPDATE inbox SET lease_owner = :owner, lease_until = :until
WHERE id IN (
    SELECT i.id FROM inbox AS i
    WHERE (i.lease_owner IS NULL OR i.lease_owner = :owner OR i.lease_until < :now)
      AND NOT EXISTS (
          SELECT 1 FROM inbox AS j
          WHERE j.session_id = i.session_id AND j.id < i.id AND j.lease_owner != :owner
            AND j.lease_until >= :now)
    ORDER BY i.id LIMIT :limit)
RETURNING id, key, session_id, accepted_at, payload, error
"""

# Sessions are created lazily and their counters summed, from the messages the batch just
# inserted: no per-turn work in Python. Token counts are summed once per turn (ordinal 0).
_UPSERT_SESSIONS = """
INSERT INTO sessions (id, source, user_id, model, parent_session_id, started_at, updated_at,
                      message_count, tool_call_count, input_tokens, output_tokens)
SELECT session_id,
       coalesce(min(CASE WHEN json_type(metadata, '$.source') = 'text'
                         THEN json_extract(metadata, '$.source') END), {source}),
       max(user_id),
       max(CASE WHEN json_type(metadata, '$.model') = 'text'
                THEN json_extract(metadata, '$.model') END),
       min(CASE WHEN json_type(metadata, '$.parent_session_id') = 'text'
                THEN json_extract(metadata, '$.parent_session_id') END),
       min(timestamp), {now}, count(*),
       sum(role = 'tool' OR tool_calls IS NOT NULL),
       sum(CASE WHEN ordinal = 0 AND json_type(metadata, '$.input_tokens') = 'integer'
                THEN json_extract(metadata, '$.input_tokens') ELSE 0 END),
       sum(CASE WHEN ordinal = 0 AND json_type(metadata, '$.output_tokens') = 'integer'
                THEN json_extract(metadata, '$.output_tokens') ELSE 0 END)
FROM messages WHERE id > {start} GROUP BY session_id
ON CONFLICT (id) DO UPDATE SET
    updated_at = excluded.updated_at,
    user_id = coalesce(sessions.user_id, excluded.user_id),
    model = coalesce(excluded.model, sessions.model),
    parent_session_id = coalesce(sessions.parent_session_id, excluded.parent_session_id),
    message_count = sessions.message_count + excluded.message_count,
    tool_call_count = sessions.tool_call_count + excluded.tool_call_count,
    input_tokens = sessions.input_tokens + excluded.input_tokens,
    output_tokens = sessions.output_tokens + excluded.output_tokens;
"""
# Every message of every turn in the batch, in batch order then message order. The CTE
# reads each turn's fields once, not once per message.
_INSERT_MESSAGES = """
WITH t AS MATERIALIZED (
    SELECT j.key AS i, json_extract(j.value, '$.s') AS s, json_extract(j.value, '$.k') AS k,
           json_extract(j.value, '$.t') AS ts, json_extract(j.value, '$.u') AS u,
           json_extract(j.value, '$.c') AS c, json_extract(j.value, '$.d') AS d,
           json_extract(j.value, '$.m') AS m
    FROM json_each({turns}) AS j
)
INSERT INTO messages (session_id, turn_key, ordinal, role, content, tool_calls, tool_call_id,
                      tool_name, timestamp, user_id, scope, metadata)
SELECT t.s, t.k, e.key, json_extract(e.value, '$[0]'), json_extract(e.value, '$[1]'),
       json_extract(e.value, '$[2]'), json_extract(e.value, '$[3]'),
       json_extract(e.value, '$[4]'), t.ts, t.u, t.c, t.d
FROM t, json_each(t.m) AS e
ORDER BY t.i, e.key;
"""
_INSERT_MESSAGE_ROW = """
INSERT INTO messages (session_id, turn_key, ordinal, role, content, tool_calls, tool_call_id,
                      tool_name, timestamp, user_id, scope, metadata)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
"""
_INDEX_BATCH = """
INSERT INTO messages_fts (rowid, content, scope)
SELECT id, content, scope FROM messages WHERE id > {start};
"""
# The batch's turns wait for the replica backend: one row per turn, with its message rows.
_INSERT_REPLICA = """
INSERT INTO replica_outbox (backend, turn_key, session_id, first_id, n_messages)
SELECT {backend}, turn_key, session_id, min(id), count(*) FROM messages WHERE id > {start}
GROUP BY turn_key ORDER BY min(id)
ON CONFLICT (backend, turn_key) DO NOTHING;
"""
# The batch's turns are 'done': one row per turn, read back from the messages it just
# inserted (ids are consecutive inside the transaction), for one run of outbox segment.
_INSERT_DONE = """
INSERT INTO outbox (key, session_id, segment, status, attempts, accepted_at, updated_at)
SELECT turn_key, session_id, {segment}, 'done', 1, timestamp, {now}
FROM messages WHERE id > {start} + {after} AND id <= {start} + {upto} AND ordinal = 0;
"""
_INSERT_DEAD = """
INSERT INTO outbox (key, session_id, segment, status, attempts, last_error, payload,
                    accepted_at, updated_at)
VALUES (?, ?, ?, 'dead', ?, ?, ?, ?, ?)
ON CONFLICT (key) DO UPDATE SET status = 'dead', attempts = excluded.attempts,
    last_error = excluded.last_error, payload = excluded.payload, updated_at = excluded.updated_at
"""
_SEARCH = """
SELECT m.id, m.session_id, m.role, m.timestamp,
       snippet(messages_fts, 0, '', '', '…', ?) AS snip
FROM messages_fts JOIN messages m ON m.id = messages_fts.rowid
WHERE messages_fts MATCH ?
ORDER BY rank
LIMIT ?
"""


def sql_literal(text: str) -> str:
    """``text`` as an SQL string literal. Only for text without U+0000 (SQLite ends a
    literal there); the caller routes such text through bound parameters instead."""
    if "\x00" in text:
        raise ValueError("an SQL literal cannot hold U+0000")
    return "'" + text.replace("'", "''") + "'"


class ReplicaRow(NamedTuple):
    """A committed turn waiting for a replica backend."""

    id: int
    turn_key: str
    session_id: str
    first_id: int
    n_messages: int
    attempts: int
    tried: bool = False  # a write of it failed before (counted or not)


@dataclass(frozen=True, slots=True)
class Hit:
    """One recalled message."""

    message_id: int
    session_id: str
    role: str
    timestamp: float
    snippet: str


@dataclass(frozen=True, slots=True)
class DeadLetter:
    key: str
    session_id: str
    attempts: int
    last_error: str
    updated_at: float


class Batch:
    """The parameters of one group commit, built up a chunk of turns at a time.

    Each table gets its rows as ONE JSON text parameter that SQLite unpacks with
    ``json_each`` in C, with the GIL released. Binding rows one by one from Python
    (``executemany``) takes and releases the GIL per row, and a busy event-loop thread holds
    each hand-back for up to the interpreter's switch interval (5 ms): a batch then took
    seconds. The turns' JSON is the outbox payload built on the accept path, so building the
    parameter is a string join.
    """

    def __init__(self, source: str) -> None:
        self.source = source
        self.turns: list[Turn] = []
        self.n_messages = 0
        self._payloads: list[str] = []
        # Runs of consecutive turns from one outbox segment: [segment, messages in the run].
        self._runs: list[list[int]] = []
        self._session_ids: set[str] = set()
        self._has_nul = False
        # Turns claimed from the shared inbox: their rows, and the lease they are under.
        self.inbox_ids: list[int] = []
        self.lease_owner: str | None = None

    @classmethod
    def of(cls, turns: Sequence[Turn], source: str) -> Batch:
        batch = cls(source)
        batch.add(turns)
        return batch

    def __len__(self) -> int:
        return len(self.turns)

    def add(self, turns: Sequence[Turn]) -> None:
        self.turns.extend(turns)
        self._session_ids.update([t.session_id for t in turns])
        self._has_nul = self._has_nul or any([t.has_nul for t in turns])
        self._payloads.extend([t.payload for t in turns])
        runs = self._runs
        for t in turns:
            self.n_messages += t.n_messages
            if runs and runs[-1][0] == t.segment:
                runs[-1][1] += t.n_messages
            else:
                runs.append([t.segment, t.n_messages])

    @property
    def has_nul(self) -> bool:
        """Whether some text holds U+0000, which SQLite's JSON functions cut short."""
        return self._has_nul

    def message_rows(self) -> list[tuple[Any, ...]]:
        """The messages as bound rows, for a batch whose text SQLite's JSON would cut."""
        rows = []
        for payload in self._payloads:
            doc = json.loads(payload)
            md = json.dumps(doc["d"], ensure_ascii=False) if doc["d"] else None
            for i, (role, content, calls, call_id, name) in enumerate(doc["m"]):
                rows.append((doc["s"], doc["k"], i, role, content, calls, call_id, name,
                             doc["t"], doc["u"], doc["c"], md))
        return rows

    def literal_parts(self) -> list[str]:
        """The turns' JSON as an SQL string literal, in pieces to join once with the rest of
        the script (payloads hold no single quote): a 2,000-turn batch is about a megabyte,
        and every extra copy of it is event-loop time."""
        parts = ["'["]
        for payload in self._payloads:
            parts.append(payload)
            parts.append(",")
        if len(parts) > 1:
            parts.pop()
        parts.append("]'")
        return parts

    def segment_runs(self, first_id: int) -> list[tuple[int, int, int]]:
        """(segment, after id, up to id) of each run, given the id before the batch's first."""
        out = []
        start = first_id
        for segment, n in self._runs:
            out.append((segment, start, start + n))
            start += n
        return out

    def session_count(self) -> int:
        return len(self._session_ids)


class SqliteStore:
    """The system of record. ``open()`` before use, ``aclose()`` after."""

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
        # The replica backend whose outbox each commit fills (None: no backend).
        self.replica: str | None = None

    # -- life cycle --------------------------------------------------------------------

    async def open(self) -> None:
        """Create or open the file (mode 0600) and its schema.

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
        try:
            self._writer = await self._connect(busy_ms=self._statement_busy_ms)
            await self._writer.executescript(SCHEMA)
            async with self._writer.execute("SELECT version FROM schema_version") as cur:
                row = await cur.fetchone()
            if row is None:
                await self._writer.execute(
                    "INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,)
                )
                # Rank on the text column only; the scope column is a filter, not evidence.
                await self._writer.execute(
                    "INSERT INTO messages_fts (messages_fts, rank) "
                    "VALUES ('rank', 'bm25(1.0, 0.0)')"
                )
            elif row[0] > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path} has schema version {row[0]}; this library knows {SCHEMA_VERSION}"
                )
            await self._add_missing_columns()
            await self._writer.commit()
            await self._writer.executescript(_LEASE_GUARD)
            for _ in range(self._readers_n):
                conn = await self._connect(readonly=True)
                self._all_readers.append(conn)
                self._readers.put_nowait(conn)
            await self._check_tables()
        except (sqlite3.Error, OSError) as exc:
            await self.aclose()
            code = sqlite_code(exc)
            if code in (SQLITE_CORRUPT, SQLITE_NOTADB):
                raise CorruptStoreError(self.path, str(exc)) from exc
            if code == SQLITE_FULL:
                raise DiskFullError(f"no space left for the store {self.path}: {exc}") from exc
            if isinstance(exc, OSError):
                raise _os_error(self.path, exc) from exc
            if isinstance(exc, sqlite3.OperationalError) and any(
                    t in str(exc) for t in ("readonly", "unable to open", "read-only")):
                raise StoreAccessError(f"cannot write the store {self.path}: {exc}") from exc
            raise StoreError(f"cannot open the store {self.path}: {exc}") from exc
        except BaseException:
            await self.aclose()
            raise

    async def _check_tables(self) -> None:
        """One cheap read of every table: a damaged page behind them shows now, not later."""
        for query in ("SELECT max(rowid) FROM sessions", "SELECT max(id) FROM messages",
                      "SELECT max(key) FROM outbox", "SELECT max(id) FROM inbox",
                      "SELECT max(id) FROM replica_outbox"):
            async with self.writer.execute(query) as cur:
                await cur.fetchone()

    async def _add_missing_columns(self) -> None:
        """Columns added since a table was first created (CREATE IF NOT EXISTS keeps an
        older table as it is)."""
        for table, column, decl in _ADDED_COLUMNS:
            async with self.writer.execute(f"PRAGMA table_info({table})") as cur:
                have = {row[1] for row in await cur.fetchall()}
            if column not in have:
                await self.writer.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")

    async def _connect(self, *, readonly: bool = False, busy_ms: int | None = None
                       ) -> aiosqlite.Connection:
        conn = await aiosqlite.connect(self.path, isolation_level=None)
        try:
            busy = self._busy_timeout_ms if busy_ms is None else busy_ms
            await conn.execute(f"PRAGMA busy_timeout = {int(busy)}")
            await conn.execute("PRAGMA journal_mode = WAL")
            await conn.execute("PRAGMA synchronous = NORMAL")
            if readonly:
                await conn.execute("PRAGMA query_only = 1")
        except BaseException:
            # Its thread is not a daemon: left open, it would keep the process alive.
            with contextlib.suppress(sqlite3.Error, ValueError):
                await conn.close()
            raise
        return conn

    async def checkpoint(self) -> None:
        """Copy the WAL into the database and truncate it: gives back the space the WAL grew
        to (after a full disk, say)."""
        await self.writer.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    async def prune_recall_results(self, older_than: float) -> int:
        cur = await (await self.aux()).execute(
            "DELETE FROM recall_results WHERE updated_at < ?", (older_than,))
        return cur.rowcount

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
            with contextlib.suppress(sqlite3.Error, ValueError):
                await conn.interrupt()  # a running statement stops now
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for conn in open_conns:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            with anyio.move_on_after(left) as scope:
                try:
                    await conn.close()
                except (sqlite3.Error, ValueError) as exc:
                    log.warning("store_close_failed", error=str(exc))
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
        finally:
            self._readers.put_nowait(conn)

    # -- writes ------------------------------------------------------------------------

    async def commit(self, turns: Sequence[Turn]) -> None:
        """Store ``turns`` in one transaction (see ``commit_batch``)."""
        await self.commit_batch(Batch.of(turns, self.source))

    def _batch_statements(self, batch: Batch) -> list[str]:
        """What a batch's transaction runs after inserting its messages: the replica
        outbox rows, the FTS index, the sessions, and the outbox keys marked 'done'."""
        # The batch's messages are the last n_messages rows once inserted: ids are
        # consecutive inside the transaction.
        start = f"((SELECT max(id) FROM messages) - {int(batch.n_messages)})"
        now = repr(self.now())
        script = [_INSERT_REPLICA.format(backend=sql_literal(self.replica), start=start)
                  ] if self.replica else []
        script += [_INDEX_BATCH.format(start=start),
                   _UPSERT_SESSIONS.format(start=start, now=now, source=sql_literal(batch.source))]
        script += [
            _INSERT_DONE.format(segment=int(segment), now=now, start=start, after=after, upto=upto)
            for segment, after, upto in batch.segment_runs(0)
        ]
        return script

    async def commit_batch(self, batch: Batch) -> None:
        """Store a batch in one transaction: messages, their index, and outbox rows 'done'.

        The statements go to SQLite as one script, so the writer thread hands the GIL back
        and forth a few times per batch, not once per statement and row: each hand-back can
        wait out the interpreter's switch interval while the event loop is busy. Values are
        inlined as SQL literals; the turns' JSON needs no escaping, as payloads write ' as
        \\u0027.

        Raises:
            sqlite3.Error: the transaction failed and was rolled back; nothing was stored.
        """
        db = self.writer
        script = self._batch_statements(batch)
        if batch.inbox_ids:
            # Inbox turns leave the inbox in the same transaction, and only while this
            # worker's lease on every one of them holds (else: IntegrityError, rolled back).
            ids = ",".join(str(int(i)) for i in batch.inbox_ids)
            owner = sql_literal(batch.lease_owner or "")
            # One statement per item: the NUL path below runs them one execute() each.
            script += [
                f"INSERT INTO temp.lease_guard (held) SELECT count(*) = {len(batch.inbox_ids)} "
                f"FROM inbox WHERE id IN ({ids}) AND lease_owner = {owner};",
                "DELETE FROM temp.lease_guard;",
                f"DELETE FROM inbox WHERE id IN ({ids});",
            ]
        try:
            if batch.has_nul:  # rare: bind the rows one by one, NUL and all
                await db.execute("BEGIN IMMEDIATE")
                await db.executemany(_INSERT_MESSAGE_ROW, batch.message_rows())
                # Statement by statement: executescript would first commit the open
                # transaction.
                for statement in script:
                    await db.execute(statement)
            else:
                head, tail = _INSERT_MESSAGES.split("{turns}")
                await db.executescript(
                    "".join(["BEGIN IMMEDIATE;", head, *batch.literal_parts(), tail, *script])
                )
            await self._commit_transaction()
        except sqlite3.IntegrityError as exc:
            with contextlib.suppress(sqlite3.Error):
                await db.execute("ROLLBACK")
            if batch.inbox_ids and not await self._lease_holds(batch):
                raise LeaseLostError(
                    f"the lease on {len(batch.inbox_ids)} inbox turns was taken over") from exc
            raise
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                await db.execute("ROLLBACK")
            raise

    async def _lease_holds(self, batch: Batch) -> bool:
        """Whether ``batch.lease_owner`` still holds every one of its inbox turns."""
        ids = [int(i) for i in batch.inbox_ids]
        held = 0
        for i in range(0, len(ids), _KEY_CHUNK):
            chunk = ids[i : i + _KEY_CHUNK]
            async with self.writer.execute(
                f"SELECT count(*) FROM inbox WHERE id IN ({','.join('?' * len(chunk))}) "
                "AND lease_owner = ?", (*chunk, batch.lease_owner),
            ) as cur:
                row = await cur.fetchone()
            held += int(row[0]) if row else 0
        return held == len(ids)

    async def _commit_transaction(self) -> None:
        await self.writer.execute("COMMIT")

    async def dead_letter(self, turn: Turn, error: str, attempts: int, payload: bytes) -> None:
        """Keep a turn that cannot be stored, with why; it is no longer retried."""
        db = self.writer
        now = self.now()
        await db.execute(
            _INSERT_DEAD,
            (turn.key, turn.session_id, turn.segment, attempts, error[:2000], payload,
             turn.accepted_at, now),
        )

    async def done_keys(self, keys: Iterable[str], *, waiting: bool = False) -> set[str]:
        """Which of these turn keys the store already holds (done or dead), and with
        ``waiting``, also those waiting in the shared inbox."""
        keys = list(keys)
        found: set[str] = set()
        db = self.writer
        for i in range(0, len(keys), _KEY_CHUNK):
            chunk = keys[i : i + _KEY_CHUNK]
            marks = ",".join("?" * len(chunk))
            async with db.execute(f"SELECT key FROM outbox WHERE key IN ({marks})", chunk) as cur:
                found.update(r[0] for r in await cur.fetchall())
            if waiting:
                async with db.execute(
                    f"SELECT key FROM inbox WHERE key IN ({marks})", chunk
                ) as cur:
                    found.update(r[0] for r in await cur.fetchall())
        return found

    async def next_segment(self) -> int:
        """One past the highest outbox segment any stored key came from."""
        async with self.writer.execute("SELECT coalesce(max(segment), 0) + 1 FROM outbox") as cur:
            row = await cur.fetchone()
        return int(row[0]) if row else 1

    # -- several processes, one memory -------------------------------------------------

    async def forward_batch(self, batch: Batch) -> None:
        """A producer's batch into the shared inbox, in accept order, in one transaction.
        Turns the store already holds or already has waiting are skipped.

        Raises:
            sqlite3.Error: the transaction failed and was rolled back; nothing was stored.
        """
        rows = ",".join([
            f"({sql_literal(t.key)},{sql_literal(t.session_id)},{float(t.accepted_at)!r},"
            f"'{t.payload}')"  # the record holds no quote (see Turn.build)
            for t in batch.turns
        ])
        db = self.writer
        try:
            await db.executescript("BEGIN IMMEDIATE;" + _FORWARD.format(rows=rows))
            await self._commit_transaction()
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                await db.execute("ROLLBACK")
            raise

    async def forward_refused(self, rows: Sequence[tuple[str, str, float, str, str]]) -> None:
        """A producer hands in turns it could not write, with why (key, session_id,
        accepted_at, record, reason): the worker dead-letters them under its lease. Only
        workers write to the store's own tables."""
        await self.writer.executemany(
            "INSERT INTO inbox (key, session_id, accepted_at, payload, error) "
            "VALUES (?, ?, ?, ?, ?) ON CONFLICT (key) DO NOTHING",
            [(k, s, float(at), record, reason[:2000]) for k, s, at, record, reason in rows],
        )

    async def claim_inbox(
        self, owner: str, lease_s: float, limit: int
    ) -> list[tuple[int, str, str, float, str, str | None]]:
        """Claim up to ``limit`` inbox turns for ``lease_s``, oldest first:
        (inbox id, key, session_id, accepted_at, record, error a producer handed it in with)."""
        now = self.now()
        params = {"owner": owner, "until": now + lease_s, "now": now, "limit": limit}
        async with self.writer.execute(_CLAIM, params) as cur:
            rows = await cur.fetchall()
        return sorted((int(r[0]), str(r[1]), str(r[2]), float(r[3]), str(r[4]),
                       None if r[5] is None else str(r[5])) for r in rows)

    async def lease_owners(self) -> list[str]:
        """The workers holding live claims on inbox turns."""
        sql = "SELECT DISTINCT lease_owner FROM inbox WHERE lease_until >= ?"
        async with self.writer.execute(sql, (self.now(),)) as cur:
            return [str(r[0]) for r in await cur.fetchall()]

    async def release_leases(self, owner: str) -> int:
        """Drop a gone worker's claims, so its turns can be claimed again now."""
        cur = await self.writer.execute(
            "UPDATE inbox SET lease_owner = NULL, lease_until = NULL WHERE lease_owner = ?",
            (owner,),
        )
        return cur.rowcount

    async def delete_inbox(self, ids: Sequence[int]) -> None:
        """Remove inbox turns that are settled another way (found stored, dead-lettered)."""
        for i in range(0, len(ids), _KEY_CHUNK):
            chunk = [int(x) for x in ids[i : i + _KEY_CHUNK]]
            await self.writer.execute(
                f"DELETE FROM inbox WHERE id IN ({','.join('?' * len(chunk))})", chunk
            )

    async def inbox_counts(self) -> tuple[int, float | None]:
        """Turns waiting in the inbox, and when the oldest was accepted (epoch seconds)."""
        async with self.reader() as db, db.execute(
            "SELECT count(*), min(accepted_at) FROM inbox"
        ) as cur:
            row = await cur.fetchone()
        return (int(row[0]), row[1]) if row else (0, None)

    async def request_recall(self, session_id: str, user_id: str | None, query: str) -> None:
        """Ask the worker for a recall; a newer request replaces an older unserved one."""
        await (await self.aux()).execute(
            "INSERT INTO recall_requests (session_id, user_id, query, after_id, requested_at) "
            "VALUES (?, ?, ?, (SELECT coalesce(max(id), 0) FROM inbox), ?) "
            "ON CONFLICT (session_id) DO UPDATE SET user_id = excluded.user_id, "
            "query = excluded.query, after_id = excluded.after_id, "
            "requested_at = excluded.requested_at",
            (session_id, user_id, query, self.now()),
        )

    async def take_recall_requests(self, limit: int) -> list[tuple[str, str | None, str, int]]:
        """The oldest recall requests, removed: (session_id, user_id, query, after_id)."""
        sql = (
            "DELETE FROM recall_requests WHERE session_id IN (SELECT session_id FROM "
            "recall_requests ORDER BY requested_at LIMIT ?) "
            "RETURNING session_id, user_id, query, after_id, requested_at"
        )
        async with (await self.aux()).execute(sql, (limit,)) as cur:
            rows = list(await cur.fetchall())
        rows.sort(key=lambda r: float(r[4]))
        return [(r[0], r[1], r[2], int(r[3])) for r in rows]

    async def inbox_holds(self, up_to_id: int) -> bool:
        """Whether turns handed in up to ``up_to_id`` still wait (any session: a recall
        reaches across the user's sessions)."""
        async with self.reader() as db, db.execute(
            "SELECT 1 FROM inbox WHERE id <= ? LIMIT 1", (up_to_id,)
        ) as cur:
            return await cur.fetchone() is not None

    async def put_recall_result(self, session_id: str, user_id: str | None, query: str,
                                block: str, source: str = "local", fallback: bool = False
                                ) -> None:
        await (await self.aux()).execute(
            "INSERT INTO recall_results (session_id, user_id, query, block, version, updated_at, "
            "source, fallback) "
            "VALUES (?, ?, ?, ?, (SELECT coalesce(max(version), 0) + 1 FROM recall_results), ?, "
            "?, ?) "
            "ON CONFLICT (session_id) DO UPDATE SET user_id = excluded.user_id, "
            "query = excluded.query, block = excluded.block, version = excluded.version, "
            "updated_at = excluded.updated_at, source = excluded.source, "
            "fallback = excluded.fallback",
            (session_id, user_id, query, block, self.now(), source, int(fallback)),
        )

    async def recall_results_since(
        self, version: int, limit: int = 1000
    ) -> list[tuple[str, str | None, str, str, int, str, bool]]:
        """Recall results written after ``version``:
        (session, user, query, block, version, source, fallback)."""
        async with self.reader() as db, db.execute(
            "SELECT session_id, user_id, query, block, version, source, fallback "
            "FROM recall_results WHERE version > ? ORDER BY version LIMIT ?", (version, limit)
        ) as cur:
            rows = await cur.fetchall()
        return [(r[0], r[1], r[2], r[3], int(r[4]), str(r[5]), bool(r[6])) for r in rows]

    # -- the replica backend's outbox ---------------------------------------------------

    async def replica_pending(self, backend: str, sessions: int, limit: int
                              ) -> list[ReplicaRow]:
        """Turns waiting for ``backend``: every waiting turn (up to ``limit``, in commit
        order) of the ``sessions`` sessions whose oldest waiting turn is oldest. A session's
        backlog goes out together, so a remote store that takes messages per session gets
        one call for many turns, and no session waits behind a busier one."""
        async with self.reader() as db, db.execute(
            "SELECT id, turn_key, session_id, first_id, n_messages, attempts, "
            "last_error IS NOT NULL FROM replica_outbox "
            "WHERE backend = :b AND status = 'pending' AND session_id IN ("
            "  SELECT session_id FROM replica_outbox WHERE backend = :b AND status = 'pending' "
            "  GROUP BY session_id ORDER BY min(id) LIMIT :sessions) "
            "ORDER BY id LIMIT :limit",
            {"b": backend, "sessions": sessions, "limit": limit},
        ) as cur:
            return [ReplicaRow(r[0], r[1], r[2], r[3], r[4], r[5], bool(r[6]))
                    for r in await cur.fetchall()]

    async def replica_turns(self, rows: Sequence[ReplicaRow]) -> list[Turn]:
        """The committed turns behind replica rows, rebuilt from their messages, in order;
        each turn's ``seq`` is its replica row."""
        if not rows:
            return []
        lo = min(r.first_id for r in rows)
        hi = max(r.first_id + r.n_messages for r in rows)
        wanted = {r.turn_key for r in rows}
        by_key: dict[str, list[Any]] = {}
        async with self.reader() as db, db.execute(
            "SELECT turn_key, session_id, user_id, timestamp, role, content, tool_calls, "
            "tool_call_id, tool_name, metadata FROM messages WHERE id >= ? AND id < ? "
            "ORDER BY id", (lo, hi),
        ) as cur:
            async for m in cur:
                if m[0] in wanted:
                    by_key.setdefault(m[0], []).append(m)
        turns = []
        for n, r in enumerate(rows):
            if n % 200 == 199:
                await asyncio.sleep(0)  # rebuilding thousands of turns: let the loop run
            msgs = by_key.get(r.turn_key)
            if not msgs:
                continue
            first = msgs[0]
            metadata = json.loads(first[9]) if first[9] else None
            turns.append(Turn.build(
                key=r.turn_key, session_id=first[1], user_id=first[2], accepted_at=first[3],
                messages=[(m[4], m[5] or "", m[6], m[7], m[8]) for m in msgs],
                metadata=metadata,
            )._replace(seq=r.id))
        return turns

    async def replica_done(self, ids: Sequence[int]) -> None:
        """The backend has these turns: their rows go (outside the writer's batches, which
        could roll the delete back and send a turn twice)."""
        db = await self.aux()
        for i in range(0, len(ids), _KEY_CHUNK):
            chunk = [int(x) for x in ids[i : i + _KEY_CHUNK]]
            await db.execute(
                f"DELETE FROM replica_outbox WHERE id IN ({','.join('?' * len(chunk))})", chunk
            )

    async def replica_failed(self, failures: Sequence[tuple[int, str, bool]], *,
                             counted: bool = True) -> None:
        """(row id, reason, dead): a dead row stops; the others count one more attempt,
        unless not ``counted`` (the backend was unavailable: no attempt was really made)."""
        now = self.now()
        await (await self.aux()).executemany(
            "UPDATE replica_outbox SET attempts = attempts + ?, last_error = ?, updated_at = ?, "
            "status = CASE WHEN ? THEN 'dead' ELSE status END WHERE id = ?",
            [(int(counted or dead), reason[:2000], now, int(dead), int(row))
             for row, reason, dead in failures],
        )

    async def replica_last_id(self, backend: str) -> int:
        async with self.reader() as db, db.execute(
            "SELECT coalesce(max(id), 0) FROM replica_outbox WHERE backend = ?", (backend,)
        ) as cur:
            row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def replica_counts(self, backend: str) -> tuple[int, int]:
        """(pending, dead) turns in ``backend``'s outbox."""
        async with self.reader() as db, db.execute(
            "SELECT coalesce(sum(status = 'pending'), 0), coalesce(sum(status = 'dead'), 0) "
            "FROM replica_outbox WHERE backend = ?", (backend,),
        ) as cur:
            row = await cur.fetchone()
        return (int(row[0]), int(row[1])) if row else (0, 0)

    async def recall_version(self) -> int:
        async with self.reader() as db, db.execute(
            "SELECT coalesce(max(version), 0) FROM recall_results"
        ) as cur:
            row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def prune_inbox_keys(self, older_than: float) -> int:
        """Forget 'done' keys of turns handed in through the inbox (segment 0) settled before
        ``older_than`` (epoch seconds). They guard against a producer handing a turn in twice
        after a crash; a producer's slot is handed in within seconds of it going away, so a
        key that old guards nothing."""
        cur = await self.writer.execute(
            "DELETE FROM outbox WHERE status = 'done' AND segment = 0 AND updated_at < ?",
            (older_than,),
        )
        return cur.rowcount

    async def prune_outbox(self, below_segment: int) -> int:
        """Forget 'done' keys whose outbox segment is gone: they can never be replayed."""
        cur = await self.writer.execute(
            "DELETE FROM outbox WHERE status = 'done' AND segment > 0 AND segment < ?",
            (below_segment,)
        )
        return cur.rowcount

    # -- reads -------------------------------------------------------------------------

    async def search(self, match: str, *, limit: int, snippet_tokens: int) -> list[Hit]:
        """Run one FTS5 MATCH expression (already quoted and scoped by the caller)."""
        async with self.reader() as db, db.execute(_SEARCH, (snippet_tokens, match, limit)) as cur:
            rows = await cur.fetchall()
        return [Hit(r[0], r[1], r[2], r[3], r[4]) for r in rows]

    async def refresh_frequent_terms(self, min_rows: int, ratio: float = 0.0) -> frozenset[str]:
        """Terms in more than ``max(min_rows, ratio * messages)`` messages: too common to
        rank on. A scan of the whole vocabulary (~0.5 s at 1M messages), on a reader."""
        async with self.reader() as db:
            async with db.execute("SELECT coalesce(max(id), 0) FROM messages") as cur:
                row = await cur.fetchone()
            threshold = max(min_rows, int(ratio * (row[0] if row else 0)))
            async with db.execute(
                "SELECT term FROM messages_vocab WHERE col = 'content' AND doc > ?", (threshold,)
            ) as cur:
                rows = await cur.fetchall()
        self.frequent_terms = frozenset(r[0] for r in rows)
        return self.frequent_terms

    async def get_messages(self, session_id: str) -> list[dict[str, Any]]:
        """A session's messages in order, as seed 001's ``get_messages``."""
        async with self.reader() as db:
            db.row_factory = aiosqlite.Row
            try:
                async with db.execute(
                    "SELECT id, session_id, turn_key, role, content, tool_calls, tool_call_id, "
                    "tool_name, timestamp, user_id, metadata FROM messages "
                    "WHERE session_id = ? ORDER BY id",
                    (session_id,),
                ) as cur:
                    rows = await cur.fetchall()
            finally:
                db.row_factory = None
        out = []
        for r in rows:
            msg = dict(r)
            for name in ("tool_calls", "metadata"):
                if msg[name]:
                    msg[name] = json.loads(msg[name])
            out.append(msg)
        return out

    async def recent_turns(self, session_id: str, n: int
                           ) -> list[tuple[str, str | None, str, str]]:
        """The session's last ``n`` stored turns, oldest first:
        (turn key, user id, first user text, last non-empty assistant text)."""
        async with self.reader() as db, db.execute(
            "SELECT turn_key, user_id, role, content FROM messages WHERE session_id = ? AND "
            "turn_key IN (SELECT turn_key FROM messages WHERE session_id = ? AND ordinal = 0 "
            "ORDER BY id DESC LIMIT ?) ORDER BY id", (session_id, session_id, n),
        ) as cur:
            rows = await cur.fetchall()
        turns: dict[str, list[Any]] = {}
        for key, user_id, role, content in rows:
            turn = turns.setdefault(key, [key, user_id, "", ""])
            if role == "user" and not turn[2]:
                turn[2] = content or ""
            elif role == "assistant" and content:
                turn[3] = content
        return [(t[0], t[1], t[2], t[3]) for t in turns.values()]

    async def get_session(self, session_id: str) -> dict[str, Any] | None:
        async with self.reader() as db:
            db.row_factory = aiosqlite.Row
            try:
                async with db.execute("SELECT * FROM sessions WHERE id = ?", (session_id,)) as cur:
                    row = await cur.fetchone()
            finally:
                db.row_factory = None
        return dict(row) if row else None

    async def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        async with self.reader() as db, db.execute(
            "SELECT key, session_id, attempts, last_error, updated_at FROM outbox "
            "WHERE status = 'dead' ORDER BY updated_at LIMIT ?",
            (limit,),
        ) as cur:
            rows = await cur.fetchall()
        return [DeadLetter(*r) for r in rows]

    # -- dead letters --------------------------------------------------------------------

    async def replay_dead_letters(
        self, keys: Iterable[str]
    ) -> tuple[list[str], dict[str, str]]:
        """Commit dead-lettered turns again, each under its own idempotency key.

        For each key one transaction removes the dead outbox row and commits the turn as
        ``commit_batch`` does: its messages, their FTS rows, the session's counters and an
        outbox row 'done' with the same key, so the turn is stored once at most. A turn that
        fails again is rolled back and stays dead, with the new error and one more attempt.
        Returns the keys replayed, and for each other key why not (also: not a dead letter).

        Raises:
            StoreError: the store itself failed (busy, locked, I/O), which is no fault of a
                turn's; the keys replayed before it stay replayed.
        """
        replayed: list[str] = []
        failed: dict[str, str] = {}
        for key in dict.fromkeys(keys):
            try:
                error = await self._replay_dead_letter(key)
            except sqlite3.OperationalError as exc:
                raise StoreError(
                    f"replaying {key} failed in the store: {exc} "
                    f"({len(replayed)} dead letters replayed before it)"
                ) from exc
            if error is None:
                replayed.append(key)
            else:
                failed[key] = error
        return replayed, failed

    async def _replay_dead_letter(self, key: str) -> str | None:
        """One dead letter in one transaction; returns why it stays dead, or None."""
        db = self.writer
        await db.execute("BEGIN IMMEDIATE")
        try:
            async with db.execute(
                "SELECT segment, payload FROM outbox WHERE key = ? AND status = 'dead'", (key,)
            ) as cur:
                row = await cur.fetchone()
            if row is None:
                await db.execute("ROLLBACK")
                return "not a dead letter"
            try:
                batch = Batch.of([_dead_turn(key, row[0], row[1])], self.source)
                await db.execute("DELETE FROM outbox WHERE key = ?", (key,))
                # Bound row by row, as commit_batch does for text with NUL: one turn, and
                # inside a transaction executescript would first commit.
                await db.executemany(_INSERT_MESSAGE_ROW, batch.message_rows())
                for statement in self._batch_statements(batch):
                    await db.execute(statement)
            except sqlite3.OperationalError:
                raise  # the store's trouble, not the turn's
            except (sqlite3.Error, ValueError, LookupError, TypeError, AttributeError) as exc:
                await db.execute("ROLLBACK")
                error = f"{type(exc).__name__}: {exc}"
                await db.execute(
                    "UPDATE outbox SET attempts = attempts + 1, last_error = ?, updated_at = ? "
                    "WHERE key = ? AND status = 'dead'",
                    (error[:2000], self.now(), key),
                )
                return error
            await self._commit_transaction()
            return None
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                await db.execute("ROLLBACK")
            raise


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


def _dead_turn(key: str, segment: int, payload: bytes | str | None) -> Turn:
    """The turn a dead outbox row holds.

    Raises:
        ValueError, LookupError, TypeError: the payload is not the turn's record.
    """
    if payload is None:
        raise ValueError("the dead letter holds no payload")
    record = payload.encode("utf-8") if isinstance(payload, str) else bytes(payload)
    turn = Turn.decode(record, segment=int(segment))
    if turn.key != key:
        raise ValueError(f"the payload is turn {turn.key!r}, not {key!r}")
    if turn.n_messages == 0:
        raise ValueError("the turn holds no messages")
    return turn
