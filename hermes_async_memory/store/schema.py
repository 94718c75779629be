"""The store's tables, their version, and what an older file needs at open (migrations)."""

from __future__ import annotations

import time
from pathlib import Path

import aiosqlite

from ..errors import StoreError
from .text_index import (
    disable_text_indexes,
    ensure_memory_index,
    ensure_tool_index,
    ensure_trigram,
    ensure_word_index,
    fts5_available,
    start_word_reindex,
)
from .tool_log import TEMP_TABLES as TOOL_LOG_TEMP_TABLES
from .tool_log import ToolLogConfig, prepare, range_log_statements

# 2: recall requests and results are keyed by (session, user), not by session alone.
# 3: key-value memory (memories, memories_fts); new tables only.
# 4: sessions keep their model config, system prompt and whether their token counts were
#    estimated, messages their reported token count (added columns); sessions are listed by
#    source.
# 5: the tool-call log (tool_calls, tool_log_counts); new tables only.
# 6: warm-start templates (templates, template_sessions); new tables only.
# 7: sessions count tool calls as Hermes does (the entries of the assistants' tool_calls; a
#    tool message counted too before): recounted. The calls of turns committed before
#    version 5 are logged. A deleted template's sessions are detached from its name.
# 8: messages are stored as given: each keeps every key a column does not hold in ``fields``
#    (JSON), its own timestamp, and Hermes's ``active`` and ``compacted`` flags; Hermes's
#    per-message columns read from ``fields`` (generated). Sessions carry every column of
#    Hermes Agent 0.19's session table (title, cwd, git, chat, billing, cost, api calls, ...),
#    and ``session_model_usage`` their usage per model and billing route (added columns and a
#    new table).
# 9: a trigram index beside the word index, for text the word index cannot split into words
#    (CJK): messages_trgm, filled with the stored messages that hold such text (new table,
#    made and filled by text_index.ensure_trigram).
# 10: Hermes Agent's key-value state (state_meta) and its compression locks
#    (compression_locks); an index of the messages' tool names and calls beside the word
#    index (messages_tools, over the generated column tool_text, made and filled by
#    text_index.ensure_tool_index): new tables and a column.
# 11: a tool call may await its answer in a later record (tool_calls.awaiting, and its
#    index idx_tool_calls_awaiting, made by tool_log.prepare): an added column and index.
# 12: the word index stems its words (porter over unicode61). An older store's index is
#    rebuilt beside it in slices while the store works, then swapped in
#    (text_index.start_word_reindex; its plan in index_rebuild, a new table).
# 13: the store may run on a SQLite without FTS5, without its full-text indexes; while they
#    are not kept, text_index_off says so (a new table; an older library, which would
#    take stale indexes for kept ones, must not open such a file).
SCHEMA_VERSION = 13

SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    source TEXT NOT NULL,
    user_id TEXT,
    model TEXT,
    parent_session_id TEXT,
    started_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    ended_at REAL,
    end_reason TEXT,
    message_count INTEGER NOT NULL DEFAULT 0,
    tool_call_count INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    model_config TEXT,  -- JSON object, as the host gave it
    system_prompt TEXT,  -- the latest snapshot
    tokens_estimated INTEGER NOT NULL DEFAULT 0  -- 1: some counts were estimated from text
    -- Hermes Agent 0.19's session columns, as it names them: SESSION_COLUMNS below, added
    -- by add_missing_columns, so that a new file and an upgraded one are the same.
);
CREATE INDEX IF NOT EXISTS idx_sessions_user ON sessions(user_id);
CREATE INDEX IF NOT EXISTS idx_sessions_source ON sessions(source, started_at DESC);
CREATE INDEX IF NOT EXISTS idx_sessions_parent ON sessions(parent_session_id);
CREATE INDEX IF NOT EXISTS idx_sessions_started ON sessions(started_at DESC);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    session_id TEXT NOT NULL,
    turn_key TEXT NOT NULL,
    ordinal INTEGER NOT NULL,
    role TEXT NOT NULL,
    content TEXT,
    tool_calls TEXT,
    tool_call_id TEXT,
    tool_name TEXT,
    timestamp REAL NOT NULL,
    user_id TEXT,
    scope TEXT NOT NULL,
    metadata TEXT,
    token_count INTEGER  -- as the message reported it (its own, or its usage); else NULL
    -- fields, active, compacted and Hermes's per-message columns: MESSAGE_COLUMNS below.
);
CREATE INDEX IF NOT EXISTS idx_messages_session ON messages(session_id, id);
-- The word index (messages_fts): text_index.ensure_word_index.
-- A row while the full-text indexes are not kept: a process that commits the store without
-- FTS5 dropped their triggers (text_index.disable_text_indexes); the next with FTS5 rebuilds
-- them and empties this.
CREATE TABLE IF NOT EXISTS text_index_off (since REAL NOT NULL);
CREATE TABLE IF NOT EXISTS outbox (
    key TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    segment INTEGER NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('pending', 'leased', 'done', 'dead')),
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    payload BLOB,
    accepted_at REAL NOT NULL,
    updated_at REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idx_outbox_segment ON outbox(segment);
CREATE INDEX IF NOT EXISTS idx_outbox_open ON outbox(status) WHERE status != 'done';
-- Several processes, one memory: producers hand turns to the inbox, a worker claims them
-- under a lease and commits them; producers ask for recalls, the worker answers.
CREATE TABLE IF NOT EXISTS inbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL UNIQUE,
    session_id TEXT NOT NULL,
    payload TEXT NOT NULL,
    accepted_at REAL NOT NULL,
    lease_owner TEXT,
    lease_until REAL
);
CREATE INDEX IF NOT EXISTS idx_inbox_session ON inbox(session_id, id);
CREATE TABLE IF NOT EXISTS recall_requests (
    session_id TEXT NOT NULL,
    user_id TEXT NOT NULL,  -- '' for a session without a user (an id is never empty)
    query TEXT NOT NULL,
    after_id INTEGER NOT NULL,
    requested_at REAL NOT NULL,
    PRIMARY KEY (session_id, user_id)
);
CREATE TABLE IF NOT EXISTS recall_results (
    session_id TEXT NOT NULL,
    user_id TEXT NOT NULL,  -- '' for a session without a user
    query TEXT NOT NULL,
    block TEXT NOT NULL,
    version INTEGER NOT NULL,
    updated_at REAL NOT NULL,
    source TEXT NOT NULL DEFAULT 'local',
    fallback INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (session_id, user_id)
);
CREATE INDEX IF NOT EXISTS idx_recall_results_version ON recall_results(version);
-- Each replica backend's own outbox: a row per committed turn, written in the turn's commit
-- transaction, removed once the backend has the turn; 'dead' with the reason when it cannot.
CREATE TABLE IF NOT EXISTS replica_outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    backend TEXT NOT NULL,
    turn_key TEXT NOT NULL,
    session_id TEXT NOT NULL,
    first_id INTEGER NOT NULL,
    n_messages INTEGER NOT NULL,
    status TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'dead')),
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    updated_at REAL,
    payload TEXT,  -- an operation's own record (a turn's is rebuilt from its messages)
    UNIQUE (backend, turn_key)
);
CREATE INDEX IF NOT EXISTS idx_replica_outbox_open ON replica_outbox(backend, status, id);
CREATE INDEX IF NOT EXISTS idx_replica_outbox_session
    ON replica_outbox(backend, status, session_id, id);
-- Key-value memory, per user: written only by commits of key-value records (see batch).
CREATE TABLE IF NOT EXISTS memories (
    id INTEGER PRIMARY KEY,
    user_id TEXT NOT NULL,
    key TEXT NOT NULL,
    value TEXT NOT NULL,
    metadata TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    scope TEXT NOT NULL,
    UNIQUE (user_id, key)
);
CREATE INDEX IF NOT EXISTS idx_memories_updated ON memories(user_id, updated_at DESC);
-- Their index (memories_fts): text_index.ensure_memory_index.
-- Procedural memory: every tool call of a committed turn, logged in the turn's transaction.
CREATE TABLE IF NOT EXISTS tool_calls (
    id INTEGER PRIMARY KEY,
    message_id INTEGER NOT NULL,  -- the assistant message that made the call
    call_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    user_id TEXT NOT NULL,  -- '' for a turn without a user
    tool TEXT NOT NULL,
    arguments TEXT NOT NULL,  -- JSON (minified as given)
    result TEXT NOT NULL,  -- the answer's first 500 characters
    ok INTEGER NOT NULL,
    error_type TEXT,
    error_message TEXT,
    duration_ms REAL,
    goal TEXT,  -- the user message that led to it
    at REAL NOT NULL,
    fixed_by INTEGER,  -- the later call that fixed this failure
    fixes INTEGER,  -- the failure this call fixed
    awaiting INTEGER NOT NULL DEFAULT 0,  -- 1: no answer yet (store.tool_log)
    UNIQUE (message_id, call_id)
);
CREATE INDEX IF NOT EXISTS idx_tool_calls_user_tool ON tool_calls(user_id, tool, id);
CREATE INDEX IF NOT EXISTS idx_tool_calls_user ON tool_calls(user_id, id);
CREATE INDEX IF NOT EXISTS idx_tool_calls_session ON tool_calls(session_id, id);
-- The failures no success has fixed yet: a new success looks for its failure here, rather
-- than walking back over every call of its tool.
CREATE INDEX IF NOT EXISTS idx_tool_calls_open_failures ON tool_calls(user_id, tool, id)
    WHERE ok = 0 AND fixed_by IS NULL;
CREATE TABLE IF NOT EXISTS tool_log_counts (
    user_id TEXT PRIMARY KEY,
    n INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TRIGGER IF NOT EXISTS tool_calls_message_delete AFTER DELETE ON messages
WHEN old.tool_calls IS NOT NULL BEGIN
    DELETE FROM tool_calls WHERE message_id = old.id;
END;
-- Warm-start templates: written only by commits of template records (store.templates).
-- The counts are the store's evidence; the document holds the rest (its own counts are
-- those it was put with). signature: the set of its examples' (tool, arguments), hashed.
CREATE TABLE IF NOT EXISTS templates (
    name TEXT PRIMARY KEY,
    task_type TEXT NOT NULL,
    tags TEXT NOT NULL,  -- JSON list, normalized (templates.model.normalize_tags)
    description TEXT NOT NULL,
    source_session_id TEXT NOT NULL,
    document TEXT NOT NULL,  -- JSON (templates.Template.to_dict)
    signature TEXT NOT NULL,
    usage_count INTEGER NOT NULL DEFAULT 0,
    successes INTEGER NOT NULL DEFAULT 0,
    failures INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idx_templates_type ON templates(task_type, signature);
-- A choice's order (store.templates.CANDIDATES), walked from its best until enough qualify.
CREATE INDEX IF NOT EXISTS idx_templates_rank ON templates(
    task_type, (CAST(successes AS REAL) / max(successes + failures, 1)) DESC, usage_count,
    (successes + failures) DESC, name);
-- A session started warm (template) or cold (NULL), and how it ended: the warm vs cold
-- numbers per task type. ok is NULL until it ends; first_* count its first turns' calls.
CREATE TABLE IF NOT EXISTS template_sessions (
    session_id TEXT PRIMARY KEY,
    template TEXT,
    task_type TEXT NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL,
    ok INTEGER,
    first_calls INTEGER NOT NULL DEFAULT 0,
    first_errors INTEGER NOT NULL DEFAULT 0
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS idx_template_sessions_type ON template_sessions(task_type);
-- The highest message id ever given, so that a deleted message's id is never given again
-- (ids are given as messages are accepted: message_ids): one row.
CREATE TABLE IF NOT EXISTS message_id_high (high INTEGER NOT NULL);
INSERT INTO message_id_high (high)
SELECT coalesce((SELECT max(id) FROM messages), 0) WHERE NOT EXISTS (SELECT 1 FROM message_id_high);
-- Hermes Agent's usage per model and billing route of a session (its session_model_usage),
-- summed by the session store's usage records (store.usage).
CREATE TABLE IF NOT EXISTS session_model_usage (
    session_id TEXT NOT NULL,
    model TEXT NOT NULL,
    billing_provider TEXT NOT NULL DEFAULT '',
    billing_base_url TEXT NOT NULL DEFAULT '',
    billing_mode TEXT NOT NULL DEFAULT '',
    task TEXT NOT NULL DEFAULT '',
    api_call_count INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    cache_read_tokens INTEGER NOT NULL DEFAULT 0,
    cache_write_tokens INTEGER NOT NULL DEFAULT 0,
    reasoning_tokens INTEGER NOT NULL DEFAULT 0,
    estimated_cost_usd REAL NOT NULL DEFAULT 0,
    actual_cost_usd REAL NOT NULL DEFAULT 0,
    cost_status TEXT,
    cost_source TEXT,
    first_seen REAL,
    last_seen REAL,
    PRIMARY KEY (session_id, model, billing_provider, billing_base_url, billing_mode, task)
);
CREATE INDEX IF NOT EXISTS idx_session_model_usage_model ON session_model_usage(model);
-- Hermes Agent's key-value state (its state_meta: the last automatic prune, ...), written
-- only by commits of meta records (store.session_state).
CREATE TABLE IF NOT EXISTS state_meta (key TEXT PRIMARY KEY, value TEXT);
-- Hermes Agent's compression locks: who compresses a session, until when (a lease a crashed
-- holder loses at expires_at); written only by commits of lock records (store.session_state).
CREATE TABLE IF NOT EXISTS compression_locks (
    session_id TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    acquired_at REAL NOT NULL,
    expires_at REAL NOT NULL
);
"""
_ADDED_COLUMNS = (
    ("recall_results", "source", "TEXT NOT NULL DEFAULT 'local'"),
    ("recall_results", "fallback", "INTEGER NOT NULL DEFAULT 0"),
    # A turn a producer could not write, handed in with why: the worker dead-letters it.
    ("inbox", "error", "TEXT"),
    ("replica_outbox", "payload", "TEXT"),
    ("sessions", "model_config", "TEXT"),
    ("sessions", "system_prompt", "TEXT"),
    ("sessions", "tokens_estimated", "INTEGER NOT NULL DEFAULT 0"),
    ("messages", "token_count", "INTEGER"),
    # 1: the template the session started from was deleted (its name may be taken again).
    ("template_sessions", "detached", "INTEGER NOT NULL DEFAULT 0"),
    # 1: the call awaits its answer (version 11, store.tool_log).
    ("tool_calls", "awaiting", "INTEGER NOT NULL DEFAULT 0"),
)
# Version 8: a message's keys no column holds, as given (JSON; see message_rows.message_row), and
# Hermes's flags: 0 in active is a message the host set aside (rewound, compacted).
MESSAGE_COLUMNS = (
    ("messages", "fields", "TEXT"),
    ("messages", "active", "INTEGER NOT NULL DEFAULT 1"),
    ("messages", "compacted", "INTEGER NOT NULL DEFAULT 0"),
    # Hermes's per-message columns, read from the fields: nothing stored twice.
    *(("messages", name, f"{kind} GENERATED ALWAYS AS ({expr}) VIRTUAL")
    for name, kind, expr in (
        ("finish_reason", "TEXT", "fields ->> '$.finish_reason'"),
        ("reasoning", "TEXT", "fields ->> '$.reasoning'"),
        ("reasoning_content", "TEXT", "fields ->> '$.reasoning_content'"),
        ("reasoning_details", "TEXT", "fields -> '$.reasoning_details'"),
        ("codex_reasoning_items", "TEXT", "fields -> '$.codex_reasoning_items'"),
        ("codex_message_items", "TEXT", "fields -> '$.codex_message_items'"),
        ("platform_message_id", "TEXT",
         "coalesce(fields ->> '$.platform_message_id', fields ->> '$.message_id')"),
        ("observed", "INTEGER", "coalesce(fields ->> '$.observed', 0)"),
        ("effect_disposition", "TEXT", "fields ->> '$.effect_disposition'"),
        ("api_content", "TEXT", "fields ->> '$.api_content'"),
        # What the tool index holds of a message: its tool name and its tool calls' JSON
        # (names and arguments), as Hermes indexes them beside the text; NULL without.
        ("tool_text", "TEXT", "CASE WHEN tool_name IS NOT NULL OR tool_calls IS NOT NULL "
                              "THEN coalesce(tool_name, '') || ' ' || coalesce(tool_calls, '') "
                              "END"),
    )),
)
# Hermes Agent 0.19's session columns beside ours (its hermes_state.SCHEMA_SQL).
SESSION_COLUMNS = tuple(("sessions", name, decl) for name, decl in (
    ("session_key", "TEXT"), ("chat_id", "TEXT"), ("chat_type", "TEXT"),
    ("thread_id", "TEXT"), ("display_name", "TEXT"), ("origin_json", "TEXT"),
    ("expiry_finalized", "INTEGER DEFAULT 0"),
    ("cache_read_tokens", "INTEGER NOT NULL DEFAULT 0"),
    ("cache_write_tokens", "INTEGER NOT NULL DEFAULT 0"),
    ("reasoning_tokens", "INTEGER NOT NULL DEFAULT 0"),
    ("cwd", "TEXT"), ("git_branch", "TEXT"), ("git_repo_root", "TEXT"),
    ("billing_provider", "TEXT"), ("billing_base_url", "TEXT"), ("billing_mode", "TEXT"),
    ("estimated_cost_usd", "REAL"), ("actual_cost_usd", "REAL"), ("cost_status", "TEXT"),
    ("cost_source", "TEXT"), ("pricing_version", "TEXT"), ("title", "TEXT"),
    ("api_call_count", "INTEGER NOT NULL DEFAULT 0"), ("handoff_state", "TEXT"),
    ("handoff_platform", "TEXT"), ("handoff_error", "TEXT"),
    ("compression_failure_cooldown_until", "REAL"), ("compression_failure_error", "TEXT"),
    ("compression_fallback_streak", "INTEGER NOT NULL DEFAULT 0"), ("profile_name", "TEXT"),
    ("rewind_count", "INTEGER NOT NULL DEFAULT 0"), ("archived", "INTEGER NOT NULL DEFAULT 0"),
))
RECOUNT_TOOL_CALLS = """
UPDATE sessions SET tool_call_count = (
    SELECT coalesce(sum(CASE WHEN json_valid(m.tool_calls)
                             THEN json_array_length(m.tool_calls) END), 0)
    FROM messages AS m WHERE m.session_id = sessions.id AND m.tool_calls IS NOT NULL);
"""
# The backfill logs this many turns per statement group (each group's outcome function call
# gets their answers as one JSON array).
BACKFILL_TURNS = 2_000
# Set on the writer connection: a batch of inbox turns commits only while its lease holds;
# an imported part whose message ids are taken is inserted under new ids (lifecycle).
LEASE_GUARD = """
CREATE TEMP TABLE IF NOT EXISTS lease_guard (held INTEGER NOT NULL CHECK (held));
CREATE TEMP TABLE IF NOT EXISTS import_fresh (n INTEGER NOT NULL);
""" + TOOL_LOG_TEMP_TABLES


async def migrate(db: aiosqlite.Connection, path: Path,
                  tool_log: ToolLogConfig | None = None) -> None:
    """Create what a new file lacks, bring an older file's tables up to date, and set up the
    writer connection's temporary tables. ``tool_log``: how commits log tool calls (the
    connection has its outcome function), for the calls of an older file's turns; None:
    they are not logged. The full-text indexes are not touched: the process that commits
    the store settles them (``settle_text_indexes``), once it holds the outbox's lock.

    Raises:
        StoreError: the file's schema is newer than this library knows.
        sqlite3.Error: the file cannot be read or written.
    """
    await db.executescript(SCHEMA)
    async with db.execute("SELECT version FROM schema_version") as cur:
        row = await cur.fetchone()
    if row is not None and row[0] > SCHEMA_VERSION:
        raise StoreError(
            f"{path} has schema version {row[0]}; this library knows {SCHEMA_VERSION}"
        )
    if row is None:
        await db.execute(
            "INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,)
        )
    elif row[0] < SCHEMA_VERSION:
        version = row[0]
        if version < 2:
            await _rekey_recalls(db)
        # Versions 3 to 6 only added tables, indexes and columns: the schema script and
        # add_missing_columns make them. Version 7's changes of rows run in one transaction
        # with the version's update: a migration cut short runs again whole.
        await add_missing_columns(db)
        await db.commit()
        script = [RECOUNT_TOOL_CALLS]
        if version < 5 and tool_log is not None:
            script += await _backfill_statements(db, tool_log)
        script.append(f"UPDATE schema_version SET version = {SCHEMA_VERSION};")
        await db.executescript(TOOL_LOG_TEMP_TABLES)
        await db.executescript("BEGIN IMMEDIATE;" + "".join(script) + "COMMIT;")
    await add_missing_columns(db)
    await db.commit()
    await prepare(db, tool_log)  # the tool log's awaiting calls
    await db.executescript(LEASE_GUARD)


async def settle_text_indexes(db: aiosqlite.Connection, *, commits: bool) -> bool:
    """Bring the full-text indexes in line with this SQLite (``text_index``). With FTS5:
    make each index the file lacks, rebuild each that an open without FTS5 left behind, and
    begin the word index's rebuild an older file needs. Without it, and only for the process
    that commits the store (``commits``: it holds the outbox's lock): drop the triggers that
    keep them, mark them not kept (``text_index_off``) and send ``db``'s fills nowhere.
    Another process (a producer, a start that fails on the lock) changes nothing while they
    are marked not kept, so that a SQLite of its own that differs from the writer's never
    changes the indexes under the writer's feet. Returns whether they are kept.

    Raises:
        sqlite3.Error: the file cannot be read or written.
    """
    async with db.execute("SELECT 1 FROM text_index_off LIMIT 1") as cur:
        off = await cur.fetchone() is not None
    if not await fts5_available(db):
        if commits:
            await disable_text_indexes(db)
        return False
    if off and not commits:
        return False
    await ensure_word_index(db)
    await ensure_memory_index(db)
    await ensure_trigram(db)
    await ensure_tool_index(db)
    await start_word_reindex(db, time.time())
    if off:
        await db.execute("DELETE FROM text_index_off")
    return True


async def _backfill_statements(db: aiosqlite.Connection, tool_log: ToolLogConfig
                               ) -> list[str]:
    """Version 5: the statements that log the tool calls of the turns committed before the
    log existed, oldest first (so the per-user bound drops the oldest), BACKFILL_TURNS
    turns at a time. A turn's messages have consecutive ids from its first (ordinal 0)."""
    async with db.execute("SELECT max(id) FROM messages") as cur:
        row = await cur.fetchone()
    last = int(row[0]) if row and row[0] is not None else 0
    async with db.execute(
            "SELECT id FROM (SELECT id, row_number() OVER (ORDER BY id) AS n FROM messages "
            "WHERE ordinal = 0) WHERE n % ? = 1 AND n > 1", (BACKFILL_TURNS,)) as cur:
        starts = [int(r[0]) for r in await cur.fetchall()]
    script: list[str] = []
    after = 0
    for upto in [*(s - 1 for s in starts), last]:
        if upto > after:
            script += range_log_statements(tool_log, after, upto)
        after = upto
    return script


async def _rekey_recalls(db: aiosqlite.Connection) -> None:
    """Version 2: recall requests and results keyed by (session, user). Both tables hold
    passing state only (a request is asked again with the next turn, a result is a cache
    entry), so they are made anew rather than copied."""
    await db.execute("DROP TABLE IF EXISTS recall_requests")
    await db.execute("DROP TABLE IF EXISTS recall_results")
    await db.executescript(SCHEMA)
    await db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION,))


# A file without these is not a store of ours (its full-text indexes may be missing: made by
# a SQLite without FTS5).
REQUIRED_TABLES = ("schema_version", "sessions", "messages", "outbox")


async def check_current(db: aiosqlite.Connection, path: Path) -> None:
    """That ``db`` is a store of ours at this library's schema version, for a reader that
    cannot bring it up to date.

    Raises:
        StoreError: not a store of ours, or another version (saying which way).
        sqlite3.Error: the file cannot be read.
    """
    async with db.execute("SELECT name FROM sqlite_master WHERE type = 'table'") as cur:
        tables = {row[0] for row in await cur.fetchall()}
    missing = [t for t in REQUIRED_TABLES if t not in tables]
    if missing:
        raise StoreError(f"{path} is not a hermes-memory store (no table {', '.join(missing)})")
    async with db.execute("SELECT max(version) FROM schema_version") as cur:
        row = await cur.fetchone()
    version = row[0] if row else None
    if version != SCHEMA_VERSION:
        raise StoreError(
            f"{path} has schema version {version}; this library reads {SCHEMA_VERSION}"
            + (": open it once with the pipeline or the worker to bring it up to date"
               if version is not None and version < SCHEMA_VERSION else ""))


async def check_tables(db: aiosqlite.Connection) -> None:
    """One cheap read of every table: a damaged page behind them shows now, not later."""
    for query in ("SELECT max(rowid) FROM sessions", "SELECT max(id) FROM messages",
                  "SELECT max(key) FROM outbox", "SELECT max(id) FROM inbox",
                  "SELECT max(id) FROM replica_outbox", "SELECT max(id) FROM memories",
                  "SELECT max(id) FROM tool_calls", "SELECT max(name) FROM templates",
                  "SELECT max(session_id) FROM template_sessions"):
        async with db.execute(query) as cur:
            await cur.fetchone()


async def add_missing_columns(db: aiosqlite.Connection) -> None:
    """Columns added since a table was first created (CREATE IF NOT EXISTS keeps an
    older table as it is)."""
    for table, column, decl in (*_ADDED_COLUMNS, *MESSAGE_COLUMNS, *SESSION_COLUMNS):
        async with db.execute(f"PRAGMA table_xinfo({table})") as cur:
            have = {row[1] for row in await cur.fetchall()}
        if column not in have:
            await db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {decl}")
