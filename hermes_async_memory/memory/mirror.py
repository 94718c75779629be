"""Hermes's own memory writes, kept as key-value memory of the user.

Hermes Agent keeps built-in memory in two files (MEMORY.md, USER.md: ``target`` "memory" and
"user") of short entries without names, and tells the provider of each write
(``on_memory_write``): ``add`` a new entry; ``replace`` the entry holding ``old_text`` with
new content; ``remove`` the entry holding ``old_text``. Here each entry is a key-value entry
under ``<target>:<hash of its first content>``; a replace or remove finds the entry the way
Hermes does, by the text it holds. A subagent's task and result (``on_delegation``) become an
observation entry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import structlog

from .backends import Memory
from .entries import InvalidEntryError

log = structlog.get_logger(__name__)

BUILTIN_ACTIONS = ("add", "replace", "remove")
_DIGEST_CHARS = 16


def builtin_key(target: str, content: str) -> str:
    """The key an added built-in entry is kept under."""
    digest = hashlib.blake2b(content.encode("utf-8", "surrogatepass"),
                             digest_size=_DIGEST_CHARS // 2).hexdigest()
    return f"{target}:{digest}"


async def mirror_builtin_write(memory: Memory, user_id: str, action: str, target: str,
                               content: str, *, old_text: str | None = None,
                               provenance: Mapping[str, Any] | None = None) -> str | None:
    """Apply one write of Hermes's built-in memory; the key it changed (None: a replace or
    remove found no entry holding ``old_text``, or a remove without one).

    Raises:
        InvalidEntryError: an unknown action or target, or content that cannot be kept.
        whatever ``memory.store`` and ``memory.delete`` raise.
    """
    if action not in BUILTIN_ACTIONS:
        raise InvalidEntryError(f"action must be one of {', '.join(BUILTIN_ACTIONS)}, "
                                f"got {action!r:.40}")
    if not isinstance(target, str) or not target or ":" in target:
        raise InvalidEntryError(f"target must be a name without ':', got {target!r:.40}")
    if not isinstance(content, str):
        raise InvalidEntryError(f"content must be a string, got {type(content).__name__}")
    content = content.strip()
    needle = (old_text or "").strip()
    prefix = f"{target}:"
    held = await memory.find(user_id, needle, prefix=prefix) if needle else None
    md = {"source": "hermes-builtin-memory", "target": target, "action": action,
          **({"provenance": dict(provenance)} if provenance else {})}
    if action == "remove":
        if held is None:
            log.info("builtin_memory_remove_unmatched", target=target, user_id=user_id)
            return None
        await memory.delete(user_id, held.key)
        return held.key
    if not content:
        raise InvalidEntryError(f"a built-in memory {action} needs content")
    key = held.key if held is not None else builtin_key(target, content)
    if action == "replace" and held is None:
        log.info("builtin_memory_replace_unmatched", target=target, user_id=user_id,
                 stored_as=key)
    await memory.store(user_id, key, content, md)
    return key


async def record_delegation(memory: Memory, user_id: str, task: str, result: str, *,
                            session_id: str, child_session_id: str | None = None) -> str:
    """Keep a subagent's task and result as an observation entry; its key."""
    if not isinstance(task, str) or not isinstance(result, str):
        raise InvalidEntryError("task and result must be strings")
    name = child_session_id or builtin_key("task", f"{session_id}\n{task}").split(":", 1)[1]
    key = f"delegation:{name}"
    md = {"kind": "observation", "source": "hermes-delegation", "session_id": session_id,
          **({"child_session_id": child_session_id} if child_session_id else {})}
    await memory.store(user_id, key, f"Task: {task.strip()}\nResult: {result.strip()}", md)
    return key
