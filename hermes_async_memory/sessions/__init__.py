"""The session store (seed 001's ``SessionDB``) over the pipeline's store, as
``pipeline.sessions`` (``api.SessionStore``): ``search`` (user text into a safe, scoped FTS5
query), ``reads`` (search, listings, one session, its messages and conversation, its parent
chain, counts; ``open_session_reads`` for a store file read-only), ``lifecycle`` (describe,
end, delete, prune, through the outbox) and ``transfer`` (export as JSON lines, import
back)."""

from __future__ import annotations

from .api import SessionStore
from .lifecycle import InvalidSessionError, PruneResult, SessionWrites
from .reads import (
    BlockingSessionReads,
    ContextMessage,
    FileSessionReads,
    SearchHit,
    SessionChain,
    SessionCounts,
    SessionInfo,
    SessionReads,
    open_session_reads,
)
from .search import SYNTAXES, InvalidSearchError
from .transfer import (
    ExportLine,
    ImportIncompleteError,
    ImportLimitError,
    ImportLimits,
    ImportResult,
    InvalidImportError,
)

__all__ = ["SYNTAXES", "BlockingSessionReads", "ContextMessage", "ExportLine",
           "FileSessionReads", "ImportIncompleteError", "ImportLimitError", "ImportLimits",
           "ImportResult", "InvalidImportError", "InvalidSearchError", "InvalidSessionError",
           "PruneResult", "SearchHit", "SessionChain", "SessionCounts", "SessionInfo",
           "SessionReads", "SessionStore", "SessionWrites", "open_session_reads"]
