"""The writer's local source: records read back from this process's outbox, in accept order.

A record the writer has not settled stays in flight here, so a writer restarted after a
transient failure is offered it again before anything newer. Settling may happen out of
order (a dead letter in the middle of a batch); the outbox and the commit barrier advance
over the settled prefix only, so their counts always mean "everything up to here".
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Sequence

from .barrier import CommitBarrier
from .errors import describe
from .outbox import Outbox, Record
from .slices import CHUNK, maybe_yield
from .turns import Turn
from .writer import Unreadable, Work

# The key and session of a record whose JSON does not parse, when its head is still whole.
_HEAD = re.compile(r'^\{"k":("(?:[^"\\]|\\.)*"),"s":("(?:[^"\\]|\\.)*")')


class OutboxSource:
    """Reads batches from an ``Outbox``; records left by an earlier run come first, in
    batches of their own (the store may hold some of them already)."""

    name = "outbox"
    polls = False
    lease_owner: str | None = None

    def __init__(self, outbox: Outbox, barrier: CommitBarrier) -> None:
        self.outbox = outbox
        self._barrier = barrier
        self._inflight: deque[Record] = deque()
        self._settled: set[int] = set()

    def waiting(self) -> int:
        return self.outbox.unread()

    async def take(self, max_turns: int, max_bytes: int) -> Work | None:
        if self._inflight:  # a restarted writer: what it had not settled, first
            records = [r for r in self._inflight if r.seq not in self._settled]
        else:
            await maybe_yield()
            records = []
            recovering = bool(self.outbox.unread()) and self._reading_recovered()
            used = 0
            while len(records) < max_turns and used < max_bytes:
                chunk = self.outbox.read(min(CHUNK, max_turns - len(records)),
                                         max_bytes - used, recovered_only=recovering)
                if not chunk:
                    break
                records.extend(chunk)
                used += sum(len(r.payload) for r in chunk)
                await maybe_yield()
            self._inflight.extend(records)
        if not records:
            return None
        items: list[Turn | Unreadable] = []
        for i, r in enumerate(records):
            items.append(decode(r))
            if i % CHUNK == CHUNK - 1:
                await maybe_yield()
        return Work(items, replay=records[0].seq <= self.outbox.recovered)

    def _reading_recovered(self) -> bool:
        return self.outbox.accepted() - self.outbox.unread() < self.outbox.recovered

    async def settle(self, items: Sequence[Turn | Unreadable], *, committed: bool) -> None:
        inflight = self._inflight
        if (not self._settled and len(items) == len(inflight)
                and items[0].seq == inflight[0].seq and items[-1].seq == inflight[-1].seq):
            # The whole batch, in order: the usual case.
            whole = list(inflight)
            inflight.clear()
            self.outbox.mark_done(whole)
            self._barrier.settle(whole[-1].seq)
            return
        settled = self._settled
        settled.update(item.seq for item in items)
        prefix: list[Record] = []
        while inflight and inflight[0].seq in settled:
            record = inflight.popleft()
            settled.discard(record.seq)
            prefix.append(record)
        if prefix:
            self.outbox.mark_done(prefix)
            self._barrier.settle(prefix[-1].seq)


def decode(record: Record) -> Turn | Unreadable:
    """The turn a record holds, or what is known of a record that does not decode."""
    try:
        return Turn.decode(record.payload, record.segment, record.seq)
    except (ValueError, LookupError, TypeError, RecursionError) as exc:
        key, session_id = f"unreadable-{record.segment}-{record.offset}", ""
        head = _HEAD.match(record.payload[:2048])
        if head is not None:
            try:
                key, session_id = json.loads(head.group(1)), json.loads(head.group(2))
            except ValueError:
                pass  # the synthetic key stands
        return Unreadable(record.seq, key, session_id, record.payload.encode("latin-1"),
                          f"unreadable outbox record: {describe(exc)}")
