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

With a replica backend (``Connections.replica``), an event that changed the session also waits
for that backend: a ``replica_outbox`` row in the session's lane carrying the event's record,
inserted after the event's own statements (a delete's after it removed the session's waiting
rows, so that it survives them). The backend gets it after the session's earlier turns and
before its later ones. A describe, end or import also carries ``ops.SNAPSHOT_FIELD``: the
session's row as the event left it, taken in the same transaction (``SNAPSHOT``). A prune
that left its session in place, and an import that inserted nothing, send nothing.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Sequence
from typing import Any

from ..message_ids import MessageIds
from ..ops import (
    IMPORTED_MESSAGE_FIELDS,
    IMPORTED_ROW_COLUMNS,
    SNAPSHOT_FIELD,
    STATE_ACTIONS,
    SessionOp,
    parse_session,
)
from ..turns import Turn, scope_tokens
from .connections import Connections
from .session_changes import change_statement
from .session_filters import SessionFilter
from .session_state import state_statement
from .sql import (
    ID_HIGH,
    KEY_CHUNK,
    SESSION_MESSAGES,
    decode_message,
    fetch_dicts,
    sql_literal,
    where_equal,
)
from .tool_log import ToolLogConfig, end_statements, session_log_statements

CHANGES = frozenset({"update", "usage", "reopen", "replace", "fields", "active"})

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
# Hermes's end: a session that is stored and not ended yet; the first end wins.
END_FIRST = """
UPDATE sessions SET ended_at = {at}, end_reason = {reason},
    updated_at = max(updated_at, {at})
WHERE id = {id} AND ended_at IS NULL;
"""
# Prune's condition on the session, checked by each statement of its delete (the sessions row
# goes last). The event's own inbox row, if it came through the inbox, is not a pending turn.
PRUNE_CONDITION = """
EXISTS (SELECT 1 FROM sessions AS p WHERE p.id = {id} AND p.ended_at IS NOT NULL
        AND p.ended_at < {before} AND p.updated_at < {before} {source_clause})
AND NOT EXISTS (SELECT 1 FROM inbox WHERE inbox.session_id = {id} AND inbox.key != {key})
"""
# Hermes's prune: the session ended, and started before the cut-off.
PRUNE_STARTED = """
EXISTS (SELECT 1 FROM sessions AS p WHERE p.id = {id} AND p.ended_at IS NOT NULL
        AND p.started_at < {before} {source_clause})
AND NOT EXISTS (SELECT 1 FROM inbox WHERE inbox.session_id = {id} AND inbox.key != {key})
"""
# A filtered prune's: the session ended, and nothing changed it after it was picked (its
# last change is before the cut-off): what picked it still holds.
PRUNE_UNCHANGED = """
EXISTS (SELECT 1 FROM sessions AS p WHERE p.id = {id} AND p.ended_at IS NOT NULL
        AND p.updated_at < {before} {source_clause})
AND NOT EXISTS (SELECT 1 FROM inbox WHERE inbox.session_id = {id} AND inbox.key != {key})
"""
# A deleted session's children keep their rows, no longer pointing at it.
DELETE = """
UPDATE sessions SET parent_session_id = NULL
WHERE parent_session_id = {id} AND id != {id} AND {condition};
DELETE FROM session_model_usage WHERE session_id = {id} AND {condition};
DELETE FROM messages WHERE session_id = {id} AND {condition};
DELETE FROM recall_requests WHERE session_id = {id} AND {condition};
DELETE FROM recall_results WHERE session_id = {id} AND {condition};
DELETE FROM replica_outbox WHERE session_id = {id} AND {condition};
DELETE FROM template_sessions WHERE session_id = {id} AND {condition};
DELETE FROM sessions WHERE id = {id} AND {condition};
"""

# An event waits for the replica backend: its record (``payload``, an SQL expression) in its
# session's lane, if ``condition`` holds once the event's statements before it have run.
INSERT_EVENT_REPLICA = """
INSERT INTO replica_outbox (backend, turn_key, session_id, first_id, n_messages, payload)
SELECT {backend}, {key}, {id}, 0, 0, {payload} WHERE {condition}
ON CONFLICT (backend, turn_key) DO NOTHING;
"""
# The record with the session's row as it is now (null when there is none). Not the system
# prompt: it can be tens of kilobytes, a backend's copy of the row is rewritten whole at every
# event, and the local store keeps it; its length says whether there is one. NUL is dropped
# from the text a turn's metadata may have set: the record is read back with
# ``ops.parse_session``, which refuses it. A model config that is not JSON goes as text. Times
# go with 17 digits, so that they read back as the same floats (SQLite's JSON writes 15).
SNAPSHOT = """json_set({payload}, '$.""" + SNAPSHOT_FIELD + """', json((
    SELECT json_object(
        'source', replace(source, char(0), ''), 'user_id', user_id,
        'model', replace(model, char(0), ''), 'parent_session_id', parent_session_id,
        'started_at', json(printf('%!.17g', started_at)),
        'ended_at', CASE WHEN ended_at IS NOT NULL THEN json(printf('%!.17g', ended_at)) END,
        'end_reason', replace(end_reason, char(0), ''),
        'model_config', CASE WHEN json_valid(model_config) THEN json(model_config)
                             ELSE replace(model_config, char(0), '') END,
        'system_prompt_chars', length(system_prompt), 'message_count', message_count,
        'tool_call_count', tool_call_count, 'input_tokens', input_tokens,
        'output_tokens', output_tokens,
        'tokens_estimated', json(CASE WHEN tokens_estimated THEN 'true' ELSE 'false' END))
    FROM sessions WHERE id = {id})))"""
# A delete is sent once the session is gone (prune's form may have left it in place).
DELETED = "NOT EXISTS (SELECT 1 FROM sessions WHERE id = {id})"
# An import part without messages (a session that had none) is sent when the session is the
# exported one; sent twice, it only sets the same metadata again.
IMPORTED_ROW = "EXISTS (SELECT 1 FROM sessions WHERE id = {id} AND started_at = {started})"

# An imported session: its exported row goes in as it was, if the session is not there; each
# part of its messages goes in if the session is the exported one (same start) and the part's
# first turn is not there yet (so a second import of the file changes nothing). The messages
# keep their exported ids when every one is free and below every id this process may still
# give out (``MessageIds.floor``, checked as the statement is made); otherwise they take the
# ids their record took as it was accepted, in order.
# The row takes every column the exported row holds (``ops.IMPORTED_ROW_COLUMNS``: ours and
# Hermes's), and the table's default for one it leaves out (an earlier version's line); a
# column that cannot be null takes 0 for a null (the import refuses one before it is accepted).
IMPORT_ROW = """
INSERT INTO sessions (id, source, started_at, updated_at{columns})
SELECT {id}, coalesce(r ->> 'source', {default_source}), coalesce(r ->> 'started_at', {started}),
       coalesce(r ->> 'updated_at', {at}){values}
FROM (SELECT json({row}) AS r) WHERE true
ON CONFLICT (id) DO NOTHING;
"""
_ROW_ALWAYS = ("source", "started_at", "updated_at")
# A session's messages as an export line has them: get_messages' columns and compacted.
_EXPORT_MESSAGES = SESSION_MESSAGES.replace(" FROM messages", ", compacted FROM messages", 1)
IMPORT_NEW = """
EXISTS (SELECT 1 FROM sessions WHERE id = {id} AND started_at = {started})
AND NOT EXISTS (SELECT 1 FROM messages WHERE session_id = {id} AND turn_key = {first_turn})
"""
IMPORT_IDS_FREE = """NOT EXISTS (SELECT 1 FROM messages WHERE id IN (
    SELECT f.value ->> 0 FROM json_each({rows}) AS f))"""
# Which ids the part's messages take: 1, their own (exported); 0, their record's.
IMPORT_CHOICE = """
INSERT INTO temp.import_fresh (n) SELECT {kept} AND {free} WHERE ({new});
"""
_KEPT = "(SELECT n FROM temp.import_fresh)"
_IMPORT_COLUMNS = """{id}, e.value ->> 1, e.value ->> 2, e.value ->> 3, e.value ->> 4,
       e.value ->> 5, e.value ->> 6, e.value ->> 7, e.value ->> 8, e.value ->> 9, {scope},
       e.value ->> 10, e.value ->> 11, e.value ->> 12, coalesce(e.value ->> 13, 1),
       coalesce(e.value ->> 14, 0)
FROM json_each({rows}) AS e"""
_IMPORT_ID = f"iif({_KEPT}, e.value ->> 0, {{first}} + e.key)"
IMPORT_MESSAGES = IMPORT_CHOICE + """
INSERT INTO messages (id, session_id, turn_key, ordinal, role, content, tool_calls,
                      tool_call_id, tool_name, timestamp, user_id, scope, metadata, token_count,
                      fields, active, compacted)
SELECT """ + _IMPORT_ID + ", " + _IMPORT_COLUMNS + """
WHERE EXISTS (SELECT 1 FROM temp.import_fresh) ORDER BY e.key;
INSERT INTO messages_fts (rowid, content, scope)
SELECT """ + _IMPORT_ID + """, e.value ->> 4, {scope} FROM json_each({rows}) AS e
WHERE EXISTS (SELECT 1 FROM temp.import_fresh);
INSERT INTO messages_tools (rowid, tool_text, scope)
SELECT m.id, m.tool_text, m.scope FROM json_each({rows}) AS e
JOIN messages AS m ON m.id = """ + _IMPORT_ID + """
WHERE EXISTS (SELECT 1 FROM temp.import_fresh) AND m.tool_text IS NOT NULL;
DELETE FROM temp.import_fresh;
"""


def session_statements(ops: Sequence[Turn], default_source: str,
                       replica: str | None = None, tool_log: ToolLogConfig | None = None,
                       ids: MessageIds | None = None) -> list[str]:
    """The statements that apply lifecycle events ``ops``, in order, for a batch's
    transaction (their outbox keys are marked done with the batch's other operations); with
    ``replica``, each event that changed its session also waits for that backend; with
    ``tool_log``, an import's tool calls are logged (and its messages settle the session's
    calls awaiting an answer), and an end settles them as never answered; ``ids`` gives an
    import's messages ids when its record came without (and says which exported ids may be
    kept).

    Raises:
        ValueError: an import without ids, and no ``ids``.
    """
    script = []
    for t in ops:
        op = parse_session(json.loads(t.payload), t.payload)
        waits = "" if replica is None else _replica_row(op, t.payload, replica)
        if op.action in CHANGES:
            script += [change_statement(op, default_source, ids), waits]
        elif op.action in STATE_ACTIONS:
            script.append(state_statement(op))  # Hermes's own state: not mirrored
        elif op.action == "import":
            # Between the row and the messages: whether the messages go in is known there.
            script += [_import_row(op, default_source), waits, _import_messages(op, ids)]
            if tool_log is not None and op.messages:
                script += session_log_statements(tool_log, sql_literal(op.session_id),
                                                 calls=any(m[5] for m in op.messages))
        else:
            script += [_statement(op, default_source), waits]
            if tool_log is not None and op.action == "end":
                # Its calls still awaiting their answer were never answered.
                script += end_statements(tool_log, sql_literal(op.session_id))
    return [s for s in script if s]


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
        if op.first_wins:
            return END_FIRST.format(id=sid, at=at, reason=_text(op.reason))
        return END.format(id=sid, at=at, default_source=sql_literal(default_source),
                          user=_text(op.user_id), reason=_text(op.reason))
    source_clause = "" if op.source is None else f"AND p.source = {sql_literal(op.source)}"
    if op.ended_before is not None:
        condition = PRUNE_CONDITION.format(
            id=sid, before=repr(op.ended_before), key=sql_literal(op.record_key),
            source_clause=source_clause)
    elif op.started_before is not None:
        condition = PRUNE_STARTED.format(
            id=sid, before=repr(op.started_before), key=sql_literal(op.record_key),
            source_clause=source_clause)
    elif op.unchanged_before is not None:
        condition = PRUNE_UNCHANGED.format(
            id=sid, before=repr(op.unchanged_before), key=sql_literal(op.record_key),
            source_clause=source_clause)
    else:
        condition = "true"
    return DELETE.format(id=sid, condition=condition)


def _replica_row(op: SessionOp, payload: str, backend: str) -> str:
    """The statement that queues the event ``op`` (its record: ``payload``) for ``backend``,
    if it changed its session: see the module doc."""
    sid, record = sql_literal(op.session_id), sql_literal(payload)
    condition = "true"
    if op.action in ("replace", "fields", "active"):
        return ""  # not mirrored: a replica keeps the messages it was sent (see README)
    if op.action in STATE_ACTIONS:
        return ""  # Hermes's own state: not mirrored
    if op.action == "delete":
        condition = DELETED.format(id=sid)
    elif op.action == "import":
        condition = (_import_new(op) if op.messages
                     else IMPORTED_ROW.format(id=sid, started=repr(op.started_at)))
    if op.action != "delete":
        record = SNAPSHOT.format(payload=record, id=sid)
    return INSERT_EVENT_REPLICA.format(backend=sql_literal(backend),
                                       key=sql_literal(op.record_key), id=sid, payload=record,
                                       condition=condition)


def _import_row(op: SessionOp, default_source: str) -> str:
    if op.row is None:
        return ""
    columns = [c for c in IMPORTED_ROW_COLUMNS if c in op.row and c not in _ROW_ALWAYS]
    values = [f"r ->> '{c}'" if IMPORTED_ROW_COLUMNS[c][1] else f"coalesce(r ->> '{c}', 0)"
              for c in columns]
    return IMPORT_ROW.format(
        id=sql_literal(op.session_id), row=sql_literal(_JSON.encode(op.row)),
        default_source=sql_literal(default_source), started=repr(op.started_at),
        at=repr(op.accepted_at), columns="".join(f", {c}" for c in columns),
        values="".join(f", {v}" for v in values))


def _import_new(op: SessionOp) -> str:
    """Whether the import part ``op`` (with messages) inserts them: checked before it does."""
    messages = op.messages or []
    return IMPORT_NEW.format(id=sql_literal(op.session_id), started=repr(op.started_at),
                             first_turn=sql_literal(str(messages[0][1])))


def _import_messages(op: SessionOp, ids: MessageIds | None) -> str:
    messages = op.messages or []
    if not messages:
        return ""
    first = op.first_id
    if first is None:
        if ids is None:
            raise ValueError(f"import {op.record_key} has no message ids and none can be given")
        first = ids.for_record(op.record_key, len(messages))
    floor = ids.floor if ids is not None else 0
    kept = int(all(m[0] < floor for m in messages))
    # An earlier version's record: no fields (12), no active flag (13), no compacted (14).
    pad = [None, 1, 0]
    rows = sql_literal(_JSON.encode([
        m if len(m) == IMPORTED_MESSAGE_FIELDS else [*m, *pad[len(m) - IMPORTED_MESSAGE_FIELDS:]]
        for m in messages]))
    # Exported ids raise the highest id given only when they may be kept (all below the
    # floor): an id from another store far above this one's must not move its counter.
    high = int(first) + len(messages) - 1
    if kept:
        high = max(high, *(int(m[0]) for m in messages))
    return IMPORT_MESSAGES.format(
        rows=rows, new=_import_new(op), free=IMPORT_IDS_FREE.format(rows=rows), kept=kept,
        first=int(first), scope=sql_literal(scope_tokens(op.user_id, op.session_id)),
        id=sql_literal(op.session_id)) + ID_HIGH.format(high=high)


def _text(value: object) -> str:
    return "NULL" if value is None else sql_literal(str(value))


class Lifecycle(Connections):
    """The reads prune and import need (their writes are batch statements, above)."""

    async def prunable_sessions(self, before: float | None, source: str | None, *,
                                started: bool = False, where: SessionFilter | None = None
                                ) -> list[tuple[str, str | None]]:
        """(id, user) of the sessions that ended and were last updated before ``before``
        (with ``started``: that ended, and started before it; None: no cut-off), of
        ``source`` only when given, matching ``where`` when given, oldest first."""
        condition, params = (where or SessionFilter()).where("s")
        sql = f"SELECT s.id, s.user_id FROM sessions AS s WHERE {condition}"
        if before is not None and started:
            sql += " AND s.started_at < ?"
            params.append(before)
        elif before is not None:
            sql += " AND s.ended_at < ? AND s.updated_at < ?"
            params += [before, before]
        if source is not None:
            sql += " AND s.source = ?"
            params.append(source)
        async with self.reader() as db, db.execute(sql + " ORDER BY s.ended_at, s.id",
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

    async def import_state(self, ids: Sequence[str]
                           ) -> dict[str, tuple[float, dict[str, int]]]:
        """For each of ``ids`` that has a session row: its start, and how many messages it
        holds of each turn (by turn key), from one read transaction: what an import checks
        before it accepts a session, and once it committed."""
        found: dict[str, tuple[float, dict[str, int]]] = {}
        async with self.reader() as db:
            await db.execute("BEGIN")
            try:
                for i in range(0, len(ids), KEY_CHUNK):
                    chunk = list(ids[i : i + KEY_CHUNK])
                    marks = ",".join("?" * len(chunk))
                    async with db.execute(
                            f"SELECT id, started_at FROM sessions WHERE id IN ({marks})",
                            chunk) as cur:
                        for r in await cur.fetchall():
                            found[str(r[0])] = (float(r[1]), {})
                    async with db.execute(
                            "SELECT session_id, turn_key, count(*) FROM messages "
                            f"WHERE session_id IN ({marks}) GROUP BY session_id, turn_key",
                            chunk) as cur:
                        for r in await cur.fetchall():
                            if str(r[0]) in found:
                                found[str(r[0])][1][str(r[1])] = int(r[2])
            finally:
                await db.execute("COMMIT")
        return found

    async def session_parents(self, ids: Sequence[str]) -> dict[str, str | None]:
        """The parent of each of ``ids`` that has a session row (None: it has none)."""
        found: dict[str, str | None] = {}
        async with self.reader() as db:
            for i in range(0, len(ids), KEY_CHUNK):
                chunk = list(ids[i : i + KEY_CHUNK])
                async with db.execute(
                        "SELECT id, parent_session_id FROM sessions "
                        f"WHERE id IN ({','.join('?' * len(chunk))})", chunk) as cur:
                    found.update((str(r[0]), None if r[1] is None else str(r[1]))
                                 for r in await cur.fetchall())
        return found

    async def dead_records(self, keys: Sequence[str]) -> dict[str, str]:
        """Which of these record keys were dead-lettered, each with why."""
        found: dict[str, str] = {}
        async with self.reader() as db:
            for i in range(0, len(keys), KEY_CHUNK):
                chunk = list(keys[i : i + KEY_CHUNK])
                async with db.execute(
                        "SELECT key, last_error FROM outbox WHERE status = 'dead' "
                        f"AND key IN ({','.join('?' * len(chunk))})", chunk) as cur:
                    found.update((str(r[0]), str(r[1] or "")) for r in await cur.fetchall())
        return found

    async def export_sessions(
        self, *, user_id: str | None = None, session_id: str | None = None,
    ) -> AsyncGenerator[tuple[dict[str, Any], list[dict[str, Any]]], None]:
        """Every session (of ``user_id``; or just ``session_id``), oldest first, with its
        messages (tool calls and metadata decoded), from one read transaction: a consistent
        snapshot however long the caller takes."""
        where, params = where_equal(("user_id", user_id), ("id", session_id))
        async with self.reader() as db:
            await db.execute("BEGIN")
            try:
                sessions = await fetch_dicts(
                    db, f"SELECT * FROM sessions{where} ORDER BY started_at, id", params)
                for session in sessions:
                    rows = await fetch_dicts(db, _EXPORT_MESSAGES, (session["id"],))
                    for r in rows:  # the flag only where it is set, as earlier lines read
                        if r.pop("compacted"):
                            r["compacted"] = 1
                    yield session, [decode_message(r) for r in rows]
            finally:
                await db.execute("COMMIT")

