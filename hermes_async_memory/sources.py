"""The writer's local source: records read back from this process's outbox, in accept order.

A record the writer has not settled stays in flight here, so a writer restarted after a
transient failure is offered it again before anything newer. Settling may happen out of
order (a dead letter in the middle of a batch); the outbox and the commit barrier advance
over the settled prefix only, so their counts always mean "everything up to here".
"""

from __future__ import annotations

import itertools
import json
import operator
import re
from collections import deque
from collections.abc import Sequence
from typing import Any

from .barrier import CommitBarrier
from .errors import describe
from .outbox import OFFSET, PAYLOAD, SEGMENT, SEQ, Outbox, Record
from .slices import CHUNK, CHUNK_BYTES, maybe_yield, runs
from .store.tool_log import ToolLogConfig, outcome_row
from .turns import UNJUDGED, Turn
from .writer import Unreadable, Work

_PAYLOAD_OF = operator.itemgetter(PAYLOAD)
# The key and session of a record whose JSON does not parse, when its head is still whole.
_HEAD = re.compile(r'^\{"k":("(?:[^"\\]|\\.)*"),"s":("(?:[^"\\]|\\.)*")')


class OutboxSource:
    """Reads batches from an ``Outbox``; records left by an earlier run come first, in
    batches of their own (the store may hold some of them already)."""

    name = "outbox"
    polls = False
    lease_owner: str | None = None
    # The tool log's settings, when the store logs tool calls: a batch read ahead has its tool
    # answers judged too (else the batch judges them as it is built, before its commit).
    tool_log: ToolLogConfig | None = None

    def __init__(self, outbox: Outbox, barrier: CommitBarrier) -> None:
        self.outbox = outbox
        self._barrier = barrier
        self._inflight: deque[Record] = deque()  # taken, not settled, in order
        self._handed = 0  # how many of those the writer has (a restarted one has none)
        self._settled: set[int] = set()
        # The next batch, read (and decoded, ``_ahead_items`` matching a prefix of
        # ``_ahead``) while the current one commits; not yet handed to the writer.
        self._ahead: list[Record] = []
        self._ahead_items: list[Turn | Unreadable] = []

    def waiting(self) -> int:
        return self.outbox.unread() + len(self._ahead)

    def rewind(self) -> None:
        """A restarted writer: the next take() offers again what was taken and not settled."""
        self._handed = 0

    async def take(self, max_turns: int, max_bytes: int) -> Work | None:
        inflight = self._inflight
        if self._handed < len(inflight):  # a restarted writer: what it had not settled, first
            records = [r for r in inflight if r[SEQ] not in self._settled]
            self._handed = len(inflight)
            items = await decode_all(records, [])
        else:
            # The writer may still hold the last batch (committed, its settle still to run).
            await maybe_yield()
            # Straight into the in-flight records, so that a writer cancelled halfway is
            # offered them again.
            start = len(inflight)
            used = sum(map(len, map(_PAYLOAD_OF, self._ahead)))
            inflight.extend(self._ahead)
            items = self._ahead_items
            self._ahead, self._ahead_items = [], []
            self._handed = len(inflight)
            await self._read(inflight, start, max_turns, max_bytes - used)
            self._handed = len(inflight)
            records = list(itertools.islice(inflight, start, None))
            items = await decode_all(records, items)
        if not records:
            return None
        return Work(items, replay=records[0][SEQ] <= self.outbox.recovered)

    async def read_ahead(self, max_turns: int, max_bytes: int) -> None:
        """Read and decode the next batch while the writer commits this one (the store works
        on its own thread meanwhile), so that Python work is not serialized with SQLite's.

        Safe to cancel at any await: records are kept as soon as they are read. Records an
        earlier run left are not read ahead: they come in batches of their own.
        """
        if self._ahead or (self.outbox.unread() and self._reading_recovered()):
            return
        await self._read(self._ahead, 0, max_turns, max_bytes)
        await decode_all(self._ahead, self._ahead_items)
        if self.tool_log is not None:  # the tool log's judging, off the commit's path too
            await judge_all(self._ahead_items, self.tool_log)

    async def _read(self, into: list[Record] | deque[Record], start: int, max_turns: int,
                    max_bytes: int) -> None:
        """Append up to ``max_turns`` records (``max_bytes`` of payload) to ``into``, whose
        records from ``start`` on are the batch being read."""
        recovering = bool(self.outbox.unread()) and self._reading_recovered()
        used = 0
        while (n := len(into) - start) < max_turns and used < max_bytes:
            chunk = self.outbox.read(min(CHUNK, max_turns - n),
                                     min(CHUNK_BYTES, max_bytes - used),
                                     recovered_only=recovering)
            if not chunk:
                break
            into.extend(chunk)  # before any await: a cancelled read loses nothing
            used += sum(map(len, map(_PAYLOAD_OF, chunk)))
            await maybe_yield()

    def _reading_recovered(self) -> bool:
        return self.outbox.accepted() - self.outbox.unread() < self.outbox.recovered

    async def settle(self, items: Sequence[Turn | Unreadable], *, committed: bool) -> None:
        inflight = self._inflight
        n = len(items)
        if (not self._settled and n and n <= len(inflight)
                and items[0].seq == inflight[0][SEQ] and items[-1].seq == inflight[n - 1][SEQ]):
            # The oldest records in flight, in order: the usual case. A chunk a step: settling
            # 2,000 records at once reads each one's fields (~0.6 ms on the loop) and frees
            # them all. Only the writer, which awaits this, changes what is in flight.
            popleft = inflight.popleft
            for start in range(0, n, CHUNK):
                if start:
                    await maybe_yield()
                done = [popleft() for _ in range(min(CHUNK, n - start))]
                self._handed = max(0, self._handed - len(done))
                self.outbox.mark_done(done)
                self._barrier.settle(done[-1][SEQ])
            return
        settled = self._settled
        settled.update(item.seq for item in items)
        prefix: list[Record] = []
        while inflight and inflight[0][SEQ] in settled:
            record = inflight.popleft()
            settled.discard(record[SEQ])
            prefix.append(record)
        self._handed = max(0, self._handed - len(prefix))
        if prefix:
            self.outbox.mark_done(prefix)
            self._barrier.settle(prefix[-1][SEQ])


async def decode_all(records: Sequence[Record], items: list[Turn | Unreadable]
                      ) -> list[Turn | Unreadable]:
    """Decode ``records`` past the ``len(items)`` already decoded into ``items``, a run of
    them (``slices.runs``) a step; returns ``items``."""
    first = len(items)
    for step, (a, b) in enumerate(runs([len(r[PAYLOAD]) for r in records[first:]])):
        if step:
            await maybe_yield()
        items.extend([decode(r) for r in records[first + a : first + b]])
    await maybe_yield()
    return items


async def judge_all(items: list[Turn | Unreadable], tool_log: ToolLogConfig) -> None:
    """Judge the tool answers of the turns in ``items`` not judged yet (in place), a run of
    turns (``slices.runs``, by their records' size) a step: the tool log's outcomes, worked
    out on the loop (``Turn.answers``). The scan alone of 2,000 turns takes ~0.3 ms."""
    rules, errors = tool_log.rules, tool_log.errors

    def outcome(content: str | None) -> Any:
        return outcome_row(content, rules, errors)

    sizes = [item.nbytes if isinstance(item, Turn) else 0 for item in items]
    for step, (a, b) in enumerate(runs(sizes)):
        if step:
            await maybe_yield()
        for i in range(a, b):
            item = items[i]
            if isinstance(item, Turn) and item.answers and item.answers[0][2] is UNJUDGED:
                items[i] = item.with_outcomes(outcome)
    await maybe_yield()


def decode(record: Record) -> Turn | Unreadable:
    """The turn a record holds, or what is known of a record that does not decode."""
    try:
        return Turn.decode(record[PAYLOAD], record[SEGMENT], record[SEQ])
    except (ValueError, LookupError, TypeError, RecursionError) as exc:
        key, session_id = f"unreadable-{record[SEGMENT]}-{record[OFFSET]}", ""
        head = _HEAD.match(record[PAYLOAD][:2048])
        if head is not None:
            try:
                key, session_id = json.loads(head.group(1)), json.loads(head.group(2))
            except ValueError:
                pass  # the synthetic key stands
        return Unreadable(record[SEQ], key, session_id, record[PAYLOAD].encode("latin-1"),
                          f"unreadable outbox record: {describe(exc)}")
