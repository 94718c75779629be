"""Recall: queued recalls, the searches that answer them, and the cache prefetch() reads.

    queue_prefetch ──► RecallService (latest query per (user, session), bounded) ──► recaller
                          │  local: scoped BM25 over the store, or the backend's own recall
                          │  producer: a request the worker answers (shared/recall.py)
                          ▼
                       RecallCache ◄── commits (recent turns), warm-ups (stored recent turns)
    prefetch ──► RecallCache (a dict lookup)

``preview_prefetch`` builds, from the store alone, the block a recall would leave there, each
line with its source (for an inspector).
"""

from __future__ import annotations

from .cache import PrefetchStatus, RecallCache
from .preview import PrefetchPreview, PreviewLine, preview_prefetch
from .query import fold, match_expression, query_terms, quote, render_hits

__all__ = [
    "PrefetchPreview",
    "PrefetchStatus",
    "PreviewLine",
    "RecallCache",
    "fold",
    "match_expression",
    "preview_prefetch",
    "query_terms",
    "quote",
    "render_hits",
]
