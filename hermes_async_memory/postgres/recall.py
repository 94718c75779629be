"""Recall from the shared PostgreSQL store: the user's (else the session's) messages that
match a query, through the generated ``search`` column's GIN index, rendered as the local
store's recall block (``recall.query.render_hits``).

The query's words are the local recall's (``recall.query.query_terms``), folded as the
'simple' configuration folds them (lower case, accents kept), each passed as its own
``plainto_tsquery`` parameter: never query syntax.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ..backends.base import RecallRequest
from ..recall.query import query_terms, render_hits
from ..settings import Settings
from ..store.messages import Hit
from ..turns import scope_token_for

RECALL_TIMEOUT_S = 2.0
# Characters of a message read back for a recall's snippet.
SNIPPET_SOURCE_CHARS = 20_000
_WORD = re.compile(r"\w+")
# The scope token (weight A) and any of the terms, through the GIN index; the user (or
# session) is checked again on the row, so a word that happens to equal a scope token never
# lets another user's row in.
RECALL = """
SELECT id, session_id, role, timestamp, left(content, {chars}) AS content
FROM messages
WHERE search @@ (plainto_tsquery('simple', $1) && ({terms}))
  AND {column} = $2
ORDER BY ts_rank(search, {terms}) DESC, id DESC
LIMIT $3
"""


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
    tsquery = " || ".join(f"plainto_tsquery('simple', ${i + 4})" for i in range(len(terms)))
    sql = RECALL.format(chars=SNIPPET_SOURCE_CHARS, terms=f"({tsquery})", column=column)
    rows = await pool.fetch(sql, scope_token_for(request.user_id, request.session_id), owner,
                            request.limit, *terms, timeout=RECALL_TIMEOUT_S)
    tokens = settings.recall_snippet_tokens
    return render_hits(Hit(r["id"], r["session_id"], r["role"], r["timestamp"],
                           snippet(r["content"] or "", terms, tokens)) for r in rows)


def snippet(content: str, terms: Sequence[str], tokens: int) -> str:
    """Up to ``tokens`` words of ``content`` around the first that matches a term, with
    ``…`` where it was cut (as the local store's FTS5 snippet)."""
    words = content.split()
    wanted = set(terms)
    at = next((i for i, w in enumerate(words)
               if any(part.lower() in wanted
                      for found in _WORD.findall(w) for part in found.split("_"))), 0)
    start = max(0, min(at - tokens // 4, len(words) - tokens))
    piece = " ".join(words[start:start + tokens])
    return f"{'…' if start > 0 else ''}{piece}{'…' if start + tokens < len(words) else ''}"
