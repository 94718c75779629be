"""Hermes's export (``export_session``, ``export_all``) as this library's export lines,
checked as Hermes checks an import: ``SessionDB.import_sessions`` and ``hermes-memory hermes
import-state`` take sessions this way. What Hermes hands over is stored as given."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..store import hermes_reads as reads

logger = logging.getLogger(__name__)

# A session's text fields Hermes's import checks are text.
_IMPORT_TEXT_FIELDS = (
    "source", "user_id", "model", "system_prompt", "end_reason", "cwd", "git_branch",
    "git_repo_root", "billing_provider", "billing_base_url", "billing_mode", "cost_status",
    "cost_source", "pricing_version", "title")

# A message's fields Hermes keeps as text, and those it keeps as JSON text.
_MESSAGE_TEXT_FIELDS = ("tool_call_id", "tool_name", "effect_disposition", "finish_reason",
                        "reasoning", "reasoning_content", "platform_message_id", "api_content")
_MESSAGE_JSON_FIELDS = ("reasoning_details", "codex_reasoning_items", "codex_message_items")


def hermes_session_line(raw: Any, sid: str, seen: Sequence[str], *, max_messages: int | None,
                        max_bytes: int | None, as_stored: bool = False
                        ) -> tuple[str, int, int]:
    """One session of Hermes's export (``export_session``, ``export_all``) as our export line,
    checked as Hermes checks an import: (the line, its messages, its size). ``max_messages``,
    ``max_bytes``: its bounds (Hermes's import has them; None: none). The message and
    tool-call counts are those of the messages given, and the rewinds start at 0, as
    Hermes's import has them; with ``as_stored`` (a session read from Hermes's own file,
    every message of it), the row's own counts are kept.

    Raises:
        ValueError: with Hermes's words for what is wrong.
    """
    if not isinstance(raw, dict):
        raise ValueError("session must be an object")
    if not sid:
        raise ValueError("session id is required")
    if sid in seen:
        raise ValueError("duplicate session id")
    messages = raw.get("messages") or []
    if not isinstance(messages, list):
        raise ValueError("messages must be a list")
    if max_messages is not None and len(messages) > max_messages:
        raise ValueError("messages exceeds the per-session import limit")
    if any(not isinstance(m, dict) for m in messages):
        raise ValueError("messages must contain only objects")
    try:
        size = len(json.dumps(raw, ensure_ascii=False, separators=(",", ":")).encode())
    except (TypeError, ValueError):
        raise ValueError("session must be JSON serializable") from None
    if max_bytes is not None and size > max_bytes:
        raise ValueError("session exceeds the import size limit")
    row = {k: raw.get(k) for k in reads.SESSION_COLUMNS if k in raw}
    config = row.get("model_config")
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            raise ValueError("model_config must be valid JSON") from None
    if config is not None and not isinstance(config, dict):
        raise ValueError("model_config must be a JSON object")
    for name in ("parent_session_id", *_IMPORT_TEXT_FIELDS):
        if row.get(name) is not None and not isinstance(row[name], str):
            raise ValueError(f"{name} must be a string")
    started = _number_or(row.get("started_at"), time.time())
    converted = [_import_message(sid, i, m, started) for i, m in enumerate(messages)]
    row.update({
        "id": sid, "source": row.get("source") or "import", "started_at": started,
        "model_config": None if config is None else json.dumps(config),
        "message_count": len(converted),
        "tool_call_count": sum(len(m["message"].get("tool_calls") or ())
                               for m in converted),
        # A channel's live state belongs to the process that ran it, not to history.
        "handoff_state": None, "handoff_platform": None, "handoff_error": None,
        "rewind_count": 0, "archived": 1 if raw.get("archived") else 0,
    })
    for name in ("ended_at", "estimated_cost_usd", "actual_cost_usd"):
        row[name] = _number_or(row.get(name), None)
    for name in ("input_tokens", "output_tokens", "cache_read_tokens",
                 "cache_write_tokens", "reasoning_tokens", "api_call_count"):
        row[name] = int(_number_or(row.get(name), 0))
    if as_stored:
        for name in ("message_count", "tool_call_count", "rewind_count"):
            if type(raw.get(name)) is int:
                row[name] = raw[name]
    row["updated_at"] = row.get("ended_at") or started
    return json.dumps({**row, "messages": converted}), len(converted), size


def _import_message(sid: str, index: int, m: Mapping[str, Any], started: float
                    ) -> dict[str, Any]:
    """A message of Hermes's export (a ``get_messages`` row) as our export line holds it:
    the message as Hermes was given it, with its time and place.

    Raises:
        ValueError: with Hermes's words for what is wrong.
    """
    role = m.get("role")
    if not isinstance(role, str) or not role:
        raise ValueError(f"messages[{index}].role must be a non-empty string")
    message: dict[str, Any] = {"role": role, "content": m.get("content")}
    for name in _MESSAGE_TEXT_FIELDS:
        value = m.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise ValueError(f"{name} must be a string")
            message[name] = value
    if m.get("message_id") is not None and "platform_message_id" not in message:
        message["platform_message_id"] = m["message_id"]
    for name in _MESSAGE_JSON_FIELDS:
        value = m.get(name)
        if isinstance(value, str):
            value = json_or(value, value)
        if value:
            message[name] = value
    if m.get("tool_calls"):
        message["tool_calls"] = m["tool_calls"]
    if m.get("observed"):
        message["observed"] = True
    tokens = m.get("token_count")
    if tokens is not None:
        try:
            message["token_count"] = int(tokens)
        except (TypeError, ValueError):
            raise ValueError("token_count must be an integer") from None
    stamp = explicit_timestamp(m.get("timestamp"))
    if stamp is not None:
        message["timestamp"] = stamp
    mid = m.get("id")
    line = {"id": mid if type(mid) is int and mid > 0 else index + 1,
            "turn_key": f"{sid}#{index}", "role": role,
            "timestamp": stamp if stamp is not None else started,
            "active": 0 if m.get("active") == 0 else 1, "message": message}
    if m.get("compacted"):
        line["compacted"] = 1
    return line


def _number_or(value: Any, default: Any) -> Any:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return default
    return number if number == number and abs(number) != float("inf") else default


def explicit_timestamp(value: Any) -> float | None:
    """An explicit message time as Hermes takes one (a datetime, or a number); None when
    none was given or it cannot be read (Hermes ignores it then, stamping the message now)."""
    if value is None:
        return None
    try:
        stamp = float(value.timestamp()) if hasattr(value, "timestamp") else float(value)
    except (TypeError, ValueError, OverflowError):
        logger.debug("ignoring an invalid explicit message timestamp: %r", value)
        return None
    return stamp if stamp == stamp and stamp not in (float("inf"), float("-inf")) else None


def json_or(text: str, default: Any) -> Any:
    try:
        return json.loads(text)
    except (TypeError, ValueError):
        return default
