"""The statements the PostgreSQL backend (``postgres.backend``) runs: the staging of a
write's messages, the sessions' counters, the lifecycle events and key-value memory, each
with the meaning the local store gives it."""

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
INSERT_MESSAGES = """
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
    RETURNING turn_key, ordinal
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
DELETE_SESSION = (
    "DELETE FROM messages WHERE session_id = $1",  # its tool calls go with them (cascade)
    "DELETE FROM template_sessions WHERE session_id = $1",
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
