"""The outbox: accepted records, durable before sync_turn returns, until the store has them.

A record is accepted by appending it to a memory-mapped segment file. Bytes stored into a
shared mapping live in the kernel's page cache, so they survive SIGKILL of the process with
no system call on the accept path (power loss is another matter; see README). The log is
also the writer's queue: the writer reads records back from the mapping, in order, so a
pending turn costs no memory beyond its bytes in the log, and overflow, crash recovery and
normal work share one path.

A record is ``[magic u32][length u32][crc32 u32][info u32][payload]``: ``info`` holds the
record's kind and message count, the CRC covers ``info`` and the payload (ASCII JSON), and
the magic and the length are written last, together: that is the commit mark. A kill before
it leaves zeros where the next header would be: the end of the log, read silently. The magic
holds bytes no ASCII payload can, so the start-up scan can find the next record after damage:
the damaged bytes are copied to ``quarantine/`` beside the segments, counted and logged, and
every intact record after them is recovered.

The store's ``outbox`` table records each turn's final state (done, dead) under its unique
key: that is what makes a replay after a crash exactly-once.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import mmap
import operator
import os
import struct
import threading
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import structlog

from .errors import (
    CorruptOutboxError,
    DiskFullError,
    QueueFullError,
    StoreAccessError,
    StoreError,
)
from .settings import OverflowPolicy

log = structlog.get_logger(__name__)

_MAGIC = b"\xd3\xa7\xf1\x8b"  # bytes >= 0x80: never inside an ASCII payload
(_MAGIC_U32,) = struct.unpack("<I", _MAGIC)
_HEAD = struct.Struct("<IIII")  # magic, length, crc32, info
_MARK = struct.Struct("<II")  # magic, length: the commit mark
_TAIL = struct.Struct("<II")  # crc32, info
_INFO = struct.Struct("<I")
HEADER_BYTES = _HEAD.size
_LEGACY = struct.Struct("<II")  # an earlier version's record: [length][crc32][payload]
_SUFFIX = ".seg"
QUARANTINE_DIR = "quarantine"
KIND_TURN = 0
_COUNT_MASK = 0xFFFFFF
# The next segment is created ahead of need once the current one is this full, so that
# sync_turn does not pay for a file creation.
_SPARE_AT = 0.5
_PAGE = mmap.PAGESIZE
_PREFAULT_BYTES = 4 * 1024 * 1024
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without touching them
_ACCESS_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR,
                            errno.EISDIR, errno.ENOENT, errno.ELOOP, errno.ENAMETOOLONG})


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


def os_error(exc: OSError, what: str) -> Exception:
    """The typed error for a file-system failure of the outbox."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(f"no space left for {what}: {exc.strerror}")
    if exc.errno in _ACCESS_ERRNOS:
        return StoreAccessError(f"cannot use {what}: {exc.strerror or exc}")
    return CorruptOutboxError(f"cannot use {what}: {exc}")


_SEGMENT_OF = operator.attrgetter("segment")
_PAYLOAD_OF = operator.attrgetter("payload")


class Record(NamedTuple):
    """One record read back from the log for the writer."""

    seq: int  # its number in accept order since open (what an earlier run left comes first)
    segment: int
    offset: int
    payload: str  # ASCII JSON
    n_messages: int
    kind: int


@dataclass(eq=False)
class _Segment:
    number: int
    path: Path
    size: int
    mm: mmap.mmap
    offset: int = 0  # where the next record goes, or the end of what was recovered
    appended: int = 0
    payload_bytes: int = 0
    done: int = 0
    sealed: bool = False
    skips: dict[int, int] = field(default_factory=dict)  # damaged region -> next record
    addr: int = 0  # where the mapping starts in memory, for madvise
    populated_to: int = 0  # pages below this were faulted in ahead of the accept path


@dataclass(frozen=True, slots=True)
class Recovery:
    """What ``open()`` found: records an earlier run left, and damage set aside."""

    records: int = 0
    quarantined_regions: int = 0
    quarantined_bytes: int = 0


@dataclass(frozen=True, slots=True)
class OutboxCounts:
    pending_turns: int  # accepted, not settled
    pending_bytes: int
    unread_turns: int  # accepted, not yet read by the writer
    segments: int
    quarantined_regions: int
    quarantined_bytes: int


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
        self._segments: dict[int, _Segment] = {}
        self._tail: _Segment | None = None
        self._spare: _Segment | None = None
        self._reserved = 0  # the highest segment number handed out (spares included)
        self._doomed: list[_Segment] = []  # settled segments to unmap and delete, off the lock
        self._seq = 0  # records accepted (recovered ones first)
        self._read_seq = 0
        self._done_seq = 0
        self._pending_bytes = 0
        self._read: tuple[int, int] = (0, 0)  # the writer's cursor: (segment, offset)
        self._settled: tuple[int, int] = (0, 0)  # after the last settled record
        self._recovered = 0
        self._quarantined = (0, 0)
        self._lock_fd: int | None = None

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
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            os.close(fd)
            raise OutboxBusyError(
                f"the outbox {self.directory} is in use by another process; "
                "one pipeline per store file (see the worker process for sharing)"
            ) from exc
        self._lock_fd = fd
        try:
            return self._recover(first_number, writable)
        except BaseException:
            self._unmap_all()
            os.close(fd)
            self._lock_fd = None
            raise

    def _recover(self, first_number: int, writable: bool) -> Recovery:
        numbers = sorted(int(p.stem) for p in self.directory.glob("*" + _SUFFIX)
                         if p.stem.isdigit())
        regions = damaged = found = 0
        legacy: list[bytes] = []
        for number in numbers:
            seg = self._map(number, create=False)
            if _is_legacy(seg):
                legacy.extend(_legacy_records(seg))
                seg.sealed = True
                self._doomed.append(seg)
                continue
            for start, end in _scan(seg):
                regions += 1
                damaged += end - start
                self._quarantine(seg, start, end)
            seg.sealed = True
            if seg.appended == 0:
                self._doomed.append(seg)
                continue
            self._segments[number] = seg
            found += seg.appended
        self._reserved = max([first_number - 1, *numbers])
        if writable or legacy:
            self._tail = self._new_segment()
            self._segments[self._tail.number] = self._tail
        self._read = self._settled = (min(self._segments, default=0), 0)
        self._seq = self._recovered = found
        self._pending_bytes = sum(seg.payload_bytes for seg in self._segments.values())
        with self._lock:
            for payload in legacy:  # an earlier version's records, re-written in this format
                self._write(payload, _count_messages(payload))
        self._recovered += len(legacy)
        self._quarantined = (regions, damaged)
        self.reap()
        return Recovery(found + len(legacy), regions, damaged)

    def _quarantine(self, seg: _Segment, start: int, end: int) -> None:
        qdir = self.directory / QUARANTINE_DIR
        path = qdir / f"{seg.number:012d}-{start:010d}.bin"
        try:
            qdir.mkdir(mode=0o700, exist_ok=True)
            with open(path, "wb") as f:
                os.fchmod(f.fileno(), 0o600)
                f.write(seg.mm[start:end])
        except OSError as exc:
            log.error("outbox_quarantine_failed", segment=str(seg.path), offset=start,
                      bytes=end - start, error=str(exc), exc_info=True)
            return
        log.error("outbox_damaged_bytes_quarantined", segment=str(seg.path), offset=start,
                  bytes=end - start, quarantine=str(path))

    def close(self) -> None:
        """Unmap everything and delete settled segments; records not settled stay on disk
        for the next start. Blocking (file I/O): call it in a worker thread."""
        with self._lock:
            segments = list(self._segments.values())
            self._segments.clear()
            if self._spare is not None:
                self._doomed.append(self._spare)
                self._spare = None
            self._tail = None
            for seg in segments:
                if seg.done >= seg.appended:
                    self._doomed.append(seg)
                else:
                    seg.mm.close()
        self.reap()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _unmap_all(self) -> None:
        for seg in [*self._segments.values(), *self._doomed]:
            seg.mm.close()
        self._segments.clear()
        self._doomed.clear()

    # -- accept (any thread) -------------------------------------------------------------

    def append(self, payload: bytes, n_messages: int, kind: int = KIND_TURN) -> tuple[int, bool]:
        """Make ``payload`` durable; returns its number and whether the backlog was past its
        bounds (the writer is behind: the record waits in the log, as every record does).

        Raises:
            QueueFullError: the backlog is full and the policy is "reject"; nothing stored.
            DiskFullError: the log cannot grow; nothing stored.
            CorruptOutboxError: the outbox is closed or its directory cannot be used.
        """
        size = len(payload)
        info = (kind << 24) | min(n_messages, _COUNT_MASK)
        with self._lock:
            tail = self._tail
            if tail is None:
                raise CorruptOutboxError("the outbox is closed")
            pending = self._seq - self._done_seq
            over = pending >= self._max_turns or self._pending_bytes + size > self._max_bytes
            if over and self._overflow == "reject":
                raise QueueFullError(
                    f"{pending} turns ({self._pending_bytes} bytes) wait to be committed; "
                    "the overflow policy is 'reject'"
                )
            return self._write(payload, info), over

    def _write(self, payload: bytes, info: int) -> int:
        tail = self._tail
        assert tail is not None
        size = len(payload)
        if tail.offset + HEADER_BYTES + size > tail.size:
            tail = self._roll(size)
        off = tail.offset
        mm = tail.mm
        mm[off + HEADER_BYTES : off + HEADER_BYTES + size] = payload
        _TAIL.pack_into(mm, off + 8, zlib.crc32(payload, zlib.crc32(_INFO.pack(info))), info)
        _MARK.pack_into(mm, off, _MAGIC_U32, size)  # the commit mark: written last
        tail.offset = off + HEADER_BYTES + size
        tail.appended += 1
        self._pending_bytes += size
        self._seq += 1
        return self._seq

    def _roll(self, size: int) -> _Segment:
        assert self._tail is not None
        need = HEADER_BYTES + size
        spare, self._spare = self._spare, None
        if spare is None or spare.size < need:
            if spare is not None:
                self._doomed.append(spare)
            # No spare ready (the maintainer fell behind): create one here, on the accept path.
            spare = self._new_segment(need)
        self._tail.sealed = True
        self._segments[spare.number] = spare
        self._tail = spare
        self._collect_settled()
        return spare

    def _new_segment(self, need: int = 0) -> _Segment:
        number = self._reserved + 1
        self._reserved = number
        return self._map(number, create=True, size=max(need, self._segment_bytes))

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
                _, size, _, info = _HEAD.unpack_from(mm, off)
                if out and used + size > max_bytes:
                    limit = seq  # full
                    break
                start = off + HEADER_BYTES
                seq += 1
                out.append(Record(seq, n, off, mm[start : start + size].decode("latin-1"),
                                  info & _COUNT_MASK, info >> 24))
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
            last = records[-1]
            self._done_seq = max(self._done_seq, last.seq)
            self._settled = (last.segment, last.offset + HEADER_BYTES + len(last.payload))
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

    def oldest_pending_accepted_at(self) -> float | None:
        """When the oldest record not yet settled was accepted (epoch seconds), or None."""
        with self._lock:
            if self._done_seq >= self._seq:
                return None
            number, off = self._settled
            for _ in range(len(self._segments) + 1):
                seg = self._segments.get(number)
                if seg is not None:
                    off = seg.skips.get(off, off)
                    if off < seg.offset:
                        _, size, _, _ = _HEAD.unpack_from(seg.mm, off)
                        start = off + HEADER_BYTES
                        payload = seg.mm[start : start + size]
                        break
                later = [n for n in self._segments if n > number]
                if not later:
                    return None
                number, off = min(later), 0
            else:
                return None
        try:
            at = json.loads(payload)["t"]
        except (ValueError, KeyError, TypeError, RecursionError):
            return None
        return float(at) if isinstance(at, (int, float)) else None

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
                unread_turns=self._seq - self._read_seq,
                segments=len(self._segments),
                quarantined_regions=self._quarantined[0],
                quarantined_bytes=self._quarantined[1],
            )

    def oldest_segment(self) -> int:
        """The lowest segment number still on disk (its turns' done keys are still needed)."""
        with self._lock:
            numbers = [*self._segments, *(s.number for s in self._doomed)]
            return min(numbers) if numbers else 0

    # -- upkeep (blocking: the maintainer calls these in a worker thread) ----------------

    def needs_spare(self) -> bool:
        tail = self._tail
        return (tail is not None and self._spare is None
                and tail.offset >= tail.size * _SPARE_AT)

    def prepare_spare(self) -> None:
        """Create the next segment ahead of need, off the accept path and off the lock.

        Raises:
            DiskFullError: no room for it (the accept path tries again when it must roll).
        """
        with self._lock:
            if self._tail is None or self._spare is not None or not self.needs_spare():
                return
            number = self._reserved + 1
            self._reserved = number
        seg = self._map(number, create=True, size=self._segment_bytes)
        with self._lock:
            if self._tail is not None and self._spare is None and self._tail.number < number:
                self._spare = seg
                return
        # The tail rolled past it meanwhile (or the outbox closed): not needed.
        seg.mm.close()
        seg.path.unlink(missing_ok=True)

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

    @staticmethod
    def prefault(plan: list[tuple[int, int]]) -> None:
        """Run a prefault plan; blocking, so call it in a worker thread. Never writes data."""
        for addr, length in plan:
            _populate_write(addr, length)

    # -- files ---------------------------------------------------------------------------

    def _map(self, number: int, *, create: bool, size: int = 0) -> _Segment:
        path = self.directory / f"{number:012d}{_SUFFIX}"
        try:
            if create:
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
            raise os_error(exc, f"outbox segment {path}") from exc
        return _Segment(number=number, path=path, size=size, mm=mm, addr=_address(mm))


class OutboxBusyError(StoreError):
    """Another live process holds this outbox directory."""


def _valid_at(mm: mmap.mmap, off: int, end: int) -> int:
    """The length of the record at ``off`` when a whole, intact record is there, else -1."""
    if off + HEADER_BYTES > end:
        return -1
    magic, size, crc, info = _HEAD.unpack_from(mm, off)
    if magic != _MAGIC_U32 or size <= 0 or off + HEADER_BYTES + size > end:
        return -1
    start = off + HEADER_BYTES
    if zlib.crc32(mm[start : start + size], zlib.crc32(_INFO.pack(info))) != crc:
        return -1
    return int(size)


def _next_valid(mm: mmap.mmap, pos: int, end: int) -> int | None:
    while True:
        found = mm.find(_MAGIC, pos, end)
        if found < 0:
            return None
        if _valid_at(mm, found, end) >= 0:
            return found
        pos = found + 1


def _scan(seg: _Segment) -> Iterator[tuple[int, int]]:
    """Count the segment's intact records; yields each damaged region (start, end).

    A region with no intact record after it is the end of the log: the torn tail of a kill
    (its commit mark was never written) is silent. A whole header whose bytes do not match is
    damage even there: a kill cannot leave one.
    """
    mm, end = seg.mm, seg.size
    off = 0
    while off + HEADER_BYTES <= end:
        size = _valid_at(mm, off, end)
        if size >= 0:
            off += HEADER_BYTES + size
            seg.appended += 1
            seg.payload_bytes += size
            continue
        nxt = _next_valid(mm, off + 1, end)
        if nxt is None:
            magic, size, _, _ = _HEAD.unpack_from(mm, off)
            if magic == _MAGIC_U32 and 0 < size <= end - off - HEADER_BYTES:
                yield off, off + HEADER_BYTES + size
            elif magic or size:
                log.debug("outbox_torn_tail", segment=str(seg.path), offset=off)
            break
        seg.skips[off] = nxt
        yield off, nxt
        off = nxt
    seg.offset = off


def _is_legacy(seg: _Segment) -> bool:
    if seg.size < 4:
        return False
    (first,) = struct.unpack_from("<I", seg.mm, 0)
    return first not in (0, _MAGIC_U32)


def _legacy_records(seg: _Segment) -> list[bytes]:
    """The intact records of a segment an earlier version wrote (``[length][crc][payload]``)."""
    out, off, mm, end = [], 0, seg.mm, seg.size
    while off + _LEGACY.size <= end:
        size, crc = _LEGACY.unpack_from(mm, off)
        if size == 0 or off + 8 + size > end or zlib.crc32(mm[off + 8 : off + 8 + size]) != crc:
            break
        out.append(bytes(mm[off + 8 : off + 8 + size]))
        off += 8 + size
    return out


def _count_messages(payload: bytes) -> int:
    try:
        return len(json.loads(payload)["m"])
    except (ValueError, KeyError, TypeError, RecursionError):
        return 0


class RecordSummary(NamedTuple):
    """One intact record found by ``inspect``: its turn's key and accept time when its
    JSON reads (None when it does not)."""

    segment: Path
    key: str | None
    accepted_at: float | None


def inspect(directory: Path) -> tuple[list[Path], list[RecordSummary]]:
    """The segment files of an outbox folder and every intact record in them, read-only and
    without the folder's lock (beside a running pipeline): a record being appended reads as
    the end of the log, damage is stepped over, a segment deleted meanwhile is skipped.

    Raises:
        OSError: the folder or a segment cannot be read (permissions).
    """
    segments: list[Path] = []
    records: list[RecordSummary] = []
    for path in sorted(directory.glob("*" + _SUFFIX)):
        if not path.stem.isdigit():
            continue
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    continue
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    found = _summaries(mm, path, size)
        except FileNotFoundError:
            continue  # settled and removed since it was listed
        segments.append(path)
        records += found
    return segments, records


def _summaries(mm: mmap.mmap, path: Path, end: int) -> list[RecordSummary]:
    if _LEGACY.unpack_from(mm, 0)[0] not in (0, _MAGIC_U32):
        payloads = []
        off = 0
        while off + _LEGACY.size <= end:
            size, crc = _LEGACY.unpack_from(mm, off)
            if size == 0 or off + 8 + size > end or zlib.crc32(mm[off + 8: off + 8 + size]) != crc:
                break
            payloads.append(mm[off + 8 : off + 8 + size])
            off += 8 + size
    else:
        payloads = []
        off = 0
        while off + HEADER_BYTES <= end:
            size = _valid_at(mm, off, end)
            if size < 0:
                nxt = _next_valid(mm, off + 1, end)
                if nxt is None:
                    break
                off = nxt
                continue
            payloads.append(mm[off + HEADER_BYTES : off + HEADER_BYTES + size])
            off += HEADER_BYTES + size
    out = []
    for payload in payloads:
        try:
            doc = json.loads(payload)
            out.append(RecordSummary(path, str(doc["k"]), float(doc["t"])))
        except (ValueError, KeyError, TypeError, RecursionError):
            out.append(RecordSummary(path, None, None))
    return out
