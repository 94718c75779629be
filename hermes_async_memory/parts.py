"""The pipeline's parts, put together for the process's role, and taken apart at close.

    role       writer sources        writer sink    recaller         role-only parts
    embedded   outbox                store          LocalRecaller    -
    producer   outbox (own slot)     ForwardSink    RemoteRecaller   ResultsPoller
    worker     outbox, inbox         store          LocalRecaller    RecallServer, slot hand-in

That table is the only place the role matters.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import sqlite3
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import structlog

from .errors import PipelineClosedError, PipelineFailedError, StoreError, describe
from .maintenance import Maintenance
from .outbox import Outbox, Recovery
from .outbox.destroyed import report_destroyed
from .recall.query import query_terms
from .recall.service import LocalRecaller, RecallService
from .replicator import Replicator
from .retry import Backoff
from .settings import Settings
from .shared.inbox import InboxSource, lease_owner
from .shared.recall import RecallServer, RemoteRecaller, ResultsPoller
from .shared.slots import ProducerSlots
from .sinks import ForwardSink, StoreSink
from .slices import CHUNK, maybe_yield
from .sources import OutboxSource
from .stats import PipelineStats, percentile
from .supervisor import DISK_FULL, FULL_TEXT_UNAVAILABLE, Supervisor
from .turns import Turn, scope_token_for
from .writer import Source, Writer

if TYPE_CHECKING:
    from .pipeline import MemoryPipeline
    from .store import SqliteStore

log = structlog.get_logger(__name__)

# Recall requests from producers a worker serves at once (each may wait out its barrier).
RECALL_SERVER_CONCURRENCY = 16
WARM_WORKERS = 2
# Of a shutdown's deadline, what is kept back for stopping the parts and closing the files.
CLOSE_RESERVE_S = 0.08


@dataclass
class Parts:
    """Everything ``start()`` built; the pipeline's calls reach the parts through this."""

    pipeline: MemoryPipeline
    outbox: Outbox
    recovery: Recovery
    writer: Writer
    recall: RecallService
    local: LocalRecaller
    maintenance: Maintenance
    supervisor: Supervisor
    inbox: InboxSource | None = None
    replicator: Replicator | None = None
    server: RecallServer | None = None
    slots: ProducerSlots | None = None
    slot: int | None = None
    counts: dict[str, int] = field(default_factory=dict)

    async def committed(self, turns: Sequence[Turn], source: Source) -> None:
        """After each commit: the cache's recent turns, the meters, the replicator."""
        p = self.pipeline
        now = p.clock()
        wall = time.time()
        note = p.cache.note_commits
        lat = p.meter.latencies_s
        rows = 0
        for i in range(0, len(turns), CHUNK):
            if i:
                await maybe_yield()
            chunk = turns[i : i + CHUNK]
            note(chunk, now)
            lat.extend([wall - t.accepted_at for t in chunk])
            rows += sum([t.n_messages for t in chunk])
        p.meter.record_batch(now, len(turns), rows)
        self.maintenance.rows_since_vocab += rows
        if self.replicator is not None:
            self.replicator.wake([t.key for t in turns])
        p.changed()
        if self.outbox.needs_spare():
            self.maintenance.poke()

    async def search(self, query: str, user_id: str | None, session_id: str | None,
                     limit: int | None) -> str:
        s = self.pipeline.settings
        store = self.pipeline.store
        terms = query_terms(query, store.frequent_terms, s.recall_max_terms,
                            stems=store.word_index_stems)
        scope = scope_token_for(user_id, session_id)
        return await self.local.search(terms, scope, limit or s.recall_limit)

    async def shut_down(self, runner: asyncio.Task[None], deadline_s: float, *,
                        drain: bool) -> None:
        """Drain what was accepted (unless ``drain`` is False: a failed pipeline), stop the
        parts and close the files, all within ``deadline_s``.

        The interpreter's automatic collection is held off meanwhile: a full collection of a
        large process stops the loop for 0.15 s and more (seen in the test suite's process),
        and the deadline is kept by the loop's timers. What the window leaves to collect is
        collected after it."""
        with _collection_held():
            await self._shut_down(runner, deadline_s, drain=drain)

    async def _shut_down(self, runner: asyncio.Task[None], deadline_s: float, *,
                         drain: bool) -> None:
        started = time.perf_counter()
        barrier = self.pipeline.barrier
        target = self.outbox.accepted()
        drain_s = max(0.0, deadline_s - CLOSE_RESERVE_S)
        if drain and drain_s > 0:
            self.writer.hurry()
            with anyio.move_on_after(drain_s):
                try:
                    await barrier.wait(target)
                except PipelineFailedError:
                    pass  # reported already; close what is there
        left = max(0.05, deadline_s - (time.perf_counter() - started))
        await self.stop(runner, left / 2)
        barrier.fail(PipelineClosedError("the pipeline closed before the flush"))
        await self.close(max(0.02, deadline_s - (time.perf_counter() - started)))
        log.info("pipeline_closed", committed=barrier.settled,
                 left_in_outbox=target - barrier.settled,
                 duration_ms=round((time.perf_counter() - started) * 1000, 2))

    async def stop(self, runner: asyncio.Task[None], timeout_s: float) -> None:
        """Let the writer finish the statement it is in, then cancel every part."""
        self.writer.stop()
        with anyio.move_on_after(timeout_s):
            await self.writer.stopped.wait()
        runner.cancel()
        await asyncio.wait({runner}, timeout=max(0.01, timeout_s / 2))
        if runner.done() and not runner.cancelled() and runner.exception() is not None:
            exc = runner.exception()
            assert exc is not None
            log.error("pipeline_parts_ended_with_error", error=describe(exc), exc_info=exc)

    async def close(self, timeout_s: float) -> None:
        """Close the backend, the store and the outbox, within ``timeout_s`` in all."""
        deadline = time.perf_counter() + timeout_s
        p = self.pipeline
        with anyio.move_on_after(timeout_s / 3):
            try:
                await p.backend.aclose()
            except Exception as exc:  # closing goes on: the store and outbox still close
                log.warning("backend_close_failed", error=describe(exc), exc_info=exc)
        await p.store.aclose(max(0.01, (deadline - time.perf_counter()) * 2 / 3))
        # A close the deadline abandons finishes on its thread, holding the lock until then;
        # a new pipeline on the same store in this process waits for it (Outbox.closing).
        self.outbox.closing()
        with anyio.move_on_after(max(0.01, deadline - time.perf_counter())) as scope:
            await anyio.to_thread.run_sync(self.outbox.close, abandon_on_cancel=True)
        if scope.cancelled_caught:
            log.warning("outbox_close_abandoned", outbox=str(self.outbox.directory))


_held_lock = threading.Lock()
_held = [0, False]  # shutdowns holding the collector off; whether it was on before the first


@contextlib.contextmanager
def _collection_held() -> Iterator[None]:
    """Hold the interpreter's automatic collection off (``Parts.shut_down``); the last of
    several shutdowns at once (pipelines on other loops) puts it back as it was."""
    with _held_lock:
        if _held[0] == 0:
            _held[1] = gc.isenabled()
            gc.disable()
        _held[0] += 1
    try:
        yield
    finally:
        with _held_lock:
            _held[0] -= 1
            if _held[0] == 0 and _held[1]:
                gc.enable()


async def build_parts(p: MemoryPipeline, key_prefix: str, backoff: Backoff,
                      on_failure: Callable[[PipelineFailedError], None]) -> Parts:
    """Open the store and the outbox and build the parts for ``p``'s role.

    Raises:
        StoreError: the store or the outbox cannot be used.
    """
    s, store = p.settings, p.store
    role = s.role
    # The full-text indexes are turned off only by the process that commits, once it holds
    # the outbox's lock: a start that fails on it, or a producer, never does.
    await store.open(commits=False)
    outbox: Outbox | None = None
    try:
        first_segment = await store.next_segment()
        slots = slot = None
        # The store's one writing connection: one multi-call transaction on it at a time.
        transactions = asyncio.Lock()
        if role == "producer":
            slots = ProducerSlots(s, ForwardSink(store, transactions), backoff)
            outbox, recovery, slot = await slots.open_own(first_segment)
        else:
            outbox = _outbox(s)
            recovery = await anyio.to_thread.run_sync(outbox.open, first_segment)
            # This process commits: it gives message ids as records are accepted, above
            # every id the store holds or an earlier run gave to a record still pending, and
            # to the pending records that came without, in their order, before any new one.
            highest, lowest, missing = await anyio.to_thread.run_sync(outbox.recovered_ids)
            store.ids.start_after(highest)
            if lowest is not None:
                store.ids.protect(lowest)
            for key, n in missing:
                store.ids.reserve(key, n)
            outbox.give_ids(store.ids)
            store.ids.oldest_pending = outbox.oldest_pending_first_id
            await store.settle_text_indexes()
        if not store.full_text:
            p.conditions.set(FULL_TEXT_UNAVAILABLE,
                             f"{store.path} keeps no full-text index (no FTS5 module in this "
                             "SQLite, or in the committing process's): searches fail and "
                             "recalls find nothing; writes go on, and the next process with "
                             "FTS5 to commit the store rebuilds the indexes")
        if not outbox.accepting():
            # Started all the same, so the writer drains what is pending (that frees room):
            # appends are refused, typed, until maintenance makes a segment.
            p.conditions.set(DISK_FULL, f"no space left for an outbox segment in "
                                        f"{outbox.directory}")
        await report_destroyed(outbox, store, p.conditions)
        plan = outbox.prefault_plan()
        if plan:
            await anyio.to_thread.run_sync(Outbox.prefault, plan)
        await p.backend.startup()
    except BaseException:
        if outbox is not None:
            outbox.close()
        await store.aclose()
        raise
    commits = role != "producer"
    local = LocalRecaller(store, p.backend, limit=s.recall_limit,
                          max_terms=s.recall_max_terms,
                          chars_per_hit=s.recall_chars_per_hit, observer=p.observer,
                          procedural=s.procedural_context if s.tool_log else None,
                          fence=p.fence)
    remote = RemoteRecaller(store, s.max_pending_recalls) if role == "producer" else None
    jobs = None
    if remote is None and s.postgres_recall_jobs and s.backend == "postgres":
        # Recalls as shared jobs that worker processes answer (postgres.recall_jobs).
        from .postgres.recall_jobs import JobRecaller

        jobs = JobRecaller(s, p.cache, local, changed=p.changed,
                           max_pending=s.max_pending_recalls, store=store,
                           procedural=s.procedural_context if s.tool_log else None,
                           clock=p.clock)
    source = OutboxSource(outbox, p.barrier)
    if commits and store.tool_log is not None:
        source.tool_log = store.tool_log
    inbox = (InboxSource(store, lease_owner(key_prefix), s.lease_s, p.clock)
             if role == "worker" else None)
    sources: list[Source] = [source] if inbox is None else [source, inbox]
    sink = StoreSink(store, transactions) if commits else ForwardSink(store, transactions)
    recall = RecallService(
        recaller=remote or jobs or local, cache=p.cache, barrier=p.barrier, store=store,
        target=outbox.accepted, max_pending=s.max_pending_recalls,
        max_warms=s.max_pending_warms, recent_turns=s.recent_turns, clock=p.clock,
        changed=p.changed,
    )
    adopt = None
    if role == "worker":
        worker_slots = ProducerSlots(s, ForwardSink(store, transactions), backoff)
        adopt = lambda: worker_slots.adopt_free(first_segment)  # noqa: E731
    maintenance = Maintenance(s, store, outbox, conditions=p.conditions, commits=commits,
                              adopt=adopt, clock=p.clock, on_round=p.changed)
    if commits:
        try:
            await maintenance.refresh_vocab()
            await maintenance.fit_wal()  # before the first commit: a small disk fills in a second
        except BaseException as exc:
            # Nothing may outlive a failed start: the store's threads would keep the process
            # alive. A damaged page read here is CorruptStoreError already (the store's reader).
            with anyio.CancelScope(shield=True):
                try:
                    await p.backend.aclose()  # started above
                except Exception as close_exc:  # the error that stopped the start is raised
                    log.warning("backend_close_failed", error=describe(close_exc))
                outbox.close()
                await store.aclose()
            if isinstance(exc, sqlite3.Error):
                raise StoreError(f"cannot start on the store {s.db_path}: {exc}") from exc
            raise
    supervisor = Supervisor(backoff=backoff, conditions=p.conditions, on_failure=on_failure,
                            clock=p.clock)
    writer = Writer(sources, sink, max_batch=s.max_batch, max_batch_bytes=s.max_batch_bytes,
                    max_wait_s=s.max_wait_ms / 1000, backoff=backoff, conditions=p.conditions,
                    observer=p.observer, clock=p.clock,
                    chore=_reindexing(store, p.changed) if commits and store.reindex else None,
                    settled=p.changed)
    writer.set_poll_interval(s.shared_poll_ms / 1000)
    parts = Parts(p, outbox, recovery, writer, recall, local, maintenance, supervisor,
                  inbox=inbox, slots=slots, slot=slot)
    writer.add_listener(parts.committed)
    supervisor.add("writer", writer.run)
    for i in range(s.recall_workers):
        supervisor.add(f"recaller-{i}", recall.run_recaller)
    for i in range(WARM_WORKERS):
        supervisor.add(f"warmer-{i}", recall.run_warmer)
    supervisor.add("maintenance", maintenance.run)
    if store.replica is not None:
        parts.replicator = Replicator(store, p.backend, max_attempts=s.replica_max_attempts,
                                      backoff=backoff, on_progress=p.changed,
                                      conditions=p.conditions)
        supervisor.add("replicator", parts.replicator.run)
    if commits and p.backend.watches:
        # Other machines' writes refresh this one's prefetch blocks (a shared store).
        backend = p.backend
        supervisor.add("backend_watch", lambda: backend.watch(recall.refresh))
    if role == "worker":
        parts.server = RecallServer(store, local, poll_s=s.shared_poll_ms / 1000,
                                    concurrency=RECALL_SERVER_CONCURRENCY)
        supervisor.add("recall_server", parts.server.run)
    if jobs is not None:
        supervisor.add("recall_jobs", jobs.run)
    if remote is not None:
        poller = ResultsPoller(store, p.cache, remote, s.shared_poll_ms / 1000)
        await poller.start()
        supervisor.add("recall_results", poller.run)
    return parts


def _outbox(s: Settings) -> Outbox:
    return Outbox(s.outbox_dir, segment_bytes=s.outbox_segment_bytes,
                  max_pending_turns=s.max_queued_turns, max_pending_bytes=s.max_queued_bytes,
                  overflow=s.overflow)


def _reindexing(store: SqliteStore, changed: Callable[[], None]
                ) -> Callable[[], Awaitable[bool]]:
    """The writer's chore while the word index is rebuilt: a slice, then the news (stats()
    shows the progress; a wait on it wakes)."""
    async def chore() -> bool:
        left = await store.reindex_chore()
        changed()
        return left
    return chore


def collect_stats(p: MemoryPipeline, parts: Parts | None) -> PipelineStats:
    """A ``PipelineStats`` snapshot of ``p``."""
    now = p.clock()
    batches_s, rows_s = p.meter.rates(now)
    lat = list(p.meter.latencies_s)
    health = p.health()
    common = {
        "committed_turns": p.meter.turns, "batches_committed": p.meter.batches,
        "rows_committed": p.meter.rows, "batches_per_s": batches_s, "rows_per_s": rows_s,
        "recall_hits": p.cache.hits, "recall_misses": p.cache.misses,
        "write_to_recallable_p50_ms": percentile(lat, 0.50) * 1000,
        "write_to_recallable_p99_ms": percentile(lat, 0.99) * 1000,
        "sanitized_turns": p.sanitized, "state": health.state,
        "failure": None if p.failure is None else str(p.failure),
        "conditions": tuple(sorted(health.conditions)), "cache_entries": len(p.cache),
        "flush_waiters": p.barrier.waiting, "role": p.settings.role,
        "tool_judge_errors": 0 if p.store.tool_log is None else p.store.tool_log.errors.count,
    }
    if parts is None:
        return PipelineStats(
            accepted_turns=0, queued_turns=0, queued_bytes=0, deferred_turns=0,
            oldest_pending_age_s=0.0, recalls_run=0, recalls_shared=0, recalls_shed=0,
            recall_errors=0, commit_retries=0, dead_letters=0, outbox_segments=0,
            **common)  # type: ignore[arg-type]
    c = parts.outbox.counts()
    oldest = parts.outbox.oldest_pending_accepted_at() if c.pending_turns else None
    w, r, rec = parts.writer, parts.recall, parts.recovery
    inbox_n, inbox_oldest = parts.maintenance.inbox_counts
    replica = parts.replicator
    waiting = replica is not None and not replica.idle
    replica_oldest = parts.maintenance.replica_oldest if waiting else None
    reindex = p.store.reindex
    return PipelineStats(
        accepted_turns=parts.outbox.accepted(), queued_turns=c.unread_turns,
        queued_bytes=c.pending_bytes,
        deferred_turns=max(0, c.pending_turns - p.settings.max_queued_turns),
        oldest_pending_age_s=0.0 if oldest is None else max(0.0, time.time() - oldest),
        recalls_run=parts.local.runs, recalls_shared=parts.local.shared,
        recalls_shed=r.recalls_shed, recall_errors=r.recall_errors,
        commit_retries=w.retries, dead_letters=w.dead_letters,
        outbox_segments=c.segments, part_restarts=sum(parts.supervisor.restarts.values()),
        pending_turns=c.pending_turns, recovered_turns=rec.records,
        pending_recalls=r.pending,
        recalls_in_flight=parts.local.in_flight + (0 if parts.server is None
                                                   else parts.server.waiting),
        warm_backlog=r.warm_backlog, warms_shed=r.warms_shed,
        sessions_warmed=r.sessions_warmed, quarantined_regions=c.quarantined_regions,
        quarantined_bytes=c.quarantined_bytes, destroyed_turns=c.destroyed_turns,
        heap_trims=parts.maintenance.heap_trims,
        inbox_turns=inbox_n,
        inbox_oldest_age_s=(0.0 if inbox_oldest is None
                            else max(0.0, time.time() - inbox_oldest)),
        inbox_committed_turns=0 if parts.inbox is None else parts.inbox.committed,
        leases_lost=w.leases_lost,
        recalls_served=0 if parts.server is None else parts.server.served,
        replicated_turns=0 if replica is None else replica.replicated,
        replica_pending=parts.maintenance.replica_counts[0] if waiting else 0,
        replica_errors=0 if replica is None else replica.errors,
        replica_dead=parts.maintenance.replica_counts[1],
        replica_lag_s=(0.0 if replica_oldest is None
                       else max(0.0, time.time() - replica_oldest)),
        replica_available=p.backend.available(),
        stale_blocks=p.cache.stale_blocks(),
        refreshes_queued=r.refreshes_queued,
        reindex_done=0 if reindex is None else reindex.indexed,
        reindex_total=0 if reindex is None else reindex.total,
        **common,  # type: ignore[arg-type]
    )
