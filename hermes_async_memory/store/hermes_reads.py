"""Synchronous reads in the shapes of Hermes Agent's session store (its ``hermes_state``), on
a plain ``sqlite3`` connection of the caller's: what ``hermes.state.SessionDB`` answers
with. The tables are ours; their Hermes-named columns (``schema.SESSION_COLUMNS`` and the
messages' generated columns) mean what Hermes's mean, so most reads are Hermes's own
questions asked of our rows.

A message's content comes back as it was given: the structured (list or dict) content, or
text holding NUL or a lone surrogate, lives in its ``fields`` (``message_rows.message_row``). So do
Hermes's per-message columns (reasoning, api_content, ...): the store has them as generated
columns for SQL to filter on, but the reads here take them from the fields in Python.
SQLite's JSON functions decode a lone surrogate's escape into bytes that are not UTF-8, and
reading such a column fails ("Could not decode to UTF-8"); parsed here, the value comes back
as it was given.

Sessions as Hermes's pickers see them (``rich_sessions``): the conversations a list shows
are roots and branches (``LISTABLE``), never a subagent's run (``_delegate_from`` in its
model config) nor a compression continuation; a compression chain shows as its root, which
the caller projects forward to its live tip (``compression_tip``).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .session_filters import SessionFilter, like_contains
from .session_filters import cwd_prefix as _cwd_prefix

# The columns of Hermes Agent 0.19's messages table, in its order: what its get_messages
# returns for each row.
MESSAGE_COLUMNS = (
    "id", "session_id", "role", "content", "tool_call_id", "tool_calls", "tool_name",
    "effect_disposition", "timestamp", "token_count", "finish_reason", "reasoning",
    "reasoning_content", "reasoning_details", "codex_reasoning_items", "codex_message_items",
    "platform_message_id", "observed", "active", "compacted", "api_content",
)
# What is read of a message: the stored columns (the rest come from its fields).
_STORED = ("id, session_id, role, content, tool_call_id, tool_calls, tool_name, timestamp, "
           "token_count, active, compacted, fields")
# Hermes's per-message columns that the store generates from the fields, as a read here
# computes them: the value as SQLite's ->> gives it (text), or its JSON as -> gives it.
_FIELD_TEXT = ("effect_disposition", "finish_reason", "reasoning", "reasoning_content",
               "api_content")
_FIELD_JSON = ("reasoning_details", "codex_reasoning_items", "codex_message_items")
# The columns of Hermes Agent 0.19's sessions table, in its order.
SESSION_COLUMNS = (
    "id", "source", "user_id", "session_key", "chat_id", "chat_type", "thread_id",
    "display_name", "origin_json", "expiry_finalized", "model", "model_config",
    "system_prompt", "parent_session_id", "started_at", "ended_at", "end_reason",
    "message_count", "tool_call_count", "input_tokens", "output_tokens", "cache_read_tokens",
    "cache_write_tokens", "reasoning_tokens", "cwd", "git_branch", "git_repo_root",
    "billing_provider", "billing_base_url", "billing_mode", "estimated_cost_usd",
    "actual_cost_usd", "cost_status", "cost_source", "pricing_version", "title",
    "api_call_count", "handoff_state", "handoff_platform", "handoff_error",
    "compression_failure_cooldown_until", "compression_failure_error",
    "compression_fallback_streak", "profile_name", "rewind_count", "archived",
)
_SESSION_SELECT = ", ".join(SESSION_COLUMNS)
# A lineage is followed this many sessions up (a cycle ends it sooner), a compression chain
# this many sessions forward.
MAX_LINEAGE = 100
# A rich row's preview: the first user message's text, line breaks as spaces, this long
# (and "..." when it was longer).
PREVIEW_CHARS = 60


def _marker(alias: str, key: str) -> str:
    """A key of a session's model config (NULL when it has none, or no JSON object)."""
    return (f"json_extract(CASE WHEN json_valid({alias}.model_config) "
            f"THEN {alias}.model_config END, '$.{key}')")


# A child session is a branch (/branch: listed, never deleted with its parent) when its
# model config says so, or (before the marker) its parent ended 'branched' before it began.
BRANCH = (f"({_marker('{a}', '_branched_from')} IS NOT NULL OR EXISTS ("
          "SELECT 1 FROM sessions AS bp WHERE bp.id = {a}.parent_session_id "
          "AND bp.end_reason = 'branched' AND {a}.started_at >= bp.ended_at))")
# What a picker lists: roots and branches that are not a subagent's run.
LISTABLE = ("(s.parent_session_id IS NULL OR " + BRANCH.format(a="s") + ") AND "
            + _marker("s", "_delegate_from") + " IS NULL")
# A compression continuation of session ``{p}``: a child of it (it ended 'compression')
# that is no branch, no subagent's run and no tool's session.
_CONTINUATION = (f"{_marker('c', '_branched_from')} IS NULL AND "
                 f"{_marker('c', '_delegate_from')} IS NULL AND coalesce(c.source, '') != 'tool'")
# The live tip of a compression chain, one step: the continuation of a session that ended
# 'compression', preferring one that was compressed again, then a live one, then the one
# active last (a stale sibling that was closed loses to the real continuation).
_NEXT_IN_CHAIN = f"""
SELECT c.id FROM sessions AS p JOIN sessions AS c ON c.parent_session_id = p.id
WHERE p.id = ? AND p.end_reason = 'compression' AND {_CONTINUATION}
ORDER BY CASE WHEN c.end_reason = 'compression' THEN 0 WHEN c.ended_at IS NULL THEN 1
              ELSE 2 END,
         coalesce((SELECT max(m.timestamp) FROM messages AS m WHERE m.session_id = c.id),
                  c.started_at) DESC,
         c.started_at DESC, c.id DESC
LIMIT 1
"""
# A rich row's extra columns: the first user message (for its preview) and when the
# session was last active (its latest message, else its start).
# A listed session's preview (its first user message) and its last activity (its last
# message's time) by insertion order, found through idx_messages_session (session, id):
# Hermes orders both by time, with an index of (session, timestamp) ours does not keep (each
# commit would pay for it); the two differ only when a message was given an earlier time
# than one stored before it.
_RICH_EXTRA = """,
    coalesce((SELECT substr(replace(replace(m.content, char(10), ' '), char(13), ' '), 1, {n})
              FROM messages AS m
              WHERE m.session_id = s.id AND m.role = 'user' AND m.content IS NOT NULL
              ORDER BY m.id LIMIT 1), '') AS _preview_raw,
    coalesce((SELECT m2.timestamp FROM messages AS m2 WHERE m2.session_id = s.id
              ORDER BY m2.id DESC LIMIT 1), s.started_at) AS last_active"""
# Each listed session's compression chain forward (root_id: the listed one; UNION ends a
# cycle), and the latest activity anywhere in it: what ``order_by_last_active`` sorts by,
# in SQL, so that LIMIT and OFFSET apply to the sorted list.
_CHAIN = """
WITH RECURSIVE chain(root_id, cur_id) AS (
    SELECT s.id, s.id FROM sessions AS s {where}
    UNION
    SELECT chain.root_id, c.id
    FROM chain
    JOIN sessions AS p ON p.id = chain.cur_id
    JOIN sessions AS c ON c.parent_session_id = chain.cur_id
    WHERE p.end_reason = 'compression' AND """ + _CONTINUATION + """
),
chain_last AS (
    SELECT root_id, max(coalesce(
        (SELECT m.timestamp FROM messages AS m WHERE m.session_id = chain.cur_id
         ORDER BY m.id DESC LIMIT 1),
        (SELECT cs.started_at FROM sessions AS cs WHERE cs.id = chain.cur_id))) AS last
    FROM chain GROUP BY root_id
)"""


# -- sessions ---------------------------------------------------------------------------


def session_row(conn: sqlite3.Connection, session_id: str) -> dict[str, Any] | None:
    row = conn.execute(f"SELECT {_SESSION_SELECT} FROM sessions WHERE id = ?",
                       (session_id,)).fetchone()
    return None if row is None else dict(row)


def session_rows(conn: sqlite3.Connection, where: str = "", params: Sequence[Any] = (),
                 order: str = "started_at DESC, id") -> list[dict[str, Any]]:
    """Sessions (``where``: a condition on alias ``s``), Hermes's columns."""
    sql = (f"SELECT {', '.join('s.' + c for c in SESSION_COLUMNS)} FROM sessions AS s"
           f"{' WHERE ' + where if where else ''} ORDER BY {order}")
    return [dict(r) for r in conn.execute(sql, list(params)).fetchall()]


def existing_sessions(conn: sqlite3.Connection, ids: Sequence[str]) -> list[str]:
    """Which of ``ids`` have a session row, in the order given."""
    found: set[str] = set()
    for i in range(0, len(ids), 500):
        chunk = list(ids[i:i + 500])
        found.update(r[0] for r in conn.execute(
            f"SELECT id FROM sessions WHERE id IN ({','.join('?' * len(chunk))})", chunk))
    return [sid for sid in ids if sid in found]


def _sessions_columns(conn: sqlite3.Connection, compact: bool) -> str:
    """Every column of our sessions table (``s.*``), or every one but the system prompt."""
    if not compact:
        return "s.*"
    names = [r[1] for r in conn.execute("PRAGMA table_info(sessions)")]
    return ", ".join(f"s.{n}" for n in names if n != "system_prompt")


def _with_preview(row: sqlite3.Row) -> dict[str, Any]:
    out = dict(row)
    raw = (out.pop("_preview_raw", "") or "").strip()
    out["preview"] = raw[:PREVIEW_CHARS] + ("..." if len(raw) > PREVIEW_CHARS else "")
    out.pop("_last", None)
    return out


def listing_where(*, source: str | None = None, exclude_sources: Sequence[str] | None = None,
                  cwd: str | None = None, min_message_count: int = 0,
                  include_archived: bool = False, archived_only: bool = False,
                  listable_only: bool = False) -> tuple[list[str], list[Any]]:
    """The conditions (on alias ``s``) of a session listing or count, and their parameters:
    ``listable_only``, only what a picker lists (``LISTABLE``); archived sessions only with
    ``include_archived``, or only those with ``archived_only``."""
    where: list[str] = []
    params: list[Any] = []
    if listable_only:
        where.append(LISTABLE)
    if source:
        where.append("s.source = ?")
        params.append(source)
    if exclude_sources:
        where.append(f"s.source NOT IN ({','.join('?' * len(exclude_sources))})")
        params.extend(exclude_sources)
    if cwd:
        clause, values = cwd_prefix(cwd)
        where.append(clause)
        params.extend(values)
    if min_message_count > 0:
        where.append("s.message_count >= ?")
        params.append(int(min_message_count))
    if archived_only:
        where.append("s.archived = 1")
    elif not include_archived:
        where.append("s.archived = 0")
    return where, params


def rich_sessions(conn: sqlite3.Connection, *, where: Sequence[str], params: Sequence[Any],
                  limit: int, offset: int, compact: bool = False,
                  order_by_last_active: bool = False, id_needle: str = "",
                  search_needle: str = "") -> list[dict[str, Any]]:
    """Sessions matching ``where`` (conditions on alias ``s``) with ``preview`` and
    ``last_active``, newest first; with ``order_by_last_active``, by the latest activity in
    each one's compression chain (then start, id), and only those whose chain holds an id
    holding ``id_needle``, or a title or id holding ``search_needle`` (case aside; also
    with punctuation and spaces left out of the title, so ``an94`` finds ``AN-94``)."""
    columns = _sessions_columns(conn, compact)
    extra = _RICH_EXTRA.format(n=PREVIEW_CHARS + 3)
    condition = " WHERE " + " AND ".join(where) if where else ""
    if not order_by_last_active:
        sql = (f"SELECT {columns}{extra} FROM sessions AS s{condition} "
               "ORDER BY s.started_at DESC, s.id DESC LIMIT ? OFFSET ?")
        rows = conn.execute(sql, [*params, int(limit), int(offset)]).fetchall()
        return [_with_preview(r) for r in rows]
    filters: list[str] = []
    filter_params: list[Any] = []
    if id_needle:
        filters.append("EXISTS (SELECT 1 FROM chain AS q WHERE q.root_id = s.id "
                       "AND lower(q.cur_id) LIKE ? ESCAPE '\\')")
        filter_params.append(like_contains(id_needle.lower()))
    if search_needle:
        needle = search_needle.lower()
        squeezed = "".join(ch for ch in needle if ch.isalnum())
        title = "lower(coalesce(cs.title, ''))"
        match = [f"{title} LIKE ? ESCAPE '\\'", "lower(q.cur_id) LIKE ? ESCAPE '\\'"]
        filter_params += [like_contains(needle)] * 2
        if squeezed:
            bare = title
            for ch in ("-", "_", ".", " "):
                bare = f"replace({bare}, '{ch}', '')"
            match.append(f"{bare} LIKE ? ESCAPE '\\'")
            filter_params.append(like_contains(squeezed))
        filters.append("EXISTS (SELECT 1 FROM chain AS q JOIN sessions AS cs ON "
                       f"cs.id = q.cur_id WHERE q.root_id = s.id AND ({' OR '.join(match)}))")
    outer = " AND ".join([*where, *filters])
    sql = (_CHAIN.format(where=condition)
           + f"\nSELECT {columns}{extra}, coalesce(cl.last, s.started_at) AS _last "
           "FROM sessions AS s LEFT JOIN chain_last AS cl ON cl.root_id = s.id"
           + (f" WHERE {outer}" if outer else "")
           + " ORDER BY _last DESC, s.started_at DESC, s.id DESC LIMIT ? OFFSET ?")
    rows = conn.execute(sql, [*params, *params, *filter_params, int(limit),
                              int(offset)]).fetchall()
    return [_with_preview(r) for r in rows]


def rich_session(conn: sqlite3.Connection, session_id: str, *, compact: bool = False
                 ) -> dict[str, Any] | None:
    """One session as ``rich_sessions`` gives it; None when there is none."""
    columns = _sessions_columns(conn, compact)
    row = conn.execute(
        f"SELECT {columns}{_RICH_EXTRA.format(n=PREVIEW_CHARS + 3)} FROM sessions AS s "
        "WHERE s.id = ?", (session_id,)).fetchone()
    return None if row is None else _with_preview(row)


def compression_tip(conn: sqlite3.Connection, session_id: str) -> str:
    """The live end of ``session_id``'s compression chain (itself when it has none)."""
    current, seen = session_id, {session_id}
    for _ in range(MAX_LINEAGE):
        row = conn.execute(_NEXT_IN_CHAIN, (current,)).fetchone()
        if row is None or not row[0] or row[0] in seen:
            break
        current = str(row[0])
        seen.add(current)
    return current


def compression_ancestor(conn: sqlite3.Connection, ancestor_id: str, descendant_id: str
                         ) -> bool:
    """Whether ``ancestor_id`` is a session ``descendant_id`` continues by compression (up
    its parents, each of which ended 'compression')."""
    if not ancestor_id or not descendant_id or ancestor_id == descendant_id:
        return False
    row = conn.execute(
        """WITH RECURSIVE up(id) AS (
               SELECT ?
               UNION
               SELECT p.id FROM up JOIN sessions AS c ON c.id = up.id
               JOIN sessions AS p ON p.id = c.parent_session_id
               WHERE p.end_reason = 'compression')
           SELECT 1 FROM up WHERE id = ? LIMIT 1""",
        (descendant_id, ancestor_id)).fetchone()
    return row is not None


def compression_lineage_ids(conn: sqlite3.Connection, session_id: str) -> list[str]:
    """The stored sessions of ``session_id``'s compression lineage: it, the ancestors it
    continues and the continuations of it (each edge a parent that ended 'compression')."""
    rows = conn.execute(
        """WITH RECURSIVE
             up(id) AS (
               SELECT ?
               UNION
               SELECT p.id FROM up JOIN sessions AS c ON c.id = up.id
               JOIN sessions AS p ON p.id = c.parent_session_id
               WHERE p.end_reason = 'compression'),
             down(id) AS (
               SELECT ?
               UNION
               SELECT c.id FROM down JOIN sessions AS p ON p.id = down.id
               JOIN sessions AS c ON c.parent_session_id = p.id
               WHERE p.end_reason = 'compression')
           SELECT id FROM sessions WHERE id IN (SELECT id FROM up UNION SELECT id FROM down)
           ORDER BY started_at, id""", (session_id, session_id)).fetchall()
    return [str(r[0]) for r in rows]


def delegate_children(conn: sqlite3.Connection, parent_ids: Sequence[str]) -> list[str]:
    """The subagent sessions (``_delegate_from`` in the model config) run for any of
    ``parent_ids``, and theirs in turn: what goes with a deleted parent. Never one of the
    parents."""
    seeds = {p for p in parent_ids if p}
    found = set(seeds)
    frontier = sorted(seeds)
    marker = _marker("s", "_delegate_from")
    while frontier:
        marks = ",".join("?" * len(frontier))
        rows = conn.execute(
            f"SELECT s.id FROM sessions AS s WHERE {marker} IN ({marks}) "
            f"OR (s.parent_session_id IN ({marks}) AND {marker} IS NOT NULL)",
            [*frontier, *frontier]).fetchall()
        frontier = sorted({str(r[0]) for r in rows} - found)
        found.update(frontier)
    return sorted(found - seeds)


def last_active_sessions(conn: sqlite3.Connection, source: str | None, limit: int,
                         offset: int) -> list[dict[str, Any]]:
    """Sessions (of ``source``) with ``last_active`` (the latest message, else the start),
    the most recently active first."""
    where = "WHERE s.source = ? " if source else ""
    rows = conn.execute(
        "SELECT s.*, coalesce(m.last, s.started_at) AS last_active FROM sessions AS s "
        "LEFT JOIN (SELECT session_id, max(timestamp) AS last FROM messages "
        "GROUP BY session_id) AS m ON m.session_id = s.id "
        f"{where}ORDER BY last_active DESC, s.started_at DESC, s.id DESC LIMIT ? OFFSET ?",
        [*([source] if source else []), int(limit), int(offset)]).fetchall()
    return [dict(r) for r in rows]


def cron_runs(conn: sqlite3.Connection, job_id: str, limit: int, offset: int
              ) -> list[dict[str, Any]]:
    """The sessions of one cron job's runs (source 'cron', id ``cron_<job>_...``), newest
    first, as ``rich_sessions`` gives them; the id is matched as a range (an index seek
    on ``idx_sessions_source``'s source, then the id), not as a substring."""
    prefix = f"cron_{job_id}_"
    upper = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    rows = conn.execute(
        f"SELECT s.*{_RICH_EXTRA.format(n=PREVIEW_CHARS + 3)} FROM sessions AS s "
        "WHERE s.source = 'cron' AND s.id >= ? AND s.id < ? "
        "ORDER BY s.started_at DESC, s.id DESC LIMIT ? OFFSET ?",
        (prefix, upper, int(limit), int(offset))).fetchall()
    return [_with_preview(r) for r in rows]


def prune_candidates(conn: sqlite3.Connection, where: SessionFilter) -> list[dict[str, Any]]:
    """The sessions ``where`` picks (only ended ones), oldest first: id, source, title, model,
    started_at, ended_at, message_count, archived."""
    condition, params = where.where("s")
    return [dict(r) for r in conn.execute(
        "SELECT s.id, s.source, s.title, s.model, s.started_at, s.ended_at, "
        f"s.message_count, s.archived FROM sessions AS s WHERE {condition} "
        "ORDER BY s.started_at, s.id", params).fetchall()]


def count_picked(conn: sqlite3.Connection, where: SessionFilter) -> int:
    condition, params = where.where("s")
    return int(conn.execute(f"SELECT count(*) FROM sessions AS s WHERE {condition}",
                            params).fetchone()[0])


# -- titles -------------------------------------------------------------------------------


def title_holder(conn: sqlite3.Connection, title: str, session_id: str) -> str | None:
    row = conn.execute("SELECT id FROM sessions WHERE title = ? AND id != ?",
                       (title, session_id)).fetchone()
    return None if row is None else str(row[0])


def numbered_titles(conn: sqlite3.Connection, base: str) -> list[tuple[str, str]]:
    """(id, title) of the sessions titled ``base #<anything>``, the latest started first
    (LIKE wildcards in ``base`` are themselves)."""
    escaped = base.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return [(str(r[0]), str(r[1])) for r in conn.execute(
        "SELECT id, title FROM sessions WHERE title LIKE ? ESCAPE '\\' "
        "ORDER BY started_at DESC, id DESC", (f"{escaped} #%",)).fetchall()]


def lineage_titles(conn: sqlite3.Connection, base: str) -> list[str]:
    """The titles ``base`` and ``base #<anything>`` in use."""
    escaped = base.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return [str(r[0]) for r in conn.execute(
        "SELECT title FROM sessions WHERE title = ? OR title LIKE ? ESCAPE '\\'",
        (base, f"{escaped} #%")).fetchall()]


# -- gateway bookkeeping -------------------------------------------------------------------


def gateway_sessions(conn: sqlite3.Connection, platform: str | None, active_only: bool
                     ) -> list[dict[str, Any]]:
    """Sessions with a routing key (a gateway's), the latest started one per key, with
    ``last_active``, the most recently active first; of ``platform`` (source, case aside),
    only not ended ones with ``active_only``."""
    sql = ("SELECT s.*, coalesce((SELECT max(m.timestamp) FROM messages AS m "
           "WHERE m.session_id = s.id), s.started_at) AS last_active FROM sessions AS s "
           "WHERE s.session_key IS NOT NULL AND s.started_at = (SELECT max(k.started_at) "
           "FROM sessions AS k WHERE k.session_key = s.session_key)")
    params: list[Any] = []
    if platform:
        sql += " AND lower(s.source) = lower(?)"
        params.append(platform)
    if active_only:
        sql += " AND s.ended_at IS NULL"
    return [dict(r) for r in conn.execute(sql + " ORDER BY last_active DESC, s.id",
                                          params).fetchall()]


def origin_sessions(conn: sqlite3.Connection, platform: str, chat_id: str,
                    thread_id: str | None) -> list[dict[str, Any]]:
    """(id, user_id) of the live gateway sessions of a chat (and thread), newest first."""
    sql = ("SELECT id, user_id FROM sessions WHERE lower(source) = lower(?) "
           "AND session_key IS NOT NULL AND chat_id = ? AND ended_at IS NULL")
    params: list[Any] = [platform, chat_id]
    if thread_id is not None:
        sql += " AND coalesce(thread_id, '') = ?"
        params.append(thread_id)
    return [dict(r) for r in conn.execute(sql + " ORDER BY started_at DESC, id DESC",
                                          params).fetchall()]


# A gateway session its peer may resume: live, or ended only by a cleanup Hermes counts as
# a mistake (an old gateway's agent_close, the TUI's orphan reaper), with messages.
_RECOVERABLE = ("(s.ended_at IS NULL OR s.end_reason IN ('agent_close', 'ws_orphan_reap')) "
                "AND (coalesce(s.message_count, 0) > 0 OR EXISTS (SELECT 1 FROM messages AS m "
                "WHERE m.session_id = s.id))")


def peer_session(conn: sqlite3.Connection, *, source: str, session_key: str,
                 user_id: str | None, chat_id: str | None, chat_type: str | None,
                 thread_id: str | None) -> dict[str, Any] | None:
    """The latest recoverable gateway session of a routing key; failing that (and with the
    whole peer given: chat and its type), of the same peer (source, user, chat, chat type,
    thread)."""
    columns = ", ".join("s." + c for c in SESSION_COLUMNS)
    row = conn.execute(
        f"SELECT {columns} FROM sessions AS s WHERE s.session_key = ? AND s.source = ? "
        f"AND {_RECOVERABLE} ORDER BY s.started_at DESC LIMIT 1",
        (session_key, source)).fetchone()
    if row is None and chat_id is not None and chat_type is not None:
        row = conn.execute(
            f"SELECT {columns} FROM sessions AS s WHERE s.source = ? "
            "AND coalesce(s.user_id, '') = coalesce(?, '') "
            "AND coalesce(s.chat_id, '') = coalesce(?, '') "
            "AND coalesce(s.chat_type, '') = coalesce(?, '') "
            "AND coalesce(s.thread_id, '') = coalesce(?, '') "
            f"AND {_RECOVERABLE} ORDER BY s.started_at DESC LIMIT 1",
            (source, user_id, chat_id, chat_type, thread_id)).fetchone()
    return None if row is None else dict(row)


# -- Hermes's own state ------------------------------------------------------------------------


def meta_value(conn: sqlite3.Connection, key: str) -> str | None:
    row = conn.execute("SELECT value FROM state_meta WHERE key = ?", (key,)).fetchone()
    return None if row is None else row[0]


def compression_lock(conn: sqlite3.Connection, session_id: str) -> tuple[str, float] | None:
    """(holder, expires_at) of the session's compression lock, ended or not; None."""
    row = conn.execute("SELECT holder, expires_at FROM compression_locks WHERE session_id = ?",
                       (session_id,)).fetchone()
    return None if row is None else (str(row[0]), float(row[1]))


def message_indexes(conn: sqlite3.Connection) -> list[str]:
    """The full-text indexes of the messages this store has: the word index, and the
    trigram index when this SQLite made it."""
    return [name for name in ("messages_fts", "messages_trgm") if table_exists(conn, name)]


# -- messages -------------------------------------------------------------------------------


def given_fields(fields: str | None) -> dict[str, Any]:
    """A message's fields (the keys it was given that no column holds), parsed."""
    if not fields:
        return {}
    try:
        given = json.loads(fields)
    except ValueError:
        return {}
    return given if isinstance(given, dict) else {}


def _sql_text(value: Any) -> Any:
    """A JSON value as SQLite's ``->>`` reads it: text, a number, 1 or 0 for a bool, NULL
    for null, and an array or object as its JSON."""
    if value is None or isinstance(value, (str, int, float)):
        return int(value) if isinstance(value, bool) else value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _with_field_columns(row: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``row`` with Hermes's per-message columns, from the fields ``given``."""
    for name in _FIELD_TEXT:
        row[name] = _sql_text(given.get(name))
    for name in _FIELD_JSON:
        row[name] = (json.dumps(given[name], ensure_ascii=False, separators=(",", ":"))
                     if name in given else None)
    platform_id = _sql_text(given.get("platform_message_id"))
    row["platform_message_id"] = (platform_id if platform_id is not None
                                  else _sql_text(given.get("message_id")))
    observed = _sql_text(given.get("observed"))
    row["observed"] = 0 if observed is None else observed
    return row


def message_rows(conn: sqlite3.Connection, session_id: str, *, include_inactive: bool = False,
                 limit: int | None = None, offset: int = 0) -> list[dict[str, Any]]:
    """A session's messages in id order, Hermes's columns, content as given and tool calls
    decoded (as Hermes's get_messages)."""
    sql = (f"SELECT {_STORED} FROM messages WHERE session_id = ?"
           f"{'' if include_inactive else ' AND active = 1'} ORDER BY id")
    params: list[Any] = [session_id]
    if limit is not None or offset:
        sql += " LIMIT ? OFFSET ?"
        params += [-1 if limit is None else int(limit), int(offset)]
    return _message_dicts(conn, sql, params)


def _message_dicts(conn: sqlite3.Connection, sql: str, params: Sequence[Any]
                   ) -> list[dict[str, Any]]:
    out = []
    for r in conn.execute(sql, list(params)).fetchall():
        stored = dict(r)
        given = given_fields(stored.pop("fields"))
        if "content" in given:
            stored["content"] = given["content"]
        if "tool_call_id" in given and stored["tool_call_id"] is None:
            stored["tool_call_id"] = given["tool_call_id"]
        if stored["tool_calls"]:
            try:
                stored["tool_calls"] = json.loads(stored["tool_calls"])
            except ValueError:
                stored["tool_calls"] = []
        _with_field_columns(stored, given)
        out.append({name: stored[name] for name in MESSAGE_COLUMNS})
    return out


def conversation_rows(conn: sqlite3.Connection, session_ids: Sequence[str], *,
                      include_inactive: bool = False) -> list[dict[str, Any]]:
    """The rows of ``session_ids``' messages a conversation projection reads, in id order:
    Hermes's columns, and ``fields`` (for the content as given)."""
    marks = ",".join("?" * len(session_ids))
    out = []
    for r in conn.execute(
            f"SELECT {_STORED} FROM messages WHERE session_id IN ({marks})"
            f"{'' if include_inactive else ' AND active = 1'} ORDER BY id",
            list(session_ids)).fetchall():
        row = dict(r)
        out.append(_with_field_columns(row, given_fields(row["fields"])))
    return out


def given_content(row: sqlite3.Row | Mapping[str, Any]) -> Any:
    """A message's content as it was given (its fields hold it when the column does not)."""
    fields = row["fields"]
    if fields and '"content"' in fields:
        given = given_fields(fields)
        if "content" in given:
            return given["content"]
    return row["content"]


def latest_user_message(conn: sqlite3.Connection, session_id: str
                        ) -> dict[str, Any] | None:
    """The session's newest active user message: its id, content (as given) and fields."""
    row = conn.execute(
        "SELECT id, content, fields FROM messages WHERE session_id = ? AND role = 'user' "
        "AND active = 1 ORDER BY id DESC LIMIT 1", (session_id,)).fetchone()
    if row is None:
        return None
    return {"id": int(row[0]), "content": given_content(row), "fields": row[2]}


def message_row(conn: sqlite3.Connection, session_id: str, message_id: int
                ) -> dict[str, Any] | None:
    """One message of the session as ``message_rows`` gives it (active or not); None."""
    rows = _message_dicts(conn, f"SELECT {_STORED} FROM messages WHERE id = ? AND "
                                "session_id = ?", [int(message_id), session_id])
    return rows[0] if rows else None


def message_ids(conn: sqlite3.Connection, session_id: str, from_id: int, active: bool
                ) -> list[int]:
    """The ids of the session's messages from ``from_id`` on that are (not) ``active``."""
    return [int(r[0]) for r in conn.execute(
        "SELECT id FROM messages WHERE session_id = ? AND id >= ? AND active = ? ORDER BY id",
        (session_id, int(from_id), 1 if active else 0)).fetchall()]


def last_active_id(conn: sqlite3.Connection, session_id: str, before: int | None = None
                   ) -> int | None:
    """The session's last active message's id (before ``before``, when given)."""
    row = conn.execute(
        "SELECT max(id) FROM messages WHERE session_id = ? AND active = 1 AND id < ?",
        (session_id, 2**63 - 1 if before is None else int(before))).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def recent_user_messages(conn: sqlite3.Connection, session_id: str, limit: int,
                         include_inactive: bool) -> list[dict[str, Any]]:
    """The session's latest user messages, newest first: id, timestamp, content (as given)
    and fields."""
    rows = conn.execute(
        "SELECT id, timestamp, content, fields FROM messages WHERE session_id = ? "
        f"AND role = 'user'{'' if include_inactive else ' AND active = 1'} "
        "ORDER BY id DESC LIMIT ?", (session_id, int(limit))).fetchall()
    return [{"id": int(r[0]), "timestamp": r[1], "content": given_content(r)} for r in rows]


def has_inactive_messages(conn: sqlite3.Connection, session_id: str) -> bool:
    return conn.execute("SELECT 1 FROM messages WHERE session_id = ? AND active = 0 LIMIT 1",
                        (session_id,)).fetchone() is not None


def lineage_root_to_tip(conn: sqlite3.Connection, session_id: str) -> list[str]:
    """``session_id`` and its ancestors by parent, root first (a cycle ends the walk)."""
    chain: list[str] = []
    seen: set[str] = set()
    current: str | None = session_id
    for _ in range(MAX_LINEAGE):
        if not current or current in seen:
            break
        seen.add(current)
        chain.append(current)
        row = conn.execute("SELECT parent_session_id FROM sessions WHERE id = ?",
                           (current,)).fetchone()
        if row is None:
            break
        current = row[0]
    return list(reversed(chain)) or [session_id]


def children(conn: sqlite3.Connection, session_id: str) -> list[dict[str, Any]]:
    """The sessions whose parent is ``session_id``, oldest first."""
    return session_rows(conn, "s.parent_session_id = ?", (session_id,), "started_at ASC, id")


def count_sessions(conn: sqlite3.Connection, where: Sequence[str], params: Sequence[Any]
                   ) -> int:
    sql = "SELECT count(*) FROM sessions AS s" + (
        " WHERE " + " AND ".join(where) if where else "")
    return int(conn.execute(sql, list(params)).fetchone()[0])


def count_messages(conn: sqlite3.Connection, session_id: str | None = None) -> int:
    if session_id:
        return int(conn.execute("SELECT count(*) FROM messages WHERE session_id = ?",
                                (session_id,)).fetchone()[0])
    return int(conn.execute("SELECT count(*) FROM messages").fetchone()[0])


def cwd_prefix(prefix: str) -> tuple[str, list[str]]:
    """The condition that a session's cwd is ``prefix`` or under it (either separator)."""
    return _cwd_prefix(prefix, "s")


def distinct_cwds(conn: sqlite3.Connection, include_archived: bool) -> list[dict[str, Any]]:
    where = "cwd IS NOT NULL AND trim(cwd) != ''" + ("" if include_archived
                                                     else " AND archived = 0")
    rows = conn.execute(
        "SELECT cwd, count(*) AS sessions, max(coalesce(ended_at, started_at, 0)) AS last "
        f"FROM sessions WHERE {where} GROUP BY cwd").fetchall()
    return [{"cwd": r[0], "sessions": int(r[1] or 0), "last_active": float(r[2] or 0)}
            for r in rows]


def resolve_prefix(conn: sqlite3.Connection, prefix: str) -> list[str]:
    """Up to two session ids starting with ``prefix`` (LIKE wildcards in it escaped)."""
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return [r[0] for r in conn.execute(
        "SELECT id FROM sessions WHERE id LIKE ? ESCAPE '\\' ORDER BY started_at DESC LIMIT 2",
        (f"{escaped}%",)).fetchall()]


# -- search ---------------------------------------------------------------------------------


_SEARCH = """SELECT m.id, m.session_id, m.role,
       snippet({index}, 0, '>>>', '<<<', '...', {tokens}) AS snippet,
       m.content, m.timestamp, m.tool_name, s.source, s.model,
       s.started_at AS session_started, {index}.rank AS score
FROM {index}
JOIN messages AS m ON m.id = {index}.rowid
JOIN sessions AS s ON s.id = m.session_id
WHERE {clauses}
ORDER BY {order}
LIMIT ?"""


def search(conn: sqlite3.Connection, match: str, *, where: Sequence[str],
           params: Sequence[Any], sort: str | None, limit: int, offset: int,
           snippet_tokens: int = 40) -> list[dict[str, Any]]:
    """Messages matching ``match`` (an FTS5 expression the caller made safe) in their text
    (the word index) or in what they say of tools (the tool index: tool name, the calls'
    names and arguments), a message found by both once (with its text's snippet); each with
    its session's source and model, a snippet (``>>>`` match ``<<<``), the content (for the
    context) and its ``score`` (bm25 in the index that found it: lower is better). Best
    first, or by time (``sort``: "newest", "oldest"); ``where`` on aliases ``m``
    (messages) and ``s`` (sessions).

    Raises:
        sqlite3.OperationalError: SQLite refused the expression.
    """
    clauses = " AND ".join(["{index} MATCH ?", *where])
    if sort in ("newest", "oldest"):
        direction = "DESC" if sort == "newest" else "ASC"
        order = f"m.timestamp {direction}, {{index}}.rank"  # {index}: replaced below
        key: Callable[[dict[str, Any]], Any] = (
            (lambda r: (-r["timestamp"], r["score"])) if sort == "newest"
            else (lambda r: (r["timestamp"], r["score"])))
    else:
        order = "{index}.rank"
        key = lambda r: (r["score"], r["id"])  # noqa: E731
    found: dict[int, dict[str, Any]] = {}
    for index in ("messages_fts", "messages_tools"):
        sql = _SEARCH.format(index=index, tokens=int(snippet_tokens),
                             clauses=clauses.replace("{index}", index),
                             order=order.replace("{index}", index))
        for r in conn.execute(sql, [match, *params, int(limit) + int(offset)]).fetchall():
            found.setdefault(int(r["id"]), dict(r))
    return sorted(found.values(), key=key)[int(offset):int(offset) + int(limit)]


def like_search(conn: sqlite3.Connection, tokens: Sequence[str], *, where: Sequence[str],
                params: Sequence[Any], limit: int, offset: int) -> list[dict[str, Any]]:
    """Messages holding any of ``tokens`` as a substring (content, tool name or calls),
    newest first: for text the word index does not split (short CJK queries)."""
    clauses, like = [], []
    for token in tokens:
        esc = token.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        clauses.append("(m.content LIKE ? ESCAPE '\\' OR m.tool_name LIKE ? ESCAPE '\\' "
                       "OR m.tool_calls LIKE ? ESCAPE '\\')")
        like += [f"%{esc}%"] * 3
    condition = " AND ".join([f"({' OR '.join(clauses)})", *where])
    rows = conn.execute(
        f"""SELECT m.id, m.session_id, m.role,
                   substr(m.content, max(1, instr(m.content, ?) - 40), 120) AS snippet,
                   m.content, m.timestamp, m.tool_name, s.source, s.model,
                   s.started_at AS session_started, 0.0 AS score
            FROM messages AS m JOIN sessions AS s ON s.id = m.session_id
            WHERE {condition}
            ORDER BY m.timestamp DESC
            LIMIT ? OFFSET ?""", [tokens[0], *like, *params, int(limit), int(offset)]
    ).fetchall()
    return [dict(r) for r in rows]


def context(conn: sqlite3.Connection, message_id: int) -> list[sqlite3.Row]:
    """The message before ``message_id`` in its session, the message, and the one after
    (by id: insertion order), each its role, content and fields."""
    return conn.execute(
        """WITH t AS (SELECT session_id FROM messages WHERE id = :id)
           SELECT role, content, fields FROM messages WHERE id = (
               SELECT max(id) FROM messages WHERE session_id = (SELECT session_id FROM t)
               AND id < :id)
           UNION ALL SELECT role, content, fields FROM messages WHERE id = :id
           UNION ALL SELECT role, content, fields FROM messages WHERE id = (
               SELECT min(id) FROM messages WHERE session_id = (SELECT session_id FROM t)
               AND id > :id)""", {"id": message_id}).fetchall()


def table_exists(conn: sqlite3.Connection, name: str) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE name = ?",
                        (name,)).fetchone() is not None


def unique(values: Iterable[Any]) -> list[str]:
    """The non-empty strings of ``values``, each once, in their order."""
    return list(dict.fromkeys(v for v in values if isinstance(v, str) and v))
