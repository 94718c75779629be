"""Recall: turn a user's query into a safe, scoped FTS5 expression, and hits into a block.

Raw text inside MATCH is query syntax (``"``, ``*``, ``NEAR(``, ``AND``, ``-``, ``:``), so every
token is quoted. Terms matching more rows than a threshold are dropped: bm25 scores every
matching row before LIMIT, so one stopword over a million rows costs seconds. The scope token
(the user's, else the session's) is ANDed in, so FTS5 intersects posting lists and ranks only
the caller's own rows.
"""

from __future__ import annotations

import re
import time
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Sequence

from ..store import Hit
from .cache import RECALL_HEADER

_WORD = re.compile(r"\w+")
MAX_QUERY_CHARS = 4096


def fold(term: str) -> str:
    """Lower-case and strip diacritics, as the unicode61 tokenizer does."""
    term = term.casefold()
    if term.isascii():
        return term
    decomposed = unicodedata.normalize("NFKD", term)
    return "".join(c for c in decomposed if not unicodedata.combining(c))


def query_terms(query: str, frequent: frozenset[str], max_terms: int,
                fold: Callable[[str], str] = fold) -> list[str]:
    """Distinct, searchable terms of ``query``, rarest-looking (longest) first, each folded
    as the index folds its words (``fold``: FTS5's unicode61 by default)."""
    seen: dict[str, None] = {}
    for raw in _WORD.findall(query[:MAX_QUERY_CHARS]):
        for part in raw.split("_"):
            if not part:
                continue
            term = fold(part)
            if term and term not in frequent:
                seen.setdefault(term, None)
    terms = sorted(seen, key=len, reverse=True)
    return terms[:max_terms]


def quote(term: str) -> str:
    return '"' + term.replace('"', '""') + '"'


def match_expression(terms: Sequence[str], scope_token: str) -> str:
    """``scope:"u…" AND content:("a" OR "b")`` — every piece quoted."""
    ors = " OR ".join(quote(t) for t in terms)
    return f"scope:{quote(scope_token)} AND content:({ors})"


def hit_lines(hits: Iterable[Hit]) -> Iterator[tuple[str, Hit]]:
    """Each hit's line of the recall block, in rank order, with the hit it shows; a hit
    whose words an earlier one already gave is left out."""
    seen = set()
    for h in hits:
        snippet = " ".join(h.snippet.split())
        if snippet in seen:
            continue  # the same words said twice add nothing to the context
        seen.add(snippet)
        day = time.strftime("%Y-%m-%d", time.gmtime(h.timestamp))
        yield f"- [{day} {h.role}] {snippet}", h


def render_hits(hits: Iterable[Hit], *, now: float | None = None) -> str:
    """A compact block: one line a hit, newest context first by rank."""
    lines = [line for line, _ in hit_lines(hits)]
    if not lines:
        return ""
    return RECALL_HEADER + "\n" + "\n".join(lines)


def with_procedural(block: str, procedural: str) -> str:
    """A recall's block: its hits (or a backend's block), then the session's procedural
    block after a blank line."""
    if not procedural:
        return block
    return f"{block}\n\n{procedural}" if block else procedural
