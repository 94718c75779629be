"""What a batch's session changes do (``ops`` actions ``update``, ``usage``, ``reopen``,
``replace``, ``fields`` and ``active``), as SQL for the batch's transaction. Values are
inlined as SQL literals (a change never holds U+0000 in a text column:
``ops.parse_session`` refused it).

- ``update``: set fields (overwrite) and fill fields (only where the row has none) on the
  session's row, and its user where it has none; with ``create``, the row is made when
  there is none (its start is the record's time, its source the one given, else the
  store's).
- ``usage``: one model call's accounting, as Hermes Agent's ``update_token_counts`` does it:
  counters and costs added (or set, ``absolute``), the model and billing route filled where
  none is stored, replaced whole by the first call that accounts usage on another route, and
  the call's share added to ``session_model_usage`` under its model and route (not for an
  ``absolute`` update, whose totals cannot be split by route).
- ``reopen``: the session's end is cleared.
- ``fields``: keys of one message's fields set (or removed), when the message is the
  session's (and, if the record says so, still its newest active message of a role):
  Hermes's per-message columns generated from them follow; its text and indexes are not
  touched.
- ``active``: the session's messages from an id on set aside (``active`` 0: Hermes's
  rewind, which also counts one in ``rewind_count``) or taken back (``active`` 1: its
  restore); their text stays, indexed.
- ``replace``: the session's messages (or only its active ones) give way to the record's,
  under the ids the record took when accepted; the index follows, and the counts are those
  of its active messages. A compaction (Hermes's ``archive_and_compact``) keeps the active
  ones on file, set aside as compacted, instead of deleting them.
"""

from __future__ import annotations

import json
from typing import Any

from ..message_ids import MessageIds
from ..ops import USAGE_COUNTS, SessionOp
from ..turns import scope_tokens
from .sql import ID_HIGH, sql_literal

_JSON = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"))

UPDATE = """
UPDATE sessions SET {assignments} updated_at = max(updated_at, {at}) WHERE id = {id};
"""
CREATE = """
INSERT INTO sessions (id, source, user_id, started_at, updated_at{columns})
VALUES ({id}, {source}, {user}, {at}, {at}{values})
ON CONFLICT (id) DO UPDATE SET {assignments}
    user_id = coalesce(sessions.user_id, excluded.user_id),
    updated_at = max(sessions.updated_at, excluded.updated_at);
"""
REOPEN = """
UPDATE sessions SET ended_at = NULL, end_reason = NULL, updated_at = max(updated_at, {at})
WHERE id = {id};
"""
# The row a usage record needs (Hermes makes it with source "unknown", filling the model).
USAGE_ROW = """
INSERT INTO sessions (id, source, user_id, model, started_at, updated_at)
VALUES ({id}, 'unknown', {user}, {model}, {at}, {at})
ON CONFLICT (id) DO UPDATE SET model = coalesce(sessions.model, excluded.model),
    user_id = coalesce(sessions.user_id, excluded.user_id);
"""
# One statement, so every expression sees the row as it was: the first call that accounts
# usage, on a route other than the one the row names, replaces the route whole (Hermes: the
# requested primary route failed and a fallback answered); after that the route only fills.
USAGE = """
UPDATE sessions SET
    input_tokens = {input_tokens},
    output_tokens = {output_tokens},
    cache_read_tokens = {cache_read_tokens},
    cache_write_tokens = {cache_write_tokens},
    reasoning_tokens = {reasoning_tokens},
    estimated_cost_usd = {estimated},
    actual_cost_usd = {actual},
    cost_status = coalesce({cost_status}, cost_status),
    cost_source = coalesce({cost_source}, cost_source),
    pricing_version = coalesce({pricing_version}, pricing_version),
    model = CASE WHEN {first_route} THEN {model} ELSE coalesce(model, {acc_model}) END,
    billing_provider = CASE WHEN {first_route} THEN {provider}
                            ELSE coalesce(billing_provider, {acc_provider}) END,
    billing_base_url = CASE WHEN {first_route} THEN {base_url}
                            ELSE coalesce(billing_base_url, {acc_base_url}) END,
    billing_mode = CASE WHEN {first_route} THEN {mode}
                        ELSE coalesce(billing_mode, {acc_mode}) END,
    api_call_count = {api_call_count},
    updated_at = max(updated_at, {at})
WHERE id = {id};
"""
# The call's share under its model and route (the session's where the call named none; an
# auxiliary task's own, or 'unknown').
MODEL_USAGE = """
INSERT INTO session_model_usage (session_id, model, billing_provider, billing_base_url,
    billing_mode, task, api_call_count, input_tokens, output_tokens, cache_read_tokens,
    cache_write_tokens, reasoning_tokens, estimated_cost_usd, actual_cost_usd, cost_status,
    cost_source, first_seen, last_seen)
SELECT {id}, coalesce({model}, {session_model}, 'unknown'),
       coalesce({provider}, {session_provider}, ''), coalesce({base_url}, {session_base_url}, ''),
       coalesce({mode}, {session_mode}, ''), {task}, {api_call_count}, {input_tokens},
       {output_tokens}, {cache_read_tokens}, {cache_write_tokens}, {reasoning_tokens},
       {estimated}, {actual}, {cost_status}, {cost_source}, {at}, {at}
FROM (SELECT 1) LEFT JOIN sessions AS s ON s.id = {id}
WHERE true
ON CONFLICT (session_id, model, billing_provider, billing_base_url, billing_mode, task)
DO UPDATE SET
    api_call_count = api_call_count + excluded.api_call_count,
    input_tokens = input_tokens + excluded.input_tokens,
    output_tokens = output_tokens + excluded.output_tokens,
    cache_read_tokens = cache_read_tokens + excluded.cache_read_tokens,
    cache_write_tokens = cache_write_tokens + excluded.cache_write_tokens,
    reasoning_tokens = reasoning_tokens + excluded.reasoning_tokens,
    estimated_cost_usd = estimated_cost_usd + excluded.estimated_cost_usd,
    actual_cost_usd = actual_cost_usd + excluded.actual_cost_usd,
    cost_status = coalesce(excluded.cost_status, cost_status),
    cost_source = coalesce(excluded.cost_source, cost_source),
    last_seen = excluded.last_seen;
"""
# A replace: the session's row (made if missing), its old messages out (the delete trigger
# takes their index rows and logged calls; a compaction keeps them, set aside: RETIRE_*), the
# record's in, indexed, and the counts of its active messages.
REPLACE = """
INSERT INTO sessions (id, source, user_id, started_at, updated_at)
VALUES ({id}, {default_source}, {user}, {at}, {at})
ON CONFLICT (id) DO UPDATE SET user_id = coalesce(sessions.user_id, excluded.user_id);
{retire}
INSERT INTO messages (id, session_id, turn_key, ordinal, role, content, tool_calls,
                      tool_call_id, tool_name, timestamp, user_id, scope, metadata, token_count,
                      fields)
SELECT {first} + e.key, {id}, {key}, e.key, e.value ->> 0, e.value ->> 1, e.value ->> 2,
       e.value ->> 3, e.value ->> 4, coalesce(e.value ->> 6, {at}), {user}, {scope}, NULL,
       e.value ->> 5, e.value ->> 7
FROM json_each({rows}) AS e ORDER BY e.key;
INSERT INTO messages_fts (rowid, content, scope)
SELECT id, content, scope FROM messages WHERE id BETWEEN {first} AND {last};
INSERT INTO messages_tools (rowid, tool_text, scope)
SELECT id, tool_text, scope FROM messages
WHERE id BETWEEN {first} AND {last} AND tool_text IS NOT NULL;
UPDATE sessions SET
    message_count = (SELECT count(*) FROM messages WHERE session_id = {id} AND active = 1),
    tool_call_count = (SELECT coalesce(sum(CASE WHEN json_valid(tool_calls)
                                              THEN json_array_length(tool_calls) END), 0)
                       FROM messages WHERE session_id = {id} AND active = 1
                         AND tool_calls IS NOT NULL),
    updated_at = max(updated_at, {at})
WHERE id = {id};
"""

RETIRE_DELETE = "DELETE FROM messages WHERE session_id = {id}{active};"
# Hermes's compaction: the live messages stay on file, set aside (active 0) and marked as
# summarized away (compacted 1): its search still finds them, its live load does not.
RETIRE_COMPACT = ("UPDATE messages SET active = 0, compacted = 1 "
                  "WHERE session_id = {id} AND active = 1;")


def change_statement(op: SessionOp, default_source: str, ids: MessageIds | None) -> str:
    """The SQL that applies the change ``op`` (update, usage, reopen or replace).

    Raises:
        ValueError: a replace without ids, and no ``ids`` to give them.
    """
    sid, at = sql_literal(op.session_id), repr(op.accepted_at)
    if op.action == "update":
        return _update(op, sid, at, default_source)
    if op.action == "usage":
        return _usage(op, sid, at)
    if op.action == "reopen":
        return REOPEN.format(id=sid, at=at)
    if op.action == "fields":
        return _fields(op, sid)
    if op.action == "active":
        return _active(op, sid, at)
    return _replace(op, sid, at, default_source, ids)


def _active(op: SessionOp, sid: str, at: str) -> str:
    args = op.args or {}
    on = 1 if args.get("on") else 0
    script = (f"UPDATE messages SET active = {on} WHERE session_id = {sid} "
              f"AND id >= {int(args['from'])} AND active = {1 - on};\n")
    if args.get("rw"):
        script += (f"UPDATE sessions SET rewind_count = coalesce(rewind_count, 0) + 1, "
                   f"updated_at = max(updated_at, {at}) WHERE id = {sid};\n")
    return script


def _fields(op: SessionOp, sid: str) -> str:
    args = op.args or {}
    mid, values, role = int(args["i"]), args["f"], args.get("r")
    expr = "coalesce(fields, '{}')"
    removed = [f"'$.{k}'" for k, v in values.items() if v is None]
    if removed:
        expr = f"json_remove({expr}, {', '.join(removed)})"
    kept = [f"'$.{k}', json({sql_literal(_JSON.encode(v))})" for k, v in values.items()
            if v is not None]
    if kept:
        expr = f"json_set({expr}, {', '.join(kept)})"
    condition = f"id = {mid} AND session_id = {sid}"
    if role is not None:
        condition += (f" AND id = (SELECT max(id) FROM messages WHERE session_id = {sid} "
                      f"AND role = {sql_literal(role)} AND active = 1)")
    return f"UPDATE messages SET fields = {expr} WHERE {condition};\n"


def _update(op: SessionOp, sid: str, at: str, default_source: str) -> str:
    sets, fills = op.fields, op.fill or {}
    if op.create:
        given = {**fills, **sets}
        source = given.pop("source", None)
        columns = list(given)
        assignments = "".join(
            [f"{c} = excluded.{c}, " for c in sets if c != "source"]
            + [f"{c} = coalesce(sessions.{c}, excluded.{c}), " for c in fills
               if c not in sets and c != "source"]
            + (["source = excluded.source, "] if "source" in sets else []))
        return CREATE.format(
            id=sid, at=at, user=_value(op.user_id),
            source=_value(source) if source is not None else sql_literal(default_source),
            columns="".join(f", {c}" for c in columns),
            values="".join(f", {_value(given[c])}" for c in columns),
            assignments=assignments)
    assignments = "".join([f"{c} = {_value(v)}, " for c, v in sets.items()]
                          + [f"{c} = coalesce({c}, {_value(v)}), " for c, v in fills.items()
                             if c not in sets]
                          + ([f"user_id = coalesce(user_id, {_value(op.user_id)}), "]
                             if op.user_id is not None else []))
    return UPDATE.format(id=sid, at=at, assignments=assignments)


def _usage(op: SessionOp, sid: str, at: str) -> str:
    u = op.usage or {}
    absolute = bool(u.get("absolute"))
    counts = {name: int(u.get(name) or 0) for name in USAGE_COUNTS}
    estimated, actual = u.get("estimated_cost_usd"), u.get("actual_cost_usd")
    accounted = any(counts.values()) or bool(estimated) or bool(actual)
    model, provider = u.get("model"), u.get("billing_provider")
    base_url, mode, task = u.get("billing_base_url"), u.get("billing_mode"), u.get("task") or ""
    first_route = (
        f"(coalesce(api_call_count, 0) = 0 AND (model IS NOT {_value(model)} "
        f"OR billing_provider IS NOT {_value(provider)}))"
        if accounted and model and provider and not task else "0")
    values = {name: str(v) for name, v in counts.items()}
    exprs = values if absolute else {name: f"coalesce({name}, 0) + {v}"
                                     for name, v in values.items()}
    if absolute:
        estimated_sql = f"coalesce({_real(estimated)}, 0)"
        actual_sql = f"coalesce({_real(actual)}, actual_cost_usd)"
    else:
        estimated_sql = f"coalesce(estimated_cost_usd, 0) + coalesce({_real(estimated)}, 0)"
        actual_sql = (f"coalesce(actual_cost_usd, 0) + {_real(actual)}" if actual is not None
                      else "actual_cost_usd")
    script = USAGE_ROW.format(id=sid, at=at, user=_value(op.user_id), model=_value(model))
    if task:  # an auxiliary call: its own row only (Hermes's record_auxiliary_usage)
        first_route = "0"
    else:
        script += USAGE.format(
            id=sid, at=at, estimated=estimated_sql, actual=actual_sql, first_route=first_route,
            model=_value(model), provider=_value(provider), base_url=_value(base_url),
            mode=_value(mode), cost_status=_value(u.get("cost_status")),
            cost_source=_value(u.get("cost_source")),
            pricing_version=_value(u.get("pricing_version")),
            acc_model=_value(model if accounted else None),
            acc_provider=_value(provider if accounted else None),
            acc_base_url=_value(base_url if accounted else None),
            acc_mode=_value(mode if accounted else None), **exprs)
    if absolute or not (any(counts.values()) or estimated):
        return script
    session = "NULL" if task else "s.{}"
    return script + MODEL_USAGE.format(
        id=sid, at=at, model=_value(model or None), provider=_value(provider or None),
        base_url=_value(base_url or None), mode=_value(mode or None), task=sql_literal(task),
        session_model=session.format("model"), session_provider=session.format(
            "billing_provider"), session_base_url=session.format("billing_base_url"),
        session_mode=session.format("billing_mode"),
        estimated=repr(float(estimated or 0.0)), actual=repr(float(actual or 0.0)),
        cost_status=_value(u.get("cost_status")), cost_source=_value(u.get("cost_source")),
        **values)


def _replace(op: SessionOp, sid: str, at: str, default_source: str,
             ids: MessageIds | None) -> str:
    messages = op.messages or []
    first = op.first_id
    if first is None and messages:
        if ids is None:
            raise ValueError(f"replace {op.record_key} has no message ids and none can be given")
        first = ids.for_record(op.record_key, len(messages))
    retire = (RETIRE_COMPACT.format(id=sid) if op.compact else RETIRE_DELETE.format(
        id=sid, active=" AND active = 1" if op.active_only else ""))
    script = REPLACE.format(
        id=sid, at=at, key=sql_literal(op.record_key), user=_value(op.user_id),
        default_source=sql_literal(default_source), retire=retire, first=int(first or 0),
        last=int(first or 0) + len(messages) - 1, rows=sql_literal(_JSON.encode(messages)),
        scope=sql_literal(scope_tokens(op.user_id, op.session_id)))
    if messages:
        script += ID_HIGH.format(high=int(first or 0) + len(messages) - 1)
    return script


def _value(value: Any) -> str:
    """A field's value as an SQL literal (None as NULL, a bool as 0/1, an object as JSON)."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, dict):
        return sql_literal(_JSON.encode(value))
    return sql_literal(str(value))


def _real(value: Any) -> str:
    return "NULL" if value is None else repr(float(value))
