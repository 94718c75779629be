"""Producer slots: each producer process accepts into an outbox folder of its own (a slot).

A producer that dies leaves acknowledged turns in its slot. They are handed in (forwarded to
the shared inbox, skipping what the store already holds or has waiting) before anyone else
can forward a newer turn of the same session:

- a starting producer takes the slots lock, hands in every free slot, then takes the lowest
  free slot for itself, and only then lets go: a restarted producer that lands in another
  slot cannot overtake the turns it left in its old one, whoever hands them in;
- a worker hands in free slots every second (without waiting for the lock), so turns a
  producer left behind do not wait for it to come back.

A slot is free when no live process holds its folder's lock (``flock`` is released when the
process ends, however it ends).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import structlog

from ..errors import StoreError
from ..outbox import PAYLOAD, Outbox, OutboxBusyError, Record, Recovery, os_error
from ..retry import Backoff, retry_transient
from ..settings import Settings
from ..sinks import ForwardSink
from ..slices import CHUNK, CHUNK_BYTES, maybe_yield
from ..sources import decode_all
from ..turns import Turn

log = structlog.get_logger(__name__)

PRODUCER_SLOTS = 64
# How long a starting producer waits for another process to finish handing slots in.
LOCK_TIMEOUT_S = 60.0
_LOCK_POLL_S = 0.01


class ProducerSlots:
    """Takes a slot for this producer, and hands in what gone producers left."""

    def __init__(self, settings: Settings, sink: ForwardSink, backoff: Backoff) -> None:
        self._settings = settings
        self._sink = sink
        self._backoff = backoff
        self.handed_in = 0

    def _outbox(self, slot: int) -> Outbox:
        s = self._settings
        return Outbox(s.producer_outbox_dir(slot), segment_bytes=s.outbox_segment_bytes,
                      max_pending_turns=s.max_queued_turns,
                      max_pending_bytes=s.max_queued_bytes, overflow=s.overflow)

    @property
    def lock_path(self) -> Path:
        db = self._settings.db_path
        return db.with_name(db.name + ".slots.lock")

    async def open_own(self, first_segment: int) -> tuple[Outbox, Recovery, int]:
        """Hand in every free slot, then take the lowest free one: (outbox, recovery, slot).

        Raises:
            StoreError: every slot is in use, or the slots lock was not had in time.
        """
        async with self._locked(wait=True):
            await self.adopt_free(first_segment, locked=True)
            for slot in range(PRODUCER_SLOTS):
                outbox = self._outbox(slot)
                try:
                    recovery = await anyio.to_thread.run_sync(outbox.open, first_segment)
                except OutboxBusyError:
                    continue  # another live producer holds it
                log.info("producer_slot", slot=slot, outbox=str(outbox.directory))
                return outbox, recovery, slot
        raise StoreError(f"all {PRODUCER_SLOTS} producer slots of "
                         f"{self._settings.db_path} are in use")

    async def adopt_free(self, first_segment: int, *, locked: bool = False) -> int:
        """Hand in what every free slot holds; returns how many turns went. Without
        ``locked``, gives up at once when another process is handing slots in."""
        if not locked:
            async with self._locked(wait=False) as have:
                return await self.adopt_free(first_segment, locked=True) if have else 0
        total = 0
        for slot in range(PRODUCER_SLOTS):
            directory = self._settings.producer_outbox_dir(slot)
            if not directory.is_dir():
                continue
            outbox = self._outbox(slot)
            try:
                found = await anyio.to_thread.run_sync(
                    functools.partial(outbox.open, first_segment, writable=False))
            except OutboxBusyError:
                continue  # a live producer holds it
            try:
                handed = await self._hand_in(outbox) if found.records else 0
            finally:
                await anyio.to_thread.run_sync(outbox.close)
            if handed:
                log.warning("producer_slot_adopted", slot=slot, turns=handed)
            total += handed
        self.handed_in += total
        return total

    async def _hand_in(self, outbox: Outbox) -> int:
        handed = 0
        while True:
            records: list[Record] = []
            left = self._settings.max_batch_bytes
            # Up to ten chunks' records a batch, a chunk (or CHUNK_BYTES) a read, the loop
            # running between reads.
            while len(records) < 10 * CHUNK and left > 0:
                chunk = outbox.read(min(CHUNK, 10 * CHUNK - len(records)),
                                    min(CHUNK_BYTES, left))
                if not chunk:
                    break
                records += chunk
                left -= sum(len(r[PAYLOAD]) for r in chunk)
                await maybe_yield()
            if not records:
                return handed
            items = await decode_all(records, [])  # a chunk at a time: the loop runs on
            turns = [t for t in items if isinstance(t, Turn)]
            held = await retry_transient(
                lambda: self._sink.held([t.key for t in turns]), self._backoff)  # noqa: B023
            todo = [t for t in turns if t.key not in held]
            if todo:
                await retry_transient(lambda: self._sink.commit(todo, None),  # noqa: B023
                                      self._backoff)
            for item in items:
                if not isinstance(item, Turn):
                    await retry_transient(
                        lambda i=item: self._sink.dead_letter(i, i.error, None),  # type: ignore[misc]
                        self._backoff)
            outbox.mark_done(records)
            handed += len(todo)

    @contextlib.asynccontextmanager
    async def _locked(self, *, wait: bool) -> AsyncIterator[bool]:
        path = self.lock_path
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise os_error(exc, f"the producer slots lock {path}") from exc
        try:
            have = False
            with anyio.move_on_after(LOCK_TIMEOUT_S if wait else 0):
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        have = True
                        break
                    except BlockingIOError:
                        if not wait:
                            break
                        # Another process's progress: a lock has no awaitable to wait on.
                        await anyio.sleep(_LOCK_POLL_S)
            if wait and not have:
                raise StoreError(f"the producer slots lock {path} was not had within "
                                 f"{LOCK_TIMEOUT_S} s")
            yield have
        finally:
            os.close(fd)  # releases the lock
