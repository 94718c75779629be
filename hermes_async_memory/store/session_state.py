"""Hermes Agent's own state beside the sessions, written by records in the outbox like a
session's (``ops.STATE_ACTIONS``), and read back:

- ``meta``: a key of its key-value state (``state_meta``: the time of the last automatic
  prune, ...) set, or removed with a value of None; in the one lane ``ops.lane_of_meta()``,
  so the writes to it commit in the order they were accepted.
- ``lock``: a session's compression lock (``compression_locks``), in the session's lane. An
  acquire first drops a lease that ended before the caller's time, then takes the lock if no
  one holds it; a refresh extends the holder's lease if it has not ended; a release drops it
  if the holder still holds it. Each is one statement group in the batch's transaction, so
  two acquires are decided in commit order; the caller learns the outcome by reading the row
  once its record committed (``SessionWrites.compression_lock``). The times are the caller's
  (the record carries them), so a lease means what its holder's clock says.
"""

from __future__ import annotations

from typing import Any

from ..ops import SessionOp
from .connections import Connections
from .sql import sql_literal

META_SET = """
INSERT INTO state_meta (key, value) VALUES ({key}, {value})
ON CONFLICT (key) DO UPDATE SET value = excluded.value;
"""
META_DELETE = "DELETE FROM state_meta WHERE key = {key};\n"
LOCK_ACQUIRE = """
DELETE FROM compression_locks WHERE session_id = {id} AND expires_at < {now};
INSERT INTO compression_locks (session_id, holder, acquired_at, expires_at)
VALUES ({id}, {holder}, {now}, {expires})
ON CONFLICT (session_id) DO NOTHING;
"""
LOCK_REFRESH = """
UPDATE compression_locks SET expires_at = {expires}
WHERE session_id = {id} AND holder = {holder} AND expires_at >= {now};
"""
LOCK_RELEASE = """
DELETE FROM compression_locks WHERE session_id = {id} AND holder = {holder};
"""


def state_statement(op: SessionOp) -> str:
    """The SQL that applies a ``meta`` or ``lock`` record (checked by ``ops.parse_session``)."""
    args: dict[str, Any] = op.args or {}
    if op.action == "meta":
        key = sql_literal(args["k"])
        if args.get("v") is None:
            return META_DELETE.format(key=key)
        return META_SET.format(key=key, value=sql_literal(args["v"]))
    mode = args["m"]
    sql = {"acquire": LOCK_ACQUIRE, "refresh": LOCK_REFRESH, "release": LOCK_RELEASE}[mode]
    return sql.format(id=sql_literal(op.session_id), holder=sql_literal(args["h"]),
                      now=repr(float(args["n"])),
                      expires=repr(float(args.get("e") or 0.0)))


class SessionState(Connections):
    """Reads of Hermes Agent's state (the writes are batch statements, above)."""

    async def compression_lock(self, session_id: str) -> tuple[str, float] | None:
        """(holder, expires_at) of the session's compression lock; None when there is none
        (an ended lease is still there until the next acquire drops it)."""
        async with self.reader() as db, db.execute(
                "SELECT holder, expires_at FROM compression_locks WHERE session_id = ?",
                (session_id,)) as cur:
            row = await cur.fetchone()
        return None if row is None else (str(row[0]), float(row[1]))

    async def meta_value(self, key: str) -> str | None:
        """A key of Hermes Agent's key-value state; None when it has none."""
        async with self.reader() as db, db.execute(
                "SELECT value FROM state_meta WHERE key = ?", (key,)) as cur:
            row = await cur.fetchone()
        return None if row is None or row[0] is None else str(row[0])
