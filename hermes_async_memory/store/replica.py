"""Each replica backend's own outbox: a row per committed turn, written in the turn's commit
transaction, removed once the backend has the turn; 'dead' with the reason when it cannot."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import StoreError
from ..turns import Turn
from .connections import Connections
from .sql import KEY_CHUNK

# The messages of the turns given as a JSON list of [first id, end id, turn key]: one primary
# key range search per turn (the CROSS JOIN keeps the list as the outer loop).
_TURN_MESSAGES = """
SELECT m.turn_key, m.session_id, m.user_id, m.timestamp, m.role, m.content, m.tool_calls,
       m.tool_call_id, m.tool_name, m.metadata, m.token_count, m.fields, m.id
FROM json_each(?) AS r CROSS JOIN messages AS m
WHERE m.id >= json_extract(r.value, '$[0]') AND m.id < json_extract(r.value, '$[1]')
  AND m.turn_key = json_extract(r.value, '$[2]')
ORDER BY m.id
"""


class ReplicaRow(NamedTuple):
    """A committed turn waiting for a replica backend."""

    id: int
    turn_key: str
    session_id: str
    first_id: int
    n_messages: int
    attempts: int
    tried: bool = False  # a write of it failed before (counted or not)
    payload: str | None = None  # an operation's record (key-value, lifecycle): no messages


class ReplicaOutbox(Connections):
    """The turns waiting for a replica backend, and what became of them."""

    async def replica_pending(self, backend: str, sessions: int, limit: int
                              ) -> list[ReplicaRow]:
        """Turns waiting for ``backend``: every waiting turn (up to ``limit``, in commit
        order) of the ``sessions`` sessions whose oldest waiting turn is oldest. A session's
        backlog goes out together, so a remote store that takes messages per session gets
        one call for many turns, and no session waits behind a busier one."""
        async with self.reader() as db, db.execute(
            "SELECT id, turn_key, session_id, first_id, n_messages, attempts, "
            "last_error IS NOT NULL, payload FROM replica_outbox "
            "WHERE backend = :b AND status = 'pending' AND session_id IN ("
            "  SELECT session_id FROM replica_outbox WHERE backend = :b AND status = 'pending' "
            "  GROUP BY session_id ORDER BY min(id) LIMIT :sessions) "
            "ORDER BY id LIMIT :limit",
            {"b": backend, "sessions": sessions, "limit": limit},
        ) as cur:
            return [ReplicaRow(r[0], r[1], r[2], r[3], r[4], r[5], bool(r[6]), r[7])
                    for r in await cur.fetchall()]

    async def replica_waiting(self, backend: str, session_id: str) -> int:
        """How many of a session's (or a lane's) records still wait for ``backend``."""
        async with self.reader() as db, db.execute(
            "SELECT count(*) FROM replica_outbox WHERE backend = ? AND status = 'pending' "
            "AND session_id = ?", (backend, session_id)) as cur:
            row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def replica_turns(self, rows: Sequence[ReplicaRow]) -> list[Turn]:
        """The committed turns behind replica rows, rebuilt from their messages, in order;
        each turn's ``seq`` is its replica row. A turn whose messages are gone is left out.
        An operation (a key-value write, a session lifecycle event) comes back as its row
        holds it (``Turn.kind`` says which it is)."""
        if not rows:
            return []
        records = {r.turn_key: Turn.decode(r.payload, seq=r.id)
                   for r in rows if r.payload is not None}
        # Each row names its turn's messages by primary key (they were inserted together, so
        # their ids are consecutive): a lookup per turn, never a scan of the turns between
        # two sparse rows. The key must match too, in case those ids were reused since.
        ranges = json.dumps([[r.first_id, r.first_id + r.n_messages, r.turn_key]
                             for r in rows if r.payload is None])
        by_key: dict[str, list[Any]] = {}
        async with self.reader() as db, db.execute(_TURN_MESSAGES, (ranges,)) as cur:
            async for m in cur:
                by_key.setdefault(m[0], []).append(m)
        turns = []
        for n, r in enumerate(rows):
            if n % 200 == 199:
                await asyncio.sleep(0)  # rebuilding thousands of turns: let the loop run
            if r.turn_key in records:
                turns.append(records[r.turn_key])
                continue
            msgs = by_key.get(r.turn_key)
            if not msgs:
                continue
            first = msgs[0]
            metadata = json.loads(first[9]) if first[9] else None
            turns.append(Turn.build(
                key=r.turn_key, session_id=first[1], user_id=first[2], accepted_at=first[3],
                messages=[(m[4], m[5], m[6], m[7], m[8], m[10],
                           None if m[3] == first[3] else m[3], m[11]) for m in msgs],
                metadata=metadata, first_id=first[12],
            )._replace(seq=r.id))
        return turns

    async def replica_done(self, ids: Sequence[int]) -> None:
        """The backend has these turns: their rows go (outside the writer's batches, which
        could roll the delete back and send a turn twice)."""
        db = await self.aux()
        for i in range(0, len(ids), KEY_CHUNK):
            chunk = [int(x) for x in ids[i : i + KEY_CHUNK]]
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

    async def replica_oldest_pending(self, backend: str) -> float | None:
        """When the oldest record still waiting for ``backend`` was accepted (seconds since
        the epoch), None when none waits: how far the replica lags behind."""
        async with self.reader() as db, db.execute(
            "SELECT coalesce((SELECT timestamp FROM messages WHERE id = r.first_id), "
            "json_extract(r.payload, '$.t')) FROM replica_outbox r "
            "WHERE r.backend = ? AND r.status = 'pending' ORDER BY r.id LIMIT 1", (backend,),
        ) as cur:
            row = await cur.fetchone()
        return None if row is None or row[0] is None else float(row[0])


def requeue_dead_letters(path: Path, backend: str, keys: Sequence[str] | None = None, *,
                         busy_timeout_ms: int = 10_000) -> int:
    """Hand ``backend``'s dead letters (those of ``keys``, or all) back to its outbox in the
    store file at ``path``; returns how many. The replicator of the pipeline running on the
    store sends them, and with ``attempts = 1`` (not a first send) the backend first checks
    what it already holds: a dead letter may have been sent before.

    Synchronous, on a connection of its own, for the command line: its caller may be inside
    an event loop of its own, and an operator waits for the write lock as long as a reader
    would (``busy_timeout_ms``), not the pipeline's short per-statement wait.

    Raises:
        StoreError: the file cannot be written (the keys requeued before stay requeued).
    """
    sql = ("UPDATE replica_outbox SET status = 'pending', attempts = 1 "
           "WHERE backend = ? AND status = 'dead'")
    try:
        conn = sqlite3.connect(path, timeout=busy_timeout_ms / 1000, isolation_level=None)
        try:
            if keys is None:
                return conn.execute(sql, (backend,)).rowcount
            requeued = 0
            for i in range(0, len(keys), KEY_CHUNK):
                chunk = list(keys[i : i + KEY_CHUNK])
                requeued += conn.execute(
                    f"{sql} AND turn_key IN ({','.join('?' * len(chunk))})", (backend, *chunk)
                ).rowcount
            return requeued
        finally:
            conn.close()
    except sqlite3.Error as exc:
        raise StoreError(f"cannot write {path}: {exc}") from exc
