"""Message ids, given as a message is accepted, not as it is committed.

A store has one committing process (the embedded pipeline, or the worker); its ids come from
one counter there. The outbox takes a record's ids in the same lock that numbers the record,
so a session's messages are numbered in the order they were accepted, and ``sync_turn`` (or
the session store's ``append_message``) can say a message's id before the writer commits
it. The counter starts above the store's highest id and above every id an earlier run gave
to records still in its outbox; a record that came without ids (a producer's, handed in
through the shared inbox, or one an earlier version wrote) takes its ids as the writer
commits it, or, when it is recovered from the outbox at start, before any new record is
accepted: in accept order still.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class MessageIds:
    """The next message ids of one store. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 1
        self._protected: int | None = None  # an earlier run's records from here on are pending
        self._reserved: dict[str, int] = {}  # record key -> its first id, given ahead
        # The first id of the oldest record not yet committed (the outbox's), when known.
        self.oldest_pending: Callable[[], int | None] = lambda: None

    @property
    def floor(self) -> int:
        """No id below this is held by a record still to be committed, nor will be given
        out: a free one is free for good (an import may keep its exported ids there)."""
        floor = self._next
        for lowest in (self._protected, self.oldest_pending()):
            if lowest is not None:
                floor = min(floor, lowest)
        return floor

    def protect(self, lowest: int) -> None:
        """An earlier run gave ids from ``lowest`` on to records not yet committed."""
        with self._lock:
            self._protected = lowest if self._protected is None else min(self._protected,
                                                                          lowest)

    def start_after(self, highest: int) -> None:
        """Ids from now on are above ``highest`` (the store's, or an earlier run's)."""
        with self._lock:
            self._next = max(self._next, int(highest) + 1)

    def take(self, n: int) -> int:
        """The first of ``n`` fresh consecutive ids."""
        with self._lock:
            return self.give_locked(n)

    def use_lock(self, lock: threading.Lock) -> None:
        """Guard the counter with ``lock`` from now on: the outbox's, which an append holds
        as it takes the record's ids (``give_locked``). Call it while no other thread uses
        this."""
        self._lock = lock

    def give_locked(self, n: int) -> int:
        """``take`` for a caller that already holds the lock given to ``use_lock``."""
        first = self._next
        self._next += max(int(n), 1)
        return first

    def reserve(self, key: str, n: int) -> None:
        """Give the record ``key`` (recovered without ids) its ids now, in accept order."""
        with self._lock:
            if key not in self._reserved:
                first = self._reserved[key] = self.give_locked(n)
                self._protected = first if self._protected is None else min(self._protected,
                                                                             first)

    def for_record(self, key: str, n: int) -> int:
        """The first id of a record that came without: reserved for it at start, or fresh."""
        with self._lock:
            first = self._reserved.get(key)
            return first if first is not None else self.give_locked(n)

    def peek(self) -> int:
        """The next id to be given (for tests and stats)."""
        return self._next
