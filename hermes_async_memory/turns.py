"""A turn as data: what sync_turn builds, what the outbox stores and what the writer commits."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from .errors import InvalidTurnError

# One stored message: (role, content, tool_calls_json, tool_call_id, tool_name).
MessageRow = tuple[str, str, "str | None", "str | None", "str | None"]

_PACK_HEAD = 10
_ROW_WIDTH = 12
_SESSION_FIELDS = ("source", "model", "parent_session_id", "input_tokens", "output_tokens")


class Receipt(NamedTuple):
    """What sync_turn hands back: the turn is durable once you hold this."""

    key: str
    session_id: str
    seq: int
    accepted_at: float
    deferred: bool = False


class Turn(NamedTuple):
    """An accepted turn on its way to the store.

    A tuple of atomic values and tuples, so the cyclic garbage collector stops tracking it:
    a backlog of queued turns then adds nothing to the cost of a full collection, which
    would otherwise stall the event loop for tens of milliseconds under load.
    """

    key: str
    seq: int
    session_id: str
    user_id: str | None
    accepted_at: float
    messages: tuple[MessageRow, ...]
    metadata: dict[str, Any] | None
    nbytes: int
    segment: int
    accepted_mono: float
    # The messages as store rows, built once on the accept path so the writer only
    # concatenates them (its Python work runs on the event loop).
    rows: tuple[tuple[Any, ...], ...]
    tool_calls: int

    @classmethod
    def build(
        cls, *, key: str, session_id: str, user_id: str | None, accepted_at: float,
        messages: Sequence[MessageRow], metadata: dict[str, Any] | None,
        accepted_mono: float = 0.0, nbytes: int = 0, segment: int = 0,
    ) -> Turn:
        scope = scope_tokens(user_id, session_id)
        md = json.dumps(metadata, ensure_ascii=False) if metadata else None
        msgs = tuple(messages)
        # A list first: the tuple is then allocated after its items, so one collector pass
        # finds them untracked and untracks it too.
        rows = tuple([
            (session_id, key, i, role, content, calls, call_id, name, accepted_at, user_id,
             scope, md)
            for i, (role, content, calls, call_id, name) in enumerate(msgs)
        ])
        tool_calls = sum(1 for m in msgs if m[0] == "tool" or m[2])
        return cls(key, 0, session_id, user_id, accepted_at, msgs, metadata, nbytes, segment,
                   accepted_mono, rows, tool_calls)

    @property
    def scope(self) -> str:
        """The FTS tokens that let a recall search only this user's or session's rows."""
        return scope_tokens(self.user_id, self.session_id)

    @property
    def user_text(self) -> str:
        for role, content, *_ in self.messages:
            if role == "user":
                return content
        return ""

    @property
    def assistant_text(self) -> str:
        for role, content, *_ in reversed(self.messages):
            if role == "assistant" and content:
                return content
        return ""

    def pack(self) -> tuple[Any, ...]:
        """A flat tuple of atomic values: the form a turn waits in the queue in.

        The cyclic collector untracks a tuple of atomic values the first time it sees it, and
        never a NamedTuple or a nested tuple whose parts it has not untracked yet; so a
        backlog packed flat adds nothing to full collections, which stall the event loop for
        milliseconds per ten thousand tracked objects.
        """
        md = json.dumps(self.metadata, ensure_ascii=False) if self.metadata else None
        head = (self.key, self.seq, self.session_id, self.user_id, self.accepted_at, md,
                self.nbytes, self.segment, self.accepted_mono, self.tool_calls)
        return head + tuple([v for row in self.rows for v in row])

    @classmethod
    def unpack(cls, flat: tuple[Any, ...]) -> Turn:
        key, seq, sid, uid, at, md, nbytes, segment, mono, tool_calls = flat[:_PACK_HEAD]
        rows = tuple([flat[i : i + _ROW_WIDTH] for i in range(_PACK_HEAD, len(flat), _ROW_WIDTH)])
        messages = tuple([r[3:8] for r in rows])
        metadata = json.loads(md) if md else None
        return cls(key, seq, sid, uid, at, messages, metadata, nbytes, segment, mono, rows,
                   tool_calls)

    def encode(self) -> bytes:
        """The outbox record; raises UnicodeEncodeError on lone surrogates."""
        doc = {
            "k": self.key,
            "s": self.session_id,
            "u": self.user_id,
            "t": self.accepted_at,
            "m": self.messages,
            "d": self.metadata,
        }
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    @classmethod
    def decode(cls, payload: bytes, segment: int = 0, accepted_mono: float = 0.0) -> Turn:
        doc = json.loads(payload)
        return cls.build(
            key=doc["k"],
            session_id=doc["s"],
            user_id=doc["u"],
            accepted_at=doc["t"],
            messages=[tuple(m) for m in doc["m"]],
            metadata=doc["d"],
            accepted_mono=accepted_mono,
            nbytes=len(payload),
            segment=segment,
        )

    def session_fields(self) -> dict[str, Any]:
        """Metadata keys that describe the session row (source, model, tokens, parent)."""
        md = self.metadata
        if not md:
            return {}
        return {k: md[k] for k in _SESSION_FIELDS if k in md}


def scope_hash(value: str) -> str:
    return hashlib.blake2b(value.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


def scope_tokens(user_id: str | None, session_id: str) -> str:
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


def _row(i: int, m: Mapping[str, Any]) -> MessageRow:
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise InvalidTurnError(f"messages[{i}] has no role")
    content = text_of(f"messages[{i}].content", m.get("content"))
    tool_calls = m.get("tool_calls")
    try:
        calls_json = json.dumps(tool_calls, ensure_ascii=False) if tool_calls else None
    except (TypeError, ValueError) as exc:
        raise InvalidTurnError(f"messages[{i}].tool_calls is not JSON-serialisable") from exc
    call_id = m.get("tool_call_id")
    name = m.get("name") or m.get("tool_name")
    return (
        role,
        content,
        calls_json,
        call_id if isinstance(call_id, str) else None,
        name if isinstance(name, str) else None,
    )


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
