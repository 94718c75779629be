"""The prefetch cache: what prefetch() answers from, with no I/O and no locks.

An entry holds a session's last few committed turns (refreshed by every commit, so a session
always recalls its own latest turns) and the block of its last recall. The rendered text is
built on first read after a change and kept, so a warm prefetch is one dict lookup.

Reads may come from any thread; writes come from the event loop. Single dict and attribute
operations are atomic under the GIL; a writer bumps an entry's version after each change and a
reader keeps its rendering only tagged with the version it rendered, so a render that raced a
change is never served after it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PrefetchStatus:
    """How fresh a session's cached block is, and which turn it reflects."""

    session_id: str
    cached: bool
    last_turn_key: str | None = None
    turns_committed: int = 0
    committed_age_s: float | None = None
    recall_query: str | None = None
    recall_age_s: float | None = None
    source: str = "local"
    stale: bool = False


@dataclass(slots=True)
class _Entry:
    user_id: str | None
    recent: deque[tuple[str, str, str]]  # (turn key, user text, assistant text)
    last_turn_key: str | None = None
    turns_committed: int = 0
    committed_mono: float | None = None
    recall_block: str = ""
    recall_query: str | None = None
    recall_mono: float | None = None
    recall_source: str = "local"
    recall_stale: bool = False
    version: int = 0
    warmed: bool = False  # its stored turns from before this process were looked up
    rendered: tuple[int, str] | None = field(default=None)


class RecallCache:
    """Per-session prefetch blocks, bounded; the least recently written entry goes first."""

    def __init__(self, *, max_sessions: int, recent_turns: int, recent_chars: int,
                 clock: object = time.monotonic) -> None:
        self._entries: dict[str, _Entry] = {}
        self._max = max_sessions
        self._recent_turns = recent_turns
        self._recent_chars = recent_chars
        self._clock = clock
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    # -- reads (any thread) ------------------------------------------------------------

    def get(self, session_id: str) -> str:
        entry = self._entries.get(session_id)
        if entry is None:
            self.misses += 1
            return ""
        rendered = entry.rendered
        version = entry.version
        if rendered is None or rendered[0] != version:
            text = self._render(entry)
            entry.rendered = (version, text)
        else:
            text = rendered[1]
        self.hits += 1
        return text

    def user_of(self, session_id: str) -> str | None:
        entry = self._entries.get(session_id)
        return entry.user_id if entry is not None else None

    def status(self, session_id: str) -> PrefetchStatus:
        entry = self._entries.get(session_id)
        if entry is None:
            return PrefetchStatus(session_id=session_id, cached=False)
        now = self._now()
        return PrefetchStatus(
            session_id=session_id,
            cached=True,
            last_turn_key=entry.last_turn_key,
            turns_committed=entry.turns_committed,
            committed_age_s=None if entry.committed_mono is None else now - entry.committed_mono,
            recall_query=entry.recall_query,
            recall_age_s=None if entry.recall_mono is None else now - entry.recall_mono,
            source=entry.recall_source,
            stale=entry.recall_stale,
        )

    # -- writes (event loop) -----------------------------------------------------------

    def note_commit(self, session_id: str, user_id: str | None, key: str,
                    user_text: str, assistant_text: str, now: float) -> None:
        entry = self._touch(session_id, user_id)
        limit = self._recent_chars
        entry.recent.append((key, _clip(user_text, limit), _clip(assistant_text, limit)))
        entry.last_turn_key = key
        entry.turns_committed += 1
        entry.committed_mono = now
        entry.version += 1

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._entries

    def needs_warm(self, session_id: str) -> bool:
        """Whether the session's stored turns from before this process were never looked up."""
        entry = self._entries.get(session_id)
        return entry is None or not entry.warmed

    def warm(self, session_id: str, turns: list[tuple[str, str | None, str, str]],
             now: float) -> bool:
        """Merge a session's stored recent turns (oldest first: key, user id, user text,
        assistant text) in front of what this process committed for it since. Returns
        whether the session's block changed."""
        entry = self._entries.get(session_id)
        fresh = entry is None
        if entry is None:
            if not turns:
                return False
            entry = self._touch(session_id, turns[-1][1])
        if entry.warmed:
            return False
        entry.warmed = True
        have = {item[0] for item in entry.recent}
        older = [(key, user, assistant) for key, _, user, assistant in turns if key not in have]
        if not older:
            return False
        limit = self._recent_chars
        merged = [(k, _clip(u, limit), _clip(a, limit)) for k, u, a in older]
        merged += list(entry.recent)
        entry.recent.clear()
        entry.recent.extend(merged)  # the deque keeps the newest recent_turns
        if fresh:  # what the cache reflects is the stored history
            entry.last_turn_key = older[-1][0]
            entry.committed_mono = now
            entry.turns_committed = len(older)
        # Otherwise the entry reflects this process's commits; their count and last turn stay.
        entry.version += 1
        return True

    def set_recall(self, session_id: str, user_id: str | None, query: str, block: str,
                   *, source: str = "local", fallback: bool = False) -> None:
        """A recall's block for the session's next prefetch.

        ``fallback``: the backend failed and ``block`` is the local store's. If the session
        holds a good block from the backend, that block stays, marked stale (its age keeps
        growing); otherwise the local block is served.
        """
        entry = self._touch(session_id, user_id)
        if fallback and entry.recall_block and entry.recall_source != "local":
            entry.recall_stale = True
            return
        entry.recall_block = block
        entry.recall_query = query
        entry.recall_mono = self._now()
        entry.recall_source = source
        entry.recall_stale = False
        entry.version += 1

    def _touch(self, session_id: str, user_id: str | None) -> _Entry:
        entries = self._entries
        entry = entries.pop(session_id, None)
        if entry is None:
            entry = _Entry(user_id=user_id, recent=deque(maxlen=self._recent_turns or 1))
            if len(entries) >= self._max:
                entries.pop(next(iter(entries)))
        elif user_id and not entry.user_id:
            entry.user_id = user_id
        entries[session_id] = entry  # re-inserted last: dict order is the eviction order
        return entry

    def _now(self) -> float:
        return self._clock()  # type: ignore[operator,no-any-return]

    def _render(self, entry: _Entry) -> str:
        parts = []
        if self._recent_turns and entry.recent:
            lines = ["Recent turns in this session:"]
            for _, user, assistant in tuple(entry.recent):
                lines.append(f"- user: {user}")
                if assistant:
                    lines.append(f"- assistant: {assistant}")
            parts.append("\n".join(lines))
        if entry.recall_block:
            parts.append(entry.recall_block)
        return "\n\n".join(parts)


def _clip(text: str, limit: int) -> str:
    text = " ".join(text.split()) if len(text) <= limit * 4 else " ".join(text[: limit * 4].split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
