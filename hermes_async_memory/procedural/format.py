"""Procedural memory rendered for a model's context: what the log knows of the tools about to
be called, guidance right after a failure, the arguments that worked for a goal, and a summary
of every tool. Pure functions of the values in ``model``; no I/O.

Each renderer returns one block, or ``""`` when there is nothing to say:

    <procedural_memory>          for_tools(): one <tool name="..."> section per tool
    <procedural_guidance>        error_guidance(): a tool has just failed; what fixed it before
    <success_template>           success_template(): arguments that worked, for a goal
    <procedural_memory_summary>  summary(): every tool by call count

A block never exceeds ``settings.budget`` characters. To fit, whole lines are left out, least
important first (in for_tools: success hints, then the oldest recent calls, then the rarer
error patterns, then whole tools from the last); a heading or tag with nothing left under it
goes too. A line is never cut and a tag never left open; when not even the smallest block
fits, the result is ``""``. Text from the log has ``<`` written as ``&lt;`` so that a logged
message cannot open or close a tag, and messages are flattened to one line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigurationError
from .model import ArgDelta, ErrorPattern, Fix, SuccessHint, ToolCall, ToolStats

CHARS_PER_TOKEN = 4  # the rough rule a max_tokens budget is converted by
MIN_BUDGET_CHARS = 100  # below this not even one tool's success rate fits in a block

ELLIPSIS = "…"
MAX_VALUE_CHARS = 40  # one argument value
VALUE_HEAD_CHARS = 12  # of a long string value, kept before the ellipsis (the rest: its end)
MAX_KEY_CHARS = 24  # one argument name
MAX_ARGS_SHOWN = 3  # arguments shown per call or hint; the rest are counted
MAX_DELTA_ITEMS = 3  # changes shown per fix; the rest are counted
MAX_NAME_CHARS = 48  # a tool name or a goal
MAX_MESSAGE_CHARS = 100  # an error message
MAX_RESULT_CHARS = 60  # a successful call's result summary

OK_MARK = "✓"
COUNT_MARK = "×"  # noqa: RUF001 - the multiplication sign, on purpose
FAIL_MARK = "✗"

# What to leave out first when a block is over budget: the highest rank goes first.
_DROP_TOOL = 1
_DROP_ERROR = 2
_DROP_CALL = 3
_DROP_HINT = 4


@dataclass(frozen=True, slots=True)
class ContextSettings:
    """How much procedural memory to render, in what detail, within what budget."""

    max_recent_calls: int = 3  # per tool, newest kept
    max_error_patterns: int = 3  # per tool, most frequent kept
    max_success_patterns: int = 3  # per tool
    include_args: bool = False  # abbreviated arguments on each recent call
    include_timing: bool = False  # durations on calls, average duration on tools
    show_fix_relations: bool = True  # "fixed by #id" on failures, the delta on fixing calls
    compact: bool = False  # for_tools: one line per tool; summary: no fixes
    max_chars: int = 2000
    # When set, the budget is max_tokens * CHARS_PER_TOKEN characters and max_chars is unused.
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        """Raises ConfigurationError (a ValueError) on a negative count or a budget under
        MIN_BUDGET_CHARS characters."""
        for name in ("max_recent_calls", "max_error_patterns", "max_success_patterns"):
            value = getattr(self, name)
            if value < 0:
                raise ConfigurationError(f"{name} must be 0 or more, not {value}")
        if self.budget < MIN_BUDGET_CHARS:
            given = (
                f"max_chars={self.max_chars}"
                if self.max_tokens is None
                else f"max_tokens={self.max_tokens} ({self.budget} characters)"
            )
            raise ConfigurationError(
                f"{given} is too small a budget: at least {MIN_BUDGET_CHARS} characters "
                f"({MIN_BUDGET_CHARS // CHARS_PER_TOKEN} tokens) are needed"
            )

    @property
    def budget(self) -> int:
        """The most characters a rendered block may take."""
        if self.max_tokens is not None:
            return self.max_tokens * CHARS_PER_TOKEN
        return self.max_chars


def for_tools(
    stats: Mapping[str, ToolStats],
    recent: Mapping[str, Sequence[ToolCall]],
    settings: ContextSettings,
) -> str:
    """A ``<procedural_memory>`` block for the tools about to be called: the tools of
    ``stats``, then those only in ``recent``, in the order given; a tool with no calls in
    either is left out."""
    return "\n".join([text for text, _ in for_tools_lines(stats, recent, settings)])


def for_tools_lines(
    stats: Mapping[str, ToolStats],
    recent: Mapping[str, Sequence[ToolCall]],
    settings: ContextSettings,
) -> list[tuple[str, str | None]]:
    """``for_tools``'s block as its lines, each with the tool it is about (None: the
    block's own tags); ``[]`` when the block is ``""``."""
    root = _Line("<procedural_memory>", close="</procedural_memory>", group=True)
    for index, tool in enumerate(dict.fromkeys([*stats, *recent])):
        stat = stats.get(tool)
        calls = _newest(recent.get(tool, ()), settings.max_recent_calls)
        if (stat is None or not stat.calls) and not calls:
            continue
        if settings.compact:
            last = _newest(recent.get(tool, ()), 1)
            line = _compact_line(tool, stat, last[0] if last else None, settings)
            root.children.append(_Line(line, drop=(_DROP_TOOL, index, 0), tool=tool))
        else:
            root.children.append(_tool_section(index, tool, stat, calls, settings))
    return _fit_lines(root, settings.budget)


def error_guidance(
    tool: str,
    error: ToolCall,
    stats: ToolStats | None,
    fixes: Sequence[Fix],
    settings: ContextSettings,
) -> str:
    """A ``<procedural_guidance>`` block for a call of ``tool`` that has just failed: the
    error, how often the tool has had it, and the argument changes that fixed it before (at
    most max_recent_calls distinct ones, most frequent first; fixes of this error type before
    others). The failed call's arguments are always shown, as the fixes are relative to them.
    ``""`` when the log knows neither this error nor any fix."""
    pattern = _pattern_for(stats, error.error_type)
    groups = _fix_groups(fixes, error.error_type)[: settings.max_recent_calls]
    if pattern is None and not groups:
        return ""
    error_type = error.error_type or "error"
    root = _Line(
        f'<procedural_guidance tool="{_attr(tool)}" error="{_attr(error_type)}">',
        close="</procedural_guidance>",
        group=True,
    )
    failed = f"failed: #{error.id} ({_args(error.arguments)}): {_outcome(error)}"
    root.children.append(_Line(failed))
    if pattern is not None:
        seen = f"{_flat(error_type, MAX_NAME_CHARS)} seen {_times(pattern.count)} with this tool"
        if stats is not None and stats.calls:
            seen += f"; {_rate(stats.successes, stats.calls)} overall"
        root.children.append(_Line(seen, drop=(1, 0, 0)))
        usual = _usual_fix(pattern)
        if usual is not None and _delta(usual) not in (text for text, _ in groups):
            root.children.append(_Line(f"usual fix: {_delta(usual)}", drop=(2, 0, 0)))
    if groups:
        heading = _Line("fixed before by:", group=True)
        for position, (text, group) in enumerate(groups):
            line = f"  - {text} ({_times(len(group))}"
            if settings.show_fix_relations:
                last = group[-1]
                line += f"; last #{last.failed.id}→#{last.fixed.id}"
            heading.children.append(_Line(line + ")", drop=(3, 0, position)))
        root.children.append(heading)
    return _fit(root, settings.budget)


def success_template(
    tool: str,
    goal: str | None,
    hints: Sequence[SuccessHint],
    examples: Sequence[ToolCall],
    settings: ContextSettings,
) -> str:
    """A ``<success_template>`` block: the arguments that worked for ``tool`` (hints for
    ``goal`` first, then those for no goal; hints for other goals are left out) and the newest
    successful example calls, with their arguments. ``""`` when there are neither."""
    chosen = _hints_for(hints, goal)[: settings.max_success_patterns]
    shown = _newest([call for call in examples if call.ok], settings.max_recent_calls)
    if not chosen and not shown:
        return ""
    opening = f'<success_template tool="{_attr(tool)}"'
    if goal:
        opening += f' goal="{_attr(goal)}"'
    root = _Line(opening + ">", close="</success_template>", group=True)
    if chosen:
        worked = _Line("arguments that worked:", group=True)
        for position, hint in enumerate(chosen):
            worked.children.append(_Line(f"  - {_hint_text(hint)}", drop=(1, 0, position)))
        root.children.append(worked)
    if shown:
        heading = _Line("examples (newest last):", group=True)
        for position, call in enumerate(shown):
            line = f"  - #{call.id} ({_args(call.arguments)}): {_outcome(call)}"
            if settings.include_timing and call.duration_ms is not None:
                line += f" ({_duration(call.duration_ms)})"
            heading.children.append(_Line(line, drop=(2, 0, -position)))
        root.children.append(heading)
    return _fit(root, settings.budget)


def summary(stats: Sequence[ToolStats], settings: ContextSettings) -> str:
    """A ``<procedural_memory_summary>`` block: the totals, then one line per tool, most
    called first, with its success rate and top error (and that error's usual fix when
    show_fix_relations and not compact). ``""`` when there are no tools."""
    if not stats:
        return ""
    calls = sum(stat.calls for stat in stats)
    successes = sum(stat.successes for stat in stats)
    root = _Line("<procedural_memory_summary>", close="</procedural_memory_summary>", group=True)
    tools = "tool" if len(stats) == 1 else "tools"
    root.children.append(_Line(f"{len(stats)} {tools}: {_rate(successes, calls)}"))
    ordered = sorted(stats, key=lambda stat: (-stat.calls, stat.tool))
    for position, stat in enumerate(ordered):
        line = f"- {_flat(stat.tool, MAX_NAME_CHARS)}: {_rate(stat.successes, stat.calls)}"
        if settings.include_timing and stat.avg_duration_ms is not None:
            line += f", avg {_duration(stat.avg_duration_ms)}"
        top = _top_errors(stat, 1)
        if top:
            line += f"; top error {_error_count(top[0])}"
            fix = _usual_fix(top[0])
            if fix is not None and settings.show_fix_relations and not settings.compact:
                line += f", usual fix {_delta(fix)}"
        root.children.append(_Line(line, drop=(_DROP_TOOL, position, 0)))
    return _fit(root, settings.budget)


# --- sections of for_tools ---


def _tool_section(
    index: int,
    tool: str,
    stat: ToolStats | None,
    calls: Sequence[ToolCall],
    settings: ContextSettings,
) -> _Line:
    section = _Line(
        f'<tool name="{_attr(tool)}">', close="</tool>", group=True, drop=(_DROP_TOOL, index, 0),
        tool=tool,
    )
    if stat is not None and stat.calls:
        line = f"success: {_rate(stat.successes, stat.calls)}"
        if settings.include_timing and stat.avg_duration_ms is not None:
            line += f", avg {_duration(stat.avg_duration_ms)}"
        section.children.append(_Line(line))
    if calls:
        heading = _Line("recent calls (newest last):", group=True)
        for position, call in enumerate(calls):
            drop = (_DROP_CALL, index, -position)  # the oldest goes first
            heading.children.append(_Line(f"  {_call_line(call, settings)}", drop=drop))
        section.children.append(heading)
    errors = _top_errors(stat, settings.max_error_patterns)
    if errors:
        heading = _Line("errors seen:", group=True)
        for position, pattern in enumerate(errors):
            line = f"  - {_error_count(pattern)}: {_flat(pattern.message, MAX_MESSAGE_CHARS)}"
            fix = _usual_fix(pattern)
            if fix is not None:
                line += f"; usual fix: {_delta(fix)}"
            heading.children.append(_Line(line, drop=(_DROP_ERROR, index, position)))
        section.children.append(heading)
    hints = list(stat.hints[: settings.max_success_patterns]) if stat is not None else []
    if hints:
        heading = _Line("arguments that worked:", group=True)
        for position, hint in enumerate(hints):
            drop = (_DROP_HINT, index, position)
            heading.children.append(_Line(f"  - {_hint_text(hint)}", drop=drop))
        section.children.append(heading)
    return section


def _call_line(call: ToolCall, settings: ContextSettings) -> str:
    line = f"{OK_MARK if call.ok else FAIL_MARK} #{call.id}"
    if settings.include_args:
        line += f" ({_args(call.arguments)})"
    line += f": {_outcome(call)}"
    if settings.include_timing and call.duration_ms is not None:
        line += f" ({_duration(call.duration_ms)})"
    if settings.show_fix_relations:
        if not call.ok and call.fixed_by is not None:
            line += f"; fixed by #{call.fixed_by}"
        elif call.ok and call.fixes is not None:
            line += f"; fixed #{call.fixes}"
            if call.delta:
                line += f" with {_delta(call.delta)}"
    return line


def _compact_line(
    tool: str, stat: ToolStats | None, last: ToolCall | None, settings: ContextSettings
) -> str:
    parts = [f"{_flat(tool, MAX_NAME_CHARS)}:"]
    if stat is not None and stat.calls:
        rate = _rate(stat.successes, stat.calls)
        if settings.include_timing and stat.avg_duration_ms is not None:
            rate += f", avg {_duration(stat.avg_duration_ms)}"
        parts.append(rate + ";")
    if last is not None:
        failure = _flat(last.error_type or "error", MAX_NAME_CHARS)
        outcome = OK_MARK if last.ok else f"{FAIL_MARK} {failure}"
        parts.append(f"last {outcome};")
    top = _top_errors(stat, min(settings.max_error_patterns, 1))
    if top:
        error = f"top error {_error_count(top[0])}"
        fix = _usual_fix(top[0])
        if fix is not None and settings.show_fix_relations:
            error += f", usual fix {_delta(fix)}"
        parts.append(error)
    return " ".join(parts).rstrip(";")


# --- selection ---


def _newest(calls: Sequence[ToolCall], limit: int) -> list[ToolCall]:
    """At most ``limit`` calls, the newest, newest last."""
    if limit <= 0:
        return []
    return sorted(calls, key=lambda call: (call.at, call.id))[-limit:]


def _top_errors(stat: ToolStats | None, limit: int) -> list[ErrorPattern]:
    if stat is None or limit <= 0:
        return []
    return sorted(stat.errors, key=lambda pattern: -pattern.count)[:limit]


def _pattern_for(stats: ToolStats | None, error_type: str | None) -> ErrorPattern | None:
    errors = stats.errors if stats is not None else ()
    return next((p for p in errors if p.error_type == error_type), None)


def _usual_fix(pattern: ErrorPattern) -> ArgDelta | None:
    if pattern.typical_fix:
        return pattern.typical_fix
    if pattern.example_fix is not None and pattern.example_fix.delta:
        return pattern.example_fix.delta
    return None


def _fix_groups(fixes: Sequence[Fix], error_type: str | None) -> list[tuple[str, list[Fix]]]:
    """Fixes with the same argument change together, oldest first within a group; groups of
    this error type first, then the larger, then the more recent."""
    groups: dict[str, list[Fix]] = {}
    for fix in sorted(fixes, key=lambda fix: (fix.fixed.at, fix.fixed.id)):
        if fix.delta:
            groups.setdefault(_delta(fix.delta), []).append(fix)

    def order(item: tuple[str, list[Fix]]) -> tuple[bool, int, float]:
        group = item[1]
        same = any(fix.failed.error_type == error_type for fix in group)
        return (not same, -len(group), -group[-1].fixed.at)

    return sorted(groups.items(), key=order)


def _hints_for(hints: Sequence[SuccessHint], goal: str | None) -> list[SuccessHint]:
    if not goal:
        return list(hints)
    wanted = goal.casefold()

    def matches(hint: SuccessHint) -> bool:
        have = (hint.goal or "").casefold()
        return bool(have) and (have in wanted or wanted in have)

    return [h for h in hints if matches(h)] + [h for h in hints if not h.goal]


# --- text ---


def _rate(successes: int, calls: int) -> str:
    if not calls:
        return "no calls"
    return f"{successes}/{calls} ok ({successes / calls:.0%})"


def _times(count: int) -> str:
    return "once" if count == 1 else f"{count} times"


def _duration(ms: float) -> str:
    if ms >= 1000:
        return f"{ms / 1000:.1f} s"
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms"


def _outcome(call: ToolCall) -> str:
    if call.ok:
        return _flat(call.result, MAX_RESULT_CHARS) or "ok"
    kind = call.error_type or "error"
    message = call.error_message
    if message and message.startswith(kind):  # "FileNotFoundError: …" names its type itself
        return _flat(message, MAX_MESSAGE_CHARS)
    text = _flat(kind, MAX_NAME_CHARS)
    if message:
        text += f": {_flat(message, MAX_MESSAGE_CHARS)}"
    return text


def _error_count(pattern: ErrorPattern) -> str:
    return f"{_flat(pattern.error_type, MAX_NAME_CHARS)} {COUNT_MARK}{pattern.count}"


def _hint_text(hint: SuccessHint) -> str:
    text = f"{_args(hint.arguments)} ({hint.count} success{'' if hint.count == 1 else 'es'}"
    if hint.goal:
        text += f', for "{_flat(hint.goal, MAX_NAME_CHARS)}"'
    return text + ")"


def _args(arguments: Any) -> str:
    """``key=value, ...``: at most MAX_ARGS_SHOWN, the rest counted; raw text as one value."""
    if isinstance(arguments, Mapping):
        items = list(arguments.items())
        shown = [f"{_key(key)}={_value(value)}" for key, value in items[:MAX_ARGS_SHOWN]]
        if len(items) > MAX_ARGS_SHOWN:
            shown.append(f"{len(items) - MAX_ARGS_SHOWN} more")
        return ", ".join(shown)
    if arguments is None or arguments == "":
        return ""
    return _value(arguments)


def _delta(delta: ArgDelta) -> str:
    """``key: old→new, +key=value, -key``: at most MAX_DELTA_ITEMS, the rest counted."""
    items = [f"{_key(k)}: {_value(old)}→{_value(new)}" for k, (old, new) in delta.changed.items()]
    items += [f"+{_key(key)}={_value(value)}" for key, value in delta.added.items()]
    items += [f"-{_key(key)}" for key in delta.removed]
    if len(items) > MAX_DELTA_ITEMS:
        items = [*items[:MAX_DELTA_ITEMS], f"{len(items) - MAX_DELTA_ITEMS} more"]
    return ", ".join(items) or "same arguments"


def _key(key: object) -> str:
    return _flat(str(key), MAX_KEY_CHARS)


def _value(value: Any) -> str:
    """A value as JSON (strings quoted, newlines escaped), cut to MAX_VALUE_CHARS."""
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)
    except (TypeError, ValueError):  # circular, or keys JSON cannot have
        text = " ".join(str(value).split())
    if len(text) > MAX_VALUE_CHARS and isinstance(value, str):
        # The head and the tail, quotes kept: paths and commands differ at their ends.
        tail = MAX_VALUE_CHARS - VALUE_HEAD_CHARS - len(ELLIPSIS) - 1
        text = text[:VALUE_HEAD_CHARS] + ELLIPSIS + text[-tail:]
    return _clip(text, MAX_VALUE_CHARS)


def _flat(text: str, limit: int) -> str:
    """Log text on one line, cut to ``limit``."""
    return _clip(" ".join(text.split()), limit)


def _attr(text: str) -> str:
    return _flat(text, MAX_NAME_CHARS).replace('"', "&quot;")


def _clip(text: str, limit: int) -> str:
    if len(text) > limit:
        text = text[: limit - len(ELLIPSIS)] + ELLIPSIS
    return text.replace("<", "&lt;")  # no tag can be opened or closed from the log's text


# --- fitting a block to its budget ---


@dataclass(eq=False)
class _Line:
    """A line of a block, with the lines under it (a section's, a heading's) and the tag that
    closes it, if any."""

    text: str
    close: str | None = None
    children: list[_Line] = field(default_factory=list)
    # A group (a tag or heading around lines) is left out once its children are all gone.
    group: bool = False
    # The rank it is left out by, highest first; None: it goes only with the line holding it.
    drop: tuple[int, int, int] | None = None
    # The tool it is about (its lines' too, unless they name their own); None: no one tool.
    tool: str | None = None


def _fit(root: _Line, budget: int) -> str:
    """The block, with the least important lines left out until it fits ``budget``."""
    return "\n".join([text for text, _ in _fit_lines(root, budget)])


def _fit_lines(root: _Line, budget: int) -> list[tuple[str, str | None]]:
    """``_fit``'s block as its lines, each with its tool (``_Line.tool``, inherited)."""
    while True:
        lines: list[tuple[str, str | None]] = []
        _render(root, lines, None)
        if len("\n".join([text for text, _ in lines])) <= budget:
            return lines
        victim = max(_droppable(root), key=lambda pair: pair[1].drop or (0, 0, 0), default=None)
        if victim is None:
            return []
        parent, line = victim
        parent.children.remove(line)


def _render(line: _Line, out: list[tuple[str, str | None]], tool: str | None) -> None:
    if line.group and not line.children:
        return
    if line.tool is not None:
        tool = line.tool
    out.append((line.text, tool))
    for child in line.children:
        _render(child, out, tool)
    if line.close is not None:
        out.append((line.close, tool))


def _droppable(line: _Line) -> Iterator[tuple[_Line, _Line]]:
    for child in line.children:
        if child.drop is not None:
            yield line, child
        yield from _droppable(child)
