"""Whether a message list would validate as an OpenAI chat completion request's
``messages``: the checks the API makes that a warm start could break.

Checked: each message is an object with a known role; its content has a type that role
takes; an assistant's ``tool_calls`` is a non-empty list of function calls with a string id
(unique in the list of messages), a name, and arguments that are a JSON object's text; the
``tool`` messages right after an assistant message answer its calls, each once, before the
next message of another role, and every call is answered. Not checked: the model's own
limits (context length, image sizes) and the content of ``user`` message parts beyond their
type.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from .model import InvalidChatError

ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# The content part types each role takes when its content is a list.
PART_TYPES: Mapping[str, frozenset[str]] = {
    "system": frozenset({"text"}),
    "developer": frozenset({"text"}),
    "user": frozenset({"text", "image_url", "input_audio", "file"}),
    "assistant": frozenset({"text", "refusal"}),
    "tool": frozenset({"text"}),
}


def validate_chat(messages: Sequence[Mapping[str, Any]]) -> None:
    """Check ``messages`` as an OpenAI chat completion request would (see the module's
    docstring).

    Raises:
        InvalidChatError: the first problem found; its ``index`` names the message.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InvalidChatError(f"messages must be a list, got {type(messages).__name__}")
    if not messages:
        raise InvalidChatError("messages must not be empty")
    seen_ids: set[str] = set()
    pending: dict[str, int] = {}  # call id -> index of the assistant message that made it
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidChatError(f"must be an object, got {type(m).__name__}", i)
        role = m.get("role")
        if role not in ROLES:
            raise InvalidChatError(f"unknown role {role!r}", i)
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise InvalidChatError(f"name must be a string, got {name!r}", i)
        if role == "tool":
            _check_content(m, "tool", i)
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidChatError("a tool message needs a tool_call_id string", i)
            if call_id not in pending:
                why = ("answers a call already answered" if call_id in seen_ids
                       else "answers no call of the assistant message before it")
                raise InvalidChatError(f"tool message {call_id!r} {why}", i)
            del pending[call_id]
            continue
        if pending:
            raise InvalidChatError(
                f"tool call(s) {', '.join(sorted(pending))} of messages"
                f"[{min(pending.values())}] are not answered before this {role} message", i)
        if role == "assistant":
            calls = m.get("tool_calls")
            if calls is not None:
                for call_id in _check_tool_calls(calls, i):
                    if call_id in seen_ids:
                        raise InvalidChatError(f"tool call id {call_id!r} is used twice", i)
                    seen_ids.add(call_id)
                    pending[call_id] = i
            has_other = calls is not None or m.get("refusal") is not None or (
                m.get("function_call") is not None)
            _check_content(m, "assistant", i, required=not has_other)
        else:
            _check_content(m, role, i)
    if pending:
        raise InvalidChatError(
            f"tool call(s) {', '.join(sorted(pending))} of messages"
            f"[{min(pending.values())}] are never answered")


def _check_content(m: Mapping[str, Any], role: str, i: int, *, required: bool = True
                   ) -> None:
    content = m.get("content")
    if content is None:
        if required:
            raise InvalidChatError(f"a {role} message needs content", i)
        return
    if isinstance(content, str):
        return
    if not isinstance(content, list) or not content:
        raise InvalidChatError(
            f"{role} content must be a string or a non-empty list of parts, got "
            f"{type(content).__name__}", i)
    allowed = PART_TYPES[role]
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind not in allowed:
            raise InvalidChatError(
                f"content[{j}] of a {role} message must be a part of type "
                f"{' / '.join(sorted(allowed))}, got {kind!r}", i)
        if kind in ("text", "refusal") and not isinstance(part.get(kind), str):
            raise InvalidChatError(f"content[{j}] needs a {kind!r} string", i)


def _check_tool_calls(calls: Any, i: int) -> list[str]:
    if not isinstance(calls, list) or not calls:
        raise InvalidChatError("tool_calls must be a non-empty list", i)
    ids: list[str] = []
    for j, call in enumerate(calls):
        where = f"tool_calls[{j}]"
        if not isinstance(call, Mapping):
            raise InvalidChatError(f"{where} must be an object", i)
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise InvalidChatError(f"{where} needs an id string", i)
        if call.get("type") != "function":
            raise InvalidChatError(f"{where} must have type 'function', got "
                                   f"{call.get('type')!r}", i)
        function = call.get("function")
        if not isinstance(function, Mapping):
            raise InvalidChatError(f"{where} needs a function object", i)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidChatError(f"{where}.function needs a name string", i)
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            raise InvalidChatError(
                f"{where}.function.arguments must be a JSON string, got "
                f"{type(arguments).__name__}", i)
        try:
            parsed = json.loads(arguments)
        except ValueError:
            raise InvalidChatError(f"{where}.function.arguments is not valid JSON", i) from None
        if not isinstance(parsed, dict):
            raise InvalidChatError(f"{where}.function.arguments must be a JSON object", i)
        if call_id in ids:
            raise InvalidChatError(f"tool call id {call_id!r} is used twice", i)
        ids.append(call_id)
    return ids
