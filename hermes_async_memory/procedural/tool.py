"""The ``procedural_memory`` tool: a model asks what fixed an error before, which arguments
worked for a goal, or how a tool has fared, and gets the log's answer as text it can read.

``call_procedural_tool`` never raises: every result is JSON, and so is every error, with a
message a model can act on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..errors import HermesMemoryError
from .api import ProceduralMemory
from .format import ContextSettings, error_guidance, success_template, summary

PROCEDURAL_TOOL = "procedural_memory"
ACTIONS = ("fix", "arguments", "stats")
_ALLOWED = {"fix": {"error", "tool"}, "arguments": {"goal", "tool"}, "stats": {"tool"}}
_REQUIRED = {"fix": "error", "arguments": "goal"}
_TEXT_LIMIT = 500
TOOL_SETTINGS = ContextSettings(max_chars=1500, include_args=True, max_recent_calls=3)

PROCEDURAL_SCHEMA: dict[str, Any] = {
    "name": PROCEDURAL_TOOL,
    "description": (
        "What your tools did in past sessions with this user. 'fix' finds how an error was "
        "fixed before (the failed call, the call that worked and what changed in the "
        "arguments); 'arguments' gives the arguments that worked for a goal like yours; "
        "'stats' shows each tool's success rate and frequent errors."
    ),
    "parameters": {
        "type": "object",
        "properties": {
            "action": {"type": "string", "enum": list(ACTIONS), "description": "What to ask."},
            "error": {"type": "string",
                      "description": "The error type or text to find a fix for (fix), e.g. "
                                     "'FileNotFoundError' or 'permission denied'."},
            "goal": {"type": "string",
                     "description": "What you are trying to do (arguments)."},
            "tool": {"type": "string",
                     "description": "Only this tool (optional)."},
        },
        "required": ["action"],
        "additionalProperties": False,
    },
}


async def call_procedural_tool(memory: ProceduralMemory, user_id: str | None,
                               args: object) -> str:
    """Run one call of the tool for ``user_id``; the answer or the error as JSON."""
    try:
        return json.dumps({"ok": True, **await _run(memory, user_id, args)},
                          ensure_ascii=False)
    except _ArgumentError as exc:
        return _error(str(exc))
    except (HermesMemoryError, TimeoutError, OSError) as exc:
        return _error(f"the procedural memory could not answer now: "
                      f"{type(exc).__name__}: {exc}")


class _ArgumentError(Exception):
    pass


async def _run(memory: ProceduralMemory, user_id: str | None, args: object
               ) -> dict[str, Any]:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise _ArgumentError("arguments must be a JSON object") from None
    if not isinstance(args, Mapping):
        raise _ArgumentError("arguments must be a JSON object")
    action = args.get("action")
    if action not in ACTIONS:
        raise _ArgumentError(f"action must be one of {', '.join(ACTIONS)}; got {action!r:.40}")
    unknown = sorted(set(args) - _ALLOWED[action] - {"action"})
    if unknown:
        raise _ArgumentError(f"action {action!r} takes no argument {', '.join(unknown)}")
    for name in ("error", "goal", "tool"):
        value = args.get(name)
        if value is not None and (not isinstance(value, str) or not value.strip()
                                  or len(value) > _TEXT_LIMIT):
            raise _ArgumentError(f"{name} must be a non-empty string of at most "
                                 f"{_TEXT_LIMIT} characters")
    required = _REQUIRED.get(action)
    if required is not None and args.get(required) is None:
        raise _ArgumentError(f"action {action!r} needs the argument {required!r}")
    tool = args.get("tool")
    if action == "fix":
        error = args["error"].strip()
        fixes = await memory.fix_for(user_id, error, tool=tool, limit=3)
        if not fixes:
            return {"action": "fix", "found": False,
                    "answer": f"No fix for {error!r} is on record."}
        first = fixes[0]
        stats = await memory.stats(user_id, [first.failed.tool], errors=3, hints=0)
        text = error_guidance(first.failed.tool, first.failed, stats[0] if stats else None,
                              fixes, TOOL_SETTINGS)
        return {"action": "fix", "found": True, "answer": text}
    if action == "arguments":
        goal = args["goal"].strip()
        hints = await memory.arguments_for(user_id, goal, tool=tool, limit=3)
        blocks = []
        for hint in hints:  # one a tool, the best matches first
            name = hint.tool or tool or ""
            examples = await memory.search(user_id, tool=name, ok=True, limit=3)
            block = success_template(name, goal, [hint], examples, TOOL_SETTINGS)
            if block:
                blocks.append(block)
        if not blocks:
            return {"action": "arguments", "found": False,
                    "answer": "No successful call is on record for that."}
        return {"action": "arguments", "found": bool(blocks), "answer": "\n\n".join(blocks)}
    stats = await memory.stats(user_id, [tool] if tool else None, errors=2, hints=0)
    return {"action": "stats", "found": bool(stats),
            "answer": summary(stats, TOOL_SETTINGS) if stats else "No tool call on record."}


def _error(message: str) -> str:
    return json.dumps({"ok": False, "error": message}, ensure_ascii=False)
