"""The PostgreSQL store's tables and their versions: numbered migrations, ``upgrade`` to run
the pending ones (``hermes-memory db upgrade``), ``check`` at start.

The tables mean what the SQLite store's mean (``store/schema.py``), with what several
machines writing one database need on top:

- **Exactly once.** Every record carries its idempotency key under a UNIQUE constraint, so a
  replicator that sends a batch again inserts with ``ON CONFLICT DO NOTHING`` and changes
  nothing: a message by ``(turn_key, ordinal)``; a record of another kind (a key-value
  write, a session's lifecycle step, a template record) by its key in ``applied_records``,
  inserted in the transaction that applies it.
- **Per-session order.** ``messages.seq`` is the turn's number in its session, assigned when
  the turn was accepted; a session is read in ``(seq, ordinal)`` order, whichever machine
  committed which turn first.
- **Full-text recall.** ``messages.search`` is a generated ``tsvector`` with a GIN index.
  The text search configuration is ``simple``: lower-cased words, no stemming and no stop
  words, whatever the language, which is what the SQLite store's FTS5 ``unicode61``
  tokenizer does (``english`` would stem and drop words, so the two stores would disagree on
  what matches, and it mangles other languages). The message's scope tokens (``u<hash>`` of
  its user, ``s<hash>`` of its session, as ``turns.scope_tokens`` makes them) go into the
  same vector at weight A, the text at weight D: a recall scoped to a user or a session is
  one GIN search (``'u…':A & (terms)``), not a text search over every user filtered
  afterwards; weight A can never match a word of the text, and a ranking gives it 0.
  Only the first ``SEARCH_CHARS`` characters are indexed: a ``tsvector`` holds at most
  1 MB, and a longer message of distinct words would fail its insert.
- **Shared jobs** (version 2): claimed with ``FOR UPDATE SKIP LOCKED`` under a lease on the
  database's clock (``postgres.jobs``).
- **Recall job results** (version 3): a worker's answer to a gateway's queued recall, per
  (user, session) (``postgres.recall_jobs``).
- **Derived work** (version 4): the tool calls a write logs wait (``pending``) for their
  user's procedural job (fixes, the per-user bound); a template's counts are recounted by
  its stats job from its sessions (those a delete detached left out) on top of the counts
  it came with (``base_*``) (``postgres.derived``).
- **Calls awaiting their answer** (version 5): a call whose record holds no answer for it
  is logged ``awaiting`` until a later write settles it (``postgres.derived``).
- **Stemmed recall** (version 6): ``messages.search_stemmed``, the text under the
  ``english`` configuration (Porter stems and the Snowball stop list, as the local word
  index) with the scope tokens as in ``search``, which session search keeps using. A
  trigger fills it for every new row; the rows stored before are filled by
  ``build_stemmed_search`` after the upgrade's transaction commits, in slices of the
  primary key (each its own transaction: writers are never blocked for long), then its GIN
  index is built with ``CREATE INDEX CONCURRENTLY``. Until that index is valid, recall
  answers through ``search`` (``postgres.recall``); ``hermes-memory db status`` shows the
  index's state and a build's progress. (A generated column would have rewritten the whole
  table under an exclusive lock, and an index on the expression would have the recall
  parse every candidate message again.)

Upgrades take a transaction-level advisory lock, so two processes upgrading at once apply
each migration once: the second waits, then finds nothing to do. A migration and its
``schema_version`` row commit together.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

import structlog

from ..errors import ConfigurationError, SchemaVersionError

if TYPE_CHECKING:
    from asyncpg import Pool, Record
    from asyncpg.pool import PoolConnectionProxy

log = structlog.get_logger(__name__)

# Characters of a message (or a key-value memory) that full-text search indexes. A tsvector
# holds at most 1 MB; the densest text measured (distinct two-character words of 4-byte
# characters, ~5.3 bytes of vector per character) makes 0.80 MB of 150,000 characters and
# fails at 200,000. Ordinary prose makes a third of that.
SEARCH_CHARS = 150_000
# pg_advisory_xact_lock's key for upgrades: "hermes" in ASCII, so another application's
# locks are unlikely to collide with it.
UPGRADE_LOCK_ID = 0x6865726D6573
UPGRADE_HINT = "run `hermes-memory db upgrade`"


# The stemmed vector (``{content}``, ``{scope}``: the row's columns) and its index.
STEMMED_VECTOR = (f"setweight(to_tsvector('english', left(coalesce({{content}}, ''), "
                  f"{SEARCH_CHARS})), 'D') || setweight(to_tsvector('simple', {{scope}}), 'A')")
STEMMED_INDEX = "messages_search_stemmed"
# A session-level advisory lock for filling and indexing it: two upgrades at once do it once.
STEMMED_LOCK_ID = UPGRADE_LOCK_ID + 1
# Rows of the primary key filled per transaction by the backfill.
STEMMED_SLICE = 5_000
STEMMED = f"""
ALTER TABLE messages ADD COLUMN search_stemmed tsvector;
CREATE FUNCTION messages_stem_search() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.search_stemmed := {STEMMED_VECTOR.format(content="NEW.content", scope="NEW.scope")};
    RETURN NEW;
END $$;
CREATE TRIGGER messages_stem_search BEFORE INSERT OR UPDATE OF content, scope ON messages
    FOR EACH ROW EXECUTE FUNCTION messages_stem_search();
"""


@dataclass(frozen=True, slots=True)
class Migration:
    """One step of the schema: ``sql`` takes a database at ``version - 1`` to ``version``."""

    version: int
    name: str
    sql: str


_SEARCH = (f"setweight(to_tsvector('simple', left(coalesce({{text}}, ''), {SEARCH_CHARS})), "
           f"'D') || setweight(to_tsvector('simple', scope), 'A')")

CORE_TABLES = f"""
CREATE TABLE sessions (
    id text PRIMARY KEY,
    source text NOT NULL,
    user_id text,
    model text,
    parent_session_id text,
    started_at double precision NOT NULL,  -- seconds since the epoch, as the records carry
    updated_at double precision NOT NULL,
    ended_at double precision,
    end_reason text,
    message_count bigint NOT NULL DEFAULT 0,
    tool_call_count bigint NOT NULL DEFAULT 0,
    input_tokens bigint NOT NULL DEFAULT 0,
    output_tokens bigint NOT NULL DEFAULT 0,
    -- JSON documents are text, as given: jsonb would reorder their keys and refuses \\u0000.
    model_config text,
    system_prompt text,
    tokens_estimated boolean NOT NULL DEFAULT false
);
CREATE INDEX sessions_user ON sessions (user_id);
CREATE INDEX sessions_source ON sessions (source, started_at DESC);
CREATE INDEX sessions_parent ON sessions (parent_session_id);
CREATE INDEX sessions_started ON sessions (started_at DESC);

CREATE TABLE messages (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    session_id text NOT NULL,
    seq bigint NOT NULL,  -- the turn's number in its session, in the order it reached here
    turn_key text NOT NULL,
    ordinal integer NOT NULL,  -- the message's place in its turn
    role text NOT NULL,
    content text,
    tool_calls text,
    tool_call_id text,
    tool_name text,
    timestamp double precision NOT NULL,
    user_id text,
    scope text NOT NULL,  -- 'u<hash> s<hash>' (turns.scope_tokens)
    metadata text,
    token_count integer,
    search tsvector GENERATED ALWAYS AS ({_SEARCH.format(text="content")}) STORED,
    CONSTRAINT messages_idempotency UNIQUE (turn_key, ordinal)
);
CREATE INDEX messages_session ON messages (session_id, seq, ordinal);
CREATE INDEX messages_user ON messages (user_id, id);
CREATE INDEX messages_search ON messages USING gin (search);

-- Key-value memory, per user.
CREATE TABLE memories (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    user_id text NOT NULL,
    key text NOT NULL,
    value text NOT NULL,
    metadata text,
    created_at double precision NOT NULL,
    updated_at double precision NOT NULL,
    scope text NOT NULL,  -- 'u<hash>' (turns.scope_token_for)
    search tsvector GENERATED ALWAYS AS ({_SEARCH.format(text="key || ' ' || value")}) STORED,
    CONSTRAINT memories_user_key UNIQUE (user_id, key)
);
CREATE INDEX memories_updated ON memories (user_id, updated_at DESC);
CREATE INDEX memories_search ON memories USING gin (search);

-- The records other than a turn's messages that have been applied, by their idempotency
-- key: inserted (ON CONFLICT DO NOTHING) in the transaction that applies the record, which
-- applies it only when the insert took.
CREATE TABLE applied_records (
    record_key text PRIMARY KEY,
    kind text NOT NULL,  -- kv, session, template...
    session_id text,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- Procedural memory: every tool call of a committed turn. A message's calls go with it.
CREATE TABLE tool_calls (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id bigint NOT NULL REFERENCES messages (id) ON DELETE CASCADE,
    call_id text NOT NULL,
    session_id text NOT NULL,
    user_id text NOT NULL,  -- '' for a turn without a user
    tool text NOT NULL,
    arguments text NOT NULL,  -- JSON, minified as given
    result text NOT NULL,  -- the answer's first 500 characters
    ok boolean NOT NULL,
    error_type text,
    error_message text,
    duration_ms double precision,
    goal text,  -- the user message that led to it
    at double precision NOT NULL,
    fixed_by bigint,  -- the later call that fixed this failure
    fixes bigint,  -- the failure this call fixed
    CONSTRAINT tool_calls_idempotency UNIQUE (message_id, call_id)
);
CREATE INDEX tool_calls_user_tool ON tool_calls (user_id, tool, id);
CREATE INDEX tool_calls_user ON tool_calls (user_id, id);
CREATE INDEX tool_calls_session ON tool_calls (session_id, id);
-- The failures no success has fixed yet, where a new success looks for the one it fixes.
CREATE INDEX tool_calls_open_failures ON tool_calls (user_id, tool, id)
    WHERE NOT ok AND fixed_by IS NULL;
CREATE TABLE tool_log_counts (
    user_id text PRIMARY KEY,
    n bigint NOT NULL
);

-- Warm-start templates and the sessions started from one (or cold).
CREATE TABLE templates (
    name text PRIMARY KEY,
    task_type text NOT NULL,
    tags text NOT NULL,  -- JSON list, normalized (templates.model.normalize_tags)
    description text NOT NULL,
    source_session_id text NOT NULL,
    document text NOT NULL,  -- JSON (templates.Template.to_dict)
    signature text NOT NULL,
    usage_count bigint NOT NULL DEFAULT 0,
    successes bigint NOT NULL DEFAULT 0,
    failures bigint NOT NULL DEFAULT 0,
    created_at double precision NOT NULL,
    updated_at double precision NOT NULL
);
CREATE INDEX templates_type ON templates (task_type, signature);
-- A choice's order (the SQLite store's idx_templates_rank).
CREATE INDEX templates_rank ON templates (
    task_type, (successes::double precision / greatest(successes + failures, 1)) DESC,
    usage_count, (successes + failures) DESC, name);
CREATE TABLE template_sessions (
    session_id text PRIMARY KEY,
    template text,  -- NULL: a cold start
    task_type text NOT NULL,
    started_at double precision NOT NULL,
    ended_at double precision,
    ok boolean,  -- NULL until the session ends
    first_calls integer NOT NULL DEFAULT 0,
    first_errors integer NOT NULL DEFAULT 0
);
CREATE INDEX template_sessions_type ON template_sessions (task_type);
"""

# Shared work (queued recalls, procedural patterns, template statistics), claimed by worker
# processes on any machine. Times are the database's (now()), so every machine's leases
# are measured on one clock.
JOBS = """
CREATE TABLE jobs (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    kind text NOT NULL,
    key text UNIQUE,  -- the same work queued twice is one job; NULL: no such identity
    payload text NOT NULL,  -- JSON
    status text NOT NULL DEFAULT 'queued' CHECK (status IN ('queued', 'running', 'dead')),
    attempts integer NOT NULL DEFAULT 0,
    run_after timestamptz NOT NULL DEFAULT now(),
    lease_owner text,
    lease_until timestamptz,
    last_error text,
    created_at timestamptz NOT NULL DEFAULT now(),
    updated_at timestamptz NOT NULL DEFAULT now(),
    CHECK ((status = 'running') = (lease_until IS NOT NULL))
);
CREATE INDEX jobs_ready ON jobs (kind, run_after, id) WHERE status = 'queued';
CREATE INDEX jobs_leased ON jobs (kind, lease_until) WHERE status = 'running';
"""

# The answers of recall jobs (``postgres.recall_jobs``): a worker's block for a gateway's
# queued recall, one row per (user, session), the latest; written in the transaction that
# completes the job, which also NOTIFYs the gateway that asked (``origin``).
RECALL_RESULTS = """
CREATE TABLE recall_results (
    user_id text NOT NULL,  -- '' for a session without a user
    session_id text NOT NULL,
    query text NOT NULL,
    block text NOT NULL,
    origin text NOT NULL,  -- the gateway that asked
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (user_id, session_id)
);
"""

# What the derived jobs (``postgres.derived``) need. Nothing wrote these tables before.
DERIVED = """
ALTER TABLE tool_calls ADD COLUMN pending boolean NOT NULL DEFAULT false;
CREATE INDEX tool_calls_pending ON tool_calls (user_id, id) WHERE pending;
ALTER TABLE templates ADD COLUMN base_usage bigint NOT NULL DEFAULT 0,
    ADD COLUMN base_successes bigint NOT NULL DEFAULT 0,
    ADD COLUMN base_failures bigint NOT NULL DEFAULT 0;
ALTER TABLE template_sessions ADD COLUMN detached boolean NOT NULL DEFAULT false;
CREATE INDEX template_sessions_template ON template_sessions (template) WHERE NOT detached;
"""

# A call may await its answer in a later record (``derived.settle_awaiting``).
AWAITING = """
ALTER TABLE tool_calls ADD COLUMN awaiting boolean NOT NULL DEFAULT false;
CREATE INDEX tool_calls_awaiting ON tool_calls (session_id, call_id) WHERE awaiting;
"""

MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "sessions, messages, key-value memory, tool-call log, templates",
              CORE_TABLES),
    Migration(2, "shared jobs", JOBS),
    Migration(3, "recall job results", RECALL_RESULTS),
    Migration(4, "derived work: pending tool calls, template base counts", DERIVED),
    Migration(5, "tool calls awaiting their answer", AWAITING),
    # The rows stored before, and the index, are done after the transaction (an index
    # cannot be built concurrently in one): build_stemmed_search.
    Migration(6, "stemmed recall search (filled and indexed after the upgrade)", STEMMED),
)
SCHEMA_VERSION = MIGRATIONS[-1].version
STEMMED_VERSION = 6
assert [m.version for m in MIGRATIONS] == list(range(1, SCHEMA_VERSION + 1))

VERSION_TABLE = """
CREATE TABLE IF NOT EXISTS schema_version (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


@dataclass(frozen=True, slots=True)
class Upgrade:
    """What ``upgrade`` did: the version it found, the version it left, the steps between."""

    database: str
    from_version: int
    to_version: int
    applied: tuple[Migration, ...]
    duration_s: float


@dataclass(frozen=True, slots=True)
class AppliedMigration:
    version: int
    name: str
    applied_at: datetime


@dataclass(frozen=True, slots=True)
class SchemaStatus:
    """A database's schema against this library's: ``version`` 0 is no schema yet."""

    database: str
    server_version: str
    version: int
    expected: int
    applied: tuple[AppliedMigration, ...]
    stemmed_index: str = "missing"  # stemmed_index_state

    @property
    def current(self) -> bool:
        return self.version == self.expected

    @property
    def pending(self) -> tuple[Migration, ...]:
        """The migrations ``upgrade`` would apply (none when the database is newer)."""
        return MIGRATIONS[self.version:] if self.version < self.expected else ()

    def as_dict(self) -> dict[str, object]:
        return {
            "database": self.database, "server_version": self.server_version,
            "version": self.version, "expected": self.expected, "current": self.current,
            "pending": [{"version": m.version, "name": m.name} for m in self.pending],
            "stemmed_index": self.stemmed_index,
            "applied": [{"version": a.version, "name": a.name,
                         "applied_at": a.applied_at.isoformat()} for a in self.applied],
        }


async def upgrade(pool: Pool[Record], *, target: int | None = None) -> Upgrade:
    """Apply the pending migrations, up to ``target`` (default: this library's version),
    each with its ``schema_version`` row, all in one transaction under the upgrade lock.

    Raises:
        ConfigurationError: ``target`` is not a version this library has.
        SchemaVersionError: the database is newer than this library (nothing is changed).
        asyncpg.PostgresError, OSError: the database failed (see ``postgres.pool.errors``).
    """
    target = SCHEMA_VERSION if target is None else target
    if not 0 <= target <= SCHEMA_VERSION:
        raise ConfigurationError(
            f"no schema version {target}: this library has 1 to {SCHEMA_VERSION}")
    started = time.perf_counter()
    async with pool.acquire() as conn, conn.transaction():
        # Held to the transaction's end: a second upgrade waits here, then finds the
        # version this one committed.
        await conn.execute("SELECT pg_advisory_xact_lock($1)", UPGRADE_LOCK_ID)
        await conn.execute(VERSION_TABLE)
        database = await _database(conn)
        found = await _version(conn)
        if found > SCHEMA_VERSION:
            raise _newer(database, found)
        steps = MIGRATIONS[found:target]
        for step in steps:
            step_started = time.perf_counter()
            await conn.execute(step.sql)
            await conn.execute("INSERT INTO schema_version (version, name) VALUES ($1, $2)",
                               step.version, step.name)
            log.info("postgres.migration", database=database, version=step.version,
                     name=step.name,
                     duration_ms=round((time.perf_counter() - step_started) * 1000, 1))
    if target >= STEMMED_VERSION:
        await build_stemmed_search(pool)
    result = Upgrade(database=database, from_version=found, to_version=max(found, target),
                     applied=steps, duration_s=time.perf_counter() - started)
    log.info("postgres.upgrade", database=database, from_version=found,
             to_version=result.to_version, applied=len(steps),
             duration_ms=round(result.duration_s * 1000, 1))
    return result


async def build_stemmed_search(pool: Pool[Record]) -> bool:
    """Fill ``search_stemmed`` for the rows stored before version 6 (slices of the primary
    key, each its own transaction), then build its index concurrently, or again if a build
    was cut short (which leaves an invalid index behind); returns whether it built the
    index. Writers go on meanwhile, and recall answers through ``search``. While another
    caller is at it, returns False at once (two at once do it once); one cut short is
    resumed by the next.

    Raises:
        asyncpg.PostgresError, OSError: the database failed (what is done stays done).
    """
    async with pool.acquire() as conn:
        # Not waited for: a statement waiting for it would hold a snapshot that the other
        # caller's concurrent index build waits out, a deadlock.
        if not await conn.fetchval("SELECT pg_try_advisory_lock($1)", STEMMED_LOCK_ID):
            log.info("postgres.stemmed_search_elsewhere",
                     detail="another upgrade is filling and indexing it")
            return False
        try:
            valid = await conn.fetchval(
                "SELECT i.indisvalid FROM pg_index AS i WHERE i.indexrelid = to_regclass($1)",
                STEMMED_INDEX)
            if valid:
                return False
            started = time.perf_counter()
            # Every row without the trigger was committed before the migration was (its
            # ALTER TABLE waited for their writers), so none is above this id.
            last = int(await conn.fetchval("SELECT coalesce(max(id), 0) FROM messages"))
            fill = (f"UPDATE messages SET search_stemmed = "
                    f"{STEMMED_VECTOR.format(content='content', scope='scope')} "
                    "WHERE id > $1 AND id <= $2 AND search_stemmed IS NULL")
            filled = 0
            for low in range(0, last, STEMMED_SLICE):
                done = await conn.execute(fill, low, low + STEMMED_SLICE)
                filled += int(done.split()[-1])
            if valid is not None:
                log.warning("postgres.stemmed_index_rebuilt", index=STEMMED_INDEX,
                            reason="an earlier build did not finish")
                await conn.execute(f"DROP INDEX CONCURRENTLY IF EXISTS {STEMMED_INDEX}")
            await conn.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {STEMMED_INDEX} "
                               "ON messages USING gin (search_stemmed)")
            log.info("postgres.stemmed_search_built", index=STEMMED_INDEX, rows_filled=filled,
                     duration_ms=round((time.perf_counter() - started) * 1000, 1))
            return True
        finally:
            await conn.execute("SELECT pg_advisory_unlock($1)", STEMMED_LOCK_ID)


async def stemmed_index_state(pool: Pool[Record]) -> str:
    """The stemmed index: ``ready``; ``building`` with the server's progress (its phase and
    blocks done); ``missing`` (``hermes-memory db upgrade`` fills the older rows and builds
    it, or is doing so); ``invalid`` (a build cut short: the next upgrade builds it again)."""
    async with pool.acquire() as conn:
        valid = await conn.fetchval(
            "SELECT i.indisvalid FROM pg_index AS i WHERE i.indexrelid = to_regclass($1)",
            STEMMED_INDEX)
        progress = await conn.fetchrow(
            "SELECT p.phase, p.blocks_done, p.blocks_total FROM pg_stat_progress_create_index "
            "AS p WHERE p.relid = to_regclass('messages') AND p.datid = "
            "(SELECT oid FROM pg_database WHERE datname = current_database())")
    if valid:
        return "ready"
    if progress is not None:
        done, total = progress["blocks_done"], progress["blocks_total"]
        share = f", {done}/{total} blocks" if total else ""
        return f"building ({progress['phase']}{share})"
    return "missing" if valid is None else "invalid"


async def check(pool: Pool[Record]) -> int:
    """That the database's schema is this library's; returns its version. For the start of
    a process that uses the database (it changes nothing).

    Raises:
        SchemaVersionError: older (the message says to run ``hermes-memory db upgrade``) or
            newer than this library.
        asyncpg.PostgresError, OSError: the database failed.
    """
    async with pool.acquire() as conn:
        database = await _database(conn)
        found = await _version(conn)
    if found > SCHEMA_VERSION:
        raise _newer(database, found)
    if found < SCHEMA_VERSION:
        have = ("has no hermes-memory schema yet" if found == 0
                else f"has schema version {found}")
        raise SchemaVersionError(
            f'the database "{database}" {have}, and this library needs version '
            f"{SCHEMA_VERSION}: {UPGRADE_HINT}", found=found, expected=SCHEMA_VERSION)
    return found


async def status(pool: Pool[Record]) -> SchemaStatus:
    """The database's schema version and its applied migrations (it changes nothing).

    Raises:
        asyncpg.PostgresError, OSError: the database failed.
    """
    async with pool.acquire() as conn:
        database = await _database(conn)
        server_version = str(await conn.fetchval("SHOW server_version"))
        found = await _version(conn)
        rows = [] if found == 0 else await conn.fetch(
            "SELECT version, name, applied_at FROM schema_version ORDER BY version")
    stemmed = await stemmed_index_state(pool) if found else "missing"
    return SchemaStatus(
        database=database, server_version=server_version, version=found,
        expected=SCHEMA_VERSION, stemmed_index=stemmed,
        applied=tuple(AppliedMigration(r["version"], r["name"], r["applied_at"])
                      for r in rows))


async def _database(conn: PoolConnectionProxy[Record]) -> str:
    return str(await conn.fetchval("SELECT current_database()"))


async def _version(conn: PoolConnectionProxy[Record]) -> int:
    """The schema's version: 0 when it has no schema_version table (or an empty one)."""
    if await conn.fetchval("SELECT to_regclass('schema_version')") is None:
        return 0
    return int(await conn.fetchval("SELECT coalesce(max(version), 0) FROM schema_version"))


def _newer(database: str, found: int) -> SchemaVersionError:
    return SchemaVersionError(
        f'the database "{database}" has schema version {found}, newer than this library '
        f"knows ({SCHEMA_VERSION}): upgrade hermes-async-memory on this machine",
        found=found, expected=SCHEMA_VERSION)
