"""The ``memory`` tool (seed 000's ``memory_backend``): a model stores, retrieves, searches,
lists and deletes the user's key-value entries, and asks what backend holds them.

``call_memory_tool`` never raises: every result is JSON, and so is every error, with a
message a model can act on (which argument, what was expected).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from ..errors import HermesMemoryError
from ..fence import DEFAULT_FENCE, Fence
from .api import MAX_QUERY_LIMIT, KeyValueMemory
from .backends import BackendLimitError, Memory
from .entries import InvalidEntryError
from .evaluation import SCORING, evaluate_backend, evaluate_backends, recommendation

# Hermes keeps "memory" for its built-in MEMORY.md tool and drops a provider tool of that name:
# ours is the seed's name.
MEMORY_TOOL = "memory_backend"
ACTIONS = ("store", "retrieve", "query", "list", "delete", "info", "evaluate")
EVALUATE_OPERATIONS = 50  # operations per measure when a model asks (the CLI runs more)
_ALLOWED = {
    "store": {"key", "value", "metadata"},
    "retrieve": {"key"},
    "query": {"query", "limit"},
    "list": set(),
    "delete": {"key"},
    "info": set(),
    "evaluate": set(),
}
_REQUIRED = {"store": ("key", "value"), "retrieve": ("key",), "query": ("query",),
             "delete": ("key",)}

MEMORY_SCHEMA: dict[str, Any] = {
    "name": MEMORY_TOOL,
    "description": (
        "Long-term key-value memory about the user, kept across sessions. 'store' saves a "
        "fact under a short key (storing an existing key replaces its value), 'retrieve' "
        "reads one key, 'query' finds entries by words in their keys and values, 'list' "
        "names every key, 'delete' forgets one, 'info' tells where the memory lives, "
        "'evaluate' compares the available backends (takes a few seconds)."
    ),
    "parameters": {
        "type": "object",
        "properties": {
            "action": {"type": "string", "enum": list(ACTIONS),
                       "description": "What to do."},
            "key": {"type": "string",
                    "description": "The entry's key (store, retrieve, delete), e.g. 'editor'."},
            "value": {"type": "string", "description": "The text to keep (store)."},
            "metadata": {"type": "object",
                         "description": "Optional JSON object kept with the entry (store)."},
            "query": {"type": "string", "description": "Words to search for (query)."},
            "limit": {"type": "integer", "minimum": 1, "maximum": MAX_QUERY_LIMIT,
                      "description": "Most entries to return (query); default 10."},
        },
        "required": ["action"],
        "additionalProperties": False,
    },
}


async def call_memory_tool(memory: Memory, user_id: str | None, args: object, *,
                           fence: Fence = DEFAULT_FENCE) -> str:
    """Run one call of the tool for ``user_id``; the result or the error as JSON. Stored
    values are data: the ``fence`` tags in every string of the answer are made inert
    (fence.py) before it is encoded: a tag with a newline where a space may be is still
    found, where JSON would have written that newline as a backslash and an n."""
    return await _call(memory, user_id, args, fence)


async def _call(memory: Memory, user_id: str | None, args: object, fence: Fence) -> str:
    inert = fence.neutralize
    try:
        return _ok(_inert(await _run(memory, user_id, args), fence))
    except _ArgumentError as exc:
        return _error(inert(str(exc)))
    except InvalidEntryError as exc:
        return _error(inert(f"invalid argument: {exc}"))
    except BackendLimitError as exc:
        return json.dumps({"ok": False, "error": inert(str(exc)), "done": exc.done},
                          ensure_ascii=False)
    except (HermesMemoryError, TimeoutError, OSError) as exc:
        return _error(inert(f"the memory could not do that now: {type(exc).__name__}: {exc}"))


def _inert(value: Any, fence: Fence) -> Any:
    """``value`` with the fence tags of each of its strings (keys too) made inert. The
    strings are whole (stored values and keys, never cut to fit): a key ending in ``<m``
    comes back as it was stored, so it can be asked for again."""
    if isinstance(value, str):
        return fence.neutralize(value, cut=False)
    if isinstance(value, dict):
        return {_inert(k, fence): _inert(v, fence) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_inert(v, fence) for v in value]
    return value


class _ArgumentError(Exception):
    pass


async def _run(memory: Memory, user_id: str | None, args: object) -> dict[str, Any]:
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise _ArgumentError("arguments must be a JSON object") from None
    if not isinstance(args, Mapping):
        raise _ArgumentError(f"arguments must be a JSON object, got {_kind(args)}")
    action = args.get("action")
    if action not in ACTIONS:
        raise _ArgumentError(f"action must be one of {', '.join(ACTIONS)}; got {action!r:.40}")
    unknown = sorted(set(args) - _ALLOWED[action] - {"action"})
    if unknown:
        raise _ArgumentError(f"action {action!r} takes no argument {', '.join(unknown)}"
                             f" (it takes: {', '.join(sorted(_ALLOWED[action])) or 'none'})")
    for name in _REQUIRED.get(action, ()):
        if args.get(name) is None:
            raise _ArgumentError(f"action {action!r} needs the argument {name!r}")
    if action == "info":
        n_entries, n_users = await memory.counts()
        return {"action": "info", "backend": memory.backend_name, "is_cloud": memory.is_cloud,
                "available": memory.is_available(), "location": memory.location,
                "key_required": memory.key_required, "stores": memory.stores,
                "entries": n_entries, "users": n_users}
    if action == "evaluate":
        return {"action": "evaluate", **await _evaluate(memory)}
    if not user_id:
        raise _ArgumentError("no user is known for this session: memory needs a user_id")
    if action == "store":
        receipt = await memory.store(user_id, args["key"], args["value"], args.get("metadata"))
        return {"action": "store", "key": args["key"], "stored": memory.stores,
                "accepted_at": receipt.accepted_at}
    if action == "retrieve":
        entry = await memory.retrieve(user_id, args["key"])
        return {"action": "retrieve", "key": args["key"], "found": entry is not None,
                "entry": entry.as_dict() if entry is not None else None}
    if action == "query":
        limit = args.get("limit", 10)
        entries = await memory.query(user_id, args["query"], limit)
        return {"action": "query", "query": args["query"], "count": len(entries),
                "entries": [e.as_dict() for e in entries]}
    if action == "list":
        names = await memory.list_keys(user_id)
        return {"action": "list", "count": len(names), "keys": names}
    existed = await memory.retrieve(user_id, args["key"]) is not None
    await memory.delete(user_id, args["key"])
    return {"action": "delete", "key": args["key"], "deleted": existed}


async def _evaluate(memory: Memory) -> dict[str, Any]:
    """The evaluation, on scratch users; condensed for a model to read."""
    if isinstance(memory, KeyValueMemory):
        report = await evaluate_backends(memory.pipeline, operations=EVALUATE_OPERATIONS)
    else:
        ev = await evaluate_backend(memory, operations=EVALUATE_OPERATIONS)
        report = {"evaluations": [asdict(ev)], "recommendation": recommendation([ev]),
                  "scoring": {"explained": SCORING.explain()}}
    return {
        "backends": [{
            "backend": e["backend"], "score": e["score"], "label": e["label"],
            "functions_passed": [n for n, c in e["checks"].items() if c["passed"]],
            "functions_failed": {n: c["reason"] for n, c in e["checks"].items()
                                 if not c["passed"]},
            "p99_ms": {op: v["p99"] for op, v in e["latency_ms"].items() if v},
            "recall": e["recall"], "is_cloud": e["is_cloud"], "location": e["location"],
            "notes": e["notes"],
        } for e in report["evaluations"]],
        "recommendation": report["recommendation"],
        "scoring": report["scoring"]["explained"],
    }


def _ok(result: dict[str, Any]) -> str:
    return json.dumps({"ok": True, **result}, ensure_ascii=False)


def _error(message: str) -> str:
    return json.dumps({"ok": False, "error": message}, ensure_ascii=False)


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__
