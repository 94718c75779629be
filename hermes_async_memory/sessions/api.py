"""``SessionStore``: the session store of one pipeline, ``pipeline.sessions``. Its reads
(``reads``), its lifecycle writes through the outbox (``lifecycle``), and export and import
(``transfer``), in one object the host holds."""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable

from .lifecycle import SessionWrites
from .reads import SessionReads
from .transfer import IMPORT_TIMEOUT_S, ImportLimits, ImportResult, import_sessions


class SessionStore(SessionReads, SessionWrites):
    """Search, read, describe, end, delete, prune, export and import a pipeline's sessions.
    Reads are async on the pipeline's loop (``blocking()`` for other threads); the
    ``*_nowait`` writes are safe from any thread and durable when they return."""

    async def import_lines(self, lines: Iterable[str] | AsyncIterable[str], *,
                           timeout_s: float = IMPORT_TIMEOUT_S,
                           limits: ImportLimits | None = None) -> ImportResult:
        """Import export lines; returns once committed and found in the store
        (``transfer.import_sessions``: every line is checked before any is accepted)."""
        return await import_sessions(self._p, lines, timeout_s=timeout_s, limits=limits)
