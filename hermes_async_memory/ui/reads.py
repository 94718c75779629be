"""What the inspector shows, read through the library's own API over a read-only store.

``InspectorReads`` holds one read-only ``SqliteStore`` of the file (``open_readonly``: no
writer, no lock, no migration) and reads it with the readers the rest of the library uses:
``FileSessionReads`` for sessions and search, ``ProceduralMemory``, ``TemplateReads``, the
store's key-value reads, ``StoreReader`` for the dead letters, and ``preview_prefetch`` for
the recall preview. It runs on the inspector's own event loop (``ui.server``), never on the
pipeline's: a slow page costs the page, not a turn.

A search asks for snippets marked with ``private_marks`` (not the ``>>>``/``<<<`` Hermes
gets, which a stored message may hold itself) and hands the page each snippet as (text,
matched) parts: the template puts a matched part in ``<mark>``, and escapes every part.

The one write, replaying dead letters, goes through the same calls as ``hermes-memory
dead-letters replay``: ``SqliteStore.replay_dead_letters`` in the store's own transactions,
and ``store.replica.requeue_dead_letters`` for a replica backend's.
"""

from __future__ import annotations

import re
import secrets
import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import structlog

from ..errors import StoreError, describe
from ..procedural.api import ProceduralMemory
from ..procedural.model import ToolStats
from ..recall.preview import PrefetchPreview, preview_prefetch
from ..recall.query import all_frequent
from ..sessions.reads import FileSessionReads, SearchHit, SessionChain, SessionInfo
from ..settings import Settings
from ..store import SqliteStore
from ..store.inspect import StoreReader
from ..store.text_index import Reindex, word_reindex_state
from ..templates.model import Template
from ..templates.outcome import TaskTypeStats
from ..templates.store import TemplateReads

log = structlog.get_logger(__name__)

PAGE = 50  # rows a list shows at once
DEAD_SHOWN = 100  # dead letters listed per kind
MEMORY_USERS = 500  # users listed beside the key-value entries
MAX_QUERY_TERMS = 64  # words of a search looked at to tell whether all are frequent


@dataclass(frozen=True)
class DeadLetters:
    """The store's dead letters and each replica backend's, the oldest first."""

    store_total: int
    store: list[dict[str, Any]]
    # backend -> (total, the first DEAD_SHOWN)
    replicas: dict[str, tuple[int, list[dict[str, Any]]]] = field(default_factory=dict)


@dataclass(frozen=True)
class UserRow:
    user_id: str | None
    sessions: int
    messages: int
    tokens: int
    last_active: float


@dataclass(frozen=True)
class SessionView:
    info: SessionInfo
    chain: SessionChain
    conversation: list[dict[str, Any]]


@dataclass(frozen=True)
class FoundMessage:
    """A search hit as the page shows it: the hit, and its snippet as (text, matched) parts
    in order, the matched words' parts True."""

    hit: SearchHit
    parts: tuple[tuple[str, bool], ...]


@dataclass(frozen=True)
class ReplayResult:
    replayed: list[str]
    failed: dict[str, str]


class InspectorReads:
    """Every read a view makes. Use ``open_inspector_reads``."""

    def __init__(self, store: SqliteStore, settings: Settings) -> None:
        self._store = store
        self.settings = settings
        # The terms too common to search for, as a pipeline keeps them (store.frequent_terms):
        # read in the background every frequent_terms_refresh_s, as reading them scans the
        # whole vocabulary (~0.5 s at 1M messages), too long for a page.
        self._terms_read = anyio.Event()
        self.path = store.path
        self.sessions = FileSessionReads(store)
        self.marks = private_marks()
        self.procedural = ProceduralMemory(store)
        self.templates = TemplateReads(store, settings.templates)

    # -- users and sessions ---------------------------------------------------------------

    async def users(self, page: int) -> tuple[int, list[UserRow]]:
        rows = await self._store.list_users(limit=PAGE, offset=page * PAGE)
        total = await self._store.count_users()
        return total, [UserRow(r["user_id"], int(r["sessions"]), int(r["messages"] or 0),
                               int(r["tokens"] or 0), float(r["last_active"])) for r in rows]

    async def session_list(self, *, user_id: str | None, source: str | None, page: int
                           ) -> tuple[int, list[SessionInfo]]:
        rows = await self.sessions.list_sessions(user_id=user_id, source=source, limit=PAGE,
                                                 offset=page * PAGE)
        total = await self._store.count_sessions(source=source, user_id=user_id)
        return total, rows

    async def session(self, session_id: str) -> SessionView | None:
        info = await self.sessions.get_session(session_id)
        if info is None:
            return None
        return SessionView(info, await self.sessions.chain(session_id),
                           await self.sessions.conversation(session_id))

    async def search(self, query: str, *, user_id: str | None, session_id: str | None,
                     sources: list[str] | None, exclude_sources: list[str] | None,
                     roles: list[str] | None, syntax: str, order: str, page: int
                     ) -> tuple[str, list[FoundMessage]]:
        """(the order used, the hits). Over everyone's messages, plain words that are all
        frequent (in more messages than recall would search for) are shown newest first:
        ranking a fifth of the store takes longer than a page may (0.1 s of CPU a query at
        1M messages), and its order says little there."""
        everyone = user_id is None and session_id is None
        if order == "rank" and everyone and syntax == "plain":
            await self._terms_read.wait()
            if all_frequent(query, self._store.frequent_terms,
                            stems=self._store.word_index_stems, max_terms=MAX_QUERY_TERMS):
                order = "frequent"
        hits = await self.sessions.search(
            query, user_id=user_id, session_id=session_id, all_users=everyone,
            syntax=syntax, sources=sources, exclude_sources=exclude_sources, roles=roles,
            limit=PAGE, offset=page * PAGE,
            order="newest" if order in ("newest", "frequent") else order, marks=self.marks)
        return order, [FoundMessage(h, snippet_parts(h.snippet, self.marks)) for h in hits]

    async def preview(self, *, user_id: str | None, session_id: str, query: str
                      ) -> PrefetchPreview:
        await self._terms_read.wait()
        return await preview_prefetch(self._store, self.settings, user_id=user_id,
                                      session_id=session_id, query=query,
                                      frequent_terms=self._store.frequent_terms)

    async def keep_frequent_terms(self) -> None:
        """Read the frequent terms now and every ``frequent_terms_refresh_s`` (a failed read
        keeps the last set: a preview then searches a few more words)."""
        s = self.settings
        while True:
            try:
                await self._store.refresh_frequent_terms(s.frequent_term_rows,
                                                         s.frequent_term_ratio)
            except Exception as exc:
                log.warning("ui_frequent_terms_failed", error=describe(exc))
            self._terms_read.set()
            await anyio.sleep(s.frequent_terms_refresh_s)

    # -- key-value, procedural, templates -------------------------------------------------

    async def memory_users(self) -> list[tuple[str, int]]:
        return await self._store.memory_users(MEMORY_USERS)

    async def memory(self, user_id: str, page: int) -> list[tuple[str, Any]]:
        """(key, entry row) of the user's entries, most recently updated first."""
        rows = await self._store.memory_entries(user_id, PAGE, page * PAGE)
        return [(r[0], r) for r in rows]

    async def tools(self, user_id: str | None) -> list[ToolStats]:
        return await self.procedural.stats(user_id)

    async def template_list(self) -> tuple[list[Template], list[TaskTypeStats]]:
        return await self.templates.list(), await self.templates.stats()

    # -- dead letters ---------------------------------------------------------------------

    async def dead_letters(self) -> DeadLetters:
        return await anyio.to_thread.run_sync(self._dead_letters)

    def _dead_letters(self) -> DeadLetters:
        with StoreReader(self.path, busy_timeout_ms=self.settings.busy_timeout_ms) as reader:
            total, rows = reader.dead_letters(DEAD_SHOWN)
            replicas = {backend: reader.replica_dead_letters(backend, DEAD_SHOWN)
                        for backend, _ in reader.replica_dead_counts()}
        return DeadLetters(total, rows, replicas)

    async def replay(self, keys: list[str], backend: str | None) -> ReplayResult:
        """Replay dead letters: the store's (``backend`` None) or a replica backend's."""
        if backend is not None:
            from ..store.replica import requeue_dead_letters

            n = await anyio.to_thread.run_sync(lambda: requeue_dead_letters(
                self.path, backend, keys, busy_timeout_ms=self.settings.busy_timeout_ms))
            missing = {} if n == len(keys) else {
                "": f"{len(keys) - n} of {len(keys)} are not dead letters of {backend}"}
            return ReplayResult(keys if n == len(keys) else [], missing)
        from ..store.dead_letters import replay_file_dead_letters

        s = self.settings
        replayed, failed = await replay_file_dead_letters(
            self.path, keys, source=s.source,
            replica=None if s.backend == "null" else s.backend,
            busy_timeout_ms=s.busy_timeout_ms)
        return ReplayResult(replayed, failed)

    # -- the store's counts ---------------------------------------------------------------

    async def counts(self) -> dict[str, int]:
        sessions = await self.sessions.counts()
        entries, kv_users = await self._store.memory_counts()
        return {"sessions": sessions.sessions, "messages": sessions.messages,
                "memory_entries": entries, "memory_users": kv_users}

    async def reindex(self) -> Reindex | None:
        """The word index's rebuild after an upgrade, while one is under way: read from the
        file at each call, as the worker or pipeline writing it moves it on."""
        try:
            async with self._store.reader() as db:
                return await word_reindex_state(db)
        except sqlite3.Error as exc:
            raise StoreError(f"cannot read the store: {exc}") from exc


def private_marks() -> tuple[str, str]:
    """(open, close) marks for a search's snippets that no stored message holds: private-use
    characters around a random token, made once per inspector and never shown nor stored."""
    token = secrets.token_hex(8)
    return f"\ue000{token}\ue001", f"\ue002{token}\ue003"


def snippet_parts(snippet: str, marks: tuple[str, str]) -> tuple[tuple[str, bool], ...]:
    """``snippet`` (marked with ``marks``) as (text, matched) parts, in order, the marks left
    out; no part is empty."""
    open_mark, close_mark = marks
    parts: list[tuple[str, bool]] = []
    matched = False
    for piece in re.split(f"({re.escape(open_mark)}|{re.escape(close_mark)})", snippet):
        if piece == open_mark:
            matched = True
        elif piece == close_mark:
            matched = False
        elif piece:
            parts.append((piece, matched))
    return tuple(parts)


@asynccontextmanager
async def open_inspector_reads(path: Path | str, settings: Settings
                               ) -> AsyncIterator[InspectorReads]:
    """The inspector's reads of the store file at ``path``, opened read-only.

    Raises:
        StoreError: no such file, not a store of ours, another schema version, unreadable.
    """
    store = SqliteStore(Path(path), readers=4, busy_timeout_ms=settings.busy_timeout_ms)
    await store.open_readonly()
    try:
        reads = InspectorReads(store, settings)
        async with anyio.create_task_group() as tg:
            tg.start_soon(reads.keep_frequent_terms)
            try:
                yield reads
            finally:
                tg.cancel_scope.cancel()
    finally:
        await store.aclose()
