"""Reads of the sessions and their messages for the session store (seed 001's
``search_messages``, ``search_sessions``, counts): a ranked search with filters and each
hit's neighbours, listings, one session, its messages, its parent chain.

All of them run on the reader pool. The search and the chain are one statement each, so each
sees one state of the store and costs one hop to the reader's thread however many hits or
sessions it returns.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from .connections import Connections
from .sql import fetch_dicts, where_equal

# Marks around the matched words in a hit's snippet, and what stands for cut text.
SNIPPET_OPEN = ">>>"
SNIPPET_CLOSE = "<<<"
SNIPPET_ELLIPSIS = "…"
CONTEXT_CHARS = 200  # of each neighbouring message's text, shown beside a hit
# A parent chain is followed this many sessions up, and down this many levels and sessions:
# a chain is a handful of sessions; the bounds only stop a cycle or a runaway tree.
MAX_ANCESTORS = 100
MAX_DESCENDANT_DEPTH = 100
MAX_DESCENDANTS = 1000

# The page of hits is picked first (MATERIALIZED: bm25 and snippet run once per hit), then
# each hit's neighbours in its own session are found through idx_messages_session, not as
# id - 1 and id + 1, which belong to whatever session committed next to it.
_SEARCH = """
WITH hits AS MATERIALIZED (
    SELECT m.id, m.session_id, m.user_id, m.role, m.tool_name, m.timestamp,
           s.source, s.model,
           snippet(messages_fts, 0, '{open}', '{close}', '{ellipsis}', ?) AS snippet,
           messages_fts.rank AS score
    FROM messages_fts
    JOIN messages AS m ON m.id = messages_fts.rowid
    LEFT JOIN sessions AS s ON s.id = m.session_id
    WHERE messages_fts MATCH ?{filters}
    ORDER BY {hit_order}
    LIMIT ? OFFSET ?
){neighbours}"""
# Everyone's messages (no user or session scope in the match): a common word matches a
# fifth of the store, and the query above joins and snippets every matching row before the
# LIMIT (1.40 s for a word in 23 % of 1M messages). Here the page is picked first, from the
# index alone when nothing but the match filters it ({page_join} empty), else joined to what
# the filters read; only then are its rows joined and given a snippet (the same match
# constrained to each rowid: a seek per hit, ~10-20 µs, which is why a scoped search, whose
# match is a few hundred rows, keeps the query above). 0.20 s for that word; bm25 ranking
# every matching row is what remains.
_SEARCH_ALL = """
WITH page AS MATERIALIZED (
    SELECT messages_fts.rowid AS id, messages_fts.rank AS score
    FROM messages_fts{page_join}
    WHERE messages_fts MATCH ?{filters}
    ORDER BY {page_order}
    LIMIT ? OFFSET ?
),
hits AS MATERIALIZED (
    SELECT m.id, m.session_id, m.user_id, m.role, m.tool_name, m.timestamp,
           s.source, s.model,
           snippet(messages_fts, 0, '{open}', '{close}', '{ellipsis}', ?) AS snippet,
           page.score
    FROM page
    CROSS JOIN messages_fts ON messages_fts.rowid = page.id
    JOIN messages AS m ON m.id = page.id
    LEFT JOIN sessions AS s ON s.id = m.session_id
    WHERE messages_fts MATCH ?
){neighbours}"""
_PAGE_JOIN_MESSAGES = "\n    JOIN messages AS m ON m.id = messages_fts.rowid"
_PAGE_JOIN_SESSIONS = "\n    LEFT JOIN sessions AS s ON s.id = m.session_id"
_NEIGHBOURS = """
SELECT h.id, h.session_id, h.user_id, h.role, h.tool_name, h.timestamp, h.source, h.model,
       h.snippet, h.score,
       p.role AS before_role, substr(coalesce(p.content, ''), 1, {chars}) AS before_content,
       n.role AS after_role, substr(coalesce(n.content, ''), 1, {chars}) AS after_content
FROM hits AS h
LEFT JOIN messages AS p ON p.id = (
    SELECT max(id) FROM messages WHERE session_id = h.session_id AND id < h.id)
LEFT JOIN messages AS n ON n.id = (
    SELECT min(id) FROM messages WHERE session_id = h.session_id AND id > h.id)
ORDER BY {order}
"""
# Up from a session: each row is an ancestor's id (nearest first) and its row, if stored.
# ``path`` holds the ids passed, so a cycle ends the walk.
_ANCESTORS = """
WITH RECURSIVE up(id, depth, path) AS (
    SELECT parent_session_id, 1, char(1) || id || char(1) FROM sessions
    WHERE id = :id AND parent_session_id IS NOT NULL AND parent_session_id != id
    UNION ALL
    SELECT s.parent_session_id, up.depth + 1, up.path || s.id || char(1)
    FROM up JOIN sessions AS s ON s.id = up.id
    WHERE s.parent_session_id IS NOT NULL AND up.depth < :max_depth
      AND instr(up.path || s.id || char(1), char(1) || s.parent_session_id || char(1)) = 0
)
SELECT up.id AS chain_id, up.depth AS chain_depth, s.*
FROM up LEFT JOIN sessions AS s ON s.id = up.id
ORDER BY up.depth
"""
# Down from a session, breadth first (the queue ordered by depth), each session once.
_DESCENDANTS = """
WITH RECURSIVE down(id, depth, path) AS (
    SELECT :id, 0, char(1) || :id || char(1)
    UNION ALL
    SELECT s.id, down.depth + 1, down.path || s.id || char(1)
    FROM down JOIN sessions AS s ON s.parent_session_id = down.id
    WHERE down.depth < :max_depth AND instr(down.path, char(1) || s.id || char(1)) = 0
    ORDER BY 2
    LIMIT :max_rows
)
SELECT down.depth AS chain_depth, s.*
FROM down JOIN sessions AS s ON s.id = down.id
WHERE down.depth > 0
ORDER BY down.depth, s.started_at, s.id
"""


class SessionQueries(Connections):
    """The session store's reads (rows as dicts, JSON columns as stored unless said)."""

    async def search_messages(
        self, match: str, *, sources: Sequence[str] | None = None,
        exclude_sources: Sequence[str] | None = None, roles: Sequence[str] | None = None,
        session_id: str | None = None, user_id: str | None = None, no_user: bool = False,
        limit: int = 20, offset: int = 0, snippet_tokens: int = 32, newest: bool = False,
    ) -> list[dict[str, Any]]:
        """Messages matching ``match`` (an FTS5 expression the caller built, quoted and
        scoped), best first (bm25, then id), or with ``newest`` the latest stored first
        (FTS5 walks its index by rowid and stops at the page: no match is ranked, which is
        what a common word over everyone's messages needs), with the session's source and
        model.

        Each row: id, session_id, user_id, role, tool_name, timestamp, source, model,
        snippet (matched words between ``SNIPPET_OPEN`` and ``SNIPPET_CLOSE``), score (bm25:
        lower is better), and the message before and after it in its own session
        (before_role, before_content, after_role, after_content; None at either end),
        their text cut to ``CONTEXT_CHARS`` characters.

        ``sources``: only sessions from these (empty: none); ``exclude_sources``: none from
        these; ``roles``: only these roles; ``session_id``/``user_id``: only that session's
        or user's messages; ``no_user``: only messages stored without a user.

        Raises:
            sqlite3.OperationalError: SQLite refused ``match`` ("fts5: syntax error ...") or
                could not read.
        """
        filters: list[str] = []
        params: list[Any] = []
        if sources is not None:
            filters.append(f"s.source IN ({_marks(sources)})")
            params.extend(sources)
        if exclude_sources:
            filters.append(f"(s.source IS NULL OR s.source NOT IN ({_marks(exclude_sources)}))")
            params.extend(exclude_sources)
        if roles is not None:
            filters.append(f"m.role IN ({_marks(roles)})")
            params.extend(roles)
        if session_id is not None:
            filters.append("m.session_id = ?")
            params.append(session_id)
        if user_id is not None:
            filters.append("m.user_id = ?")
            params.append(user_id)
        if no_user:
            filters.append("m.user_id IS NULL")
        order = "h.id DESC" if newest else "h.score, h.id"
        marks = dict(open=SNIPPET_OPEN, close=SNIPPET_CLOSE, ellipsis=SNIPPET_ELLIPSIS,
                     filters="".join(f"\n      AND {f}" for f in filters),
                     neighbours=_NEIGHBOURS.format(chars=CONTEXT_CHARS, order=order),
                     hit_order="m.id DESC" if newest else "messages_fts.rank, m.id",
                     page_order=("messages_fts.rowid DESC" if newest
                                 else "messages_fts.rank, messages_fts.rowid"))
        if session_id is None and user_id is None and not no_user:  # everyone's messages
            page_join = ""
            if filters:
                page_join = _PAGE_JOIN_MESSAGES
                if sources is not None or exclude_sources:
                    page_join += _PAGE_JOIN_SESSIONS
            sql = _SEARCH_ALL.format(page_join=page_join, **marks)
            params = [match, *params, limit, offset, snippet_tokens, match]
        else:
            sql = _SEARCH.format(**marks)
            params = [snippet_tokens, match, *params, limit, offset]
        async with self.reader() as db:
            return await fetch_dicts(db, sql, params)

    async def list_sessions(self, *, source: str | None = None, user_id: str | None = None,
                            limit: int = 50, offset: int = 0) -> list[dict[str, Any]]:
        """Sessions, newest first (``started_at``, then id), every column, model_config
        decoded."""
        where, params = where_equal(("source", source), ("user_id", user_id))
        async with self.reader() as db:
            rows = await fetch_dicts(
                db, f"SELECT * FROM sessions{where} ORDER BY started_at DESC, id "
                "LIMIT ? OFFSET ?", [*params, limit, offset])
        return [decode_session(r) for r in rows]

    async def list_users(self, *, limit: int = 50, offset: int = 0) -> list[dict[str, Any]]:
        """The users with stored sessions, by id (sessions without a user as ``None``,
        first): each with ``sessions``, ``messages``, ``tokens`` (input and output) and
        ``last_active`` (the latest ``updated_at``). Walks ``idx_sessions_user`` in order,
        so a page costs its own users' sessions, not the whole table's."""
        async with self.reader() as db:
            return await fetch_dicts(
                db, "SELECT user_id, count(*) AS sessions, sum(message_count) AS messages, "
                "sum(input_tokens + output_tokens) AS tokens, max(updated_at) AS last_active "
                "FROM sessions GROUP BY user_id ORDER BY user_id LIMIT ? OFFSET ?",
                [limit, offset])

    async def count_users(self) -> int:
        """Distinct users with stored sessions (sessions without a user count as one)."""
        async with self.reader() as db:
            rows = await fetch_dicts(
                db, "SELECT count(*) AS n FROM (SELECT 1 FROM sessions GROUP BY user_id)", [])
        return int(rows[0]["n"])

    async def get_session(self, session_id: str) -> dict[str, Any] | None:
        """The session's row, every column, model_config decoded; None when not stored."""
        async with self.reader() as db:
            rows = await fetch_dicts(db, "SELECT * FROM sessions WHERE id = ?", [session_id])
        return decode_session(rows[0]) if rows else None

    async def parent_chain(self, session_id: str
                           ) -> tuple[list[tuple[str, dict[str, Any] | None]],
                                      list[dict[str, Any]], bool]:
        """(ancestors, descendants, truncated).

        ancestors: nearest first, (id, its row or None when that session is not stored:
        the walk ends there), at most ``MAX_ANCESTORS``. descendants: every session whose
        parent chain leads to ``session_id``, breadth first (by depth, then started_at, id),
        at most ``MAX_DESCENDANTS`` down to ``MAX_DESCENDANT_DEPTH`` levels. A cycle ends
        either walk at the session it would repeat. truncated: a bound cut either walk.
        Rows are every column, model_config decoded.
        """
        async with self.reader() as db:
            up = await fetch_dicts(db, _ANCESTORS, {"id": session_id, "max_depth": MAX_ANCESTORS})
            down = await fetch_dicts(db, _DESCENDANTS, {
                "id": session_id, "max_depth": MAX_DESCENDANT_DEPTH,
                "max_rows": MAX_DESCENDANTS + 2})  # the session itself, and one to tell a cut
        ancestors: list[tuple[str, dict[str, Any] | None]] = []
        for r in up:
            chain_id = r.pop("chain_id")
            r.pop("chain_depth")
            ancestors.append((chain_id, decode_session(r) if r["id"] is not None else None))
        truncated = len(up) >= MAX_ANCESTORS and ancestors[-1][1] is not None and bool(
            ancestors[-1][1].get("parent_session_id"))
        deepest = max((r["chain_depth"] for r in down), default=0)
        if len(down) > MAX_DESCENDANTS:
            down, truncated = down[:MAX_DESCENDANTS], True
        elif deepest >= MAX_DESCENDANT_DEPTH:
            truncated = True  # the walk stopped there; there may be more below
        for r in down:
            r.pop("chain_depth")
        return ancestors, [decode_session(r) for r in down], truncated

    async def count_sessions(self, source: str | None = None, user_id: str | None = None,
                             session_id: str | None = None) -> int:
        """Sessions stored (from ``source``, of ``user_id``, with id ``session_id``)."""
        where, params = where_equal(("source", source), ("user_id", user_id), ("id", session_id))
        async with self.reader() as db:
            rows = await fetch_dicts(db, f"SELECT count(*) AS n FROM sessions{where}", params)
        return int(rows[0]["n"])

    async def count_messages(self, session_id: str | None = None, user_id: str | None = None,
                             source: str | None = None) -> int:
        """Messages stored (of ``session_id``, of ``user_id``, in sessions from ``source``)."""
        where, params = where_equal(("m.session_id", session_id), ("m.user_id", user_id),
                               ("s.source", source))
        join = " JOIN sessions AS s ON s.id = m.session_id" if source is not None else ""
        async with self.reader() as db:
            rows = await fetch_dicts(db, f"SELECT count(*) AS n FROM messages AS m{join}{where}",
                                params)
        return int(rows[0]["n"])


def decode_session(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with its model_config decoded (None when absent, or not a JSON object:
    what the host gave is shown only as the object it must be)."""
    config = row.get("model_config")
    if isinstance(config, str):
        try:
            decoded = json.loads(config)
        except ValueError:
            decoded = None
        row["model_config"] = decoded if isinstance(decoded, dict) else None
    return row


def _marks(values: Sequence[str]) -> str:
    return ",".join("?" * len(values))
