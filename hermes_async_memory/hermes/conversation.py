"""Stored message rows as Hermes replays a session (``get_messages_as_conversation``,
``get_resume_conversations``): OpenAI messages, with Hermes's own clean-ups."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import HermesMemoryError
from ..store import hermes_reads as reads
from .import_lines import json_or

logger = logging.getLogger(__name__)

_REVIEW_HARNESS_PREFIXES = (
    "Review the conversation above and update the skill library",
    "Review the conversation above and consider saving to memory",
)


def conversation(rows: Sequence[Mapping[str, Any]], *, session_id: str, include_ancestors: bool,
                 repair_alternation: bool) -> list[dict[str, Any]]:
    """Message rows as Hermes replays them: OpenAI messages, recalled memory context
    stripped from user and assistant text, an assistant's reasoning and finish reason
    restored, a replayed user prompt shown once across a lineage, background-review harness
    turns dropped, and (``repair_alternation``) Hermes's own repair of the sequence."""
    sanitize_context = hermes_helper("agent.memory_manager", "sanitize_context")
    messages: list[dict[str, Any]] = []
    for row in rows:
        content = reads.given_content(row)
        if row["role"] in ("user", "assistant") and isinstance(content, str):
            content = sanitize_context(content).strip()
        msg: dict[str, Any] = {"role": row["role"], "content": content}
        if row["api_content"]:
            msg["api_content"] = row["api_content"]
        if row["timestamp"]:
            msg["timestamp"] = row["timestamp"]
        if row["tool_call_id"]:
            msg["tool_call_id"] = row["tool_call_id"]
        if row["tool_name"]:
            msg["tool_name"] = row["tool_name"]
        if row["effect_disposition"]:
            msg["effect_disposition"] = row["effect_disposition"]
        if row["tool_calls"]:
            msg["tool_calls"] = json_or(row["tool_calls"], [])
        if row["platform_message_id"]:
            msg["message_id"] = row["platform_message_id"]
        if row["observed"]:
            msg["observed"] = True
        if row["role"] == "assistant":
            if row["finish_reason"]:
                msg["finish_reason"] = row["finish_reason"]
            if row["reasoning"]:
                msg["reasoning"] = row["reasoning"]
            if row["reasoning_content"] is not None:
                msg["reasoning_content"] = row["reasoning_content"]
            for key in ("reasoning_details", "codex_reasoning_items", "codex_message_items"):
                if row[key]:
                    msg[key] = json_or(row[key], None)
        if include_ancestors and _replayed_user_prompt(messages, msg):
            continue
        messages.append(msg)
    messages = _without_review_harness(messages)
    if repair_alternation and messages:
        repair = hermes_helper("agent.agent_runtime_helpers", "repair_message_sequence")
        repaired = repair(None, messages)
        if repaired:
            logger.info("repaired %d message-alternation violation(s) restoring session %s",
                        repaired, session_id)
    return messages


def _replayed_user_prompt(messages: Sequence[Mapping[str, Any]],
                          msg: Mapping[str, Any]) -> bool:
    """A user prompt equal to the last one before any assistant reply (a resumed session
    replays its prompt into the next segment)."""
    content = msg.get("content")
    if msg.get("role") != "user" or not isinstance(content, str) or not content:
        return False
    for prev in reversed(messages):
        if prev.get("role") == "user" and prev.get("content") == content:
            return True
        if prev.get("role") == "assistant" and (prev.get("content") or prev.get("tool_calls")):
            return False
    return False


def _without_review_harness(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop the background-review harness prompts an older Hermes wrote into real sessions,
    with the curator reply right after each."""
    out: list[dict[str, Any]] = []
    skip_reply = False
    for msg in messages:
        content = msg.get("content")
        if (msg.get("role") in ("user", "system") and isinstance(content, str)
                and content.lstrip().startswith(_REVIEW_HARNESS_PREFIXES)):
            skip_reply = True
            continue
        if skip_reply:
            skip_reply = False
            if msg.get("role") == "assistant":
                continue
        out.append(msg)
    return out


def hermes_helper(module: str, name: str) -> Any:
    """A helper of the installed hermes-agent (the client this module stands in for)."""
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except ImportError as exc:
        raise HermesMemoryError(f"Hermes's session store needs hermes-agent installed ({exc})"
                                ) from exc
