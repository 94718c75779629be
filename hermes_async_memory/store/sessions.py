"""Reads of the sessions and their messages for the session store (seed 001's
``search_messages``, ``search_sessions``, counts): a ranked search with filters and each
hit's neighbours, listings, one session, its messages, its parent chain.

All of them run on the reader pool. The search and the chain are one statement each, so each
sees one state of the store and costs one hop to the reader's thread however many hits or
sessions it returns.

A query holding CJK text (``TextQuery``) is searched as substrings: through the trigram index
(``text_index``) when every message it can match is there, else with LIKE over the newest
``LIKE_MAX_ROWS`` messages in scope (see ``search_messages``).
"""

from __future__ import annotations

import json
import re
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

from ..turns import scope_token_for
from .connections import Connections
from .sql import fetch_dicts, where_equal
from .text_index import TOOL_INDEX, has_cjk, is_missing_trigram

# Marks around the matched words in a hit's snippet, and what stands for cut text.
SNIPPET_OPEN = ">>>"
SNIPPET_CLOSE = "<<<"
SNIPPET_ELLIPSIS = "…"
CONTEXT_CHARS = 200  # of each neighbouring message's text, shown beside a hit
# A substring search's snippet: this many characters for each word a word snippet would show
# (its text is cut by the library, not by FTS5: see _text_snippet).
TEXT_SNIPPET_CHARS_PER_TOKEN = 3
# The LIKE search (substrings too short for the trigram index, a query that can match text
# without CJK, or a SQLite without the trigram tokenizer) reads at most this many messages in
# scope, newest first, and stops at its page: a bound on a search that no index serves.
LIKE_MAX_ROWS = 200_000
TRIGRAM_MIN_CHARS = 3  # the trigram index finds no shorter substring
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
       h.snippet, h.score{extra},
       p.role AS before_role, substr(coalesce(p.content, ''), 1, {chars}) AS before_content,
       n.role AS after_role, substr(coalesce(n.content, ''), 1, {chars}) AS after_content
FROM hits AS h
LEFT JOIN messages AS p ON p.id = (
    SELECT max(id) FROM messages WHERE session_id = h.session_id AND id < h.id)
LEFT JOIN messages AS n ON n.id = (
    SELECT min(id) FROM messages WHERE session_id = h.session_id AND id > h.id)
ORDER BY {order}
"""
# A word snippet that ends in a match, cut: the match's whole text, for one whose phrase ran
# past the snippet's last word (a hyphenated word: FTS5 closes the mark where it cuts).
_MARKED = """,
       CASE WHEN substr(h.snippet, -{tail_chars}) = '{close}{ellipsis}' THEN (
           SELECT highlight(messages_fts, 0, '{open}', '{close}') FROM messages_fts
           WHERE messages_fts MATCH ? AND rowid = h.id) END AS marked"""

# A substring search (``TextQuery``): the page of hits, then where each one's first match is
# (``anchor``: the least position of a needle, ASCII case aside, as LIKE matches) and the
# text around it, which the library marks and cuts (``_text_snippet``). {source}: the rows
# and what picks them (the trigram index, or the messages in scope for LIKE).
_TEXT_SEARCH = """
WITH page AS MATERIALIZED (
    SELECT m.id, m.session_id, m.user_id, m.role, m.tool_name, m.timestamp,
           s.source, s.model, {score} AS score
    FROM {source}
    LEFT JOIN sessions AS s ON s.id = m.session_id
    WHERE {where}{filters}
    ORDER BY {page_order}
    LIMIT ? OFFSET ?
),
anchored AS MATERIALIZED (
    SELECT page.*, (SELECT min(nullif(instr(lower(m.content), j.value), 0))
                    FROM json_each(?) AS j) AS anchor
    FROM page JOIN messages AS m ON m.id = page.id
),
hits AS MATERIALIZED (
    SELECT a.*, max(1, coalesce(a.anchor, 1) - {before}) AS snippet_from,
           substr(m.content, max(1, coalesce(a.anchor, 1) - {before}), {span}) AS snippet,
           length(m.content) AS content_chars
    FROM anchored AS a JOIN messages AS m ON m.id = a.id
){neighbours}"""
_TRIGRAM_SOURCE = """messages_trgm
    JOIN messages AS m ON m.id = messages_trgm.rowid"""
# LIKE over a user's messages: their rows come from the word index's scope column, newest
# first (FTS5 walks the posting list backwards); over a session's or everyone's, from the
# messages themselves (idx_messages_session, or the table), newest first.
_USER_SOURCE = """messages_fts
    JOIN messages AS m ON m.id = messages_fts.rowid"""
_USER_FLOOR = """messages_fts MATCH ? AND messages_fts.rowid >= coalesce((
        SELECT f.rowid FROM messages_fts AS f WHERE f.messages_fts MATCH ?
        ORDER BY f.rowid DESC LIMIT 1 OFFSET {skip}), 0)"""
_SESSION_FLOOR = """m.id >= coalesce((
        SELECT id FROM messages WHERE session_id = ? ORDER BY id DESC LIMIT 1 OFFSET {skip}),
        0)"""
_ALL_FLOOR = """m.id >= coalesce((
        SELECT id FROM messages ORDER BY id DESC LIMIT 1 OFFSET {skip}), 0)"""

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


@dataclass(frozen=True, slots=True)
class Substring:
    """Messages whose text holds ``text`` (ASCII letters in either case; the trigram index
    also folds other letters), at its very start with ``initial``. Empty text: none."""

    text: str
    initial: bool = False


@dataclass(frozen=True, slots=True)
class SubstringOp:
    """``left`` and ``right`` (AND), either (OR), or ``left`` without ``right`` (NOT)."""

    op: str
    left: TextQuery
    right: TextQuery


# What a substring search looks for: a tree of literal strings (no syntax of its own).
TextQuery: TypeAlias = Substring | SubstringOp


class SessionQueries(Connections):
    """The session store's reads (rows as dicts, JSON columns as stored unless said)."""

    async def search_messages(
        self, match: str, *, sources: Sequence[str] | None = None,
        exclude_sources: Sequence[str] | None = None, roles: Sequence[str] | None = None,
        session_id: str | None = None, user_id: str | None = None, no_user: bool = False,
        limit: int = 20, offset: int = 0, snippet_tokens: int = 32, newest: bool = False,
        text: TextQuery | None = None, tool_match: str | None = None,
        marks: tuple[str, str] = (SNIPPET_OPEN, SNIPPET_CLOSE),
    ) -> list[dict[str, Any]]:
        """Messages matching ``match`` (an FTS5 expression the caller built, quoted and
        scoped), best first (bm25, then id), or with ``newest`` the latest stored first
        (FTS5 walks its index by rowid and stops at the page: no match is ranked, which is
        what a common word over everyone's messages needs), with the session's source and
        model.

        ``text``: search for these substrings instead of ``match``, for a query holding CJK
        text, which the word index does not split into words. Through the trigram index
        when every message that can match is in it (the query holds CJK text in every
        alternative: the index holds every message with CJK text) and each string of an
        AND'ed part has 3 characters or more, ranked by bm25 over that index; the parts
        with shorter strings are checked with LIKE on its hits. Otherwise (only shorter
        strings, an alternative without CJK, a SQLite without the trigram tokenizer) with
        LIKE over the newest ``LIKE_MAX_ROWS`` messages in scope, newest first, score 0.
        The snippet is cut by the library around the first match, every string marked.

        Each row: id, session_id, user_id, role, tool_name, timestamp, source, model,
        snippet (matched words between ``marks``, by default ``SNIPPET_OPEN`` and
        ``SNIPPET_CLOSE``; a phrase marked once, whole), score (bm25: lower is better), and
        the message before and after it in its own session (before_role, before_content,
        after_role, after_content; None at either end), their text cut to
        ``CONTEXT_CHARS`` characters.

        ``tool_match``: also the messages whose tool text (``text_index``: the tool index)
        matches this expression (``match`` with ``tool_text`` for its column): the same
        query over each index, the two pages merged (a message both find is its text's
        hit), the snippet of a tool hit from its tool text. Not for ``text``.

        ``sources``: only sessions from these (empty: none); ``exclude_sources``: none from
        these; ``roles``: only these roles; ``session_id``/``user_id``: only that session's
        or user's messages; ``no_user``: only messages stored without a user.

        ``marks``: (open, close) around each match instead of ``>>>`` and ``<<<``, for a
        reader that must tell a mark from stored text holding the same characters (the
        inspector asks for marks no message holds, and renders each match as HTML).

        Raises:
            ValueError: a mark is empty or holds U+0000.
            FullTextUnavailableError: the store keeps no full-text index (no FTS5).
            sqlite3.OperationalError: SQLite refused ``match`` ("fts5: syntax error ...") or
                could not read.
        """
        self.require_full_text()
        open_mark, close_mark = marks
        if not open_mark or not close_mark or "\x00" in open_mark + close_mark:
            raise ValueError("a snippet's marks must be non-empty text without U+0000")
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
        if text is not None:
            return await self._search_text(
                text, filters, params, session_id=session_id, user_id=user_id, limit=limit,
                offset=offset, chars=TEXT_SNIPPET_CHARS_PER_TOKEN * snippet_tokens,
                newest=newest, marks=marks)
        order = "h.id DESC" if newest else "h.score, h.id"
        # The marks go into the statement as SQL text (quotes doubled), as the ellipsis does.
        open_sql, close_sql = (m.replace("'", "''") for m in marks)
        marked = _MARKED.format(open=open_sql, close=close_sql, ellipsis=SNIPPET_ELLIPSIS,
                                tail_chars=len(close_mark + SNIPPET_ELLIPSIS))
        shape = dict(open=open_sql, close=close_sql, ellipsis=SNIPPET_ELLIPSIS,
                     filters="".join(f"\n      AND {f}" for f in filters),
                     neighbours=_NEIGHBOURS.format(chars=CONTEXT_CHARS, order=order,
                                                   extra=marked),
                     hit_order="m.id DESC" if newest else "messages_fts.rank, m.id",
                     page_order=("messages_fts.rowid DESC" if newest
                                 else "messages_fts.rank, messages_fts.rowid"))
        everyone = session_id is None and user_id is None and not no_user
        if everyone:  # everyone's messages
            page_join = ""
            if filters:
                page_join = _PAGE_JOIN_MESSAGES
                if sources is not None or exclude_sources:
                    page_join += _PAGE_JOIN_SESSIONS
            sql = _SEARCH_ALL.format(page_join=page_join, **shape)
        else:
            sql = _SEARCH.format(**shape)

        def arguments(expr: str, n: int, skip: int) -> list[Any]:
            if everyone:
                return [expr, *params, n, skip, snippet_tokens, expr, expr]
            return [snippet_tokens, expr, *params, n, skip, expr]

        async with self.reader() as db:
            if tool_match is None:
                rows = await fetch_dicts(db, sql, arguments(match, limit, offset))
            else:  # each index's first offset + limit hits, merged, then the page
                rows = await fetch_dicts(db, sql, arguments(match, offset + limit, 0))
                found = {r["id"] for r in rows}
                rows += [r for r in await fetch_dicts(
                    db, sql.replace("messages_fts", TOOL_INDEX),
                    arguments(tool_match, offset + limit, 0)) if r["id"] not in found]
                rows.sort(key=(lambda r: -r["id"]) if newest
                          else (lambda r: (r["score"], r["id"])))
                rows = rows[offset:offset + limit]
        for r in rows:
            marked = r.pop("marked")
            if marked is not None:
                r["snippet"] = _uncut(r["snippet"], marked, close_mark)
        return rows

    async def _search_text(
        self, text: TextQuery, filters: list[str], params: list[Any], *,
        session_id: str | None, user_id: str | None, limit: int, offset: int, chars: int,
        newest: bool, marks: tuple[str, str],
    ) -> list[dict[str, Any]]:
        """``search_messages`` for substrings: the trigram index, else LIKE (see there)."""
        # The AND'ed parts the trigram index answers (all of them or none when the query can
        # match a message without CJK text, which the index lacks), and those checked by LIKE.
        anchored = _anchored(text)
        trigram: list[TextQuery] = []
        checked: list[TextQuery] = []
        for part in _and_parts(text):
            (trigram if anchored and _trigram_fits(part) else checked).append(part)
        needles = _needles(text)
        longest = max((len(n) for n in needles), default=0)
        shape = dict(filters="".join(f"\n      AND {f}" for f in filters),
                     before=chars, span=2 * chars + longest)
        tail = [json.dumps([_ascii_lower(n) for n in needles])]
        async with self.reader() as db:
            rows = None
            if trigram:
                like_params: list[Any] = []
                likes = "".join(f"\n      AND {_like(p, like_params)}" for p in checked)
                sql = _TEXT_SEARCH.format(
                    source=_TRIGRAM_SOURCE, score="messages_trgm.rank",
                    where="messages_trgm MATCH ?" + likes,
                    page_order="m.id DESC" if newest else "messages_trgm.rank, m.id",
                    neighbours=_NEIGHBOURS.format(chars=CONTEXT_CHARS, extra=_TEXT_EXTRA,
                                                  order="h.id DESC" if newest
                                                  else "h.score, h.id"), **shape)
                match = " AND ".join(f"({_trigram(p)})" for p in trigram)
                try:
                    rows = await fetch_dicts(
                        db, sql, [match, *like_params, *params, limit, offset, *tail])
                except sqlite3.OperationalError as exc:
                    if not is_missing_trigram(exc):
                        raise
            if rows is None:
                rows = await fetch_dicts(db, *_like_search(
                    text, shape, params, session_id=session_id, user_id=user_id,
                    limit=limit, offset=offset, tail=tail))
        pattern = _needle_pattern(needles)
        for r in rows:
            r["snippet"] = _text_snippet(r, pattern, chars, marks)
        return rows

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


# -- substring searches ------------------------------------------------------------------

_TEXT_EXTRA = ", h.anchor, h.snippet_from, h.content_chars"
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def _ascii_lower(text: str) -> str:
    """As SQLite's lower() without ICU (and LIKE): ASCII letters only."""
    return text.translate(_ASCII_LOWER)


def _and_parts(node: TextQuery) -> list[TextQuery]:
    """The operands of the AND chain ``node`` heads (``node`` itself when it is no AND)."""
    return _chain(node) if isinstance(node, SubstringOp) and node.op == "AND" else [node]


def _like_search(text: TextQuery, shape: dict[str, Any], params: list[Any], *,
                 session_id: str | None, user_id: str | None, limit: int, offset: int,
                 tail: list[Any]) -> tuple[str, list[Any]]:
    """The LIKE form of a substring search: (SQL, parameters)."""
    like_params: list[Any] = []
    condition = _like(text, like_params)
    skip = LIKE_MAX_ROWS - 1
    head: list[Any]
    if session_id is not None or user_id is None:
        source, order = "messages AS m", "m.id DESC"
        if session_id is not None:
            where, head = _SESSION_FLOOR.format(skip=skip), [session_id]
        else:
            where, head = _ALL_FLOOR.format(skip=skip), []
    else:
        scope = f'scope:"{scope_token_for(user_id, None)}"'
        source, order = _USER_SOURCE, "messages_fts.rowid DESC"
        where, head = _USER_FLOOR.format(skip=skip), [scope, scope]
    sql = _TEXT_SEARCH.format(
        source=source, score="0.0", where=f"{where}\n      AND {condition}",
        page_order=order, neighbours=_NEIGHBOURS.format(
            chars=CONTEXT_CHARS, extra=_TEXT_EXTRA, order="h.id DESC"), **shape)
    return sql, [*head, *like_params, *params, limit, offset, *tail]


def _leaves(node: TextQuery) -> list[Substring]:
    out: list[Substring] = []
    stack = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, SubstringOp):
            stack += [x.right, x.left]
        else:
            out.append(x)
    return out


def _anchored(node: TextQuery) -> bool:
    """Whether every message matching ``node`` holds CJK text (so is in the trigram index)."""
    if isinstance(node, Substring):
        return has_cjk(node.text)
    if node.op == "AND":
        return _anchored(node.left) or _anchored(node.right)
    if node.op == "OR":
        return _anchored(node.left) and _anchored(node.right)
    return _anchored(node.left)  # NOT: what it keeps is the left side's


def _trigram_fits(node: TextQuery) -> bool:
    """Whether the trigram index can answer ``node``: each of its strings is long enough."""
    return all(len(leaf.text) >= TRIGRAM_MIN_CHARS for leaf in _leaves(node))


def _needles(node: TextQuery) -> list[str]:
    """The strings a hit may show, longest first: all but those after a NOT."""
    out: dict[str, None] = {}
    stack = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, Substring):
            if x.text:
                out.setdefault(x.text, None)
        elif x.op == "NOT":
            stack.append(x.left)
        else:
            stack += [x.right, x.left]
    return sorted(out, key=len, reverse=True)


def _chain(node: SubstringOp) -> list[TextQuery]:
    """The operands of the run of ``node.op`` that ``node`` heads, left to right (NOT is
    left-associative: only its left side continues the run)."""
    if node.op == "NOT":
        rights: list[TextQuery] = []
        x: TextQuery = node
        while isinstance(x, SubstringOp) and x.op == "NOT":
            rights.append(x.right)
            x = x.left
        return [x, *reversed(rights)]
    out: list[TextQuery] = []
    stack: list[TextQuery] = [node]
    while stack:
        x = stack.pop()
        if isinstance(x, SubstringOp) and x.op == node.op:
            stack += [x.right, x.left]
        else:
            out.append(x)
    return out


def _trigram(node: TextQuery) -> str:
    """``node`` as an FTS5 query of the trigram index: every string quoted (a substring),
    each run of one operator flat (FTS5's parser has a bounded stack)."""
    if isinstance(node, Substring):
        return ("^" if node.initial else "") + '"' + node.text.replace('"', '""') + '"'
    return f" {node.op} ".join(
        _trigram(x) if isinstance(x, Substring) else f"({_trigram(x)})" for x in _chain(node))


def _like(node: TextQuery, params: list[Any]) -> str:
    """``node`` as an SQL condition on ``m.content`` (LIKE), its patterns added to
    ``params``."""
    if isinstance(node, Substring):
        if not node.text:
            return "0"
        escaped = (node.text.replace("\\", "\\\\").replace("%", "\\%")
                   .replace("_", "\\_"))
        params.append(("" if node.initial else "%") + escaped + "%")
        return "m.content LIKE ? ESCAPE '\\'"
    parts = [_like(x, params) for x in _chain(node)]
    if node.op == "NOT":
        return "(" + " AND NOT ".join(parts) + ")"
    return "(" + f" {node.op} ".join(parts) + ")"


def _needle_pattern(needles: Sequence[str]) -> re.Pattern[str] | None:
    if not needles:
        return None
    return re.compile("|".join(re.escape(n) for n in needles), re.IGNORECASE)


def _text_snippet(row: dict[str, Any], pattern: re.Pattern[str] | None, chars: int,
                  marks: tuple[str, str]) -> str:
    """A substring hit's snippet: about ``chars`` characters of its text around its first
    match, every match in it between ``marks``, never one cut; ``SNIPPET_ELLIPSIS`` where
    text was left out. Takes the row's window columns out of ``row``."""
    window: str = row.pop("snippet") or ""
    start = int(row.pop("snippet_from") or 1) - 1  # where the window starts in the text
    total = int(row.pop("content_chars") or 0)
    anchor = row.pop("anchor")
    spans = [] if pattern is None else [(m.start(), m.end()) for m in pattern.finditer(window)]
    focus = 0 if anchor is None else int(anchor) - 1 - start
    first = next(((a, b) for a, b in spans if a >= focus), spans[0] if spans else (0, 0))
    lo = max(0, first[0] - chars // 4)
    hi = min(len(window), max(lo + chars, first[1]))
    lo = max(0, min(lo, hi - chars))  # near the end: more of what comes before
    for a, b in spans:  # a match is shown whole or not at all
        if a < lo < b:
            lo = a
        if a < hi < b:
            hi = b
    out = [SNIPPET_ELLIPSIS] if start + lo > 0 else []
    at = lo
    for a, b in spans:
        if a >= lo and b <= hi:
            out += [window[at:a], marks[0], window[a:b], marks[1]]
            at = b
    out.append(window[at:hi])
    if start + hi < total:
        out.append(SNIPPET_ELLIPSIS)
    return "".join(out)


def _uncut(snippet: str, marked: str, close: str) -> str:
    """``snippet`` (a word snippet ending in a ``close`` mark and an ellipsis) with its last
    match whole, from ``marked`` (the whole text, matches marked): FTS5 closes a match's mark
    where the snippet ends, inside a phrase."""
    lead = SNIPPET_ELLIPSIS if snippet.startswith(SNIPPET_ELLIPSIS) else ""
    body = snippet[len(lead):-len(close + SNIPPET_ELLIPSIS)]
    at = marked.find(body)
    end = -1 if at < 0 else marked.find(close, at + len(body))
    if not body or end < 0:
        return snippet
    end += len(close)
    return lead + marked[at:end] + (SNIPPET_ELLIPSIS if end < len(marked) else "")
