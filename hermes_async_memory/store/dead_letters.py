"""Dead letters: turns the store cannot hold, kept in the ``outbox`` table with why, listed
and replayed under their own keys."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import StoreError
from ..turns import TURN, Turn
from .batch import INSERT_MESSAGE_ROW, Batch
from .connections import Connections, rollback
from .sql import single_statements

_INSERT_DEAD = """
INSERT INTO outbox (key, session_id, segment, status, attempts, last_error, payload,
                    accepted_at, updated_at)
VALUES (?, ?, ?, 'dead', ?, ?, ?, ?, ?)
ON CONFLICT (key) DO UPDATE SET status = 'dead', attempts = excluded.attempts,
    last_error = excluded.last_error, payload = excluded.payload, updated_at = excluded.updated_at
"""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    key: str
    session_id: str
    attempts: int
    last_error: str
    updated_at: float


class DeadLetters(Connections):
    """Keeping, listing and replaying dead letters."""

    async def dead_letter(self, turn: Turn, error: str, attempts: int, payload: bytes) -> None:
        """Keep a turn that cannot be stored, with why; it is no longer retried."""
        db = self.writer
        now = self.now()
        await db.execute(
            _INSERT_DEAD,
            (turn.key, turn.session_id, turn.segment, attempts, error[:2000], payload,
             turn.accepted_at, now),
        )

    async def dead_letters(self, limit: int = 100) -> list[DeadLetter]:
        async with self.reader() as db, db.execute(
            "SELECT key, session_id, attempts, last_error, updated_at FROM outbox "
            "WHERE status = 'dead' ORDER BY updated_at LIMIT ?",
            (limit,),
        ) as cur:
            rows = await cur.fetchall()
        return [DeadLetter(*r) for r in rows]

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
                batch = Batch.of([_dead_turn(key, row[0], row[1])], self.source, self.ids)
                await db.execute("DELETE FROM outbox WHERE key = ?", (key,))
                # Bound row by row, as commit_batch does for text with NUL: one turn, and
                # inside a transaction executescript would first commit.
                await db.executemany(INSERT_MESSAGE_ROW, batch.message_rows())
                for text in batch.statements(replica=self.replica, replica_kv=self.replica_kv,
                                             replica_templates=self.replica_templates,
                                             now=self.now(), tool_log=self.tool_log):
                    for statement in single_statements(text):
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
            await rollback(db)
            raise



async def replay_file_dead_letters(path: Path, keys: Iterable[str], *, source: str,
                                   replica: str | None, busy_timeout_ms: int
                                   ) -> tuple[list[str], dict[str, str]]:
    """``replay_dead_letters`` on the store file at ``path``, from a process beside the one
    that writes it (the admin CLI, the inspector): a writer connection of its own for the
    replay's transactions, closed after. ``replica``: the backend a replayed turn is then
    queued for (None: none).

    Raises:
        StoreError: the file cannot be opened or written.
    """
    from . import SqliteStore

    store = SqliteStore(path, readers=0, busy_timeout_ms=busy_timeout_ms, source=source)
    if replica is not None:
        store.replica = replica
    await store.open()
    try:
        return await store.replay_dead_letters(keys)
    finally:
        await store.aclose()


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
    if turn.n_messages == 0 and turn.kind == TURN:
        raise ValueError("the turn holds no messages")
    return turn
