"""How local turns become Honcho data: ids, peers, messages and their metadata.

One Honcho workspace; one peer for the assistant and one per user (a turn without a user gets
a peer of its own session, so strangers are never merged); one Honcho session per
``session_id``. Every id is made to fit the server's ``^[a-zA-Z0-9_-]+$`` (at most 512
characters): an id that fits is kept as is, one that does not is rewritten and gets a hash of
the original appended, so two different ids never meet. Each message carries its turn's
idempotency key and its index within the turn in ``metadata``: what the exactly-once check
before a resend looks for.

Key-value memory (``ops``): each write becomes one message from the user's peer in a memory
session of that user's own, in write order, with the typed metadata ``MEMORY_FIELD``
(``{"op": "put" | "delete", "key", "metadata", "at"}``); a put's content is the value, a
delete's is a line that says so (Honcho cannot remove one message). The memory session's id
is the user's lane rewritten (see ``honcho_id``), so it can never be a conversation's.

Session lifecycle records (``ops.OP_SESSION``) become an ``Action`` on the session besides
messages: a describe or an end sets the session's metadata to the snapshot of the local row
the record carries (``session_metadata``; the local store is the system of record, so the
whole metadata is replaced, and sending it twice changes nothing); a delete deletes the
Honcho session, and with it its messages; an import adds the imported messages, tagged with
the import record's key and their index in it as a turn's are, then sets the metadata.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

from ...ops import OP_SESSION, SessionOp, parse_record, parse_session_record
from ...turns import Turn
from .client import sdk
from .config import HonchoConfig

# The server's rules (honcho src/schemas/api.py): RESOURCE_NAME_PATTERN for workspace, peer
# and session ids, max_length=512.
ID_PATTERN = re.compile(r"[A-Za-z0-9_-]+")
_REWRITTEN = re.compile(r".*-h[0-9a-f]{16}")  # what honcho_id appends to an id it rewrote
MAX_ID_CHARS = 512
_ID_HASH_CHARS = 16  # 64 bits of blake2b: what keeps rewritten ids apart

# Message metadata fields this backend writes.
KEY_FIELD = "turn_key"  # the turn's idempotency key
INDEX_FIELD = "turn_msg"  # the message's index within its turn (0, 1, ...)
USER_FIELD = "user_peer"  # the user peer of the turn: what a "search" recall filters on
MEMORY_FIELD = "hermes_memory"  # a key-value write: {"op", "key", "metadata", "at"}
IMPORTED_FIELD = "imported_turn"  # an imported message: the key of the turn it was part of
# Session metadata field this backend writes besides the local row's snapshot.
SESSION_ID_FIELD = "session_id"  # the local session id (the Honcho id may be rewritten)


def honcho_id(raw: str) -> str:
    """``raw`` as a Honcho id: unchanged when it already fits ``^[a-zA-Z0-9_-]{1,512}$``,
    otherwise with the other characters replaced by ``_`` and a hash of ``raw`` appended.

    Deterministic, and collision-safe: two different ids give two different results (up to a
    64-bit hash), and a rewritten id cannot equal an id that was kept.
    """
    # An id that already ends like a rewritten one is rewritten too, so a kept id can never
    # equal a rewritten one.
    if (len(raw) <= MAX_ID_CHARS and ID_PATTERN.fullmatch(raw)
            and not _REWRITTEN.fullmatch(raw)):
        return raw
    digest = hashlib.blake2b(raw.encode("utf-8", "surrogatepass"),
                             digest_size=_ID_HASH_CHARS // 2).hexdigest()
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", raw)[: MAX_ID_CHARS - _ID_HASH_CHARS - 2]
    return f"{stem}-h{digest}"



class Msg(NamedTuple):
    key: str
    pos: int  # the index within its turn
    params: Any  # honcho MessageCreateParams


class Action(NamedTuple):
    """What a session lifecycle record does to its Honcho session after its messages."""

    delete: bool = False  # delete the session (its messages go with it)
    metadata: dict[str, object] | None = None  # else: set the session's metadata to this


class Unit(NamedTuple):
    """One turn (or record) as the messages it becomes, and what it does besides."""

    turn: Turn
    msgs: list[Msg]
    action: Action | None = None


def session_metadata(session_id: str, snapshot: dict[str, Any]) -> dict[str, object]:
    """The Honcho metadata of a session: the snapshot of its local row (see
    ``store.lifecycle.SNAPSHOT``) and its local id."""
    return {**snapshot, SESSION_ID_FIELD: session_id}


class Mapper:
    """The Honcho ids and messages of local sessions, users and turns under one config."""

    def __init__(self, config: HonchoConfig) -> None:
        self.config = config
        self.workspace = honcho_id(config.workspace_id)
        self.assistant = honcho_id(config.assistant_peer)

    def session_name(self, session_id: str) -> str:
        """The Honcho session id of a local session."""
        return honcho_id(session_id)

    def user_peer_name(self, user_id: str | None, session_id: str) -> str:
        """The Honcho peer of a user (or, with no user, of the session alone)."""
        if user_id:
            return honcho_id(self.config.user_peer_prefix + user_id)
        return honcho_id(f"{self.config.user_peer_prefix}session-{session_id}")

    def unit(self, turn: Turn) -> Unit:
        """The Honcho messages of one turn, each tagged with the turn's key and its index."""
        if turn.kind == OP_SESSION:
            return self._session_unit(turn)
        user_peer = self.user_peer_name(turn.user_id, turn.session_id)
        created = dt.datetime.fromtimestamp(turn.accepted_at, tz=dt.timezone.utc)
        if turn.kind != "turn":
            return Unit(turn, self._memory_msgs(turn, user_peer, created))
        msgs: list[Msg] = []
        for ordinal, m in enumerate(turn.messages):
            msgs += self._message(turn.key, len(msgs), m, ordinal, user_peer, created, {})
        return Unit(turn, msgs)

    def _message(self, key: str, first: int, m: Sequence[Any], ordinal: int, user_peer: str,
                 created: dt.datetime, extra: dict[str, object]) -> list[Msg]:
        """One stored message (role, content, tool calls, call id, tool name[, token count])
        as Honcho messages numbered from ``first``: more than one when its content is longer
        than a message may be."""
        honcho = sdk()
        role, content, calls_json, call_id, tool_name = m[:5]
        content = content or ""
        step = self.config.max_message_chars
        parts = [content[i:i + step] for i in range(0, len(content), step)] or [""]
        msgs = []
        for p, part in enumerate(parts):
            index = first + p
            md: dict[str, object] = {KEY_FIELD: key, INDEX_FIELD: index, "role": role,
                                     "ordinal": ordinal, USER_FIELD: user_peer, **extra}
            if len(parts) > 1:
                md["part"], md["parts"] = p, len(parts)
            if calls_json and p == 0:
                md["tool_calls"] = calls_json
            if call_id:
                md["tool_call_id"] = call_id
            if tool_name:
                md["tool_name"] = tool_name
            if len(m) > 5 and m[5] is not None and p == 0:
                md["token_count"] = m[5]
            params = honcho.MessageCreateParams(
                content=part, peer_id=user_peer if role == "user" else self.assistant,
                metadata=md, created_at=created)
            msgs.append(Msg(key, index, params))
        return msgs

    def _session_unit(self, turn: Turn) -> Unit:
        """A lifecycle record as what it does to its Honcho session (see the module doc)."""
        op = parse_session_record(turn.payload)
        if op is None:
            raise ValueError(f"record {turn.key} is not a session lifecycle event")
        if op.action == "delete":
            return Unit(turn, [], Action(delete=True))
        msgs = self._imported_msgs(op, turn) if op.action == "import" else []
        if op.snapshot is None:  # no local row to mirror (an older record): messages only
            return Unit(turn, msgs)
        return Unit(turn, msgs, Action(metadata=session_metadata(op.session_id, op.snapshot)))

    def _imported_msgs(self, op: SessionOp, turn: Turn) -> list[Msg]:
        """An import part's messages, tagged with the record's key and their index in it,
        and with the key of the turn each was part of (``IMPORTED_FIELD``)."""
        msgs: list[Msg] = []
        for m in op.messages or []:
            turn_key, ordinal, role, content, calls, call_id, tool_name, at, user = m[1:10]
            if calls is not None and not isinstance(calls, str):
                calls = json.dumps(calls)
            if not isinstance(at, (int, float)) or isinstance(at, bool):
                at = turn.accepted_at
            created = dt.datetime.fromtimestamp(at, tz=dt.timezone.utc)
            peer = self.user_peer_name(user if isinstance(user, str) else op.user_id,
                                       op.session_id)
            row = (str(role), content if isinstance(content, str) else "", calls, call_id,
                   tool_name, m[11])
            msgs += self._message(op.record_key, len(msgs), row,
                                  ordinal if isinstance(ordinal, int) else 0, peer, created,
                                  {IMPORTED_FIELD: turn_key})
        return msgs

    def _memory_msgs(self, turn: Turn, user_peer: str, created: dt.datetime) -> list[Msg]:
        """A key-value write as a message in the user's memory session (a value longer
        than a message may be is split across several, as a turn's content is)."""
        op = parse_record(turn.payload)
        if op is None:
            raise ValueError(f"record {turn.key} is neither a turn nor a key-value write")
        action = "put" if op.action == "put" else "delete"
        content = op.value if action == "put" else f"(memory entry {op.key!r} deleted)"
        typed = {"op": action, "key": op.key, "metadata": op.metadata or {},
                 "at": op.accepted_at}
        step = self.config.max_message_chars
        parts = [content[i:i + step] for i in range(0, len(content), step)] or [""]
        msgs = []
        for index, part in enumerate(parts):
            md: dict[str, object] = {KEY_FIELD: turn.key, INDEX_FIELD: index,
                                     USER_FIELD: user_peer, "role": "memory", MEMORY_FIELD: typed}
            if len(parts) > 1:
                md["part"], md["parts"] = index, len(parts)
            msgs.append(Msg(turn.key, index, sdk().MessageCreateParams(
                content=part, peer_id=user_peer, metadata=md, created_at=created)))
        return msgs
