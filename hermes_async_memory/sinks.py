"""Where the writer's batches go: the store (commit), or a worker (a producer forwards).

Only a store sink commits and dead-letters into the store. A producer's sink hands its
batches, and the records it could not write, to the shared inbox: the worker commits the
one and dead-letters the other under its lease, so nothing goes around the worker.

Both kinds write a transaction of several calls on the store's one writing connection, and
a worker has both at once (its writer commits, its maintainer hands in the slots of gone
producers). They take turns through one lock per store, ``transactions``: two transactions
interleaved on one connection are one transaction, committed by whichever ends first.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import cast

from .message_ids import MessageIds
from .slices import CHUNK, committing, maybe_yield, runs
from .sources import judge_all
from .store import Batch, SqliteStore
from .store.tool_log import ToolLogConfig
from .turns import Turn
from .writer import Unreadable


async def build_batch(turns: Sequence[Turn], source: str, ids: MessageIds | None = None,
                      tool_log: ToolLogConfig | None = None) -> Batch:
    """A batch's parameters, built a chunk at a time so the loop keeps running; with a
    ``tool_log``, its tool answers the read-ahead did not judge are judged first."""
    if tool_log is not None:
        items: list[Turn | Unreadable] = list(turns)
        await judge_all(items, tool_log)
        turns = cast("list[Turn]", items)  # judge_all keeps each item's kind
    batch = Batch(source, ids)
    for step, (a, b) in enumerate(runs([t.nbytes for t in turns])):
        if step:
            await maybe_yield()
        batch.add(turns[a:b])
    for _ in batch.seal(CHUNK):
        await maybe_yield()
    return batch


class StoreSink:
    """Commits batches into the SQLite store, one transaction each."""

    name = "committed"

    def __init__(self, store: SqliteStore, transactions: asyncio.Lock | None = None) -> None:
        self._store = store
        self._transactions = transactions or asyncio.Lock()

    async def commit(self, turns: Sequence[Turn], lease_owner: str | None) -> int:
        batch = await build_batch(turns, self._store.source, self._store.ids,
                                  self._store.tool_log)
        if lease_owner is not None:  # inbox turns: they leave the inbox in the same transaction
            batch.inbox_ids = [t.seq for t in turns]
            batch.lease_owner = lease_owner
        async with self._transactions:
            # Only now is the store's thread at work: the loop's naps (slices) start here,
            # not while the batch above is built on the loop itself.
            with committing():
                await self._store.commit_batch(batch)
        return batch.n_messages

    async def held(self, keys: Sequence[str]) -> set[str]:
        return await self._store.done_keys(keys)

    async def dead_letter(self, item: Turn | Unreadable, reason: str,
                          lease_owner: str | None) -> None:
        if isinstance(item, Unreadable):
            turn, payload = Turn.stub(item.key, item.session_id, seq=item.seq), item.payload
        else:
            turn, payload = item, item.payload.encode("latin-1")
        await self._store.dead_letter(turn, reason, 1, payload)


class ForwardSink:
    """A producer's sink: batches into the shared inbox, in accept order."""

    name = "forwarded"

    def __init__(self, store: SqliteStore, transactions: asyncio.Lock | None = None) -> None:
        self._store = store
        self._transactions = transactions or asyncio.Lock()

    async def commit(self, turns: Sequence[Turn], lease_owner: str | None) -> int:
        # The records as they are: the worker builds the batch it commits.
        async with self._transactions:
            with committing():
                await self._store.forward_batch(turns)
        return sum(t.n_messages for t in turns)

    async def held(self, keys: Sequence[str]) -> set[str]:
        return await self._store.done_keys(keys, waiting=True)

    async def dead_letter(self, item: Turn | Unreadable, reason: str,
                          lease_owner: str | None) -> None:
        if isinstance(item, Unreadable):
            row = (item.key, item.session_id, 0.0, item.payload.decode("latin-1"), reason)
        else:
            row = (item.key, item.session_id, item.accepted_at, item.payload, reason)
        await self._store.forward_refused([row])
