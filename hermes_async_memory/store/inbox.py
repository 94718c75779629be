"""The shared inbox (several processes, one memory): producers hand their turns in, a worker
claims them under a lease and commits them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from ..slices import CHUNK, maybe_yield
from ..turns import Turn
from .connections import Connections, rollback
from .sql import KEY_CHUNK, sql_literal

# Rows fetched per call from a large result.
FETCH_ROWS = 250

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


class Inbox(Connections):
    """Handing turns in, claiming them, and the leases on them."""

    async def forward_batch(self, turns: Sequence[Turn]) -> None:
        """A producer's turns into the shared inbox, in accept order, in one transaction.
        Turns the store already holds or already has waiting are skipped. Their rows are
        rendered a chunk at a time, the event loop running between chunks.

        Raises:
            sqlite3.Error: the transaction failed and was rolled back; nothing was stored.
        """
        chunks = []
        for i in range(0, len(turns), CHUNK):
            if i:
                await maybe_yield()
            chunks.append(",".join([
                f"({sql_literal(t.key)},{sql_literal(t.session_id)},{float(t.accepted_at)!r},"
                f"'{t.payload}')"  # the record holds no quote (see Turn.build)
                for t in turns[i : i + CHUNK]
            ]))
        rows = ",".join(chunks)
        db = self.writer
        try:
            await db.executescript("BEGIN IMMEDIATE;" + _FORWARD.format(rows=rows))
            await self._commit_transaction()
        except BaseException:
            await rollback(db)
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
        rows: list[Any] = []
        async with self.writer.execute(_CLAIM, params) as cur:
            # In pieces: the store's thread holds the GIL while it turns rows into Python
            # values, and 2,000 records at once kept the event loop from running for ~3 ms.
            while chunk := await cur.fetchmany(FETCH_ROWS):
                rows.extend(chunk)
        # Already of these types (the columns' own); sorted as they are: converting each
        # value of 2,000 rows took the loop ~2 ms in one step.
        claimed = cast(list[tuple[int, str, str, float, str, str | None]], list(rows))
        claimed.sort()
        return claimed

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
        for i in range(0, len(ids), KEY_CHUNK):
            chunk = [int(x) for x in ids[i : i + KEY_CHUNK]]
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

    async def inbox_holds(self, up_to_id: int) -> bool:
        """Whether turns handed in up to ``up_to_id`` still wait (any session: a recall
        reaches across the user's sessions)."""
        async with self.reader() as db, db.execute(
            "SELECT 1 FROM inbox WHERE id <= ? LIMIT 1", (up_to_id,)
        ) as cur:
            return await cur.fetchone() is not None
