"""Operations: records that travel the outbox beside turns, ordered in lanes as turns are in
their sessions. Three kinds:

- a key-value write (``OP_KV``): put or delete one entry of a user's memory, in the lane
  ``lane_of(user)``;
- a session lifecycle event (``OP_SESSION``), in the session's own lane, so that it commits
  after every turn of the session accepted before it: ``describe`` (model, model config,
  system prompt, parent, source), ``end`` (with a reason) and ``delete`` (optionally only if
  the session ended before a cut-off and holds nothing newer: prune's form). A delete that
  trails a pending turn removes that turn too; it can never be brought back by it. The
  session store's changes travel the same way (``update``, ``usage``, ``reopen``,
  ``replace``, ``fields``, ``active``), and so does Hermes Agent's own state beside the
  sessions (``STATE_ACTIONS``: ``meta`` in the one lane ``lane_of_meta()``, ``lock`` in the
  session's).
- a warm-start template write (``OP_TEMPLATE``), all in the one lane
  ``lane_of_templates()``, so they commit in the order they were accepted: ``put`` (a
  template's JSON document), ``delete``, ``use`` (a session started from a template, or
  cold) and ``outcome`` (how such a session ended).

This module owns the record's format: encoding it (on the caller's thread, like a turn's),
and reading it back with its checks (``parse_kv``), for the writer's decode, the store's
batch and the reads that lay pending writes over the store's answer.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from json.encoder import encode_basestring_ascii as _esc
from typing import Any, NamedTuple

from .templates.model import InvalidTemplateError, Template

ID_DIGITS = 19  # a record's id slot: an int64 in decimal (see turns.ID_SLOT)

OP_KV = "kv"
OP_SESSION = "session"
OP_TEMPLATE = "template"
OP_KINDS = frozenset({OP_KV, OP_SESSION, OP_TEMPLATE})
SESSION_ACTIONS = frozenset({"describe", "end", "delete", "import", "update", "usage",
                             "reopen", "replace", "fields", "active", "meta", "lock"})
# Hermes Agent's own state beside the sessions: ``meta`` sets a key of its key-value state
# (in the one lane ``lane_of_meta()``); ``lock`` acquires, refreshes or releases a session's
# compression lock (in the session's lane). Their arguments: the record's ``a``.
STATE_ACTIONS = frozenset({"meta", "lock"})
LOCK_MODES = frozenset({"acquire", "refresh", "release"})
MAX_META_KEY_CHARS = 512
# A ``fields`` record sets keys of one message's fields (Hermes's per-message columns, such
# as api_content): never these, which columns and indexes hold; a key is a plain name.
MESSAGE_FIELD_COLUMNS = frozenset({"role", "content", "tool_calls", "tool_call_id",
                                   "tool_name", "timestamp", "token_count"})
MESSAGE_FIELD_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
TEMPLATE_ACTIONS = frozenset({"put", "delete", "use", "outcome"})
# How a template's put meets a template already stored under its name: "save" replaces its
# content and keeps its usage and outcome counts; "keep" leaves it as it is (an import);
# "auto" also inserts nothing when a template of the same task type has the same examples
# or the same source session (automatic creation's deduplication, exact in lane order).
PUT_MODES = frozenset({"save", "keep", "auto"})
# An imported message: id, turn key, ordinal, role, content, tool calls (JSON text), tool call
# id, tool name, timestamp, user id, metadata (JSON text), token count, fields (JSON text: the
# keys no column holds, ``message_rows.message_row``), active (1, or 0: set aside by the host),
# compacted (1: set aside by a compaction, still found by Hermes's search); as exported. An
# earlier version's record has no compacted flag (14), no active flag (13), nor fields (12).
IMPORTED_MESSAGE_FIELDS = 15
# An imported session's row (the record's ``row``): every column of the sessions table but its
# id, as exported, with the type its value has (an int is taken for a float) and whether it
# may be null. A column a row leaves out (an earlier version's line) takes the table's
# default. ``model_config`` holds a JSON object's text, as ``describe`` stores it.
IMPORTED_ROW_COLUMNS: dict[str, tuple[type, bool]] = {
    "source": (str, False), "user_id": (str, True), "model": (str, True),
    "parent_session_id": (str, True), "started_at": (float, False),
    "updated_at": (float, False), "ended_at": (float, True), "end_reason": (str, True),
    "message_count": (int, False), "tool_call_count": (int, False),
    "input_tokens": (int, False), "output_tokens": (int, False), "model_config": (str, True),
    "system_prompt": (str, True), "tokens_estimated": (int, False),
    # Hermes Agent 0.19's (``store.schema.SESSION_COLUMNS``).
    "session_key": (str, True), "chat_id": (str, True), "chat_type": (str, True),
    "thread_id": (str, True), "display_name": (str, True), "origin_json": (str, True),
    "expiry_finalized": (int, True), "cache_read_tokens": (int, False),
    "cache_write_tokens": (int, False), "reasoning_tokens": (int, False), "cwd": (str, True),
    "git_branch": (str, True), "git_repo_root": (str, True), "billing_provider": (str, True),
    "billing_base_url": (str, True), "billing_mode": (str, True),
    "estimated_cost_usd": (float, True), "actual_cost_usd": (float, True),
    "cost_status": (str, True), "cost_source": (str, True), "pricing_version": (str, True),
    "title": (str, True), "api_call_count": (int, False), "handoff_state": (str, True),
    "handoff_platform": (str, True), "handoff_error": (str, True),
    "compression_failure_cooldown_until": (float, True),
    "compression_failure_error": (str, True), "compression_fallback_streak": (int, False),
    "profile_name": (str, True), "rewind_count": (int, False), "archived": (int, False),
}
# What a ``describe`` may set on a session, and the type each holds.
SESSION_FIELDS: dict[str, type] = {
    "source": str, "model": str, "model_config": dict, "system_prompt": str,
    "parent_session_id": str, "tokens_estimated": bool,
}
# What an ``update`` may set or fill on a session, and the type each holds: ours, and Hermes
# Agent 0.19's session columns (its hermes_state.SCHEMA_SQL). A float also takes an int.
UPDATE_FIELDS: dict[str, type] = {
    **SESSION_FIELDS,
    **dict.fromkeys((
        "title", "cwd", "git_branch", "git_repo_root", "session_key", "chat_id", "chat_type",
        "thread_id", "display_name", "origin_json", "billing_provider", "billing_base_url",
        "billing_mode", "cost_status", "cost_source", "pricing_version", "handoff_state",
        "handoff_platform", "handoff_error", "compression_failure_error", "profile_name"),
        str),
    **dict.fromkeys(("estimated_cost_usd", "actual_cost_usd",
                     "compression_failure_cooldown_until"), float),
    **dict.fromkeys((
        "expiry_finalized", "api_call_count", "compression_fallback_streak", "rewind_count",
        "archived", "input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens",
        "reasoning_tokens"), int),
}
# A ``usage`` record: one model call's accounting (Hermes's update_token_counts), or the
# session's totals (``absolute``). Counts are integers, costs floats, the route text.
USAGE_COUNTS = ("input_tokens", "output_tokens", "cache_read_tokens", "cache_write_tokens",
                "reasoning_tokens", "api_call_count")
USAGE_COSTS = ("estimated_cost_usd", "actual_cost_usd")
USAGE_TEXTS = ("model", "billing_provider", "billing_base_url", "billing_mode", "cost_status",
               "cost_source", "pricing_version", "task")
# A replica row's copy of a describe, end or import record also holds the session's row as
# that event left it, under this key (``store.lifecycle.SNAPSHOT``): what a backend mirrors.
SNAPSHOT_FIELD = "snap"
# No id may hold this character (``message_rows.check_id``), so a lane is never a session's id.
LANE_MARK = "\x01"

_ENCODER = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), allow_nan=False)
_PUT = '{"x":"kv","k":%s,"s":%s,"u":%s,"t":%r,"o":"put","n":%s,"v":%s,"d":%s}'
_DEL = '{"x":"kv","k":%s,"s":%s,"u":%s,"t":%r,"o":"del","n":%s}'


class KvOp(NamedTuple):
    """A key-value write as read back from its record."""

    record_key: str
    lane: str
    user_id: str
    accepted_at: float
    action: str  # "put" or "del"
    key: str
    value: str  # "" for a delete
    metadata: dict[str, Any] | None


class SessionOp(NamedTuple):
    """A session lifecycle event as read back from its record."""

    record_key: str
    session_id: str
    user_id: str | None
    accepted_at: float
    action: str  # "describe", "end" or "delete"
    fields: dict[str, Any]  # describe: what it sets (``SESSION_FIELDS``)
    reason: str | None  # end: why the session ended
    ended_before: float | None  # delete: only if the session ended and was idle before this
    source: str | None  # delete: only if the session has this source
    row: dict[str, Any] | None = None  # import: the session's exported row (first part only)
    messages: list[list[Any]] | None = None  # import: a part of its messages, in id order
    started_at: float | None = None  # import: the exported session's start (its identity)
    snapshot: dict[str, Any] | None = None  # a replica row's copy: the row after the event
    first_id: int | None = None  # import, replace: the first id its record took (message_ids)
    fill: dict[str, Any] | None = None  # update: fields set only where the row has none
    create: bool = False  # update: make the row when the session has none
    first_wins: bool = False  # end: only a session not ended yet
    started_before: float | None = None  # delete: only if it ended and started before this
    usage: dict[str, Any] | None = None  # usage: the call's counts, costs and route
    active_only: bool = False  # replace: only the messages the host has not set aside
    # delete: only if the session ended and nothing changed it after this time (a filtered
    # prune's form: what chose it still holds)
    unchanged_before: float | None = None
    compact: bool = False  # replace: the old messages stay, set aside as compacted
    # meta: {"k": key, "v": value or None}; lock: {"m": mode, "h": holder, "n": the
    # caller's time, "e": when the lease ends}; fields: {"i": message id, "f": {key: value
    # or None (removed)}, "r": only if the message is the session's newest active one of
    # this role, or None}; active: {"from": the first message id, "on": 1 to restore, 0 to
    # set aside, "rw": count a rewind on the session}
    args: dict[str, Any] | None = None


class TemplateOp(NamedTuple):
    """A template write as read back from its record."""

    record_key: str
    lane: str
    accepted_at: float
    action: str  # "put", "delete", "use" or "outcome"
    name: str | None  # the template; None for a cold start and its outcome
    document: dict[str, Any] | None = None  # put: the template's JSON document
    mode: str = "save"  # put: ``PUT_MODES``
    session_id: str | None = None  # use, outcome
    task_type: str | None = None  # use, outcome: the session's
    ok: bool | None = None  # outcome: a success
    first_calls: int = 0  # outcome: tool calls in the session's first turns
    first_errors: int = 0  # outcome: of those, failures


def lane_of(user_id: str) -> str:
    """The lane a user's key-value writes are ordered in."""
    return f"{LANE_MARK}kv{LANE_MARK}{user_id}"


def lane_of_templates() -> str:
    """The one lane every template write is ordered in."""
    return f"{LANE_MARK}templates"


def lane_of_meta() -> str:
    """The one lane every write of Hermes Agent's key-value state (``meta``) is ordered in."""
    return f"{LANE_MARK}meta"


def encode_put(record_key: str, user_id: str, accepted_at: float, key: str, value: str,
               metadata: Mapping[str, Any] | None) -> str:
    """A put's record: compact ASCII JSON with ' written as \\u0027, as a turn's (see
    ``turns.encode_payload``). The arguments were checked by the caller."""
    payload = _PUT % (_esc(record_key), _esc(lane_of(user_id)), _esc(user_id), accepted_at,
                      _esc(key), _esc(value),
                      "null" if metadata is None else _ENCODER.encode(metadata))
    return payload.replace("'", "\\u0027") if "'" in payload else payload


def encode_delete(record_key: str, user_id: str, accepted_at: float, key: str) -> str:
    payload = _DEL % (_esc(record_key), _esc(lane_of(user_id)), _esc(user_id), accepted_at,
                      _esc(key))
    return payload.replace("'", "\\u0027") if "'" in payload else payload


def encode_session_op(record_key: str, session_id: str, user_id: str | None,
                      accepted_at: float, action: str, *, fields: Mapping[str, Any] | None = None,
                      reason: str | None = None, ended_before: float | None = None,
                      source: str | None = None, row: Mapping[str, Any] | None = None,
                      messages: list[list[Any]] | None = None,
                      started_at: float | None = None, first_wins: bool = False,
                      started_before: float | None = None,
                      unchanged_before: float | None = None,
                      args: Mapping[str, Any] | None = None) -> str:
    """A lifecycle event's record (compact ASCII JSON, ' as \\u0027), or a ``meta`` or
    ``lock`` record (its ``args``). Checked by the caller."""
    doc: dict[str, Any] = {"x": OP_SESSION, "k": record_key, "s": session_id, "u": user_id,
                           "t": accepted_at, "o": action}
    if fields:
        doc["f"] = dict(fields)
    if reason is not None:
        doc["r"] = reason
    if first_wins:
        doc["fw"] = True
    if ended_before is not None:
        doc["b"] = ended_before
    if started_before is not None:
        doc["sb"] = started_before
    if unchanged_before is not None:
        doc["ub"] = unchanged_before
    if args is not None:
        doc["a"] = dict(args)
    if source is not None:
        doc["src"] = source
    if action == "import":
        doc.update({"row": None if row is None else dict(row), "m": messages or [],
                    "st": started_at})
    payload = _ENCODER.encode(doc)
    if action == "import" and messages:  # its messages' ids, given as it is appended
        payload = payload[:-1] + ',"i":' + "null".rjust(ID_DIGITS) + "}"
    return payload.replace("'", "\\u0027") if "'" in payload else payload


def encode_session_change(record_key: str, session_id: str, user_id: str | None,
                          accepted_at: float, action: str, *,
                          fields: Mapping[str, Any] | None = None,
                          fill: Mapping[str, Any] | None = None, create: bool = False,
                          usage: Mapping[str, Any] | None = None,
                          messages: Sequence[Sequence[Any]] | None = None,
                          active_only: bool = False, compact: bool = False,
                          args: Mapping[str, Any] | None = None) -> str:
    """An update, usage, reopen or replace record (compact ASCII JSON, ' as \\u0027), read
    back by ``parse_session``. Checked by the caller; a replace's ``messages`` are
    ``turns.MessageRow`` rows, and its record has an id slot for their ids."""
    doc: dict[str, Any] = {"x": OP_SESSION, "k": record_key, "s": session_id, "u": user_id,
                           "t": accepted_at, "o": action}
    if fields:
        doc["f"] = dict(fields)
    if fill:
        doc["fi"] = dict(fill)
    if create:
        doc["cr"] = True
    if usage is not None:
        doc["us"] = dict(usage)
    if args is not None:
        doc["a"] = dict(args)
    if action == "replace":
        doc["m"] = [list(m) for m in messages or ()]
        if active_only:
            doc["ao"] = True
        if compact:
            doc["cp"] = True
    payload = _ENCODER.encode(doc)
    if action == "replace" and messages:  # its messages' ids, given as it is appended
        payload = payload[:-1] + ',"i":' + "null".rjust(ID_DIGITS) + "}"
    return payload.replace("'", "\\u0027") if "'" in payload else payload


def encode_template_op(record_key: str, accepted_at: float, action: str, *,
                       name: str | None = None, document: Mapping[str, Any] | None = None,
                       mode: str = "save", session_id: str | None = None,
                       task_type: str | None = None, ok: bool | None = None,
                       first_calls: int = 0, first_errors: int = 0) -> str:
    """A template write's record (compact ASCII JSON, ' as \\u0027). Checked by the caller;
    ``parse_template`` reads it back."""
    doc: dict[str, Any] = {"x": OP_TEMPLATE, "k": record_key, "s": lane_of_templates(),
                           "t": accepted_at, "o": action, "n": name}
    if action == "put":
        doc.update({"d": None if document is None else dict(document), "m": mode})
    elif action in ("use", "outcome"):
        doc.update({"sid": session_id, "tt": task_type})
        if action == "outcome":
            doc.update({"ok": ok, "fc": first_calls, "fe": first_errors})
    payload = _ENCODER.encode(doc)
    return payload.replace("'", "\\u0027") if "'" in payload else payload


def parse_template(doc: Mapping[str, Any], payload: str) -> TemplateOp:
    """The template write a record's JSON holds; a put's document is read as a template.

    Raises:
        ValueError, TypeError, KeyError: not a well-formed template write (an unreadable
            document is an ``InvalidTemplateError``, a ValueError).
    """
    record_key, lane, at, action, name = doc["k"], doc["s"], doc["t"], doc["o"], doc["n"]
    if type(record_key) is not str or lane != lane_of_templates():
        raise TypeError("the template write's key or lane is wrong")
    if not isinstance(at, (int, float)) or isinstance(at, bool):
        raise TypeError("the template write's time is not a number")
    if action not in TEMPLATE_ACTIONS:
        raise ValueError(f"unknown template action {action!r:.20}")
    if name is not None and type(name) is not str:
        raise TypeError("the template's name is not a string")
    if "\\u0000" in payload:
        raise ValueError("the template write holds U+0000")
    if action in ("put", "delete") and not name:
        raise ValueError(f"a template {action} needs a name")
    if action == "put":
        document, mode = doc["d"], doc["m"]
        if mode not in PUT_MODES:
            raise ValueError(f"unknown put mode {mode!r:.20}")
        if Template.from_dict(document).name != name:
            raise InvalidTemplateError("the document names another template")
        # A lone surrogate (no UTF-8 store can hold one) raises UnicodeEncodeError.
        json.dumps(document, ensure_ascii=False).encode("utf-8")
        return TemplateOp(record_key, lane, float(at), action, name, document, mode)
    if action == "delete":
        return TemplateOp(record_key, lane, float(at), action, name)
    session_id, task_type = doc["sid"], doc["tt"]
    if type(session_id) is not str or not session_id or type(task_type) is not str:
        raise TypeError("the template write's session id or task type is not a string")
    if action == "use":
        return TemplateOp(record_key, lane, float(at), action, name, session_id=session_id,
                          task_type=task_type)
    ok, calls, errors = doc["ok"], doc["fc"], doc["fe"]
    if type(ok) is not bool or type(calls) is not int or type(errors) is not int or not (
            0 <= errors <= calls):
        raise TypeError("the outcome's result or counts are mistyped")
    return TemplateOp(record_key, lane, float(at), action, name, session_id=session_id,
                      task_type=task_type, ok=ok, first_calls=calls, first_errors=errors)


def parse_session(doc: Mapping[str, Any], payload: str) -> SessionOp:
    """The lifecycle event a record's JSON holds.

    Raises:
        ValueError, TypeError, KeyError: not a well-formed lifecycle event.
    """
    record_key, session_id, user_id, at, action = doc["k"], doc["s"], doc["u"], doc["t"], doc["o"]
    if type(record_key) is not str or type(session_id) is not str:
        raise TypeError("the event's key or session id is not a string")
    if user_id is not None and type(user_id) is not str:
        raise TypeError("the event's user id is not a string")
    if not isinstance(at, (int, float)) or isinstance(at, bool):
        raise TypeError("the event's time is not a number")
    if action not in SESSION_ACTIONS:
        raise ValueError(f"unknown session action {action!r:.20}")
    if action in ("update", "usage", "reopen", "replace", "fields", "active"):
        return _parse_change(doc, payload, record_key, session_id, user_id, float(at), action)
    if action in STATE_ACTIONS:
        return _parse_state(doc, payload, record_key, session_id, user_id, float(at), action)
    fields = doc.get("f") or {}
    if type(fields) is not dict:
        raise TypeError("the event's fields are not an object")
    for name, value in fields.items():
        want = SESSION_FIELDS.get(name)
        if want is None:
            raise ValueError(f"unknown session field {name!r:.40}")
        if value is not None and type(value) is not want:
            raise TypeError(f"the session field {name} is mistyped")
    reason, before, source = doc.get("r"), doc.get("b"), doc.get("src")
    if reason is not None and type(reason) is not str:
        raise TypeError("the end reason is not a string")
    if before is not None and (not isinstance(before, (int, float)) or isinstance(before, bool)):
        raise TypeError("the cut-off is not a number")
    if source is not None and type(source) is not str:
        raise TypeError("the source is not a string")
    if "\\u0000" in payload and _holds_nul(fields, reason, source, doc.get("row"),
                                             _message_columns(doc.get("m"))):
        raise ValueError("the event holds U+0000 in a text column")
    row = messages = started = None
    if action == "import":
        row, messages, started = doc["row"], doc["m"], doc["st"]
        if row is not None and type(row) is not dict:
            raise TypeError("the imported session's row is not an object")
        if not isinstance(started, (int, float)) or isinstance(started, bool):
            raise TypeError("the imported session's start is not a number")
        # Everything the import's statements need is checked here, where a record is read:
        # a part that failed in its batch would fail the batch's other records with it.
        if type(messages) is not list or not all(
                type(m) is list and IMPORTED_MESSAGE_FIELDS - 3 <= len(m)
                <= IMPORTED_MESSAGE_FIELDS
                and type(m[0]) is int and 0 < m[0] < 2**63 and type(m[1]) is str
                and type(m[3]) is str
                and (type(m[8]) is int or (type(m[8]) is float and math.isfinite(m[8])))
                and (len(m) < 13 or m[12] is None or type(m[12]) is str)
                and (len(m) < 14 or m[13] in (0, 1))
                and (len(m) < 15 or m[14] in (0, 1))
                for m in messages):
            raise TypeError("the imported messages are mistyped")
        if len({m[0] for m in messages}) != len(messages):
            raise ValueError("the imported messages repeat an id")
        # A lone surrogate (no UTF-8 store can hold one; SQLite's JSON would write bytes no
        # read can decode) raises UnicodeEncodeError.
        json.dumps([row, messages], ensure_ascii=False).encode("utf-8")
        started = float(started)
    snapshot = doc.get(SNAPSHOT_FIELD)
    if snapshot is not None and type(snapshot) is not dict:
        raise TypeError("the session snapshot is not an object")
    first_id = doc.get("i")
    if first_id is not None and type(first_id) is not int:
        raise TypeError("the import's first message id is not an integer")
    first_wins, started_before = doc.get("fw", False), doc.get("sb")
    unchanged_before = doc.get("ub")
    if type(first_wins) is not bool:
        raise TypeError("the end's first-wins flag is not a boolean")
    if started_before is not None and not _number(started_before):
        raise TypeError("the start cut-off is not a number")
    if unchanged_before is not None and not _number(unchanged_before):
        raise TypeError("the unchanged-since cut-off is not a number")
    return SessionOp(record_key, session_id, user_id, float(at), action, fields, reason,
                     None if before is None else float(before), source, row, messages,
                     started, snapshot, first_id, first_wins=first_wins,
                     started_before=None if started_before is None else float(started_before),
                     unchanged_before=(None if unchanged_before is None
                                       else float(unchanged_before)))


def _parse_change(doc: Mapping[str, Any], payload: str, record_key: str, session_id: str,
                  user_id: str | None, at: float, action: str) -> SessionOp:
    """An update, usage, reopen or replace record (``parse_session``'s other half)."""
    fields, fill = _update_fields(doc.get("f")), _update_fields(doc.get("fi"))
    create = doc.get("cr", False)
    if type(create) is not bool:
        raise TypeError("the update's create flag is not a boolean")
    usage = doc.get("us")
    if action == "usage":
        if type(usage) is not dict or type(usage.get("absolute", False)) is not bool:
            raise TypeError("the usage record's values are not an object")
        for name, value in usage.items():
            if name in USAGE_COUNTS:
                ok = type(value) is int and value >= 0
            elif name in USAGE_COSTS:
                ok = value is None or _number(value)
            elif name in USAGE_TEXTS:
                ok = value is None or type(value) is str
            else:
                ok = name == "absolute"
            if not ok:
                raise TypeError(f"the usage value {name!r:.40} is mistyped")
    messages, active_only = doc.get("m"), doc.get("ao", False)
    compact = doc.get("cp", False)
    if action == "replace":
        if type(messages) is not list or not all(
                type(m) is list and len(m) == 8 and type(m[0]) is str for m in messages):
            raise TypeError("the replacing messages are mistyped")
        if type(active_only) is not bool or type(compact) is not bool:
            raise TypeError("the replace's active-only or compact flag is not a boolean")
    first_id = doc.get("i")
    if first_id is not None and type(first_id) is not int:
        raise TypeError("the record's first message id is not an integer")
    args = doc.get("a") if action in ("fields", "active") else None
    if action == "fields":
        _check_message_fields(args)
    elif action == "active":
        if type(args) is not dict or type(args.get("from")) is not int or args.get(
                "on") not in (0, 1) or type(args.get("rw", False)) is not bool:
            raise TypeError("the active record's arguments are mistyped")
    if "\\u0000" in payload and _holds_nul(fields, fill, usage,
                                             [m[:7] for m in messages or ()]):
        raise ValueError("the event holds U+0000 in a text column")
    return SessionOp(record_key, session_id, user_id, at, action, fields, None, None, None,
                     None, messages if action == "replace" else None, None,
                     doc.get(SNAPSHOT_FIELD), first_id, fill=fill, create=create,
                     usage=usage if action == "usage" else None, active_only=active_only,
                     compact=compact if action == "replace" else False, args=args)


def _check_message_fields(args: Any) -> None:
    """A ``fields`` record's arguments (see ``SessionOp.args``).

    Raises:
        TypeError, ValueError: they are not well formed.
    """
    if type(args) is not dict:
        raise TypeError("the fields record's arguments are not an object")
    mid, values, role = args.get("i"), args.get("f"), args.get("r")
    if type(mid) is not int or not 0 < mid < 2**63:
        raise TypeError("the fields record's message id is not a positive integer")
    if role is not None and type(role) is not str:
        raise TypeError("the fields record's role is not a string")
    if type(values) is not dict or not values:
        raise TypeError("the fields record's values are not a non-empty object")
    for key in values:
        if MESSAGE_FIELD_KEY.fullmatch(key) is None or key in MESSAGE_FIELD_COLUMNS:
            raise ValueError(f"a message's field {key!r:.40} cannot be set")
    # A lone surrogate (no UTF-8 store can hold one) raises UnicodeEncodeError.
    json.dumps(args, ensure_ascii=False).encode("utf-8")


def _parse_state(doc: Mapping[str, Any], payload: str, record_key: str, session_id: str,
                 user_id: str | None, at: float, action: str) -> SessionOp:
    """A ``meta`` or ``lock`` record (``parse_session``'s third part)."""
    args = doc.get("a")
    if type(args) is not dict:
        raise TypeError(f"the {action} record's arguments are not an object")
    if action == "meta":
        key, value = args.get("k"), args.get("v")
        if session_id != lane_of_meta():
            raise ValueError("a meta record is not in the meta lane")
        if type(key) is not str or not key or len(key) > MAX_META_KEY_CHARS:
            raise TypeError("the meta key is not a non-empty string")
        if value is not None and type(value) is not str:
            raise TypeError("the meta value is not a string")
        texts: list[Any] = [key, value]
    else:
        mode, holder, now, expires = args.get("m"), args.get("h"), args.get("n"), args.get("e")
        if mode not in LOCK_MODES:
            raise ValueError(f"unknown lock mode {mode!r:.20}")
        if type(holder) is not str or not holder:
            raise TypeError("the lock's holder is not a non-empty string")
        if not _finite(now) or (mode != "release" and not _finite(expires)):
            raise TypeError("the lock's times are not finite numbers")
        texts = [holder]
    if "\\u0000" in payload and _holds_nul(texts):
        raise ValueError("the event holds U+0000 in a text column")
    # A lone surrogate (no UTF-8 store can hold one) raises UnicodeEncodeError.
    json.dumps(texts, ensure_ascii=False).encode("utf-8")
    return SessionOp(record_key, session_id, user_id, at, action, {}, None, None, None,
                     args=args)


def _update_fields(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if type(value) is not dict:
        raise TypeError("the update's fields are not an object")
    for name, v in value.items():
        want = UPDATE_FIELDS.get(name)
        if want is None:
            raise ValueError(f"unknown session field {name!r:.40}")
        if v is not None and type(v) is not want and not (want is float and type(v) is int):
            raise TypeError(f"the session field {name} is mistyped")
    return value


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value: Any) -> bool:
    return _number(value) and math.isfinite(value)


def _message_columns(messages: Any) -> Any:
    """An import record's messages as ``_holds_nul`` reads them: each row's columns before
    its fields (12: JSON text, which holds U+0000 as an escape)."""
    if type(messages) is not list:
        return messages
    return [m[:12] if type(m) is list else m for m in messages]


def _holds_nul(*values: Any) -> bool:
    """Whether text a statement writes into a column holds U+0000 (SQLite's JSON functions
    end text there). JSON text inside it (a message's fields, its metadata) holds U+0000 as
    an escape, which reads back exactly."""
    stack = list(values)
    while stack:
        v = stack.pop()
        if type(v) is str:
            if "\x00" in v:
                return True
        elif type(v) is list:
            stack.extend(v)
        elif type(v) is dict:
            stack.extend(v.values())
    return False


def parse_kv(doc: Mapping[str, Any], payload: str) -> KvOp:
    """The key-value write a record's JSON (``doc``, read from ``payload``) holds.

    Raises:
        ValueError, TypeError, KeyError: not a well-formed key-value write, or one holding
            U+0000 (refused at accept: SQLite's JSON functions cut text there).
    """
    if doc["x"] != OP_KV:
        raise ValueError(f"unknown record kind {doc['x']!r:.40}")
    record_key, lane, user_id, at, action, key = (
        doc["k"], doc["s"], doc["u"], doc["t"], doc["o"], doc["n"])
    if not all(type(v) is str for v in (record_key, lane, user_id, key)):
        raise TypeError("the operation's key, lane, user id or entry key is not a string")
    if not isinstance(at, (int, float)) or isinstance(at, bool):
        raise TypeError("the operation's time is not a number")
    value, metadata = "", None
    if action == "put":
        value, metadata = doc["v"], doc["d"]
        if type(value) is not str or not (metadata is None or type(metadata) is dict):
            raise TypeError("the operation's value or metadata is mistyped")
    elif action != "del":
        raise ValueError(f"unknown key-value action {action!r:.20}")
    if "\\u0000" in payload:
        raise ValueError("the operation holds U+0000")
    return KvOp(record_key, lane, user_id, float(at), action, key, value, metadata or None)


def parse_op(doc: Mapping[str, Any], payload: str) -> KvOp | SessionOp | TemplateOp:
    """The operation a record's JSON (with an ``x`` field) holds.

    Raises:
        ValueError, TypeError, KeyError: an unknown kind, or a malformed operation.
    """
    kind = doc["x"]
    if kind == OP_KV:
        return parse_kv(doc, payload)
    if kind == OP_SESSION:
        return parse_session(doc, payload)
    if kind == OP_TEMPLATE:
        return parse_template(doc, payload)
    raise ValueError(f"unknown record kind {kind!r:.40}")


def parse_record(payload: str) -> KvOp | None:
    """The key-value write ``payload`` holds, or None for a record of another kind."""
    doc = json.loads(payload)
    return parse_kv(doc, payload) if type(doc) is dict and doc.get("x") == OP_KV else None


def parse_session_record(payload: str) -> SessionOp | None:
    """The lifecycle event ``payload`` holds, or None for a record of another kind."""
    doc = json.loads(payload)
    return (parse_session(doc, payload) if type(doc) is dict and doc.get("x") == OP_SESSION
            else None)


def parse_template_record(payload: str) -> TemplateOp | None:
    """The template write ``payload`` holds, or None for a record of another kind."""
    doc = json.loads(payload)
    return (parse_template(doc, payload) if type(doc) is dict and doc.get("x") == OP_TEMPLATE
            else None)
