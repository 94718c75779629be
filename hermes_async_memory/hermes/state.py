"""Hermes Agent's session store (``hermes_state.SessionDB``, hermes-agent 0.19) over this
library's store: a drop-in for ``import hermes_state``.

    Hermes threads ──► SessionDB writes ──► the pipeline's durable outbox (no waiting on I/O)
                                             └─► group commit into the store, in order
                   ──► SessionDB reads  ──► wait for what was accepted to commit (read your
                                            own writes), then one SQL read on this thread

Same constructor, methods, return shapes and exceptions as Hermes's, synchronous and safe
from any thread. Every write is a record in the store's outbox, so it survives a SIGKILL the
moment the method returns; ``append_message`` returns the message's id then. A read first
waits until everything accepted before it (by any thread of this process) is committed.

What differs from Hermes's own, by design (README, "Hermes's session store"):

- The file is a store of ours: the same sessions and messages (with Hermes's column names,
  so ``_conn`` reads as Hermes's code expects) and our memory beside them. Hermes's own
  ``state.db`` is refused, untouched; ``hermes-memory sessions import`` brings its sessions
  over.
- Messages keep every key they were given (``turns.message_row``).
- SQLite must have FTS5 (every store of ours indexes its messages with it).
- One process commits a store; several processes share one through ``hermes-memory worker``.
"""

from __future__ import annotations

import contextvars
import datetime as _dt
import json
import logging
import re
import sqlite3
import sys  # noqa: F401 (Hermes's code and tests reach it as hermes_state.sys)
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ..errors import HermesMemoryError, StoreError
from ..settings import Settings
from ..store import hermes_reads as reads
from ..store.connections import check_store_file
from ..turns import Receipt, sanitize
from . import runtime as runtimes
from .config import DEFAULT_DB, default_hermes_home

logger = logging.getLogger(__name__)

# Hermes's own schema, for code that builds a legacy file with it (its tests do); our store
# is not made from it.
SCHEMA_VERSION = 22
SCHEMA_SQL = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, source TEXT NOT NULL, user_id TEXT, model TEXT, model_config TEXT,
    system_prompt TEXT, parent_session_id TEXT, started_at REAL NOT NULL, ended_at REAL,
    end_reason TEXT, message_count INTEGER DEFAULT 0, tool_call_count INTEGER DEFAULT 0,
    input_tokens INTEGER DEFAULT 0, output_tokens INTEGER DEFAULT 0, title TEXT
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL, role TEXT NOT NULL,
    content TEXT, tool_call_id TEXT, tool_calls TEXT, tool_name TEXT, timestamp REAL NOT NULL,
    token_count INTEGER, finish_reason TEXT
);
CREATE TABLE IF NOT EXISTS state_meta (key TEXT PRIMARY KEY, value TEXT);
"""
MAX_FTS5_QUERY_CHARS = 2_048
DEFAULT_DB_PATH = default_hermes_home() / DEFAULT_DB
# How long a read waits for the writes accepted before it to commit.
READ_WAIT_S = 30.0
# How long a call that must commit first (an import, a prune) may take.
WRITE_WAIT_S = 120.0
CLOSE_DEADLINE_S = 10.0

_last_init_error: str | None = None
_last_init_error_lock = threading.Lock()
_REVIEW_HARNESS_PREFIXES = (
    "Review the conversation above and update the skill library",
    "Review the conversation above and consider saving to memory",
)
_CONTENT_JSON_PREFIX = "\x00json:"
_BOOLEAN_WORDS = {"AND", "OR", "NOT"}


def _set_last_init_error(message: str | None) -> None:
    global _last_init_error
    with _last_init_error_lock:
        _last_init_error = message


def get_last_init_error() -> str | None:
    """Why the last ``SessionDB()`` of this process failed to open, or None."""
    return _last_init_error


def format_session_db_unavailable(prefix: str = "Session database not available") -> str:
    """``prefix``, with why the store could not be opened when that is known."""
    cause = get_last_init_error()
    return f"{prefix}: {cause}" if cause else f"{prefix}."


class SessionDB:
    """Hermes Agent's session store over this library's: sessions, their messages, full-text
    search, export and import. Thread-safe; every method returns when its write is durable
    (writes) or answers from everything written before it (reads)."""

    # Hermes's import bounds (one import, one transaction's worth).
    _IMPORT_MAX_SESSIONS = 500
    _IMPORT_MAX_MESSAGES_PER_SESSION = 10_000
    _IMPORT_MAX_TOTAL_MESSAGES = 50_000
    _IMPORT_MAX_SESSION_BYTES = 5 * 1024 * 1024
    _IMPORT_MAX_TOTAL_BYTES = 25 * 1024 * 1024
    MAX_TITLE_LENGTH = 100

    def __init__(self, db_path: Path | str | None = None, read_only: bool = False) -> None:
        self.db_path = Path(db_path) if db_path is not None else DEFAULT_DB_PATH
        self.read_only = read_only
        self._lock = threading.RLock()
        self._runtime: runtimes.Runtime | None = None
        self._raw: sqlite3.Connection | None = None
        self._users: dict[str, str | None] = {}  # session -> its user, as this store has it
        self._fts_enabled = True  # every store of ours indexes its messages with FTS5
        self._trigram_available = False
        try:
            check_store_file(self.db_path)
            if read_only:
                self._raw = _connect(f"file:{self.db_path}?mode=ro", uri=True)
                return
            self.db_path.parent.mkdir(parents=True, exist_ok=True)
            settings = Settings.from_env(db_path=self.db_path)
            self._runtime = runtimes.acquire(settings, contextvars.copy_context())
            self._raw = _connect(str(self.db_path))
            self._trigram_available = reads.table_exists(self._raw, "messages_fts_trigram")
        except Exception as exc:
            _set_last_init_error(f"{type(exc).__name__}: {exc}")
            self.close()
            raise

    # -- plumbing ------------------------------------------------------------------------

    @property
    def _conn(self) -> sqlite3.Connection:
        """The store's file as a plain ``sqlite3`` connection (rows as ``sqlite3.Row``), for
        code that reads Hermes's tables directly: everything written before is committed
        when this returns."""
        self._settle()
        if self._raw is None:
            raise StoreError(f"the session store {self.db_path} is closed")
        return self._raw

    def _settle(self) -> None:
        """Wait until every write accepted so far is committed (read your own writes)."""
        runtime = self._runtime
        if runtime is None:
            return
        pipeline = runtime.pipeline
        if pipeline is None or not pipeline.pending():
            return
        runtime.call(lambda p: p.flush(timeout=READ_WAIT_S), READ_WAIT_S + 1.0)

    @contextmanager
    def _reading(self) -> Iterator[sqlite3.Connection]:
        self._settle()
        with self._lock:
            if self._raw is None:
                raise StoreError(f"the session store {self.db_path} is closed")
            yield self._raw

    def _writes(self) -> Any:
        """The pipeline's session writes (``SessionStore``)."""
        runtime = self._runtime
        if runtime is None or runtime.pipeline is None:
            raise StoreError(f"the session store {self.db_path} is "
                             f"{'read-only' if self.read_only else 'closed'}")
        return runtime.pipeline.sessions

    def _user(self, session_id: str) -> str | None:
        """The session's user (a message's scope for recall): as it was created here, else
        as the store has it."""
        if session_id in self._users:
            return self._users[session_id]
        with self._reading() as conn:
            row = conn.execute("SELECT user_id FROM sessions WHERE id = ?",
                               (session_id,)).fetchone()
        user = None if row is None else row[0]
        if row is not None:
            self._users[session_id] = user
        return user

    def close(self) -> None:
        """Drain what was accepted (within the runtime's deadline) and close. Idempotent."""
        runtime, self._runtime = self._runtime, None
        raw, self._raw = self._raw, None
        if raw is not None:
            raw.close()
        if runtime is not None:
            runtimes.release(runtime, CLOSE_DEADLINE_S)

    def __enter__(self) -> SessionDB:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- sessions ------------------------------------------------------------------------

    def create_session(self, session_id: str, source: str, **kwargs: Any) -> str:
        """Create the session's row, or fill the fields it lacks; returns ``session_id``."""
        self._insert_session_row(session_id, source, **kwargs)
        return session_id

    def ensure_session(self, session_id: str, source: str = "unknown", model: str | None = None,
                       **kwargs: Any) -> str:
        self._insert_session_row(session_id, source, model=model, **kwargs)
        return session_id

    def _insert_session_row(
        self, session_id: str, source: str, model: str | None = None,
        model_config: Mapping[str, Any] | None = None, system_prompt: str | None = None,
        user_id: str | None = None, session_key: str | None = None, chat_id: str | None = None,
        chat_type: str | None = None, thread_id: str | None = None,
        parent_session_id: str | None = None, cwd: str | None = None,
        profile_name: str | None = None,
    ) -> None:
        fill = {"source": source, "model": model,
                "model_config": dict(model_config) if model_config else None,
                "system_prompt": system_prompt, "session_key": session_key,
                "chat_id": chat_id, "chat_type": chat_type, "thread_id": thread_id,
                "parent_session_id": parent_session_id, "cwd": cwd,
                "profile_name": profile_name}
        self._writes().update_nowait(
            session_id, user_id=user_id, create=True,
            fill={k: v for k, v in fill.items() if v is not None})
        if session_id not in self._users or self._users[session_id] is None:
            self._users[session_id] = user_id

    def end_session(self, session_id: str, end_reason: str) -> None:
        """End the session; the first end wins (``reopen_session`` first to end it again)."""
        self._writes().end_nowait(session_id, end_reason, first_wins=True)

    def reopen_session(self, session_id: str) -> None:
        self._writes().reopen_nowait(session_id)

    def update_system_prompt(self, session_id: str, system_prompt: str) -> None:
        self._set(session_id, system_prompt=system_prompt)

    def update_session_model(self, session_id: str, model: str) -> None:
        self._set(session_id, model=model)

    def update_session_meta(self, session_id: str, model_config_json: str,
                            model: str | None = None) -> None:
        config = json.loads(model_config_json) if model_config_json else None
        fields: dict[str, Any] = {"model_config": config}
        if model is not None:
            fields["model"] = model
        self._set(session_id, **fields)

    def update_session_billing_route(self, session_id: str, *, provider: str, base_url: str,
                                     billing_mode: str | None = None) -> None:
        fields: dict[str, Any] = {"billing_provider": provider, "billing_base_url": base_url,
                                  "system_prompt": None}
        if billing_mode is not None:
            fields["billing_mode"] = billing_mode
        self._set(session_id, **fields)

    def update_session_cwd(self, session_id: str, cwd: str, git_branch: str | None = None,
                           git_repo_root: str | None = None) -> None:
        """The session's working directory; a branch or repo root only when not empty."""
        if not session_id or not cwd:
            return
        fields: dict[str, Any] = {"cwd": cwd}
        if (git_branch or "").strip():
            fields["git_branch"] = (git_branch or "").strip()
        if (git_repo_root or "").strip():
            fields["git_repo_root"] = (git_repo_root or "").strip()
        self._set(session_id, **fields)

    def backfill_repo_roots(self, cwd_to_root: Mapping[str, str]) -> None:
        """Fill the repo root of the sessions in each cwd that have none."""
        pairs = [(cwd, root) for cwd, root in cwd_to_root.items() if root and cwd]
        if not pairs:
            return
        with self._reading() as conn:
            targets = [(sid, root) for cwd, root in pairs for (sid,) in conn.execute(
                "SELECT id FROM sessions WHERE cwd = ? AND coalesce(git_repo_root, '') = ''",
                (cwd,)).fetchall()]
        writes = self._writes()
        for sid, root in targets:
            writes.update_nowait(sid, fill={"git_repo_root": root})

    def update_token_counts(
        self, session_id: str, input_tokens: int = 0, output_tokens: int = 0,
        model: str | None = None, cache_read_tokens: int = 0, cache_write_tokens: int = 0,
        reasoning_tokens: int = 0, estimated_cost_usd: float | None = None,
        actual_cost_usd: float | None = None, cost_status: str | None = None,
        cost_source: str | None = None, pricing_version: str | None = None,
        billing_provider: str | None = None, billing_base_url: str | None = None,
        billing_mode: str | None = None, api_call_count: int = 0, absolute: bool = False,
    ) -> None:
        """Account a model call's usage (or set the totals, ``absolute``); see
        ``SessionWrites.record_usage_nowait``."""
        self._writes().record_usage_nowait(
            session_id, user_id=self._users.get(session_id),
            input_tokens=int(input_tokens or 0), output_tokens=int(output_tokens or 0),
            cache_read_tokens=int(cache_read_tokens or 0),
            cache_write_tokens=int(cache_write_tokens or 0),
            reasoning_tokens=int(reasoning_tokens or 0),
            api_call_count=int(api_call_count or 0), estimated_cost_usd=estimated_cost_usd,
            actual_cost_usd=actual_cost_usd, model=model, billing_provider=billing_provider,
            billing_base_url=billing_base_url, billing_mode=billing_mode,
            cost_status=cost_status, cost_source=cost_source, pricing_version=pricing_version,
            absolute=bool(absolute))

    def record_auxiliary_usage(self, session_id: str, *, task: str, model: str | None = None,
                               billing_provider: str | None = None,
                               billing_base_url: str | None = None,
                               billing_mode: str | None = None, input_tokens: int = 0,
                               output_tokens: int = 0, cache_read_tokens: int = 0,
                               cache_write_tokens: int = 0, reasoning_tokens: int = 0,
                               estimated_cost_usd: float | None = None,
                               actual_cost_usd: float | None = None,
                               api_call_count: int = 1, **_: Any) -> None:
        """An auxiliary call's usage (vision, compression, titles, ...): its own row."""
        if not session_id or not task:
            return
        self._writes().record_usage_nowait(
            session_id, task=task, model=model or "unknown", billing_provider=billing_provider,
            billing_base_url=billing_base_url, billing_mode=billing_mode,
            input_tokens=int(input_tokens or 0), output_tokens=int(output_tokens or 0),
            cache_read_tokens=int(cache_read_tokens or 0),
            cache_write_tokens=int(cache_write_tokens or 0),
            reasoning_tokens=int(reasoning_tokens or 0),
            estimated_cost_usd=estimated_cost_usd, actual_cost_usd=actual_cost_usd,
            api_call_count=int(api_call_count or 0))

    def _set(self, session_id: str, **fields: Any) -> None:
        self._writes().update_nowait(session_id, fields=fields)

    def get_session(self, session_id: str) -> dict[str, Any] | None:
        with self._reading() as conn:
            return reads.session_row(conn, session_id)

    def resolve_session_id(self, session_id_or_prefix: str) -> str | None:
        """The exact id, else the one session id the prefix names; None when none or many."""
        if self.get_session(session_id_or_prefix):
            return session_id_or_prefix
        with self._reading() as conn:
            matches = reads.resolve_prefix(conn, session_id_or_prefix)
        return matches[0] if len(matches) == 1 else None

    @staticmethod
    def sanitize_title(title: str | None) -> str | None:
        """A title cleaned as Hermes cleans it (control and invisible characters out,
        whitespace collapsed); None when nothing is left.

        Raises:
            ValueError: longer than ``MAX_TITLE_LENGTH`` once cleaned.
        """
        if not title:
            return None
        cleaned = re.sub(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]", "", sanitize(title))
        cleaned = re.sub(r"[\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff\ufffc\ufff9-\ufffb]",
                         "", cleaned)
        cleaned = re.sub(r"\s+", " ", cleaned).strip()
        if not cleaned:
            return None
        if len(cleaned) > SessionDB.MAX_TITLE_LENGTH:
            raise ValueError(f"Title too long ({len(cleaned)} chars, "
                             f"max {SessionDB.MAX_TITLE_LENGTH})")
        return cleaned

    def set_session_title(self, session_id: str, title: str) -> bool:
        """Set (or with an empty title, clear) the session's title; False when there is no
        such session.

        Raises:
            ValueError: the title is too long, or another session has it.
        """
        return self._set_title(session_id, title, only_if_empty=False)

    def set_auto_title_if_empty(self, session_id: str, title: str) -> bool:
        return self._set_title(session_id, title, only_if_empty=True)

    def _set_title(self, session_id: str, title: str, *, only_if_empty: bool) -> bool:
        cleaned = self.sanitize_title(title)
        with self._reading() as conn:
            row = reads.session_row(conn, session_id)
            holder = reads.title_holder(conn, cleaned, session_id) if cleaned else None
        if row is None or (only_if_empty and row["title"] is not None):
            return False
        if holder is not None:
            raise ValueError(f"Title '{cleaned}' is already in use by session {holder}")
        self._set(session_id, title=cleaned)
        return True

    def get_session_title(self, session_id: str) -> str | None:
        row = self.get_session(session_id)
        return None if row is None else row["title"]

    def get_session_by_title(self, title: str) -> dict[str, Any] | None:
        with self._reading() as conn:
            rows = reads.session_rows(conn, "s.title = ?", (title,))
        return rows[0] if rows else None

    def distinct_session_cwds(self, include_archived: bool = False) -> list[dict[str, Any]]:
        with self._reading() as conn:
            return reads.distinct_cwds(conn, include_archived)

    def session_count(self, source: str | None = None, cwd_prefix: str | None = None,
                      min_message_count: int = 0, include_archived: bool = False,
                      archived_only: bool = False, exclude_children: bool = False,
                      exclude_sources: Sequence[str] | None = None) -> int:
        where: list[str] = []
        params: list[Any] = []
        if exclude_children:
            where.append("s.parent_session_id IS NULL")
        if source:
            where.append("s.source = ?")
            params.append(source)
        if exclude_sources:
            where.append(f"s.source NOT IN ({','.join('?' * len(exclude_sources))})")
            params.extend(exclude_sources)
        if cwd_prefix:
            clause, values = reads.cwd_prefix(cwd_prefix)
            where.append(clause)
            params.extend(values)
        if min_message_count > 0:
            where.append("s.message_count >= ?")
            params.append(min_message_count)
        if archived_only:
            where.append("s.archived = 1")
        elif not include_archived:
            where.append("s.archived = 0")
        with self._reading() as conn:
            return reads.count_sessions(conn, where, params)

    def message_count(self, session_id: str | None = None) -> int:
        with self._reading() as conn:
            return reads.count_messages(conn, session_id)

    # -- messages ------------------------------------------------------------------------

    def append_message(
        self, session_id: str, role: str, content: Any = None, tool_name: str | None = None,
        tool_calls: Any = None, tool_call_id: str | None = None, token_count: int | None = None,
        finish_reason: str | None = None, reasoning: str | None = None,
        reasoning_content: str | None = None, reasoning_details: Any = None,
        codex_reasoning_items: Any = None, codex_message_items: Any = None,
        platform_message_id: str | None = None, observed: bool = False,
        effect_disposition: str | None = None, timestamp: Any = None,
        api_content: str | None = None,
    ) -> int:
        """Append a message; returns its id (durable, and given, when this returns)."""
        message: dict[str, Any] = {"role": role, "content": content}
        for key, value in (("tool_name", tool_name), ("tool_call_id", tool_call_id),
                           ("token_count", token_count), ("finish_reason", finish_reason),
                           ("reasoning", reasoning), ("reasoning_content", reasoning_content),
                           ("platform_message_id", platform_message_id),
                           ("effect_disposition", effect_disposition),
                           ("api_content", api_content)):
            if value is not None:
                message[key] = value
        for key, value in (("tool_calls", tool_calls), ("reasoning_details", reasoning_details),
                           ("codex_reasoning_items", codex_reasoning_items),
                           ("codex_message_items", codex_message_items)):
            if value:
                message[key] = value
        if observed:
            message["observed"] = True
        stamp = _timestamp(timestamp)
        if stamp is not None:
            message["timestamp"] = stamp
        receipt = self._writes().append_nowait(session_id, [message],
                                               user_id=self._user(session_id))
        return _first_id(receipt)

    def replace_messages(self, session_id: str, messages: Sequence[Mapping[str, Any]],
                         active_only: bool = False) -> None:
        """Replace the session's messages (only its active ones, ``active_only``), at once."""
        self._writes().replace_messages_nowait(
            session_id, [_hermes_message(m) for m in messages],
            user_id=self._user(session_id), active_only=active_only)

    def get_messages(self, session_id: str, include_inactive: bool = False,
                     limit: int | None = None, offset: int = 0) -> list[dict[str, Any]]:
        with self._reading() as conn:
            return reads.message_rows(conn, session_id, include_inactive=include_inactive,
                                      limit=limit, offset=offset)

    def get_messages_as_conversation(self, session_id: str, include_ancestors: bool = False,
                                     include_inactive: bool = False,
                                     repair_alternation: bool = False) -> list[dict[str, Any]]:
        with self._reading() as conn:
            ids = (reads.lineage_root_to_tip(conn, session_id) if include_ancestors
                   else [session_id])
            rows = reads.conversation_rows(conn, ids, include_inactive=include_inactive)
        return _conversation(rows, session_id=session_id, include_ancestors=include_ancestors,
                             repair_alternation=repair_alternation)

    def get_resume_conversations(self, session_id: str
                                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(the tip's conversation, alternation repaired; the whole lineage's, as shown)."""
        with self._reading() as conn:
            rows = reads.conversation_rows(conn, reads.lineage_root_to_tip(conn, session_id))
        tip = [r for r in rows if r["session_id"] == session_id]
        return (_conversation(tip, session_id=session_id, include_ancestors=False,
                              repair_alternation=True),
                _conversation(rows, session_id=session_id, include_ancestors=True,
                              repair_alternation=False))

    def get_ancestor_display_prefix(self, session_id: str) -> list[dict[str, Any]]:
        """The ancestors' messages as the resumed conversation shows them (not the tip's)."""
        with self._reading() as conn:
            ids = reads.lineage_root_to_tip(conn, session_id)
            if len(ids) <= 1:
                return []
            rows = reads.conversation_rows(conn, ids)
        ancestors = [r for r in rows if r["session_id"] != session_id]
        return _conversation(ancestors, session_id=session_id, include_ancestors=True,
                             repair_alternation=False) if ancestors else []

    def get_conversation_root(self, session_id: str) -> str:
        with self._reading() as conn:
            chain = reads.lineage_root_to_tip(conn, session_id)
        return chain[0] if chain and chain[0] else session_id

    # -- search --------------------------------------------------------------------------

    @staticmethod
    def _is_fts5_unavailable_error(exc: sqlite3.OperationalError) -> bool:
        text = str(exc).lower()
        return "no such module: fts5" in text or "no such tokenizer: trigram" in text

    @staticmethod
    def _is_trigram_unavailable_error(exc: sqlite3.OperationalError) -> bool:
        return "no such tokenizer: trigram" in str(exc).lower()

    def _fts_table_exists(self, name: str) -> bool:
        with self._reading() as conn:
            return reads.table_exists(conn, name)

    @staticmethod
    def _sanitize_fts5_query(query: str) -> str:
        """A user's search text as a safe FTS5 query, in Hermes's dialect: balanced quoted
        phrases kept, FTS5's special characters out, dangling AND/OR/NOT dropped, and words
        joined by dots, hyphens or underscores quoted as phrases."""
        query = query[:MAX_FTS5_QUERY_CHARS]
        quoted: list[str] = []
        pieces: list[str] = []
        i = 0
        while i < len(query):
            ch = query[i]
            if ch != '"':
                pieces.append(ch)
                i += 1
                continue
            end = query.find('"', i + 1)
            if end == -1:
                pieces.append(" ")
                i += 1
                continue
            quoted.append(query[i:end + 1])
            pieces.append(f"\x00Q{len(quoted) - 1}\x00")
            i = end + 1
        text = re.sub(r'[+{}():"^]', " ", "".join(pieces))
        text = re.sub(r"\*+", "*", text)
        text = re.sub(r"(^|\s)\*", r"\1", text)
        text = re.sub(r"(?i)^(AND|OR|NOT)\b\s*", "", text.strip())
        text = re.sub(r"(?i)\s+(AND|OR|NOT)\s*$", "", text.strip())
        text = re.sub(r"\b(\w+(?:[._-]\w+)+)\b", r'"\1"', text)
        for n, phrase in enumerate(quoted):
            text = text.replace(f"\x00Q{n}\x00", phrase)
        return text.strip()

    @staticmethod
    def _contains_cjk(text: str) -> bool:
        return any(_is_cjk(ord(ch)) for ch in text)

    @staticmethod
    def _count_cjk(text: str) -> int:
        return sum(1 for ch in text if _is_cjk(ord(ch)))

    def search_messages(
        self, query: str, source_filter: Sequence[str] | None = None,
        exclude_sources: Sequence[str] | None = None, role_filter: Sequence[str] | None = None,
        limit: int = 20, offset: int = 0, sort: str | None = None,
        include_inactive: bool = False,
    ) -> list[dict[str, Any]]:
        """Messages matching ``query`` (Hermes's search dialect), each with its session's
        source and model, a snippet (``>>>`` match ``<<<``) and its neighbours in its
        session (``context``)."""
        if not query or not query.strip():
            return []
        match = self._sanitize_fts5_query(query)
        if not match:
            return []
        where: list[str] = []
        params: list[Any] = []
        if not include_inactive:
            where.append("(m.active = 1 OR m.compacted = 1)")
        if source_filter is not None:
            where.append(f"s.source IN ({','.join('?' * len(source_filter))})")
            params.extend(source_filter)
        if exclude_sources is not None:
            where.append(f"s.source NOT IN ({','.join('?' * len(exclude_sources))})")
            params.extend(exclude_sources)
        if role_filter:
            where.append(f"m.role IN ({','.join('?' * len(role_filter))})")
            params.extend(role_filter)
        order = "rank"
        if isinstance(sort, str) and sort.strip().lower() in ("newest", "oldest"):
            direction = "DESC" if sort.strip().lower() == "newest" else "ASC"
            order = f"m.timestamp {direction}, rank"
        with self._reading() as conn:
            if self._contains_cjk(match):
                raw = match.strip('"').strip()
                tokens = [t for t in raw.split() if t.upper() not in _BOOLEAN_WORDS] or [raw]
                matches = reads.like_search(conn, tokens, where=where, params=params,
                                            limit=limit, offset=offset)
            else:
                try:
                    matches = reads.search(conn, match, where=where, params=params,
                                           order=order, limit=limit, offset=offset)
                except sqlite3.OperationalError:
                    return []
            for found in matches:
                found["context"] = [
                    {"role": r["role"], "content": _preview(reads.given_content(r))[:200]}
                    for r in reads.context(conn, found["id"])]
        for found in matches:
            found.pop("content", None)
        return matches

    # -- lineage, export, import, delete, prune ------------------------------------------

    def get_compression_lineage(self, session_id: str) -> list[str]:
        """The session's compression ancestors through its tip, oldest first."""
        with self._reading() as conn:
            session = reads.session_row(conn, session_id)
            if session is None:
                return []
            if _is_branch(session):
                return [session_id]
            root, seen = session, {session["id"]}
            while True:
                parent_id = root.get("parent_session_id")
                if not parent_id or _is_branch(root):
                    break
                parent = reads.session_row(conn, parent_id)
                if (parent is None or parent["id"] in seen
                        or parent.get("end_reason") != "compression"):
                    break
                root = parent
                seen.add(root["id"])
            lineage, visited, current = [root["id"]], {root["id"]}, root
            while current.get("end_reason") == "compression":
                nxt = next((c for c in reads.children(conn, current["id"])
                            if not _is_branch(c)), None)
                if nxt is None or nxt["id"] in visited:
                    break
                lineage.append(nxt["id"])
                visited.add(nxt["id"])
                current = nxt
        return lineage if session_id in lineage else [session_id]

    def export_session(self, session_id: str) -> dict[str, Any] | None:
        session = self.get_session(session_id)
        if session is None:
            return None
        return {**session, "messages": self.get_messages(session_id)}

    def export_session_lineage(self, session_id: str) -> dict[str, Any] | None:
        segments = [s for s in (self.export_session(sid)
                                for sid in self.get_compression_lineage(session_id)) if s]
        if not segments:
            return None
        base = dict(segments[-1])
        base["segments"] = segments
        base["lineage_session_ids"] = [s["id"] for s in segments]
        base["message_count"] = sum(len(s.get("messages") or []) for s in segments)
        base["messages"] = [m for s in segments for m in (s.get("messages") or [])]
        return base

    def export_all(self, source: str | None = None) -> list[dict[str, Any]]:
        with self._reading() as conn:
            sessions = reads.session_rows(conn, "s.source = ?" if source else "",
                                          (source,) if source else ())
        return [{**s, "messages": self.get_messages(s["id"])} for s in sessions]

    def import_sessions(self, sessions: list[dict[str, Any]]) -> dict[str, Any]:
        """Import sessions as ``export_session`` / ``export_all`` give them, all or none:
        ``{"ok", "imported", "skipped", "detached", "imported_ids", "skipped_ids",
        "errors"}``. A session whose id is stored is skipped; a parent that is neither
        stored nor imported, or that would close a cycle, is dropped (``detached``); the
        live state of a channel (handoff, rewinds) is not restored. When a session cannot
        be imported, nothing is, and ``errors`` says which (``index``, ``session_id``,
        ``error``), as Hermes's own import says it.

        Raises:
            ValueError: ``sessions`` is not a list, or holds more than Hermes imports at once.
        """
        if not isinstance(sessions, list):
            raise ValueError("sessions must be a list")
        if len(sessions) > self._IMPORT_MAX_SESSIONS:
            raise ValueError(f"sessions must contain at most {self._IMPORT_MAX_SESSIONS} entries")
        lines: list[str] = []
        ids: list[str] = []
        errors: list[dict[str, Any]] = []
        total_messages = total_bytes = 0
        for index, raw in enumerate(sessions):
            sid = str(raw.get("id") or "").strip() if isinstance(raw, dict) else ""
            try:
                line, n, size = self._import_line(raw, sid, ids)
                total_messages, total_bytes = total_messages + n, total_bytes + size
                if total_bytes > self._IMPORT_MAX_TOTAL_BYTES:
                    raise ValueError("import exceeds the total size limit")
                if total_messages > self._IMPORT_MAX_TOTAL_MESSAGES:
                    raise ValueError("messages exceeds the total import limit")
            except ValueError as exc:
                errors.append({"index": index, "error": str(exc), **(
                    {"session_id": sid} if sid else {})})
                continue
            ids.append(sid)
            lines.append(line)
        if errors:
            return {"ok": False, "imported": 0, "skipped": 0, "detached": 0, "errors": errors}
        with self._reading() as conn:
            stored = {sid for sid in ids if reads.session_row(conn, sid) is not None}
        runtime = self._runtime
        if runtime is None:
            raise StoreError(f"the session store {self.db_path} is closed")
        fresh = [line for sid, line in zip(ids, lines, strict=True) if sid not in stored]
        result = runtime.call(lambda p: p.sessions.import_lines(fresh, timeout_s=WRITE_WAIT_S),
                              WRITE_WAIT_S + 1.0)
        imported = [sid for sid in ids if sid not in stored]
        return {"ok": True, "imported": result.imported, "skipped": len(stored),
                "detached": len(result.detached), "imported_ids": imported,
                "skipped_ids": [sid for sid in ids if sid in stored], "errors": []}

    def _import_line(self, raw: Any, sid: str, seen: Sequence[str]) -> tuple[str, int, int]:
        """One session of Hermes's import payload as our export line, checked as Hermes
        checks it: (the line, its messages, its size).

        Raises:
            ValueError: with Hermes's words for what is wrong.
        """
        if not isinstance(raw, dict):
            raise ValueError("session must be an object")
        if not sid:
            raise ValueError("session id is required")
        if sid in seen:
            raise ValueError("duplicate session id")
        messages = raw.get("messages") or []
        if not isinstance(messages, list):
            raise ValueError("messages must be a list")
        if len(messages) > self._IMPORT_MAX_MESSAGES_PER_SESSION:
            raise ValueError("messages exceeds the per-session import limit")
        if any(not isinstance(m, dict) for m in messages):
            raise ValueError("messages must contain only objects")
        try:
            size = len(json.dumps(raw, ensure_ascii=False, separators=(",", ":")).encode())
        except (TypeError, ValueError):
            raise ValueError("session must be JSON serializable") from None
        if size > self._IMPORT_MAX_SESSION_BYTES:
            raise ValueError("session exceeds the import size limit")
        row = {k: raw.get(k) for k in reads.SESSION_COLUMNS if k in raw}
        config = row.get("model_config")
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except ValueError:
                raise ValueError("model_config must be valid JSON") from None
        if config is not None and not isinstance(config, dict):
            raise ValueError("model_config must be a JSON object")
        for name in ("parent_session_id", *_IMPORT_TEXT_FIELDS):
            if row.get(name) is not None and not isinstance(row[name], str):
                raise ValueError(f"{name} must be a string")
        started = _number_or(row.get("started_at"), time.time())
        converted = [_import_message(sid, i, m, started) for i, m in enumerate(messages)]
        row.update({
            "id": sid, "source": row.get("source") or "import", "started_at": started,
            "model_config": None if config is None else json.dumps(config),
            "message_count": len(converted),
            "tool_call_count": sum(len(m["message"].get("tool_calls") or ())
                                   for m in converted),
            # A channel's live state belongs to the process that ran it, not to history.
            "handoff_state": None, "handoff_platform": None, "handoff_error": None,
            "rewind_count": 0, "archived": 1 if raw.get("archived") else 0,
        })
        for name in ("ended_at", "estimated_cost_usd", "actual_cost_usd"):
            row[name] = _number_or(row.get(name), None)
        for name in ("input_tokens", "output_tokens", "cache_read_tokens",
                     "cache_write_tokens", "reasoning_tokens", "api_call_count"):
            row[name] = int(_number_or(row.get(name), 0))
        row["updated_at"] = row.get("ended_at") or started
        return json.dumps({**row, "messages": converted}), len(converted), size

    def delete_session(self, session_id: str, sessions_dir: Path | None = None) -> bool:
        """Delete the session and its messages (its children stay, without a parent);
        False when there is no such session."""
        if self.get_session(session_id) is None:
            return False
        self._writes().delete_nowait(session_id)
        self._users.pop(session_id, None)
        _remove_session_files(sessions_dir, session_id)
        return True

    def prune_sessions(self, older_than_days: float | None = 90, source: str | None = None,
                       sessions_dir: Path | None = None, **filters: Any) -> int:
        """Delete the ended sessions that started more than ``older_than_days`` ago (of
        ``source``); their children stay, without a parent. Returns how many went."""
        if filters:
            raise TypeError(f"prune filters {sorted(filters)} are not supported")
        self._settle()
        runtime = self._runtime
        if runtime is None:
            raise StoreError(f"the session store {self.db_path} is closed")
        days = 0.0 if older_than_days is None else float(older_than_days)
        result = runtime.call(lambda p: p.sessions.prune(days, source=source, by="started",
                                                         timeout_s=WRITE_WAIT_S),
                              WRITE_WAIT_S + 1.0)
        for sid in result.deleted:
            self._users.pop(sid, None)
            _remove_session_files(sessions_dir, sid)
        return len(result.deleted)

    # -- meta ------------------------------------------------------------------------------

    def vacuum(self) -> int:
        return 0


def _connect(target: str, *, uri: bool = False) -> sqlite3.Connection:
    conn = sqlite3.connect(target, uri=uri, check_same_thread=False, timeout=30.0,
                           isolation_level=None)
    conn.row_factory = sqlite3.Row
    return conn


def _first_id(receipt: Receipt) -> int:
    if receipt.first_id is None:
        raise HermesMemoryError("the store gives message ids as it commits (a producer): "
                                "run the session store in the process that commits")
    return receipt.first_id


def _timestamp(value: Any) -> float | None:
    """An explicit message time as Hermes takes one (a datetime, or a number); None when
    none was given or it cannot be read (Hermes ignores it then, stamping the message now)."""
    if value is None:
        return None
    try:
        stamp = float(value.timestamp()) if hasattr(value, "timestamp") else float(value)
    except (TypeError, ValueError, OverflowError):
        logger.debug("ignoring an invalid explicit message timestamp: %r", value)
        return None
    return stamp if stamp == stamp and stamp not in (float("inf"), float("-inf")) else None


def _hermes_message(m: Mapping[str, Any]) -> dict[str, Any]:
    """A message as ``replace_messages`` stores it: as given, its explicit time read as
    Hermes reads it."""
    message = dict(m)
    if "timestamp" in message:
        stamp = _timestamp(message["timestamp"])
        if stamp is None:
            del message["timestamp"]
        elif isinstance(message["timestamp"], _dt.datetime):
            message["timestamp"] = stamp
    return message


# A session's text fields Hermes's import checks are text.
_IMPORT_TEXT_FIELDS = (
    "source", "user_id", "model", "system_prompt", "end_reason", "cwd", "git_branch",
    "git_repo_root", "billing_provider", "billing_base_url", "billing_mode", "cost_status",
    "cost_source", "pricing_version", "title")
# A message's fields Hermes keeps as text, and those it keeps as JSON text.
_MESSAGE_TEXT_FIELDS = ("tool_call_id", "tool_name", "effect_disposition", "finish_reason",
                        "reasoning", "reasoning_content", "platform_message_id", "api_content")
_MESSAGE_JSON_FIELDS = ("reasoning_details", "codex_reasoning_items", "codex_message_items")


def _import_message(sid: str, index: int, m: Mapping[str, Any], started: float
                    ) -> dict[str, Any]:
    """A message of Hermes's export (a ``get_messages`` row) as our export line holds it:
    the message as Hermes was given it, with its time and place.

    Raises:
        ValueError: with Hermes's words for what is wrong.
    """
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"messages[{index}].role must be a non-empty string")
    message: dict[str, Any] = {"role": role, "content": m.get("content")}
    for name in _MESSAGE_TEXT_FIELDS:
        value = m.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a string")
            message[name] = value
    if m.get("message_id") is not None and "platform_message_id" not in message:
        message["platform_message_id"] = m["message_id"]
    for name in _MESSAGE_JSON_FIELDS:
        value = m.get(name)
        if isinstance(value, str):
            value = _json_or(value, value)
        if value:
            message[name] = value
    if m.get("tool_calls"):
        message["tool_calls"] = m["tool_calls"]
    if m.get("observed"):
        message["observed"] = True
    tokens = m.get("token_count")
    if tokens is not None:
        try:
            message["token_count"] = int(tokens)
        except (TypeError, ValueError):
            raise ValueError("token_count must be an integer") from None
    stamp = _timestamp(m.get("timestamp"))
    if stamp is not None:
        message["timestamp"] = stamp
    mid = m.get("id")
    return {"id": mid if type(mid) is int and mid > 0 else index + 1,
            "turn_key": f"{sid}#{index}", "role": role,
            "timestamp": stamp if stamp is not None else started,
            "active": 0 if m.get("active") == 0 else 1, "message": message}


def _number_or(value: Any, default: Any) -> Any:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return default
    return number if number == number and abs(number) != float("inf") else default


def _preview(content: Any) -> str:
    if isinstance(content, list):
        text = " ".join(p.get("text", "") for p in content
                        if isinstance(p, dict) and p.get("type") == "text").strip()
        return text or "[multimodal content]"
    return content if isinstance(content, str) else ""


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x3000 <= cp <= 0x303F or 0x3040 <= cp <= 0x309F or 0x30A0 <= cp <= 0x30FF
            or 0xAC00 <= cp <= 0xD7AF)


def _is_branch(session: Mapping[str, Any]) -> bool:
    raw = session.get("model_config")
    if not raw:
        return False
    try:
        config = json.loads(raw) if isinstance(raw, str) else raw
    except ValueError:
        return False
    return isinstance(config, dict) and config.get("_branched_from") is not None


def _conversation(rows: Sequence[sqlite3.Row], *, session_id: str, include_ancestors: bool,
                  repair_alternation: bool) -> list[dict[str, Any]]:
    """Message rows as Hermes replays them: OpenAI messages, recalled memory context
    stripped from user and assistant text, an assistant's reasoning and finish reason
    restored, a replayed user prompt shown once across a lineage, background-review harness
    turns dropped, and (``repair_alternation``) Hermes's own repair of the sequence."""
    sanitize_context = _hermes_helper("agent.memory_manager", "sanitize_context")
    messages: list[dict[str, Any]] = []
    for row in rows:
        content = reads.given_content(row)
        if row["role"] in ("user", "assistant") and isinstance(content, str):
            content = sanitize_context(content).strip()
        msg: dict[str, Any] = {"role": row["role"], "content": content}
        if row["api_content"]:
            msg["api_content"] = row["api_content"]
        if row["timestamp"]:
            msg["timestamp"] = row["timestamp"]
        if row["tool_call_id"]:
            msg["tool_call_id"] = row["tool_call_id"]
        if row["tool_name"]:
            msg["tool_name"] = row["tool_name"]
        if row["effect_disposition"]:
            msg["effect_disposition"] = row["effect_disposition"]
        if row["tool_calls"]:
            msg["tool_calls"] = _json_or(row["tool_calls"], [])
        if row["platform_message_id"]:
            msg["message_id"] = row["platform_message_id"]
        if row["observed"]:
            msg["observed"] = True
        if row["role"] == "assistant":
            if row["finish_reason"]:
                msg["finish_reason"] = row["finish_reason"]
            if row["reasoning"]:
                msg["reasoning"] = row["reasoning"]
            if row["reasoning_content"] is not None:
                msg["reasoning_content"] = row["reasoning_content"]
            for key in ("reasoning_details", "codex_reasoning_items", "codex_message_items"):
                if row[key]:
                    msg[key] = _json_or(row[key], None)
        if include_ancestors and _replayed_user_prompt(messages, msg):
            continue
        messages.append(msg)
    messages = _without_review_harness(messages)
    if repair_alternation and messages:
        repair = _hermes_helper("agent.agent_runtime_helpers", "repair_message_sequence")
        repaired = repair(None, messages)
        if repaired:
            logger.info("repaired %d message-alternation violation(s) restoring session %s",
                        repaired, session_id)
    return messages


def _json_or(text: str, default: Any) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return default


def _replayed_user_prompt(messages: Sequence[Mapping[str, Any]],
                          msg: Mapping[str, Any]) -> bool:
    """A user prompt equal to the last one before any assistant reply (a resumed session
    replays its prompt into the next segment)."""
    content = msg.get("content")
    if msg.get("role") != "user" or not isinstance(content, str) or not content:
        return False
    for prev in reversed(messages):
        if prev.get("role") == "user" and prev.get("content") == content:
            return True
        if prev.get("role") == "assistant" and (prev.get("content") or prev.get("tool_calls")):
            return False
    return False


def _without_review_harness(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop the background-review harness prompts an older Hermes wrote into real sessions,
    with the curator reply right after each."""
    out: list[dict[str, Any]] = []
    skip_reply = False
    for msg in messages:
        content = msg.get("content")
        if (msg.get("role") in ("user", "system") and isinstance(content, str)
                and content.lstrip().startswith(_REVIEW_HARNESS_PREFIXES)):
            skip_reply = True
            continue
        if skip_reply:
            skip_reply = False
            if msg.get("role") == "assistant":
                continue
        out.append(msg)
    return out


def _hermes_helper(module: str, name: str) -> Any:
    """A helper of the installed hermes-agent (the client this module stands in for)."""
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except ImportError as exc:
        raise HermesMemoryError(f"Hermes's session store needs hermes-agent installed ({exc})"
                                ) from exc


def _remove_session_files(sessions_dir: Path | None, session_id: str) -> None:
    """The session's transcript files Hermes keeps beside its store, when it names the
    folder."""
    if sessions_dir is None:
        return
    folder = Path(sessions_dir)
    for path in (folder / f"{session_id}.json", folder / f"{session_id}.jsonl",
                 *folder.glob(f"request_dump_{session_id}*")):
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            logger.debug("could not remove %s: %s", path, exc)


__all__ = ["DEFAULT_DB_PATH", "MAX_FTS5_QUERY_CHARS", "SCHEMA_SQL", "SCHEMA_VERSION",
           "SessionDB", "format_session_db_unavailable", "get_last_init_error"]
