"""Upkeep, off the accept path and off the event loop's back.

Every second (sooner when the writer asks for a spare segment):
- the outbox: the next segment created ahead of need, settled segments deleted, settled
  pages dropped from memory, pages ahead of the tail faulted in — file I/O, all of it in a
  worker thread;
- memory: once the outbox is empty after a backlog, the C allocator's free heap given back;
- the store (a process that commits): done keys of deleted segments forgotten, the frequent
  terms re-read, a WAL checkpoint when the WAL crowds the disk, while the store is short of
  room and once it has room again, old recall results pruned;
- shared mode (a worker): the inbox's depth, what gone producers left handed in, old done
  keys of inbox turns forgotten;
- the replica backend's backlog counted.

A full disk is a condition health shows while it lasts; once a spare segment can be made
again it clears, and writing goes on in the same process. While the store is short of room
it comes first: no new segment is made (the spare's room is given back), since only its
commits let segments go.
"""

from __future__ import annotations

import asyncio
import ctypes
import mmap
import os
import sqlite3
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import structlog

from .errors import describe
from .faults import Fault, classify, is_disk_full
from .outbox import Outbox
from .settings import Settings
from .store import SqliteStore
from .supervisor import DISK_FULL, DISK_FULL_STORE, Conditions

log = structlog.get_logger(__name__)

EVERY_S = 1.0
PRUNE_EVERY_S = 60.0  # the pruning deletes scan their tables: not every second
INBOX_KEYS_KEPT_S = 7 * 24 * 3600.0  # done keys of inbox turns: the duplicate guard's memory
RESULTS_KEPT_S = 600.0  # a producer polls results within milliseconds; these are long read
# Records settled since the heap was last given back before the next time (when idle).
TRIM_EVERY_BYTES = 16 * 1024 * 1024
# A WAL smaller than this is not checkpointed early, however full the disk.
WAL_CHECKPOINT_MIN_BYTES = 64 * 1024
# SQLite checkpoints after a commit leaves the WAL this many pages long: its default, less on
# a nearly full disk (a quarter of the free space), never less than the minimum.
AUTOCHECKPOINT_PAGES = 1000
AUTOCHECKPOINT_MIN_PAGES = 16
WAL_PAGE_BYTES = 4096 + 24  # a page and its frame header


def _load_malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None  # not the GNU C library: its allocator gives memory back on its own terms
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_malloc_trim = _load_malloc_trim()


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE
    except (OSError, ValueError, IndexError):
        return 0


def _wal_and_free(db: Path) -> tuple[int, int]:
    """The size of the store's WAL file, and the free space of its disk (room to spare when
    unknown)."""
    try:
        st = os.statvfs(db.parent)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 1 << 62
    try:
        wal = os.stat(db.with_name(db.name + "-wal")).st_size
    except OSError:
        wal = 0
    return wal, free


class Maintenance:
    """The maintainer: one supervised part running each job in turn."""

    def __init__(self, settings: Settings, store: SqliteStore, outbox: Outbox, *,
                 conditions: Conditions, commits: bool,
                 adopt: Callable[[], Awaitable[int]] | None = None,
                 on_round: Callable[[], None] = lambda: None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._settings = settings
        self._store = store
        self.outbox = outbox
        self._conditions = conditions
        self._commits = commits
        self._adopt = adopt
        self._on_round = on_round  # the counts it refreshed may be awaited: wait_until()
        self._clock = clock
        self._wall = wall_clock
        self._poke = asyncio.Event()
        self._last_pruned = 0
        self._vocab_next = 0.0
        self.rows_since_vocab = 0
        self.inbox_counts: tuple[int, float | None] = (0, None)
        self.replica_counts = (0, 0)  # (pending, dead)
        self.replica_oldest: float | None = None  # the oldest waiting record's accept time
        self._checkpoint_due = False
        self._autocheckpoint = AUTOCHECKPOINT_PAGES  # SQLite's default, until changed
        self._prune_next = 0.0
        self._trimmed_at = 0  # the outbox's settled bytes when the heap was last given back
        self.heap_trims = 0
        self._accepted_seen = -1  # the outbox's accepted count at the last round
        conditions.on_clear(DISK_FULL_STORE, self._after_full_disk)

    def _after_full_disk(self) -> None:
        # Room again: give back what the WAL grew to while the disk was full, soon.
        self._checkpoint_due = True
        self._poke.set()

    def poke(self) -> None:
        """Run a round soon (the writer saw the outbox tail fill up)."""
        self._poke.set()

    async def run(self) -> None:
        while True:
            with anyio.move_on_after(EVERY_S):
                await self._poke.wait()
            self._poke.clear()
            await self.round()
            self._on_round()

    async def round(self) -> None:
        await self._job("outbox", self._outbox)
        if not self._commits:
            return  # a producer: the worker keeps the store
        await self._job("store", self._store_upkeep)
        if self._adopt is not None:
            await self._job("shared", self._shared)
        if self._store.replica is not None:
            name = self._store.replica
            await self._job("replica", self._replica_counts(name))

    async def _job(self, name: str, job: Callable[[], Awaitable[None]]) -> None:
        try:
            await job()
        except Exception as exc:  # transient trouble waits for the next round; else it is loud
            if classify(exc) is not Fault.TRANSIENT:
                raise
            if is_disk_full(exc):
                self._conditions.set(DISK_FULL if name == "outbox" else DISK_FULL_STORE,
                                     describe(exc))
            log.warning("maintenance_retry", job=name, error=describe(exc))

    async def _outbox(self) -> None:
        outbox = self.outbox
        # Settled segments go first: on a full disk their room is what the store and the
        # next segment need, and a spare that cannot be made must not keep it.
        await anyio.to_thread.run_sync(outbox.reap)
        await anyio.to_thread.run_sync(outbox.release_settled)
        # While the store is short of room it comes first: a new segment would take the
        # room its commit needs, and only a commit lets segments go. The spare's room is
        # given to it; appends go on into the tail, then are refused, typed.
        short = DISK_FULL_STORE in self._conditions
        outbox.hold_growth = short
        if short:
            await anyio.to_thread.run_sync(outbox.drop_spare)
        elif outbox.needs_spare():
            await anyio.to_thread.run_sync(outbox.prepare_spare)
        if DISK_FULL in self._conditions and not outbox.needs_spare():
            self._conditions.clear(DISK_FULL)
        plan = outbox.prefault_plan()
        if plan:
            await anyio.to_thread.run_sync(Outbox.prefault, plan)
        await self._give_back_heap()

    async def _give_back_heap(self) -> None:
        """Once a backlog has drained, return the heap's free pages to the system.

        Draining a backlog decodes and encodes batch after batch, and the store's thread
        allocates beside the loop's: the C allocator keeps the freed memory, fragmented
        between live objects, as its own. Held by an idle process, that was most of the
        backlog's peak (50 of 233 MiB after 100,000 turns of 2 KB). ``malloc_trim`` gives
        back every free page. It runs in a worker thread, but it holds each arena's lock while it
        walks it, and the loop's own allocations would wait: so only once the outbox is empty
        and no turn came in since the last round (the traffic has stopped, not paused), after
        enough records went through for it to matter.
        """
        counts, accepted = self.outbox.counts(), self.outbox.accepted()
        quiet, self._accepted_seen = accepted == self._accepted_seen, accepted
        if (_malloc_trim is None or counts.pending_turns or not quiet
                or counts.settled_bytes - self._trimmed_at < TRIM_EVERY_BYTES):
            return
        self._trimmed_at = counts.settled_bytes
        started, rss = self._clock(), _rss_bytes()
        trim = _malloc_trim
        await anyio.to_thread.run_sync(lambda: trim(0))
        self.heap_trims += 1
        log.debug("heap_given_back", freed_mib=round((rss - _rss_bytes()) / 2**20, 1),
                  duration_ms=round((self._clock() - started) * 1e3, 2))

    async def _store_upkeep(self) -> None:
        store, s = self._store, self._settings
        wal_bytes, free_bytes = await self.fit_wal()
        crowded = wal_bytes >= WAL_CHECKPOINT_MIN_BYTES and wal_bytes * 2 >= free_bytes
        reason = ("disk_full_cleared" if self._checkpoint_due
                  else "disk_full" if DISK_FULL_STORE in self._conditions
                  else "wal_crowds_disk" if crowded
                  else None)
        if reason is not None:
            started = self._clock()
            try:
                done = await store.checkpoint()
            except sqlite3.Error as exc:
                if reason != "disk_full" or not is_disk_full(exc):
                    raise
                # Expected while the store is short of room (a checkpoint grows the file
                # first), tried again each second: the writer's retries say so already.
                log.debug("store_checkpoint_deferred", error=describe(exc))
                done = False
            if done:
                self._checkpoint_due = False
                (log.debug if reason == "disk_full" else log.info)(
                    "store_checkpointed", reason=reason,
                    duration_ms=round((self._clock() - started) * 1e3, 2))
        oldest = self.outbox.oldest_segment()
        if oldest > self._last_pruned:
            await store.prune_outbox(oldest)
            self._last_pruned = oldest
        if self.rows_since_vocab and self._clock() >= self._vocab_next:
            await self.refresh_vocab()
        if self._clock() >= self._prune_next:
            self._prune_next = self._clock() + PRUNE_EVERY_S
            if s.role == "worker":
                await store.prune_recall_results(self._wall() - RESULTS_KEPT_S)
                await store.prune_inbox_keys(self._wall() - INBOX_KEYS_KEPT_S)
        if (DISK_FULL_STORE in self._conditions and not self.outbox.counts().pending_turns
                and not self.inbox_counts[0]):
            # Set by a write of this job's, or by the writer's last batch: the store took this
            # round's writes and nothing waits, so no commit of the writer's will clear it.
            self._conditions.clear(DISK_FULL_STORE)

    async def fit_wal(self) -> tuple[int, int]:
        """Keep the store's WAL to a quarter of the disk's free space; returns the WAL's
        size and the free space, in bytes.

        The WAL only shrinks at a checkpoint, and SQLite's own comes at 4 MiB: on a disk with
        less room than that, commits would fail for want of the room the WAL's old pages
        hold, and so would the checkpoint that gives it back (it grows the file first).
        """
        wal_bytes, free_bytes = await anyio.to_thread.run_sync(_wal_and_free,
                                                               self._store.path)
        pages = max(AUTOCHECKPOINT_MIN_PAGES,
                    min(AUTOCHECKPOINT_PAGES, free_bytes // 4 // WAL_PAGE_BYTES))
        if pages != self._autocheckpoint:
            await self._store.set_autocheckpoint(pages)
            self._autocheckpoint = pages
        return wal_bytes, free_bytes

    async def refresh_vocab(self) -> None:
        """Re-read the frequent terms; the scan grows with the store, so its own duration
        spaces the next one out (at most ~1 % of one reader's time)."""
        s = self._settings
        self.rows_since_vocab = 0
        started = self._clock()
        terms = await self._store.refresh_frequent_terms(s.frequent_term_rows,
                                                         s.frequent_term_ratio)
        took = self._clock() - started
        self._vocab_next = self._clock() + max(s.frequent_terms_refresh_s, took * 100)
        log.debug("frequent_terms_refreshed", terms=len(terms), duration_ms=round(took * 1e3, 2))

    async def _shared(self) -> None:
        assert self._adopt is not None
        self.inbox_counts = await self._store.inbox_counts()
        await self._adopt()

    def _replica_counts(self, name: str) -> Callable[[], Awaitable[None]]:
        async def count() -> None:
            self.replica_counts = await self._store.replica_counts(name)
            self.replica_oldest = (await self._store.replica_oldest_pending(name)
                                   if self.replica_counts[0] else None)
        return count
