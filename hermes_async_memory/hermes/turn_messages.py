"""What a Hermes turn's ``messages=`` holds for the store: the turn's own messages out of the
conversation Hermes passes, and their token counts (reported, or estimated and marked)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ..turns import MAX_TOKENS, is_token_count

CHARS_PER_TOKEN = 4  # the estimate when a turn's messages report no usage


def this_turn(messages: Sequence[Mapping[str, Any]], user_content: str,
              assistant_content: str) -> list[dict[str, Any]] | None:
    """This turn's messages out of the conversation Hermes passes, user text as given.

    Hermes hands its live message list to a worker thread, so by the time ``sync_turn`` runs
    the next turn may have been appended: the turn ends at its final assistant message (the
    last one equal to ``assistant_content`` within the last two user turns), else at the
    end. Its user message is replaced by ``user_content``, which Hermes has already cleaned
    of skill scaffolding. None when there is no user message to start from.
    """
    snapshot = list(messages)
    end = len(snapshot)
    users_seen = 0
    for i in range(len(snapshot) - 1, -1, -1):
        m = snapshot[i]
        if not isinstance(m, Mapping):
            continue
        role = m.get("role")
        if role == "assistant" and m.get("content") == assistant_content:
            end = i + 1
            break
        if role == "user":
            users_seen += 1
            if users_seen == 2:
                break
    for start in range(end - 1, -1, -1):
        m = snapshot[start]
        if isinstance(m, Mapping) and m.get("role") == "user":
            rows = [dict(r) for r in snapshot[start:end] if isinstance(r, Mapping)]
            if user_content:
                rows[0]["content"] = user_content
            return rows
    return None


def token_counts(rows: Sequence[Mapping[str, Any]] | None, user_content: str,
                 assistant_content: str) -> tuple[int, int, bool]:
    """(input tokens, output tokens, estimated) of a turn: the usage its assistant messages
    report when every one of them reports it (OpenAI's ``prompt_tokens`` and
    ``completion_tokens``, or ``input_tokens`` and ``output_tokens``); else estimated at
    about four characters a token, from what was sent (user and tool text) and what came
    back (assistant text and tool calls)."""
    replies = [m for m in rows or () if m.get("role") == "assistant"]
    if replies and all(isinstance(m.get("usage"), Mapping) for m in replies):
        tokens_in = tokens_out = 0
        for m in replies:
            usage = m["usage"]
            got_in = usage.get("prompt_tokens", usage.get("input_tokens"))
            got_out = usage.get("completion_tokens", usage.get("output_tokens"))
            if not (is_token_count(got_in) and is_token_count(got_out)):
                break
            tokens_in += got_in
            tokens_out += got_out
        else:
            return min(tokens_in, MAX_TOKENS), min(tokens_out, MAX_TOKENS), False
    sent = len(user_content) if not rows else 0
    said = len(assistant_content) if not rows else 0
    for m in rows or ():
        text = m.get("content")
        size = len(text) if isinstance(text, str) else 0
        if m.get("role") == "assistant":
            calls = m.get("tool_calls")
            said += size + (len(json.dumps(calls, default=str)) if calls else 0)
        else:
            sent += size
    return -(-sent // CHARS_PER_TOKEN), -(-said // CHARS_PER_TOKEN), True

