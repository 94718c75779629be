"""A template turned into what a new conversation starts with: chat messages for library
users, or one text block for a client that only takes text (Hermes's
``system_prompt_block``, or its first prefetch).

Both say the same: a note (which template, its task type, that its calls come from an
earlier session and may be out of date), the files and URLs that session worked with, its
first user requests, its instructions, and the successful calls themselves.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from .extract import shorten, text_of
from .model import Example, Template

WARM_TEXT_CHARS = 2000  # default bound of warm_text
LINE_CHARS = 300  # of one line of warm_text
ARGS_CHARS = 160  # of an example's arguments in warm_text
RESULT_CHARS = 120  # of an example's result in warm_text
EMPTY_RESULT = "(no output)"  # some providers refuse a tool message with empty content
LEADING_ROLES = ("system", "developer")
CAVEAT = ("Its example tool calls succeeded in that session: follow their conventions, but "
          "they were not made in this conversation and their results may be out of date.")


def warm_messages(template: Template, existing: Sequence[Mapping[str, Any]] = ()
                  ) -> list[dict[str, Any]]:
    """``existing`` with the warm start inserted after its leading system (and developer)
    messages: a system note, then per example an assistant message calling the tool (a
    fresh id) and the ``tool`` message answering it.

    The source session's instructions are part of the note unless a leading system
    message already holds them. The result passes ``validate_chat`` when ``existing``
    does (or is only system messages, or empty).
    """
    head = 0
    while head < len(existing) and existing[head].get("role") in LEADING_ROLES:
        head += 1
    leading = [dict(m) for m in existing[:head]]
    context = template.system_context.strip()
    if context and any(context in text_of(m.get("content")) for m in leading):
        context = ""
    out = [*leading, {"role": "system", "content": "\n".join(_note(template, context))}]
    taken = {str(c.get("id")) for m in existing for c in _calls(m)}
    for example in template.examples:
        call_id = _fresh_id(taken)
        out.append({
            "role": "assistant",
            "content": None,
            "tool_calls": [{
                "id": call_id,
                "type": "function",
                "function": {"name": example.tool,
                             "arguments": json.dumps(dict(example.arguments),
                                                     ensure_ascii=False)},
            }],
        })
        out.append({"role": "tool", "tool_call_id": call_id,
                    "content": example.result or EMPTY_RESULT})
    out.extend(dict(m) for m in existing[head:])
    return out


def warm_text(template: Template, max_chars: int = WARM_TEXT_CHARS) -> str:
    """The warm start as one ``<warm_start>`` block of at most ``max_chars`` characters.

    Sections come in this order: the note, examples, files and URLs, user requests, the
    source session's instructions. A section whose heading and first line do not fit is
    left out; within a section, lines are kept until one does not fit. No line is cut.

    Raises:
        ValueError: ``max_chars`` cannot hold even the block's tags and first line.
    """
    open_tag = (f'<warm_start template="{escape(template.name)}" '
                f'task_type="{escape(template.task_type)}">')
    close_tag = "</warm_start>"
    note, *rest = _head(template)
    first = [open_tag, _line(note)]
    used = sum(len(x) + 1 for x in first) + len(close_tag)
    if used > max_chars:
        raise ValueError(f"max_chars={max_chars} cannot hold the block's tags and note "
                         f"({used} characters)")
    lines = first
    sections: list[tuple[str, list[str]]] = [
        ("", [_line(x) for x in rest if x]),
        ("Examples:", [_example_line(e) for e in template.examples]),
        ("Files and URLs:", [_line(f"- {m}") for m in template.context_markers]),
        ("User requests:", [_line(f"- {p}") for p in template.user_patterns]),
        ("Instructions of that session:",
         [_line(x) for x in template.system_context.splitlines() if x.strip()]),
    ]
    for heading, items in sections:
        if not items:
            continue
        cost = len(heading) + 1 if heading else 0
        if used + cost + len(items[0]) + 1 > max_chars:
            continue
        if heading:
            lines.append(heading)
            used += cost
        for item in items:
            if used + len(item) + 1 > max_chars:
                break
            lines.append(item)
            used += len(item) + 1
    lines.append(close_tag)
    return "\n".join(lines)


def _note(template: Template, context: str) -> list[str]:
    """The system note's lines for warm_messages."""
    lines = _head(template)
    if template.context_markers:
        lines += ["Files and URLs that session worked with:",
                  *(f"- {m}" for m in template.context_markers)]
    if template.user_patterns:
        lines += ["User requests in that session:", *(f"- {p}" for p in template.user_patterns)]
    if context:
        lines += ["Instructions of that session:", context]
    return lines


def _head(template: Template) -> list[str]:
    """What the template is; the first line names it."""
    tags = f"; tags: {', '.join(template.tags)}" if template.tags else ""
    lines = [f'Warm start from template "{template.name}" ({template.task_type} task{tags}).']
    if template.description:
        lines.append(template.description)
    lines.append(f'It was taken from session "{template.source_session_id}".')
    if template.examples:
        lines.append(CAVEAT)
    return lines


def _example_line(example: Example) -> str:
    args = shorten(json.dumps(dict(example.arguments), ensure_ascii=False), ARGS_CHARS)
    result = shorten(" ".join(example.result.split()), RESULT_CHARS) or EMPTY_RESULT
    return _line(f"- {example.tool} {args} -> {result}")


def _line(text: str) -> str:
    return shorten(" ".join(text.split()), LINE_CHARS)


def _calls(message: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    calls = message.get("tool_calls")
    return [c for c in calls if isinstance(c, Mapping)] if isinstance(calls, list) else []


def _fresh_id(taken: set[str]) -> str:
    while True:  # a collision with a 96-bit random id is not expected; it is still checked
        call_id = f"call_warm_{uuid.uuid4().hex[:24]}"
        if call_id not in taken:
            taken.add(call_id)
            return call_id
