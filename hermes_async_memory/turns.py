"""A turn as data: what sync_turn builds, what the outbox stores and what the writer commits.

A turn's record is its messages' rows (``message_rows``: each message as given), the ids,
the time and the metadata, as compact ASCII JSON (``encode_turn``); ``Turn`` is the record
decoded once, with the few plain values the writer, the cache and the backends read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from json.encoder import encode_basestring_ascii
from typing import Any, NamedTuple

import orjson

from .errors import InvalidTurnError
from .message_rows import MessageRow, check_metadata, turn_messages
from .ops import ID_DIGITS, OP_KV, OP_SESSION, OP_TEMPLATE, KvOp, TemplateOp, parse_op
from .tool_rows import Plan, read_calls, values
from .tool_rows import has_surrogate as _has_surrogate

_TEXT_KEPT = 2000  # characters of the user and assistant text kept for the prefetch cache

_esc = encode_basestring_ascii  # a str as a JSON string literal, ASCII only (C)
_ENCODER = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), allow_nan=False)
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
    Row by row: a turn with one accented message pays for that row alone. A turn whose
    rows' text is all ASCII, the commonest, is written in one call (half the time of row by
    row for a bench tool turn's rows; 8 % of its accept's instructions)."""
    for m in rows:  # its text, all but the fields (ASCII as written: ``_fields_json``)
        if len(m) != 8 or not (m[0].isascii() and (m[1] is None or m[1].isascii())
                               and (m[2] is None or m[2].isascii())
                               and (m[3] is None or m[3].isascii())
                               and (m[4] is None or m[4].isascii())):
            break
    else:  # all ASCII, the commonest turn: the whole array at once
        whole = orjson.dumps(rows)
        if whole.isascii():  # the fields are written ASCII: this guards that invariant
            return whole.decode("ascii")
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
    (checked) ids; kept for the session's next turns (exact ``str`` ids only). Emptied when
    full; any thread."""
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
            # Exact ``str`` ids only: a subclass could compare equal to a kept one and differ.
            ids = (_SCOPES.get((session_id, user_id)) if type(session_id) is str and (
                user_id is None or type(user_id) is str) else None) or _scope_parts(
                    session_id, user_id)
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
