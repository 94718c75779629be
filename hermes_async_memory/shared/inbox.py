"""A worker's second source: the shared inbox the producers hand their batches to.

Turns are claimed under an expiring lease (the store's ``claim_inbox`` never claims a turn
whose session has an earlier turn under another worker's live claim, so per-session order
holds across workers). A claim held by a worker process that is gone from this host is taken
back at once, without waiting out its lease. A commit removes its turns from the inbox in
the same transaction, and only while the lease holds.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Sequence

import structlog

from ..slices import maybe_yield
from ..store import SqliteStore
from ..turns import Turn
from ..writer import Unreadable, Work

log = structlog.get_logger(__name__)

LEASE_SWEEP_S = 1.0  # how often a worker looks for claims of workers that are gone


def lease_owner(key_prefix: str) -> str:
    """This process as a lease owner: host, pid (so a worker on the same host can tell a
    gone owner at once) and the pipeline's key prefix."""
    return f"{socket.gethostname()}:{os.getpid()}:{key_prefix}"


class InboxSource:
    """Claims batches from the shared inbox for a worker's writer."""

    name = "inbox"
    polls = True  # producers in other processes hand turns in with no wake-up to wait on

    def __init__(self, store: SqliteStore, owner: str, lease_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._store = store
        self.lease_owner: str | None = owner
        self._lease_s = lease_s
        self._clock = clock
        self._next_sweep = 0.0
        self.committed = 0
        self.reclaimed = 0

    def waiting(self) -> int:
        return 0  # unknown without a query; the writer polls

    async def take(self, max_turns: int, max_bytes: int) -> Work | None:
        if self._clock() >= self._next_sweep:
            self._next_sweep = self._clock() + LEASE_SWEEP_S
            await self._sweep_gone_leases()
        assert self.lease_owner is not None
        rows = await self._store.claim_inbox(self.lease_owner, self._lease_s, max_turns)
        if not rows:
            return None
        items: list[Turn | Unreadable] = []
        for inbox_id, key, session_id, _accepted_at, record, error in rows:
            items.append(_item(inbox_id, key, session_id, record, error))
            await maybe_yield()
        return Work(items)

    async def settle(self, items: Sequence[Turn | Unreadable], *, committed: bool) -> None:
        if committed:  # the commit removed their inbox rows
            self.committed += len(items)
            return
        await self._store.delete_inbox([item.seq for item in items])

    async def _sweep_gone_leases(self) -> None:
        host = socket.gethostname()
        for owner in await self._store.lease_owners():
            if owner == self.lease_owner:
                continue
            owner_host, _, rest = owner.partition(":")
            pid_text = rest.partition(":")[0]
            if owner_host != host or not pid_text.isdigit() or process_alive(int(pid_text)):
                continue
            released = await self._store.release_leases(owner)
            self.reclaimed += released
            log.warning("inbox_leases_reclaimed", owner=owner, turns=released)


def _item(inbox_id: int, key: str, session_id: str, record: str, error: str | None
          ) -> Turn | Unreadable:
    if error is not None:  # a producer found it unstorable: a dead letter, under our lease
        return Unreadable(inbox_id, key, session_id, record.encode("utf-8", "replace"), error)
    try:
        turn = Turn.decode(record, seq=inbox_id)
    except (ValueError, LookupError, TypeError, RecursionError) as exc:
        return Unreadable(inbox_id, key, session_id, record.encode("utf-8", "replace"),
                          f"unreadable inbox record: {type(exc).__name__}: {exc}")
    if turn.key != key:
        return Unreadable(inbox_id, key, session_id, record.encode("utf-8", "replace"),
                          f"unreadable inbox record: it holds turn {turn.key!r}")
    return turn


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, someone else's
    return True
