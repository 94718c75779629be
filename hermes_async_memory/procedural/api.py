"""The query API of procedural memory (``pipeline.procedural``): per-tool statistics with
frequent errors and success hints, call search, the fix for an error, and the arguments that
worked for a goal. It reads what is committed (``await pipeline.flush()`` first to read the
latest turns' calls); a call still awaiting its answer (``store.tool_log``: its answer, or
the message that closes it, is not committed yet) is read once it is settled."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from ..slices import maybe_yield
from ..store import CallRow, SqliteStore
from .extract import arg_delta
from .model import ArgDelta, ErrorPattern, Fix, SuccessHint, ToolCall, ToolStats

HINT_SAMPLE = 200  # recent successes a tool's success hints are drawn from
FIX_SAMPLE = 50  # recent fixed failures an error's typical fix is drawn from
# Rows worked a step between the loop's other callbacks (slices.maybe_yield): a recall builds
# the procedural block on the event loop, and 50 fixes in one step took ~8 ms.
_STEP = 10
_WORD = re.compile(r"\w{3,}")


class ProceduralMemory:
    """Reads of the tool-call log, for one user at a time (``None``: turns without a user)."""

    def __init__(self, store: SqliteStore) -> None:
        self._store = store

    async def stats(self, user_id: str | None, tools: Sequence[str] | None = None, *,
                    errors: int = 3, hints: int = 3) -> list[ToolStats]:
        """Each tool's numbers, most called first, with its ``errors`` most frequent error
        types (and their typical fix) and ``hints`` success hints."""
        uid = _uid(user_id)
        out = []
        for tool, calls, ok, avg_ms, last_at in await self._store.tool_totals(uid, tools):
            patterns = await self.error_patterns(user_id, tool, limit=errors) if errors else []
            tips = await self.success_hints(user_id, tool, limit=hints) if hints else []
            out.append(ToolStats(tool=tool, calls=calls, successes=int(ok or 0),
                                 failures=calls - int(ok or 0), avg_duration_ms=avg_ms,
                                 last_at=last_at, errors=tuple(patterns), hints=tuple(tips)))
        return out

    async def recent(self, user_id: str | None, tool: str, limit: int = 3) -> list[ToolCall]:
        """A tool's latest calls, oldest first, with their fix relations."""
        rows = await self._store.tool_call_search(_uid(user_id), tools=[tool], limit=limit)
        return await self._calls(rows[::-1])

    async def search(self, user_id: str | None, *, tool: str | None = None,
                     ok: bool | None = None, text: str | None = None,
                     error_type: str | None = None, session_id: str | None = None,
                     limit: int = 20) -> list[ToolCall]:
        """Calls by tool, outcome, error type and text (a substring of the arguments, the
        result, the error or the goal), newest first."""
        rows = await self._store.tool_call_search(
            _uid(user_id), tools=[tool] if tool else None, ok=ok, text=text,
            error_type=error_type, session_id=session_id, limit=limit)
        return await self._calls(rows)

    async def fix_for(self, user_id: str | None, error: str, *, tool: str | None = None,
                      limit: int = 3) -> list[Fix]:
        """How failures like ``error`` were fixed: failures whose error type is ``error``,
        or whose message contains it, each with the call that fixed it and the argument
        delta; newest first."""
        uid = _uid(user_id)
        tools = [tool] if tool else None
        rows = await self._store.tool_call_search(uid, tools=tools, ok=False, fixed=True,
                                                  error_type=error, limit=limit)
        if len(rows) < limit:
            seen = {r.id for r in rows}
            more = await self._store.tool_call_search(uid, tools=tools, ok=False, fixed=True,
                                                      text=error, limit=limit)
            rows += [r for r in more if r.id not in seen][: limit - len(rows)]
        return await self._fixes(rows)

    async def arguments_for(self, user_id: str | None, goal: str, *, tool: str | None = None,
                            limit: int = 3) -> list[SuccessHint]:
        """The arguments that worked for goals like ``goal``: per tool, from its successes
        whose goal shares the most words with it (all its successes when none does)."""
        uid = _uid(user_id)
        words = set(_WORD.findall(goal.lower()))
        rows = await self._store.tool_call_search(uid, tools=[tool] if tool else None,
                                                  ok=True, limit=HINT_SAMPLE)
        parsed = await _parsed_arguments(rows)
        by_tool: dict[str, list[tuple[int, CallRow, Any]]] = {}
        for r, a in zip(rows, parsed, strict=True):
            score = len(words & set(_WORD.findall((r.goal or "").lower())))
            by_tool.setdefault(r.tool, []).append((score, r, a))
        hints = []
        for scored in by_tool.values():
            best = max(s for s, _, _ in scored)
            chosen = [(r, a) for s, r, a in scored if s == best]
            hints.append((best, SuccessHint(arguments=await typical_arguments(
                a for _, a in chosen), count=len(chosen), goal=goal, tool=chosen[0][0].tool)))
        hints.sort(key=lambda h: (-h[0], -h[1].count))
        return [h for _, h in hints[:limit]]

    async def error_patterns(self, user_id: str | None, tool: str, *, limit: int = 3
                             ) -> list[ErrorPattern]:
        """A tool's most frequent error types, each with its latest message and the argument
        change that fixed it most often."""
        uid = _uid(user_id)
        found = await self._store.tool_errors(uid, tool, limit)
        latest = {r.id: r for r in await self._store.tool_calls_by_id([f[2] for f in found])}
        out = []
        for error_type, count, last_id in found:
            fixed = await self._store.tool_call_search(uid, tools=[tool], ok=False, fixed=True,
                                                       error_type=error_type, limit=FIX_SAMPLE)
            fixes = await self._fixes(fixed)
            typical = _most_common_delta([f.delta for f in fixes])
            example = next((f for f in fixes if typical is not None and f.delta == typical),
                           None)
            last = latest.get(last_id)
            out.append(ErrorPattern(error_type=error_type,
                                    message=(last.error_message or "") if last else "",
                                    count=count, typical_fix=typical, example_fix=example))
        return out

    async def success_hints(self, user_id: str | None, tool: str, *, limit: int = 3
                            ) -> list[SuccessHint]:
        """Typical arguments of a tool's successes: overall, then per frequent goal."""
        rows = await self._store.tool_call_search(_uid(user_id), tools=[tool], ok=True,
                                                  limit=HINT_SAMPLE)
        if not rows:
            return []
        parsed = await _parsed_arguments(rows)
        hints = [SuccessHint(arguments=await typical_arguments(parsed), count=len(rows))]
        goals = Counter(r.goal for r in rows if r.goal)
        for goal, n in goals.most_common(limit - 1):
            if n < 2:
                break
            same = [a for r, a in zip(rows, parsed, strict=True) if r.goal == goal]
            hints.append(SuccessHint(arguments=await typical_arguments(same), count=n,
                                     goal=goal))
        return hints[:limit]

    async def _calls(self, rows: Sequence[CallRow]) -> list[ToolCall]:
        """Rows as ToolCalls; a fixing call gets its delta from the failure it fixed."""
        fixed_ids = [r.fixes for r in rows if r.fixes is not None]
        failed = {r.id: r for r in await self._store.tool_calls_by_id(fixed_ids)}
        return [_call(r, failed.get(r.fixes) if r.fixes is not None else None) for r in rows]

    async def _fixes(self, failures: Sequence[CallRow]) -> list[Fix]:
        ids = [r.fixed_by for r in failures if r.fixed_by is not None]
        fixing = {r.id: r for r in await self._store.tool_calls_by_id(ids)}
        out = []
        for i, r in enumerate(failures):
            if i % _STEP == _STEP - 1:  # a recall runs this on the loop: ~40 µs a fix
                await maybe_yield()
            f = fixing.get(r.fixed_by) if r.fixed_by is not None else None
            if f is None:  # the fixing call was trimmed from the log
                continue
            out.append(Fix(failed=_call(r, None), fixed=_call(f, r),
                           delta=_delta(r.arguments, f.arguments)))
        return out


async def typical_arguments(args: Iterable[Any]) -> dict[str, Any]:
    """Per argument key found in at least half of the calls, its most frequent value;
    ``_STEP`` calls a step (a recall runs this on the loop)."""
    values: dict[str, Counter[Any]] = {}
    n = 0
    for a in args:
        n += 1
        if n % _STEP == 0:
            await maybe_yield()
        if not isinstance(a, dict):
            a = {"": a}
        for k, v in a.items():
            counts = values.get(k)
            if counts is None:
                counts = values[k] = Counter()
            counts[_value_key(v)] += 1
    out = {}
    for k, counts in values.items():
        if sum(counts.values()) * 2 >= n:
            out[k] = _key_value(counts.most_common(1)[0][0])
    return out


# How typical_arguments tells values apart: text, a whole number, a bool and None as
# themselves, tagged with their kind (1, True and "1" are three values); anything else by
# its JSON (sorted keys). A recall counts every key of up to HINT_SAMPLE calls: a json.dumps
# each took ~25 ms on the loop for 200 calls of 40 keys.
_PLAIN_KINDS = {str: "s", int: "i", bool: "b", type(None): "n"}


def _value_key(v: Any) -> Any:
    kind = _PLAIN_KINDS.get(type(v))
    return (kind, v) if kind is not None else json.dumps(v, sort_keys=True, default=str)


def _key_value(key: Any) -> Any:
    return key[1] if isinstance(key, tuple) else json.loads(key)


def _uid(user_id: str | None) -> str:
    if user_id is None:
        return ""
    if not isinstance(user_id, str) or not user_id:
        raise ValueError("user_id must be a non-empty string or None")
    return user_id


async def _parsed_arguments(rows: Sequence[CallRow]) -> list[Any]:
    """Each row's arguments read from their JSON, ``_STEP`` rows a step (a recall reads up
    to HINT_SAMPLE of them on the loop)."""
    out = []
    for i, r in enumerate(rows):
        if i % _STEP == _STEP - 1:
            await maybe_yield()
        out.append(_args(r.arguments))
    return out


def _args(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _delta(before: str, after: str) -> ArgDelta:
    added, removed, changed = arg_delta(_args(before), _args(after))
    return ArgDelta(added=added, removed=removed, changed=changed)


def _call(r: CallRow, failed: CallRow | None) -> ToolCall:
    return ToolCall(
        id=r.id, call_id=r.call_id, tool=r.tool, arguments=_args(r.arguments), result=r.result,
        ok=bool(r.ok), error_type=r.error_type, error_message=r.error_message,
        duration_ms=r.duration_ms, session_id=r.session_id, user_id=r.user_id or None,
        goal=r.goal, at=r.at, fixed_by=r.fixed_by, fixes=r.fixes,
        delta=_delta(failed.arguments, r.arguments) if failed is not None else None)


def _most_common_delta(deltas: Sequence[ArgDelta]) -> ArgDelta | None:
    """The delta seen most (by which keys were added, removed and changed)."""
    if not deltas:
        return None
    shape = Counter((tuple(sorted(d.added)), tuple(sorted(d.removed)), tuple(sorted(d.changed)))
                    for d in deltas)
    top = shape.most_common(1)[0][0]
    return next(d for d in deltas
                if (tuple(sorted(d.added)), tuple(sorted(d.removed)),
                    tuple(sorted(d.changed))) == top)
