"""Outbox segment files: created with their blocks reserved, mapped, scanned at start (damage
set aside), and faulted in ahead of the accept path. Blocking file work: the outbox calls
these in worker threads, never on the event loop, and never under the lock that the accept
path takes (but for the fallback in ``Outbox._roll``)."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from ..errors import CorruptOutboxError, DiskFullError, StoreAccessError
from . import records
from .records import HEAD, HEADER_BYTES, MAGIC_U32

log = structlog.get_logger(__name__)

QUARANTINE_DIR = "quarantine"
# The smallest segment made to fit a disk short of room for a whole one.
MIN_FITTED_BYTES = 64 * 1024
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without touching them
_ACCESS_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR,
                            errno.EISDIR, errno.ENOENT, errno.ELOOP, errno.ENAMETOOLONG})


@dataclass(eq=False)
class Segment:
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
    released_to: int = 0  # pages below this are settled and were dropped from memory


def os_error(exc: OSError, what: str) -> Exception:
    """The typed error for a file-system failure of the outbox."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(f"no space left for {what}: {exc.strerror}")
    if exc.errno in _ACCESS_ERRNOS:
        return StoreAccessError(f"cannot use {what}: {exc.strerror or exc}")
    return CorruptOutboxError(f"cannot use {what}: {exc}")


def path_of(directory: Path, number: int) -> Path:
    return directory / f"{number:012d}{records.SUFFIX}"


def map_segment(directory: Path, number: int, *, create: bool, size: int = 0) -> Segment:
    """Map segment ``number``; with ``create``, a new file of ``size`` bytes, its blocks
    reserved (a write into a hole of a full disk would be SIGBUS).

    Raises:
        DiskFullError, StoreAccessError, CorruptOutboxError: by the file system's answer.
    """
    path = path_of(directory, number)
    try:
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
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
    return Segment(number=number, path=path, size=size, mm=mm, addr=_address(mm))


def create_segment(directory: Path, number: int, size: int, need: int) -> Segment:
    """A new segment of ``size`` bytes or, on a disk without room for that, a smaller one
    that fits: a quarter of the free space (the rest stays for the store, which must commit
    what waits before segments can go), never less than ``need`` or ``MIN_FITTED_BYTES``.

    Raises:
        DiskFullError: not even that fits.
        StoreAccessError, CorruptOutboxError: by the file system's answer.
    """
    try:
        return map_segment(directory, number, create=True, size=max(size, need))
    except DiskFullError:
        fitted = _quarter_free(directory)
        if fitted < max(need, MIN_FITTED_BYTES) or fitted >= size:
            raise
    return map_segment(directory, number, create=True, size=fitted)


def _quarter_free(directory: Path) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    quarter = st.f_bavail * st.f_frsize // 4
    return quarter - quarter % mmap.PAGESIZE


def scan(seg: Segment) -> Iterator[tuple[int, int]]:
    """Count the segment's intact records; yields each damaged region (start, end).

    A region with no intact record after it is the end of the log: the torn tail of a kill
    (its commit mark was never written) is silent. A whole header whose bytes do not match is
    damage even there: a kill cannot leave one.
    """
    mm, end = seg.mm, seg.size
    off = 0
    while off + HEADER_BYTES <= end:
        size = records.valid_at(mm, off, end)
        if size >= 0:
            off += HEADER_BYTES + size
            seg.appended += 1
            seg.payload_bytes += size
            continue
        nxt = records.next_valid(mm, off + 1, end)
        if nxt is None:
            magic, size, _, _ = HEAD.unpack_from(mm, off)
            if magic == MAGIC_U32 and 0 < size <= end - off - HEADER_BYTES:
                yield off, off + HEADER_BYTES + size
            elif magic or size:
                log.debug("outbox_torn_tail", segment=str(seg.path), offset=off)
            break
        seg.skips[off] = nxt
        yield off, nxt
        off = nxt
    seg.offset = off


def quarantine(directory: Path, seg: Segment, start: int, end: int) -> None:
    """Copy damaged bytes aside, beside the segments, and say so at error level."""
    qdir = directory / QUARANTINE_DIR
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


def prefault(plan: list[tuple[int, int]]) -> None:
    """Fault address ranges in, writable, without writing; blocking."""
    for addr, length in plan:
        _populate_write(addr, length)


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
