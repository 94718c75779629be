"""Key-value memory as data: an entry, and the write operations that carry it through the
outbox (records of kind ``OP_KV``), checked before they are accepted."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidTurnError
from ..turns import _ENCODER, _NULL, LANE_MARK, OP_KV, check_id, check_nesting
from ..turns import _esc as esc

MAX_KEY_CHARS = 512
_PUT = '{"x":"kv","k":%s,"s":%s,"u":%s,"t":%r,"o":"put","n":%s,"v":%s,"d":%s}'
_DEL = '{"x":"kv","k":%s,"s":%s,"u":%s,"t":%r,"o":"del","n":%s}'


class InvalidEntryError(InvalidTurnError):
    """A key-value write or read was refused before it was accepted: the message says which
    argument and what was expected. Nothing was stored."""


@dataclass(frozen=True, slots=True)
class MemoryEntry:
    """One key-value entry of a user's memory."""

    key: str
    value: str
    user_id: str
    created_at: float
    updated_at: float
    metadata: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "user_id": self.user_id,
                "created_at": self.created_at, "updated_at": self.updated_at,
                "metadata": dict(self.metadata)}


def lane_of(user_id: str) -> str:
    """The lane a user's key-value writes are ordered in (never a session id)."""
    return f"{LANE_MARK}kv{LANE_MARK}{user_id}"


def check_user(user_id: object) -> str:
    try:
        checked = check_id("user_id", user_id)
    except InvalidTurnError as exc:
        raise InvalidEntryError(str(exc)) from None
    assert checked is not None
    return checked


def check_key(key: object) -> str:
    if not isinstance(key, str) or not key:
        raise InvalidEntryError(f"key must be a non-empty string, got {_kind(key)}")
    if len(key) > MAX_KEY_CHARS:
        raise InvalidEntryError(f"key is longer than {MAX_KEY_CHARS} characters")
    _check_text("key", key)
    return key


def check_value(value: object) -> str:
    if not isinstance(value, str):
        raise InvalidEntryError(f"value must be a string, got {_kind(value)}")
    _check_text("value", value)
    return value


def check_entry_metadata(metadata: object) -> dict[str, Any] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise InvalidEntryError(f"metadata must be an object (a mapping), got {_kind(metadata)}")
    if not all(isinstance(k, str) for k in metadata):
        raise InvalidEntryError("metadata's keys must be strings")
    md = dict(metadata)
    try:
        check_nesting("metadata", md)
        text = json.dumps(md, allow_nan=False, ensure_ascii=False)
        text.encode("utf-8")
    except InvalidTurnError as exc:
        raise InvalidEntryError(str(exc)) from None
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidEntryError(f"metadata is not JSON-serialisable: {exc}") from None
    except UnicodeEncodeError:
        raise InvalidEntryError("metadata holds a lone surrogate") from None
    if "\\u0000" in text or "\x00" in text:
        raise InvalidEntryError("metadata holds a NUL character")
    return md or None


def encode_put(record_key: str, user_id: str, accepted_at: float, key: str, value: str,
               metadata: Mapping[str, Any] | None) -> str:
    """A put's record: compact ASCII JSON, ' written as \\u0027 (as a turn's, see
    ``turns.encode_payload``)."""
    payload = _PUT % (esc(record_key), esc(lane_of(user_id)), esc(user_id), accepted_at,
                      esc(key), esc(value),
                      _NULL if metadata is None else _ENCODER.encode(metadata))
    return payload.replace("'", "\\u0027") if "'" in payload else payload


def encode_delete(record_key: str, user_id: str, accepted_at: float, key: str) -> str:
    payload = _DEL % (esc(record_key), esc(lane_of(user_id)), esc(user_id), accepted_at,
                      esc(key))
    return payload.replace("'", "\\u0027") if "'" in payload else payload


def op_fields(payload: str) -> tuple[str, str, str, float, dict[str, Any] | None] | None:
    """(action "put" or "del", entry key, value, time, metadata) of an operation's record;
    None for a record of another kind."""
    doc = json.loads(payload)
    if doc.get("x") != OP_KV:
        return None
    md = doc.get("d")
    return doc["o"], doc["n"], doc.get("v", ""), float(doc["t"]), md or None


def _check_text(name: str, text: str) -> None:
    if "\x00" in text:
        raise InvalidEntryError(f"{name} holds a NUL character")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidEntryError(f"{name} holds a lone surrogate") from None


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__
