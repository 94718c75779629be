"""Operations: records that travel the outbox beside turns, ordered in lanes as turns are in
their sessions. The one kind so far is a key-value write (``OP_KV``): put or delete one entry
of a user's memory, in the lane ``lane_of(user)``.

This module owns the record's format: encoding it (on the caller's thread, like a turn's),
and reading it back with its checks (``parse_kv``), for the writer's decode, the store's
batch and the reads that lay pending writes over the store's answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from json.encoder import encode_basestring_ascii as _esc
from typing import Any, NamedTuple

OP_KV = "kv"
OP_KINDS = frozenset({OP_KV})
# No id may hold this character (``turns.check_id``), so a lane is never a session's id.
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


def lane_of(user_id: str) -> str:
    """The lane a user's key-value writes are ordered in."""
    return f"{LANE_MARK}kv{LANE_MARK}{user_id}"


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


def parse_record(payload: str) -> KvOp | None:
    """The key-value write ``payload`` holds, or None for a record of another kind."""
    doc = json.loads(payload)
    return parse_kv(doc, payload) if type(doc) is dict and doc.get("x") == OP_KV else None
