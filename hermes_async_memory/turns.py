"""A turn as data: what sync_turn builds, what the outbox stores and what the writer commits.

A message is stored as it was given. Its plain parts go to columns the store indexes and sums
(role, text content, tool calls, tool call id, tool name, token count, timestamp); every
other key, and a value no column holds exactly (structured content, ``None``, an integer
call id, text with a lone surrogate, ...), goes with it as given, in a JSON object of its
own (``fields``). ``message_of`` puts the two back together: the message as given.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from json.encoder import encode_basestring_ascii
from typing import Any, NamedTuple

import orjson

from .errors import InvalidTurnError
from .ops import ID_DIGITS, LANE_MARK, OP_KV, OP_SESSION, OP_TEMPLATE, KvOp, TemplateOp, parse_op
from .tool_rows import Plan, read_calls, values
from .tool_rows import has_surrogate as _has_surrogate

# One stored message: (role, content text or None, tool calls as JSON text, tool call id,
# tool name, token count, timestamp or None (the record's), fields as JSON text or None).
# A record written by an earlier version holds the first five, or six.
MessageRow = tuple[str, "str | None", "str | None", "str | None", "str | None", "int | None",
                   "float | None", "str | None"]

_TEXT_KEPT = 2000  # characters of the user and assistant text kept for the prefetch cache
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

_esc = encode_basestring_ascii  # a str as a JSON string literal, ASCII only (C)
_ENCODER = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), allow_nan=False)
_FIELDS_ENCODER = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), allow_nan=False,
                                   check_circular=False).encode
# A message's tool calls as its column holds them: compact, as orjson writes them too (see
# ``_calls_json``).
_CALLS_ENCODER = json.JSONEncoder(ensure_ascii=False, check_circular=False, allow_nan=False,
                                  separators=(",", ":")).encode
# The C scanner json.loads runs, without its two Python wrappers (~0.4 µs a record).
_scan_once: Callable[[str, int], tuple[Any, int]] = (
    json.JSONDecoder().scan_once)  # type: ignore[attr-defined]
_NULL = "null"
TURN = "turn"
# The record's first message id goes last, in a field of fixed width that the outbox fills as
# it appends the record (``outbox.records.write``): ``ID_SLOT`` characters before the closing
# brace, right-aligned, or ``null`` where ids are given at commit (a producer's records).
ID_SLOT = ID_DIGITS + 1  # from the end of the payload: the digits, then "}"
NO_ID = b"null".rjust(ID_DIGITS)
_DOC = '{"k":%s,"s":%s,"u":%s,"t":%r,"c":%s,"m":%s,"d":%s,"i":' + "null".rjust(ID_DIGITS) + "}"
# A turn of a user text and a reply, no metadata: ``_DOC`` with its two rows written out.
# A turn of a user text and a reply, no metadata: ``_DOC`` with its two rows written out, in
# bytes, from the key, the ids' part (``_scope_parts``), the time, the scope's part and the
# two texts, each as a JSON string.
_PLAIN_RECORD = _DOC.replace('"m":%s', '"m":[["user",%s,null,null,null,null,null,null],'
                             '["assistant",%s,null,null,null,null,null,null]]').replace(
    '"d":%s', '"d":null').replace('"s":%s,"u":%s', "%s").replace('"c":%s', "%s").replace(
    "%r", "%a").encode("ascii")
_dumps = orjson.dumps
_ABSENT: Any = object()
UNJUDGED: Any = object()  # a tool answer's outcome before the writer judged it (Turn.answers)


class Receipt(NamedTuple):
    """What sync_turn hands back: the turn is durable once you hold this. ``first_id`` is the
    store id of its first message (the others follow, in order), or None where the store
    gives ids as it commits (a producer's turns, an operation)."""

    key: str
    session_id: str
    seq: int
    accepted_at: float
    deferred: bool = False
    first_id: int | None = None


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
    # The store id of its first message (the others follow); None until one is given.
    first_id: int | None = None
    # Its tool answers (``tool`` messages with a call id): (ordinal, content, outcome), for
    # the tool log: the outcome is ``UNJUDGED`` until the writer judges them on the loop
    # (``sources.judge_all``, ``with_outcomes``).
    answers: tuple[tuple[int, str | None, Any], ...] = ()
    # Its tool calls' rows for the log, worked out as it was decoded (``tool_rows.Plan``),
    # then as SQL values once its answers are judged and its ids known (a str); False where
    # the commit must log its calls the SQL way; None: no message with calls.
    log_plan: Plan | str | bool | None = None

    @classmethod
    def build(
        cls, *, key: str, session_id: str, user_id: str | None, accepted_at: float,
        messages: Sequence[MessageRow], metadata: Mapping[str, Any] | None, segment: int = 0,
        first_id: int | None = None,
    ) -> Turn:
        """Raises TypeError or ValueError when ``metadata`` is not JSON-serialisable."""
        payload = encode_payload(key, session_id, user_id, accepted_at, messages, metadata)
        if first_id is not None:
            payload = with_first_id(payload, first_id)
        return cls.decode(payload, segment)

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
        doc = _fast_doc(payload)
        if doc is None:
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
            if type(m) is not list or type(m[0]) is not str or len(m) not in (5, 6, 8):
                raise TypeError("a message of the record is mistyped")
            if len(m) > 5 and m[5] is not None and type(m[5]) is not int:
                raise TypeError("a message's token count is mistyped")
            if len(m) == 8 and not (
                    (m[6] is None or type(m[6]) in (int, float))
                    and (m[7] is None or type(m[7]) is str)):
                raise TypeError("a message's timestamp or fields are mistyped")
        first_id = doc.get("i")
        if first_id is not None and type(first_id) is not int:
            raise TypeError("the record's first message id is not an integer")
        metadata = doc["d"]
        if type(metadata) is str:  # as JSON text (this version); an object (earlier ones)
            metadata = json.loads(metadata)
        return cls._fields_of(key, session_id, user_id, float(at), messages, metadata,
                              payload, segment=segment, nbytes=len(payload), seq=seq,
                              first_id=first_id)

    @classmethod
    def _fields_of(
        cls, key: str, session_id: str, user_id: str | None, accepted_at: float,
        messages: Sequence[Sequence[Any]], metadata: Mapping[str, Any] | None, payload: str,
        *, segment: int, nbytes: int, seq: int = 0, first_id: int | None = None,
    ) -> Turn:
        user = assistant = ""
        tool_calls = 0
        answered = False
        calls_at: list[tuple[int, str]] | None = None
        plan: Plan | bool | None = None
        for i, m in enumerate(messages):  # the first user text, the last assistant text
            role = m[0]
            if role == "assistant":
                if m[1]:
                    assistant = m[1]
            elif role == "user":
                if not user and m[1]:
                    user = m[1]
            elif role == "tool" and m[3] is not None:
                answered = True
            if m[2]:  # an assistant's calls, as JSON text
                if calls_at is None:
                    calls_at = []
                calls_at.append((i, m[2]))
        if calls_at is not None:  # counted as Hermes counts them; the log's rows worked out
            tool_calls, plan = read_calls(messages, calls_at)
        if metadata and isinstance(metadata, Mapping):
            md = metadata
            source, model, parent = (_str(md.get("source")), _str(md.get("model")),
                                     _str(md.get("parent_session_id")))
            tokens_in, tokens_out = _count(md.get("input_tokens")), _count(md.get("output_tokens"))
        else:
            source = model = parent = None
            tokens_in = tokens_out = 0
        # Positional tuple.__new__: a 20-field NamedTuple built by keyword (or _replace) costs
        # ~1.5 µs.
        return tuple.__new__(cls, (
            key, seq, session_id, user_id, accepted_at, payload, nbytes, segment, len(messages),
            tool_calls, user[:_TEXT_KEPT] if len(user) > _TEXT_KEPT else user,
            assistant[:_TEXT_KEPT] if len(assistant) > _TEXT_KEPT else assistant,
            source, model, parent, tokens_in, tokens_out,
            "\\u0000" in payload, TURN, first_id, _answers(messages) if answered else (), plan,
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
            segment, 0, 0, "", "", None, None, None, 0, 0, False, kind, None, (), None))

    def encode(self) -> bytes:
        """The outbox record (ASCII JSON)."""
        return self.payload.encode("ascii")

    @property
    def messages(self) -> tuple[MessageRow, ...]:
        """The turn's message rows (``MessageRow``), an earlier version's widened."""
        return tuple(_widen(m) for m in json.loads(self.payload)["m"])

    @property
    def metadata(self) -> dict[str, Any] | None:
        md: Any = json.loads(self.payload)["d"]
        if type(md) is str:
            md = json.loads(md)
        return md if isinstance(md, dict) else None

    def with_outcomes(self, judge: Callable[[str | None], Any]) -> Turn:
        """This turn with each tool answer's outcome, ``judge(content)``; and with its plan's
        log rows as SQL values where its ids are known (the read-ahead judges while the last
        batch commits: the values are then no work for the next batch's serial build)."""
        answers = tuple([(i, content, judge(content)) for i, content, _ in self.answers])
        plan = self.log_plan
        if type(plan) is tuple and self.first_id is not None:
            rows = values(plan, self.first_id, {i: outcome for i, _, outcome in answers})
            if rows is not None:  # else the batch finds None as well: the SQL way
                plan = rows
        return self._replace(answers=answers, log_plan=plan)

    def with_seq(self, seq: int) -> Turn:
        return self._replace(seq=seq)

    def with_first_id(self, first_id: int) -> Turn:
        """This turn with its messages' ids from ``first_id`` on, written into its payload
        (for a record that came without: a producer's, or an earlier version's)."""
        payload = with_first_id(self.payload, first_id)
        # Log rows worked out for other ids would be wrong: the plan is gone, the SQL way.
        plan = False if type(self.log_plan) is str else self.log_plan
        return self._replace(payload=payload, nbytes=len(payload), first_id=first_id,
                             log_plan=plan)

    @classmethod
    def stub(cls, key: str, session_id: str, *, seq: int = 0, segment: int = 0,
             accepted_at: float = 0.0) -> Turn:
        """A turn that holds only where it came from: for a record that does not decode."""
        return tuple.__new__(cls, (key, seq, session_id, None, accepted_at, "", 0, segment, 0,
                                   0, "", "", None, None, None, 0, 0, False, TURN, None, (),
                                   None))


def _answers(messages: Sequence[Sequence[Any]]) -> tuple[tuple[int, str | None, Any], ...]:
    """``Turn.answers``: the tool messages with a call id, unjudged (a plain turn has none,
    and its decode builds nothing for them)."""
    return tuple([(i, m[1], UNJUDGED) for i, m in enumerate(messages)
                  if m[0] == "tool" and m[3] is not None])


def _fast_doc(payload: str) -> dict[str, Any] | None:
    """A turn record of this version read by orjson (~2.5x the standard library's scanner),
    or None: read it the exact way. orjson reads an integer past 64 bits as a float, where a
    turn record of this version has none (its metadata, fields and tool calls are JSON text
    within it); an earlier version's record may hold its metadata as an object, and is read
    again. orjson refuses the escape of a lone surrogate, NaN and trailing text."""
    if not payload.startswith('{"k":'):
        return None  # an operation's record (ops)
    try:
        doc = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    if type(doc) is not dict or not (doc.get("d") is None or type(doc["d"]) is str):
        return None
    return doc


def with_first_id(payload: str, first_id: int) -> str:
    """``payload`` (a turn record of this version) with its id slot holding ``first_id``."""
    if not payload.endswith("}") or payload[-ID_SLOT - 5:-ID_SLOT] != ',"i":':
        raise ValueError("the record has no id slot")
    return payload[:-ID_SLOT] + str(int(first_id)).rjust(ID_DIGITS) + "}"


EMPTY_SLOT = b',"i":' + NO_ID + b"}"  # how a turn record without its ids ends


def encode_payload(
    key: str, session_id: str, user_id: str | None, accepted_at: float,
    messages: Sequence[MessageRow], metadata: Mapping[str, Any] | None,
) -> str:
    """A turn's JSON: ``{"k", "s", "u", "t", "c", "m", "d", "i"}``, compact and ASCII, put
    together from the C string encoder (2-3x cheaper than ``json.dumps`` of the dict; this
    runs on the caller's thread for every turn). ``m`` holds each message as a ``MessageRow``
    list; ``d``, the metadata, goes as JSON text (a string), read back exactly (SQLite would
    write its numbers with 15 digits); ``i``, last, is the empty id slot (see ``ID_SLOT``).

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
        _rows_json(messages),
        _NULL if metadata is None else _esc(_ENCODER.encode(metadata)),
    )
    return _no_quote(payload)


def _no_quote(payload: str) -> str:
    """``payload`` with ' written as \\u0027 (see ``encode_payload``)."""
    return payload.replace("'", "\\u0027") if "'" in payload else payload


def _sized(payload: str, max_bytes: int) -> bytes:
    """The record's bytes.

    Raises:
        InvalidTurnError: over ``max_bytes``.
    """
    data = payload.encode("ascii")
    if len(data) > max_bytes:
        raise _too_big(len(data), max_bytes)
    return data


def _too_big(size: int, max_bytes: int) -> InvalidTurnError:
    return InvalidTurnError(f"the turn is {size} bytes encoded; the limit (max_turn_bytes) is "
                            f"{max_bytes}")


def _rows_json(rows: Sequence[Sequence[Any]]) -> str:
    """The record's ``m``: its rows as a JSON array. orjson writes each row that comes out
    ASCII: rows of this version hold text, None, integers and finite floats only, which it
    writes as ``_encode_row`` does (a float's exponent aside: ``1e-07`` is written
    ``1e-7``), ~2x faster for a bench tool turn's seven rows. A row whose content is not
    ASCII is not tried (its JSON would not be), and it, any other row orjson writes beyond
    ASCII, and an earlier version's row go to ``_encode_row`` (non-ASCII as \\u escapes).
    Row by row: a turn with one accented message pays for that row alone."""
    parts = []
    for m in rows:
        data = (orjson.dumps(m) if len(m) == 8 and (m[1] is None or m[1].isascii())
                else None)
        parts.append(data.decode("ascii") if data is not None and data.isascii()
                     else _encode_row(m))
    return "[" + ",".join(parts) + "]"


def _encode_row(m: Sequence[Any]) -> str:
    if len(m) == 8:
        role, text, calls, call_id, name, tokens, at, fields = m
    else:  # an earlier version's row
        role, text, calls, call_id, name = m[:5]
        tokens, at, fields = (m[5] if len(m) > 5 else None), None, None
    return "[%s,%s,%s,%s,%s,%s,%s,%s]" % (  # noqa: UP031 (the fastest here)
        _esc(role), _NULL if text is None else _esc(text),
        _NULL if calls is None else _esc(calls), _NULL if call_id is None else _esc(call_id),
        _NULL if name is None else _esc(name), _NULL if tokens is None else str(int(tokens)),
        _NULL if at is None else repr(float(at)), _NULL if fields is None else _esc(fields))


def _widen(m: Sequence[Any]) -> MessageRow:
    if len(m) == 8:
        return tuple(m)
    return (m[0], m[1], m[2], m[3], m[4], m[5] if len(m) > 5 else None, None, None)


def payload_rows(payload: str) -> list[tuple[Any, ...]]:
    """The message rows a turn's payload holds, as the replica stores take them: (session_id,
    turn_key, ordinal, role, content, tool_calls, tool_call_id, tool_name, timestamp, user_id,
    scope, metadata as JSON text or None, token_count)."""
    doc = json.loads(payload)
    md = _metadata_text(doc["d"])
    at = doc["t"]
    return [(doc["s"], doc["k"], i, *r[:5], at if r[6] is None else r[6], doc["u"], doc["c"],
             md, r[5]) for i, r in enumerate(map(_widen, doc["m"]))]


def store_rows(payload: str) -> list[tuple[Any, ...]]:
    """The message rows of a turn's payload as the SQLite store inserts them, bound
    (``store.batch.INSERT_MESSAGE_ROW``): (id, session_id, turn_key, ordinal, role, content,
    tool_calls, tool_call_id, tool_name, timestamp, user_id, scope, metadata, token_count,
    fields)."""
    doc = json.loads(payload)
    md = _metadata_text(doc["d"])
    at, first = doc["t"], doc.get("i")
    return [(None if first is None else first + i, doc["s"], doc["k"], i, *r[:5],
             at if r[6] is None else r[6], doc["u"], doc["c"], md, r[5], r[7])
            for i, r in enumerate(map(_widen, doc["m"]))]


def _metadata_text(md: Any) -> str | None:
    """The metadata column's text: the record's own JSON text (as the batch's SQL takes
    it), or an earlier version's object written out."""
    if type(md) is str:
        return md if md != "{}" else None
    return json.dumps(md, ensure_ascii=False) if md else None


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


_SCALARS = frozenset({str, int, float, bool, type(None)})
_PLAIN = frozenset({str, int, bool, type(None), float})


def is_token_count(value: object) -> bool:
    """An integer from 0 to ``MAX_TOKENS`` (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKENS


def _str(value: object) -> str | None:
    # No NUL: refused at accept (check_metadata); an earlier version's record may hold one.
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


def _scope_parts(session_id: str, user_id: str | None) -> tuple[bytes, bytes]:
    """A turn record's ``"s":..,"u":..`` and ``"c":..`` as the record holds them, for the
    (checked) ids; kept for the session's next turns (exact ``str`` ids only: a subclass
    could compare equal to one and still differ). Emptied when full; any thread."""
    parts = (
        _no_quote(f'"s":{_esc(session_id)},"u":'
                  f'{_NULL if user_id is None else _esc(user_id)}').encode("ascii"),
        ('"c":' + _esc(scope_tokens(user_id, session_id))).encode("ascii"),
    )
    if type(session_id) is str and (user_id is None or type(user_id) is str):
        if len(_SCOPES) >= _SCOPES_MAX:
            _SCOPES.clear()
        _SCOPES[session_id, user_id] = parts
    return parts


_SCOPES: dict[tuple[str, str | None], tuple[bytes, bytes]] = {}
_SCOPES_MAX = 16_384  # ~300 bytes each


def scope_token_for(user_id: str | None, session_id: str | None) -> str:
    """The one token a recall filters on: the user's when known, else the session's."""
    if user_id:
        return "u" + scope_hash(user_id)
    if session_id:
        return "s" + scope_hash(session_id)
    raise InvalidTurnError("a recall needs a user_id or a session_id")


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


# Ids check_id passed (its rules do not depend on the name), so a session's next turns skip
# them (~0.5 µs a turn of ~10 here). Emptied when full; any thread.
_PASSED: dict[str, None] = {}
CHECKED_IDS = _PASSED  # read only: ``sync_turn`` looks its ids up here before checking
_PASSED_MAX = 65_536


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


_CALL_KEYS = frozenset({"id", "type", "function"})
_FUNCTION_KEYS = frozenset({"name", "arguments"})


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


_NO_FUNCTION: dict[str, Any] = {}


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


def encode_turn(
    key: str, session_id: str, user_id: str | None, accepted_at: float, user_content: object,
    assistant_content: object, messages: Sequence[Mapping[str, Any]] | None,
    metadata: object, max_bytes: int,
) -> tuple[bytes, int, bool]:
    """What ``sync_turn`` appends to the outbox: (the record, its messages, whether some
    text is indexed as a U+FFFD copy, see ``message_row``). The ids are checked by the
    caller.

    Raises:
        InvalidTurnError: the turn can never be stored as given (types, nesting, token
            counts, not JSON, or over ``max_bytes`` encoded); nothing was stored.
    """
    if (messages is None and metadata is None and type(user_content) is str
            and type(assistant_content) is str and "\x00" not in user_content
            and "\x00" not in assistant_content):
        # The common turn, a user text and a reply, put together in one step: the rows
        # ``turn_messages`` would make, encoded as ``encode_payload`` would (~40 % less).
        if user_content.isascii() and assistant_content.isascii():
            # The commonest, ASCII text: its JSON strings from orjson (~3x the standard
            # library's escaper; DEL goes unescaped, as JSON allows).
            texts = _dumps(user_content), _dumps(assistant_content)
        elif _has_surrogate(user_content) or _has_surrogate(assistant_content):
            texts = None  # no text column holds it: a row of its own (``message_row``)
        else:
            texts = _esc(user_content).encode("ascii"), _esc(assistant_content).encode("ascii")
        if texts is not None:
            ids = _SCOPES.get((session_id, user_id)) or _scope_parts(session_id, user_id)
            data = _PLAIN_RECORD % (_dumps(key), ids[0], accepted_at, ids[1], *texts)
            if b"'" in data:
                data = data.replace(b"'", b"\\u0027")
            if len(data) > max_bytes:
                raise _too_big(len(data), max_bytes)
            return data, 2, False
    md = check_metadata(metadata)
    notes: list[int] = []
    rows = turn_messages(user_content, assistant_content, messages, notes)
    data, n = encode_rows(key, session_id, user_id, accepted_at, rows, md, max_bytes)
    return data, n, bool(notes)


def encode_rows(key: str, session_id: str, user_id: str | None, accepted_at: float,
                rows: Sequence[MessageRow], metadata: Mapping[str, Any] | None,
                max_bytes: int) -> tuple[bytes, int]:
    """``encode_turn`` for rows already made (``message_row``) and checked metadata.

    Raises:
        InvalidTurnError: no rows, or over ``max_bytes`` encoded.
    """
    if not rows:
        raise InvalidTurnError("a turn needs at least one message")
    try:
        payload = encode_payload(key, session_id, user_id, accepted_at, rows, metadata)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidTurnError(f"metadata is not JSON-serialisable: {exc}") from exc
    return _sized(payload, max_bytes), len(rows)
