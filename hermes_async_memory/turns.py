"""A turn as data: what sync_turn builds, what the outbox stores and what the writer commits."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from json.encoder import encode_basestring_ascii
from typing import Any, NamedTuple

from .errors import InvalidTurnError
from .ops import LANE_MARK, OP_KV, OP_SESSION, OP_TEMPLATE, KvOp, TemplateOp, parse_op

# One stored message: (role, content, tool_calls_json, tool_call_id, tool_name), and its
# token count after those when it reported one (the record leaves it out otherwise).
MessageRow = (tuple[str, str, "str | None", "str | None", "str | None"]
              | tuple[str, str, "str | None", "str | None", "str | None", int])

_TEXT_KEPT = 2000  # characters of the user and assistant text kept for the prefetch cache
# Metadata and tool calls nest at most this deep. Deeper JSON is refused at sync_turn: past a
# few hundred levels Python's JSON reader and SQLite's JSON functions fail on it, and a turn
# must never be accepted that no part of the store can read back.
MAX_NESTING = 32
# Token counts in metadata are summed into each session's counters; a value this size can
# never overflow them (2**31 * 2**32 turns < 2**63), a larger one could stall its batch.
MAX_TOKENS = 2**31 - 1
_TOKEN_KEYS = ("input_tokens", "output_tokens")

_esc = encode_basestring_ascii  # a str as a JSON string literal, ASCII only (C)
_ENCODER = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), allow_nan=False)
_CALLS_ENCODER = json.JSONEncoder(ensure_ascii=False, check_circular=False).encode
# The C scanner json.loads runs, without its two Python wrappers (~0.4 µs a record).
_scan_once: Callable[[str, int], tuple[Any, int]] = (
    json.JSONDecoder().scan_once)  # type: ignore[attr-defined]
_NULL = "null"
TURN = "turn"
_DOC = '{"k":%s,"s":%s,"u":%s,"t":%r,"c":%s,"m":[%s],"d":%s}'


class Receipt(NamedTuple):
    """What sync_turn hands back: the turn is durable once you hold this."""

    key: str
    session_id: str
    seq: int
    accepted_at: float
    deferred: bool = False


class Turn(NamedTuple):
    """An accepted turn on its way to the store.

    ``payload`` is the turn as JSON: the outbox record, and what the writer hands SQLite
    (one text parameter per batch, unpacked by ``json_each`` in C). Everything else is the
    few plain values the writer, the cache and the backends read, taken from it once.
    """

    key: str
    seq: int
    session_id: str
    user_id: str | None
    accepted_at: float
    payload: str
    nbytes: int
    segment: int
    n_messages: int
    tool_calls: int
    user_text: str
    assistant_text: str
    source: str | None
    model: str | None
    parent_session_id: str | None
    input_tokens: int
    output_tokens: int
    has_nul: bool
    # What the record is: a turn (TURN), or an operation through the same durable path (a
    # key-value write, ``ops.OP_KV``, in its user's lane; a session lifecycle event,
    # ``ops.OP_SESSION``, in its session's; a template write, ``ops.OP_TEMPLATE``, in the
    # templates' lane): no messages, and its lane for session id.
    kind: str = "turn"

    @classmethod
    def build(
        cls, *, key: str, session_id: str, user_id: str | None, accepted_at: float,
        messages: Sequence[MessageRow], metadata: Mapping[str, Any] | None, segment: int = 0,
    ) -> Turn:
        """Raises TypeError or ValueError when ``metadata`` is not JSON-serialisable."""
        payload = encode_payload(key, session_id, user_id, accepted_at, messages, metadata)
        return cls._fields_of(key, session_id, user_id, accepted_at, messages, metadata,
                              payload, segment=segment, nbytes=len(payload))

    @classmethod
    def decode(cls, record: bytes | str, segment: int = 0, seq: int = 0) -> Turn:
        """The turn an outbox record (its JSON) holds.

        The writer decodes every record it commits with this (on the event loop), so it reads
        the JSON with the C scanner directly and checks the fields in the one pass that also
        picks out the texts.

        Raises:
            ValueError: the record is not a turn's JSON (also UnicodeDecodeError,
                json.JSONDecodeError); KeyError, TypeError: a field is missing or mistyped;
                RecursionError: it nests too deep to read.
        """
        payload = record.decode("ascii") if isinstance(record, bytes) else record
        try:
            doc, end = _scan_once(payload, 0)
        except StopIteration:
            end = -1
        if end != len(payload):
            doc = json.loads(payload)  # not JSON, or trailing text: the full reader says why
        if type(doc) is not dict:
            raise TypeError("the record is not a JSON object")
        if "x" in doc:
            return cls._op_of(doc, payload, segment, seq)
        key, session_id, user_id, at, messages = doc["k"], doc["s"], doc["u"], doc["t"], doc["m"]
        if type(key) is not str or type(session_id) is not str:
            raise TypeError("the record's key or session id is not a string")
        if user_id is not None and type(user_id) is not str:
            raise TypeError("the record's user id is not a string")
        if not isinstance(at, (int, float)) or type(messages) is not list:
            raise TypeError("the record's time or messages are mistyped")
        for m in messages:
            if (type(m) is not list or type(m[0]) is not str
                    or (len(m) != 5 and (len(m) != 6 or type(m[5]) is not int))):
                raise TypeError("a message of the record is mistyped")
        return cls._fields_of(key, session_id, user_id, float(at), messages, doc["d"],
                              payload, segment=segment, nbytes=len(payload), seq=seq)

    @classmethod
    def _fields_of(
        cls, key: str, session_id: str, user_id: str | None, accepted_at: float,
        messages: Sequence[Sequence[Any]], metadata: Mapping[str, Any] | None, payload: str,
        *, segment: int, nbytes: int, seq: int = 0,
    ) -> Turn:
        user = assistant = ""
        tool_calls = 0
        for m in messages:  # one pass: the first user text, the last non-empty assistant text
            role = m[0]
            if role == "assistant":
                if m[1]:
                    assistant = m[1]
            elif role == "user":
                if not user:
                    user = m[1]
            if m[2]:  # an assistant's calls, as JSON text: counted as Hermes counts them
                tool_calls += _n_calls(m[2])
        if metadata and isinstance(metadata, Mapping):
            md = metadata
            source, model, parent = (_str(md.get("source")), _str(md.get("model")),
                                     _str(md.get("parent_session_id")))
            tokens_in, tokens_out = _count(md.get("input_tokens")), _count(md.get("output_tokens"))
        else:
            source = model = parent = None
            tokens_in = tokens_out = 0
        # Positional tuple.__new__: a 19-field NamedTuple built by keyword (or _replace) costs
        # ~1.5 µs.
        return tuple.__new__(cls, (
            key, seq, session_id, user_id, accepted_at, payload, nbytes, segment, len(messages),
            tool_calls, user[:_TEXT_KEPT] if len(user) > _TEXT_KEPT else user,
            assistant[:_TEXT_KEPT] if len(assistant) > _TEXT_KEPT else assistant,
            source, model, parent, tokens_in, tokens_out,
            "\\u0000" in payload, TURN,
        ))

    @classmethod
    def _op_of(cls, doc: dict[str, Any], payload: str, segment: int, seq: int) -> Turn:
        """An operation's record (``ops``), checked here as a turn's is: a record no part
        can apply is dead-lettered at decode and never reaches a commit."""
        op = parse_op(doc, payload)
        user: str | None = None
        if isinstance(op, KvOp):
            lane, kind, user = op.lane, OP_KV, op.user_id
        elif isinstance(op, TemplateOp):
            lane, kind = op.lane, OP_TEMPLATE
        else:
            lane, kind, user = op.session_id, OP_SESSION, op.user_id
        return tuple.__new__(cls, (
            op.record_key, seq, lane, user, op.accepted_at, payload, len(payload),
            segment, 0, 0, "", "", None, None, None, 0, 0, False, kind))

    def encode(self) -> bytes:
        """The outbox record (ASCII JSON)."""
        return self.payload.encode("ascii")

    @property
    def messages(self) -> tuple[MessageRow, ...]:
        return tuple(tuple(m) for m in json.loads(self.payload)["m"])

    @property
    def metadata(self) -> dict[str, Any] | None:
        md: dict[str, Any] | None = json.loads(self.payload)["d"]
        return md

    def with_seq(self, seq: int) -> Turn:
        return self._replace(seq=seq)

    @classmethod
    def stub(cls, key: str, session_id: str, *, seq: int = 0, segment: int = 0,
             accepted_at: float = 0.0) -> Turn:
        """A turn that holds only where it came from: for a record that does not decode."""
        return tuple.__new__(cls, (key, seq, session_id, None, accepted_at, "", 0, segment, 0,
                                   0, "", "", None, None, None, 0, 0, False, TURN))


def encode_payload(
    key: str, session_id: str, user_id: str | None, accepted_at: float,
    messages: Sequence[MessageRow], metadata: Mapping[str, Any] | None,
) -> str:
    """A turn's JSON: ``{"k", "s", "u", "t", "c", "m", "d"}``, compact and ASCII, as
    ``json.dumps`` would write it, put together from the C string encoder (2-3x cheaper than
    ``json.dumps`` of the dict; this runs on the caller's thread for every turn).

    ASCII only (non-ASCII as \\u escapes, which SQLite's JSON decodes in C): the writer thread
    hands a batch to SQLite without re-encoding a megabyte under the GIL. Single quotes are
    written as the JSON escape \\u0027, so a batch of payloads joined is already a valid SQL
    string literal between two quotes (see store.Batch). NaN is refused (it is not JSON).

    Raises:
        TypeError, ValueError: ``metadata`` is not JSON-serialisable.
    """
    payload = _DOC % (
        _esc(key), _esc(session_id), _NULL if user_id is None else _esc(user_id),
        accepted_at, _esc(scope_tokens(user_id, session_id)),
        ",".join([
            f"[{_esc(m[0])},{_esc(m[1])},{_NULL if m[2] is None else _esc(m[2])},"
            f"{_NULL if m[3] is None else _esc(m[3])},{_NULL if m[4] is None else _esc(m[4])}"
            f"{'' if len(m) == 5 else f',{m[5]:d}'}]"
            for m in messages
        ]),
        _NULL if metadata is None else _ENCODER.encode(metadata),
    )
    if "'" in payload:
        payload = payload.replace("'", "\\u0027")
    return payload


def payload_rows(payload: str) -> list[tuple[Any, ...]]:
    """The message rows a turn's payload holds, as the stores insert them: (session_id,
    turn_key, ordinal, role, content, tool_calls, tool_call_id, tool_name, timestamp,
    user_id, scope, metadata as JSON text or None, token_count)."""
    doc = json.loads(payload)
    md = json.dumps(doc["d"], ensure_ascii=False) if doc["d"] else None
    return [(doc["s"], doc["k"], i, *m[:5], doc["t"], doc["u"], doc["c"], md,
             m[5] if len(m) > 5 else None) for i, m in enumerate(doc["m"])]


def check_metadata(metadata: object) -> dict[str, Any] | None:
    """A copy of ``metadata`` that the store can hold, or None.

    Raises:
        InvalidTurnError: not a mapping, nested deeper than ``MAX_NESTING``, or a token count
            that is not an integer from 0 to ``MAX_TOKENS``.
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
    check_nesting("metadata", md)
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


_SCALARS = frozenset({str, int, float, bool, type(None)})


def is_token_count(value: object) -> bool:
    """An integer from 0 to ``MAX_TOKENS`` (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKENS


def _str(value: object) -> str | None:
    return value.replace("\x00", "") if isinstance(value, str) else None


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def scope_hash(value: str) -> str:
    return hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


@lru_cache(maxsize=65536)
def scope_tokens(user_id: str | None, session_id: str) -> str:
    """The FTS tokens a turn is stored under (cached: two hashes cost ~1 µs per turn)."""
    if user_id:
        return f"u{scope_hash(user_id)} s{scope_hash(session_id)}"
    return f"s{scope_hash(session_id)}"


def scope_token_for(user_id: str | None, session_id: str | None) -> str:
    """The one token a recall filters on: the user's when known, else the session's."""
    if user_id:
        return "u" + scope_hash(user_id)
    if session_id:
        return "s" + scope_hash(session_id)
    raise InvalidTurnError("a recall needs a user_id or a session_id")


def check_id(name: str, value: object, *, optional: bool = False) -> str | None:
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
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidTurnError(f"{name} holds a lone surrogate") from exc
    return value


def text_of(name: str, value: object) -> str:
    """Message content as text: str as is, None as "", OpenAI content parts joined."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    if isinstance(value, list):
        parts = []
        for part in value:
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                parts.append(part["text"])
        return "\n".join(parts)
    raise InvalidTurnError(f"{name} must be a string, got {type(value).__name__}")


def turn_messages(
    user_content: object, assistant_content: object, messages: Sequence[Mapping[str, Any]] | None
) -> list[MessageRow]:
    """The rows of one turn.

    ``messages`` is the OpenAI-style conversation as of the finished turn (Hermes passes the
    whole history). Only this turn's part is stored: from the last user message to the end,
    so tool calls and tool results are kept and earlier turns are not written twice.
    """
    user = text_of("user_content", user_content)
    assistant = text_of("assistant_content", assistant_content)
    if messages:
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
            raise InvalidTurnError("messages must be a list of message dicts")
        start = None
        for i in range(len(messages) - 1, -1, -1):
            m = messages[i]
            if not isinstance(m, Mapping):
                raise InvalidTurnError(f"messages[{i}] must be a dict, got {type(m).__name__}")
            if m.get("role") == "user":
                start = i
                break
        if start is not None:
            rows = [_row(i, messages[i]) for i in range(start, len(messages))]
            if assistant and not any(r[0] == "assistant" and r[1] == assistant for r in rows):
                rows.append(("assistant", assistant, None, None, None))
            return rows
    return [("user", user, None, None, None), ("assistant", assistant, None, None, None)]


def _n_calls(calls_json: str) -> int:
    """How many calls a message's ``tool_calls`` (JSON text) holds; 0 when it is no list."""
    try:
        calls = json.loads(calls_json)
    except ValueError:
        return 0
    return len(calls) if type(calls) is list else 0


def _calls_json(i: int, tool_calls: object) -> str:
    """A message's ``tool_calls`` as JSON text (as ``json.dumps`` writes it).

    Encoded first, without the encoder's cycle check: a cycle or a deep nesting stops at the
    interpreter's recursion limit. The nesting is walked only when the text holds more
    brackets than ``MAX_NESTING`` (it cannot nest deeper than it has brackets): five calls
    with short arguments hold about 15, and the walk cost a third of their encoding."""
    name = f"messages[{i}].tool_calls"
    try:
        calls_json = _CALLS_ENCODER(tool_calls)
    except RecursionError:
        raise InvalidTurnError(f"{name} nests deeper than {MAX_NESTING} levels") from None
    except (TypeError, ValueError) as exc:
        raise InvalidTurnError(f"{name} is not JSON-serialisable") from exc
    if calls_json.count("{") + calls_json.count("[") > MAX_NESTING:
        check_nesting(name, tool_calls)
    return calls_json


def _row(i: int, m: Mapping[str, Any]) -> MessageRow:
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise InvalidTurnError(f"messages[{i}] has no role")
    content = text_of(f"messages[{i}].content", m.get("content"))
    tool_calls = m.get("tool_calls")
    calls_json = _calls_json(i, tool_calls) if tool_calls else None
    call_id = m.get("tool_call_id")
    name = m.get("name") or m.get("tool_name")
    row: MessageRow = (
        role,
        content,
        calls_json,
        call_id if isinstance(call_id, str) else None,
        name if isinstance(name, str) else None,
    )
    tokens = message_tokens(m)
    return row if tokens is None else (*row, tokens)


def message_tokens(m: Mapping[str, Any]) -> int | None:
    """The token count a message reports: its own ``token_count`` (as Hermes's session store
    keeps it), else, for a model's reply, the completion tokens of its ``usage``; None when it
    reports none (a session's counters are estimated then; a message's is left unknown)."""
    tokens: object = m.get("token_count")
    usage = m.get("usage")
    if tokens is None and m.get("role") == "assistant" and isinstance(usage, Mapping):
        tokens = usage.get("completion_tokens", usage.get("output_tokens"))
    return tokens if isinstance(tokens, int) and is_token_count(tokens) else None


def has_lone_surrogate(rows: Sequence[MessageRow], metadata: Mapping[str, Any] | None) -> bool:
    """Whether some text holds a lone surrogate, which no UTF-8 store can hold."""
    for row in rows:
        for value in row[1:5]:
            if value and not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    return True
    if metadata:
        try:
            json.dumps(metadata, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return True
        except (TypeError, ValueError):
            return False  # refused later, with a clear error
    return False


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


def encode_turn(
    key: str, session_id: str, user_id: str | None, accepted_at: float, user_content: object,
    assistant_content: object, messages: Sequence[Mapping[str, Any]] | None,
    metadata: object, max_bytes: int,
) -> tuple[bytes, int, bool]:
    """What ``sync_turn`` appends to the outbox: (the record, its messages, whether text was
    sanitized). The ids are checked by the caller.

    Raises:
        InvalidTurnError: the turn can never be stored (types, nesting, token counts, not
            JSON, or over ``max_bytes`` encoded); nothing was stored.
    """
    md = check_metadata(metadata)
    rows = turn_messages(user_content, assistant_content, messages)
    sanitized = has_lone_surrogate(rows, md)
    if sanitized:
        # Lone surrogates cannot be stored as UTF-8 anywhere: keep the turn, with U+FFFD.
        rows, md = sanitize(rows), sanitize(md)
    try:
        payload = encode_payload(key, session_id, user_id, accepted_at, rows, md)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidTurnError(f"metadata is not JSON-serialisable: {exc}") from exc
    data = payload.encode("ascii")
    if len(data) > max_bytes:
        raise InvalidTurnError(f"the turn is {len(data)} bytes encoded; the limit "
                               f"(max_turn_bytes) is {max_bytes}")
    return data, len(rows), sanitized
