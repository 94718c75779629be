"""The outbox: accepted records, durable before sync_turn returns, until the store has them.

A record is accepted by appending it to a memory-mapped segment file (``records`` has the
format, ``segments`` the files). Bytes stored into a shared mapping live in the kernel's page
cache, so they survive SIGKILL of the process with no system call on the accept path (power
loss is another matter; see docs/how-it-works.md). The log is also the writer's queue: the
writer reads records back from the mapping, in order, so a pending turn costs no memory
beyond its bytes in the log, and overflow, crash recovery and normal work share one path.
At open, damaged bytes are copied to ``quarantine/`` beside the segments, counted and
logged, and every intact record after them is recovered.

The store's ``outbox`` table records each turn's final state (done, dead) under its unique
key: that is what makes a replay after a crash exactly-once.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import operator
import os
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

import structlog

from ..errors import CorruptOutboxError, DiskFullError, QueueFullError, StoreError
from ..message_ids import MessageIds
from ..ops import ID_DIGITS
from ..settings import OverflowPolicy
from ..turns import EMPTY_SLOT, ID_SLOT
from . import records as fmt
from .records import COUNT_MASK, HEAD, HEADER_BYTES, KIND_TURN
from .segments import (
    Segment,
    create_segment,
    map_segment,
    os_error,
    prefault,
    quarantine,
    scan,
)

# The next segment is created ahead of need once the current one is this full, so that
# sync_turn does not pay for a file creation.
_SPARE_AT = 0.5
# After a segment could not be made on the accept path, appends that need one are refused
# without trying again for this long: no file system calls per refused turn.
_FULL_RETRY_S = 0.1
_PAGE = mmap.PAGESIZE
_PREFAULT_BYTES = 4 * 1024 * 1024
# Settled pages are dropped from memory once this many have gathered, this many per call
# (mmap.madvise holds the GIL: ~50 µs a MiB).
_RELEASE_MIN = 1024 * 1024
_RELEASE_STEP = 1024 * 1024
_MADV_DONTNEED = getattr(mmap, "MADV_DONTNEED", None)
# A record's key as this library makes them (``MemoryPipeline.new_key``): the pipeline's
# random prefix, then its accept counter in hex.
_OUR_KEY = re.compile(r"([0-9a-f]{12})-([0-9a-f]+)")
# How long an open waits for this process's own earlier outbox on the same directory to
# finish closing (a close a deadline abandoned goes on on its thread, holding the lock).
_CLOSING_WAIT_S = 10.0
_held_lock = threading.Lock()
_held: dict[str, _Held] = {}  # by absolute directory: this process's locked outboxes

log = structlog.get_logger(__name__)


# One record read back from the log for the writer: a plain tuple, read by the positions
# below. The collector stops tracking a plain tuple of numbers and text at the first
# collection it survives, and tracks a NamedTuple for as long as it lives: the writer holds
# thousands of records in flight (a batch, the next one read ahead, a dead producer's slot
# being handed in), and every collection would walk them all.
Record = tuple[int, int, int, str, int, int]
SEQ: Final = 0  # its number in accept order since open (what an earlier run left comes first)
SEGMENT: Final = 1
OFFSET: Final = 2
PAYLOAD: Final = 3  # ASCII JSON
N_MESSAGES: Final = 4
KIND: Final = 5
_SEGMENT_OF = operator.itemgetter(SEGMENT)
_PAYLOAD_OF = operator.itemgetter(PAYLOAD)


@dataclass(frozen=True, slots=True)
class Recovery:
    """What ``open()`` found: records an earlier run left, and damage set aside."""

    records: int = 0
    quarantined_regions: int = 0
    quarantined_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Destroyed:
    """Acknowledged records an outbox segment no longer holds (cut short or emptied)."""

    turns: int  # how many; a lower bound where nothing written after them tells the number
    segments: tuple[int, ...]  # the segments found cut short


@dataclass(frozen=True, slots=True)
class OutboxCounts:
    pending_turns: int  # accepted, not settled
    pending_bytes: int
    settled_bytes: int  # settled since open, in all
    unread_turns: int  # accepted, not yet read by the writer
    segments: int
    quarantined_regions: int
    quarantined_bytes: int
    destroyed_turns: int


class Outbox:
    """The durable accept log, read back in order by the writer."""

    def __init__(
        self,
        directory: Path,
        *,
        segment_bytes: int,
        max_pending_turns: int,
        max_pending_bytes: int,
        overflow: OverflowPolicy,
    ) -> None:
        self.directory = directory
        self._segment_bytes = segment_bytes
        self._max_turns = max_pending_turns
        self._max_bytes = max_pending_bytes
        self._overflow = overflow
        self._lock = threading.Lock()
        self._segments: dict[int, Segment] = {}
        self._tail: Segment | None = None
        self._spare: Segment | None = None
        self._reserved = 0  # the highest segment number handed out (spares included)
        self._doomed: list[Segment] = []  # settled segments to unmap and delete, off the lock
        self._seq = 0  # records accepted (recovered ones first)
        self._read_seq = 0
        self._done_seq = 0
        self._pending_bytes = 0
        self._read: tuple[int, int] = (0, 0)  # the writer's cursor: (segment, offset)
        self._settled: tuple[int, int] = (0, 0)  # after the last settled record
        self._settled_bytes = 0
        self._recovered = 0
        self._quarantined = (0, 0)
        # Segments found cut short at open (number -> whether a record is torn at the cut),
        # and the keys of the records each segment from the first of them on still holds.
        self._cut: dict[int, bool] = {}
        self._file_keys: dict[int, set[tuple[str, int]]] = {}
        # Acknowledged records found destroyed, this start and any not cleared since.
        self.destroyed_turns = 0
        self._lock_fd: int | None = None
        self._held: _Held | None = None  # see _hold
        # Set by a process that commits the store: each turn record takes its messages' ids
        # as it is appended, in accept order (``message_ids``).
        self.ids: MessageIds | None = None
        self._open = False
        self._writable = False
        # Set while the store is short of room: no new segment takes the room its commit
        # needs (only a commit lets segments go); appends that need one are refused, typed.
        self.hold_growth = False
        self._refuse_until = 0.0  # monotonic: see _FULL_RETRY_S

    # -- life cycle (blocking: call it in a worker thread) ------------------------------

    def open(self, first_number: int = 1, *, writable: bool = True) -> Recovery:
        """Lock the directory, map what an earlier run left, and set aside damaged bytes.

        ``writable=False``: only to read back what is there (a gone producer's slot being
        handed in); no new segment is created and nothing can be appended.

        Raises:
            OutboxBusyError: another live process holds the directory.
            StoreAccessError, DiskFullError, CorruptOutboxError: it cannot be used.
        """
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.directory / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise os_error(exc, f"the outbox directory {self.directory}") from exc
        _await_own_close(self.directory)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise OutboxBusyError(
                f"the outbox {self.directory} is in use by another pipeline (in this process "
                "or another); "
                "one pipeline per store file (see the worker process for sharing)"
            ) from exc
        self._lock_fd = fd
        self._held = _hold(self.directory)
        try:
            return self._recover(first_number, writable)
        except BaseException:
            self._open = False
            self._unmap_all()
            self._release_lock()
            raise

    def _recover(self, first_number: int, writable: bool) -> Recovery:
        numbers = sorted(int(p.stem) for p in self.directory.glob("*" + fmt.SUFFIX)
                         if p.stem.isdigit())
        regions = damaged = found = 0
        legacy: list[bytes] = []
        mapped: dict[int, Segment] = {}
        for number in numbers:
            seg = map_segment(self.directory, number, create=False)
            if fmt.is_legacy(seg.mm, seg.size):
                legacy.extend(fmt.legacy_payloads(seg.mm, seg.size))
                seg.sealed = True
                self._doomed.append(seg)
                continue
            for start, end in scan(seg):
                regions += 1
                damaged += end - start
                quarantine(self.directory, seg, start, end)
            mapped[number] = seg
            cut = _cut_short(seg)
            if cut is not None:
                self._cut[number] = cut
            seg.sealed = True
            if seg.appended == 0:
                self._doomed.append(seg)
                continue
            self._segments[number] = seg
            found += seg.appended
        if numbers and mapped.get(numbers[-1]) is not None and mapped[numbers[-1]].size == 0:
            # The newest segment, empty: a kill between its creation and its reservation
            # leaves that, with nothing in it yet.
            self._cut.pop(numbers[-1], None)
        if self._cut:
            # From the segment before the first cut one: an emptied segment's records are
            # told by the last record before it and the first after it.
            first = max([n for n in mapped if n < min(self._cut)], default=min(self._cut))
            self._file_keys = {n: _keys_in(seg) for n, seg in mapped.items() if n >= first}
        self._reserved = max([first_number - 1, *numbers])
        self._open, self._writable = True, writable
        if writable or legacy:
            try:
                self._tail = self._new_segment()
                self._segments[self._tail.number] = self._tail
            except DiskFullError as exc:
                if legacy:
                    raise
                # Open all the same: the writer drains what is here, which frees the room.
                # Appends are refused (typed) until a segment can be made.
                log.warning("outbox_opened_without_segment", outbox=str(self.directory),
                            error=str(exc))
        self._read = self._settled = (min(self._segments, default=0), 0)
        self._seq = self._recovered = found
        self._pending_bytes = sum(seg.payload_bytes for seg in self._segments.values())
        with self._lock:
            for payload in legacy:  # an earlier version's records, re-written in this format
                self._write(payload, fmt.count_messages(payload))
        self._recovered += len(legacy)
        self._quarantined = (regions, damaged)
        self.reap()
        return Recovery(found + len(legacy), regions, damaged)

    def cut_short(self) -> list[int]:
        """The segments found cut short at open (truncated mid-record, or emptied)."""
        return sorted(self._cut)

    def count_destroyed(self, stored: dict[int, list[str]]) -> Destroyed:
        """How many acknowledged records the segments found cut short lost. ``stored``: the
        keys the store settled, by the segment they came from (from the first cut one on).

        A record's key carries its pipeline's accept counter: the counters missing between
        the last record known from a cut segment (still in it, or settled from it) and the
        next one known after it, of the same pipeline, are the records destroyed. A cut with
        nothing known after it counts its torn record, if there is one: a lower bound.
        """
        if not self._cut:
            return Destroyed(0, ())
        known = {n: set(keys) for n, keys in self._file_keys.items()}
        for n, keys in stored.items():
            known.setdefault(n, set()).update(k for k in map(_split_key, keys) if k)
        every = set().union(*known.values())
        total = 0
        for number, torn in sorted(self._cut.items()):
            before = set().union(*(v for n, v in known.items() if n <= number))
            after = set().union(*(v for n, v in known.items() if n > number))
            lost = 0
            for prefix in {p for p, _ in before}:
                last = max(c for p, c in before if p == prefix)
                nxt = [c for p, c in after if p == prefix and c > last]
                if nxt:
                    lost += sum(1 for c in range(last + 1, min(nxt))
                                if (prefix, c) not in every)
            total += lost or int(torn)
        return Destroyed(total, tuple(sorted(self._cut)))

    def close(self) -> None:
        """Unmap everything and delete settled segments; records not settled stay on disk
        for the next start. Blocking (file I/O): call it in a worker thread."""
        try:
            with self._lock:
                segments = list(self._segments.values())
                self._segments.clear()
                if self._spare is not None:
                    self._doomed.append(self._spare)
                    self._spare = None
                self._tail = None
                self._open = False
                for seg in segments:
                    if seg.done >= seg.appended:
                        self._doomed.append(seg)
                    else:
                        seg.mm.close()
            self.reap()
        finally:  # whatever failed above, the lock goes (and an open waiting for it wakes)
            self._release_lock()

    def closing(self) -> None:
        """Say, on the caller's thread, that ``close`` is about to run (perhaps on a thread a
        deadline abandons): an open of the same directory in this process waits for it to
        let go of the lock rather than find the outbox busy."""
        if self._held is not None:
            self._held.closing = True

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        held, self._held = self._held, None
        if held is not None:
            with _held_lock:
                if _held.get(held.key) is held:
                    del _held[held.key]
            held.released.set()

    def _unmap_all(self) -> None:
        for seg in [*self._segments.values(), *self._doomed]:
            seg.mm.close()
        self._segments.clear()
        self._doomed.clear()

    # -- accept (any thread) -------------------------------------------------------------

    def append(self, payload: bytes, n_messages: int, kind: int = KIND_TURN
               ) -> tuple[int, bool, int | None]:
        """Make ``payload`` durable; returns its number, whether the backlog was past its
        bounds (the writer is behind: the record waits in the log, as every record does), and
        the first id of its messages when it has an id slot and ``ids`` is set (else None).

        Raises:
            QueueFullError: the backlog is full and the policy is "reject"; nothing stored.
            DiskFullError: the log cannot grow; nothing stored.
            CorruptOutboxError: the outbox is closed or its directory cannot be used.
        """
        size = len(payload)
        info = (kind << 24) | (n_messages if n_messages < COUNT_MASK else COUNT_MASK)
        with self._lock:
            if not self._open or not self._writable:
                raise CorruptOutboxError("the outbox is closed")
            pending = self._seq - self._done_seq
            over = pending >= self._max_turns or self._pending_bytes + size > self._max_bytes
            if over and self._overflow == "reject":
                raise QueueFullError(
                    f"{pending} turns ({self._pending_bytes} bytes) wait to be committed; "
                    "the overflow policy is 'reject'"
                )
            ids = self.ids
            if ids is None or not n_messages or not payload.endswith(EMPTY_SLOT):
                return self._write(payload, info), over, None
            first = ids.give_locked(n_messages)  # ``ids`` shares this lock: see ``give_ids``
            return self._write(payload, info, b"%*d" % (ID_DIGITS, first)), over, first

    def give_ids(self, ids: MessageIds) -> None:
        """Number each turn record's messages from ``ids`` as it is appended. ``ids`` takes
        this outbox's lock as its own: an append holds one lock, not two. Call it before the
        first append, once ``ids`` is set up."""
        ids.use_lock(self._lock)
        self.ids = ids

    def _write(self, payload: bytes, info: int, slot: bytes | None = None) -> int:
        tail = self._tail
        size = len(payload)
        if tail is None or tail.offset + HEADER_BYTES + size > tail.size:
            tail = self._roll(size)
        tail.offset = fmt.write(tail.mm, tail.offset, payload, info, slot)
        tail.appended += 1
        self._pending_bytes += size
        self._seq += 1
        return self._seq

    def _roll(self, size: int) -> Segment:
        need = HEADER_BYTES + size
        spare, self._spare = self._spare, None
        if spare is None or spare.size < need:
            if spare is not None:
                self._doomed.append(spare)
            if self.hold_growth:
                raise DiskFullError("no space left for a new outbox segment: the store "
                                    "needs the room to commit what waits")
            if time.monotonic() < self._refuse_until:
                raise DiskFullError("no space left for a new outbox segment (the last try "
                                    "failed moments ago)")
            # No spare ready (the maintainer fell behind, or the disk was full): create one
            # here, on the accept path.
            try:
                spare = self._new_segment(need)
            except DiskFullError:
                self._refuse_until = time.monotonic() + _FULL_RETRY_S
                raise
        if self._tail is not None:
            self._tail.sealed = True
        self._segments[spare.number] = spare
        self._tail = spare
        self._collect_settled()
        return spare

    def _new_segment(self, need: int = 0) -> Segment:
        number = self._reserved + 1
        self._reserved = number
        return create_segment(self.directory, number, self._segment_bytes, need)

    # -- the writer's side (event loop) --------------------------------------------------

    def read(self, max_records: int, max_bytes: int, *, recovered_only: bool = False
             ) -> list[Record]:
        """Up to ``max_records`` records not yet read (and at least one, whatever its size,
        while any is left), in accept order. ``recovered_only``: stop at the first record this
        process accepted, so records left by an earlier run come in batches of their own.

        Only the writer reads. Bytes below a segment's end never change, so they are copied
        out without the lock that the accept path takes.
        """
        with self._lock:
            number, off = self._read
            # The segments from the cursor on, each with its end as of now.
            ahead = [(n, seg, seg.offset) for n, seg in sorted(self._segments.items())
                     if n >= number]
            limit = self._recovered if recovered_only else self._seq
        out: list[Record] = []
        seq = self._read_seq
        used = 0
        for n, seg, end in ahead:
            if n > number:
                number, off = n, 0
            mm, skips = seg.mm, seg.skips
            while off < end and len(out) < max_records and seq < limit:
                off = skips.get(off, off)
                if off >= end:
                    break
                _, size, _, info = HEAD.unpack_from(mm, off)
                if out and used + size > max_bytes:
                    limit = seq  # full
                    break
                start = off + HEADER_BYTES
                seq += 1
                out.append((seq, n, off, mm[start : start + size].decode("latin-1"),
                            info & COUNT_MASK, info >> 24))
                used += size
                off = start + size
            if len(out) >= max_records or seq >= limit or off < end:
                break
        self._read = (number, off)
        self._read_seq = seq
        return out

    def mark_done(self, records: list[Record]) -> None:
        """The store has these records (or their dead letters): their bytes may go. Records
        are settled in the order they were read."""
        if not records:
            return
        per_segment = Counter(map(_SEGMENT_OF, records))
        nbytes = sum(map(len, map(_PAYLOAD_OF, records)))
        with self._lock:
            segments = self._segments
            for number, n in per_segment.items():
                seg = segments.get(number)
                if seg is not None:
                    seg.done += n
            self._pending_bytes -= nbytes
            self._settled_bytes += nbytes
            last = records[-1]
            self._done_seq = max(self._done_seq, last[SEQ])
            self._settled = (last[SEGMENT], last[OFFSET] + HEADER_BYTES + len(last[PAYLOAD]))
            self._collect_settled()

    def _collect_settled(self) -> None:
        read_segment = self._read[0]
        for number in sorted(self._segments):
            seg = self._segments[number]
            if seg is self._tail or number >= read_segment:
                break
            if seg.sealed and seg.done >= seg.appended:
                del self._segments[number]
                self._doomed.append(seg)

    def oldest_pending_first_id(self) -> int | None:
        """The first message id of the oldest record not yet settled, when it has one: no
        record still to be committed holds a lower id (ids follow accept order)."""
        payload = self._oldest_pending_payload()
        return None if payload is None else _slot_id(payload[-ID_SLOT - 5:])

    def oldest_pending_accepted_at(self) -> float | None:
        """When the oldest record not yet settled was accepted (epoch seconds), or None."""
        payload = self._oldest_pending_payload()
        if payload is None:
            return None
        try:
            at = json.loads(payload)["t"]
        except (ValueError, KeyError, TypeError, RecursionError):
            return None
        return float(at) if isinstance(at, (int, float)) else None

    def _oldest_pending_payload(self) -> bytes | None:
        with self._lock:
            if self._done_seq >= self._seq:
                return None
            number, off = self._settled
            for _ in range(len(self._segments) + 1):
                seg = self._segments.get(number)
                if seg is not None:
                    off = seg.skips.get(off, off)
                    if off < seg.offset:
                        _, size, _, _ = HEAD.unpack_from(seg.mm, off)
                        start = off + HEADER_BYTES
                        payload = seg.mm[start : start + size]
                        break
                later = [n for n in self._segments if n > number]
                if not later:
                    return None
                number, off = min(later), 0
            else:
                return None
        return payload

    def recovered_ids(self) -> tuple[int, int | None, list[tuple[str, int]]]:
        """What the records an earlier run left say of message ids: (the highest id they
        hold, or 0; the lowest, or None; the key and message count of each record with
        messages but no ids, in order). Call it after ``open`` and before any append."""
        highest, lowest = 0, None
        missing: list[tuple[str, int]] = []
        with self._lock:
            seen = 0
            for _, seg in sorted(self._segments.items()):
                off, end, mm = 0, seg.offset, seg.mm
                while off < end and seen < self._recovered:
                    off = seg.skips.get(off, off)
                    if off >= end:
                        break
                    _, size, _, info = HEAD.unpack_from(mm, off)
                    start = off + HEADER_BYTES
                    off = start + size
                    seen += 1
                    n = info & COUNT_MASK
                    if not n:
                        continue
                    first = _slot_id(mm[start + size - ID_SLOT - 5 : start + size])
                    if first is None:
                        key = _KEY.search(mm[start : start + min(size, 600)])
                        if key is not None:
                            missing.append((json.loads(key.group(1)), n))
                        continue
                    highest = max(highest, first + n - 1)
                    lowest = first if lowest is None else min(lowest, first)
        return highest, lowest, missing

    # -- counts (any thread) -------------------------------------------------------------

    def accepted(self) -> int:
        """Records accepted since open, those an earlier run left included."""
        return self._seq

    @property
    def recovered(self) -> int:
        """Records an earlier run left, read back first."""
        return self._recovered

    def unread(self) -> int:
        return self._seq - self._read_seq

    def counts(self) -> OutboxCounts:
        with self._lock:
            return OutboxCounts(
                pending_turns=self._seq - self._done_seq,
                pending_bytes=self._pending_bytes,
                settled_bytes=self._settled_bytes,
                unread_turns=self._seq - self._read_seq,
                segments=len(self._segments),
                quarantined_regions=self._quarantined[0],
                quarantined_bytes=self._quarantined[1],
                destroyed_turns=self.destroyed_turns,
            )

    def oldest_segment(self) -> int:
        """The lowest segment number still on disk (its turns' done keys are still needed)."""
        with self._lock:
            numbers = [*self._segments, *(s.number for s in self._doomed)]
            return min(numbers) if numbers else 0

    # -- upkeep (blocking: the maintainer calls these in a worker thread) ----------------

    def needs_spare(self) -> bool:
        """Whether the next segment should be made now: the tail is half full, or there is
        none (the disk was full when it was needed)."""
        if not self._open or not self._writable:
            return False
        tail = self._tail
        return tail is None or (self._spare is None and tail.offset >= tail.size * _SPARE_AT)

    def accepting(self) -> bool:
        """Whether a segment to append into is ready (else the next append must make one)."""
        return self._tail is not None

    def prepare_spare(self) -> None:
        """Create the next segment ahead of need, off the accept path and off the lock.

        Raises:
            DiskFullError: no room for it (the accept path tries again when it must roll).
        """
        with self._lock:
            if not self.needs_spare():
                return
            number = self._reserved + 1
            self._reserved = number
        seg = create_segment(self.directory, number, self._segment_bytes, 0)
        with self._lock:
            self._refuse_until = 0.0
            if self._open and self._tail is None:  # the first since a full disk: the tail
                self._segments[number] = seg
                self._tail = seg
                return
            if self._tail is not None and self._spare is None and self._tail.number < number:
                self._spare = seg
                return
        # The tail rolled past it meanwhile (or the outbox closed): not needed.
        seg.mm.close()
        seg.path.unlink(missing_ok=True)

    def drop_spare(self) -> int:
        """Delete the spare segment, giving its room to the store while the store is short of
        it (pending turns leave the outbox only once the store has them); returns the bytes
        freed. The next roll makes a segment again."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is None:
            return 0
        spare.mm.close()
        spare.path.unlink(missing_ok=True)
        return spare.size

    def reap(self) -> int:
        """Unmap and delete settled segments; returns how many went."""
        with self._lock:
            doomed, self._doomed = self._doomed, []
        for seg in doomed:
            seg.mm.close()
            seg.path.unlink(missing_ok=True)
        return len(doomed)

    def prefault_plan(self) -> list[tuple[int, int]]:
        """Address ranges ahead of the tail (and of the spare) to fault in off the loop.

        The first write to a page of the mapping faults, and on ext4 that fault updates the
        file's times under the filesystem journal: milliseconds when the disk is busy, inside
        sync_turn. Faulting the pages in ahead of need moves that wait to a worker thread.
        """
        plan = []
        with self._lock:
            for seg in (self._tail, self._spare):
                if seg is None or not seg.addr or seg.populated_to >= seg.size:
                    continue
                if seg.populated_to - seg.offset > _PREFAULT_BYTES // 2:
                    continue
                start = max(seg.populated_to, seg.offset - seg.offset % _PAGE)
                end = min(seg.size, start + _PREFAULT_BYTES)
                seg.populated_to = end
                plan.append((seg.addr + start, end - start))
        return plan

    def release_settled(self) -> int:
        """Drop the settled pages of live segments from this process's memory; returns the
        bytes dropped. Blocking: call it in a worker thread.

        The writer never reads a settled record again, but its pages stay mapped until the
        segment is deleted: a whole segment (16 MiB) of a backlog long drained, counted in
        the process's RSS. The mapping is shared, so the bytes stay in the file; a page read
        again (an earlier run's records at start) is read back from it.
        """
        if _MADV_DONTNEED is None:
            return 0
        with self._lock:
            number, off = self._settled
            ranges = []
            for seg in self._segments.values():
                if seg.number > number:
                    continue
                end = seg.offset if seg.number < number else min(off, seg.offset)
                end -= end % _PAGE  # the page the next record starts in stays
                if end - seg.released_to >= _RELEASE_MIN:
                    ranges.append((seg, seg.released_to, end))
                    seg.released_to = end
        released = 0
        for seg, start, end in ranges:
            for at in range(start, end, _RELEASE_STEP):
                length = min(_RELEASE_STEP, end - at)
                try:
                    # The mmap object's own call: a segment unmapped meanwhile (reaped, or the
                    # outbox closed) raises instead of touching memory mapped in its place.
                    seg.mm.madvise(_MADV_DONTNEED, at, length)
                except (ValueError, OSError):
                    break
                released += length
        return released

    @staticmethod
    def prefault(plan: list[tuple[int, int]]) -> None:
        """Run a prefault plan; blocking, so call it in a worker thread. Never writes data."""
        prefault(plan)


# A record's key near its start (a turn's first field, an operation's second).
_KEY = re.compile(rb'"k":("(?:[^"\\]|\\.)*")')


@dataclass(eq=False)
class _Held:
    """An outbox directory this process has locked: ``released`` is set once its close has
    let go of the lock; ``closing`` once that close has begun."""

    key: str
    released: threading.Event = field(default_factory=threading.Event)
    closing: bool = False


def _hold(directory: Path) -> _Held:
    """Record that this process holds ``directory``'s lock (see ``_await_own_close``)."""
    held = _Held(os.path.abspath(directory))
    with _held_lock:
        _held[held.key] = held
    return held


def _await_own_close(directory: Path) -> None:
    """Before locking ``directory``: if this process's own earlier outbox on it is closing,
    wait (up to ``_CLOSING_WAIT_S``) until it has let go of the lock. One still open is left
    alone: the lock then says the outbox is busy, at once."""
    with _held_lock:
        held = _held.get(os.path.abspath(directory))
    if held is not None and held.closing:
        held.released.wait(_CLOSING_WAIT_S)


def _slot_id(tail: bytes) -> int | None:
    """The id in a record's id slot (its tail: ``,"i":`` then the slot and ``}``)."""
    if not tail.startswith(b',"i":') or not tail.endswith(b"}"):
        return None
    digits = tail[5:-1].strip()
    return int(digits) if digits.isdigit() else None


class OutboxBusyError(StoreError):
    """Another live process holds this outbox directory."""


def _cut_short(seg: Segment) -> bool | None:
    """Whether the segment was cut short after it was written (None: it was not), and then
    whether a record is torn at the cut. Segments are made whole pages long, their blocks
    reserved, and a record is only written where it fits: a file of another length (but a
    segment made to the size of the one record larger than a segment), or a commit mark
    whose record runs past the end of the file, was cut by something else."""
    off, end = seg.offset, seg.size
    torn = False
    if off + HEADER_BYTES <= end:
        magic, size, _, _ = HEAD.unpack_from(seg.mm, off)
        torn = magic == fmt.MAGIC_U32 and size > end - off - HEADER_BYTES
    elif off < end:
        torn = any(seg.mm[off:end])
    one_record = seg.appended == 1 and off == end
    if torn or end == 0 or (end % _PAGE and not one_record):
        return torn
    return None


def _split_key(key: str) -> tuple[str, int] | None:
    found = _OUR_KEY.fullmatch(key)
    return None if found is None else (found[1], int(found[2], 16))


def _keys_in(seg: Segment) -> set[tuple[str, int]]:
    """The (prefix, counter) of every intact record of the segment that has a key of ours."""
    out = set()
    for payload in fmt.intact_payloads(seg.mm, seg.offset):
        found = _KEY.search(payload[:600])
        split = None if found is None else _split_key(found[1].decode("ascii").strip('"'))
        if split is not None:
            out.add(split)
    return out
