"""Recall from the shared PostgreSQL store, ranked and shown as the local store's recall is.

The query's words are the local recall's (``recall.query.query_terms``: the Snowball stop
list left out), folded by the server into the lexemes of its text search configuration:
``english`` (Porter stems, as the local word index's porter tokenizer) through the
``search_stemmed`` column once its index (``schema.STEMMED_INDEX``) is built and valid,
else ``simple`` through the ``search`` column, so a database whose older rows are still
being filled keeps answering. Each
word is a parameter: never query syntax.

The candidates are the scope's messages (the user's, else the session's) holding any of the
lexemes, found through a GIN index in one statement that also returns, for each, how often
each lexeme occurs in it and its length. They are ranked here by BM25 (k1 1.2, b 0.75; the
local store's FTS5 ranks by it too): a lexeme's document frequency is counted among the
candidates, which hold every scope message that has it, over the scope's message count, so
the figures are the scope's own. (A tsvector keeps at most 256 positions of a word and
none past 16,383: counts and lengths of very long messages are under-counted.) The best
``pool_size(limit)`` are the pool; the best ``shown_size(limit)`` of them are read with the
messages before and after each in its session (of the same scope), and the block is made
by the local recall's own window ranking and line filling (``rank_windows``,
``fill_lines``): whole messages, the reply beside the question, within the block's budget of
characters.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from ..backends.base import RecallRequest
from ..fence import Fence
from ..recall.query import fill_lines, pool_size, query_terms, rank_windows, render_hits, shown_size
from ..settings import Settings
from ..store.messages import PoolRow
from ..turns import scope_token_for
from .schema import STEMMED_INDEX

RECALL_TIMEOUT_S = 2.0
# Characters of a message read back for the block (a longer one is shown in part anyway).
TEXT_CHARS = 20_000
# The candidates ranked, at most: the scope's newest that match. A scope whose messages
# match more than this many is ranked over its newest this many (each candidate's vector is
# read: this bounds a recall's time for a user with a very long history).
MAX_CANDIDATES = 2_000
BM25_K1 = 1.2
BM25_B = 0.75
# How often a database whose stemmed index is not valid yet is asked again.
STEMMED_RECHECK_S = 30.0

# {vector}: ``search_stemmed`` or ``search``; {config}: the configuration that folds the
# query's words as that vector's text was folded. Each candidate's vector is read once: the
# lexemes of the query it holds, how often each occurs, and its length (weight D: the text,
# not the scope tokens).
CANDIDATES = """
WITH lex AS (
    SELECT array_agg(DISTINCT v.lexeme) AS lexemes
    FROM unnest($3::text[]) AS t(term), unnest(to_tsvector('{config}', t.term)) AS v
), q AS (
    SELECT lexemes, (SELECT string_agg(quote_literal(l), ' | ') FROM unnest(lexemes) AS l
                    )::tsquery AS query
    FROM lex
), found AS (
    SELECT m.id, m.session_id, m.{vector} AS vec
    FROM messages AS m, q
    WHERE m.{vector} @@ (plainto_tsquery('simple', $1) && q.query) AND m.{column} = $2
    ORDER BY m.id DESC
    LIMIT {cap}
)
SELECT f.id, f.session_id,
       (SELECT count(*) FROM messages AS s WHERE s.{column} = $2) AS scope_rows,
       w.length, w.lexemes, w.counts
FROM found AS f, q, LATERAL (
    SELECT coalesce(sum(coalesce(array_length(u.positions, 1), 1))
                    FILTER (WHERE 'D' = ANY(u.weights)), 0) AS length,
           coalesce(array_agg(u.lexeme ORDER BY u.lexeme)
                    FILTER (WHERE u.lexeme = ANY(q.lexemes)), '{{}}') AS lexemes,
           coalesce(array_agg(coalesce(array_length(u.positions, 1), 1) ORDER BY u.lexeme)
                    FILTER (WHERE u.lexeme = ANY(q.lexemes)), '{{}}') AS counts
    FROM unnest(f.vec) AS u) AS w
"""
# The shown hits' texts, with the message before and after each in its session (in the
# session's stored order) that has the same scope: another user may send the same session
# id, and their messages are never shown.
SHOWN = f"""
SELECT h.id, h.role, h.timestamp, left(h.content, {TEXT_CHARS}) AS content,
       b.id AS b_id, b.role AS b_role, b.timestamp AS b_at, left(b.content, {TEXT_CHARS})
           AS b_content,
       a.id AS a_id, a.role AS a_role, a.timestamp AS a_at, left(a.content, {TEXT_CHARS})
           AS a_content
FROM messages AS h
LEFT JOIN LATERAL (
    SELECT p.id, p.role, p.timestamp, p.content FROM messages AS p
    WHERE p.session_id = h.session_id AND (p.seq, p.ordinal) < (h.seq, h.ordinal)
      AND p.scope = h.scope
    ORDER BY p.seq DESC, p.ordinal DESC LIMIT 1) AS b ON true
LEFT JOIN LATERAL (
    SELECT x.id, x.role, x.timestamp, x.content FROM messages AS x
    WHERE x.session_id = h.session_id AND (x.seq, x.ordinal) > (h.seq, h.ordinal)
      AND x.scope = h.scope
    ORDER BY x.seq, x.ordinal LIMIT 1) AS a ON true
WHERE h.id = ANY($1::bigint[])
"""
STEMMED_VALID = """
SELECT i.indisvalid FROM pg_index AS i WHERE i.indexrelid = to_regclass($1)
"""

# Per pool (the newest few; a pool cannot be weakly referenced): whether its database's
# stemmed index is valid, and when that was last asked.
_stemmed: dict[int, tuple[Any, bool, float]] = {}
_STEMMED_POOLS = 16


async def stemmed_ready(pool: Any) -> bool:
    """Whether the stemmed index is built and valid: once it is, it stays so for the pool;
    until then the database is asked again every ``STEMMED_RECHECK_S``."""
    known = _stemmed.get(id(pool))
    now = time.monotonic()
    if known is not None and known[0] is pool and (known[1]
                                                    or now - known[2] < STEMMED_RECHECK_S):
        return bool(known[1])
    ready = bool(await pool.fetchval(STEMMED_VALID, STEMMED_INDEX, timeout=RECALL_TIMEOUT_S))
    _stemmed.pop(id(pool), None)
    _stemmed[id(pool)] = (pool, ready, now)
    while len(_stemmed) > _STEMMED_POOLS:
        del _stemmed[next(iter(_stemmed))]
    return ready


async def recall_block(pool: Any, request: RecallRequest, settings: Settings) -> str:
    """The block for ``request`` ("" when nothing matches).

    Raises:
        the driver's errors (the caller maps them: ``pool.database_errors``).
    """
    terms = query_terms(request.query, frozenset(), settings.recall_max_terms, fold=str.lower,
                        stems=False)
    if not terms:
        return ""
    if request.user_id:
        column, owner = "user_id", request.user_id
    else:
        column, owner = "session_id", request.session_id
    stemmed = await stemmed_ready(pool)
    sql = CANDIDATES.format(vector="search_stemmed" if stemmed else "search",
                            config="english" if stemmed else "simple", column=column,
                            cap=MAX_CANDIDATES)
    found = await pool.fetch(sql, scope_token_for(request.user_id, request.session_id),
                             owner, terms, timeout=RECALL_TIMEOUT_S)
    if not found:
        return ""
    ranked = bm25(found)
    limit = request.limit
    best = ranked[:pool_size(limit)]
    shown = [row.message_id for row in best[:shown_size(limit)]]
    rows = await pool.fetch(SHOWN, shown, timeout=RECALL_TIMEOUT_S)
    texts: dict[int, tuple[str, float, str]] = {}
    beside: dict[int, tuple[int | None, int | None]] = {}
    for r in rows:
        texts[r["id"]] = (r["role"], r["timestamp"], r["content"] or "")
        beside[r["id"]] = (r["b_id"], r["a_id"])
        for side in ("b", "a"):
            if r[f"{side}_id"] is not None:
                texts.setdefault(r[f"{side}_id"], (r[f"{side}_role"], r[f"{side}_at"],
                                                   r[f"{side}_content"] or ""))
    candidates = [PoolRow(row.message_id, row.session_id, row.rank,
                          *beside.get(row.message_id, (None, None))) for row in best]
    windows = rank_windows(candidates)[:shown_size(limit)]
    hits = fill_lines(windows, texts, terms, limit=limit,
                      budget=settings.recall_chars_per_hit * limit)
    return render_hits(hits, fence=Fence(settings.fence_tags))


def bm25(found: Sequence[Any]) -> list[PoolRow]:
    """The candidates as pool rows, best first (rank: minus the score, as FTS5's bm25 is
    ordered); ties go to the newer message."""
    n = max(int(found[0]["scope_rows"]), len(found))
    df: Counter[str] = Counter()
    for r in found:
        df.update(r["lexemes"])
    idf = {lex: math.log(1 + (n - d + 0.5) / (d + 0.5)) for lex, d in df.items()}
    avg = sum(int(r["length"]) for r in found) / len(found) or 1.0
    rows = []
    for r in found:
        norm = BM25_K1 * (1 - BM25_B + BM25_B * int(r["length"]) / avg)
        score = sum(idf[lex] * tf * (BM25_K1 + 1) / (tf + norm)
                    for lex, tf in zip(r["lexemes"], r["counts"], strict=True))
        rows.append(PoolRow(int(r["id"]), r["session_id"], -score, None, None))
    rows.sort(key=lambda row: (row.rank, -row.message_id))
    return rows

