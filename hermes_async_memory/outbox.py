"""The outbox: accepted turns, durable before sync_turn returns, until the store has them.

A turn is accepted by appending one record to a memory-mapped segment file. Bytes stored into
a shared mapping live in the kernel's page cache, so they survive SIGKILL of the process with
no system call on the accept path (power loss is another matter; see README). A record is
``[u32 length][u32 crc32][payload]``; the length is written last and is the commit mark, so a
record torn by a kill reads as the end of the log.

The outbox also holds the bounded in-memory queue the writer drains. When that queue is full
(or anything is already waiting on disk), a new turn is only appended to the log and the
receipt says "deferred"; the writer later reads such turns back from the log, in order. After
a crash the log is read back the same way, so recovery and overflow share one path. The
``outbox`` table in the store records each turn's final state (done, dead) under a unique key:
that is what makes a replay exactly-once.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import fcntl
import mmap
import os
import struct
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from .errors import CorruptOutboxError, QueueFullError, StoreError
from .settings import OverflowPolicy
from .turns import Turn

log = structlog.get_logger(__name__)

_HEADER = struct.Struct("<II")
_LEN = struct.Struct("<I")
_CRC = struct.Struct("<I")
_SUFFIX = ".seg"
# The next segment is created ahead of need once the current one is this full, so that
# sync_turn does not pay for a file creation.
_SPARE_AT = 0.5
_PAGE = mmap.PAGESIZE
_PREFAULT_BYTES = 4 * 1024 * 1024
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without touching them


def _load_madvise() -> Callable[[int, int, int], int] | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_madvise = _load_madvise()


def _populate_write(addr: int, length: int) -> None:
    # Through ctypes, which lets go of the GIL while the kernel works. An old kernel answers
    # EINVAL and the pages simply fault on first use, as without this.
    global _madvise
    if _madvise is not None and _madvise(addr, length, _MADV_POPULATE_WRITE) != 0:
        if ctypes.get_errno() == errno.EINVAL:
            _madvise = None


def _address(mm: mmap.mmap) -> int:
    view = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(view)
    finally:
        del view  # release the buffer export, or the mapping could not be closed


@dataclass(eq=False)
class _Segment:
    number: int
    path: Path
    size: int
    mm: mmap.mmap
    offset: int = 0  # where the next record goes (or the end of what was recovered)
    appended: int = 0
    done: int = 0
    sealed: bool = False
    addr: int = 0  # where the mapping starts in memory, for madvise
    populated_to: int = 0  # pages below this were faulted in ahead of the accept path

    def close(self) -> None:
        self.mm.close()


@dataclass
class OutboxCounts:
    queued_turns: int
    queued_bytes: int
    deferred_turns: int
    segments: int
    oldest_accepted_mono: float | None


@dataclass
class _Cursor:
    segment: int
    offset: int


@dataclass
class Refill:
    """Turns read back from the log, in accept order."""

    turns: list[Turn] = field(default_factory=list)
    recovered: bool = False


class Outbox:
    """The durable accept log plus the bounded queue in front of the writer."""

    def __init__(
        self,
        directory: Path,
        *,
        segment_bytes: int,
        max_queued_turns: int,
        max_queued_bytes: int,
        overflow: OverflowPolicy,
        clock: Callable[[], float],
    ) -> None:
        self._dir = directory
        self._segment_bytes = segment_bytes
        self._max_turns = max_queued_turns
        self._max_bytes = max_queued_bytes
        self._overflow = overflow
        self._clock = clock
        self._lock = threading.Lock()
        self._segments: dict[int, _Segment] = {}
        self._tail: _Segment | None = None
        self._spare: _Segment | None = None
        self._queue: collections.deque[tuple[Any, ...]] = collections.deque()
        self._queued_bytes = 0
        # Set while turns wait on disk only; everything accepted then goes to disk only
        # too, so per-session order holds when the writer reads them back.
        self._spill: _Cursor | None = None
        self._spilled = 0
        self._recovering_until: _Cursor | None = None
        self._seq = 0
        self._lock_fd: int | None = None
        self._open = False

    # -- life cycle --------------------------------------------------------------------

    def open(self, first_number: int = 1) -> int:
        """Map the segments left by an earlier run; returns how many records they hold.

        Raises:
            StoreError: the directory is locked by another process or cannot be used.
        """
        try:
            self._dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self._dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise StoreError(f"cannot use the outbox directory {self._dir}: {exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise StoreError(
                f"the outbox {self._dir} is in use by another process; "
                "one pipeline per store file (see the worker process for sharing)"
            ) from exc
        self._lock_fd = fd
        found = 0
        numbers = sorted(
            int(p.stem) for p in self._dir.glob("*" + _SUFFIX) if p.stem.isdigit()
        )
        for number in numbers:
            seg = self._map(number, create=False)
            self._scan(seg)
            seg.sealed = True
            if seg.appended == 0:
                self._drop(seg)
                continue
            self._segments[number] = seg
            found += seg.appended
        if self._segments:
            first = min(self._segments)
            self._spill = _Cursor(first, 0)
            self._spilled = found
            last = max(self._segments)
            self._recovering_until = _Cursor(last, self._segments[last].offset)
        # Segment numbers never repeat (the store remembers the highest it saw), so the
        # store can forget done keys of segments that are gone.
        next_number = max([first_number, *(n + 1 for n in numbers)])
        self._tail = self._map(next_number, create=True)
        self._segments[next_number] = self._tail
        self._open = True
        return found

    def close(self) -> None:
        """Unmap everything; records not yet done stay on disk for the next start."""
        with self._lock:
            self._open = False
            for seg in list(self._segments.values()):
                if seg.done >= seg.appended:
                    self._drop(seg)
                else:
                    seg.mm.flush()
                    seg.close()
            self._segments.clear()
            if self._spare is not None:
                self._drop(self._spare)
                self._spare = None
            self._tail = None
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    # -- accept (any thread) -------------------------------------------------------------

    def put(self, turn: Turn, payload: bytes) -> tuple[Turn, bool]:
        """Make ``turn`` durable and queue it; returns it numbered, and whether it was
        deferred to disk (queued turns are read back from there later).

        Raises:
            QueueFullError: the queue is full and the policy is "reject"; nothing stored.
            StoreError: the log cannot grow (disk full); nothing stored.
        """
        size = len(payload)
        with self._lock:
            tail = self._tail
            if tail is None:
                raise StoreError("the outbox is closed")
            full = (
                len(self._queue) >= self._max_turns
                or self._queued_bytes + size > self._max_bytes
            )
            if full and self._spill is None and self._overflow == "reject":
                raise QueueFullError(
                    f"{len(self._queue)} turns ({self._queued_bytes} bytes) are queued; "
                    "the overflow policy is 'reject'"
                )
            if tail.offset + _HEADER.size + size + _LEN.size > tail.size:
                tail = self._roll(size)
            off = tail.offset
            mm = tail.mm
            mm[off + 8 : off + 8 + size] = payload
            _CRC.pack_into(mm, off + 4, zlib.crc32(payload))
            _LEN.pack_into(mm, off, size)  # the commit mark: written last
            tail.offset = off + 8 + size
            tail.appended += 1
            self._seq += 1
            # The turn numbered, as the plain tuple it is queued as (Turn.pack's form; the
            # field order is Turn's): cheaper than NamedTuple._replace on every accept.
            flat = (turn[0], self._seq, *turn[2:6], size, tail.number, *turn[8:])
            if self._spill is not None or full:
                if self._spill is None:
                    self._spill = _Cursor(tail.number, off)
                self._spilled += 1
                return Turn.unpack(flat), True
            # Queued packed flat, which the garbage collector stops tracking: a backlog then
            # never makes a full collection (a loop stall) longer or more frequent.
            self._queue.append(flat)
            self._queued_bytes += size
            return Turn.unpack(flat), False

    def _roll(self, size: int) -> _Segment:
        assert self._tail is not None
        self._tail.sealed = True
        need = _HEADER.size + size + _LEN.size
        spare = self._spare
        self._spare = None
        if spare is None or spare.size < need:
            if spare is not None:
                self._drop(spare)
            spare = self._map(self._tail.number + 1, create=True, size=need)
        self._segments[spare.number] = spare
        self._tail = spare
        self._reap_locked()
        return spare

    # -- the writer's side (event loop) --------------------------------------------------

    def take(self, max_turns: int) -> list[Turn]:
        """Up to ``max_turns`` queued turns, oldest first."""
        with self._lock:
            q = self._queue
            make = Turn.unpack
            n = min(max_turns, len(q))
            batch = [make(q.popleft()) for _ in range(n)]
            self._queued_bytes -= sum(t.nbytes for t in batch)
            return batch

    def recovering(self) -> bool:
        """Whether records left by an earlier run are still to be read back."""
        return self._recovering_until is not None

    def accepted(self) -> int:
        """Turns accepted by put() since open()."""
        return self._seq

    def queued(self) -> int:
        return len(self._queue)

    def deferred(self) -> int:
        return self._spilled

    def has_work(self) -> bool:
        return bool(self._queue) or self._spill is not None

    def refill(self, max_turns: int, max_bytes: int) -> Refill:
        """Read turns that wait on disk only, in order, up to the given room.

        Raises:
            CorruptOutboxError: a record's bytes do not decode.
        """
        out = Refill()
        with self._lock:
            cur = self._spill
            if cur is None:
                return out
            assert self._tail is not None
            if self._recovering_until is not None:
                until = self._recovering_until
                out.recovered = (cur.segment, cur.offset) < (until.segment, until.offset)
            used = 0
            while len(out.turns) < max_turns:
                seg = self._segments.get(cur.segment)
                if seg is None:
                    later = [n for n in self._segments if n > cur.segment]
                    if not later:
                        break
                    cur = _Cursor(min(later), 0)
                    continue
                if cur.offset >= seg.offset:
                    if seg is self._tail:
                        break
                    later = [n for n in self._segments if n > cur.segment]
                    if not later:
                        break
                    cur = _Cursor(min(later), 0)
                    continue
                if out.recovered and self._recovering_until is not None:
                    until = self._recovering_until
                    if (cur.segment, cur.offset) >= (until.segment, until.offset):
                        break  # recovered and new turns are not mixed in one refill
                (size,) = _LEN.unpack_from(seg.mm, cur.offset)
                if out.turns and used + size > max_bytes:
                    break
                payload = bytes(seg.mm[cur.offset + 8 : cur.offset + 8 + size])
                try:
                    turn = Turn.decode(payload, seg.number, self._clock())
                except (ValueError, KeyError, TypeError) as exc:
                    raise CorruptOutboxError(
                        f"record at {seg.path}:{cur.offset} does not decode"
                    ) from exc
                out.turns.append(turn)
                used += size
                cur = _Cursor(cur.segment, cur.offset + 8 + size)
            self._spilled -= len(out.turns)
            if (
                self._recovering_until is not None
                and (cur.segment, cur.offset)
                >= (self._recovering_until.segment, self._recovering_until.offset)
            ):
                self._recovering_until = None
            tail = self._tail
            if cur.segment == tail.number and cur.offset >= tail.offset:
                self._spill = None  # caught up: new turns may use the queue again
                self._spilled = 0
            else:
                self._spill = cur
        return out

    def mark_done(self, turns: list[Turn]) -> None:
        """The store has these turns (or their dead letters): their records may go."""
        with self._lock:
            for t in turns:
                seg = self._segments.get(t.segment)
                if seg is not None:
                    seg.done += 1
            self._reap_locked()

    def prepare_spare(self) -> None:
        """Create the next segment ahead of need (called off the accept path)."""
        with self._lock:
            tail = self._tail
            if tail is None or self._spare is not None:
                return
            if tail.offset < tail.size * _SPARE_AT:
                return
            # Under the lock, so an accept that rolls over meanwhile cannot race for the name.
            self._spare = self._map(tail.number + 1, create=True)

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

    @staticmethod
    def prefault(plan: list[tuple[int, int]]) -> None:
        """Run a prefault plan; blocking, so call it in a worker thread. Never writes data."""
        for addr, length in plan:
            _populate_write(addr, length)

    def oldest_segment(self) -> int:
        with self._lock:
            return min(self._segments) if self._segments else 0

    def counts(self) -> OutboxCounts:
        with self._lock:
            oldest = Turn.unpack(self._queue[0]).accepted_mono if self._queue else None
            return OutboxCounts(
                queued_turns=len(self._queue),
                queued_bytes=self._queued_bytes,
                deferred_turns=self._spilled,
                segments=len(self._segments),
                oldest_accepted_mono=oldest,
            )

    # -- files ---------------------------------------------------------------------------

    def _reap_locked(self) -> None:
        for number in sorted(self._segments):
            seg = self._segments[number]
            if seg is self._tail or not seg.sealed or seg.done < seg.appended:
                continue
            if self._spill is not None and self._spill.segment <= number:
                continue
            del self._segments[number]
            self._drop(seg)

    def _map(self, number: int, *, create: bool, size: int | None = None) -> _Segment:
        path = self._dir / f"{number:012d}{_SUFFIX}"
        try:
            if create:
                size = max(size or 0, self._segment_bytes)
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    # Reserve the blocks now: a write into a hole of a full disk is SIGBUS.
                    os.posix_fallocate(fd, 0, size)
                except OSError:
                    os.close(fd)
                    path.unlink(missing_ok=True)
                    raise
            else:
                fd = os.open(path, os.O_RDWR)
                size = os.fstat(fd).st_size
            try:
                if size == 0:
                    mm = mmap.mmap(-1, 1)
                else:
                    mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except OSError as exc:
            raise StoreError(f"cannot map outbox segment {path}: {exc}") from exc
        return _Segment(number=number, path=path, size=size, mm=mm, addr=_address(mm))

    def _scan(self, seg: _Segment) -> None:
        mm, off, end = seg.mm, 0, seg.size
        while off + _HEADER.size <= end:
            size, crc = _HEADER.unpack_from(mm, off)
            if size == 0:
                break
            if off + 8 + size > end or zlib.crc32(mm[off + 8 : off + 8 + size]) != crc:
                log.warning("outbox_torn_record", segment=seg.number, offset=off)
                break
            off += 8 + size
            seg.appended += 1
        seg.offset = off

    def _drop(self, seg: _Segment) -> None:
        seg.close()
        seg.path.unlink(missing_ok=True)
