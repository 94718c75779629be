"""The prefetch cache: what prefetch() answers from, with no I/O and no locks.

An entry belongs to one (user, session): two users who send the same session id (say
"default") never see each other's turns. It holds the session's last few committed turns
(refreshed by every commit, so a session always recalls its own latest turns) and the block
of its last recall. The rendered text is built on first read after a change and kept, so a
warm prefetch is one dict lookup.

Reads may come from any thread; writes come from the event loop. Single dict operations are
atomic under the GIL, and an entry is never taken out of the dict to be moved (the LRU order
is kept with ``OrderedDict.move_to_end``), so a reader never misses an entry that is there.
A writer bumps an entry's version after each change and a reader keeps its rendering only
tagged with the version it rendered, so a render that raced a change is never served after it.

``fresh`` holds the rendered text of the entries that have not changed since: the warm path
is a ``fresh.get`` (no entry, no version compare). A change takes the entry's text out of
``fresh`` with its version bump, and a reader puts a rendering in only if the version it
rendered is still the entry's (and the entry is still cached): each of those under
``_lock``, held for a few operations, so a text is in ``fresh`` only while it is its
entry's current one. The lock is never taken on the warm path.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..fence import DEFAULT_FENCE, Fence
from ..ops import OP_SESSION, parse_session_record
from ..turns import TURN

if TYPE_CHECKING:
    from ..backends import WriteNotice
    from ..turns import Turn

CacheKey = tuple[str | None, str]  # (user id, session id)
MAX_DELETES_KEPT = 4096  # deleted sessions and users remembered against late results
RECALL_HEADER = "Related memory:"
RECENT_HEADER = "Recent turns in this session:"


@dataclass(frozen=True, slots=True)
class PrefetchStatus:
    """How fresh a session's cached block is, and which turn it reflects."""

    session_id: str
    cached: bool
    user_id: str | None = None
    last_turn_key: str | None = None
    turns_committed: int = 0
    committed_age_s: float | None = None
    recall_query: str | None = None
    recall_age_s: float | None = None
    source: str = "local"
    stale: bool = False


@dataclass(slots=True)
class _Entry:
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
    """Per-(user, session) prefetch blocks, bounded; the least recently written goes first."""

    def __init__(self, *, max_sessions: int, recent_turns: int, recent_chars: int,
                 clock: Callable[[], float] = time.monotonic,
                 fence: Fence = DEFAULT_FENCE) -> None:
        self._entries: OrderedDict[CacheKey, _Entry] = OrderedDict()
        # Each unchanged entry's rendered text (see the module's docstring); never rebound,
        # so a reader may keep a reference to it.
        self.fresh: dict[CacheKey, str] = {}
        self._lock = threading.Lock()
        # The sessions cached for each user: who to refresh when a user's memory changes.
        self._by_user: dict[str | None, dict[str, None]] = {}
        self._max = max_sessions
        self._recent_turns = recent_turns
        self._recent_chars = recent_chars
        self._clock = clock
        # Stored text never holds the tags the block is wrapped in (fence.py): made inert as
        # an entry is written, so prefetch() stays a lookup.
        self._fence = fence
        self.hits = 0
        self.misses = 0
        # Called after every change (event-loop thread): the pipeline wakes its waiters.
        self.on_change: Callable[[], None] = _nothing
        # Deleted sessions (and their users), with the count of deletes when each went: a
        # warm-up or recall that read the store before the delete must not put back what it
        # read (``epoch()`` when it started, passed to ``warm``/``set_recall``).
        self._deletes = 0
        self._deleted: OrderedDict[tuple[str, str], int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    # -- reads (any thread) ------------------------------------------------------------

    def cached(self, user_id: object, session_id: object) -> str | None:
        """The block of a cached (user, session), rendered now if a commit changed it and
        kept in ``fresh`` (where ``MemoryPipeline.prefetch`` looks first; this is its way
        when the block is not there); counted as a hit. None when it has no entry (not
        counted: see ``get``). Entries exist only for ids that were checked, so a hit needs
        no check.

        Raises:
            TypeError: an id is not hashable (so not an id).
        """
        key: CacheKey = (user_id, session_id)  # type: ignore[assignment]
        entry = self._entries.get(key)
        if entry is None:
            return None
        rendered = entry.rendered
        version = entry.version
        if rendered is None or rendered[0] != version:
            text = self._render(entry)
            entry.rendered = (version, text)
        else:
            text = rendered[1]
        with self._lock:  # only the current version's text, of an entry still cached
            if entry.version == version and self._entries.get(key) is entry:
                self.fresh[key] = text
        self.hits += 1
        return text

    def get(self, user_id: str | None, session_id: str) -> str:
        """The (user, session)'s block, or "" (counted as a miss)."""
        text = self.cached(user_id, session_id)
        if text is None:
            self.misses += 1
            return ""
        return text

    def status(self, user_id: str | None, session_id: str) -> PrefetchStatus:
        entry = self._entries.get((user_id, session_id))
        if entry is None:
            return PrefetchStatus(session_id=session_id, cached=False, user_id=user_id)
        now = self._clock()
        return PrefetchStatus(
            session_id=session_id,
            cached=True,
            user_id=user_id,
            last_turn_key=entry.last_turn_key,
            turns_committed=entry.turns_committed,
            committed_age_s=None if entry.committed_mono is None else now - entry.committed_mono,
            recall_query=entry.recall_query,
            recall_age_s=None if entry.recall_mono is None else now - entry.recall_mono,
            source=entry.recall_source,
            stale=entry.recall_stale,
        )

    def stale_blocks(self) -> int:
        """Entries serving a backend's block marked stale (the backend could not be asked)."""
        return sum([1 for entry in list(self._entries.values()) if entry.recall_stale])

    def followed(self, notice: WriteNotice) -> list[tuple[str | None, str, str]]:
        """(user, session, last recall query) of the entries whose recall block ``notice``
        may have outdated: those of its users and of its user-less sessions, or all."""
        entries, out = self._entries, []
        if notice.everyone:
            keys: list[CacheKey] = list(entries)
        else:
            by_user = self._by_user
            keys = [(user, session) for user in notice.users
                    for session in by_user.get(user, ())]
            keys += [(None, session) for session in notice.sessions]
        for key in keys:
            entry = entries.get(key)
            if entry is not None and entry.recall_query is not None:
                out.append((key[0], key[1], entry.recall_query))
        return out

    def needs_warm(self, user_id: str | None, session_id: str) -> bool:
        """Whether the session's stored turns from before this process were never looked up."""
        entry = self._entries.get((user_id, session_id))
        return entry is None or not entry.warmed

    # -- writes (event loop) -----------------------------------------------------------

    def note_commits(self, turns: Sequence[Turn], now: float) -> None:
        """A committed batch's turns, in order, into their sessions' recent turns, with one
        ``on_change`` after them all."""
        limit, touch, inert, bump = (self._recent_chars, self._touch,
                                     self._fence.neutralize, self._bump)
        for t in turns:
            if t.kind != TURN:  # an operation: no session's turn
                if t.kind == OP_SESSION and _deletes(t):
                    self._forget(t.session_id, t.user_id)
                continue
            key = (t.user_id, t.session_id)
            entry = touch(key)
            entry.recent.append((t.key, inert(_clip(t.user_text, limit)),
                                 inert(_clip(t.assistant_text, limit))))
            entry.last_turn_key = t.key
            entry.turns_committed += 1
            entry.committed_mono = now
            bump(key, entry)
        if turns:
            self.on_change()

    def epoch(self) -> int:
        """The deletes so far: what a reader of the store notes before it reads."""
        return self._deletes

    def _stale(self, user_id: str | None, session_id: str, epoch: int | None) -> bool:
        """Whether a result read at ``epoch`` may hold what a later delete removed."""
        if epoch is None or epoch == self._deletes:
            return False
        deleted = self._deleted
        return (deleted.get(("s", session_id), -1) > epoch
                or (user_id is not None and deleted.get(("u", user_id), -1) > epoch))

    def forget_session(self, session_id: str, user_id: str | None) -> None:
        """A deleted session: its entries go, and so do the recall blocks of its user's other
        sessions (a block may quote it) until their next recall."""
        if self._forget(session_id, user_id):
            self.on_change()

    def _forget(self, session_id: str, user_id: str | None) -> bool:
        """``forget_session`` without ``on_change``: whether it changed anything."""
        self._deletes += 1
        marks = [("s", session_id)] + ([("u", user_id)] if user_id is not None else [])
        for mark in marks:
            self._deleted[mark] = self._deletes
            self._deleted.move_to_end(mark)
        while len(self._deleted) > MAX_DELETES_KEPT:
            self._deleted.popitem(last=False)
        entries = self._entries
        gone = [key for key in entries if key[1] == session_id]
        with self._lock:
            for key in gone:
                del entries[key]
                self._unindex(key)
        dropped = 0
        if user_id is not None:
            for key, entry in entries.items():
                if key[0] == user_id and entry.recall_block:
                    entry.recall_block, entry.recall_query, entry.recall_mono = "", None, None
                    self._bump(key, entry)
                    dropped += 1
        return bool(gone or dropped)

    def warm(self, user_id: str | None, session_id: str,
             turns: list[tuple[str, str, str]], now: float, *, epoch: int | None = None) -> bool:
        """Merge a session's stored recent turns (oldest first: key, user text, assistant
        text) in front of what this process committed for it since. Returns whether the
        session's block changed. Dropped when the session was deleted after ``epoch``."""
        if self._stale(user_id, session_id, epoch):
            return False
        key = (user_id, session_id)
        entry = self._entries.get(key)
        new = entry is None
        if entry is None:
            if not turns:
                return False
            entry = self._touch(key)
        if entry.warmed:
            return False
        entry.warmed = True
        have = {item[0] for item in entry.recent}
        older = [t for t in turns if t[0] not in have]
        if not older:
            return False
        limit, inert = self._recent_chars, self._fence.neutralize
        merged = [(k, inert(_clip(u, limit)), inert(_clip(a, limit))) for k, u, a in older]
        merged += list(entry.recent)
        entry.recent.clear()
        entry.recent.extend(merged)  # the deque keeps the newest recent_turns
        if new:  # what the cache reflects is the stored history
            entry.last_turn_key = older[-1][0]
            entry.committed_mono = now
            entry.turns_committed = len(older)
        # Otherwise the entry reflects this process's commits; their count and last turn stay.
        self._bump(key, entry)
        self.on_change()
        return True

    def set_recall(self, user_id: str | None, session_id: str, query: str, block: str,
                   *, source: str = "local", fallback: bool = False,
                   epoch: int | None = None) -> None:
        """A recall's block for the session's next prefetch.

        ``fallback``: the backend failed and ``block`` is the local store's. If the session
        holds a good block from the backend, that block stays, marked stale (its age keeps
        growing); otherwise the local block is served.
        """
        if self._stale(user_id, session_id, epoch):
            return  # read before a delete of the session or of its user's other session
        # The local block's stored text is inert already; a backend's block is made so here.
        block = self._fence.neutralize(block)
        key = (user_id, session_id)
        entry = self._touch(key)
        if fallback and entry.recall_block and entry.recall_source != "local":
            entry.recall_stale = True  # not shown in the block: its text stays
        else:
            entry.recall_block = block
            entry.recall_query = query
            entry.recall_mono = self._clock()
            entry.recall_source = source
            entry.recall_stale = False
            self._bump(key, entry)
        self.on_change()

    def _bump(self, key: CacheKey, entry: _Entry) -> None:
        """An entry just changed: a new version, and its kept block goes (see the module's
        docstring: a reader keeps a block under the same lock)."""
        with self._lock:
            entry.version += 1
            self.fresh.pop(key, None)

    def _touch(self, key: CacheKey) -> _Entry:
        entries = self._entries
        entry = entries.get(key)
        if entry is None:
            entry = _Entry(recent=deque(maxlen=self._recent_turns or 1))
            entries[key] = entry
            self._by_user.setdefault(key[0], {})[key[1]] = None
            while len(entries) > self._max:
                with self._lock:
                    self._unindex(entries.popitem(last=False)[0])
        else:
            entries.move_to_end(key)  # in place: a reader on another thread still finds it
        return entry

    def _unindex(self, key: CacheKey) -> None:
        """A key whose entry left the cache (under the lock)."""
        self.fresh.pop(key, None)
        sessions = self._by_user.get(key[0])
        if sessions is not None:
            sessions.pop(key[1], None)
            if not sessions:
                del self._by_user[key[0]]

    def _render(self, entry: _Entry) -> str:
        recent = [(user, assistant) for _, user, assistant in tuple(entry.recent)]
        return block_text(recent if self._recent_turns else (), entry.recall_block)


# A line of a prefetch block and which part of the cache entry it shows: (text, part,
# position, role). part: "heading" (the recent turns'), "recent" (a recent turn's line),
# "recall" (a line of the recall block) or "blank" (between the two); position: for
# "recent" the turn's among the recent turns (oldest first), for "recall" the line's in the
# recall block (``recall_block.split("\n")``), else -1; role: for "recent", "user" or
# "assistant", else "". A plain tuple: a block is rendered after every commit of its session.
BlockLine = tuple[str, str, int, str]


def _recent_lines(recent: Sequence[tuple[str, str]]) -> list[str]:
    """The recent turns' part of a block: the heading, then each turn's user and (when it
    has one) assistant line."""
    lines = [RECENT_HEADER]
    for user, assistant in recent:
        lines.append(f"- user: {user}")
        if assistant:
            lines.append(f"- assistant: {assistant}")
    return lines


def block_text(recent: Sequence[tuple[str, str]], recall_block: str) -> str:
    """The prefetch block ``RecallCache.get`` serves: the recent turns ((user text, assistant
    text), oldest first) under their heading, a blank line, and the recall block without the
    hits the recent turns already show. Rendered at the first prefetch after each change of
    the entry, so strings only; ``block_lines`` gives the same lines with their parts."""
    shown = "\n".join(_recent_lines(recent)) if recent else ""
    block = _without_shown(recall_block, shown) if recall_block and shown else recall_block
    if shown and block:
        return f"{shown}\n\n{block}"
    return shown or block


def block_lines(recent: Sequence[tuple[str, str]], recall_block: str) -> list[BlockLine]:
    """A prefetch block's lines: the recent turns ((user text, assistant text), oldest
    first) under their heading, then a blank line and the recall block, without the hits
    the recent turns already show (``_kept_lines``). What ``RecallCache.get`` serves,
    joined by newlines (``block_text``)."""
    out: list[BlockLine] = []
    shown = ""
    if recent:
        texts = _recent_lines(recent)
        out.append((texts[0], "heading", -1, ""))
        parts = iter(texts[1:])
        for position, (_, assistant) in enumerate(recent):
            out.append((next(parts), "recent", position, "user"))
            if assistant:
                out.append((next(parts), "recent", position, "assistant"))
        shown = "\n".join(texts)
    if recall_block:
        lines = recall_block.split("\n")
        kept = _kept_lines(recall_block, shown) if shown else range(len(lines))
        if kept and out:
            out.append(("", "blank", -1, ""))
        out.extend([(lines[i], "recall", i, "") for i in kept])
    return out


def _deletes(record: Turn) -> bool:
    """Whether a lifecycle event's record deletes its session (prune's form included)."""
    op = parse_session_record(record.payload)
    return op is not None and op.action == "delete"


def _nothing() -> None:
    return None


def _without_shown(block: str, shown: str) -> str:
    """The recall block without the hits whose text the recent turns already show; what
    follows the hits after a blank line (the procedural block) is kept as it is, and the
    hits' heading goes when no hit is left. Strings only: it runs at a prefetch."""
    hits, _, rest = block.partition("\n\n")
    lines = hits.split("\n")
    if lines[0] != RECALL_HEADER:
        return block  # a backend's block, or no hits: its own format
    kept = [lines[i] for i in _kept_hits(lines, shown)]
    head = "\n".join([RECALL_HEADER, *kept]) if kept else ""
    return f"{head}\n\n{rest}" if head and rest else head or rest


def _kept_lines(block: str, shown: str) -> list[int]:
    """``_without_shown`` as the positions of the block's lines (``block.split("\n")``) it
    keeps, for ``block_lines``."""
    hits, _, rest = block.partition("\n\n")
    lines = hits.split("\n")
    if lines[0] != RECALL_HEADER:
        return list(range(block.count("\n") + 1))
    kept = _kept_hits(lines, shown)
    head = [0, *kept] if kept else []
    # After the hits' lines, the blank line at len(lines), then the rest's lines.
    tail = list(range(len(lines) + 1, len(lines) + 2 + rest.count("\n"))) if rest else []
    if head and tail:
        return [*head, len(lines), *tail]
    return head or tail


def _kept_hits(lines: list[str], shown: str) -> list[int]:
    """The positions of the hit lines (after the heading, ``lines[0]``) whose text the
    recent turns (``shown``) do not already show."""
    kept = []
    for index in range(1, len(lines)):
        _, sep, text = lines[index].partition("] ")
        core = " ".join(text.replace("…", " ").split())
        if sep and core and (core in shown or _all_shown(core, shown)):
            continue
        kept.append(index)
    return kept


def _all_shown(core: str, shown: str) -> bool:
    """Whether a hit's line with the messages beside it (``role: text`` parts joined by
    `` | ``) shows only what the recent turns show (``- role: text`` lines)."""
    parts = core.split(" | ")
    return len(parts) > 1 and all(f"- {part}" in shown for part in parts)


def _clip(text: str, limit: int) -> str:
    """``text`` on one line, runs of whitespace as one space, at most ``limit`` characters."""
    if (len(text) <= limit and text.isprintable() and "  " not in text
            and text[:1] != " " and text[-1:] != " "):
        # Already one line with single spaces (the usual chat message): as is. Every
        # whitespace character but the space is non-printable, so split/join is a no-op here;
        # this check scans in C and skips building a list of every word (~1 µs a text).
        return text
    text = " ".join(text.split()) if len(text) <= limit * 4 else " ".join(text[: limit * 4].split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
