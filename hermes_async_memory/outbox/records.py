"""The outbox's record format, and reading records back without the outbox's lock.

A record is ``[magic u32][length u32][crc32 u32][info u32][payload]``: ``info`` holds the
record's kind and message count, the CRC covers ``info`` and the payload (ASCII JSON), and
the magic and the length are written last, together: that is the commit mark. A kill before
it leaves zeros where the next header would be: the end of the log, read silently. The magic
holds bytes no ASCII payload can, so a scan can find the next record after damage.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from pathlib import Path
from typing import NamedTuple

MAGIC = b"\xd3\xa7\xf1\x8b"  # bytes >= 0x80: never inside an ASCII payload
(MAGIC_U32,) = struct.unpack("<I", MAGIC)
HEAD = struct.Struct("<IIII")  # magic, length, crc32, info
_MARK = struct.Struct("<II")  # magic, length: the commit mark
_TAIL = struct.Struct("<II")  # crc32, info
_INFO = struct.Struct("<I")
HEADER_BYTES = HEAD.size
LEGACY = struct.Struct("<II")  # an earlier version's record: [length][crc32][payload]
SUFFIX = ".seg"
KIND_TURN = 0
COUNT_MASK = 0xFFFFFF


def write(mm: mmap.mmap, off: int, payload: bytes, info: int, slot: bytes | None = None
          ) -> int:
    """Write a record at ``off``, its commit mark last; returns where the next one goes.

    ``slot``: bytes that replace the payload's last ``len(slot) + 1`` but one (a turn's id
    slot, ``turns.ID_SLOT``), filled as the record is written."""
    size = len(payload)
    if slot is not None:
        # Two copies of a few hundred bytes cost less than writing and checksumming the
        # record in three pieces.
        at = size - len(slot) - 1
        payload = payload[:at] + slot + payload[at + len(slot):]
    start = off + HEADER_BYTES
    mm[start : start + size] = payload
    _TAIL.pack_into(mm, off + 8, zlib.crc32(payload, _info_crc(info)), info)
    _MARK.pack_into(mm, off, MAGIC_U32, size)  # the commit mark: written last
    return start + size


_INFO_CRCS: dict[int, int] = {}


def _info_crc(info: int) -> int:
    """The CRC of ``info``'s bytes, where a record's CRC starts (a turn's is one of a few)."""
    crc = _INFO_CRCS.get(info)
    if crc is None:
        crc = zlib.crc32(_INFO.pack(info))
        if len(_INFO_CRCS) < 4096:
            _INFO_CRCS[info] = crc
    return crc


def valid_at(mm: mmap.mmap, off: int, end: int) -> int:
    """The length of the record at ``off`` when a whole, intact record is there, else -1."""
    if off + HEADER_BYTES > end:
        return -1
    magic, size, crc, info = HEAD.unpack_from(mm, off)
    if magic != MAGIC_U32 or size <= 0 or off + HEADER_BYTES + size > end:
        return -1
    start = off + HEADER_BYTES
    if zlib.crc32(mm[start : start + size], _info_crc(info)) != crc:
        return -1
    return int(size)


def next_valid(mm: mmap.mmap, pos: int, end: int) -> int | None:
    """Where the next intact record after ``pos`` starts, if any."""
    while True:
        found = mm.find(MAGIC, pos, end)
        if found < 0:
            return None
        if valid_at(mm, found, end) >= 0:
            return found
        pos = found + 1


def is_legacy(mm: mmap.mmap, size: int) -> bool:
    """Whether an earlier version wrote this segment."""
    if size < 4:
        return False
    (first,) = struct.unpack_from("<I", mm, 0)
    return first not in (0, MAGIC_U32)


def legacy_payloads(mm: mmap.mmap, end: int) -> list[bytes]:
    """The intact records of a segment an earlier version wrote (``[length][crc][payload]``)."""
    out, off = [], 0
    while off + LEGACY.size <= end:
        size, crc = LEGACY.unpack_from(mm, off)
        if size == 0 or off + 8 + size > end or zlib.crc32(mm[off + 8 : off + 8 + size]) != crc:
            break
        out.append(bytes(mm[off + 8 : off + 8 + size]))
        off += 8 + size
    return out


def intact_payloads(mm: mmap.mmap, end: int) -> list[bytes]:
    """The payload of every intact record, damage stepped over."""
    out, off = [], 0
    while off + HEADER_BYTES <= end:
        size = valid_at(mm, off, end)
        if size < 0:
            nxt = next_valid(mm, off + 1, end)
            if nxt is None:
                break
            off = nxt
            continue
        out.append(bytes(mm[off + HEADER_BYTES : off + HEADER_BYTES + size]))
        off += HEADER_BYTES + size
    return out


def count_messages(payload: bytes) -> int:
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
    for path in sorted(directory.glob("*" + SUFFIX)):
        if not path.stem.isdigit():
            continue
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size == 0:
                    continue
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    payloads = (legacy_payloads(mm, size) if is_legacy(mm, size)
                                else intact_payloads(mm, size))
        except FileNotFoundError:
            continue  # settled and removed since it was listed
        segments.append(path)
        records += [_summary(path, payload) for payload in payloads]
    return segments, records


def _summary(path: Path, payload: bytes) -> RecordSummary:
    try:
        doc = json.loads(payload)
        return RecordSummary(path, str(doc["k"]), float(doc["t"]))
    except (ValueError, KeyError, TypeError, RecursionError):
        return RecordSummary(path, None, None)
