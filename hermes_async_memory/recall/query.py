"""Recall: turn a user's query into a safe, scoped FTS5 expression, and hits into a block.

Raw text inside MATCH is query syntax (``"``, ``*``, ``NEAR(``, ``AND``, ``-``, ``:``), so every
token is quoted. Stopwords (the Snowball English list) are left out, and so are terms
matching more rows than a threshold: bm25 scores every matching row before LIMIT, so one
common word over a million rows costs milliseconds. The scope token (the user's, else the
session's) is ANDed in, so FTS5 intersects posting lists and ranks only the caller's own
rows.

The block shows whole messages, not fragments: each hit with the messages around it in its
session (the answer is often the reply to the message that matched), ranked by the hit's
bm25 plus a share of its neighbours', within a budget of characters (``fill_lines``).
"""

from __future__ import annotations

import functools
import re
import threading
import time
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import snowballstemmer
from stopwords import get_stopwords

from ..fence import DEFAULT_FENCE, Fence
from ..store import Hit, PoolRow, Said
from .cache import RECALL_HEADER

# A word, with the apostrophes inside it ("don't"): a stopword is matched whole, else its
# parts are the terms.
_WORD = re.compile("\\w+(?:['\u2019]\\w+)*")
_PART = re.compile(r"\w+")
MAX_QUERY_CHARS = 4096
STOPWORDS = frozenset(w.replace("\u2019", "'") for w in get_stopwords("english") if w)
# How much of its neighbours' scores a hit's rank takes (their bm25, when they match too).
NEIGHBOUR_SHARE = 0.6
# The hits ranked for a recall of ``limit``: ``max(POOL_MIN, POOL_PER_HIT * limit)``.
POOL_PER_HIT = 2
POOL_MIN = 10
SHOWN_PER_HIT = 2
# A message longer than this shows as this much of it, around its first matching word.
MESSAGE_CHARS = 600
_LEAD = 150  # characters kept before that word
_local = threading.local()


def fold(term: str) -> str:
    """Lower-case and strip diacritics, as the unicode61 tokenizer does."""
    term = term.casefold()
    if term.isascii():
        return term
    decomposed = unicodedata.normalize("NFKD", term)
    return "".join(c for c in decomposed if not unicodedata.combining(c))


@functools.lru_cache(maxsize=16_384)
def stem(term: str) -> str:
    """``term`` (folded) as the word index's porter tokenizer stems it, for comparing with
    the index's vocabulary. One stemmer per thread: the stemmer keeps state. Cached: a
    query's words recur, and a stem costs ~5 µs."""
    stemmer = getattr(_local, "stemmer", None)
    if stemmer is None:
        stemmer = _local.stemmer = snowballstemmer.stemmer("porter")
    return str(stemmer.stemWord(term))


def query_terms(query: str, frequent: frozenset[str], max_terms: int,
                fold: Callable[[str], str] = fold, stems: bool = True) -> list[str]:
    """Distinct, searchable terms of ``query``, rarest-looking (longest) first, each folded
    as the index folds its words (``fold``: FTS5's unicode61 by default). Stopwords are
    left out, and so are the ``frequent`` terms of the index's vocabulary: compared by their
    stem when the index stems (``stems``), so "running" and "runs" are one term."""
    seen: dict[str, str] = {}
    for word in _WORD.findall(query[:MAX_QUERY_CHARS]):
        if fold(word).replace("\u2019", "'") in STOPWORDS:
            continue
        for raw in _PART.findall(word):
            for part in raw.split("_"):
                if not part:
                    continue
                term = fold(part)
                if not term or term in STOPWORDS:
                    continue
                key = stem(term) if stems else term
                if key not in frequent:
                    seen.setdefault(key, term)
    terms = sorted(seen.values(), key=len, reverse=True)
    return terms[:max_terms]


def all_frequent(query: str, frequent: frozenset[str], *, stems: bool = True,
                 max_terms: int = 64) -> bool:
    """Whether every word of ``query`` is a stopword or one of the index's ``frequent``
    terms (compared by stem when the index stems): ranking what matches it means ranking
    much of the store. False for a query without words."""
    if not _PART.search(query[:MAX_QUERY_CHARS]):
        return False
    terms = query_terms(query, frozenset(), max_terms, stems=stems)
    keys = {stem(t) for t in terms} if stems else set(terms)
    return frequent.issuperset(keys)


def quote(term: str) -> str:
    return '"' + term.replace('"', '""') + '"'


def match_expression(terms: Sequence[str], scope_token: str) -> str:
    """``scope:"u…" AND content:("a" OR "b")`` — every piece quoted."""
    ors = " OR ".join(quote(t) for t in terms)
    return f"scope:{quote(scope_token)} AND content:({ors})"


def pool_size(limit: int) -> int:
    """How many ranked messages a recall of ``limit`` hits reads: their scores rank the
    windows of the best ``shown_size(limit)``."""
    return max(POOL_MIN, POOL_PER_HIT * limit)


def shown_size(limit: int) -> int:
    """How many of the best messages a recall of ``limit`` hits may show, with the
    messages beside them."""
    return SHOWN_PER_HIT * limit


def rank_windows(pool: Sequence[PoolRow]) -> list[PoolRow]:
    """The pool's hits, best first by their window's score: a hit's bm25 plus
    ``NEIGHBOUR_SHARE`` of the bm25 of the messages before and after it in its session,
    when those are in the pool too. Ties keep bm25's order."""
    score = {row.message_id: -row.rank for row in pool}
    def window(row: PoolRow) -> float:
        around = score.get(row.before or 0, 0.0) + score.get(row.after or 0, 0.0)
        return -row.rank + NEIGHBOUR_SHARE * around
    return sorted(pool, key=window, reverse=True)


def _clip_text(text: str, terms: Sequence[str]) -> str:
    """A long message as ``MESSAGE_CHARS`` of it around the first of ``terms`` it holds (a
    term's stem-like prefix, case-folded); else its start. On one line."""
    text = " ".join(text.split())
    if len(text) <= MESSAGE_CHARS:
        return text
    folded = text.casefold()
    found = [i for t in terms if (i := folded.find(t[:max(4, len(t) - 2)])) >= 0]
    start = max(0, min(found) - _LEAD) if found else 0
    piece = text[start:start + MESSAGE_CHARS - 2]
    return ("…" if start else "") + piece + ("…" if start + len(piece) < len(text) else "")


def fill_lines(ranked: Sequence[PoolRow], texts: Mapping[int, tuple[str, float, str]],
               terms: Sequence[str], *, limit: int, budget: int) -> list[Hit]:
    """The recall's hits: up to ``limit`` of ``ranked`` whose text fits in ``budget``
    characters, best first, each the middle of a run of its session's messages. A ranked
    message right beside a run already chosen joins that run instead of making a line of
    its own; then each run takes the message after it and the one before it, line by line
    in rank order, while the budget lasts. A message shows once. ``texts``: role,
    timestamp and content of each message id."""
    rows = {row.message_id: row for row in ranked}
    used: set[int] = set()
    size = 0
    lines: list[_Run] = []
    ends: dict[int, tuple[_Run, str]] = {}  # the message beside a run's end -> (run, side)

    def said(message_id: int) -> tuple[Said, int] | None:
        if message_id in used or message_id not in texts:
            return None
        role, _, content = texts[message_id]
        text = _clip_text(content, terms)
        return (Said(message_id, role, text), len(text) + len(role) + SAID_COST) if text \
            else None

    def grow(run: _Run, side: str, message: Said) -> None:
        used.add(message.message_id)
        ends.pop(message.message_id, None)
        row = rows.get(message.message_id)
        if side == "after":
            run.after.append(message)
            run.last = row.after if row is not None else None
            if run.last is not None:
                ends.setdefault(run.last, (run, "after"))
        else:
            run.before.insert(0, message)
            run.first = row.before if row is not None else None
            if run.first is not None:
                ends.setdefault(run.first, (run, "before"))

    for row in ranked:
        if len(lines) >= limit:
            break
        found = said(row.message_id)
        if found is None:
            continue
        message, cost = found
        end = ends.get(row.message_id)
        if end is not None:
            if size + cost <= budget:
                size += cost
                grow(end[0], end[1], message)
            continue
        cost += LINE_COST - SAID_COST - len(message.role)
        if size + cost > budget:
            continue
        size += cost
        used.add(row.message_id)
        run = _Run(row, message, first=row.before, last=row.after)
        lines.append(run)
        for side, other in (("after", row.after), ("before", row.before)):
            if other is not None:
                ends.setdefault(other, (run, side))
    for run in lines:
        for side in ("after", "before"):
            other = run.last if side == "after" else run.first
            found = None if other is None else said(other)
            if found is not None and size + found[1] <= budget:
                size += found[1]
                grow(run, side, found[0])
    hits = []
    for run in lines:
        role, timestamp, _ = texts[run.row.message_id]
        hits.append(Hit(run.row.message_id, run.row.session_id, role, timestamp,
                        run.hit.text, before=tuple(run.before), after=tuple(run.after)))
    return hits


@dataclass(slots=True)
class _Run:
    """A line being filled: its hit, the messages before and after it (session order), and
    the ids beside the run's two ends (None: the session's end, or not known)."""

    row: PoolRow
    hit: Said
    first: int | None
    last: int | None
    before: list[Said] = field(default_factory=list)
    after: list[Said] = field(default_factory=list)


# What a line costs beyond its messages' text: "- [YYYY-MM-DD role] " and the newline; each
# message beside the hit: " | ", its role and ": ".
LINE_COST = 30
SAID_COST = 5


def hit_lines(hits: Iterable[Hit], fence: Fence = DEFAULT_FENCE
              ) -> Iterator[tuple[str, Hit]]:
    """Each hit's line of the recall block, in rank order, with the hit it shows: its day,
    then the message before it, the hit and the message after it, each with its role. A
    hit whose words an earlier one already gave is left out. Each message's text has the
    ``fence`` tags made inert, after any cut (a tag's start at a cut included)."""
    inert = fence.neutralize
    seen = set()
    for h in hits:
        snippet = inert(" ".join(h.snippet.split()))
        if snippet in seen:
            continue  # the same words said twice add nothing to the context
        seen.add(snippet)
        day = time.strftime("%Y-%m-%d", time.gmtime(h.timestamp))
        if not h.before and not h.after:
            yield f"- [{day} {h.role}] {snippet}", h
            continue
        parts = [f"{s.role}: {inert(s.text)}" for s in h.before]
        parts.append(f"{h.role}: {snippet}")
        parts += [f"{s.role}: {inert(s.text)}" for s in h.after]
        yield f"- [{day}] " + " | ".join(parts), h


def render_hits(hits: Iterable[Hit], *, now: float | None = None,
                fence: Fence = DEFAULT_FENCE) -> str:
    """A compact block: one line a hit, best first, the ``fence`` tags in it made inert."""
    lines = [line for line, _ in hit_lines(hits, fence)]
    if not lines:
        return ""
    return RECALL_HEADER + "\n" + "\n".join(lines)


def with_procedural(block: str, procedural: str) -> str:
    """A recall's block: its hits (or a backend's block), then the session's procedural
    block after a blank line."""
    if not procedural:
        return block
    return f"{block}\n\n{procedural}" if block else procedural
