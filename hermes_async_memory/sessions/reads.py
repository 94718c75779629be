"""The session store's reads: search a user's messages (plain text or FTS5 syntax, with
filters and each hit's neighbours), list sessions, one session, its conversation in OpenAI
chat format, its parent chain, counts.

Reads see what is committed: a turn accepted and not yet committed shows once it is
(``await pipeline.flush()`` first to wait for it). ``SessionReads`` is async, on the
pipeline's loop; ``BlockingSessionReads`` (``reads.blocking(timeout_s)``) is the same for any
other thread.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..blocking import run_blocking
from ..errors import InvalidTurnError, PipelineClosedError, StoreError
from ..message_rows import check_id
from ..store.sessions import SNIPPET_CLOSE, SNIPPET_OPEN
from ..turns import scope_token_for
from .search import (
    InvalidSearchError,
    content_expression,
    is_fts5_syntax_error,
    scoped_match,
    text_query,
)
from .transfer import ExportLine, export_line

if TYPE_CHECKING:
    from ..pipeline import MemoryPipeline
    from ..store import SqliteStore

T = TypeVar("T")
MAX_SEARCH_LIMIT = 100
MAX_LIST_LIMIT = 1000
# Past this, paging is a scan of every match anyway (bm25 ranks all of them); the bound
# keeps an offset inside SQLite's 64-bit integers.
MAX_OFFSET = 1_000_000
MAX_FILTER_VALUES = 100  # sources, excluded sources or roles in one search
SNIPPET_TOKENS = 32  # words of a hit's snippet (FTS5 allows at most 64)
READ_TIMEOUT_S = 10.0  # a blocking read waits this long for its answer
_READABLE = ("open", "failed", "closing")  # a failed pipeline's store still reads


@dataclass(frozen=True, slots=True)
class ContextMessage:
    """A message next to a hit in its session: its role and its first 200 characters."""

    role: str
    content: str

    def as_dict(self) -> dict[str, Any]:
        return {"role": self.role, "content": self.content}


@dataclass(frozen=True, slots=True)
class SearchHit:
    """One matching message.

    ``snippet`` marks the matched words as ``>>>word<<<`` (``store.sessions.SNIPPET_OPEN``
    and ``SNIPPET_CLOSE``, or the ``marks`` the search was given) and stands ``…`` for text
    cut away. ``rank`` is FTS5's bm25 on the message text (on its tool text, for a message
    found by that, whose snippet is then of its tool text): lower is better. ``before`` and
    ``after`` are the messages next to it in its own session (None at either end).
    """

    message_id: int
    session_id: str
    user_id: str | None
    source: str | None
    model: str | None
    timestamp: float
    role: str
    tool_name: str | None
    snippet: str
    rank: float
    before: ContextMessage | None
    after: ContextMessage | None

    @property
    def context(self) -> tuple[ContextMessage, ...]:
        """The neighbours there are, in order."""
        return tuple(m for m in (self.before, self.after) if m is not None)

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["before"] = None if self.before is None else self.before.as_dict()
        out["after"] = None if self.after is None else self.after.as_dict()
        return out


@dataclass(frozen=True, slots=True)
class SessionInfo:
    """A stored session: every column of its row. ``model_config`` is the JSON object the
    host gave (None when none, or when what is stored is not an object);
    ``tokens_estimated``: some token counts were estimated from text."""

    id: str
    source: str
    user_id: str | None
    model: str | None
    parent_session_id: str | None
    started_at: float
    updated_at: float
    ended_at: float | None
    end_reason: str | None
    message_count: int
    tool_call_count: int
    input_tokens: int
    output_tokens: int
    model_config: dict[str, Any] | None
    system_prompt: str | None
    tokens_estimated: bool

    @property
    def ended(self) -> bool:
        return self.ended_at is not None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> SessionInfo:
        """From a row of ``sessions`` with model_config decoded (``store.sessions``)."""
        config = row.get("model_config")
        return cls(
            id=row["id"], source=row["source"], user_id=row["user_id"], model=row["model"],
            parent_session_id=row["parent_session_id"], started_at=row["started_at"],
            updated_at=row["updated_at"], ended_at=row.get("ended_at"),
            end_reason=row.get("end_reason"),
            # A counter past 2**63 was summed by SQLite as a real.
            message_count=int(row["message_count"]),
            tool_call_count=int(row["tool_call_count"]),
            input_tokens=int(row["input_tokens"]), output_tokens=int(row["output_tokens"]),
            model_config=config if isinstance(config, dict) else None,
            system_prompt=row.get("system_prompt"),
            tokens_estimated=bool(row.get("tokens_estimated")),
        )

    def as_dict(self) -> dict[str, Any]:
        """Every column, and ``ended``."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.model_config is not None:
            out["model_config"] = dict(self.model_config)
        out["ended"] = self.ended
        return out


@dataclass(frozen=True, slots=True)
class SessionChain:
    """A session's place among its parents and children.

    ``ancestors``: its parent's parent ... up to its parent, oldest first (stored sessions
    only). ``missing_parent``: the id the walk up stopped at because no such session is
    stored (a parent named by metadata and never stored itself), else None.
    ``descendants``: every stored session whose parent chain leads to it, breadth first
    (children, then grandchildren, each level by start time). ``truncated``: a bound
    (``store.sessions.MAX_ANCESTORS``, ``MAX_DESCENDANTS``, ``MAX_DESCENDANT_DEPTH``) cut a
    walk. A cycle of parents ends a walk at the session it would repeat.
    """

    session_id: str
    ancestors: tuple[SessionInfo, ...]
    descendants: tuple[SessionInfo, ...]
    missing_parent: str | None = None
    truncated: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {"session_id": self.session_id,
                "ancestors": [s.as_dict() for s in self.ancestors],
                "descendants": [s.as_dict() for s in self.descendants],
                "missing_parent": self.missing_parent, "truncated": self.truncated}


@dataclass(frozen=True, slots=True)
class SessionCounts:
    """Sessions and messages stored (under the filters asked for)."""

    sessions: int
    messages: int

    def as_dict(self) -> dict[str, Any]:
        return {"sessions": self.sessions, "messages": self.messages}


class SessionReads:
    """Reads of one pipeline's sessions. Stateless: any number may share a pipeline."""

    def __init__(self, pipeline: MemoryPipeline) -> None:
        self._p = pipeline

    @property
    def pipeline(self) -> MemoryPipeline:
        return self._p

    async def search(
        self, query: str, *, user_id: str | None = None, all_users: bool = False,
        syntax: str = "plain", sources: Sequence[str] | None = None,
        exclude_sources: Sequence[str] | None = None, roles: Sequence[str] | None = None,
        session_id: str | None = None, limit: int = 20, offset: int = 0,
        order: str = "rank", marks: tuple[str, str] = (SNIPPET_OPEN, SNIPPET_CLOSE),
    ) -> list[SearchHit]:
        """Messages matching ``query``, best first (bm25, then oldest), one page; with
        ``order="newest"`` the latest stored first, unranked (fast however many match). A
        message matches by its text, or by what it says of tools (its tool name, its calls'
        names and arguments: the tool index), the query whole in either.

        ``syntax="plain"``: ``query`` is data; a message matches when it holds every word
        (case and accents aside); operators and quotes in it are words or punctuation.
        ``syntax="fts5"``: FTS5 query syntax (phrases, ``word*``, AND, OR, NOT, NEAR, ``^``,
        parentheses), without column filters: see ``sessions.search``. Blank text (or
        punctuation only, in plain text) finds nothing. A query holding CJK text is searched
        as substrings (大别山 finds 大别山项目计划书): see ``sessions.search.text_query``
        and ``SqliteStore.search_messages``.

        Whose messages: ``user_id``'s only, by default; or, without ``user_id``, the
        messages stored without a user in ``session_id``; or, with ``all_users=True``,
        everyone's (an administrator's search: a user-facing caller never sets it).
        Filters narrow that: ``sources`` (only sessions from these; an empty list: none),
        ``exclude_sources``, ``roles`` (only these roles), ``session_id``.

        ``marks``: the (open, close) text around each match in a snippet. A stored message
        may hold ``>>>`` itself; a reader that must tell a mark from text (the inspector,
        which shows each match as HTML) asks for marks no message holds.

        Raises:
            InvalidSearchError: a malformed FTS5 query (says what and where), an unknown
                ``syntax``, no user_id / session_id / all_users, a limit not 1 to 100, an
                offset not 0 to 1,000,000, an invalid id or filter, an empty mark or one
                holding U+0000.
            PipelineClosedError: the pipeline is not open.
            FullTextUnavailableError: the store keeps no full-text index (a SQLite without
                FTS5; every other read works).
            StoreError: the store could not be read.
        """
        if order not in ("rank", "newest"):
            raise InvalidSearchError(f"order must be 'rank' or 'newest', got {order!r}")
        if not isinstance(all_users, bool):
            raise InvalidSearchError(f"all_users must be a bool, got {type(all_users).__name__}")
        if (not isinstance(marks, tuple) or len(marks) != 2
                or not all(isinstance(m, str) and m and "\x00" not in m for m in marks)):
            raise InvalidSearchError("marks must be two non-empty strings without U+0000")
        user = _id("user_id", user_id, optional=True)
        session = _id("session_id", session_id, optional=True)
        limit = _int("limit", limit, 1, MAX_SEARCH_LIMIT)
        offset = _int("offset", offset, 0, MAX_OFFSET)
        only_sources = _values("sources", sources)
        not_sources = _values("exclude_sources", exclude_sources)
        only_roles = _values("roles", roles)
        if user is None and session is None and not all_users:
            raise InvalidSearchError(
                "a search needs a user_id (or a session_id, for a session without a user; or "
                "all_users=True, for an administrator)")
        expression = content_expression(query, syntax)
        self._check_open()
        if expression is None:
            return []
        # The scope tokens put the restriction inside the full-text index (FTS5 intersects
        # posting lists, and ranks only these rows); the SQL filters make it exact.
        tokens = [] if user is None else [scope_token_for(user, None)]
        if session is not None:
            tokens.append(scope_token_for(None, session))
        match = scoped_match(expression, tokens)
        # CJK text: searched as substrings (the trigram index), which the word index is not.
        text = text_query(query, syntax)
        try:
            rows = await self._store().search_messages(
                match, tool_match=scoped_match(expression, tokens, "tool_text"),
                sources=only_sources, exclude_sources=not_sources, roles=only_roles,
                session_id=session, user_id=user,
                no_user=user is None and not all_users, limit=limit, offset=offset,
                snippet_tokens=SNIPPET_TOKENS, newest=order == "newest", text=text,
                marks=marks)
        except sqlite3.OperationalError as exc:
            if is_fts5_syntax_error(exc):
                raise InvalidSearchError(f"SQLite refused the query: {exc}") from exc
            raise StoreError(f"cannot search the store: {exc}") from exc
        except sqlite3.Error as exc:
            raise StoreError(f"cannot search the store: {exc}") from exc
        return [_hit(r) for r in rows]

    async def list_sessions(self, *, source: str | None = None, user_id: str | None = None,
                            limit: int = 50, offset: int = 0) -> list[SessionInfo]:
        """Sessions, newest first (by start, then id), one page.

        Raises:
            InvalidSearchError: an invalid filter, a limit not 1 to 1000, an offset not 0 to
                1,000,000.
            PipelineClosedError, StoreError.
        """
        source = _id("source", source, optional=True)
        user = _id("user_id", user_id, optional=True)
        limit = _int("limit", limit, 1, MAX_LIST_LIMIT)
        offset = _int("offset", offset, 0, MAX_OFFSET)
        self._check_open()
        rows = await _read(self._store().list_sessions(
            source=source, user_id=user, limit=limit, offset=offset))
        return [SessionInfo.from_row(r) for r in rows]

    async def get_session(self, session_id: str) -> SessionInfo | None:
        """The stored session, or None.

        Raises:
            InvalidSearchError: an invalid id. PipelineClosedError, StoreError.
        """
        session = _session(session_id)
        self._check_open()
        row = await _read(self._store().get_session(session))
        return None if row is None else SessionInfo.from_row(row)

    async def messages(self, session_id: str) -> list[dict[str, Any]]:
        """The session's messages as stored, in order ([] when none), as seed 001's
        ``get_messages``: each a dict of id, session_id, turn_key, role, content (its text),
        tool_calls and metadata (decoded), tool_call_id, tool_name, timestamp, user_id,
        token_count (None when the message reported none), active (0: set aside by the
        host), and ``message``: the message exactly as it was handed over, every key kept.

        Raises:
            InvalidSearchError: an invalid id. PipelineClosedError, StoreError.
        """
        session = _session(session_id)
        self._check_open()
        return await _read(self._store().get_messages(session))

    async def conversation(self, session_id: str) -> list[dict[str, Any]]:
        """The session's messages as they were handed over, every key kept, in order ([]
        when none). A message an earlier version stored comes back in OpenAI chat format:
        ``{"role", "content"}``, with its ``tool_calls``, ``tool_call_id`` and ``name``.

        Each tool result comes right after the assistant message that made its call (the
        nearest one before it with that call id, else the nearest after), in the order of
        the calls: what a chat API expects back (messages handed over in that order stay
        as they are). A result whose call is not stored stays where it is.

        Raises:
            InvalidSearchError: an invalid id. PipelineClosedError, StoreError.
        """
        session = _session(session_id)
        self._check_open()
        return pair_tool_results(await self.messages(session))

    async def chain(self, session_id: str) -> SessionChain:
        """The session's ancestors (oldest first) and descendants (breadth first); see
        ``SessionChain``. A session that is not stored has no ancestors, and has
        descendants when stored sessions name it their parent.

        Raises:
            InvalidSearchError: an invalid id. PipelineClosedError, StoreError.
        """
        session = _session(session_id)
        self._check_open()
        up, down, truncated = await _read(self._store().parent_chain(session))
        ancestors: list[SessionInfo] = []
        missing = None
        for chain_id, row in up:  # nearest first
            if row is None:
                missing = chain_id
                break
            ancestors.append(SessionInfo.from_row(row))
        return SessionChain(session, tuple(reversed(ancestors)),
                            tuple(SessionInfo.from_row(r) for r in down), missing, truncated)

    async def counts(self, source: str | None = None, user_id: str | None = None,
                     session_id: str | None = None) -> SessionCounts:
        """Sessions and their messages stored, under the filters given (all: everything).

        Raises:
            InvalidSearchError: an invalid filter. PipelineClosedError, StoreError.
        """
        source = _id("source", source, optional=True)
        user = _id("user_id", user_id, optional=True)
        session = _id("session_id", session_id, optional=True)
        self._check_open()
        store = self._store()
        sessions = await _read(store.count_sessions(source, user, session))
        messages = await _read(store.count_messages(session, user, source))
        return SessionCounts(sessions, messages)

    def export(self, *, user_id: str | None = None, session_id: str | None = None
               ) -> AsyncIterator[ExportLine]:
        """The committed sessions (of ``user_id``; or just ``session_id``), oldest first,
        as export lines (``transfer.export_line``), one at a time, from one snapshot however
        long the caller takes.

        Raises:
            InvalidSearchError: an invalid id. PipelineClosedError, StoreError.
        """
        user = _id("user_id", user_id, optional=True)
        session = _id("session_id", session_id, optional=True)
        self._check_open()
        return self._export(user, session)

    async def _export(self, user_id: str | None, session_id: str | None
                      ) -> AsyncIterator[ExportLine]:
        rows = self._store().export_sessions(user_id=user_id, session_id=session_id)
        try:
            async for session, messages in rows:
                yield export_line(session, messages)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read the store: {exc}") from exc
        finally:
            await rows.aclose()

    def _store(self) -> SqliteStore:
        return self._p.store

    def _check_open(self) -> None:
        if self._p.state not in _READABLE:
            raise PipelineClosedError(f"the pipeline is {self._p.state}")

    def blocking(self, timeout_s: float = READ_TIMEOUT_S) -> BlockingSessionReads:
        """The same reads for a thread other than the pipeline's loop."""
        return BlockingSessionReads(self, timeout_s)


class BlockingSessionReads:
    """``SessionReads`` for any thread but the pipeline's loop thread: each read runs on the
    loop and is waited for up to ``timeout_s`` (then TimeoutError, and the read is
    cancelled)."""

    def __init__(self, reads: SessionReads, timeout_s: float = READ_TIMEOUT_S) -> None:
        self._r = reads
        self._timeout_s = timeout_s

    def search(
        self, query: str, *, user_id: str | None = None, all_users: bool = False,
        syntax: str = "plain", sources: Sequence[str] | None = None,
        exclude_sources: Sequence[str] | None = None, roles: Sequence[str] | None = None,
        session_id: str | None = None, limit: int = 20, offset: int = 0,
    ) -> list[SearchHit]:
        return self._run(self._r.search(
            query, user_id=user_id, all_users=all_users, syntax=syntax, sources=sources,
            exclude_sources=exclude_sources, roles=roles, session_id=session_id, limit=limit,
            offset=offset))

    def list_sessions(self, *, source: str | None = None, user_id: str | None = None,
                      limit: int = 50, offset: int = 0) -> list[SessionInfo]:
        return self._run(self._r.list_sessions(source=source, user_id=user_id, limit=limit,
                                               offset=offset))

    def get_session(self, session_id: str) -> SessionInfo | None:
        return self._run(self._r.get_session(session_id))

    def messages(self, session_id: str) -> list[dict[str, Any]]:
        return self._run(self._r.messages(session_id))

    def conversation(self, session_id: str) -> list[dict[str, Any]]:
        return self._run(self._r.conversation(session_id))

    def chain(self, session_id: str) -> SessionChain:
        return self._run(self._r.chain(session_id))

    def counts(self, source: str | None = None, user_id: str | None = None,
               session_id: str | None = None) -> SessionCounts:
        return self._run(self._r.counts(source, user_id, session_id))

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return run_blocking(self._r.pipeline, coro, self._timeout_s)


class FileSessionReads(SessionReads):
    """The same reads on a store file opened read-only, with no pipeline: for a tool that
    reads beside the process that writes the file (``open_session_reads``)."""

    def __init__(self, store: SqliteStore) -> None:
        self._file_store: SqliteStore | None = store

    @property
    def pipeline(self) -> MemoryPipeline:
        raise PipelineClosedError("these reads have no pipeline: they read a file")

    def blocking(self, timeout_s: float = READ_TIMEOUT_S) -> BlockingSessionReads:
        raise PipelineClosedError("reads of a file have no blocking form: await them")

    def _store(self) -> SqliteStore:
        if self._file_store is None:
            raise PipelineClosedError("the store file is closed")
        return self._file_store

    def _check_open(self) -> None:
        self._store()


@asynccontextmanager
async def open_session_reads(path: Path | str, *, busy_timeout_ms: int = 10_000
                             ) -> AsyncIterator[FileSessionReads]:
    """The session reads of the store file at ``path``, opened read-only (no writer, no
    lock, no migration): safe beside a running pipeline or worker.

    Raises:
        StoreError: no such file, not a store of ours, another schema version, unreadable.
    """
    from ..store import SqliteStore

    store = SqliteStore(Path(path), readers=1, busy_timeout_ms=busy_timeout_ms)
    await store.open_readonly()
    reads = FileSessionReads(store)
    try:
        yield reads
    finally:
        reads._file_store = None
        await store.aclose()


def pair_tool_results(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Stored messages (``store.get_messages`` rows) as an OpenAI chat, each tool result
    moved right after the assistant message that called it (see ``conversation``)."""
    messages = [_chat_message(r) for r in rows]
    calls: dict[str, list[int]] = {}  # call id -> indexes of the assistant messages making it
    for i, m in enumerate(messages):
        for call_id in _call_ids(m):
            calls.setdefault(call_id, []).append(i)
    results: dict[int, list[tuple[int, int, dict[str, Any]]]] = {}
    placed: set[int] = set()
    for i, m in enumerate(messages):
        result_of = m.get("tool_call_id")
        if m["role"] != "tool" or not isinstance(result_of, str) or result_of not in calls:
            continue  # no stored call: it stays where it is
        makers = calls[result_of]
        before = [j for j in makers if j < i]
        maker = before[-1] if before else makers[0]
        order = _call_ids(messages[maker]).index(result_of)
        results.setdefault(maker, []).append((order, i, m))
        placed.add(i)
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if i in placed:
            continue
        out.append(m)
        out.extend(r for _, _, r in sorted(results.get(i, ()), key=lambda x: (x[0], x[1])))
    return out


def _chat_message(row: Mapping[str, Any]) -> dict[str, Any]:
    message: dict[str, Any] = row["message"]
    return message


def _call_ids(message: Mapping[str, Any]) -> list[str]:
    calls = message.get("tool_calls") or ()
    return [c["id"] for c in calls if isinstance(c, Mapping) and isinstance(c.get("id"), str)]


def _hit(r: Mapping[str, Any]) -> SearchHit:
    before = (None if r["before_role"] is None
              else ContextMessage(r["before_role"], r["before_content"]))
    after = None if r["after_role"] is None else ContextMessage(r["after_role"], r["after_content"])
    return SearchHit(
        message_id=r["id"], session_id=r["session_id"], user_id=r["user_id"],
        source=r["source"], model=r["model"], timestamp=r["timestamp"], role=r["role"],
        tool_name=r["tool_name"], snippet=r["snippet"] or "", rank=float(r["score"]),
        before=before, after=after)


async def _read(coro: Coroutine[Any, Any, T]) -> T:
    """Await a store read; SQLite's errors become StoreError."""
    try:
        return await coro
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read the store: {exc}") from exc


def _id(name: str, value: object, *, optional: bool = False) -> str | None:
    """``message_rows.check_id``, raising InvalidSearchError."""
    try:
        return check_id(name, value, optional=optional)
    except InvalidSearchError:
        raise
    except InvalidTurnError as exc:
        raise InvalidSearchError(str(exc)) from None


def _session(value: object) -> str:
    return _value("session_id", value)


def _int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidSearchError(f"{name} must be an integer from {low} to {high}, "
                                 f"got {value!r:.20}")
    return value


def _values(name: str, value: object) -> list[str] | None:
    """A filter's values as a list (a single string is one value), checked."""
    if value is None:
        return None
    if isinstance(value, str):
        items: Sequence[object] = [value]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=str) if isinstance(value, (set, frozenset)) else value
    else:
        raise InvalidSearchError(f"{name} must be a list of strings, got {type(value).__name__}")
    if len(items) > MAX_FILTER_VALUES:
        raise InvalidSearchError(f"{name} holds {len(items)} values; at most {MAX_FILTER_VALUES}")
    return [_value(name, v) for v in items]


def _value(name: str, value: object) -> str:
    checked = _id(name, value)
    assert checked is not None
    return checked


__all__ = ["BlockingSessionReads", "ContextMessage", "FileSessionReads", "SearchHit",
           "SessionChain", "SessionCounts", "SessionInfo", "SessionReads", "open_session_reads",
           "pair_tool_results"]
