"""What the Hermes provider adds to a session's system prompt and first prefetch, as text
(all it can hand Hermes): a new session's warm start, and the user's tools' summary.

When ``TemplateSettings.warm_start`` is on, a brand-new session (nothing stored for it yet)
gets the template chosen for its task type (``warm_task_type``, or the task type the user's
recent tool calls make) and tags; its text block (``templates.warm_text``) goes out once:
through ``system_prompt_block`` while the session is new (Hermes builds the system prompt at
the session's first turn, after ``initialize`` chose), or else with its first ``prefetch``
(for a host whose system prompt was built before the choice).
Every new session is recorded as a warm or a cold start (durable at once, on the caller's
thread), and ``on_session_end`` records its outcome, which moves the template's success rate
and the warm vs cold figures (``hermes-memory templates stats``).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING

import structlog

from ..errors import HermesMemoryError, describe
from ..procedural.context import summary_block
from ..templates import Template, classify_tools, warm_text

if TYPE_CHECKING:
    from ..pipeline import MemoryPipeline
    from .runtime import Runtime

log = structlog.get_logger(__name__)

# Choosing, and reading the summary, happen as a session starts: neither may hold Hermes up
# longer than this.
CHOOSE_TIMEOUT_S = 1.0
SUMMARY_TIMEOUT_S = 1.0
END_TIMEOUT_S = 5.0
RECENT_CALLS = 100  # of the user's, whose tools say the task type when none is set


class WarmStarts:
    """The warm text of each new session, until its first prefetch has carried it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[str, str] = {}  # session -> its warm text, not yet prefetched
        self._new: dict[str, str] = {}  # session -> its warm text, for the system prompt

    def begin(self, runtime: Runtime, session_id: str, user_id: str | None) -> None:
        """Choose and record the start of ``session_id`` if it is new. Never raises: a
        session starts cold when anything fails (logged)."""
        settings = runtime.settings.templates
        if not settings.warm_start or not session_id:
            return
        try:
            chosen = runtime.call(lambda p: _choose(p, session_id, user_id),
                                  CHOOSE_TIMEOUT_S)
        except (HermesMemoryError, TimeoutError) as exc:
            log.warning("warm_start_skipped", session_id=session_id, error=describe(exc))
            return
        if chosen is None:
            return  # not a new session
        template, task_type = chosen
        pipeline = runtime.pipeline
        if pipeline is None:
            return
        try:
            pipeline.templates.start_nowait(session_id, template, task_type)
        except HermesMemoryError as exc:
            log.warning("warm_start_not_recorded", session_id=session_id, error=describe(exc))
        if template is None:
            log.info("cold_start", session_id=session_id, task_type=task_type)
            return
        # It opens the first prefetch block: its template's text is made inert as the rest.
        text = pipeline.fence.neutralize(warm_text(template, settings.warm_max_chars))
        with self._lock:
            self._pending[session_id] = text
            self._new[session_id] = text
        log.info("warm_start", session_id=session_id, template=template.name,
                 task_type=task_type)

    def system_block(self, session_id: str) -> str:
        """The warm text while ``session_id`` is new ("" otherwise); the first prefetch then
        does not repeat it."""
        with self._lock:
            text = self._new.get(session_id, "")
            if text:
                self._pending.pop(session_id, None)
            return text

    def take(self, session_id: str) -> str:
        """The warm text for the session's first prefetch, unless the system prompt carried
        it; once ("" after). The session is no longer new after it."""
        if not self._new:  # every prefetch asks: no lock when no session is new
            return ""
        with self._lock:
            self._new.pop(session_id, None)
            return self._pending.pop(session_id, "")

    def end(self, runtime: Runtime, session_id: str, reason: str) -> None:
        """Record the session's outcome (when it was started here). Never raises."""
        with self._lock:
            self._pending.pop(session_id, None)
            self._new.pop(session_id, None)
        if not runtime.settings.templates.warm_start or not session_id:
            return
        try:
            runtime.call(lambda p: p.templates.end(session_id, reason=reason,
                                                   timeout_s=END_TIMEOUT_S), END_TIMEOUT_S)
        except (HermesMemoryError, TimeoutError) as exc:
            log.warning("session_outcome_not_recorded", session_id=session_id,
                        error=describe(exc))


def tools_summary(runtime: Runtime | None, user_id: str | None) -> str:
    """With ``procedural_summary`` on, the compact summary of the user's tools ("" when off,
    empty, or not read in time). Never raises."""
    settings = runtime.settings if runtime is not None else None
    if (runtime is None or settings is None or not settings.procedural_summary
            or not settings.tool_log or settings.procedural_context is None):
        return ""
    compact = dataclasses.replace(settings.procedural_context, compact=True)
    try:
        return runtime.call(lambda p: summary_block(p.procedural, user_id, compact),
                            SUMMARY_TIMEOUT_S)
    except (HermesMemoryError, TimeoutError) as exc:
        log.warning("procedural_summary_skipped", error=describe(exc))
        return ""


async def _choose(p: MemoryPipeline, session_id: str, user_id: str | None
                  ) -> tuple[Template | None, str] | None:
    """(the template, the task type) for a new session; None when it is not new."""
    if await p.sessions.get_session(session_id) is not None:
        return None
    s = p.settings.templates
    task_type = s.warm_task_type
    if not task_type:
        calls = await p.procedural.search(user_id, limit=RECENT_CALLS)
        if not calls:
            return None, "chat"
        task_type = classify_tools((c.tool for c in calls), s)
    return await p.templates.choose(task_type, s.warm_tags), task_type
