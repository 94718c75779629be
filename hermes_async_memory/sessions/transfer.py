"""Export sessions as JSON lines, and import them back through the durable path.

A line is one session: its row, every column as stored, and ``messages``, in order, each
with its id, turn key, role, content, tool calls, tool-call id, tool name, timestamp, user,
metadata (tool calls and metadata decoded) and token count. ``hermes-memory sessions export``
writes the same lines.

An import appends one record per session (more for a long one: parts of its messages, each
within ``max_turn_bytes``) to the session's lane of the outbox. When it commits, the session
goes in as exported, ids kept, unless a session of that id is there already: importing a
file twice changes nothing, and a session that was deleted comes back as it was, so export,
delete, import, export gives the same bytes. A message id that another session holds by
then gets a new one.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import InvalidTurnError
from ..ops import encode_session_op
from ..turns import MAX_TOKENS, Receipt, check_id, is_token_count, message_row
from .lifecycle import InvalidSessionError

if TYPE_CHECKING:
    from ..pipeline import MemoryPipeline

IMPORT_TIMEOUT_S = 120.0
_PART_OVERHEAD = 1024  # bytes of a part's record besides its messages
_ROW_COLUMNS = (
    "source", "user_id", "model", "parent_session_id", "started_at", "updated_at", "ended_at",
    "end_reason", "message_count", "tool_call_count", "input_tokens", "output_tokens",
    "model_config", "system_prompt", "tokens_estimated",
)


class InvalidImportError(InvalidSessionError):
    """A line of an import cannot be a session: the message says which line and why.
    Nothing of that line was accepted (earlier lines were)."""


@dataclass(frozen=True, slots=True)
class ImportResult:
    """What an import did: sessions accepted and committed, sessions skipped because a
    session of that id was there already, and the messages imported."""

    imported: int
    skipped: int
    messages: int

    def as_dict(self) -> dict[str, int]:
        return {"imported": self.imported, "skipped": self.skipped, "messages": self.messages}


class ExportLine(str):
    """One session's export line (with the newline); ``messages``: how many it holds."""

    __slots__ = ("messages",)
    messages: int


def export_line(session: Mapping[str, Any], messages: list[dict[str, Any]]) -> ExportLine:
    """One session as its export line."""
    line = ExportLine(json.dumps({**session, "messages": messages}, ensure_ascii=False) + "\n")
    line.messages = len(messages)
    return line


async def export_sessions(pipeline: MemoryPipeline, *, user_id: str | None = None,
                          session_id: str | None = None) -> AsyncIterator[str]:
    """The committed sessions (of ``user_id``; or just ``session_id``), oldest first, one
    line at a time: a reader for the whole export, one snapshot however long it takes
    (``pipeline.sessions.export``)."""
    async for line in pipeline.sessions.export(user_id=user_id, session_id=session_id):
        yield line


async def import_sessions(pipeline: MemoryPipeline,
                          lines: Iterable[str] | AsyncIterable[str], *,
                          timeout_s: float = IMPORT_TIMEOUT_S) -> ImportResult:
    """Import export lines; returns once they are committed.

    Raises:
        InvalidImportError: a line is not a session (says which line, and why); the lines
            before it were accepted and are committed.
        FlushTimeoutError: the import did not commit within ``timeout_s`` (it is durable,
            and commits later).
        QueueFullError, DiskFullError, PipelineClosedError, PipelineFailedError.
    """
    imported = skipped = n_messages = 0
    receipts: list[Receipt] = []
    budget = pipeline.settings.max_turn_bytes - _PART_OVERHEAD
    number = 0
    try:
        async for line in _lines(lines):
            number += 1
            if not line.strip():
                continue
            session, messages = _parse(line, number)
            sid = session["id"]
            if await pipeline.store.existing_sessions([sid]):
                skipped += 1
                continue
            row = {k: session.get(k) for k in _ROW_COLUMNS}
            user = session.get("user_id")
            records = []
            for i, part in enumerate(_parts(messages, budget, number) or [[]]):
                key, at = pipeline.new_key(), time.time()
                data = encode_session_op(
                    key, sid, user, at, "import", row=row if i == 0 else None, messages=part,
                    started_at=float(session["started_at"])).encode("ascii")
                if len(data) > pipeline.settings.max_turn_bytes:
                    raise InvalidImportError(f"line {number}: a message is larger than "
                                             "max_turn_bytes")
                records.append((key, at, data))
            # Accepted whole or not at all: a line refused halfway leaves no part behind.
            receipts += [pipeline.accept_record(key, sid, at, data) for key, at, data in records]
            imported += 1
            n_messages += len(messages)
    except InvalidImportError:
        await pipeline.committed(receipts, timeout_s)  # what was accepted before it commits
        raise
    await pipeline.committed(receipts, timeout_s)
    return ImportResult(imported, skipped, n_messages)


async def _lines(lines: Iterable[str] | AsyncIterable[str]) -> AsyncIterator[str]:
    if isinstance(lines, AsyncIterable):
        async for line in lines:
            yield line
    else:
        for line in lines:
            yield line


def _parse(line: str, number: int) -> tuple[dict[str, Any], list[list[Any]]]:
    """The session and its messages as import records hold them."""
    try:
        doc = json.loads(line)
    except ValueError as exc:
        raise InvalidImportError(f"line {number}: not JSON ({exc})") from None
    if type(doc) is not dict:
        raise InvalidImportError(f"line {number}: not a JSON object")
    try:
        check_id("id", doc.get("id"))
        if doc.get("user_id") is not None:
            check_id("user_id", doc.get("user_id"))
    except InvalidTurnError as exc:
        raise InvalidImportError(f"line {number}: {exc}") from None
    started = doc.get("started_at")
    if isinstance(started, bool) or not isinstance(started, (int, float)):
        raise InvalidImportError(f"line {number}: started_at must be a number")
    raw = doc.get("messages")
    if not isinstance(raw, list):
        raise InvalidImportError(f"line {number}: messages must be a list")
    out = []
    ordinals: dict[str, int] = {}
    for j, m in enumerate(raw):
        where = f"line {number}, message {j}"
        if not isinstance(m, dict):
            raise InvalidImportError(f"{where}: not an object")
        mid, turn, role = m.get("id"), m.get("turn_key"), m.get("role")
        if isinstance(mid, bool) or not isinstance(mid, int) or mid <= 0:
            raise InvalidImportError(f"{where}: id must be a positive integer")
        if not isinstance(turn, str) or not turn or not isinstance(role, str) or not role:
            raise InvalidImportError(f"{where}: turn_key and role must be non-empty strings")
        stamp = m.get("timestamp")
        if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
            raise InvalidImportError(f"{where}: timestamp must be a number")
        for name in ("content", "tool_call_id", "tool_name", "user_id"):
            if m.get(name) is not None and not isinstance(m.get(name), str):
                raise InvalidImportError(f"{where}: {name} must be a string or null")
        tokens = m.get("token_count")
        if tokens is not None and not is_token_count(tokens):
            raise InvalidImportError(
                f"{where}: token_count must be null or an integer from 0 to {MAX_TOKENS}")
        ordinal = ordinals.get(turn, 0)
        ordinals[turn] = ordinal + 1
        calls, md, given = m.get("tool_calls"), m.get("metadata"), m.get("message")
        md_text = None if md is None else json.dumps(md, ensure_ascii=False,
                                                     separators=(",", ":"))
        if not isinstance(given, dict):  # an earlier version's line: its columns
            given = {"role": role, "content": m.get("content")}
            if calls is not None:
                given["tool_calls"] = calls
            if m.get("tool_call_id") is not None:
                given["tool_call_id"] = m.get("tool_call_id")
            if m.get("tool_name") is not None:
                given["tool_name"] = m.get("tool_name")
        try:  # the message as it was handed over: stored the same way
            row = message_row(j, given)
        except InvalidTurnError as exc:
            raise InvalidImportError(f"{where}: {exc}") from None
        if row[0] != role:
            raise InvalidImportError(f"{where}: its message's role is not {role!r}")
        out.append([mid, turn, ordinal, row[0], row[1], row[2], row[3], row[4],
                    float(stamp), m.get("user_id"), md_text, tokens, row[7]])
    texts = [v for m in out for v in m[:12] if isinstance(v, str)]
    texts += [v for v in doc.values() if isinstance(v, str)]
    if any("\x00" in t for t in texts):
        raise InvalidImportError(f"line {number}: holds U+0000, which an import cannot carry")
    try:
        "".join(texts).encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidImportError(f"line {number}: holds a lone surrogate, which no UTF-8 "
                                 "store can hold") from None
    ids = [m[0] for m in out]
    if len(set(ids)) != len(ids):
        raise InvalidImportError(f"line {number}: two messages have one id")
    return doc, out


def _parts(messages: list[list[Any]], budget: int, number: int) -> list[list[list[Any]]]:
    """The messages in parts whose records stay within ``budget`` bytes, whole turns kept
    together where they fit (a part's first turn is how a second import recognises it)."""
    parts: list[list[list[Any]]] = []
    current: list[list[Any]] = []
    size = 0
    for m in messages:
        n = len(json.dumps(m, ensure_ascii=True)) + 1
        if current and size + n > budget and m[1] != current[-1][1]:
            parts.append(current)
            current, size = [], 0
        current.append(m)
        size += n
    if current:
        parts.append(current)
    return parts
