"""Tool calls out of a turn's messages, in the OpenAI format Hermes sends: an assistant
message's ``tool_calls`` answered by ``tool`` messages with the same ``tool_call_id``.

Success or failure of a call is decided by ``OutcomeRules``, checked in this order on the
tool message's content (read as a JSON object when it is one):
  1. an explicit status (``status`` / ``ok`` / ``success`` keys): its word decides;
  2. an error field (``error`` / ``stderr_error`` / ``exception``) that is present and not
     empty: a failure, its type taken from the field (``error_type`` or ``type`` beside it, or
     an ``XxxError:`` prefix of the text), else ``"error"``;
  3. a non-zero exit code (``exit_code`` / ``returncode`` / ``exitCode``): a failure of type
     ``"exit_code"``;
  4. exception text (a Python traceback, or a line starting ``XxxError:`` or
     ``XxxException:``) anywhere in the content: a failure of that type;
  5. otherwise a success. A call never answered is logged as a failure of type
     ``"no_result"``.
Every key list and the exception pattern are settings.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

RESULT_CHARS = 500  # of the tool's answer kept as the result summary
GOAL_CHARS = 500
ERROR_CHARS = 300
MAX_TYPE_CHARS = 40  # of an error type read from the words before a message's colon


@dataclass(frozen=True)
class OutcomeRules:
    """How a tool's answer is judged a success or a failure (see the module's docstring)."""

    status_keys: tuple[str, ...] = ("status", "ok", "success")
    failure_statuses: tuple[str, ...] = ("error", "failed", "failure", "false", "timeout")
    success_statuses: tuple[str, ...] = ("ok", "success", "succeeded", "true", "done")
    error_keys: tuple[str, ...] = ("error", "exception", "stderr_error")
    error_type_keys: tuple[str, ...] = ("error_type", "type")
    exit_code_keys: tuple[str, ...] = ("exit_code", "returncode", "exitCode")
    duration_ms_keys: tuple[str, ...] = ("duration_ms", "elapsed_ms")
    duration_s_keys: tuple[str, ...] = ("duration_s", "duration", "elapsed")
    exception_pattern: str = (
        r"(?m)^(?:Traceback \(most recent call last\)|(?:[\w.]*\.)?"
        r"(?P<type>[A-Z]\w*(?:Error|Exception)):)")

    @functools.cached_property
    def keys(self) -> frozenset[str]:
        """Every key a rule reads: an answer's object holding none of them is judged by the
        exception pattern alone."""
        return frozenset((*self.status_keys, *self.error_keys, *self.exit_code_keys,
                          *self.duration_ms_keys, *self.duration_s_keys))


_DEFAULT_PATTERN = OutcomeRules.exception_pattern
# The default pattern cannot match a text without one of these (a substring test is ~20x
# cheaper than the pattern's scan, and most answers are successes).
_DEFAULT_PATTERN_NEEDS = ("Error", "Exception", "Traceback")
_compiled = functools.lru_cache(maxsize=32)(re.compile)


class Outcome(NamedTuple):
    """A tool answer judged (a named tuple: a frozen dataclass cost ~2 µs to build, and the
    writer judges every answer of every batch)."""

    ok: bool
    error_type: str | None = None
    error_message: str | None = None
    duration_ms: float | None = None


@dataclass(frozen=True)
class CallRecord:
    """One tool call as found in a turn's messages."""

    call_id: str
    tool: str
    arguments: Any  # parsed JSON (a dict, usually); the raw text when it is not JSON
    arguments_json: str  # canonical JSON of ``arguments`` (sorted keys)
    result: str  # the answer's first RESULT_CHARS characters ("" when never answered)
    outcome: Outcome
    goal: str | None  # the user message that led to it
    answered: bool


_TYPE_PREFIX = re.compile(r"^\s*(?:[\w.]*\.)?([A-Z]\w*(?:Error|Exception))\s*:")


def judge(content: Any, rules: OutcomeRules = OutcomeRules()) -> Outcome:
    """Success or failure of a tool's answer, by ``rules``."""
    text = content if isinstance(content, str) else json.dumps(content, default=str)
    doc = _as_object(content)
    # No key a rule reads (most answers): only the pattern below can judge it.
    duration = None
    if doc is not None and not rules.keys.isdisjoint(doc):
        duration = _duration_ms(doc, rules)
        for k in rules.status_keys:
            if k in doc and isinstance(doc[k], (str, bool)):
                word = str(doc[k]).strip().lower()
                if word in rules.failure_statuses:
                    said = _error_text(doc, rules) or f"{k}={doc[k]}"
                    return Outcome(False, _error_type(doc, said, rules) or "status",
                                   said[:ERROR_CHARS], duration)
                if word in rules.success_statuses:
                    return Outcome(True, duration_ms=duration)
        message = _error_text(doc, rules)
        if message:
            return Outcome(False, _error_type(doc, message, rules) or "error",
                           message[:ERROR_CHARS], duration)
        for k in rules.exit_code_keys:
            code = doc.get(k)
            if isinstance(code, int) and not isinstance(code, bool) and code != 0:
                detail = _first_text(doc, ("stderr", "output", "stdout")) or ""
                return Outcome(False, "exit_code",
                               f"exit code {code}{': ' + detail if detail else ''}"
                               [:ERROR_CHARS], duration)
    pattern = rules.exception_pattern
    if pattern == _DEFAULT_PATTERN and not any([w in text for w in _DEFAULT_PATTERN_NEEDS]):
        return Outcome(True, duration_ms=duration)  # (the answer's text holds its fields')
    if doc is not None:  # the pattern looks at the lines of the text fields, not at JSON
        text = "\n".join(v for v in doc.values() if isinstance(v, str))
    match = _compiled(pattern).search(text)
    if match is not None:
        # A pattern of the user's may have no group named "type".
        kind: str = match.groupdict().get("type") or _last_exception_type(text) or "exception"
        lines = text[match.start():].splitlines()
        if match.group(0).startswith("Traceback"):
            tail = [x for x in text.splitlines() if x.strip()]
            lines = tail[-1:] if tail else lines
        return Outcome(False, kind, (lines[0] if lines else kind)[:ERROR_CHARS], duration)
    return Outcome(True, duration_ms=duration)


def calls_in(messages: Sequence[Mapping[str, Any]],
             rules: OutcomeRules = OutcomeRules()) -> list[CallRecord]:
    """Every tool call in ``messages``, in order, with its answer matched by id.

    A message row may carry ``tool_calls`` as a list or as its JSON text (as the store keeps
    it). Calls without a function name are skipped; a call never answered is a failure of
    type ``"no_result"``."""
    answers: dict[str, Mapping[str, Any]] = {}
    for m in messages:
        if m.get("role") == "tool" and isinstance(m.get("tool_call_id"), str):
            answers.setdefault(m["tool_call_id"], m)
    out: list[CallRecord] = []
    goal: str | None = None
    for m in messages:
        role = m.get("role")
        if role == "user":
            content = m.get("content")
            goal = content[:GOAL_CHARS] if isinstance(content, str) and content else goal
            continue
        if role != "assistant":
            continue
        for call in _tool_calls(m.get("tool_calls")):
            function = call.get("function")
            if not isinstance(function, Mapping):
                continue
            name = function.get("name")
            if not isinstance(name, str) or not name:
                continue
            call_id = call.get("id")
            call_id = call_id if isinstance(call_id, str) and call_id else f"#{len(out)}"
            arguments = _arguments(function.get("arguments"))
            answer = answers.get(call_id)
            if answer is None:
                outcome = Outcome(False, "no_result", "the call was never answered")
                result = ""
            else:
                content = answer.get("content")
                outcome = judge(content if content is not None else "", rules)
                if outcome.duration_ms is None:
                    outcome = _with_duration(outcome, answer, rules)
                result = (content if isinstance(content, str)
                          else json.dumps(content, default=str))[:RESULT_CHARS]
            out.append(CallRecord(
                call_id=call_id, tool=name, arguments=arguments,
                arguments_json=json.dumps(arguments, sort_keys=True, default=str,
                                          ensure_ascii=False),
                result=result, outcome=outcome, goal=goal, answered=answer is not None))
    return out


def _tool_calls(value: Any) -> list[Mapping[str, Any]]:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return []
    if not isinstance(value, list):
        return []
    return [c for c in value if isinstance(c, Mapping)]


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value if value is not None else {}


def _as_object(content: Any) -> Mapping[str, Any] | None:
    if isinstance(content, Mapping):
        return content
    if isinstance(content, str) and content.lstrip().startswith("{"):
        try:
            doc = json.loads(content)
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None
    return None


def _error_text(doc: Mapping[str, Any], rules: OutcomeRules) -> str | None:
    for k in rules.error_keys:
        v = doc.get(k)
        if v is None or v is False or v == "" or v == {} or v == []:
            continue
        if isinstance(v, Mapping):
            inner = v.get("message")
            return str(inner) if inner else json.dumps(v, default=str)
        return str(v)
    return None


def _error_type(doc: Mapping[str, Any], message: str, rules: OutcomeRules) -> str | None:
    for k in rules.error_type_keys:
        v = doc.get(k)
        if isinstance(v, str) and v and v.lower() not in ("error", "ok", "result"):
            return v
    for k in rules.error_keys:
        v = doc.get(k)
        if isinstance(v, Mapping) and isinstance(v.get("type"), str):
            return str(v["type"])
    match = _TYPE_PREFIX.match(message)
    if match:
        return match.group(1)
    # "File not found: x.py" (Hermes's tools): the words before the colon name the error.
    kind, sep, _ = message.partition(":")
    kind = " ".join(kind.split())
    if sep and 3 <= len(kind) <= MAX_TYPE_CHARS and any(c.isalpha() for c in kind) and (
            "/" not in kind and "\\" not in kind):
        return kind
    return None


def _last_exception_type(text: str) -> str | None:
    for line in reversed(text.splitlines()):
        match = _TYPE_PREFIX.match(line)
        if match:
            return match.group(1)
    return None


def _first_text(doc: Mapping[str, Any], keys: tuple[str, ...]) -> str | None:
    for k in keys:
        v = doc.get(k)
        if isinstance(v, str) and v.strip():
            return v.strip().splitlines()[-1][:200]
    return None


def _duration_ms(doc: Mapping[str, Any], rules: OutcomeRules) -> float | None:
    """The duration an answer reports, in milliseconds: finite only. An infinite one (JSON
    reads ``1e999`` as inf; ``1e308`` seconds overflows in milliseconds) has no JSON form,
    and the outcomes go to the commit as JSON: it would fail the turn's batch."""
    for keys, scale in ((rules.duration_ms_keys, 1.0), (rules.duration_s_keys, 1000.0)):
        for k in keys:
            v = doc.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0:
                try:
                    ms = float(v) * scale
                except OverflowError:  # an integer past a float's range
                    continue
                if math.isfinite(ms):
                    return ms
    return None


def _with_duration(outcome: Outcome, message: Mapping[str, Any],
                   rules: OutcomeRules) -> Outcome:
    duration = _duration_ms(message, rules)
    if duration is None:
        return outcome
    return Outcome(outcome.ok, outcome.error_type, outcome.error_message, duration)


def arg_delta(before: Any, after: Any) -> tuple[dict[str, Any], dict[str, Any],
                                                  dict[str, tuple[Any, Any]]]:
    """(added, removed, changed) from ``before``'s arguments to ``after``'s; arguments that
    are not objects compare as one value under the key ``""``."""
    a = before if isinstance(before, Mapping) else {"": before}
    b = after if isinstance(after, Mapping) else {"": after}
    added = {k: b[k] for k in b if k not in a}
    removed = {k: a[k] for k in a if k not in b}
    changed = {k: (a[k], b[k]) for k in a if k in b and a[k] != b[k]}
    return added, removed, changed
