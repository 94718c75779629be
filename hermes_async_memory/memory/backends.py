"""The key-value memory's backends, with seed 000's identity (``backend_name``, ``is_cloud``,
``is_available()``), and the choice of one for a pipeline (``memory_for``).

- ``KeyValueMemory`` (``api``): the local SQLite store, the default.
- ``HonchoMemory``: the local store stays the system of record (``retrieve``, ``list_keys``
  and ``query`` answer from it); each write is also mirrored to Honcho as a message with
  typed metadata in the user's memory session, by the replicator, from the replica outbox
  the write's commit fills. Honcho cannot delete one message: ``delete`` still deletes the
  entry here, durably, then raises ``BackendLimitError`` saying so.
- ``NullMemory``: stores nothing, answers empty; the evaluation's baseline.

There is no process-wide backend: each pipeline has its own (``pipeline.memory``), chosen
from its settings.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Coroutine, Mapping
from typing import TYPE_CHECKING, Any, Literal, TypeVar, cast

from ..errors import HermesMemoryError
from ..ops import lane_of
from ..turns import Receipt
from .api import READ_TIMEOUT_S, KeyValueMemory
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
    from ..settings import KvBackendName

T = TypeVar("T")


class BackendLimitError(HermesMemoryError):
    """The backend cannot do this; ``done`` says what was done all the same (and
    ``receipt`` holds the local write's receipt, when there was one)."""

    def __init__(self, message: str, *, done: str, receipt: Receipt | None = None) -> None:
        super().__init__(message)
        self.done = done
        self.receipt = receipt


class HonchoMemory(KeyValueMemory):
    """Key-value memory in the local store, each write mirrored to Honcho."""

    backend_name = "honcho (cloud)"
    is_cloud = True

    def is_available(self) -> bool:
        """Whether writes are accepted now and Honcho may be tried (its circuit is not
        open). No network call."""
        return super().is_available() and self.pipeline.backend.available()

    @property
    def location(self) -> str:
        config = self.pipeline.settings.honcho
        where = f"{config.base_url} (workspace {config.workspace_id})" if config else "Honcho"
        return f"{where}, and {self.pipeline.settings.db_path}"

    @property
    def key_required(self) -> bool:
        config = self.pipeline.settings.honcho
        return bool(config and config.api_key)

    async def settled(self, user_id: str, timeout_s: float = READ_TIMEOUT_S) -> None:
        """Return once the user's acknowledged writes are committed here and Honcho has
        them (a write Honcho refused for good is a dead letter of the backend's, and does
        not hold this up).

        Raises:
            TimeoutError: Honcho did not get them within ``timeout_s``.
        """
        started = time.monotonic()
        await super().settled(user_id, timeout_s)
        p, lane = self.pipeline, lane_of(check_user(user_id))
        if p.store.replica is None:  # a producer: the worker's pipeline sends them
            return
        while True:
            mark = p.change_mark()  # before the read: a change during it is not missed
            if not await p.store.replica_waiting(p.store.replica, lane):
                return
            await p.next_change(max(0.0, timeout_s - (time.monotonic() - started)),
                                since=mark)

    def delete_nowait(self, user_id: str, key: str) -> Receipt:
        """Delete the entry from the local store (durable when this returns), then raise:
        Honcho keeps its messages.

        Raises:
            BackendLimitError: always, once the local delete is durable (``receipt``).
        """
        receipt = super().delete_nowait(user_id, key)
        raise BackendLimitError(
            f"Honcho cannot delete one message: the entry {key!r} was deleted from the local "
            "store (the system of record, which retrieve, list and query read), but the "
            "messages that mirrored it stay in Honcho, followed by one that marks it deleted",
            done="deleted locally", receipt=receipt)


class NullMemory:
    """Stores nothing and answers empty: memory switched off, and the evaluation's baseline.
    Arguments are still checked, so a call that would fail elsewhere fails here too."""

    backend_name = "null (disabled)"
    is_cloud = False
    key_required = False
    stores = False
    location = "nowhere (nothing is stored)"

    def __init__(self) -> None:
        self._keys = itertools.count(1)

    def is_available(self) -> bool:
        return True

    def store_nowait(self, user_id: str, key: str, value: str,
                     metadata: Mapping[str, Any] | None = None) -> Receipt:
        user = check_user(user_id)
        check_key(key), check_value(value), check_entry_metadata(metadata)
        return Receipt(f"null-{next(self._keys)}", lane_of(user), 0, time.time())

    def delete_nowait(self, user_id: str, key: str) -> Receipt:
        user = check_user(user_id)
        check_key(key)
        return Receipt(f"null-{next(self._keys)}", lane_of(user), 0, time.time())

    async def store(self, user_id: str, key: str, value: str,
                    metadata: Mapping[str, Any] | None = None) -> Receipt:
        return self.store_nowait(user_id, key, value, metadata)

    async def delete(self, user_id: str, key: str) -> Receipt:
        return self.delete_nowait(user_id, key)

    async def retrieve(self, user_id: str, key: str) -> MemoryEntry | None:
        check_user(user_id), check_key(key)
        return None

    async def list_keys(self, user_id: str) -> list[str]:
        check_user(user_id)
        return []

    async def query(self, user_id: str, text: str, limit: int = 10) -> list[MemoryEntry]:
        check_user(user_id)
        if not isinstance(text, str):
            raise InvalidEntryError(f"query must be a string, got {type(text).__name__}")
        return []

    async def find(self, user_id: str, needle: str, *, prefix: str = "") -> MemoryEntry | None:
        check_user(user_id)
        return None

    async def counts(self) -> tuple[int, int]:
        return (0, 0)

    async def settled(self, user_id: str, timeout_s: float = 0.0) -> None:
        """Nothing is ever pending."""
        check_user(user_id)

    def blocking(self, timeout_s: float = 0.0) -> BlockingNullMemory:
        return BlockingNullMemory(self)


class BlockingNullMemory:
    """``NullMemory`` for any thread: its coroutines never wait, so each runs to its end
    here (same checks, same answers)."""

    def __init__(self, memory: NullMemory) -> None:
        self._m = memory
        self.backend_name = memory.backend_name
        self.is_cloud = memory.is_cloud
        self.is_available = memory.is_available
        self.store = memory.store_nowait
        self.delete = memory.delete_nowait

    def retrieve(self, user_id: str, key: str) -> MemoryEntry | None:
        return _at_once(self._m.retrieve(user_id, key))

    def query(self, user_id: str, text: str, limit: int = 10) -> list[MemoryEntry]:
        return _at_once(self._m.query(user_id, text, limit))

    def list_keys(self, user_id: str) -> list[str]:
        return _at_once(self._m.list_keys(user_id))

    def counts(self) -> tuple[int, int]:
        return _at_once(self._m.counts())


def _at_once(coro: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never suspends."""
    try:
        coro.send(None)
    except StopIteration as done:
        return cast(T, done.value)
    coro.close()
    raise RuntimeError("a null-memory coroutine suspended")


Memory = KeyValueMemory | NullMemory


def kv_choice(kv_backend: KvBackendName, replica: str) -> Literal["local", "honcho", "null"]:
    """The key-value backend ``kv_backend`` names (``Settings.kv_backend``) beside the
    replica backend named ``replica``: "auto" is Honcho when that is Honcho, else the local
    store."""
    if kv_backend == "auto":
        return "honcho" if replica == "honcho" else "local"
    return kv_backend


def memory_for(pipeline: MemoryPipeline) -> Memory:
    """The key-value backend ``pipeline``'s settings choose (``kv_choice``)."""
    choice = kv_choice(pipeline.settings.kv_backend, pipeline.backend.name)
    if choice == "null":
        return NullMemory()
    if choice == "honcho":
        if pipeline.store.replica is not None:
            pipeline.store.replica_kv = True  # each write's commit queues it for Honcho
        return HonchoMemory(pipeline)
    return KeyValueMemory(pipeline)
