"""The procedural block a session's next prefetch carries, and the compact summary for a
system prompt: what the log says of the tools the session's last turns used, with guidance
first when a tool has just failed. Built by the recaller after the session's turns commit
(their tool calls are logged in the same transaction), so ``prefetch()`` stays a lookup."""

from __future__ import annotations

import dataclasses

from .api import ProceduralMemory
from .format import MIN_BUDGET_CHARS, ContextSettings, error_guidance, for_tools_lines, summary

LAST_CALLS = 10  # of the session's newest calls, whose tools the block covers


async def session_block(memory: ProceduralMemory, user_id: str | None, session_id: str,
                        settings: ContextSettings) -> str:
    """The block for a session's next turn ("" when its turns called no tool)."""
    lines = await session_block_lines(memory, user_id, session_id, settings)
    return "\n".join([text for text, _ in lines])


async def session_block_lines(memory: ProceduralMemory, user_id: str | None, session_id: str,
                              settings: ContextSettings) -> list[tuple[str, str | None]]:
    """``session_block``'s lines, each with the tool it is about (None: the tags around
    several tools, and the blank line between the guidance and the rest)."""
    newest = await memory.search(user_id, session_id=session_id, limit=LAST_CALLS)
    if not newest:
        return []
    tools = list(dict.fromkeys(c.tool for c in newest))
    parts: list[list[tuple[str, str | None]]] = []
    budget = settings.budget
    # A tool that failed in the session's latest turn, not fixed since: what fixed it before.
    latest_at = newest[0].at
    failed = next((c for c in newest if c.at == latest_at and not c.ok and c.fixed_by is None),
                  None)
    stats = {s.tool: s for s in await memory.stats(
        user_id, tools, errors=settings.max_error_patterns, hints=settings.max_success_patterns)}
    if failed is not None:
        fixes = await memory.fix_for(user_id, failed.error_type or "error", tool=failed.tool,
                                     limit=settings.max_recent_calls)
        guidance = error_guidance(failed.tool, failed, stats.get(failed.tool), fixes, settings)
        if guidance:
            parts.append([(line, failed.tool) for line in guidance.split("\n")])
            budget -= len(guidance) + 2
    if budget >= MIN_BUDGET_CHARS:
        recent = {t: await memory.recent(user_id, t, settings.max_recent_calls) for t in tools}
        rest = dataclasses.replace(settings, max_chars=budget, max_tokens=None)
        block = for_tools_lines(stats, recent, rest)
        if block:
            parts.append(block)
    out: list[tuple[str, str | None]] = []
    for part in parts:
        if out:
            out.append(("", None))
        out.extend(part)
    return out


async def summary_block(memory: ProceduralMemory, user_id: str | None,
                        settings: ContextSettings) -> str:
    """The compact summary of every tool the user's log knows ("" when none)."""
    stats = await memory.stats(user_id, errors=1, hints=0)
    return summary(stats, settings) if stats else ""
