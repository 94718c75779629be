"""Messages and sessions: the group commit that stores them, and the reads of them (FTS5
search, a session's messages, its recent turns, its row)."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from ..errors import LeaseLostError
from ..turns import Turn
from .batch import INSERT_MESSAGE_ROW, INSERT_MESSAGES, Batch
from .connections import Connections, rollback
from .sql import KEY_CHUNK, SESSION_MESSAGES, decode_message, fetch_dicts, single_statements
from .text_index import word_reindex_step

log = structlog.get_logger(__name__)

# A recall's candidates: the best ``?`` messages of the MATCH by bm25; the first ``?`` of
# them (those the block may show) with their text and the ids and texts of the messages
# before and after each in its session that are in its scope too (another user may send
# the same session id: their messages are never shown). idx_messages_session: a seek each
# way, then a step over any other scope's messages. The rest only lend their scores to
# their neighbours' windows. One statement: a recall is one round trip to a reader (a
# second one only for a hit longer than RECALL_SOURCE_CHARS: FTS5's snippet of it).
RECALL_POOL = """
WITH hits AS MATERIALIZED (
    SELECT rowid AS id, rank, row_number() OVER (ORDER BY rank) AS n FROM (
        SELECT rowid, rank FROM messages_fts WHERE messages_fts MATCH ?1 ORDER BY rank LIMIT ?2)
), near AS MATERIALIZED (
    SELECT h.id, h.rank, m.session_id, h.n <= ?3 AS shown, m.role, m.timestamp,
           CASE WHEN h.n > ?3 THEN NULL WHEN length(m.content) > ?4 THEN ''
                ELSE m.content END AS content,
           CASE WHEN h.n <= ?3 THEN (SELECT max(p.id) FROM messages AS p
               WHERE p.session_id = m.session_id AND p.id < h.id AND p.scope = m.scope) END
               AS before,
           CASE WHEN h.n <= ?3 THEN (SELECT min(x.id) FROM messages AS x
               WHERE x.session_id = m.session_id AND x.id > h.id AND x.scope = m.scope) END
               AS after
    FROM hits AS h JOIN messages AS m ON m.id = h.id
)
SELECT near.id, near.session_id, near.rank, near.before, near.after, near.shown,
       near.role, near.timestamp, near.content,
       b.role, b.timestamp, substr(b.content, 1, ?4), a.role, a.timestamp, substr(a.content, 1, ?4)
FROM near LEFT JOIN messages AS b ON b.id = near.before
LEFT JOIN messages AS a ON a.id = near.after
ORDER BY near.rank
"""
# The characters of a message a recall reads: it shows at most a window of them. A longer
# hit is shown as FTS5's snippet of it, SNIPPET_TOKENS around what matched.
RECALL_SOURCE_CHARS = 20_000
RECALL_SNIPPET = """
SELECT rowid, snippet(messages_fts, 0, '', '', '…', 64) FROM messages_fts
WHERE messages_fts MATCH ? AND rowid IN ({ids})
"""


@dataclass(frozen=True, slots=True)
class Said:
    """A message shown beside a recalled one: the one before or after it in its session."""

    message_id: int
    role: str
    text: str


@dataclass(frozen=True, slots=True)
class Hit:
    """One recalled message (its text, whole or the part around what matched), with the
    messages shown beside it."""

    message_id: int
    session_id: str
    role: str
    timestamp: float
    snippet: str
    before: tuple[Said, ...] = ()
    after: tuple[Said, ...] = ()


@dataclass(frozen=True, slots=True)
class PoolRow:
    """A recall's candidate: a matching message, its bm25 rank (lower is better) and the
    ids of its neighbours in its session (None at either end)."""

    message_id: int
    session_id: str
    rank: float
    before: int | None
    after: int | None


@dataclass(frozen=True, slots=True)
class StoredTurn:
    """A stored turn as the prefetch cache shows it: its first user text and its last
    non-empty assistant text, each with the message it comes from (row id and timestamp;
    None when the turn has no such message)."""

    key: str
    user_id: str | None
    user_text: str
    assistant_text: str
    user_message_id: int | None = None
    user_timestamp: float | None = None
    assistant_message_id: int | None = None
    assistant_timestamp: float | None = None


class Messages(Connections):
    """Writes and reads of the messages, their index and the sessions."""

    async def commit(self, turns: Sequence[Turn]) -> None:
        """Store ``turns`` in one transaction (see ``commit_batch``)."""
        await self.commit_batch(Batch.of(turns, self.source, self.ids))

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
        script = batch.statements(replica=self.replica, replica_kv=self.replica_kv,
                                   replica_templates=self.replica_templates,
                                   now=self.now(), tool_log=self.tool_log)
        script += batch.lease_statements()
        try:
            if batch.has_nul:  # rare: bind the rows one by one, NUL and all
                await db.execute("BEGIN IMMEDIATE")
                await db.executemany(INSERT_MESSAGE_ROW, batch.message_rows())
                # Statement by statement: executescript would first commit the open
                # transaction (a lifecycle event's text holds several).
                for statement in (s for text in script for s in single_statements(text)):
                    await db.execute(statement)
            else:
                head, tail = INSERT_MESSAGES.split("{turns}")
                await db.executescript(
                    "".join(["BEGIN IMMEDIATE;", head, *batch.literal_parts(), tail, *script])
                )
            await self._commit_transaction()
        except sqlite3.IntegrityError as exc:
            await rollback(db)
            if batch.inbox_ids and not await self._lease_holds(batch):
                raise LeaseLostError(
                    f"the lease on {len(batch.inbox_ids)} inbox turns was taken over") from exc
            raise
        except BaseException:
            await rollback(db)
            raise

    async def _lease_holds(self, batch: Batch) -> bool:
        """Whether ``batch.lease_owner`` still holds every one of its inbox turns."""
        ids = [int(i) for i in batch.inbox_ids]
        held = 0
        for i in range(0, len(ids), KEY_CHUNK):
            chunk = ids[i : i + KEY_CHUNK]
            async with self.writer.execute(
                f"SELECT count(*) FROM inbox WHERE id IN ({','.join('?' * len(chunk))}) "
                "AND lease_owner = ?", (*chunk, batch.lease_owner),
            ) as cur:
                row = await cur.fetchone()
            held += int(row[0]) if row else 0
        return held == len(ids)

    async def recall_pool(self, match: str, pool: int, shown: int
                          ) -> tuple[list[PoolRow], dict[int, tuple[str, float, str]]]:
        """A recall's candidates for one FTS5 MATCH expression (quoted and scoped by the
        caller), best first: ``pool`` of them, the first ``shown`` with their neighbours'
        ids; and role, timestamp and text (its first RECALL_SOURCE_CHARS characters) of those
        and of their neighbours (``RECALL_POOL``). None without the word index (a SQLite
        without FTS5: ``full_text``)."""
        if not self.full_text:
            return [], {}
        async with self.reader() as db:
            # One hand-over to the reader's thread, not three (execute, fetch, close).
            rows = list(await db.execute_fetchall(
                RECALL_POOL, (match, pool, shown, RECALL_SOURCE_CHARS)))
            texts: dict[int, tuple[str, float, str]] = {}
            long: list[int] = []
            for r in rows:
                if r[5]:
                    texts[int(r[0])] = (r[6], float(r[7]), r[8] or "")
                    if r[8] == "":  # longer than RECALL_SOURCE_CHARS (or empty)
                        long.append(int(r[0]))
            if long:
                for rowid, snip in await db.execute_fetchall(
                        RECALL_SNIPPET.format(ids=",".join(map(str, long))), (match,)):
                    role, at, _ = texts[int(rowid)]
                    texts[int(rowid)] = (role, at, snip or "")
        for r in rows:  # the neighbours: a hit's own text (or snippet) stands
            if r[3] is not None and r[9] is not None:
                texts.setdefault(int(r[3]), (r[9], float(r[10]), r[11] or ""))
            if r[4] is not None and r[12] is not None:
                texts.setdefault(int(r[4]), (r[12], float(r[13]), r[14] or ""))
        return [PoolRow(int(r[0]), r[1], float(r[2]), r[3], r[4]) for r in rows], texts

    async def refresh_frequent_terms(self, min_rows: int, ratio: float = 0.0) -> frozenset[str]:
        """Terms in more than ``max(min_rows, ratio * messages)`` messages: too common to
        rank on (``read_frequent_terms``), kept as ``frequent_terms`` for the recalls."""
        self._frequent_args = (min_rows, ratio)
        self.frequent_terms = await self.read_frequent_terms(min_rows, ratio)
        return self.frequent_terms

    async def reindex_chore(self) -> bool:
        """One slice of the word index's rebuild (``text_index.word_reindex_step``), for the
        writer to run between its batches; whether more is left. The last one swaps the
        stemming index in, and the frequent terms are read anew from it."""
        if self.reindex is None:
            return False
        self.reindex = await word_reindex_step(self.writer)
        if self.reindex is not None:
            return True
        self.word_index_stems = True
        log.info("word_index_rebuilt")
        if self._frequent_args is not None:
            await self.refresh_frequent_terms(*self._frequent_args)
        return False

    async def read_frequent_terms(self, min_rows: int, ratio: float = 0.0) -> frozenset[str]:
        """Terms in more than ``max(min_rows, ratio * messages)`` messages. A scan of the
        whole vocabulary (~0.5 s at 1M messages), on a reader; nothing is kept. None without
        the word index."""
        if not self.full_text:
            return frozenset()
        async with self.reader() as db:
            async with db.execute("SELECT coalesce(max(id), 0) FROM messages") as cur:
                row = await cur.fetchone()
            threshold = max(min_rows, int(ratio * (row[0] if row else 0)))
            async with db.execute(
                "SELECT term FROM messages_vocab WHERE col = 'content' AND doc > ?", (threshold,)
            ) as cur:
                rows = await cur.fetchall()
        return frozenset(r[0] for r in rows)

    async def get_messages(self, session_id: str) -> list[dict[str, Any]]:
        """A session's messages in order, as seed 001's ``get_messages`` (``sql.MESSAGE_COLUMNS``,
        tool calls and metadata decoded)."""
        async with self.reader() as db:
            rows = await fetch_dicts(db, SESSION_MESSAGES, (session_id,))
        return [decode_message(r) for r in rows]

    async def recent_turns(self, session_id: str, n: int
                           ) -> list[tuple[str, str | None, str, str]]:
        """The session's last ``n`` stored turns, oldest first:
        (turn key, user id, first user text, last non-empty assistant text)."""
        return [(t.key, t.user_id, t.user_text, t.assistant_text)
                for t in await self.recent_stored_turns(session_id, n)]

    async def recent_stored_turns(self, session_id: str, n: int) -> list[StoredTurn]:
        """The session's last ``n`` stored turns, oldest first, with the messages their
        texts come from."""
        async with self.reader() as db, db.execute(
            "SELECT turn_key, user_id, role, content, id, timestamp FROM messages "
            "WHERE session_id = ? AND turn_key IN (SELECT turn_key FROM messages "
            "WHERE session_id = ? AND ordinal = 0 ORDER BY id DESC LIMIT ?) ORDER BY id",
            (session_id, session_id, n),
        ) as cur:
            rows = await cur.fetchall()
        turns: dict[str, list[Any]] = {}
        for key, user_id, role, content, message_id, timestamp in rows:
            turn = turns.setdefault(key, [key, user_id, "", "", None, None, None, None])
            if role == "user" and not turn[2]:  # the first user message with text
                turn[2], turn[4], turn[5] = content or "", message_id, timestamp
            elif role == "assistant" and content:  # the last assistant message with text
                turn[3], turn[6], turn[7] = content, message_id, timestamp
        return [StoredTurn(*t) for t in turns.values()]
