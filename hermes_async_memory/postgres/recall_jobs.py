"""Recalls as shared jobs: a gateway queues its recall, a worker process on any machine
answers it from PostgreSQL, and the gateway's prefetch cache takes the answer when its
NOTIFY comes (``Settings.postgres_recall_jobs``).

    gateway: JobRecaller.recall ──► jobs (kind "recall", one per (user, session): the
             latest query replaces a queued one) ──► NOTIFY hermes_jobs
    worker:  recall_handler ──► recall_block ──► recall_results + NOTIFY hermes_recalls
             + the job's completion, in one transaction
    gateway: the NOTIFY (its own origin) ──► the result row ──► RecallCache.set_recall

The gateway's ``recall()`` returns None (the answer arrives later), as a producer's
request does. While the database cannot be reached (the pool not open, the listener not
connected, an enqueue that fails) the gateway's local recall answers instead, marked a
fallback, so prefetch still answers. After its listener reconnects (notifications sent
meanwhile are lost) the gateway queues its unanswered requests again.

A result read before a delete of its session (or of its user's other session) is dropped
by the cache's epoch rule: the epoch is the one when the recall was asked.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from ..backends.base import RecallRequest
from ..errors import DatabaseError, describe
from ..procedural.api import ProceduralMemory
from ..procedural.context import session_block
from ..procedural.format import ContextSettings
from ..recall.cache import CacheKey, RecallCache
from ..recall.service import LocalRecaller, Recalled
from ..retry import Backoff
from ..settings import Settings
from ..store import SqliteStore
from .dsn import settings_dsn
from .jobs import Job, complete_in, enqueue
from .listen import Listener
from .pool import UnclassifiedErrors, close_pool, database_errors
from .recall import recall_block

if TYPE_CHECKING:
    from asyncpg import Pool, Record

log = structlog.get_logger(__name__)

RECALL_KIND = "recall"
RECALLS_CHANNEL = "hermes_recalls"  # its payload: {origin, user_id, session_id}
SOURCE = "postgres"
# Queuing a recall waits this long at most; past it the local recall answers.
ENQUEUE_TIMEOUT_S = 2.0
# Reading answers waits this long at most; past it they are read again after a backoff.
READ_TIMEOUT_S = 5.0
# After a failed enqueue, recalls go to the local store this long before trying again.
RETRY_AFTER_S = 5.0
# The gateway's own connections: queuing and reading answers, one at a time mostly.
POOL_MAX_SIZE = 2

UPSERT_RESULT = """
INSERT INTO recall_results (user_id, session_id, query, block, origin)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (user_id, session_id) DO UPDATE SET
    query = EXCLUDED.query, block = EXCLUDED.block, origin = EXCLUDED.origin,
    created_at = now()
"""
# A gateway takes its answers: read once, they go (the table holds only answers not yet
# taken, rather than a row for every session ever recalled).
READ_RESULTS = """
DELETE FROM recall_results r
USING unnest($1::text[], $2::text[]) AS k(user_id, session_id)
WHERE r.user_id = k.user_id AND r.session_id = k.session_id AND r.origin = $3
RETURNING r.user_id, r.session_id, r.query, r.block
"""


def recall_key(user_id: str | None, session_id: str) -> str:
    """The job key of a (user, session)'s recall: one job each, the latest query."""
    return "recall:" + json.dumps([user_id, session_id], separators=(",", ":"))


def recall_payload(user_id: str | None, session_id: str, query: str, origin: str) -> str:
    return json.dumps({"user_id": user_id, "session_id": session_id, "query": query,
                       "origin": origin}, separators=(",", ":"))


def recall_handler(settings: Settings) -> Callable[[Pool[Record], Job], Awaitable[None]]:
    """The worker's handler of recall jobs, with ``settings``' recall options (hits,
    terms, snippet length)."""

    async def handle(pool: Pool[Record], job: Job) -> None:
        asked = json.loads(job.payload)
        user_id: str | None = asked.get("user_id")
        session_id: str = asked["session_id"]
        query: str = asked["query"]
        origin = str(asked.get("origin", ""))
        block = await recall_block(
            pool, RecallRequest(query, session_id, user_id, settings.recall_limit), settings)
        notice = json.dumps({"origin": origin, "user_id": user_id, "session_id": session_id},
                            separators=(",", ":"))
        async with pool.acquire() as conn, conn.transaction():
            await conn.execute(UPSERT_RESULT, user_id or "", session_id, query, block, origin)
            await conn.execute("SELECT pg_notify($1, $2)", RECALLS_CHANNEL, notice)
            await complete_in(conn, job)  # a lost lease rolls the answer back

    return handle


@dataclass(frozen=True, slots=True)
class _Asked:
    query: str
    epoch: int  # the cache's deletes when it was asked (RecallCache.epoch)


class JobRecaller:
    """A gateway's recaller (``recall.service.Recaller``) whose recalls are shared jobs
    (module doc); ``run`` is its supervised part: the pool, the listener, the answers."""

    def __init__(self, settings: Settings, cache: RecallCache, local: LocalRecaller, *,
                 changed: Callable[[], None], max_pending: int,
                 store: SqliteStore | None = None, procedural: ContextSettings | None = None,
                 backoff: Backoff | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings
        self._dsn = settings_dsn(settings)
        self._cache = cache
        self._local = local
        self._changed = changed
        self._max_pending = max_pending
        # The procedural block appended to an answer, as the local recall appends it.
        self._procedural = ((ProceduralMemory(store), procedural)
                            if store is not None and procedural is not None else None)
        self._backoff = backoff or Backoff()
        self._clock = clock
        # Names this gateway's requests: the answers to other gateways' are not ours.
        self.origin = uuid.uuid4().hex[:16]
        self._pool: Pool[Record] | None = None
        self._listener: Listener | None = None
        self._retry_at = 0.0  # after a failed enqueue: the local recall answers until then
        # Asked and not answered yet, oldest first (the latest query of each).
        self.requested: OrderedDict[CacheKey, _Asked] = OrderedDict()
        self._arrived: set[CacheKey] = set()
        self._resend = False
        self._work = asyncio.Event()
        self.queued = 0
        self.answered = 0
        self.fallbacks = 0
        self._unclassified = UnclassifiedErrors()

    @property
    def ready(self) -> bool:
        """Whether recalls go to the workers now: connected, and listening for answers."""
        return (self._pool is not None and self._listener is not None
                and self._listener.connected and self._clock() >= self._retry_at)

    # -- asking (the recall service's workers) -------------------------------------------

    async def recall(self, query: str, user_id: str | None, session_id: str
                     ) -> Recalled | None:
        """Queue the recall and return None (the answer comes with its NOTIFY); the local
        recall's block, a fallback, while the database cannot be reached."""
        key = (user_id, session_id)
        pool = self._pool
        if pool is None or not self.ready:
            return await self._fallback(key, query)
        # Noted before the job is queued: the answer cannot come first.
        self.requested[key] = _Asked(query, self._cache.epoch())
        self.requested.move_to_end(key)
        while len(self.requested) > self._max_pending:
            self.requested.popitem(last=False)
        try:
            await self._enqueue(pool, key, query)
        except DatabaseError as exc:
            if self._clock() >= self._retry_at:
                log.warning("recall_job_queue_failed", session_id=session_id,
                            error=describe(exc), retry_in_s=RETRY_AFTER_S)
            self._retry_at = self._clock() + RETRY_AFTER_S
            return await self._fallback(key, query)
        self.queued += 1
        return None

    async def _enqueue(self, pool: Pool[Record], key: CacheKey, query: str) -> None:
        user_id, session_id = key
        async with database_errors(self._dsn, self._unclassified):
            with anyio.fail_after(ENQUEUE_TIMEOUT_S):
                await enqueue(pool, RECALL_KIND,
                              recall_payload(user_id, session_id, query, self.origin),
                              key=recall_key(user_id, session_id), replace=True)

    async def _fallback(self, key: CacheKey, query: str) -> Recalled:
        # A late answer to an earlier request must not replace this newer block.
        self.requested.pop(key, None)
        self.fallbacks += 1
        recalled = await self._local.recall(query, key[0], key[1])
        if recalled.source == "local" and not recalled.fallback:
            recalled = Recalled(recalled.block, recalled.source, True)
        return recalled

    # -- answers (the supervised part) ---------------------------------------------------

    async def run(self) -> None:
        """Open the pool, listen for answers and deliver them, until cancelled.

        Raises:
            DatabaseError: the database refused us for a reason waiting will not mend.
        """
        from .worker import open_when_reachable  # it imports this module

        s = self._settings
        pool = await open_when_reachable(
            s.replace(postgres_pool_min_size=min(s.postgres_pool_min_size, 1),
                      postgres_pool_max_size=POOL_MAX_SIZE),
            self._backoff, part="recall_jobs")
        listener = Listener(s, backoff=self._backoff)
        listener.subscribe(RECALLS_CHANNEL, self._on_answer)
        listener.on_connect(self._on_connect)
        self._pool, self._listener = pool, listener
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(listener.run, name="hermes-recall-jobs-listen")
                tg.start_soon(self._deliver, pool, name="hermes-recall-jobs-deliver")
        finally:
            self._pool = self._listener = None
            await close_pool(pool)

    def _on_answer(self, payload: str) -> None:
        try:
            notice = json.loads(payload)
            if notice.get("origin") != self.origin:
                return
            key = (notice.get("user_id"), str(notice["session_id"]))
        except (ValueError, TypeError, KeyError, AttributeError):
            log.warning("recall_job_notice_unreadable", size=len(payload))
            return
        if key in self.requested:
            self._arrived.add(key)
            self._work.set()

    def _on_connect(self) -> None:
        # Answers sent while it was away are lost: what is still asked is asked again.
        if self.requested:
            self._resend = True
            self._work.set()
        self._changed()  # recalls go to the workers from now on

    async def _deliver(self, pool: Pool[Record]) -> None:
        failures = 0
        while True:
            await self._work.wait()
            self._work.clear()
            resend, self._resend = self._resend, False
            keys, self._arrived = self._arrived, set()
            try:
                if resend:
                    await self._ask_again(pool)
                if keys:
                    await self._read(pool, keys)
            except DatabaseError as exc:  # read (and asked) again after a backoff
                self._resend = self._resend or resend
                self._arrived |= keys
                failures += 1
                delay = self._backoff.delay(failures)
                log.warning("recall_job_answers_failed", error=describe(exc),
                            retry_in_s=round(delay, 3))
                await anyio.sleep(delay)
                self._work.set()
                continue
            failures = 0

    async def _ask_again(self, pool: Pool[Record]) -> None:
        for key, asked in list(self.requested.items()):
            if self.requested.get(key) is asked:
                await self._enqueue(pool, key, asked.query)

    async def _read(self, pool: Pool[Record], keys: Iterable[CacheKey]) -> None:
        wanted = list(keys)
        async with database_errors(self._dsn, self._unclassified):
            with anyio.fail_after(READ_TIMEOUT_S):
                rows = await pool.fetch(READ_RESULTS, [u or "" for u, _ in wanted],
                                        [s for _, s in wanted], self.origin)
        for row in rows:
            await self._apply(row)
        self._changed()

    async def _apply(self, row: Any) -> None:
        key: CacheKey = (row["user_id"] or None, row["session_id"])
        asked = self.requested.get(key)
        if asked is None:
            return  # answered already, or answered locally since
        block = await self._with_procedural(row["block"], key)
        if self.requested.get(key) is not asked:
            return  # asked again (or answered locally) meanwhile: the newer one decides
        if row["query"] == asked.query:
            del self.requested[key]
        # An answer to an earlier query of the session (it was running when the latest
        # came) is shown until the latest one's comes, as a local recall's would be.
        self._cache.set_recall(key[0], key[1], row["query"], block, source=SOURCE,
                               epoch=asked.epoch)
        self.answered += 1

    async def _with_procedural(self, block: str, key: CacheKey) -> str:
        if self._procedural is None:
            return block
        memory, options = self._procedural
        try:
            extra = await session_block(memory, key[0], key[1], options)
        except Exception as exc:  # the answer stands without it
            log.warning("procedural_block_failed", session_id=key[1], error=describe(exc),
                        exc_info=exc)
            return block
        if not extra:
            return block
        return f"{block}\n\n{extra}" if block else extra
