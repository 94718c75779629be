"""How a session ended, judged by stated rules, and the warm vs cold numbers: pure data and
functions for ``templates.store``.

The rules, first that applies wins (``TemplateSettings``):
  1. explicit feedback (``True`` / ``False``);
  2. an end reason in ``failure_reasons`` (trimmed, case aside): a failure;
  3. a share of failed tool calls above ``max_error_rate`` (the session's calls in the
     tool-call log; a session without calls has no rate): a failure;
  4. otherwise a success.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

from .model import Example, TemplateSettings

FEEDBACK, REASON, TOOL_ERRORS, DEFAULT = "feedback", "reason", "tool_errors", "default"
AUTO_PREFIX = "auto"
_NAME_SAFE = re.compile(r"[^\w.-]+")
SESSION_IN_NAME_CHARS = 40  # a longer session id is named by its hash


def judge_session(settings: TemplateSettings, *, feedback: bool | None, reason: str | None,
                  calls: int, errors: int) -> tuple[bool, str]:
    """(ok, the rule that decided: "feedback", "reason", "tool_errors" or "default")."""
    if feedback is not None:
        return feedback, FEEDBACK
    if reason is not None and reason.strip().lower() in settings.failure_reasons:
        return False, REASON
    if calls and errors / calls > settings.max_error_rate:
        return False, TOOL_ERRORS
    return True, DEFAULT


def examples_signature(examples: Iterable[Example]) -> str:
    """The set of (tool, arguments) of ``examples`` as a short hash: equal for two templates
    whose examples are the same calls, whatever their order, results and ids."""
    pairs = sorted({json.dumps([e.tool, dict(e.arguments)], sort_keys=True,
                               ensure_ascii=False) for e in examples})
    text = "\n".join(pairs).encode("utf-8", "surrogatepass")
    return hashlib.blake2b(text, digest_size=16).hexdigest()


def auto_name(task_type: str, session_id: str) -> str:
    """The name of the template made automatically from a session: ``auto-<type>-<session>``,
    the session id as it is when it is short and plain, else its hash."""
    plain = _NAME_SAFE.sub("-", session_id).strip("-")
    if plain != session_id or len(plain) > SESSION_IN_NAME_CHARS:
        plain = hashlib.blake2b(session_id.encode("utf-8", "surrogatepass"),
                                digest_size=6).hexdigest()
    return f"{AUTO_PREFIX}-{task_type}-{plain}"


@dataclass(frozen=True, slots=True)
class SessionOutcome:
    """What ``TemplateStore.end`` recorded for a session."""

    session_id: str
    template: str | None  # the template it started from; None: a cold start
    task_type: str
    ok: bool
    rule: str  # which rule decided (see the module's docstring)
    reason: str | None
    calls: int  # the session's tool calls in the log
    errors: int  # of those, failures
    first_calls: int  # tool calls of its first ``first_turns`` turns
    first_errors: int
    created: str | None = None  # the template made from it automatically, if one was

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class StartStats:
    """The sessions of a task type that started one way (warm or cold).

    ``measured`` are the ended ones with at least one tool call in their first turns; their
    ``avg_error_rate`` is the mean of each one's first-turn error rate (every session
    weighs the same), ``pooled_error_rate`` is all their first-turn failures over all their
    first-turn calls (every call weighs the same). Both None when none is measured.
    """

    sessions: int
    ended: int
    successes: int
    measured: int
    first_calls: int
    first_errors: int
    avg_error_rate: float | None

    @property
    def pooled_error_rate(self) -> float | None:
        return self.first_errors / self.first_calls if self.first_calls else None

    @property
    def success_rate(self) -> float | None:
        return self.successes / self.ended if self.ended else None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "pooled_error_rate": self.pooled_error_rate,
                "success_rate": self.success_rate}


NO_SESSIONS = StartStats(0, 0, 0, 0, 0, 0, None)


@dataclass(frozen=True, slots=True)
class TaskTypeStats:
    """Warm against cold starts of one task type: do warm starts help?"""

    task_type: str
    warm: StartStats
    cold: StartStats

    def as_dict(self) -> dict[str, Any]:
        return {"task_type": self.task_type, "warm": self.warm.as_dict(),
                "cold": self.cold.as_dict()}
