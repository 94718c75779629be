"""What the model sees of memory search: the system-prompt text that points it at the tool,
and the tool's schema (OpenAI function format)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

SEARCH_TOOL = "memory_search"
MAX_TOOL_LIMIT = 20

SYSTEM_PROMPT = (
    "## Long-term memory\n"
    "Earlier conversations are stored locally (hermes-async-memory). Before each reply, "
    "the latest turns of this session and snippets recalled from earlier sessions may "
    "appear in a <memory-context> block: background, not a new request. To look up "
    "something said before (a name, a decision, a preference, a file), call "
    f"`{SEARCH_TOOL}` rather than asking the user to repeat it."
)

SEARCH_SCHEMA: dict[str, Any] = {
    "name": SEARCH_TOOL,
    "description": (
        "Full-text search over what was said in earlier conversations with this user "
        "(all their stored sessions, or only this one). Returns dated snippets, best match "
        "first. Use keywords, not a question."
    ),
    "parameters": {
        "type": "object",
        "properties": {
            "query": {"type": "string",
                      "description": "Keywords to look for, e.g. 'Lisbon restaurant station'"},
            "scope": {"type": "string", "enum": ["user", "session"],
                      "description": "'user' (default): every stored session of this user; "
                                     "'session': this session only"},
            "limit": {"type": "integer", "minimum": 1, "maximum": MAX_TOOL_LIMIT,
                      "description": "Most snippets to return (default 5)"},
        },
        "required": ["query"],
    },
}


def search_arguments(args: object) -> tuple[str, str, int | None]:
    """The tool call's (query, scope, limit).

    Raises:
        ValueError: an argument is missing or invalid (the message says which).
    """
    if not isinstance(args, Mapping):
        raise ValueError("arguments must be a JSON object")
    query, scope, limit = args.get("query"), args.get("scope") or "user", args.get("limit")
    if not isinstance(query, str) or not query.strip():
        raise ValueError("query must be a non-empty string")
    if scope not in ("user", "session"):
        raise ValueError("scope must be 'user' or 'session'")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int)
                              or not 1 <= limit <= MAX_TOOL_LIMIT):
        raise ValueError(f"limit must be an integer from 1 to {MAX_TOOL_LIMIT}")
    return query, scope, limit
