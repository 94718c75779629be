"""Export sessions as JSON lines, and import them back through the durable path.

**The format.** A line is one session, a JSON object: its row, every column of the
``sessions`` table as stored (ours, and Hermes Agent 0.19's: title, cwd, git_branch,
billing_*, costs, api_call_count, ...; ``ops.IMPORTED_ROW_COLUMNS``), and ``messages``, in
order, each as ``get_messages`` reads it: id, session id, turn key, role, content, tool
calls, tool-call id, tool name, timestamp, user, metadata (tool calls and metadata decoded),
token count, ``active`` (0: set aside by the host), ``compacted`` (1, only where set: set
aside by a compaction, still found by Hermes's search) and ``message``, the message exactly as
it was handed over. The columns ``message`` also gives (role, content, tool calls, tool-call
id, tool name) stay beside it, so that a line reads as ``get_messages`` and the CLI's
``show --json`` do (``jq '.messages[].content'``); the others (id, turn, timestamp, user,
metadata, token count, active) only the columns hold. An import takes the message from
``message`` and the rest from the columns; a line of an earlier version, without
``message``, from its columns alone. A line is UTF-8 text: a lone surrogate (which a
message's fields keep exactly) is written as its JSON escape. ``hermes-memory sessions
export`` writes the same lines.

**The import** (``import_sessions``) goes in three steps:

1. *Checked, all of it, before anything is accepted.* Every line is read and checked: JSON,
   ids, the type of every column and message, ``model_config`` (a JSON object, as
   ``describe`` takes it), every message as ``sync_turn`` would store it, no session twice,
   and the limits (``ImportLimits``). A bad line raises ``InvalidImportError`` with its
   number, a limit ``ImportLimitError`` naming it; either way nothing was accepted. Text is
   normalized as on the accept path: a message's text holding NUL or a lone surrogate is kept
   exactly in its fields (its content column holds a U+FFFD copy for the index), metadata
   and tool-call arguments keep it exactly as JSON escapes; a session's own text (names,
   title, prompt, ...) holding one is refused, as ``describe`` refuses it. A session whose
   parent is itself, is neither stored nor in the import, or would close a cycle is imported
   without one (``ImportResult.detached``).
2. *Accepted, in line order*: one record per session (more, its parts, for a session larger
   than ``max_turn_bytes``), each durable as it is appended. An append cannot be taken back.
   So "nothing" holds up to the first append (its error is raised as it is); if a later one
   fails (``QueueFullError`` under the "reject" policy, ``DiskFullError``,
   ``PipelineClosedError``), the records appended before it stay and commit, and
   ``ImportIncompleteError`` names the sessions not accepted (or in part); if the process
   dies while appending, those appended commit at the next start. Importing the same lines
   again finishes the job: a stored session is skipped, except one with the line's start
   that holds the first turn of its line and only turns of its line, not all of them (an
   import cut short): it gets the parts it lacks, each once.
3. *Verified once committed.* The store is read back: each session must be there, the one
   exported (same start), with every message of its line. If one is not (a record
   dead-lettered, a session of that id with another start stored meanwhile, deleted
   meanwhile) ``ImportIncompleteError`` says which and why, and counts what is stored; an
   import never reports a count it has not found in the store.

A session already in the store is skipped (importing a file twice changes nothing); one that
was deleted comes back as exported, so export, delete, import, export gives the same bytes.
Messages keep their exported ids where free and below every id still pending
(``MessageIds.floor``); else the ids their record took as it was appended, in order.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..errors import ConfigurationError, HermesMemoryError, InvalidTurnError, StoreError, describe
from ..message_rows import MAX_TOKENS, check_id, is_token_count, message_row
from ..ops import IMPORTED_ROW_COLUMNS, encode_session_op
from ..turns import Receipt
from .lifecycle import InvalidSessionError, _config

if TYPE_CHECKING:
    from ..pipeline import MemoryPipeline

IMPORT_TIMEOUT_S = 120.0
_MIB = 1024 * 1024
# The limits of one import (``ImportLimits``'s defaults). An import is held in memory, as its
# records (about the size of its lines), until every line is checked; it is appended to the
# outbox whole, and an import over ``max_queued_bytes`` would outrun the backlog's bounds.
# Hermes Agent's own (hermes_state ``_IMPORT_MAX_*``: 500 sessions, 10,000 messages and 5 MiB
# a session, 25 MiB in all) bound one transaction: ours commit a session at a time.
MAX_IMPORT_SESSIONS = 10_000
MAX_IMPORT_BYTES = 128 * _MIB
MAX_SESSION_MESSAGES = 100_000
MAX_SESSION_BYTES = 64 * _MIB
_PART_OVERHEAD = 1024  # bytes of a part's record besides its row and messages
_ENCODE = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"), allow_nan=False).encode
_INT64 = 2**63


@dataclass(frozen=True, slots=True)
class ImportLimits:
    """How much one import may hold: sessions (lines) and bytes (UTF-8, of every line) in
    all, and messages and bytes (its line's) a session. Over one, the import is refused
    with ``ImportLimitError`` before anything is accepted: split the file (each line is a
    session, so ``split -l`` does), or pass larger limits."""

    max_sessions: int = MAX_IMPORT_SESSIONS
    max_bytes: int = MAX_IMPORT_BYTES
    max_session_messages: int = MAX_SESSION_MESSAGES
    max_session_bytes: int = MAX_SESSION_BYTES

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_bytes", "max_session_messages", "max_session_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ConfigurationError(f"{name} must be a positive integer, got {value!r}")


class InvalidImportError(InvalidSessionError):
    """The import was refused before any of it was accepted: a line is not a session (or
    breaks a limit). The message says which line and why; ``line`` is its number (from 1;
    None when no one line is at fault). Nothing was stored."""

    def __init__(self, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


class ImportLimitError(InvalidImportError):
    """The import is over a limit: ``limit`` names it (an ``ImportLimits`` field, or the
    backlog's setting), ``value`` is its value. Nothing was accepted."""

    def __init__(self, message: str, line: int | None, *, limit: str, value: int) -> None:
        super().__init__(message, line)
        self.limit = limit
        self.value = value


@dataclass(frozen=True, slots=True)
class ImportResult:
    """What an import stored (each count checked in the store once committed): sessions
    imported, sessions skipped because a session of that id was there already, the messages
    imported, and the imported sessions whose parent was dropped (itself, not stored nor in
    the import, or closing a cycle)."""

    imported: int
    skipped: int
    messages: int
    detached: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {"imported": self.imported, "skipped": self.skipped, "messages": self.messages,
                "detached": list(self.detached)}


class ImportIncompleteError(StoreError):
    """An import accepted sessions that the store does not hold as exported. ``sessions``
    maps each to why (dead-lettered, with the store's error; a session of that id with
    another start stored meanwhile; not accepted, or only in part, when an append failed).
    ``result`` counts what the import stored, checked in the store (None when an append
    failed: nothing was waited for); ``accepted``, the sessions whose records were all
    appended then (durable: they commit in order, now or at the next start)."""

    def __init__(self, message: str, *, sessions: Mapping[str, str],
                 result: ImportResult | None, accepted: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.sessions = dict(sessions)
        self.result = result
        self.accepted = accepted


class ExportLine(str):
    """One session's export line (with the newline); ``messages``: how many it holds."""

    __slots__ = ("messages",)
    messages: int


def export_line(session: Mapping[str, Any], messages: list[dict[str, Any]]) -> ExportLine:
    """One session as its export line: UTF-8 text (a lone surrogate as its JSON escape)."""
    text = json.dumps({**session, "messages": messages}, ensure_ascii=False) + "\n"
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # inside a string, as \udxxx: JSON reads the same text
            text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    line = ExportLine(text)
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
                          timeout_s: float = IMPORT_TIMEOUT_S,
                          limits: ImportLimits | None = None) -> ImportResult:
    """Import export lines; returns once they are committed, and found in the store. See
    the module doc for what is checked first, and what is guaranteed.

    Raises:
        InvalidImportError: a line is not a session (says which line, and why); nothing was
            accepted. ``ImportLimitError``: over a limit (``limits``, or the backlog's under
            the "reject" policy); nothing was accepted.
        ImportIncompleteError: what was accepted is not all in the store once committed, or
            an append failed after others were made (they commit); says which sessions, why.
        FlushTimeoutError: the import did not commit within ``timeout_s`` (it is durable,
            and commits later).
        QueueFullError, DiskFullError, PipelineClosedError: the first append failed; nothing
            was accepted. PipelineFailedError.
    """
    limits = limits or ImportLimits()
    sessions = await _read(pipeline, lines, limits)
    todo, skipped = await _plan(pipeline, sessions)
    detached = await _detach(pipeline, [s for s in todo if s.new])
    _check_backlog(pipeline, todo)
    receipts: list[Receipt] = []
    accepted: list[_Session] = []
    try:  # no await in here: nothing but a failed append stops it halfway
        for s in todo:
            for part in s.send:
                receipts.append(pipeline.accept_record(part.key, s.sid, part.at, part.data,
                                                       part.n_messages))
                s.sent += 1
            accepted.append(s)
    except HermesMemoryError as exc:
        if not receipts:
            raise  # nothing was accepted
        raise _cut_short(todo, accepted, exc) from exc
    await pipeline.committed(receipts, timeout_s)
    problems = await _verify(pipeline, todo)
    ok = [s for s in todo if s.sid not in problems]
    result = ImportResult(len(ok), skipped, sum(s.n_send for s in ok),
                          tuple(sid for sid in detached if sid not in problems))
    if problems:
        raise ImportIncompleteError(
            f"{len(problems)} of the {len(todo)} sessions accepted are not in the store as "
            f"exported ({_some(problems)}); {result.imported} were imported",
            sessions=problems, result=result, accepted=tuple(s.sid for s in todo))
    return result


# -- step 1: read and check every line ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Part:
    """One record of a session's import: its key, time and bytes, and its messages' first
    turn (how the store tells a part it holds already)."""

    key: str
    at: float
    data: bytes
    first_turn: str | None
    n_messages: int


@dataclass(slots=True)
class _Session:
    line: int
    sid: str
    user: str | None
    started: float
    parent: str | None
    row: dict[str, Any]
    turns: dict[str, int]  # turn key -> its messages
    parts: list[_Part]
    new: bool = False  # not in the store: its row goes in
    send: list[_Part] = field(default_factory=list)
    sent: int = 0  # parts appended

    @property
    def n_send(self) -> int:
        return sum(p.n_messages for p in self.send)

    def detach(self) -> None:
        """Import it without its parent: its first part's record is written again."""
        self.parent = self.row["parent_session_id"] = None
        first = self.parts[0]
        data = encode_session_op(first.key, self.sid, self.user, first.at, "import",
                                 row=self.row, messages=json.loads(first.data)["m"],
                                 started_at=self.started).encode("ascii")
        self.parts[0] = replace(first, data=data)


async def _read(pipeline: MemoryPipeline, lines: Iterable[str] | AsyncIterable[str],
                limits: ImportLimits) -> list[_Session]:
    sessions: list[_Session] = []
    seen: dict[str, int] = {}
    number = total = 0
    source = _lines(lines)
    while True:
        try:
            line = await anext(source)
        except StopAsyncIteration:
            break
        except UnicodeDecodeError as exc:  # a text stream decodes ahead: no line to name
            raise InvalidImportError(f"the input is not UTF-8 text ({exc.reason}), after "
                                     f"line {number}") from None
        number += 1
        if not line or line.isspace():
            continue
        size = len(line) if line.isascii() else len(line.encode("utf-8", "surrogatepass"))
        if size > limits.max_session_bytes:
            raise ImportLimitError(
                f"line {number}: the session is {size} bytes; the limit is "
                f"{limits.max_session_bytes} a session (max_session_bytes)", number,
                limit="max_session_bytes", value=limits.max_session_bytes)
        total += size
        if total > limits.max_bytes:
            raise ImportLimitError(
                f"line {number}: the import is over {limits.max_bytes} bytes (max_bytes); "
                "split it (a line is a session)", number, limit="max_bytes",
                value=limits.max_bytes)
        if len(sessions) == limits.max_sessions:
            raise ImportLimitError(
                f"line {number}: the import holds more than {limits.max_sessions} sessions "
                "(max_sessions); split it (a line is a session)", number,
                limit="max_sessions", value=limits.max_sessions)
        s = _session(pipeline, line, number, limits)
        if s.sid in seen:
            raise InvalidImportError(f"line {number}: session {s.sid!r:.80} is on line "
                                     f"{seen[s.sid]} too", number)
        seen[s.sid] = number
        sessions.append(s)
    return sessions


async def _lines(lines: Iterable[str] | AsyncIterable[str]) -> AsyncIterator[str]:
    if isinstance(lines, AsyncIterable):
        async for line in lines:
            yield line
    else:
        for line in lines:
            yield line


def _session(pipeline: MemoryPipeline, line: str, number: int,
             limits: ImportLimits) -> _Session:
    """The line's session, checked, with its records encoded."""
    try:
        doc = json.loads(line)
    except ValueError as exc:
        raise InvalidImportError(f"line {number}: not JSON ({exc})", number) from None
    except RecursionError:
        raise InvalidImportError(f"line {number}: not JSON (nested too deep)", number) from None
    if type(doc) is not dict:
        raise InvalidImportError(f"line {number}: not a JSON object", number)
    sid = _id(f"line {number}", "id", doc.get("id"), number)
    assert sid is not None
    row = {name: _column(name, value, number) for name, value in doc.items()
           if name not in ("id", "messages")}
    if row.get("started_at") is None:
        raise InvalidImportError(f"line {number}: started_at must be a number", number)
    messages = _messages(doc.get("messages"), number, limits)
    turns: dict[str, int] = {}
    for m in messages:
        turns[m[1]] = turns.get(m[1], 0) + 1
    user, started = row.get("user_id"), float(row["started_at"])
    limit = pipeline.settings.max_turn_bytes
    budget = limit - _PART_OVERHEAD
    row_bytes = len(_ENCODE(row))
    if row_bytes > budget:
        raise InvalidImportError(f"line {number}: the session's row is {row_bytes} bytes "
                                 f"encoded; a record's limit (max_turn_bytes) is {limit}", number)
    parts = []
    for i, part in enumerate(_parts(messages, budget, budget - row_bytes) or [[]]):
        key, at = pipeline.new_key(), time.time()
        data = encode_session_op(key, sid, user, at, "import", row=row if i == 0 else None,
                                 messages=part, started_at=started).encode("ascii")
        if len(data) > limit:
            raise InvalidImportError(
                f"line {number}: turn {part[0][1]!r:.80} is {len(data)} bytes as an import "
                f"record; a record's limit (max_turn_bytes) is {limit}", number)
        parts.append(_Part(key, at, data, part[0][1] if part else None, len(part)))
    return _Session(number, sid, user, started, row.get("parent_session_id"), row, turns,
                    parts)


def _id(where: str, name: str, value: object, number: int, *, optional: bool = False
        ) -> str | None:
    try:
        return check_id(name, value, optional=optional)
    except InvalidTurnError as exc:
        raise InvalidImportError(f"{where}: {exc}", number) from None


def _column(name: str, value: Any, number: int) -> Any:
    """A session column's value, checked: its type, and text a column holds as given."""
    where = f"line {number}"
    spec = IMPORTED_ROW_COLUMNS.get(name)
    if spec is None:
        raise InvalidImportError(f"{where}: {name!r:.60} is not a column of a session", number)
    kind, nullable = spec
    if value is None:
        if nullable:
            return None
        raise InvalidImportError(f"{where}: {name} cannot be null", number)
    if name == "model_config":
        return _model_config(value, number)
    if kind is str:
        if type(value) is not str:
            raise InvalidImportError(f"{where}: {name} must be a string or null", number)
        if name in ("user_id", "parent_session_id"):
            return _id(where, name, value, number)
        if "\x00" in value:  # as describe and sync_turn's metadata refuse a session's text
            raise InvalidImportError(f"{where}: {name} holds a NUL character", number)
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidImportError(f"{where}: {name} holds a lone surrogate", number) from None
        return value
    if kind is int:
        if type(value) is bool:
            return int(value)
        if type(value) is not int or not -_INT64 <= value < _INT64:
            raise InvalidImportError(
                f"{where}: {name} must be an integer{' or null' if nullable else ''}", number)
        return value
    if not ((type(value) is int and -_INT64 <= value < _INT64)
            or (type(value) is float and math.isfinite(value))):
        raise InvalidImportError(
            f"{where}: {name} must be a number{' or null' if nullable else ''}", number)
    return value


def _model_config(value: Any, number: int) -> str:
    """The model config as its JSON text (the exported text as it is), checked as
    ``describe`` checks it: a JSON object, storable as given."""
    parsed = value
    if type(value) is str:
        try:
            parsed = json.loads(value)
        except (ValueError, RecursionError):
            raise InvalidImportError(f"line {number}: model_config is not JSON text",
                                     number) from None
    try:
        config = _config(parsed)
    except InvalidSessionError as exc:
        raise InvalidImportError(f"line {number}: {exc}", number) from None
    return value if type(value) is str else _ENCODE(config)


def _messages(raw: object, number: int, limits: ImportLimits) -> list[list[Any]]:
    """The messages as import records hold them (``ops.IMPORTED_MESSAGE_FIELDS``)."""
    if not isinstance(raw, list):
        raise InvalidImportError(f"line {number}: messages must be a list", number)
    if len(raw) > limits.max_session_messages:
        raise ImportLimitError(
            f"line {number}: the session holds {len(raw)} messages; the limit is "
            f"{limits.max_session_messages} a session (max_session_messages)", number,
            limit="max_session_messages", value=limits.max_session_messages)
    out = []
    ordinals: dict[str, int] = {}
    ids: set[int] = set()
    for j, m in enumerate(raw):
        where = f"line {number}, message {j}"
        if not isinstance(m, dict):
            raise InvalidImportError(f"{where}: not an object", number)
        mid, role = m.get("id"), m.get("role")
        if type(mid) is not int or not 0 < mid < _INT64:
            raise InvalidImportError(f"{where}: id must be a positive integer", number)
        if mid in ids:
            raise InvalidImportError(f"line {number}: two messages have one id ({mid})", number)
        ids.add(mid)
        turn = _id(where, "turn_key", m.get("turn_key"), number)
        assert turn is not None
        if not isinstance(role, str) or not role:
            raise InvalidImportError(f"{where}: role must be a non-empty string", number)
        stamp = m.get("timestamp")
        if not (type(stamp) is int or (type(stamp) is float and math.isfinite(stamp))):
            raise InvalidImportError(f"{where}: timestamp must be a number", number)
        user = _id(where, "user_id", m.get("user_id"), number, optional=True)
        for name in ("content", "tool_call_id", "tool_name"):
            if m.get(name) is not None and not isinstance(m.get(name), str):
                raise InvalidImportError(f"{where}: {name} must be a string or null", number)
        tokens = m.get("token_count")
        if tokens is not None and not is_token_count(tokens):
            raise InvalidImportError(
                f"{where}: token_count must be null or an integer from 0 to {MAX_TOKENS}",
                number)
        active, compacted = m.get("active", 1), m.get("compacted", 0)
        if active not in (0, 1) or type(active) not in (int, bool):
            raise InvalidImportError(f"{where}: active must be 0 or 1", number)
        if compacted not in (0, 1) or type(compacted) not in (int, bool):
            raise InvalidImportError(f"{where}: compacted must be 0 or 1", number)
        md = m.get("metadata")
        try:  # JSON text as sync_turn writes it: NUL and lone surrogates as escapes
            md_text = None if md is None else _ENCODE(md)
        except (ValueError, RecursionError):
            raise InvalidImportError(f"{where}: metadata is not JSON that reads back as "
                                     "given", number) from None
        given = m.get("message")
        if not isinstance(given, dict):  # an earlier version's line: its columns
            given = {"role": role, "content": m.get("content")}
            for name in ("tool_calls", "tool_call_id", "tool_name"):
                if m.get(name) is not None:
                    given[name] = m[name]
        try:  # the message as it was handed over: stored as sync_turn stores it
            row = message_row(j, given)
        except InvalidTurnError as exc:
            raise InvalidImportError(f"{where}: {exc}", number) from None
        if row[0] != role:
            raise InvalidImportError(f"{where}: its message's role is not {role!r:.40}",
                                     number)
        ordinal = ordinals.get(turn, 0)
        ordinals[turn] = ordinal + 1
        record = [mid, turn, ordinal, row[0], row[1], row[2], row[3], row[4], float(stamp),
                  user, md_text, tokens if "token_count" in m else row[5], row[7], int(active)]
        if compacted:  # only where set: a worker of the version before reads the rest
            record.append(1)
        out.append(record)
    return out


def _parts(messages: list[list[Any]], budget: int, first_budget: int
           ) -> list[list[list[Any]]]:
    """The messages in parts whose records stay within ``budget`` bytes (the first, which
    also holds the row, within ``first_budget``), whole turns kept together (a part's first
    turn is how a second import recognises it)."""
    parts: list[list[list[Any]]] = []
    current: list[list[Any]] = []
    size, room = 0, first_budget
    for m in messages:
        n = len(_ENCODE(m)) + 1
        if current and size + n > room and m[1] != current[-1][1]:
            parts.append(current)
            current, size, room = [], 0, budget
        current.append(m)
        size += n
    if current:
        parts.append(current)
    return parts


# -- step 2: what to accept ------------------------------------------------------------------


async def _plan(pipeline: MemoryPipeline, sessions: list[_Session]
                ) -> tuple[list[_Session], int]:
    """The sessions to accept, with the parts each sends, and how many are skipped."""
    held = await pipeline.store.import_state([s.sid for s in sessions])
    todo: list[_Session] = []
    skipped = 0
    for s in sessions:
        there = held.get(s.sid)
        if there is None:
            s.new, s.send = True, s.parts
            todo.append(s)
            continue
        started, turns = there
        # An import of this very session cut short: its first part is in, some others are
        # not, and nothing else is. Anything else of that id is another session: skipped.
        if (started == s.started and s.parts[0].first_turn in turns
                and turns.keys() < s.turns.keys()):
            s.send = [p for p in s.parts if p.first_turn not in turns]
            todo.append(s)
        else:
            skipped += 1
    return todo, skipped


async def _detach(pipeline: MemoryPipeline, new: list[_Session]) -> tuple[str, ...]:
    """Drop the parent of each new session whose parent is itself, is neither stored nor
    in the import, or would close a cycle (in line order: the link that would close it)."""
    imported = {s.sid: s for s in new}
    stored: dict[str, str | None] = {}  # parent of each stored session the chains reach
    missing: set[str] = set()
    ask = {s.parent for s in new if s.parent is not None and s.parent not in imported}
    while ask:
        found = await pipeline.store.session_parents(sorted(ask))
        stored.update(found)
        missing |= ask - found.keys()
        ask = {p for p in found.values()
               if p is not None and p not in imported and p not in stored and p not in missing}
    kept: dict[str, str | None] = {}
    detached = []
    for s in new:
        p = s.parent
        if p is not None and (p == s.sid or p in missing
                              or _closes_cycle(s.sid, p, imported, kept, stored)):
            s.detach()
            detached.append(s.sid)
        kept[s.sid] = s.parent
    return tuple(detached)


def _closes_cycle(sid: str, parent: str, imported: dict[str, _Session],
                  kept: dict[str, str | None], stored: dict[str, str | None]) -> bool:
    seen: set[str] = set()
    at: str | None = parent
    while at is not None and at not in seen:
        if at == sid:
            return True
        seen.add(at)
        if at in imported:
            at = kept[at] if at in kept else imported[at].parent
        else:
            at = stored.get(at)
    return False


def _check_backlog(pipeline: MemoryPipeline, todo: list[_Session]) -> None:
    """Under the "reject" policy, an import larger than the backlog's bounds would fail
    partway: refused before anything is accepted."""
    settings = pipeline.settings
    if settings.overflow != "reject":
        return
    records = sum(len(s.send) for s in todo)
    size = sum(len(p.data) for s in todo for p in s.send)
    for limit, value, have in (("max_queued_turns", settings.max_queued_turns, records),
                               ("max_queued_bytes", settings.max_queued_bytes, size)):
        if have > value:
            raise ImportLimitError(
                f"the import is {records} records ({size} bytes), more than the backlog "
                f"holds ({limit} is {value}) under the overflow policy 'reject'; split it",
                None, limit=limit, value=value)


def _cut_short(todo: list[_Session], accepted: list[_Session],
               exc: HermesMemoryError) -> ImportIncompleteError:
    why = describe(exc)
    missed: dict[str, str] = {}
    for s in todo[len(accepted):]:
        missed[s.sid] = (f"{s.sent} of its {len(s.send)} records accepted ({why}): import "
                         "the same lines again to complete it" if s.sent
                         else f"not accepted ({why})")
    return ImportIncompleteError(
        f"an append failed after {len(accepted)} of {len(todo)} sessions were accepted: those "
        f"commit (now, or at the next start); import the same lines again for the rest "
        f"({_some(missed)}): {why}", sessions=missed, result=None,
        accepted=tuple(s.sid for s in accepted))


# -- step 3: what the store holds --------------------------------------------------------------


async def _verify(pipeline: MemoryPipeline, todo: list[_Session]) -> dict[str, str]:
    """Each accepted session that the store does not hold as exported, with why."""
    dead = await pipeline.store.dead_records([p.key for s in todo for p in s.send])
    held = await pipeline.store.import_state([s.sid for s in todo])
    problems: dict[str, str] = {}
    for s in todo:
        errors = [dead[p.key] for p in s.send if p.key in dead]
        there = held.get(s.sid)
        if errors:
            problems[s.sid] = f"dead-lettered: {errors[0]}"
        elif there is None:
            problems[s.sid] = "not in the store once its import committed (deleted meanwhile)"
        elif there[0] != s.started:
            problems[s.sid] = ("a session of that id with another start was stored before it "
                               "committed; its messages were not imported")
        else:
            lacking = sum(max(0, n - there[1].get(turn, 0)) for turn, n in s.turns.items())
            if lacking:
                problems[s.sid] = (f"{lacking} of its {sum(s.turns.values())} messages are "
                                   "not in the store")
    return problems


def _some(problems: Mapping[str, str], shown: int = 3) -> str:
    text = "; ".join(f"{sid}: {why}" for sid, why in list(problems.items())[:shown])
    return text + (f"; and {len(problems) - shown} more" if len(problems) > shown else "")
