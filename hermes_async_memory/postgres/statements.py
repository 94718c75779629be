"""The statements the PostgreSQL backend (``postgres.backend``) runs: the staging of a
write's messages and their tool calls, the sessions' counters, the lifecycle events,
key-value memory and templates, each with the meaning the local store gives it, and the
shared jobs a write queues for the work derived from it (``postgres.derived``)."""

from __future__ import annotations

STAGE = """
CREATE TEMP TABLE IF NOT EXISTS hermes_stage (
    pos bigint NOT NULL,
    session_id text NOT NULL,
    turn_rank bigint NOT NULL,
    turn_key text NOT NULL,
    ordinal integer NOT NULL,
    role text NOT NULL,
    content text,
    tool_calls text,
    tool_call_id text,
    tool_name text,
    timestamp double precision NOT NULL,
    user_id text,
    scope text NOT NULL,
    metadata text,
    token_count integer
) ON COMMIT DELETE ROWS
"""
STAGE_COLUMNS = ("pos", "session_id", "turn_rank", "turn_key", "ordinal", "role", "content",
                 "tool_calls", "tool_call_id", "tool_name", "timestamp", "user_id", "scope",
                 "metadata", "token_count")
# The sessions of a phase's turns exist and are locked, in id order; fields other than the
# counters are set as SQLite's UPSERT_SESSIONS sets them. updated_at: the newest accept.
UPSERT_SESSIONS = """
INSERT INTO sessions (id, source, user_id, model, parent_session_id, started_at, updated_at)
SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[],
                     $6::float8[], $7::float8[]) ORDER BY 1
ON CONFLICT (id) DO UPDATE SET
    updated_at = greatest(sessions.updated_at, excluded.updated_at),
    user_id = coalesce(sessions.user_id, excluded.user_id),
    model = coalesce(excluded.model, sessions.model),
    parent_session_id = coalesce(sessions.parent_session_id, excluded.parent_session_id)
"""
# The staged messages go in after each session's highest seq; returns the turns inserted.
_INSERT_STAGED = """
WITH last AS (
    SELECT d.session_id,
           (SELECT max(m.seq) FROM messages AS m WHERE m.session_id = d.session_id) AS seq
    FROM (SELECT DISTINCT session_id FROM hermes_stage) AS d
), ins AS (
    INSERT INTO messages (session_id, seq, turn_key, ordinal, role, content, tool_calls,
                          tool_call_id, tool_name, timestamp, user_id, scope, metadata,
                          token_count)
    SELECT st.session_id, coalesce(last.seq, 0) + st.turn_rank, st.turn_key, st.ordinal,
           st.role, st.content, st.tool_calls, st.tool_call_id, st.tool_name, st.timestamp,
           st.user_id, st.scope, st.metadata, st.token_count
    FROM hermes_stage AS st JOIN last USING (session_id)
    ORDER BY st.pos
    ON CONFLICT (turn_key, ordinal) DO NOTHING
    RETURNING {returning}
)"""
INSERT_MESSAGES = _INSERT_STAGED.format(returning="turn_key, ordinal") + """
SELECT turn_key FROM ins WHERE ordinal = 0
"""
# The tool calls of a write's turns (``derived.call_rows``: one row per call, by the
# (turn, ordinal) of the message that made it), staged beside the messages.
STAGE_CALLS = """
CREATE TEMP TABLE IF NOT EXISTS hermes_stage_calls (
    pos bigint NOT NULL,
    turn_key text NOT NULL,
    ordinal integer NOT NULL,
    call_id text NOT NULL,
    tool text NOT NULL,
    arguments text NOT NULL,
    result text NOT NULL,
    ok boolean NOT NULL,
    error_type text,
    error_message text,
    duration_ms double precision,
    goal text,
    awaiting boolean NOT NULL
) ON COMMIT DELETE ROWS;
DELETE FROM hermes_stage_calls;
"""
STAGE_CALL_COLUMNS = ("pos", "turn_key", "ordinal", "call_id", "tool", "arguments", "result",
                      "ok", "error_type", "error_message", "duration_ms", "goal", "awaiting")
# INSERT_MESSAGES, and in the same statement the staged calls of the messages it inserted
# (joined to its RETURNING: a message already there, a resend's, adds no call), in message
# then call order, waiting for their user's procedural job (``pending``), or for their answer
# (``awaiting``: ``derived.settle_awaiting``).
INSERT_MESSAGES_AND_CALLS = _INSERT_STAGED.format(
    returning="id, session_id, turn_key, ordinal, user_id, timestamp") + """, calls AS (
    INSERT INTO tool_calls (message_id, call_id, session_id, user_id, tool, arguments, result,
                            ok, error_type, error_message, duration_ms, goal, at, pending,
                            awaiting)
    SELECT ins.id, c.call_id, ins.session_id, coalesce(ins.user_id, ''), c.tool, c.arguments,
           c.result, c.ok, c.error_type, c.error_message, c.duration_ms, c.goal,
           ins.timestamp, true, c.awaiting
    FROM hermes_stage_calls AS c JOIN ins USING (turn_key, ordinal)
    ORDER BY c.pos
    ON CONFLICT (message_id, call_id) DO NOTHING
)
SELECT turn_key FROM ins WHERE ordinal = 0
"""
ADD_COUNTERS = """
UPDATE sessions AS s SET message_count = s.message_count + v.m,
       tool_call_count = s.tool_call_count + v.c, input_tokens = s.input_tokens + v.i,
       output_tokens = s.output_tokens + v.o
FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::bigint[], $5::bigint[])
     AS v(id, m, c, i, o)
WHERE s.id = v.id
"""
CLAIM_RECORD = """
INSERT INTO applied_records (record_key, kind, session_id) VALUES ($1, $2, $3)
ON CONFLICT (record_key) DO NOTHING RETURNING true
"""
# The lifecycle events, as store.lifecycle applies them in SQLite.
DESCRIBE = """
INSERT INTO sessions (id, source, user_id, model, parent_session_id, started_at, updated_at,
                      model_config, system_prompt, tokens_estimated)
VALUES ($1, coalesce($4, $3), $5, $6, $7, $2, $2, $8, $9, $10)
ON CONFLICT (id) DO UPDATE SET
    source = coalesce($4, sessions.source),
    user_id = coalesce(sessions.user_id, excluded.user_id),
    model = coalesce($6, sessions.model),
    parent_session_id = coalesce($7, sessions.parent_session_id),
    model_config = coalesce($8, sessions.model_config),
    system_prompt = coalesce($9, sessions.system_prompt),
    tokens_estimated = sessions.tokens_estimated OR $10,
    updated_at = greatest(sessions.updated_at, excluded.updated_at)
"""
END = """
INSERT INTO sessions (id, source, user_id, started_at, updated_at, ended_at, end_reason)
VALUES ($1, $3, $4, $2, $2, $2, $5)
ON CONFLICT (id) DO UPDATE SET
    user_id = coalesce(sessions.user_id, excluded.user_id),
    ended_at = excluded.ended_at, end_reason = excluded.end_reason,
    updated_at = greatest(sessions.updated_at, excluded.updated_at)
"""
# Prune's form: the session goes only if it ended, and was last updated, before the cut-off.
PRUNABLE = """
SELECT EXISTS (SELECT 1 FROM sessions WHERE id = $1 AND ended_at IS NOT NULL
               AND ended_at < $2 AND updated_at < $2 AND ($3::text IS NULL OR source = $3))
"""
# A session's row of template_sessions goes with it; what it counted for its template stays
# counted (as in SQLite, where a template's counts are not taken back): it moves into the
# template's base counts, from which the stats job recounts (``derived``).
DELETE_SESSION = (
    "DELETE FROM messages WHERE session_id = $1",  # its tool calls go with them (cascade)
    """WITH gone AS (
        DELETE FROM template_sessions WHERE session_id = $1
        RETURNING template, detached, ok, started_at, ended_at)
    UPDATE templates AS t SET base_usage = t.base_usage + 1,
        base_successes = t.base_successes + (g.ok IS TRUE)::int,
        base_failures = t.base_failures + (g.ok IS FALSE)::int,
        updated_at = greatest(t.updated_at, g.started_at, g.ended_at)
    FROM gone AS g WHERE t.name = g.template AND NOT g.detached""",
    "DELETE FROM sessions WHERE id = $1",
)
IMPORT_ROW = """
INSERT INTO sessions (id, source, user_id, model, parent_session_id, started_at, updated_at,
                      ended_at, end_reason, message_count, tool_call_count, input_tokens,
                      output_tokens, model_config, system_prompt, tokens_estimated)
VALUES ($1, coalesce($2, $17), $3, $4, $5, $6, coalesce($7, $18), $8, $9, $10, $11, $12,
        $13, $14, $15, $16)
ON CONFLICT (id) DO NOTHING
"""
IMPORT_TARGET = "SELECT EXISTS (SELECT 1 FROM sessions WHERE id = $1 AND started_at = $2)"
LAST_SEQ = "SELECT coalesce(max(seq), 0) FROM messages WHERE session_id = $1"
IMPORT_MESSAGES = """
INSERT INTO messages (session_id, seq, turn_key, ordinal, role, content, tool_calls,
                      tool_call_id, tool_name, timestamp, user_id, scope, metadata, token_count)
SELECT $1, v.seq, v.turn_key, v.ordinal, v.role, v.content, v.tool_calls, v.tool_call_id,
       v.tool_name, v.ts, v.user_id, $2, v.metadata, v.token_count
FROM unnest($3::bigint[], $4::text[], $5::int[], $6::text[], $7::text[], $8::text[],
            $9::text[], $10::text[], $11::float8[], $12::text[], $13::text[], $14::int[])
     WITH ORDINALITY AS v(seq, turn_key, ordinal, role, content, tool_calls, tool_call_id,
                          tool_name, ts, user_id, metadata, token_count, n)
ORDER BY v.n
ON CONFLICT (turn_key, ordinal) DO NOTHING
"""
# Key-value memory, as store.memories applies it: a put keeps an entry's created_at.
KV_PUT = """
INSERT INTO memories (user_id, key, value, metadata, created_at, updated_at, scope)
VALUES ($1, $2, $3, $4, $5, $5, $6)
ON CONFLICT (user_id, key) DO UPDATE SET
    value = excluded.value, metadata = excluded.metadata, updated_at = excluded.updated_at
"""
KV_DELETE = "DELETE FROM memories WHERE user_id = $1 AND key = $2"

# Warm-start templates, as store.templates applies them in SQLite. The counts the store
# gathers (usage, successes, failures) are recounted by the template's stats job from
# template_sessions, on top of the counts the template came with (``base_*``): a put sets
# both, and keeps them when it replaces a stored template's content.
_PUT = """
INSERT INTO templates (name, task_type, tags, description, source_session_id, document,
                       signature, usage_count, successes, failures, base_usage,
                       base_successes, base_failures, created_at, updated_at)
SELECT $1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $8, $9, $10, $11, $12
WHERE NOT $13::boolean OR NOT EXISTS (
    SELECT 1 FROM templates WHERE task_type = $2 AND (signature = $7 OR source_session_id = $5))
ON CONFLICT (name) DO {conflict}
"""
# mode "save": a stored template gets the content, keeps its counts and creation time.
TEMPLATE_SAVE = _PUT.format(conflict="""UPDATE SET task_type = excluded.task_type,
    tags = excluded.tags, description = excluded.description,
    source_session_id = excluded.source_session_id, document = excluded.document,
    signature = excluded.signature,
    updated_at = greatest(templates.updated_at, excluded.updated_at)""")
# mode "keep", and "auto" ($13: not when one of the task type has its examples or source).
TEMPLATE_KEEP = _PUT.format(conflict="NOTHING")
# A deleted template's sessions keep their rows (warm starts still) but leave its counts.
TEMPLATE_DELETE = (
    "DELETE FROM templates WHERE name = $1",
    "UPDATE template_sessions SET detached = true WHERE template = $1 AND NOT detached",
)
# A session's start, once. Warm from a template that is not stored (deleted meanwhile): the
# row is detached at once (SQLite counts no use of it either). The template's row is
# share-locked, so a concurrent delete either comes first (the start is detached) or after
# (it detaches the start). Returns the template whose counts changed, if any.
TEMPLATE_USE = """
WITH known AS (SELECT 1 FROM templates WHERE name = $2 FOR KEY SHARE), ins AS (
    INSERT INTO template_sessions (session_id, template, task_type, started_at, detached)
    SELECT $1, $2, $3, $4, $2::text IS NOT NULL AND NOT EXISTS (SELECT 1 FROM known)
    ON CONFLICT (session_id) DO NOTHING
    RETURNING template, detached)
SELECT template FROM ins WHERE template IS NOT NULL AND NOT detached
"""
# How a session ended (again: replaces the outcome); a session never started is a cold one,
# started when its session row says. Returns the template whose counts changed, if any.
TEMPLATE_OUTCOME = """
INSERT INTO template_sessions (session_id, template, task_type, started_at, ended_at, ok,
                               first_calls, first_errors)
VALUES ($1, NULL, $2, coalesce((SELECT started_at FROM sessions WHERE id = $1), $3), $3, $4,
        $5, $6)
ON CONFLICT (session_id) DO UPDATE SET
    ended_at = excluded.ended_at, ok = excluded.ok, first_calls = excluded.first_calls,
    first_errors = excluded.first_errors
RETURNING CASE WHEN NOT detached THEN template END
"""
# Shared jobs a write queues (``postgres.jobs``' table): one per key ($2, with payloads $3),
# in key order. A key queued or running already gets no second job, but its row stays
# locked until the write commits: a job that starts running gives up its key first
# (``derived``), which waits for the write, so it then reads what the write committed; a
# write after that queues a new job. A dead job of the key is queued again. Returns how many
# jobs were queued (a NOTIFY on the jobs channel then tells the workers).
ENQUEUE_JOBS = """
WITH q AS (
    INSERT INTO jobs (kind, key, payload)
    SELECT $1, j.key, j.payload FROM unnest($2::text[], $3::text[]) AS j(key, payload)
    ORDER BY j.key
    ON CONFLICT (key) DO UPDATE SET status = 'queued', attempts = 0, run_after = now(),
        updated_at = now()
    WHERE jobs.status = 'dead'
    RETURNING id)
SELECT count(*) FROM q
"""
