"""A message as given, as a stored row, and the checks that turn away at ``sync_turn`` what
could not be stored as given.

A message's plain parts go to columns the store indexes and sums (role, text content, tool
calls, tool call id, tool name, token count, timestamp); every other key, and a value no
column holds exactly (structured content, ``None``, an integer call id, text with a lone
surrogate, ...), goes with it as given, in a JSON object of its own (``fields``).
``message_of`` puts the two back together: the message as given. ``turns`` puts a turn's
rows into its outbox record.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from json.encoder import encode_basestring_ascii
from typing import Any

import orjson

from .errors import InvalidTurnError
from .ops import LANE_MARK
from .tool_rows import has_surrogate as _has_surrogate

_esc = encode_basestring_ascii  # a str as a JSON string literal, ASCII only (C)

# One stored message: (role, content text or None, tool calls as JSON text, tool call id,
# tool name, token count, timestamp or None (the record's), fields as JSON text or None).
# A record written by an earlier version holds the first five, or six.
MessageRow = tuple[str, "str | None", "str | None", "str | None", "str | None", "int | None",
                   "float | None", "str | None"]

# Metadata, tool calls and a message's fields nest at most this deep. Deeper JSON is refused
# at sync_turn: past a few hundred levels Python's JSON reader and SQLite's JSON functions
# fail on it, and a turn must never be accepted that no part of the store can read back.
MAX_NESTING = 32

# Token counts in metadata are summed into each session's counters; a value this size can
# never overflow them (2**31 * 2**32 turns < 2**63), a larger one could stall its batch.
MAX_TOKENS = 2**31 - 1

_TOKEN_KEYS = ("input_tokens", "output_tokens")
# Text columns a turn's metadata sets on its session row: ids and names, never cut or changed.
_NAME_KEYS = ("source", "model", "parent_session_id")

_FIELDS_ENCODER = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), allow_nan=False,
                                   check_circular=False).encode

# A message's tool calls as its column holds them: compact, as orjson writes them too (see
# ``_calls_json``).
_CALLS_ENCODER = json.JSONEncoder(ensure_ascii=False, check_circular=False, allow_nan=False,
                                  separators=(",", ":")).encode

_SCALARS = frozenset({str, int, float, bool, type(None)})
_PLAIN = frozenset({str, int, bool, type(None), float})

# Ids check_id passed (its rules do not depend on the name), so a session's next turns skip
# them (~0.5 µs a turn of ~10 here). Emptied when full; any thread.
_PASSED: dict[str, None] = {}
CHECKED_IDS = _PASSED  # read only: ``sync_turn`` looks its ids up here before checking
_PASSED_MAX = 65_536

_CALL_KEYS = frozenset({"id", "type", "function"})
_FUNCTION_KEYS = frozenset({"name", "arguments"})
_NO_FUNCTION: dict[str, Any] = {}


def check_metadata(metadata: object) -> dict[str, Any] | None:
    """A copy of ``metadata`` that the store can hold exactly, or None.

    Raises:
        InvalidTurnError: not a mapping of text keys, not JSON (a key that is not a string, a
            value JSON cannot hold, NaN), nested deeper than ``MAX_NESTING``, a token count
            that is not an integer from 0 to ``MAX_TOKENS``, or a session name (source,
            model, parent_session_id) holding a NUL or a lone surrogate.
    """
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise InvalidTurnError(f"metadata must be a mapping, got {type(metadata).__name__}")
    if not metadata:
        return None
    md = dict(metadata)
    for name in _TOKEN_KEYS:
        value = md.get(name)
        if value is None:
            continue
        if not is_token_count(value):
            raise InvalidTurnError(
                f"metadata.{name} must be an integer from 0 to {MAX_TOKENS}, got {value!r:.40}")
    for name in _NAME_KEYS:
        value = md.get(name)
        if isinstance(value, str):
            if "\x00" in value:
                raise InvalidTurnError(f"metadata.{name} holds a NUL character")
            if not value.isascii() and _has_surrogate(value):
                raise InvalidTurnError(f"metadata.{name} holds a lone surrogate")
    check_json("metadata", md)
    return md


def check_nesting(name: str, value: object, limit: int = MAX_NESTING) -> None:
    """Raises InvalidTurnError when ``value`` nests lists and dicts deeper than ``limit``.

    Plain JSON types are told by ``type() is`` first: an ``isinstance`` against the
    ``Mapping`` ABC costs ~10x more, and a turn with five tool calls has a few hundred
    values to look at."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        kind = type(item)
        if kind is dict:
            children: Any = item.values()  # type: ignore[attr-defined]
        elif kind is list or kind is tuple or isinstance(item, (list, tuple)):
            children = item
        elif kind not in _SCALARS and isinstance(item, Mapping):
            children = item.values()
        else:
            continue
        if depth > limit:
            raise InvalidTurnError(f"{name} nests deeper than {limit} levels")
        for child in children:
            if type(child) not in _SCALARS:
                stack.append((child, depth + 1))


def check_json(name: str, value: object, limit: int = MAX_NESTING) -> None:
    """Raises InvalidTurnError unless ``value`` is JSON that reads back equal to it: text
    keys only (``{1: "a"}`` would come back as ``{"1": "a"}``, and beside a ``"1"`` key one
    value would be lost), strings, integers, finite floats, booleans, None, lists, tuples
    (read back as lists) and mappings, at most ``limit`` levels deep."""
    stack: list[tuple[object, int, str]] = [(value, 1, name)]
    while stack:
        item, depth, where = stack.pop()
        kind = type(item)
        if kind is str or kind is int or kind is bool or item is None:
            continue
        if kind is float:
            if not math.isfinite(item):  # type: ignore[arg-type]
                raise InvalidTurnError(f"{where} is {item!r}: not JSON-serialisable")
            continue
        if depth > limit:
            raise InvalidTurnError(f"{name} nests deeper than {limit} levels")
        if kind is dict or (kind not in _SCALARS and isinstance(item, Mapping)):
            for k, v in item.items():  # type: ignore[attr-defined]
                if type(k) is not str:
                    raise InvalidTurnError(
                        f"{where} has a key that is not a string: {k!r:.40} "
                        f"({type(k).__name__}); JSON keys are text")
                if type(v) not in _PLAIN:
                    stack.append((v, depth + 1, f"{where}.{k}"))
                elif type(v) is float and not math.isfinite(v):
                    raise InvalidTurnError(f"{where}.{k} is {v!r}: not JSON-serialisable")
        elif kind is list or kind is tuple or isinstance(item, (list, tuple)):
            for i, v in enumerate(item):  # type: ignore[arg-type]
                if type(v) not in _PLAIN:
                    stack.append((v, depth + 1, f"{where}[{i}]"))
                elif type(v) is float and not math.isfinite(v):
                    raise InvalidTurnError(f"{where}[{i}] is {v!r}: not JSON-serialisable")
        elif isinstance(item, (int, str)):
            continue  # a subclass (an IntEnum, a StrEnum): JSON keeps its value
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise InvalidTurnError(f"{where} is {item!r}: not JSON-serialisable")
        else:
            raise InvalidTurnError(f"{where} is a {kind.__name__}: not JSON-serialisable")


def is_token_count(value: object) -> bool:
    """An integer from 0 to ``MAX_TOKENS`` (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKENS


def check_id(name: str, value: object, *, optional: bool = False) -> str | None:
    if type(value) is str and value in _PASSED:  # a session's every turn carries its ids
        return value
    if value is None and optional:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidTurnError(f"{name} must be a non-empty string, got {type(value).__name__}")
    if len(value) > 512:
        raise InvalidTurnError(f"{name} is longer than 512 characters")
    if "\x00" in value:
        raise InvalidTurnError(f"{name} holds a NUL character")
    if LANE_MARK in value:
        raise InvalidTurnError(f"{name} holds the reserved character \\x01")
    if not value.isascii() and _has_surrogate(value):
        raise InvalidTurnError(f"{name} holds a lone surrogate")
    if type(value) is str:  # a subclass could compare equal to one and still differ
        if len(_PASSED) >= _PASSED_MAX:
            _PASSED.clear()
        _PASSED[value] = None
    return value


def content_text(content: object) -> str | None:
    """The text of structured message content, for the index and the recall: the ``text``
    strings of its parts (OpenAI's ``{"type": "text", "text": ...}``, and any part that
    holds one), in order, a line each; None when it holds none."""
    found: list[str] = []
    stack: list[object] = [content]
    while stack:
        item = stack.pop()
        if isinstance(item, Mapping):
            text = item.get("text")
            if isinstance(text, str):
                found.append(text)
            stack.extend(reversed([v for k, v in item.items() if k != "text"
                                   and isinstance(v, (Mapping, list, tuple))]))
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
    return "\n".join(found) if found else None


def message_row(i: int, m: object, notes: list[int] | None = None) -> MessageRow:
    """One message, as given, as a ``MessageRow``: what the columns hold exactly, and every
    other key (and any value a column would not hold exactly) in its fields. Text holding
    NUL or a lone surrogate is kept exactly in the fields, and its content column holds a
    copy with U+FFFD there, for the index and the recall (``index_text``); ``notes`` gets
    an entry when that happens.

    Raises:
        InvalidTurnError: not a mapping with a non-empty string role, or not JSON that reads
            back as given (see ``check_json``).
    """
    if type(m) is dict:
        row = _plain_row(m)
        if row is not None:
            return row
    elif not isinstance(m, Mapping):
        raise InvalidTurnError(f"messages[{i}] must be a dict, got {type(m).__name__}")
    role = m.get("role")
    if type(role) is not str or not role:
        raise InvalidTurnError(f"messages[{i}] has no role (a non-empty string)")
    if "\x00" in role or (not role.isascii() and _has_surrogate(role)):
        raise InvalidTurnError(f"messages[{i}].role holds a NUL or a lone surrogate")
    fields: dict[str, Any] = {}
    text: str | None = None
    calls_json = call_id = tool_name = None
    for key, value in m.items():
        if key == "role":
            continue
        if key == "content":
            if type(value) is str:
                if _column_text(value):
                    text = value
                else:  # exactly in the fields; the column's copy is for the index
                    fields[key] = value
                    text = index_text(value)
                    if notes is not None:
                        notes.append(i)
                continue
            text = None if value is None else content_text(value)
            if text is not None and not _column_text(text):
                text = index_text(text)
                if notes is not None:
                    notes.append(i)
        elif key == "tool_calls" and type(value) is list:
            calls_json = _calls_json(i, value)
            continue
        elif key == "tool_call_id" and type(value) is str and _column_text(value):
            call_id = value
            continue
        elif type(key) is not str:
            raise InvalidTurnError(f"messages[{i}] has a key that is not a string: {key!r:.40}")
        fields[key] = value
    tool = m.get("tool_name")
    if tool is None and role == "tool":
        tool = m.get("name")
    if type(tool) is str and _column_text(tool):
        tool_name = tool
    tokens = message_tokens(m) if "token_count" in m or "usage" in m else None
    at = m.get("timestamp")
    stamp = None if at is None else float(at) if isinstance(
        at, (int, float)) and type(at) is not bool and math.isfinite(at) else None
    fields_json = _fields_json(i, fields) if fields else None
    return (role, text, calls_json, call_id, tool_name, tokens, stamp, fields_json)


def _plain_row(m: dict[str, Any]) -> MessageRow | None:
    """``message_row`` of the two commonest messages, made directly (a third of its cost for
    a tool turn's rows): a text message, ``{"role", "content"}``, and a tool's answer,
    ``{"role": "tool", "tool_call_id", "name", "content"}``, every value text a column holds
    exactly. None for any other message: ``message_row`` goes its general way."""
    n = len(m)
    role = m.get("role")
    if type(role) is not str:
        return None
    if n == 2:
        content = m.get("content")
        if (type(content) is str and role and _column_text(role)
                and _column_text(content)):
            return (role, content, None, None, None, None, None, None)
    elif n == 4 and role == "tool":
        call_id, name, content = m.get("tool_call_id"), m.get("name"), m.get("content")
        if (type(call_id) is str and type(name) is str and type(content) is str
                and _column_text(call_id) and _column_text(name) and _column_text(content)):
            # The tool's name: its column, and its key among the fields (_fields_json's form).
            return (role, content, None, call_id, name, None, None, '{"name":' + _esc(name) + "}")
    return None


def _fields_json(i: int, fields: dict[str, Any]) -> str:
    """A message's other keys as JSON text (compact, ASCII). Text values alone (a tool's
    ``name``, ``reasoning``) need no check, and are written by the C string encoder directly,
    without setting up an encoder object for each message."""
    if all([type(v) is str for v in fields.values()]):  # the keys are text (message_row)
        return "{" + ",".join([_esc(k) + ":" + _esc(v) for k, v in fields.items()]) + "}"
    check_json(f"messages[{i}]", fields)
    try:
        return _FIELDS_ENCODER(fields)
    except RecursionError:
        raise InvalidTurnError(f"messages[{i}] nests deeper than {MAX_NESTING} levels") from None


def index_text(value: str) -> str:
    """``value`` with NUL and lone surrogates as U+FFFD: what a text column can hold (SQLite's
    JSON functions end text at NUL, and UTF-8 cannot hold a lone surrogate)."""
    text: str = sanitize(value)
    return text.replace("\x00", "\ufffd")


def _column_text(value: str) -> bool:
    """Whether a text column holds ``value`` exactly (no NUL: the SQL paths cut it there; no
    lone surrogate: UTF-8 cannot hold one)."""
    return "\x00" not in value and (value.isascii() or not _has_surrogate(value))


def message_of(role: str, content: str | None, tool_calls: str | None, tool_call_id: str | None,
               fields: str | None, *, tool_name: str | None = None) -> dict[str, Any]:
    """A stored message put back together, as it was given (``message_row``'s inverse).

    A message an earlier version stored has no fields: it comes back as that version kept it
    (role, content, its tool calls and call id, and its tool name as ``name``); a message of
    this version with no fields has no tool name (it would be in its fields)."""
    out: dict[str, Any] = {"role": role}
    if content is not None:
        out["content"] = content
    if tool_calls is not None:
        out["tool_calls"] = _loads_or_text(tool_calls)
    if tool_call_id is not None:
        out["tool_call_id"] = tool_call_id
    if fields is not None:
        out.update(json.loads(fields))
    elif tool_name is not None:
        out["name"] = tool_name
    return out


def _loads_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def turn_messages(
    user_content: object, assistant_content: object, messages: Sequence[Mapping[str, Any]] | None,
    notes: list[int] | None = None,
) -> list[MessageRow]:
    """The rows of one turn.

    With ``messages``, the turn is exactly those messages, each stored as given, in order;
    ``user_content`` and ``assistant_content`` are then only checked (they are the turn's
    texts for the prefetch cache, which reads them from the rows). Without, the turn is a
    user message and an assistant message with those contents.
    """
    if messages is not None and not (
            isinstance(messages, Sequence) and not isinstance(messages, (str, bytes))):
        raise InvalidTurnError("messages must be a list of message dicts")
    if messages:
        _check_text("user_content", user_content)
        _check_text("assistant_content", assistant_content)
        return [message_row(i, m, notes) for i, m in enumerate(messages)]
    return [_text_row("user", "user_content", user_content, notes),
            _text_row("assistant", "assistant_content", assistant_content, notes)]


def _check_text(name: str, value: object) -> None:
    if value is not None and not isinstance(value, (str, list)):
        raise InvalidTurnError(f"{name} must be a string, got {type(value).__name__}")


def _text_row(role: str, name: str, value: object, notes: list[int] | None) -> MessageRow:
    if type(value) is str and "\x00" not in value and (value.isascii()
                                                       or not _has_surrogate(value)):
        return (role, value, None, None, None, None, None, None)
    if value is not None and not isinstance(value, (str, list)):
        raise InvalidTurnError(f"{name} must be a string, got {type(value).__name__}")
    return message_row(0, {"role": role, "content": value}, notes)


def _calls_json(i: int, tool_calls: object) -> str:
    """A message's ``tool_calls`` as JSON text: compact, non-ASCII as it is.

    OpenAI's shape goes to orjson (``_openai_shaped``: text in lists and dicts, nothing
    else orjson could write its own way, such as a UUID or a dataclass). Anything else is
    encoded first by the standard library, without the encoder's cycle check: a cycle or a
    deep nesting stops at the interpreter's recursion limit. Then ``_plain_keys`` walks the
    lists and dicts alone: the encoder writes a number, bool or None key as text (``{1:
    "a"}`` as ``{"1": "a"}``), which would not read back as given. Anything it is not sure
    of goes to ``check_json``, which says what is wrong."""
    if _openai_shaped(tool_calls):
        # Lists and dicts of text alone: orjson writes exactly what _CALLS_ENCODER would, in
        # a tenth of the time (5 calls: ~2 µs against ~15 µs). It refuses a lone surrogate,
        # which the path below names.
        try:
            return orjson.dumps(tool_calls).decode()
        except orjson.JSONEncodeError:
            pass
    name = f"messages[{i}].tool_calls"
    try:
        calls_json = _CALLS_ENCODER(tool_calls)
    except RecursionError:
        raise InvalidTurnError(f"{name} nests deeper than {MAX_NESTING} levels") from None
    except (TypeError, ValueError) as exc:
        check_json(name, tool_calls)
        raise InvalidTurnError(f"{name} is not JSON-serialisable") from exc
    if not _plain_keys(tool_calls):
        check_json(name, tool_calls)
    if "\x00" in calls_json or (not calls_json.isascii() and _has_surrogate(calls_json)):
        raise InvalidTurnError(f"{name} holds a NUL or a lone surrogate in its text")
    return calls_json


def _openai_shaped(calls: object) -> bool:
    """Whether ``calls`` are tool calls of OpenAI's shape with text values only (``{"id",
    "type", "function": {"name", "arguments"}}``, any of them missing): then every key is
    text and nothing nests, which ``_plain_keys`` would find walking them, in twice the
    time. False means "not sure"."""
    if type(calls) is not list:
        return False
    for call in calls:
        if type(call) is not dict or not call.keys() <= _CALL_KEYS:
            return False
        function = call.get("function", _NO_FUNCTION)
        if (type(function) is not dict or not function.keys() <= _FUNCTION_KEYS
                or type(call.get("id", "")) is not str or type(call.get("type", "")) is not str
                or type(function.get("name", "")) is not str
                or type(function.get("arguments", "")) is not str):
            return False
    return True


def _plain_keys(value: object, limit: int = MAX_NESTING) -> bool:
    """Whether every dict in ``value`` (plain lists and dicts, as the encoder just wrote
    them) has text keys only, at most ``limit`` levels deep. False means "not sure": a
    tuple, a mapping that is no dict, a key of another type, a value of another type, or deeper
    nesting. Less than half the cost of scanning the encoded text for such a key."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return False
        if type(item) is dict:
            for k, v in item.items():
                if type(k) is not str:
                    return False
                if type(v) is dict or type(v) is list:
                    stack.append((v, depth + 1))
                elif type(v) not in _PLAIN:
                    return False
        elif type(item) is list:
            for v in item:
                if type(v) is dict or type(v) is list:
                    stack.append((v, depth + 1))
                elif type(v) not in _PLAIN:
                    return False
        else:
            return False
    return True


def message_tokens(m: Mapping[str, Any]) -> int | None:
    """The token count a message reports: its own ``token_count`` (as Hermes's session store
    keeps it), else, for a model's reply, the completion tokens of its ``usage``; None when it
    reports none (a session's counters are estimated then; a message's is left unknown)."""
    tokens: object = m.get("token_count")
    usage = m.get("usage")
    if tokens is None and m.get("role") == "assistant" and isinstance(usage, Mapping):
        tokens = usage.get("completion_tokens", usage.get("output_tokens"))
    return tokens if isinstance(tokens, int) and is_token_count(tokens) else None


def sanitize(value: Any) -> Any:
    """Replace lone surrogates (which no UTF-8 store can hold) with U+FFFD, recursively."""
    if isinstance(value, str):
        return value.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    if isinstance(value, list):
        return [sanitize(v) for v in value]
    if isinstance(value, tuple):
        return tuple(sanitize(v) for v in value)
    if isinstance(value, dict):
        return {sanitize(k): sanitize(v) for k, v in value.items()}
    return value
