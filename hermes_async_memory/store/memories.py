"""Key-value memory: what a batch's key-value records do to the ``memories`` table, and the
reads of it (one entry, a user's keys, ranked full-text search).

A batch applies its key-value records as if one by one, in order, in two statements: each
(user, key)'s records in the batch are first folded into their net effect (gone; updated in
place, keeping ``created_at``; or deleted and made anew), so put, delete, put of one key in
one batch ends as a fresh entry whose ``created_at`` is the second put's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..ops import parse_record
from ..turns import Turn, scope_token_for
from .connections import Connections
from .sql import sql_literal

_ROWS = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"))

DELETE_ENTRIES = """
DELETE FROM memories WHERE id IN (
    SELECT m.id FROM json_each({rows}) AS r
    JOIN memories AS m ON m.user_id = r.value ->> 0 AND m.key = r.value ->> 1
);
"""
UPSERT_ENTRIES = """
INSERT INTO memories (user_id, key, value, metadata, created_at, updated_at, scope)
SELECT r.value ->> 0, r.value ->> 1, r.value ->> 2, r.value ->> 3, r.value ->> 4,
       r.value ->> 5, r.value ->> 6
FROM json_each({rows}) AS r WHERE true
ON CONFLICT (user_id, key) DO UPDATE SET
    value = excluded.value, metadata = excluded.metadata, updated_at = excluded.updated_at;
"""
INSERT_OPS_DONE = """
INSERT INTO outbox (key, session_id, segment, status, attempts, accepted_at, updated_at)
SELECT r.value ->> 0, r.value ->> 1, r.value ->> 2, 'done', 1, r.value ->> 3, {now}
FROM json_each({rows}) AS r;
"""
# A replica backend that mirrors key-value memory gets each record as it was written, in
# lane order: the row carries the record itself (it has no message rows to be rebuilt from).
INSERT_OPS_REPLICA = """
INSERT INTO replica_outbox (backend, turn_key, session_id, first_id, n_messages, payload)
SELECT {backend}, r.value ->> 0, r.value ->> 1, 0, 0, r.value ->> 2
FROM json_each({rows}) AS r WHERE true
ON CONFLICT (backend, turn_key) DO NOTHING;
"""
_ENTRY = "SELECT key, value, user_id, created_at, updated_at, metadata FROM memories "
QUERY = (
    "SELECT m.key, m.value, m.user_id, m.created_at, m.updated_at, m.metadata "
    "FROM memories_fts JOIN memories AS m ON m.id = memories_fts.rowid "
    "WHERE memories_fts MATCH ? AND m.user_id = ? "
    "ORDER BY bm25(memories_fts, 2.0, 1.0, 0.0), m.updated_at DESC LIMIT ?"
)
EntryRow = tuple[str, str, str, float, float, str | None]


def ops_done(ops: Sequence[Turn], now_sql: str) -> str:
    """The statement that marks a batch's operations (of every kind) done."""
    done = [[t.key, t.session_id, t.segment, t.accepted_at] for t in ops]
    return INSERT_OPS_DONE.format(rows=sql_literal(_ROWS.encode(done)), now=now_sql)


def op_statements(ops: Sequence[Turn], replica: str | None = None) -> list[str]:
    """The statements that apply ``ops`` (key-value records, in batch order) for a batch's
    transaction; with ``replica``, each also waits for that backend."""
    net: dict[tuple[str, str], list[Any]] = {}  # (user, key) -> [effect, value, md, c, u]
    for t in ops:
        op = parse_record(t.payload)
        assert op is not None  # the batch holds only key-value operations here
        was = net.get((op.user_id, op.key))
        entry: list[Any]
        if op.action == "del":
            entry = ["gone"]
        elif was is None:
            entry = ["update", op.value, op.metadata, op.accepted_at, op.accepted_at]
        elif was[0] == "gone":
            entry = ["renew", op.value, op.metadata, op.accepted_at, op.accepted_at]
        else:
            entry = [was[0], op.value, op.metadata, was[3], op.accepted_at]
        net[(op.user_id, op.key)] = entry
    deletes = [[u, k] for (u, k), e in net.items() if e[0] != "update"]
    puts = [
        [u, k, e[1], None if e[2] is None else _ROWS.encode(e[2]), e[3], e[4],
         scope_token_for(u, None)]
        for (u, k), e in net.items() if e[0] != "gone"
    ]
    script = []
    if deletes:
        script.append(DELETE_ENTRIES.format(rows=sql_literal(_ROWS.encode(deletes))))
    if puts:
        script.append(UPSERT_ENTRIES.format(rows=sql_literal(_ROWS.encode(puts))))
    if replica is not None:
        script.append(replica_statement(ops, replica))
    return script


def replica_statement(ops: Sequence[Turn], replica: str) -> str:
    """The statement that queues operations' records (of a kind the replica backend keeps,
    in batch order) for ``replica``, each as it was written."""
    rows = _ROWS.encode([[t.key, t.session_id, t.payload] for t in ops])
    return INSERT_OPS_REPLICA.format(backend=sql_literal(replica), rows=sql_literal(rows))


class Memories(Connections):
    """Reads of the key-value memory (its writes are batch statements, above)."""

    async def memory_entry(self, user_id: str, key: str) -> EntryRow | None:
        async with self.reader() as db, db.execute(
                _ENTRY + "WHERE user_id = ? AND key = ?", (user_id, key)) as cur:
            row = await cur.fetchone()
        return None if row is None else _row(row)

    async def memory_keys(self, user_id: str) -> list[str]:
        """The user's keys, most recently updated first."""
        async with self.reader() as db, db.execute(
                "SELECT key FROM memories WHERE user_id = ? ORDER BY updated_at DESC, key",
                (user_id,)) as cur:
            return [str(r[0]) for r in await cur.fetchall()]

    async def memory_entries(self, user_id: str, limit: int, offset: int = 0
                             ) -> list[EntryRow]:
        """The user's entries, most recently updated first."""
        async with self.reader() as db, db.execute(
                _ENTRY + "WHERE user_id = ? ORDER BY updated_at DESC, key LIMIT ? OFFSET ?",
                (user_id, limit, offset)) as cur:
            return [_row(r) for r in await cur.fetchall()]

    async def memory_users(self, limit: int) -> list[tuple[str, int]]:
        """Users with key-value entries, by id, with their entry counts."""
        async with self.reader() as db, db.execute(
                "SELECT user_id, count(*) FROM memories GROUP BY user_id ORDER BY user_id "
                "LIMIT ?", (limit,)) as cur:
            return [(str(r[0]), int(r[1])) for r in await cur.fetchall()]

    async def memory_query(self, user_id: str, match: str, limit: int) -> list[EntryRow]:
        """Entries whose key or value match ``match`` (an FTS5 expression the caller built
        from quoted terms), best first.

        Raises:
            FullTextUnavailableError: the store keeps no full-text index (no FTS5).
        """
        self.require_full_text()
        async with self.reader() as db, db.execute(QUERY, (match, user_id, limit)) as cur:
            return [_row(r) for r in await cur.fetchall()]

    async def memory_find(self, user_id: str, prefix: str, needle: str) -> EntryRow | None:
        """The user's most recently updated entry whose key starts with ``prefix`` and
        whose value holds ``needle`` (plain text, case-sensitive), if any."""
        async with self.reader() as db, db.execute(
                _ENTRY + "WHERE user_id = ? AND substr(key, 1, ?) = ? AND instr(value, ?) > 0 "
                "ORDER BY updated_at DESC, key LIMIT 1",
                (user_id, len(prefix), prefix, needle)) as cur:
            row = await cur.fetchone()
        return None if row is None else _row(row)

    async def memory_counts(self) -> tuple[int, int]:
        """(entries, users) in the whole store."""
        async with self.reader() as db, db.execute(
                "SELECT count(*), count(DISTINCT user_id) FROM memories") as cur:
            row = await cur.fetchone()
        return (int(row[0]), int(row[1])) if row else (0, 0)

    async def lane_records(self, lane: str) -> list[str]:
        """Records of ``lane`` handed in to the shared inbox and not committed yet, oldest
        first: what another process acknowledged that a read must see."""
        async with self.reader() as db, db.execute(
                "SELECT payload FROM inbox WHERE session_id = ? AND error IS NULL ORDER BY id",
                (lane,)) as cur:
            return [str(r[0]) for r in await cur.fetchall()]


def _row(r: Any) -> EntryRow:
    return (str(r[0]), str(r[1]), str(r[2]), float(r[3]), float(r[4]),
            None if r[5] is None else str(r[5]))
