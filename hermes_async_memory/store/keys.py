"""The idempotency keys of settled turns (the ``outbox`` table): a turn whose key is here is
stored (or dead-lettered) and is never committed again."""

from __future__ import annotations

from collections.abc import Iterable

from .connections import Connections
from .sql import KEY_CHUNK


class DoneKeys(Connections):
    """Which turns the store has settled, and forgetting keys that guard nothing."""

    async def done_keys(self, keys: Iterable[str], *, waiting: bool = False) -> set[str]:
        """Which of these turn keys the store already holds (done or dead), and with
        ``waiting``, also those waiting in the shared inbox."""
        keys = list(keys)
        found: set[str] = set()
        db = self.writer
        for i in range(0, len(keys), KEY_CHUNK):
            chunk = keys[i : i + KEY_CHUNK]
            marks = ",".join("?" * len(chunk))
            async with db.execute(f"SELECT key FROM outbox WHERE key IN ({marks})", chunk) as cur:
                found.update(r[0] for r in await cur.fetchall())
            if waiting:
                async with db.execute(
                    f"SELECT key FROM inbox WHERE key IN ({marks})", chunk
                ) as cur:
                    found.update(r[0] for r in await cur.fetchall())
        return found

    async def keys_by_segment(self, first: int) -> dict[int, list[str]]:
        """The keys the store settled from outbox segment ``first`` on, by segment (what
        tells how many records a damaged segment lost)."""
        out: dict[int, list[str]] = {}
        async with self.writer.execute("SELECT segment, key FROM outbox WHERE segment >= ?",
                                       (first,)) as cur:
            for segment, key in await cur.fetchall():
                out.setdefault(int(segment), []).append(str(key))
        return out

    async def next_segment(self) -> int:
        """One past the highest outbox segment any stored key came from."""
        async with self.writer.execute("SELECT coalesce(max(segment), 0) + 1 FROM outbox") as cur:
            row = await cur.fetchone()
        return int(row[0]) if row else 1

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
