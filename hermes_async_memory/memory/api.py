"""Key-value memory per user: the library's ``store``, ``retrieve``, ``query``, ``list_keys``
and ``delete`` (seed 000's ``MemoryBackend``), over the pipeline's durable path.

A write is a record in the outbox, like a turn: durable when ``store`` or ``delete`` returns
its receipt, committed by the writer in order within the user's lane, exactly once. A read
first waits for the user's lane to settle here (a per-user barrier: usually nothing to wait
for, else one commit), then lays over the store's answer what other processes handed in to
the shared inbox and no worker committed yet: every read sees every acknowledged write.

``KeyValueMemory`` is async, on the pipeline's loop; ``BlockingKeyValueMemory``
(``memory.blocking(timeout_s)``) is the same for any other thread.
"""

from __future__ import annotations

import json
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..blocking import run_blocking
from ..ops import KvOp, encode_delete, encode_put, lane_of, parse_record
from ..recall.query import query_terms, quote
from ..store import EntryRow
from ..turns import Receipt, scope_token_for
from .entries import (
    InvalidEntryError,
    MemoryEntry,
    check_entry_metadata,
    check_key,
    check_user,
    check_value,
)

if TYPE_CHECKING:
    from ..pipeline import MemoryPipeline

T = TypeVar("T")
MAX_QUERY_LIMIT = 100
QUERY_MAX_TERMS = 16
READ_TIMEOUT_S = 10.0  # a read waits at most this long for the user's lane to settle
_SHARED_ROLES = ("producer", "worker")


class KeyValueMemory:
    """One pipeline's key-value memory (the local store is the system of record)."""

    backend_name = "local (SQLite)"
    is_cloud = False
    stores = True  # (the null backend's is False)

    def __init__(self, pipeline: MemoryPipeline) -> None:
        self._p = pipeline

    @property
    def pipeline(self) -> MemoryPipeline:
        return self._p

    def is_available(self) -> bool:
        """Whether writes are accepted now (the pipeline is open). No I/O."""
        return self._p.state == "open"

    @property
    def location(self) -> str:
        """Where the entries live."""
        return str(self._p.settings.db_path)

    @property
    def key_required(self) -> bool:
        """Whether using it needs an API key."""
        return False

    # -- writes: durable on return, no I/O ----------------------------------------------

    def store_nowait(self, user_id: str, key: str, value: str,
                     metadata: Mapping[str, Any] | None = None) -> Receipt:
        """Set ``key`` of the user's memory to ``value``; an existing entry keeps its
        ``created_at``. Durable when this returns; any thread.

        Raises:
            InvalidEntryError: an argument cannot be stored (says which, and why).
            QueueFullError, DiskFullError, PipelineClosedError: as ``sync_turn``.
        """
        user, key, value = check_user(user_id), check_key(key), check_value(value)
        md = check_entry_metadata(metadata)
        record_key, at = self._p.new_key(), time.time()
        return self._accept(record_key, user, at, encode_put(record_key, user, at, key, value, md))

    def delete_nowait(self, user_id: str, key: str) -> Receipt:
        """Remove ``key`` from the user's memory (nothing happens when it is absent).
        Durable when this returns; any thread.

        Raises:
            InvalidEntryError, QueueFullError, DiskFullError, PipelineClosedError.
        """
        user, key = check_user(user_id), check_key(key)
        record_key, at = self._p.new_key(), time.time()
        return self._accept(record_key, user, at, encode_delete(record_key, user, at, key))

    async def store(self, user_id: str, key: str, value: str,
                    metadata: Mapping[str, Any] | None = None) -> Receipt:
        """``store_nowait``, as a coroutine."""
        return self.store_nowait(user_id, key, value, metadata)

    async def delete(self, user_id: str, key: str) -> Receipt:
        """``delete_nowait``, as a coroutine."""
        return self.delete_nowait(user_id, key)

    def _accept(self, record_key: str, user: str, at: float, payload: str) -> Receipt:
        data = payload.encode("ascii")
        limit = self._p.settings.max_turn_bytes
        if len(data) > limit:
            raise InvalidEntryError(f"the entry is {len(data)} bytes encoded; the limit "
                                    f"(max_turn_bytes) is {limit}")
        return self._p.accept_record(record_key, lane_of(user), at, data)

    # -- reads: the user's acknowledged writes included ---------------------------------

    async def retrieve(self, user_id: str, key: str) -> MemoryEntry | None:
        """The entry under ``key``, or None when the user has none.

        Raises:
            InvalidEntryError, PipelineClosedError, PipelineFailedError, FlushTimeoutError
            (the user's writes did not settle in time), StoreError.
        """
        user, key = check_user(user_id), check_key(key)
        pending = await self._pending(user)
        row = await self._p.store.memory_entry(user, key)
        entry = _entry(row)
        for op in pending:
            if op.key == key:
                entry = _apply(entry, op)
        return entry

    async def list_keys(self, user_id: str) -> list[str]:
        """The user's keys, most recently updated first."""
        user = check_user(user_id)
        pending = await self._pending(user)
        keys = await self._p.store.memory_keys(user)
        for op in pending:
            if op.key in keys:
                keys.remove(op.key)
            if op.action == "put":
                keys.insert(0, op.key)
        return keys

    async def query(self, user_id: str, text: str, limit: int = 10) -> list[MemoryEntry]:
        """Entries whose key or value hold words of ``text``, best match first. ``text`` is
        data: FTS5 operators in it are searched for as words.

        Raises:
            InvalidEntryError: ``text`` is not a string, or ``limit`` not 1 to 100.
            FullTextUnavailableError: the store keeps no full-text index (a SQLite without
                FTS5; ``retrieve`` and ``list_keys`` work).
        """
        user = check_user(user_id)
        if not isinstance(text, str):
            raise InvalidEntryError(f"query must be a string, got {type(text).__name__}")
        if isinstance(limit, bool) or not isinstance(limit, int) or not (
                1 <= limit <= MAX_QUERY_LIMIT):
            raise InvalidEntryError(f"limit must be an integer from 1 to {MAX_QUERY_LIMIT}, "
                                    f"got {limit!r:.20}")
        pending = await self._pending(user)
        terms = query_terms(text, frozenset(), QUERY_MAX_TERMS)
        if not terms:
            return []
        ors = " OR ".join(quote(t) for t in terms)
        match = f"scope:{quote(scope_token_for(user, None))} AND {{key value}}:({ors})"
        found = [e for e in (_entry(r) for r in
                             await self._p.store.memory_query(user, match, limit)) if e]
        if not pending:
            return found
        latest = await self._after(user, pending, {e.key: e for e in found})
        wanted = set(terms)
        fresh = [e for e in latest.values()
                 if e is not None and wanted & _words(e.key + " " + e.value)]
        fresh.sort(key=lambda e: -e.updated_at)
        return (fresh + [e for e in found if e.key not in latest])[:limit]

    async def find(self, user_id: str, needle: str, *, prefix: str = "") -> MemoryEntry | None:
        """The user's most recently updated entry whose key starts with ``prefix`` and whose
        value holds ``needle`` (plain, case-sensitive text), or None."""
        user = check_user(user_id)
        if not isinstance(needle, str) or not needle:
            raise InvalidEntryError("the text to find must be a non-empty string")
        pending = await self._pending(user)
        found = _entry(await self._p.store.memory_find(user, prefix, needle))
        latest = await self._after(user, [op for op in pending if op.key.startswith(prefix)],
                                   {found.key: found} if found is not None else {})
        fresh = [e for e in latest.values() if e is not None and needle in e.value]
        if fresh:
            return max(fresh, key=lambda e: e.updated_at)
        return None if found is None or found.key in latest else found

    async def _after(self, user: str, pending: Sequence[KvOp],
                     known: Mapping[str, MemoryEntry]) -> dict[str, MemoryEntry | None]:
        """Each key that ``pending`` writes, as it stands once they apply (None: deleted),
        starting from its committed entry (from ``known``, else read; so an update keeps
        its ``created_at``)."""
        latest: dict[str, MemoryEntry | None] = {}
        for op in pending:
            if op.key in latest:
                base = latest[op.key]
            else:
                base = known.get(op.key) or _entry(await self._p.store.memory_entry(user, op.key))
            latest[op.key] = _apply(base, op)
        return latest

    async def counts(self) -> tuple[int, int]:
        """(entries, users) committed in the store."""
        return await self._p.store.memory_counts()

    async def settled(self, user_id: str, timeout_s: float = READ_TIMEOUT_S) -> None:
        """Return once the user's writes acknowledged here are committed: what any reader
        of the store (another process too) sees from then on.

        Raises:
            FlushTimeoutError, PipelineFailedError, PipelineClosedError: as ``flush``.
        """
        await self._p.lane_committed(lane_of(check_user(user_id)), timeout_s)

    async def _pending(self, user: str) -> list[KvOp]:
        """Wait for the user's lane here; then the writes other processes handed in and no
        worker has committed yet, oldest first."""
        lane = lane_of(user)
        await self._p.flush_lane(lane, READ_TIMEOUT_S)
        if self._p.settings.role not in _SHARED_ROLES:
            return []
        ops = [parse_record(payload) for payload in await self._p.store.lane_records(lane)]
        return [op for op in ops if op is not None]

    def blocking(self, timeout_s: float = READ_TIMEOUT_S) -> BlockingKeyValueMemory:
        """The same operations for a thread other than the pipeline's loop."""
        return BlockingKeyValueMemory(self, timeout_s)


class BlockingKeyValueMemory:
    """``KeyValueMemory`` for any thread but the pipeline's loop thread: each read runs on
    the loop and is waited for up to ``timeout_s``; writes never wait."""

    def __init__(self, memory: KeyValueMemory, timeout_s: float) -> None:
        self._m = memory
        self._timeout_s = timeout_s
        self.backend_name = memory.backend_name
        self.is_cloud = memory.is_cloud
        self.is_available = memory.is_available
        self.store = memory.store_nowait
        self.delete = memory.delete_nowait

    def retrieve(self, user_id: str, key: str) -> MemoryEntry | None:
        return self._run(self._m.retrieve(user_id, key))

    def query(self, user_id: str, text: str, limit: int = 10) -> list[MemoryEntry]:
        return self._run(self._m.query(user_id, text, limit))

    def list_keys(self, user_id: str) -> list[str]:
        return self._run(self._m.list_keys(user_id))

    def counts(self) -> tuple[int, int]:
        return self._run(self._m.counts())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Raises TimeoutError past ``timeout_s`` (the read is cancelled)."""
        return run_blocking(self._m.pipeline, coro, self._timeout_s)

def _entry(row: EntryRow | None) -> MemoryEntry | None:
    if row is None:
        return None
    key, value, user, created, updated, md = row
    return MemoryEntry(key, value, user, created, updated, json.loads(md) if md else {})


def _apply(entry: MemoryEntry | None, op: KvOp) -> MemoryEntry | None:
    """``entry`` after the pending write ``op``."""
    if op.action == "del":
        return None
    created = entry.created_at if entry is not None else op.accepted_at
    return MemoryEntry(op.key, op.value, op.user_id, created, op.accepted_at,
                       dict(op.metadata or {}))


def _words(text: str) -> set[str]:
    return set(query_terms(text, frozenset(), 10_000))


__all__: Sequence[str] = ("BlockingKeyValueMemory", "KeyValueMemory")
