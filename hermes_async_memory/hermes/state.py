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

What differs from Hermes's own, by design (docs/hermes.md, "Hermes's session store"):

- The file is a store of ours: the same sessions and messages (with Hermes's column names,
  so ``_conn`` reads as Hermes's code expects) and our memory beside them. Hermes's own
  ``state.db`` is refused, untouched; ``hermes-memory hermes import-state`` brings its
  sessions over (``migrate``).
- Messages keep every key they were given (``message_rows.message_row``); a lone surrogate in their
  text (content, tool name, reasoning, api_content) is stored as U+FFFD, as Hermes does.
- A message's tool name and tool calls are searched in an index of their own beside the
  text's (Hermes indexes the three as one text): a query matches within either.
- Writes that decide something (a compression lock) wait for their record to commit and
  read the outcome; bulk deletes (prune, empty sessions) pick their sessions, then each
  delete checks at commit that nothing changed the session since.
- Titles are unique where they are set (``set_session_title``), with no unique index a
  commit could fail on. No foreign keys: a delete handles its session's messages and
  children itself. The full-text indexes merge as FTS5's automerge does; no write path
  runs ``optimize_fts`` on a cadence.
- On a SQLite without FTS5 the store keeps no full-text index (``store.text_index``):
  ``_fts_enabled`` is False and a search finds nothing, as Hermes's does.
- One process commits a store; several processes share one through ``hermes-memory worker``.
- Not here: Hermes's Telegram topic bindings, gateway routing index and handoff state
  machine, its WAL helper (``apply_wal_with_fallback``) and its private write hook
  (``_execute_write``).
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

from ..errors import ConfigurationError, HermesMemoryError, StoreError
from ..message_rows import sanitize
from ..settings import Settings
from ..store import hermes_reads as reads
from ..store.connections import check_store_file
from ..store.session_filters import SessionFilter
from ..turns import Receipt
from . import runtime as runtimes
from .config import DEFAULT_DB, default_hermes_home
from .conversation import conversation
from .import_lines import explicit_timestamp, hermes_session_line

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
        # Whether the store keeps its full-text indexes (False: a SQLite without FTS5, whose
        # searches find nothing here, as Hermes's do; the store's text_index says more).
        self._fts_enabled = True
        self._trigram_available = False
        try:
            check_store_file(self.db_path)
            if read_only:
                self._raw = _connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=30.0)
                self._fts_enabled = reads.table_exists(self._raw, "messages_fts_delete")
                return
            self.db_path.parent.mkdir(parents=True, exist_ok=True)
            settings = Settings.from_env(db_path=self.db_path)
            if settings.role == "producer":
                # A producer's writes are committed by a worker, later: its ids are not known
                # at acknowledgement, and its reads could not see its own writes.
                raise ConfigurationError(
                    "Hermes's session store runs in the process that commits the store "
                    "(role embedded or worker), not as a producer")
            self._runtime = runtimes.acquire(settings, contextvars.copy_context())
            if self._runtime.pipeline is not None:
                self._fts_enabled = self._runtime.pipeline.store.full_text
            # Its reads wait for a lock as Hermes's do (a checkpoint, another process's write).
            self._raw = _connect(str(self.db_path), timeout=30.0)
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
        """Set the title (``only_if_empty``: only while the session has none, checked again
        at commit). A title held by a session this one continues by compression (hidden
        behind it in the lists) moves to this one; held by any other session, it is
        refused."""
        cleaned = self.sanitize_title(title)
        with self._reading() as conn:
            row = reads.session_row(conn, session_id)
            holder = reads.title_holder(conn, cleaned, session_id) if cleaned else None
            moves = holder is not None and reads.compression_ancestor(conn, holder, session_id)
        if row is None or (only_if_empty and row["title"] is not None):
            return False
        if holder is not None and not moves:
            raise ValueError(f"Title '{cleaned}' is already in use by session {holder}")
        writes = self._writes()
        if holder is not None:
            writes.update_nowait(holder, fields={"title": None})
        if only_if_empty:
            if cleaned is not None:
                writes.update_nowait(session_id, fill={"title": cleaned})
        else:
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
        """How many sessions; with ``exclude_children``, how many ``list_sessions_rich``
        lists (roots and branches, no subagent's run, no compression continuation)."""
        where, params = reads.listing_where(
            source=source, exclude_sources=exclude_sources, cwd=cwd_prefix,
            min_message_count=min_message_count, include_archived=include_archived,
            archived_only=archived_only, listable_only=exclude_children)
        with self._reading() as conn:
            return reads.count_sessions(conn, where, params)

    def message_count(self, session_id: str | None = None) -> int:
        with self._reading() as conn:
            return reads.count_messages(conn, session_id)

    # -- listings ------------------------------------------------------------------------

    def list_sessions_rich(
        self, source: str | None = None, exclude_sources: Sequence[str] | None = None,
        cwd_prefix: str | None = None, limit: int = 20, offset: int = 0,
        include_children: bool = False, min_message_count: int = 0,
        project_compression_tips: bool = True, order_by_last_active: bool = False,
        include_archived: bool = False, archived_only: bool = False,
        id_query: str | None = None, search_query: str | None = None,
        compact_rows: bool = False,
    ) -> list[dict[str, Any]]:
        """Sessions as Hermes's pickers list them, newest first (or, with
        ``order_by_last_active``, by the latest activity in each one's compression chain):
        every column (``compact_rows``: but the system prompt), ``preview`` (the first user
        message, 60 characters) and ``last_active``. Roots and branches only, unless
        ``include_children``; a compressed conversation shows as its live tip in its root's
        place (``_lineage_root_id``), unless ``project_compression_tips`` is False.
        ``id_query`` / ``search_query`` (with ``order_by_last_active``): only conversations
        with an id (or a title) holding that text anywhere in their chain."""
        where, params = reads.listing_where(
            source=source, exclude_sources=exclude_sources, cwd=cwd_prefix,
            min_message_count=min_message_count, include_archived=include_archived,
            archived_only=archived_only, listable_only=not include_children)
        with self._reading() as conn:
            rows = reads.rich_sessions(
                conn, where=where, params=params, limit=limit, offset=offset,
                compact=compact_rows, order_by_last_active=order_by_last_active,
                id_needle=(id_query or "").strip().lower(),
                search_needle=(search_query or "").strip().lower())
            if project_compression_tips and not include_children:
                rows = [_projected(conn, row, compact_rows) for row in rows]
        return rows

    def _get_session_rich_row(self, session_id: str, compact_rows: bool = False
                              ) -> dict[str, Any] | None:
        """One session as ``list_sessions_rich`` gives it (not projected); None."""
        with self._reading() as conn:
            return reads.rich_session(conn, session_id, compact=compact_rows)

    def get_compression_tip(self, session_id: str) -> str | None:
        """The live end of the session's compression chain (itself when it has none)."""
        with self._reading() as conn:
            return reads.compression_tip(conn, session_id)

    def list_cron_job_runs(self, job_id: str, limit: int = 20, offset: int = 0
                           ) -> list[dict[str, Any]]:
        """The run sessions of one cron job (``cron_<job_id>_...``), newest first, with
        ``preview`` and ``last_active``."""
        with self._reading() as conn:
            return reads.cron_runs(conn, job_id, limit, offset)

    def search_sessions(self, source: str | None = None, limit: int = 20, offset: int = 0
                        ) -> list[dict[str, Any]]:
        """Sessions (of ``source``), the most recently active first, with ``last_active``."""
        with self._reading() as conn:
            return reads.last_active_sessions(conn, source, limit, offset)

    def search_sessions_by_id(self, query: str, limit: int = 20,
                              include_archived: bool = True) -> list[dict[str, Any]]:
        """Listed conversations whose id (or a compressed root's id) holds ``query``, case
        aside: an exact id first, then those it begins, then the others, each by activity."""
        needle = (query or "").strip().lower()
        if not needle or limit <= 0:
            return []
        found = self.list_sessions_rich(limit=limit * 4, include_archived=include_archived,
                                        order_by_last_active=True, id_query=needle)

        def rank(row: Mapping[str, Any]) -> int:
            ids = [str(v).lower() for v in (row.get("id"), row.get("_lineage_root_id")) if v]
            if needle in ids:
                return 0
            return 1 if any(i.startswith(needle) for i in ids) else 2

        return [row for _, row in sorted(enumerate(found), key=lambda e: (rank(e[1]), e[0]))
                ][:limit]

    def resolve_session_by_title(self, title: str) -> str | None:
        """The session a title names: the latest started of its numbered continuations
        (``title #N``) when there are any, else the session with exactly that title."""
        with self._reading() as conn:
            numbered = reads.numbered_titles(conn, title)
            if numbered:
                return numbered[0][0]
            holder = reads.title_holder(conn, title, "")
        return holder

    def get_next_title_in_lineage(self, base_title: str) -> str:
        """The next title of a lineage: ``base`` while no session has it, else ``base #N``
        one above the highest number in use (the unnumbered title counts as #1); a
        number on ``base_title`` is left off first."""
        match = re.match(r"^(.*?) #(\d+)$", base_title)
        base = match.group(1) if match else base_title
        with self._reading() as conn:
            titles = reads.lineage_titles(conn, base)
        if not titles:
            return base
        highest = 1
        for used in titles:
            numbered = re.match(r"^.* #(\d+)$", used)
            if numbered:
                highest = max(highest, int(numbered.group(1)))
        return f"{base} #{highest + 1}"

    # -- archive, bulk delete, prune -------------------------------------------------------

    def set_session_archived(self, session_id: str, archived: bool) -> bool:
        """Archive (hide from the default lists, keeping everything) or unarchive the
        session with its whole compression lineage; False when there is no such session."""
        with self._reading() as conn:
            lineage = reads.compression_lineage_ids(conn, session_id)
        writes = self._writes()
        for sid in lineage:
            writes.update_nowait(sid, fields={"archived": 1 if archived else 0})
        return bool(lineage)

    def list_prune_candidates(self, older_than_days: float | None = None,
                              source: str | None = None, **filters: Any
                              ) -> list[dict[str, Any]]:
        """The sessions ``prune_sessions`` (or ``archive_sessions``) with these filters
        would take, oldest first; nothing changes.

        Raises:
            TypeError: an unknown filter, or a value of the wrong type.
        """
        where = _prune_filter(older_than_days, source, filters)
        with self._reading() as conn:
            return reads.prune_candidates(conn, where)

    def archive_sessions(self, older_than_days: float | None = None,
                         source: str | None = None, **filters: Any) -> int:
        """Archive every session the filters pick (not yet archived ones, unless
        ``archived`` says otherwise), each with its compression lineage; returns how many
        were picked."""
        filters.setdefault("archived", False)
        picked = self.list_prune_candidates(older_than_days, source, **filters)
        for row in picked:
            self.set_session_archived(row["id"], True)
        return len(picked)

    def delete_sessions(self, session_ids: Sequence[str], sessions_dir: Path | None = None
                        ) -> int:
        """Delete the listed sessions that exist (anything but a non-empty string is left
        out; each id once), each as ``delete_session`` does; returns how many existed."""
        ids = reads.unique(session_ids or ())
        if not ids:
            return 0
        with self._reading() as conn:
            existing = reads.existing_sessions(conn, ids)
            delegates = reads.delegate_children(conn, existing)
        self._delete(delegates + existing, sessions_dir)
        return len(existing)

    def count_empty_sessions(self) -> int:
        """How many sessions ``delete_empty_sessions`` would delete: ended, not archived,
        without messages."""
        with self._reading() as conn:
            return reads.count_picked(conn, _EMPTY)

    def delete_empty_sessions(self, sessions_dir: Path | None = None) -> int:
        """Delete the ended, unarchived sessions without messages (their children stay,
        without a parent); each delete checks when it commits that nothing changed the
        session since. Returns how many went."""
        return self._prune(_EMPTY, sessions_dir)

    def _prune(self, where: SessionFilter, sessions_dir: Path | None) -> int:
        self._settle()
        runtime = self._runtime
        if runtime is None:
            raise StoreError(f"the session store {self.db_path} is closed")
        result = runtime.call(lambda p: p.sessions.prune(None, where=where,
                                                         timeout_s=WRITE_WAIT_S),
                              WRITE_WAIT_S + 1.0)
        for sid in result.deleted:
            self._users.pop(sid, None)
            _remove_session_files(sessions_dir, sid)
        return len(result.deleted)

    def _delete(self, session_ids: Sequence[str], sessions_dir: Path | None) -> None:
        writes = self._writes()
        for sid in session_ids:
            writes.delete_nowait(sid)
            self._users.pop(sid, None)
            _remove_session_files(sessions_dir, sid)

    # -- Hermes's own state, maintenance ---------------------------------------------------

    def get_meta(self, key: str) -> str | None:
        """A value of Hermes's key-value state (``state_meta``); None when unset."""
        with self._reading() as conn:
            return reads.meta_value(conn, key)

    def set_meta(self, key: str, value: str) -> None:
        """Set a value of Hermes's key-value state (durable when this returns)."""
        self._writes().set_meta_nowait(key, value if value is None or isinstance(value, str)
                                       else str(value))

    def optimize_fts(self) -> int:
        """Merge the messages' full-text indexes into one segment each (layout only: what a
        search finds is unchanged). Returns how many of Hermes's two indexes that merged:
        the word index (which ours keeps as its text and its tool text, merged together)
        and, when this SQLite has it, the trigram index."""
        merged = self._maintain(lambda p: p.store.optimize_text_indexes())
        return len({"messages_fts" if name == "messages_tools" else name for name in merged})

    def vacuum(self) -> int:
        """Merge the full-text indexes (``optimize_fts``), then rewrite the store file to
        give back the space deletes left (VACUUM; commits wait meanwhile, and go on after).
        Returns ``optimize_fts``'s count."""
        merged = 0
        try:
            merged = self.optimize_fts()
        except (HermesMemoryError, sqlite3.Error) as exc:
            logger.warning("merging the full-text indexes before VACUUM failed: %s", exc)
        self._maintain(lambda p: p.store.vacuum())
        return merged

    def _maintain(self, job: Any) -> Any:
        """Run a maintenance job of the store (on its own connection) once every write
        accepted so far is committed."""
        self._settle()
        runtime = self._runtime
        if runtime is None:
            raise StoreError(f"the session store {self.db_path} is "
                             f"{'read-only' if self.read_only else 'closed'}")
        return runtime.call(job, WRITE_WAIT_S)

    def maybe_auto_prune_and_vacuum(self, retention_days: int = 90,
                                    min_interval_hours: int = 24, vacuum: bool = True,
                                    sessions_dir: Path | None = None) -> dict[str, Any]:
        """Hermes's start-up upkeep, at most once per ``min_interval_hours`` (the last run's
        time is kept in ``state_meta``): prune the ended sessions that started more than
        ``retention_days`` ago, and VACUUM when some went (``vacuum``). Never raises:
        ``{"skipped", "pruned", "vacuumed"}``, with ``"error"`` when something failed."""
        result: dict[str, Any] = {"skipped": False, "pruned": 0, "vacuumed": False}
        try:
            now = time.time()
            last = self.get_meta("last_auto_prune")
            try:
                if last and now - float(last) < min_interval_hours * 3600:
                    result["skipped"] = True
                    return result
            except ValueError:
                pass  # an unreadable mark: as if it never ran
            result["pruned"] = self.prune_sessions(older_than_days=retention_days,
                                                   sessions_dir=sessions_dir)
            if vacuum and result["pruned"] > 0:
                try:
                    self.vacuum()
                    result["vacuumed"] = True
                except (HermesMemoryError, sqlite3.Error) as exc:
                    logger.warning("VACUUM of %s failed: %s", self.db_path, exc)
            self.set_meta("last_auto_prune", str(now))
            if result["pruned"]:
                logger.info("session store upkeep: pruned %d session(s) older than %d days%s",
                            result["pruned"], retention_days,
                            " and vacuumed" if result["vacuumed"] else "")
        except Exception as exc:  # upkeep never stops a start-up
            logger.warning("session store upkeep failed: %s", exc)
            result["error"] = str(exc)
        return result

    @staticmethod
    def _parse_schema_columns(schema_sql: str) -> dict[str, dict[str, str]]:
        """The columns each ``CREATE TABLE`` of ``schema_sql`` declares: {table: {column:
        its declaration}} (table constraints left out)."""
        tables: dict[str, dict[str, str]] = {}
        for match in re.finditer(r"CREATE\s+TABLE\s+(?:IF\s+NOT\s+EXISTS\s+)?[\"`]?(\w+)[\"`]?"
                                 r"\s*\((.*?)\)\s*;", schema_sql, re.IGNORECASE | re.DOTALL):
            columns: dict[str, str] = {}
            for part in _top_level_parts(match.group(2)):
                words = part.split(None, 1)
                if not words or words[0].upper() in _TABLE_CONSTRAINTS:
                    continue
                columns[words[0].strip('"`')] = words[1] if len(words) > 1 else ""
            tables[match.group(1)] = columns
        return tables

    # -- gateway bookkeeping ---------------------------------------------------------------

    def record_gateway_session_peer(
        self, session_id: str, *, source: str, user_id: str | None = None,
        session_key: str | None = None, chat_id: str | None = None,
        chat_type: str | None = None, thread_id: str | None = None,
        display_name: str | None = None, origin_json: str | None = None,
    ) -> None:
        """Keep the gateway's routing peer on the session's row: its routing key, source,
        chat, chat type and thread; its display name and origin (JSON) when given (None
        leaves what is stored). The user fills the row's when it has none: ours is the
        scope its messages were stored under, which a later peer does not move."""
        if not session_id or not session_key:
            return
        fields: dict[str, Any] = {"session_key": session_key, "source": source,
                                  "chat_id": chat_id, "chat_type": chat_type,
                                  "thread_id": thread_id}
        if display_name is not None:
            fields["display_name"] = display_name
        if origin_json is not None:
            fields["origin_json"] = origin_json
        self._writes().update_nowait(session_id, user_id=user_id, fields=fields)

    def set_expiry_finalized(self, session_id: str, finalized: bool = True) -> None:
        """Mark (or unmark) the gateway session's expiry as finalized."""
        if session_id:
            self._set(session_id, expiry_finalized=1 if finalized else 0)

    def list_gateway_sessions(self, *, platform: str | None = None, active_only: bool = True
                              ) -> list[dict[str, Any]]:
        """The gateway's sessions (those with a routing key): the latest started one per
        key, with ``last_active``, the most recently active first; of ``platform`` (its
        source, case aside), not ended ones only with ``active_only``."""
        with self._reading() as conn:
            return reads.gateway_sessions(conn, platform, active_only)

    def find_session_by_origin(self, *, platform: str, chat_id: str,
                               thread_id: str | None = None, user_id: str | None = None
                               ) -> str | None:
        """The latest live gateway session of a chat (and thread): the one of ``user_id``
        when there is one; else the only one, or the latest when they all have one user;
        None when several users share the chat (never another participant's session)."""
        if not platform or chat_id in (None, ""):
            return None
        with self._reading() as conn:
            rows = reads.origin_sessions(conn, platform, str(chat_id),
                                         None if thread_id is None else str(thread_id))
        if not rows:
            return None
        if user_id:
            mine = [r for r in rows if str(r.get("user_id") or "") == str(user_id)]
            if mine:
                return str(mine[0]["id"])
            if len(rows) > 1:
                return None
        elif len({str(r.get("user_id") or "").strip() for r in rows} - {""}) > 1:
            return None
        return str(rows[0]["id"])

    def find_latest_gateway_session_for_peer(
        self, *, source: str, user_id: str | None = None, session_key: str | None = None,
        chat_id: str | None = None, chat_type: str | None = None,
        thread_id: str | None = None,
    ) -> dict[str, Any] | None:
        """The latest gateway session of a routing key its peer may resume: live, or ended
        only by a cleanup Hermes counts as a mistake (agent_close, ws_orphan_reap), with
        messages; failing that, with the whole peer given, the same for that peer."""
        if not session_key:
            return None
        with self._reading() as conn:
            return reads.peer_session(conn, source=source, session_key=session_key,
                                      user_id=user_id, chat_id=chat_id, chat_type=chat_type,
                                      thread_id=thread_id)

    # -- compression bookkeeping -------------------------------------------------------------

    def record_compression_failure_cooldown(self, session_id: str, cooldown_until: float,
                                            error: str | None = None) -> None:
        """Keep the session's compression cooldown (until when, and why)."""
        if session_id:
            self._set(session_id, compression_failure_cooldown_until=float(cooldown_until),
                      compression_failure_error=error)

    def get_compression_failure_cooldown(self, session_id: str) -> dict[str, Any] | None:
        """The session's compression cooldown while it lasts: ``cooldown_until``,
        ``remaining_seconds`` and ``error``; None when there is none (or it is over)."""
        if not session_id:
            return None
        now = time.time()
        row = self.get_session(session_id)
        until = None if row is None else row["compression_failure_cooldown_until"]
        if until is None or float(until) <= now:
            return None
        return {"cooldown_until": float(until), "remaining_seconds": float(until) - now,
                "error": row["compression_failure_error"] if row else None}

    def clear_compression_failure_cooldown(self, session_id: str) -> None:
        if session_id:
            self._set(session_id, compression_failure_cooldown_until=None,
                      compression_failure_error=None)

    def get_compression_fallback_streak(self, session_id: str) -> int:
        """How many compressions in a row fell back to the deterministic summary."""
        row = self.get_session(session_id) if session_id else None
        try:
            return max(0, int((row or {}).get("compression_fallback_streak") or 0))
        except (TypeError, ValueError):
            return 0

    def set_compression_fallback_streak(self, session_id: str, streak: int) -> None:
        if session_id:
            self._set(session_id, compression_fallback_streak=max(0, int(streak)))

    def try_acquire_compression_lock(self, session_id: str, holder: str,
                                     ttl_seconds: float = 300.0) -> bool:
        """Take the session's compression lock for ``holder`` until ``ttl_seconds`` from now
        (a lease that ended is taken over): True when ``holder`` has it, once its record
        committed; False when another holder has it, or the lock could not be decided."""
        return self._lock_call(session_id, holder, "acquire", ttl_seconds)

    def refresh_compression_lock(self, session_id: str, holder: str,
                                 ttl_seconds: float = 300.0) -> bool:
        """Extend ``holder``'s lease to ``ttl_seconds`` from now, if it still holds it."""
        return self._lock_call(session_id, holder, "refresh", ttl_seconds)

    def release_compression_lock(self, session_id: str, holder: str) -> None:
        """Give the lock up, if ``holder`` still has it (durable when this returns)."""
        if session_id and holder:
            try:
                self._writes().compression_lock_nowait(session_id, holder, "release")
            except HermesMemoryError as exc:
                logger.warning("releasing the compression lock of %s failed: %s",
                               session_id, exc)

    def get_compression_lock_holder(self, session_id: str) -> str | None:
        """Who holds the session's compression lock now (a lease not ended); None."""
        if not session_id:
            return None
        with self._reading() as conn:
            held = reads.compression_lock(conn, session_id)
        return held[0] if held is not None and held[1] >= time.time() else None

    def _lock_call(self, session_id: str, holder: str, mode: str, ttl_s: float) -> bool:
        if not session_id or not holder:
            return False
        runtime = self._runtime
        now = time.time()
        try:
            if runtime is None:
                raise StoreError(f"the session store {self.db_path} is closed")
            return bool(runtime.call(lambda p: p.sessions.compression_lock(
                session_id, holder, mode, ttl_s=float(ttl_s), now=now,
                timeout_s=READ_WAIT_S), READ_WAIT_S + 1.0))
        except (HermesMemoryError, TimeoutError) as exc:
            logger.warning("the compression lock of %s (%s) failed: %s", session_id, mode, exc)
            return False

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
        """Append a message; returns its id (durable, and given, when this returns). A lone
        surrogate in its text (content, tool name, reasoning, api_content) is stored as
        U+FFFD, as Hermes stores it."""
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
        stamp = explicit_timestamp(timestamp)
        if stamp is not None:
            message["timestamp"] = stamp
        receipt = self._writes().append_nowait(session_id, [_scrubbed(message)],
                                               user_id=self._user(session_id))
        return _first_id(receipt)

    def replace_messages(self, session_id: str, messages: Sequence[Mapping[str, Any]],
                         active_only: bool = False) -> None:
        """Replace the session's messages (only its active ones, ``active_only``), at once
        (lone surrogates in their text as ``append_message`` stores them)."""
        self._writes().replace_messages_nowait(
            session_id, [_scrubbed(_hermes_message(m)) for m in messages],
            user_id=self._user(session_id), active_only=active_only)

    def archive_and_compact(self, session_id: str,
                            compacted_messages: Sequence[Mapping[str, Any]]) -> int:
        """Compact the session in place: its active messages stay on file, set aside as
        compacted (found by ``search_messages``, not loaded as the live conversation), and
        ``compacted_messages`` become its active ones, at once. Returns how many are
        active now."""
        messages = [_scrubbed(_hermes_message(m)) for m in compacted_messages]
        self._writes().replace_messages_nowait(session_id, messages,
                                               user_id=self._user(session_id), compact=True)
        return len(messages)

    def has_archived_messages(self, session_id: str) -> bool:
        """Whether the session has messages set aside (compacted or rewound)."""
        with self._reading() as conn:
            return reads.has_inactive_messages(conn, session_id)

    def set_latest_user_api_content(self, session_id: str, content: Any,
                                    api_content: str) -> int:
        """Put ``api_content`` (what was sent to the model for it) on the session's newest
        active user message, if its content is ``content``; returns how many messages were
        changed (0 or 1). The write checks when it commits that the message is still the
        newest active user message."""
        with self._reading() as conn:
            latest = reads.latest_user_message(conn, session_id)
        if latest is None or latest["content"] != content:
            return 0
        self._writes().set_message_fields_nowait(
            session_id, latest["id"], {"api_content": _scrub(api_content)},
            only_if_latest="user")
        return 1

    def get_messages(self, session_id: str, include_inactive: bool = False,
                     limit: int | None = None, offset: int = 0) -> list[dict[str, Any]]:
        with self._reading() as conn:
            return reads.message_rows(conn, session_id, include_inactive=include_inactive,
                                      limit=limit, offset=offset)

    def rewind_to_message(self, session_id: str, target_message_id: int) -> dict[str, Any]:
        """Set aside (``/rewind``) the session's messages from ``target_message_id`` on, the
        target included (a user message: the caller offers it as the next prompt); they stay
        stored, for ``get_messages(include_inactive=True)`` and ``restore_rewound``. Counts a
        rewind on the session every time. Returns ``rewound_count`` (how many were active),
        ``target_message`` (its row) and ``new_head_id`` (the last message left active).

        Raises:
            ValueError: no such message in the session, or not a user message.
        """
        with self._reading() as conn:
            target = reads.message_row(conn, session_id, target_message_id)
            if target is None:
                raise ValueError(f"message {target_message_id} not found in session "
                                 f"{session_id}")
            if target["role"] != "user":
                raise ValueError(f"rewind target must be a 'user' message (got role="
                                 f"{target['role']!r}, id={target_message_id})")
            rewound = reads.message_ids(conn, session_id, target_message_id, active=True)
            head = reads.last_active_id(conn, session_id, before=target_message_id)
        self._writes().set_active_nowait(session_id, target_message_id, False, rewind=True)
        return {"rewound_count": len(rewound), "target_message": target, "new_head_id": head}

    def restore_rewound(self, session_id: str, since_message_id: int) -> int:
        """Take back the session's messages set aside from ``since_message_id`` on (undo
        of a rewind); returns how many there were."""
        with self._reading() as conn:
            restored = reads.message_ids(conn, session_id, since_message_id, active=False)
        if restored:
            self._writes().set_active_nowait(session_id, since_message_id, True)
        return len(restored)

    def list_recent_user_messages(self, session_id: str, limit: int = 20,
                                  include_inactive: bool = False) -> list[dict[str, Any]]:
        """The session's latest user messages, newest first (the ``/rewind`` picker): id,
        timestamp and a preview (80 characters, whitespace collapsed)."""
        with self._reading() as conn:
            rows = reads.recent_user_messages(conn, session_id, limit, include_inactive)
        out = []
        for row in rows:
            preview = " ".join(_preview(row["content"]).split())
            out.append({"id": row["id"], "timestamp": row["timestamp"],
                        "preview": preview[:77] + "..." if len(preview) > 80 else preview})
        return out

    def get_messages_as_conversation(self, session_id: str, include_ancestors: bool = False,
                                     include_inactive: bool = False,
                                     repair_alternation: bool = False) -> list[dict[str, Any]]:
        with self._reading() as conn:
            ids = (reads.lineage_root_to_tip(conn, session_id) if include_ancestors
                   else [session_id])
            rows = reads.conversation_rows(conn, ids, include_inactive=include_inactive)
        return conversation(rows, session_id=session_id, include_ancestors=include_ancestors,
                             repair_alternation=repair_alternation)

    def get_resume_conversations(self, session_id: str
                                 ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(the tip's conversation, alternation repaired; the whole lineage's, as shown)."""
        with self._reading() as conn:
            rows = reads.conversation_rows(conn, reads.lineage_root_to_tip(conn, session_id))
        tip = [r for r in rows if r["session_id"] == session_id]
        return (conversation(tip, session_id=session_id, include_ancestors=False,
                              repair_alternation=True),
                conversation(rows, session_id=session_id, include_ancestors=True,
                              repair_alternation=False))

    def get_ancestor_display_prefix(self, session_id: str) -> list[dict[str, Any]]:
        """The ancestors' messages as the resumed conversation shows them (not the tip's)."""
        with self._reading() as conn:
            ids = reads.lineage_root_to_tip(conn, session_id)
            if len(ids) <= 1:
                return []
            rows = reads.conversation_rows(conn, ids)
        ancestors = [r for r in rows if r["session_id"] != session_id]
        return conversation(ancestors, session_id=session_id, include_ancestors=True,
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
        """Messages matching ``query`` (Hermes's search dialect) in their text or in what
        they say of tools (a tool name, the calls' names and arguments), each with its
        session's source and model, a snippet (``>>>`` match ``<<<``) and its neighbours in
        its session (``context``). A word of the query found in the text and another only
        in the tool text do not make a match together (two indexes, each asked whole)."""
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
        by_time = sort.strip().lower() if isinstance(sort, str) else None
        with self._reading() as conn:
            if self._contains_cjk(match):
                raw = match.strip('"').strip()
                tokens = [t for t in raw.split() if t.upper() not in _BOOLEAN_WORDS] or [raw]
                matches = reads.like_search(conn, tokens, where=where, params=params,
                                            limit=limit, offset=offset)
            elif not self._fts_enabled:
                return []
            else:
                try:
                    matches = reads.search(conn, match, where=where, params=params,
                                           sort=by_time, limit=limit, offset=offset)
                except sqlite3.OperationalError:
                    return []
            for found in matches:
                found["context"] = [
                    {"role": r["role"], "content": _preview(reads.given_content(r))[:200]}
                    for r in reads.context(conn, found["id"])]
        for found in matches:
            found.pop("content", None)
            found.pop("score", None)
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
        checks it, within Hermes's bounds (``hermes_session_line``)."""
        return hermes_session_line(raw, sid, seen,
                                   max_messages=self._IMPORT_MAX_MESSAGES_PER_SESSION,
                                   max_bytes=self._IMPORT_MAX_SESSION_BYTES)

    def delete_session(self, session_id: str, sessions_dir: Path | None = None) -> bool:
        """Delete the session and its messages, with the subagent runs it spawned
        (``_delegate_from``); its other children (branches, continuations) stay, without a
        parent. False when there is no such session."""
        with self._reading() as conn:
            if reads.session_row(conn, session_id) is None:
                return False
            delegates = reads.delegate_children(conn, [session_id])
        self._delete([*delegates, session_id], sessions_dir)
        return True

    def prune_sessions(self, older_than_days: float | None = 90, source: str | None = None,
                       sessions_dir: Path | None = None, **filters: Any) -> int:
        """Delete the ended sessions that started more than ``older_than_days`` ago (None:
        any time) and match the filters (``list_prune_candidates``); their children stay,
        without a parent. Each delete checks when it commits that the session is still
        ended and nothing changed it since it was picked. Returns how many went.

        Raises:
            TypeError: an unknown filter, or a value of the wrong type.
        """
        return self._prune(_prune_filter(older_than_days, source, filters), sessions_dir)


# What delete_empty_sessions takes: ended, unarchived sessions without messages.
_EMPTY = SessionFilter(max_messages=0, archived=False)
# What begins a table constraint in a CREATE TABLE, not a column.
_TABLE_CONSTRAINTS = frozenset({"PRIMARY", "UNIQUE", "FOREIGN", "CHECK", "CONSTRAINT"})
# What a listed compression root takes from its live tip.
_FROM_TIP = ("id", "ended_at", "end_reason", "message_count", "tool_call_count", "title",
             "last_active", "preview", "model", "system_prompt", "cwd", "git_branch",
             "git_repo_root")


def _projected(conn: sqlite3.Connection, row: dict[str, Any], compact: bool
               ) -> dict[str, Any]:
    """A listed session as its compression chain's live tip, in its place: the tip's
    identity and activity, the root's start (``_lineage_root_id`` names the root)."""
    if row.get("end_reason") != "compression":
        return row
    tip_id = reads.compression_tip(conn, row["id"])
    tip = None if tip_id == row["id"] else reads.rich_session(conn, tip_id, compact=compact)
    if tip is None:
        return row
    merged = {**row, **{k: tip[k] for k in _FROM_TIP if k in tip}}
    merged["_lineage_root_id"] = row["id"]
    return merged


def _prune_filter(older_than_days: float | None, source: str | None,
                  filters: dict[str, Any]) -> SessionFilter:
    """Hermes's prune arguments as a ``SessionFilter`` (``older_than_days`` is a
    ``started_before`` unless one is given).

    Raises:
        TypeError: an unknown filter, or a value of the wrong type.
    """
    if filters.get("started_before") is None and older_than_days is not None:
        filters["started_before"] = time.time() - float(older_than_days) * 86_400
    return SessionFilter.of(source=source, **filters)


def _top_level_parts(body: str) -> list[str]:
    """``body`` cut at the commas outside parentheses, each part stripped (SQL comments
    left out)."""
    body = re.sub(r"--[^\n]*", "", body)
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in body:
        if ch == "," and depth == 0:
            parts.append("".join(current).strip())
            current = []
            continue
        depth += (ch == "(") - (ch == ")")
        current.append(ch)
    parts.append("".join(current).strip())
    return [p for p in parts if p]


def _connect(target: str, *, timeout: float, uri: bool = False) -> sqlite3.Connection:
    conn = sqlite3.connect(target, uri=uri, check_same_thread=False, timeout=timeout,
                           isolation_level=None)
    conn.row_factory = sqlite3.Row
    return conn


def _first_id(receipt: Receipt) -> int:
    if receipt.first_id is None:
        raise HermesMemoryError("the store gives message ids as it commits (a producer): "
                                "run the session store in the process that commits")
    return receipt.first_id


# A message's text that Hermes stores with lone surrogates as U+FFFD.
_SCRUBBED = ("content", "tool_name", "reasoning", "reasoning_content", "api_content")


def _scrub(value: Any) -> Any:
    """Text with its lone surrogates as U+FFFD (Hermes's scrub); anything else as it is."""
    return sanitize(value) if isinstance(value, str) else value


def _scrubbed(message: dict[str, Any]) -> dict[str, Any]:
    for key in _SCRUBBED:
        if isinstance(message.get(key), str):
            message[key] = _scrub(message[key])
    return message


def _hermes_message(m: Mapping[str, Any]) -> dict[str, Any]:
    """A message as ``replace_messages`` stores it: as given, its explicit time read as
    Hermes reads it."""
    message = dict(m)
    if "timestamp" in message:
        stamp = explicit_timestamp(message["timestamp"])
        if stamp is None:
            del message["timestamp"]
        elif isinstance(message["timestamp"], _dt.datetime):
            message["timestamp"] = stamp
    return message


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
