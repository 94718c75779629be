"""Procedural memory as data: a logged tool call, the fix that followed a failure, and what
the log says of a tool. The query API returns these; the formatter renders them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ArgDelta:
    """How a fixing call's arguments differ from the failed call's."""

    added: Mapping[str, Any] = field(default_factory=dict)  # key -> new value
    removed: Mapping[str, Any] = field(default_factory=dict)  # key -> old value
    changed: Mapping[str, tuple[Any, Any]] = field(default_factory=dict)  # key -> (old, new)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed)


@dataclass(frozen=True)
class ToolCall:
    """One logged tool call: an assistant ``tool_calls`` entry and the ``tool`` message that
    answered it (matched by id)."""

    id: int  # the log's row id
    call_id: str  # the tool_call id the model gave it
    tool: str
    arguments: Any  # the parsed JSON arguments (a dict, usually); the raw text when not JSON
    result: str  # a summary of the tool's answer ("" when it was never answered)
    ok: bool
    error_type: str | None  # e.g. "FileNotFoundError", "exit_code", "error"
    error_message: str | None
    duration_ms: float | None  # when the tool message reported it
    session_id: str
    user_id: str | None
    goal: str | None  # the user message that led to the call
    at: float  # when its turn was accepted (epoch seconds)
    fixed_by: int | None = None  # the id of the later call that fixed this failure
    fixes: int | None = None  # the id of the failed call this one fixed
    delta: ArgDelta | None = None  # for a fixing call: its arguments against the failure's


@dataclass(frozen=True)
class Fix:
    """A success of a tool that followed its failure within the window, with changed
    arguments."""

    failed: ToolCall
    fixed: ToolCall
    delta: ArgDelta


@dataclass(frozen=True)
class ErrorPattern:
    """A frequent error of a tool: how often, and the fix seen most for it."""

    error_type: str
    message: str  # the latest message of this type
    count: int
    typical_fix: ArgDelta | None = None
    example_fix: Fix | None = None


@dataclass(frozen=True)
class SuccessHint:
    """Arguments that worked: per argument key, its most frequent value in successes."""

    arguments: Mapping[str, Any]
    count: int  # successes it is drawn from
    goal: str | None = None  # the goal it is for, when asked per goal
    tool: str | None = None  # the tool it is for, when the question named none


@dataclass(frozen=True)
class ToolStats:
    """What the log says of one tool, for one user (or for all)."""

    tool: str
    calls: int
    successes: int
    failures: int
    avg_duration_ms: float | None
    last_at: float
    errors: tuple[ErrorPattern, ...] = ()
    hints: tuple[SuccessHint, ...] = ()

    @property
    def success_rate(self) -> float:
        return self.successes / self.calls if self.calls else 0.0
