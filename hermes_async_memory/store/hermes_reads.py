"""Synchronous reads in the shapes of Hermes Agent's session store (its ``hermes_state``), on
a plain ``sqlite3`` connection of the caller's: what ``hermes.state.SessionDB`` answers
with. The tables are ours; their Hermes-named columns (``schema.SESSION_COLUMNS`` and the
messages' generated columns) mean what Hermes's mean, so most reads are Hermes's own
questions asked of our rows.

A message's content comes back as it was given: the structured (list or dict) content, or
text holding NUL or a lone surrogate, lives in its ``fields`` (``turns.message_row``).
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Sequence
from typing import Any

# The columns of Hermes Agent 0.19's messages table, in its order: what its get_messages
# returns for each row (``fields`` is read beside them to give content back as given).
MESSAGE_COLUMNS = (
    "id", "session_id", "role", "content", "tool_call_id", "tool_calls", "tool_name",
    "effect_disposition", "timestamp", "token_count", "finish_reason", "reasoning",
    "reasoning_content", "reasoning_details", "codex_reasoning_items", "codex_message_items",
    "platform_message_id", "observed", "active", "compacted", "api_content",
)
_MESSAGE_SELECT = ", ".join(MESSAGE_COLUMNS) + ", fields"
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
# What a conversation projection reads of each message.
CONVERSATION_COLUMNS = (
    "session_id, role, content, tool_call_id, tool_calls, tool_name, effect_disposition, "
    "finish_reason, reasoning, reasoning_content, reasoning_details, codex_reasoning_items, "
    "codex_message_items, platform_message_id, observed, timestamp, api_content, fields")
# A lineage is followed this many sessions up (a cycle ends it sooner).
MAX_LINEAGE = 100


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


def message_rows(conn: sqlite3.Connection, session_id: str, *, include_inactive: bool = False,
                 limit: int | None = None, offset: int = 0) -> list[dict[str, Any]]:
    """A session's messages in id order, Hermes's columns, content as given and tool calls
    decoded (as Hermes's get_messages)."""
    sql = (f"SELECT {_MESSAGE_SELECT} FROM messages WHERE session_id = ?"
           f"{'' if include_inactive else ' AND active = 1'} ORDER BY id")
    params: list[Any] = [session_id]
    if limit is not None or offset:
        sql += " LIMIT ? OFFSET ?"
        params += [-1 if limit is None else int(limit), int(offset)]
    out = []
    for r in conn.execute(sql, params).fetchall():
        row = dict(r)
        fields = row.pop("fields")
        given = json.loads(fields) if fields else {}
        if "content" in given:
            row["content"] = given["content"]
        if "tool_call_id" in given and row["tool_call_id"] is None:
            row["tool_call_id"] = given["tool_call_id"]
        if row["tool_calls"]:
            try:
                row["tool_calls"] = json.loads(row["tool_calls"])
            except ValueError:
                row["tool_calls"] = []
        out.append(row)
    return out


def conversation_rows(conn: sqlite3.Connection, session_ids: Sequence[str], *,
                      include_inactive: bool = False) -> list[sqlite3.Row]:
    """The rows of ``session_ids``' messages a conversation projection reads, in id order."""
    marks = ",".join("?" * len(session_ids))
    return conn.execute(
        f"SELECT {CONVERSATION_COLUMNS} FROM messages WHERE session_id IN ({marks})"
        f"{'' if include_inactive else ' AND active = 1'} ORDER BY id",
        list(session_ids)).fetchall()


def given_content(row: sqlite3.Row | dict[str, Any]) -> Any:
    """A message's content as it was given (its fields hold it when the column does not)."""
    fields = row["fields"]
    if fields and '"content"' in fields:
        given = json.loads(fields)
        if "content" in given:
            return given["content"]
    return row["content"]


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
    prefix = prefix.rstrip("/\\") or prefix
    return "(s.cwd = ? OR s.cwd LIKE ? OR s.cwd LIKE ?)", [prefix, f"{prefix}/%", f"{prefix}\\%"]


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


def title_holder(conn: sqlite3.Connection, title: str, session_id: str) -> str | None:
    row = conn.execute("SELECT id FROM sessions WHERE title = ? AND id != ?",
                       (title, session_id)).fetchone()
    return None if row is None else str(row[0])


def search(conn: sqlite3.Connection, match: str, *, where: Sequence[str],
           params: Sequence[Any], order: str, limit: int, offset: int,
           snippet_tokens: int = 40) -> list[dict[str, Any]]:
    """Messages matching ``match`` (an FTS5 expression the caller made safe), with their
    session's source and model, a snippet (``>>>`` match ``<<<``) and the content (for the
    context); ``where`` on aliases ``m`` (messages) and ``s`` (sessions).

    Raises:
        sqlite3.OperationalError: SQLite refused the expression.
    """
    clauses = " AND ".join(["messages_fts MATCH ?", *where])
    rows = conn.execute(
        f"""SELECT m.id, m.session_id, m.role,
                   snippet(messages_fts, 0, '>>>', '<<<', '...', {int(snippet_tokens)})
                       AS snippet,
                   m.content, m.timestamp, m.tool_name, s.source, s.model,
                   s.started_at AS session_started
            FROM messages_fts
            JOIN messages AS m ON m.id = messages_fts.rowid
            JOIN sessions AS s ON s.id = m.session_id
            WHERE {clauses}
            ORDER BY {order}
            LIMIT ? OFFSET ?""", [match, *params, int(limit), int(offset)]).fetchall()
    return [dict(r) for r in rows]


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
                   s.started_at AS session_started
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
