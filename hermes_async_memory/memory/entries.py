"""Key-value memory as data: an entry, and the checks a write's arguments pass before it is
accepted (its record's format is ``ops``)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import InvalidTurnError
from ..message_rows import check_id, check_nesting

MAX_KEY_CHARS = 512


class InvalidEntryError(InvalidTurnError):
    """A key-value write or read was refused before it was accepted: the message says which
    argument and what was expected. Nothing was stored."""


@dataclass(frozen=True, slots=True)
class MemoryEntry:
    """One key-value entry of a user's memory.

    ``MemoryEntry(key, value)`` is enough, as with seed 000's: ``user_id`` defaults to ""
    (no user), ``created_at`` left 0 is now, ``updated_at`` left 0 is ``created_at`` (not
    updated since), and ``metadata`` is empty."""

    key: str
    value: str
    user_id: str = ""
    created_at: float = 0.0
    updated_at: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.created_at:
            object.__setattr__(self, "created_at", time.time())
        if not self.updated_at:
            object.__setattr__(self, "updated_at", self.created_at)

    def as_dict(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "user_id": self.user_id,
                "created_at": self.created_at, "updated_at": self.updated_at,
                "metadata": dict(self.metadata)}


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
