"""A full disk, read-only files and bad folders, on real file systems.

A small tmpfs is mounted for each test (root only, as in CI; elsewhere the tests skip), so a
full disk is a real ENOSPC from the kernel, not a mocked error.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import sqlite3
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
from structlog.testing import capture_logs

from hermes_async_memory import (
    DiskFullError,
    FlushTimeoutError,
    MemoryPipeline,
    Receipt,
    Settings,
    StoreAccessError,
)

from .helpers import stored_turns
from .processes import ROOT, child_env

MIB = 1024 * 1024
SEGMENT_BYTES = 256 * 1024
TEXT = "the quick brown fox jumps over the lazy dog and then some more words " * 4


class SmallDisk:
    """A tmpfs of ``size_mib`` mounted at ``path``; ``fill()`` leaves no free byte."""

    def __init__(self, path: Path, size_mib: int) -> None:
        self.path = path
        self.ballast = path / "ballast"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700",
                               "tmpfs", str(path)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")

    def fill(self) -> None:
        fd = os.open(self.ballast, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for size in (1 << 20, 65536, 4096, 1):
                try:
                    while True:
                        os.write(fd, b"\0" * size)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
        finally:
            os.close(fd)

    def free(self) -> None:
        self.ballast.unlink()

    def remount(self, option: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{option}", str(self.path)], check=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    d = SmallDisk(tmp_path / "fs", 24)
    try:
        yield d
    finally:
        d.unmount()


def accept(mem: MemoryPipeline, n: int, tag: str) -> tuple[list[Receipt], int]:
    """Offer ``n`` turns over 8 sessions; returns the receipts and how many were refused
    with DiskFullError (any other error fails the test)."""
    receipts, refused = [], 0
    for i in range(n):
        try:
            receipts.append(mem.sync_turn(f"{tag} {i} {TEXT}", f"reply {i}",
                                          session_id=f"s{i % 8}", user_id="u"))
        except DiskFullError:
            refused += 1
    return receipts, refused


async def test_a_full_disk_refuses_turns_typed_then_recovers_in_the_same_process(
    disk: SmallDisk,
) -> None:
    """Invariant: every acknowledged turn is stored exactly once, in session order; a turn
    that could not be made durable is refused with DiskFullError, never acknowledged."""
    db = disk.path / "m.db"
    settings = Settings(db_path=db, outbox_segment_bytes=SEGMENT_BYTES, max_wait_ms=1)
    async with MemoryPipeline(settings) as mem:
        before, refused = accept(mem, 200, "before")
        assert refused == 0
        await mem.flush()
        # An empty WAL: the next commit needs new blocks, and there will be none.
        other = sqlite3.connect(db)
        other.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        other.close()

        disk.fill()
        during: list[Receipt] = []
        with anyio.fail_after(30):
            # The writer tries to commit these and is refused by the full disk: a transient
            # fault, retried, never a dead letter.
            got, refused = accept(mem, 20, "first")
            during += got
            await mem.wait_until(lambda: mem.stats().commit_retries > 0)
            # The segment space reserved up front runs out; the next segment cannot be
            # made, and sync_turn refuses, typed.
            while not refused:
                got, refused = accept(mem, 200, f"during{len(during)}")
                during += got
        health = mem.health()
        assert not health.ok and "disk_full" in health.conditions
        assert (health.reason or "").startswith("disk full")
        assert "disk_full" in mem.stats().conditions
        with pytest.raises(FlushTimeoutError):
            await mem.flush(timeout=0.3)
        assert mem.stats().dead_letters == 0

        with capture_logs() as logs:
            disk.free()
            with anyio.fail_after(30):
                await mem.flush()
                await mem.wait_until(lambda: mem.health().ok)
                # The WAL is given back once the disk has room again.
                await mem.wait_until(lambda: "store_checkpointed" in [e["event"] for e in logs])
            after, refused = accept(mem, 2000, "after")  # several new segments
            assert refused == 0
            with anyio.fail_after(30):
                await mem.flush()
        assert mem.state == "open" and mem.health().ok

    assert_stored_once_in_order(db, before + during + after)


async def test_a_full_disk_at_start_is_a_typed_error(disk: SmallDisk) -> None:
    disk.fill()
    settings = Settings(db_path=disk.path / "m.db")
    with pytest.raises(DiskFullError):
        await MemoryPipeline(settings).start()


async def test_a_read_only_file_system_is_one_typed_error_at_start(disk: SmallDisk) -> None:
    settings = Settings(db_path=disk.path / "m.db")
    async with MemoryPipeline(settings) as mem:
        mem.sync_turn("hello", "hi", session_id="s")
    disk.remount("ro")
    with pytest.raises(StoreAccessError) as caught:
        await MemoryPipeline(settings).start()
    assert "read-only" in str(caught.value).lower() or "readonly" in str(caught.value).lower()


def _seed_store(db: Path) -> None:
    code = (
        "import asyncio\n"
        "from hermes_async_memory import MemoryPipeline, Settings\n"
        "async def go():\n"
        f"    async with MemoryPipeline(Settings(db_path={str(db)!r})) as mem:\n"
        "        mem.sync_turn('a', 'b', session_id='s')\n"
        "asyncio.run(go())\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, env=child_env(), cwd=ROOT)


@pytest.mark.parametrize("case", ["parent is a file", "missing parent on a read-only disk",
                                  "read-only folder", "read-only store"])
def test_a_store_that_cannot_be_used_is_one_line_from_the_worker(
    disk: SmallDisk, case: str
) -> None:
    """Root ignores file modes, so "read-only" is a read-only mount, as on a real host."""
    if case == "parent is a file":
        (disk.path / "file").write_text("")
        db = disk.path / "file" / "m.db"
    elif case == "missing parent on a read-only disk":
        db = disk.path / "no" / "such" / "m.db"
        disk.remount("ro")
    elif case == "read-only folder":
        db = disk.path / "m.db"
        disk.remount("ro")
    else:
        db = disk.path / "m.db"
        _seed_store(db)
        disk.remount("ro")
    env = {**child_env(), "HERMES_MEMORY_DB_PATH": str(db)}
    done = subprocess.run([sys.executable, "-m", "workers", "--deadline", "1"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("python -m workers: error: cannot "), lines[0]
    assert str(db.parent) in lines[0] or str(db) in lines[0]


# -- a nearly full disk (issue 27, section 4) ---------------------------------------------

BALLAST_BYTES = 256 * 1024


def assert_stored_once_in_order(db: Path, acked: list[Receipt]) -> None:
    """Every acknowledged turn is stored, once, and each session's in accept order."""
    stored = stored_turns(db)
    keys = Counter(key for rows in stored.values() for key, role, _ in rows if role == "user")
    assert {r.key for r in acked} == set(keys), "every acknowledged turn is stored"
    assert all(n == 1 for n in keys.values()), "and stored once"
    for session, rows in stored.items():
        got = [key for key, role, _ in rows if role == "user"]
        assert got == [r.key for r in acked if r.session_id == session], session


def leave_pending(db: Path, settings: Settings, n: int, *, until_full: bool = False
                  ) -> list[Receipt]:
    """Accept ``n`` turns (``until_full``: until the first DiskFullError) in a child process
    killed before its writer commits them: they are left in the outbox, durable and pending,
    as after a crash on a full disk."""
    code = (
        "import asyncio, json, os, signal, sys\n"
        "from hermes_async_memory import DiskFullError, MemoryPipeline, Settings\n"
        "from pathlib import Path\n"
        "async def go():\n"
        f"    mem = MemoryPipeline(Settings(db_path=Path({str(db)!r}),"
        f" outbox_segment_bytes={settings.outbox_segment_bytes}))\n"
        "    await mem.start()\n"
        f"    for i in range({n}):\n"
        "        try:\n"
        f"            r = mem.sync_turn(f'left {{i}} {TEXT}', 'ok', session_id=f's{{i % 8}}',"
        " user_id='u')\n"
        "        except DiskFullError:\n"
        f"            if {until_full}: break\n"
        "            raise\n"
        "        print('receipt', json.dumps([r.key, r.session_id]), flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "asyncio.run(go())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == -9, done.stderr
    out = []
    lines = [line for line in done.stdout.splitlines() if line.startswith("receipt ")]
    for i, line in enumerate(lines):
        key, session = json.loads(line.removeprefix("receipt "))
        out.append(Receipt(key, session, i + 1, 0.0, False, None))
    assert len(out) < n if until_full else len(out) == n
    return out


async def accept_until_refused(mem: MemoryPipeline) -> list[Receipt]:
    """Offer turns, letting the writer commit between chunks, until the disk is so full that
    sync_turn refuses one with DiskFullError; returns the acknowledged ones."""
    acked: list[Receipt] = []
    with anyio.fail_after(60):
        while True:
            got, refused = accept(mem, 20, f"fill{len(acked)}")
            acked += got
            if refused:
                return acked
            # The writer catches up, or the store is the one short of room.
            await mem.wait_until(lambda: mem.stats().pending_turns == 0
                                 or "disk_full_store" in mem.health().conditions)


@pytest.mark.parametrize("segment_bytes", [None, 64 * 1024], ids=["default", "64KiB"])
async def test_a_disk_smaller_than_one_segment_fills_then_drains_once_room_returns(
    tmp_path: Path, segment_bytes: int | None
) -> None:
    """Issue 27's setup: a 2 MiB disk (smaller than the default 16 MiB segment) filled by
    the pipeline itself until accepts fail, then 256 KiB freed. Invariant: every acknowledged
    turn is stored once, in session order, within a deadline, in the same process."""
    disk = SmallDisk(tmp_path / "fs", 2)
    try:
        disk.ballast.write_bytes(b"\1" * BALLAST_BYTES)
        db = disk.path / "m.db"
        settings = Settings(db_path=db, max_wait_ms=1)
        if segment_bytes is not None:
            settings = dataclasses.replace(settings, outbox_segment_bytes=segment_bytes)
        async with MemoryPipeline(settings) as mem:
            acked = await accept_until_refused(mem)
            assert len(acked) > 100, "a disk smaller than a segment still accepts turns"
            assert not mem.health().ok and "disk_full" in mem.health().conditions
            disk.free()
            with anyio.fail_after(30):
                await mem.flush()
            # The disk grown: it goes on accepting, no restart needed.
            disk.remount("size=8m")
            with anyio.fail_after(30):
                await mem.wait_until(lambda: mem.health().ok)
            after, refused = accept(mem, 20, "after")
            assert refused == 0
            with anyio.fail_after(30):
                await mem.flush()
            assert mem.stats().dead_letters == 0
        assert_stored_once_in_order(db, acked + after)
    finally:
        disk.unmount()


async def test_a_restart_with_less_free_space_than_one_segment_starts_and_drains(
    disk: SmallDisk,
) -> None:
    """A 24 MiB disk holding a 16 MiB segment of pending turns (a crash): less room than a
    new segment. Start commits them and accepts new turns, in the same process."""
    db = disk.path / "m.db"
    settings = Settings(db_path=db, max_wait_ms=1)
    left = leave_pending(db, settings, 300)
    free = os.statvfs(disk.path)
    assert free.f_bavail * free.f_frsize < settings.outbox_segment_bytes
    async with MemoryPipeline(settings) as mem:
        assert mem.stats().recovered_turns == 300
        with anyio.fail_after(30):
            await mem.flush()
        after, refused = accept(mem, 200, "after")
        assert refused == 0
        with anyio.fail_after(30):
            await mem.flush()
            await mem.wait_until(lambda: mem.health().ok)
    assert_stored_once_in_order(db, left + after)


async def test_a_restart_on_a_full_disk_starts_refuses_typed_and_drains_once_room_returns(
    disk: SmallDisk,
) -> None:
    """Pending turns left by a crash, then the disk filled to the last byte. Start succeeds
    (no segment can be made): health says disk full and sync_turn refuses, typed. Once room
    returns the same process commits every pending turn once, in order, and accepts again."""
    db = disk.path / "m.db"
    settings = Settings(db_path=db, outbox_segment_bytes=SEGMENT_BYTES, max_wait_ms=1)
    left = leave_pending(db, settings, 300)
    disk.fill()
    mem = MemoryPipeline(settings)
    await mem.start()
    try:
        assert "disk_full" in mem.health().conditions
        assert mem.stats().recovered_turns == 300
        with pytest.raises(DiskFullError):
            mem.sync_turn("refused", "no room", session_id="s0", user_id="u")
        disk.free()
        with anyio.fail_after(30):
            await mem.flush()
            await mem.wait_until(lambda: mem.health().ok)
        after, refused = accept(mem, 200, "after")
        assert refused == 0
        with anyio.fail_after(30):
            await mem.flush()
    finally:
        await mem.aclose()
    assert_stored_once_in_order(db, left + after)


async def test_an_outbox_on_its_own_full_disk_restarts_drains_and_accepts_by_itself(
    tmp_path: Path,
) -> None:
    """The outbox's folder on a 1 MiB disk of its own, filled with pending turns by a process
    killed before its writer ran; the store has room. Start succeeds although no segment can
    be made, commits every pending turn (the store can take them), and the segments it
    drained give the room back: accepts resume in the same process, nothing freed by hand."""
    db = tmp_path / "m.db"
    settings = Settings(db_path=db, outbox_segment_bytes=SEGMENT_BYTES, max_wait_ms=1)
    disk = SmallDisk(settings.outbox_dir, 1)
    try:
        left = leave_pending(db, settings, 100_000, until_full=True)
        assert len(left) > 1000
        async with MemoryPipeline(settings) as mem:
            assert mem.stats().recovered_turns == len(left)
            assert "disk_full" in mem.health().conditions
            with anyio.fail_after(30):
                await mem.flush()
                await mem.wait_until(lambda: mem.health().ok)
            after, refused = accept(mem, 500, "after")
            assert refused == 0
            with anyio.fail_after(30):
                await mem.flush()
            assert mem.stats().dead_letters == 0
        assert_stored_once_in_order(db, left + after)
    finally:
        disk.unmount()
