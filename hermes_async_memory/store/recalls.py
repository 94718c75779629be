"""Recalls across processes: producers ask (``recall_requests``), the worker answers
(``recall_results``), and producers read the answers by version."""

from __future__ import annotations

from .connections import Connections

NO_USER = ""  # the user column of a session without a user: a real id is never empty


class Recalls(Connections):
    """Recall requests and results, on the auxiliary connection: they never wait for a batch."""

    async def request_recall(self, session_id: str, user_id: str | None, query: str) -> None:
        """Ask the worker for a recall; a newer request replaces an older unserved one."""
        await (await self.aux()).execute(
            "INSERT INTO recall_requests (session_id, user_id, query, after_id, requested_at) "
            "VALUES (?, ?, ?, (SELECT coalesce(max(id), 0) FROM inbox), ?) "
            "ON CONFLICT (session_id, user_id) DO UPDATE SET "
            "query = excluded.query, after_id = excluded.after_id, "
            "requested_at = excluded.requested_at",
            (session_id, user_id or NO_USER, query, self.now()),
        )

    async def take_recall_requests(self, limit: int) -> list[tuple[str, str | None, str, int]]:
        """The oldest recall requests, removed: (session_id, user_id, query, after_id)."""
        sql = (
            "DELETE FROM recall_requests WHERE rowid IN (SELECT rowid FROM "
            "recall_requests ORDER BY requested_at LIMIT ?) "
            "RETURNING session_id, user_id, query, after_id, requested_at"
        )
        async with (await self.aux()).execute(sql, (limit,)) as cur:
            rows = list(await cur.fetchall())
        rows.sort(key=lambda r: float(r[4]))
        return [(r[0], r[1] or None, r[2], int(r[3])) for r in rows]

    async def put_recall_result(self, session_id: str, user_id: str | None, query: str,
                                block: str, source: str = "local", fallback: bool = False
                                ) -> None:
        await (await self.aux()).execute(
            "INSERT INTO recall_results (session_id, user_id, query, block, version, updated_at, "
            "source, fallback) "
            "VALUES (?, ?, ?, ?, (SELECT coalesce(max(version), 0) + 1 FROM recall_results), ?, "
            "?, ?) "
            "ON CONFLICT (session_id, user_id) DO UPDATE SET "
            "query = excluded.query, block = excluded.block, version = excluded.version, "
            "updated_at = excluded.updated_at, source = excluded.source, "
            "fallback = excluded.fallback",
            (session_id, user_id or NO_USER, query, block, self.now(), source, int(fallback)),
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
        return [(r[0], r[1] or None, r[2], r[3], int(r[4]), str(r[5]), bool(r[6]))
                for r in rows]

    async def recall_version(self) -> int:
        async with self.reader() as db, db.execute(
            "SELECT coalesce(max(version), 0) FROM recall_results"
        ) as cur:
            row = await cur.fetchone()
        return int(row[0]) if row else 0

    async def prune_recall_results(self, older_than: float) -> int:
        cur = await (await self.aux()).execute(
            "DELETE FROM recall_results WHERE updated_at < ?", (older_than,))
        return cur.rowcount
