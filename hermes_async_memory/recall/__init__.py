"""Recall: queued recalls, the searches that answer them, and the cache prefetch() reads.

    queue_prefetch ──► RecallService (latest query per (user, session), bounded) ──► recaller
                          │  local: scoped BM25 over the store, or the backend's own recall
                          │  producer: a request the worker answers (shared/recall.py)
                          ▼
                       RecallCache ◄── commits (recent turns), warm-ups (stored recent turns)
    prefetch ──► RecallCache (a dict lookup)
"""

from __future__ import annotations

from .cache import PrefetchStatus, RecallCache
from .query import fold, match_expression, query_terms, quote, render_hits

__all__ = [
    "PrefetchStatus",
    "RecallCache",
    "fold",
    "match_expression",
    "query_terms",
    "quote",
    "render_hits",
]
