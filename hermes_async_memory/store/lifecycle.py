"""Session lifecycle events (``ops.OP_SESSION``): what a batch's events do to the sessions,
their messages and what is derived from them.

An event commits in its session's lane, after every turn of the session accepted before it,
and the writer ends a batch after an event (``Writer._process``): so the statements here run
after the messages of every turn that came before, and before any that came after.

- ``describe`` creates the session's row if it has none and sets the fields it carries
  (``tokens_estimated`` only ever turns on: some of the session's counts were estimated).
- ``end`` sets ``ended_at`` and ``end_reason`` (creating the row for a session that never
  stored a turn, so that its end is on record).
- ``delete`` removes the session, its messages with their index rows (the delete trigger),
  its recall requests and cached blocks, and the replica rows still waiting to send its turns.
  Prune's form carries a cut-off (and maybe a source): the session goes only if, at commit, it
  has ended, ended and was last updated before the cut-off, and no other process has a turn of
  it waiting in the shared inbox. A pending turn accepted before the prune committed first and
  made the session recent: it stays.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from ..ops import SessionOp, parse_session
from ..turns import Turn
from .connections import Connections
from .sql import KEY_CHUNK, sql_literal

_JSON = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"))

DESCRIBE = """
INSERT INTO sessions (id, source, user_id, model, parent_session_id, started_at, updated_at,
                      model_config, system_prompt, tokens_estimated)
VALUES ({id}, coalesce({source}, {default_source}), {user}, {model}, {parent}, {at}, {at},
        {model_config}, {system_prompt}, {estimated})
ON CONFLICT (id) DO UPDATE SET
    source = coalesce({source}, sessions.source),
    user_id = coalesce(sessions.user_id, excluded.user_id),
    model = coalesce({model}, sessions.model),
    parent_session_id = coalesce({parent}, sessions.parent_session_id),
    model_config = coalesce({model_config}, sessions.model_config),
    system_prompt = coalesce({system_prompt}, sessions.system_prompt),
    tokens_estimated = max(sessions.tokens_estimated, {estimated}),
    updated_at = max(sessions.updated_at, excluded.updated_at);
"""
END = """
INSERT INTO sessions (id, source, user_id, started_at, updated_at, ended_at, end_reason)
VALUES ({id}, {default_source}, {user}, {at}, {at}, {at}, {reason})
ON CONFLICT (id) DO UPDATE SET
    user_id = coalesce(sessions.user_id, excluded.user_id),
    ended_at = excluded.ended_at, end_reason = excluded.end_reason,
    updated_at = max(sessions.updated_at, excluded.updated_at);
"""
# Prune's condition on the session, checked by each statement of its delete (the sessions row
# goes last). The event's own inbox row, if it came through the inbox, is not a pending turn.
PRUNE_CONDITION = """
EXISTS (SELECT 1 FROM sessions AS p WHERE p.id = {id} AND p.ended_at IS NOT NULL
        AND p.ended_at < {before} AND p.updated_at < {before} {source_clause})
AND NOT EXISTS (SELECT 1 FROM inbox WHERE inbox.session_id = {id} AND inbox.key != {key})
"""
DELETE = """
DELETE FROM messages WHERE session_id = {id} AND {condition};
DELETE FROM recall_requests WHERE session_id = {id} AND {condition};
DELETE FROM recall_results WHERE session_id = {id} AND {condition};
DELETE FROM replica_outbox WHERE session_id = {id} AND {condition};
DELETE FROM sessions WHERE id = {id} AND {condition};
"""


def session_statements(ops: Sequence[Turn], default_source: str) -> list[str]:
    """The statements that apply lifecycle events ``ops``, in order, for a batch's
    transaction (their outbox keys are marked done with the batch's other operations)."""
    script = []
    for t in ops:
        op = parse_session(json.loads(t.payload), t.payload)
        script.append(_statement(op, default_source))
    return script


def _statement(op: SessionOp, default_source: str) -> str:
    sid, at = sql_literal(op.session_id), repr(op.accepted_at)
    if op.action == "describe":
        f = op.fields
        config = f.get("model_config")
        return DESCRIBE.format(
            id=sid, at=at, default_source=sql_literal(default_source), user=_text(op.user_id),
            source=_text(f.get("source")), model=_text(f.get("model")),
            parent=_text(f.get("parent_session_id")),
            model_config="NULL" if config is None else sql_literal(_JSON.encode(config)),
            system_prompt=_text(f.get("system_prompt")),
            estimated=int(bool(f.get("tokens_estimated"))))
    if op.action == "end":
        return END.format(id=sid, at=at, default_source=sql_literal(default_source),
                          user=_text(op.user_id), reason=_text(op.reason))
    if op.ended_before is None:
        condition = "true"
    else:
        condition = PRUNE_CONDITION.format(
            id=sid, before=repr(op.ended_before), key=sql_literal(op.record_key),
            source_clause="" if op.source is None else f"AND p.source = {sql_literal(op.source)}")
    return DELETE.format(id=sid, condition=condition)


def _text(value: object) -> str:
    return "NULL" if value is None else sql_literal(str(value))


class Lifecycle(Connections):
    """The reads prune needs (its deletes are batch statements, above)."""

    async def prunable_sessions(self, before: float, source: str | None
                                ) -> list[tuple[str, str | None]]:
        """(id, user) of the sessions that ended and were last updated before ``before``
        (of ``source`` only, when given), oldest first."""
        sql = ("SELECT id, user_id FROM sessions WHERE ended_at IS NOT NULL AND ended_at < ? "
               "AND updated_at < ?")
        params: list[object] = [before, before]
        if source is not None:
            sql += " AND source = ?"
            params.append(source)
        async with self.reader() as db, db.execute(sql + " ORDER BY ended_at, id",
                                                   params) as cur:
            return [(str(r[0]), None if r[1] is None else str(r[1]))
                    for r in await cur.fetchall()]

    async def existing_sessions(self, ids: Sequence[str]) -> set[str]:
        """Which of ``ids`` have a session row."""
        found: set[str] = set()
        async with self.reader() as db:
            for i in range(0, len(ids), KEY_CHUNK):
                chunk = list(ids[i : i + KEY_CHUNK])
                async with db.execute(
                        f"SELECT id FROM sessions WHERE id IN ({','.join('?' * len(chunk))})",
                        chunk) as cur:
                    found.update(str(r[0]) for r in await cur.fetchall())
        return found
