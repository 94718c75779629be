"""Several pipelines on one store file: producers hand turns to the inbox, a worker commits
them under leases and serves the producers' recalls.

Invariants checked on every turn: each accepted turn is stored exactly once, and each
session's turns are stored in the order they were accepted.
"""

from __future__ import annotations

import os
import socket
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import anyio
import pytest

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.errors import LeaseLostError
from hermes_async_memory.maintenance import RESULTS_KEPT_S, Maintenance
from hermes_async_memory.message_rows import turn_messages
from hermes_async_memory.outbox import Outbox
from hermes_async_memory.parts import RECALL_SERVER_CONCURRENCY
from hermes_async_memory.store import Batch, SqliteStore
from hermes_async_memory.supervisor import Conditions
from hermes_async_memory.turns import Turn, encode_payload

from .helpers import count_rows, stored_turns
from .test_writer import _leave_in_outbox
from .test_writer import _turn as _record

WAIT_S = 30.0  # generous for a busy CI machine; nothing waits this long when things work


async def eventually(mem: MemoryPipeline, check: Callable[[], bool], what: str) -> None:
    """Wait for ``check`` on ``mem``'s state: it wakes its waiters after each change."""
    try:
        await mem.wait_until(check, timeout=WAIT_S)
    except TimeoutError:
        raise AssertionError(f"not within {WAIT_S} s: {what}") from None


class FakeWallClock:
    """The store's wall clock, moved by the test: leases expire when it says so."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def shared(db: Path, role: str, **extra: object) -> Settings:
    return Settings(db_path=db, role=role, shared_poll_ms=5.0, **extra)  # type: ignore[arg-type]


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "memory.db"


@pytest.fixture
async def worker(db: Path) -> AsyncIterator[MemoryPipeline]:
    async with MemoryPipeline(shared(db, "worker")) as mem:
        yield mem


async def test_three_producers_one_worker_store_every_turn_once_in_order(
    db: Path, worker: MemoryPipeline
) -> None:
    accepted: dict[str, list[str]] = {}
    async with AsyncExitStack() as stack:
        producers = [
            await stack.enter_async_context(MemoryPipeline(shared(db, "producer")))
            for _ in range(3)
        ]
        # Each producer has its own outbox slot beside the store.
        assert len({p.outbox_dir for p in producers}) == 3
        for i in range(600):
            p = producers[i % 3]
            sid = f"s{i % 3}-{i % 20}"
            receipt = p.sync_turn(f"question {i}", f"answer {i}", session_id=sid,
                                  user_id=f"u{i % 7}")
            accepted.setdefault(sid, []).append(receipt.key)
        for p in producers:
            await p.flush(timeout=WAIT_S)  # handed to the shared inbox
        await eventually(worker, lambda: worker.stats().inbox_committed_turns == 600,
                         "the worker committed every handed-in turn")
    stored = stored_turns(db)
    assert set(stored) == set(accepted)
    for sid, keys in accepted.items():
        user_rows = [k for k, role, _ in stored[sid] if role == "user"]
        assert user_rows == keys, f"session {sid}: stored once each, in accept order"
    assert count_rows(db, "SELECT count(*) FROM inbox") == 0
    assert count_rows(db, "SELECT count(*) FROM sessions") == len(accepted)


async def test_a_producer_reads_the_recall_the_worker_ran(db: Path, worker: MemoryPipeline
                                                          ) -> None:
    async with MemoryPipeline(shared(db, "producer")) as producer:
        producer.sync_turn("my invoice number is INV-4471", "noted",
                           session_id="s1", user_id="alice")
        producer.sync_turn("the staging password rotates on fridays", "ok",
                           session_id="s2", user_id="bob")
        producer.queue_prefetch("which invoice did I mention", session_id="s1-next",
                                user_id="alice")
        await eventually(producer, lambda: "INV-4471" in producer.prefetch(
            "", session_id="s1-next", user_id="alice"),
            "the worker's recall reached the producer's cache")
        block = producer.prefetch("", session_id="s1-next", user_id="alice")
        assert "fridays" not in block, "alice's recall must not hold bob's text"
    assert count_rows(db, "SELECT count(*) FROM recall_requests") == 0


async def test_two_users_of_one_session_id_each_get_their_own_recall_across_processes(
    db: Path, worker: MemoryPipeline
) -> None:
    """"default" is a common session id. Requests and results were keyed by session only:
    one user's request replaced the other's, and a result could land under either."""
    async with MemoryPipeline(shared(db, "producer")) as producer:
        producer.sync_turn("my locker code is 4471", "noted", session_id="old-a",
                           user_id="alice")
        producer.sync_turn("my bike is a green Brompton", "noted", session_id="old-b",
                           user_id="bob")
        await producer.flush(timeout=WAIT_S)
        producer.queue_prefetch("what is my locker code", session_id="default",
                                user_id="alice")
        producer.queue_prefetch("which bike do I ride", session_id="default", user_id="bob")
        await eventually(producer, lambda: (
            "4471" in producer.prefetch("", session_id="default", user_id="alice")
            and "Brompton" in producer.prefetch("", session_id="default", user_id="bob")),
            "both users' recalls reached the producer")
        assert "Brompton" not in producer.prefetch("", session_id="default", user_id="alice")
        assert "4471" not in producer.prefetch("", session_id="default", user_id="bob")


async def test_a_producer_sees_its_own_recent_turns_at_once(db: Path) -> None:
    async with MemoryPipeline(shared(db, "producer")) as producer:
        producer.sync_turn("remember the blue folder", "will do", session_id="s1")
        await producer.flush(timeout=WAIT_S)
        assert "blue folder" in producer.prefetch("", session_id="s1")


async def test_a_restarted_producer_hands_in_what_a_stopped_one_left_exactly_once(
    db: Path,
) -> None:
    keys = []
    first = MemoryPipeline(shared(db, "producer"))
    await first.start()
    for i in range(300):
        keys.append(first.sync_turn(f"q{i}", f"a{i}", session_id=f"s{i % 5}").key)
    await first.aclose(deadline_s=0)  # most of it stays in the producer's own outbox
    async with MemoryPipeline(shared(db, "producer")) as second:  # takes the same free slot
        await second.flush(timeout=WAIT_S)
    async with MemoryPipeline(shared(db, "worker")) as worker:
        # Before, this waited for the inbox to be empty, then read the worker's counter,
        # which a commit bumps only after it returns: 2 runs in 15 read 0. Wait on the
        # worker's own count instead.
        await eventually(worker, lambda: worker.stats().inbox_committed_turns == 300,
                         "the worker committed what the stopped producer left")
    assert count_rows(db, "SELECT count(*) FROM inbox") == 0
    stored = stored_turns(db)
    assert sorted(k for rows in stored.values() for k, role, _ in rows if role == "user") == \
        sorted(keys)


def _turn(key: str, session_id: str) -> Turn:
    return Turn.build(key=key, session_id=session_id, user_id=None, accepted_at=time.time(),
                      messages=turn_messages(f"q {key}", f"a {key}", None), metadata=None)


async def _handed_in(store: SqliteStore, turns: list[Turn]) -> None:
    await store.forward_batch(turns)


def _set_lease(db: Path, key: str, owner: str, until: float) -> None:
    conn = sqlite3.connect(db, isolation_level=None)
    try:
        conn.execute("UPDATE inbox SET lease_owner = ?, lease_until = ? WHERE key = ?",
                     (owner, until, key))
    finally:
        conn.close()


async def test_a_live_claim_holds_its_session_back_until_it_expires(db: Path) -> None:
    clock = FakeWallClock()
    store = SqliteStore(db, wall_clock=clock)
    await store.open()
    try:
        await _handed_in(store, [_turn("a1", "A"), _turn("a2", "A"), _turn("b1", "B")])
        # Another worker on this host, alive (our own pid), claimed a1 for 0.5 s.
        other = f"{socket.gethostname()}:{os.getpid()}:other"
        _set_lease(db, "a1", other, clock.now + 0.5)
        claimed = await store.claim_inbox("me", 30.0, 100)
        assert [key for _, key, *_ in claimed] == ["b1"], "a2 must wait behind a1"
        clock.now += 0.4
        assert [key for _, key, *_ in await store.claim_inbox("me", 30.0, 100)] == ["b1"]
        clock.now += 0.2  # the other claim expired
        claimed = await store.claim_inbox("me", 30.0, 100)
        assert [key for _, key, *_ in claimed] == ["a1", "a2", "b1"], "expired: ours, in order"
    finally:
        await store.aclose()


async def test_a_gone_workers_claims_are_taken_back_at_once(db: Path) -> None:
    done = await anyio.run_process([sys.executable, "-c", "import os; print(os.getpid())"])
    gone = f"{socket.gethostname()}:{int(done.stdout)}:killed"
    store = SqliteStore(db)
    await store.open()
    try:
        await _handed_in(store, [_turn("k1", "A"), _turn("k2", "A")])
    finally:
        await store.aclose()
    _set_lease(db, "k1", gone, time.time() + 3600)  # an hour-long lease of a dead process
    async with MemoryPipeline(shared(db, "worker")) as worker:
        await eventually(worker, lambda: worker.stats().inbox_committed_turns == 2,
                         "the dead worker's claim was taken back without waiting an hour")
    assert [k for k, role, _ in stored_turns(db)["A"] if role == "user"] == ["k1", "k2"]


async def test_a_batch_whose_lease_was_taken_over_is_not_committed(db: Path) -> None:
    store = SqliteStore(db)
    await store.open()
    try:
        turns = [_turn("x1", "S"), _turn("x2", "S")]
        await _handed_in(store, turns)
        claimed = await store.claim_inbox("me", 30.0, 100)
        _set_lease(db, "x2", "someone-else", time.time() + 30)
        batch = Batch.of([t._replace(seq=row[0]) for t, row in zip(turns, claimed, strict=True)],
                         "test", store.ids)
        batch.inbox_ids, batch.lease_owner = [row[0] for row in claimed], "me"
        with pytest.raises(LeaseLostError):
            await store.commit_batch(batch)
    finally:
        await store.aclose()
    assert count_rows(db) == 0, "nothing of the batch was stored"
    assert count_rows(db, "SELECT count(*) FROM inbox") == 2


async def test_handing_in_skips_turns_already_stored_or_waiting(db: Path) -> None:
    store = SqliteStore(db)
    await store.open()
    try:
        turns = [_turn("d1", "S"), _turn("d2", "S")]
        await _handed_in(store, turns)
        await _handed_in(store, turns)  # a producer replaying after a crash
        assert count_rows(db, "SELECT count(*) FROM inbox") == 2
        claimed = await store.claim_inbox("me", 30.0, 100)
        batch = Batch.of([t._replace(seq=row[0]) for t, row in zip(turns, claimed, strict=True)],
                         "test", store.ids)
        batch.inbox_ids, batch.lease_owner = [row[0] for row in claimed], "me"
        await store.commit_batch(batch)
        await _handed_in(store, turns)  # and again, after the worker stored them
        assert count_rows(db, "SELECT count(*) FROM inbox") == 0
    finally:
        await store.aclose()
    assert [k for k, role, _ in stored_turns(db)["S"] if role == "user"] == ["d1", "d2"]


async def test_an_unreadable_inbox_record_is_dead_lettered_and_the_rest_committed(
    db: Path,
) -> None:
    store = SqliteStore(db)
    await store.open()
    try:
        await _handed_in(store, [_turn("g1", "S")])
    finally:
        await store.aclose()
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute("INSERT INTO inbox (key, session_id, payload, accepted_at) "
                 "VALUES ('bad', 'S', 'not json {', 0)")
    conn.close()
    store = SqliteStore(db)
    await store.open()
    try:
        await _handed_in(store, [_turn("g2", "S")])
    finally:
        await store.aclose()
    async with MemoryPipeline(shared(db, "worker")) as worker:
        await eventually(worker, lambda: worker.stats().inbox_committed_turns == 2
                         and worker.stats().dead_letters == 1,
                         "the worker went past the bad record")
    assert count_rows(db, "SELECT count(*) FROM inbox") == 0
    assert [k for k, role, _ in stored_turns(db)["S"] if role == "user"] == ["g1", "g2"]
    assert count_rows(db, "SELECT count(*) FROM outbox WHERE status = 'dead'") == 1


async def test_a_turn_holding_nul_goes_through_the_inbox_and_is_stored(
    db: Path, worker: MemoryPipeline
) -> None:
    async with MemoryPipeline(shared(db, "producer")) as producer:
        key = producer.sync_turn("before\x00after", "ok", session_id="nul").key
        await producer.flush(timeout=WAIT_S)
    await eventually(worker, lambda: worker.stats().inbox_committed_turns == 1, "committed")
    assert worker.stats().dead_letters == 0
    assert [(k, c) for k, role, c in stored_turns(db)["nul"] if role == "user"] == \
        [(key, "before\x00after")]


async def test_turns_left_in_a_slot_nobody_restarts_into_are_handed_in(db: Path) -> None:
    first = MemoryPipeline(shared(db, "producer"))  # slot 0
    await first.start()
    # Slot 1: a producer whose writer hands in one turn at a time, stopped at once.
    stuck = MemoryPipeline(shared(db, "producer", max_batch=1, max_wait_ms=600_000))
    await stuck.start()
    keys = [stuck.sync_turn(f"q{i}", "a", session_id="left").key for i in range(20)]
    await stuck.aclose(deadline_s=0)
    await first.aclose()
    assert count_rows(db, "SELECT count(*) FROM inbox") < 20, "most stayed in slot 1"
    # A new producer takes the lowest free slot, 0, and hands in what slot 1 holds.
    async with MemoryPipeline(shared(db, "producer")) as later:
        assert later.outbox_dir == first.settings.producer_outbox_dir(0)
    assert count_rows(db, "SELECT count(*) FROM inbox") == 20
    async with MemoryPipeline(shared(db, "worker")) as w:
        await eventually(w, lambda: w.stats().inbox_committed_turns == 20, "committed")
    assert [k for k, role, _ in stored_turns(db)["left"] if role == "user"] == keys


async def test_a_producer_caches_only_its_own_sessions_recalls(
    db: Path, worker: MemoryPipeline
) -> None:
    async with MemoryPipeline(shared(db, "producer")) as mine, \
            MemoryPipeline(shared(db, "producer")) as other:
        mine.sync_turn("the invoice is INV-1", "ok", session_id="m1", user_id="u")
        await mine.flush(timeout=WAIT_S)
        await eventually(worker, lambda: worker.stats().inbox_committed_turns == 1,
                         "committed")
        mine.queue_prefetch("invoice", session_id="m2", user_id="u")
        await eventually(mine, lambda: "INV-1" in mine.prefetch("", session_id="m2",
                                                                user_id="u"), "recalled")
        other.queue_prefetch("something", session_id="o1", user_id="v")
        await eventually(other, lambda: other.prefetch_status(
            "o1", user_id="v").recall_query == "something", "the other got its answer")
        assert not other.prefetch_status("m2", user_id="u").cached, \
            "another gateway's session stays out of its cache"


async def test_old_done_keys_of_inbox_turns_are_pruned_and_recent_ones_kept(db: Path) -> None:
    store = SqliteStore(db)
    await store.open()
    try:
        turns = [_turn("old", "S"), _turn("new", "S")]
        await _handed_in(store, turns)
        claimed = await store.claim_inbox("me", 30.0, 100)
        batch = Batch.of([t._replace(seq=row[0]) for t, row in zip(turns, claimed, strict=True)],
                         "test", store.ids)
        batch.inbox_ids, batch.lease_owner = [row[0] for row in claimed], "me"
        await store.commit_batch(batch)
        conn = sqlite3.connect(db, isolation_level=None)
        conn.execute("UPDATE outbox SET updated_at = 0 WHERE key = 'old'")
        conn.close()
        assert await store.prune_inbox_keys(time.time() - 3600) == 1
    finally:
        await store.aclose()
    assert count_rows(db, "SELECT count(*) FROM outbox WHERE key = 'new'") == 1
    assert count_rows(db, "SELECT count(*) FROM messages") == 4, "messages are never pruned"


async def test_recall_requests_waiting_out_their_barrier_are_served_together_within_a_bound(
    db: Path,
) -> None:
    """A turn another worker holds under a live claim is a barrier no request passes until
    it gives up waiting (RECALL_BARRIER_S). Before, a worker served one request at a time:
    twenty such requests took twenty barrier waits."""
    store = SqliteStore(db)
    await store.open()
    try:
        await _handed_in(store, [_turn("held", "elsewhere")])
        _set_lease(db, "held", "another-host:1:w", time.time() + 3600)
        async with MemoryPipeline(shared(db, "worker")) as worker, \
                MemoryPipeline(shared(db, "producer")) as producer:
            for i in range(20):
                producer.queue_prefetch(f"question {i}", session_id=f"s{i}", user_id="u")
            await eventually(worker, lambda: worker.stats().recalls_served == 20,
                             "every request answered")
            server = worker._parts.server if worker._parts else None
            assert server is not None
            assert server.peak_in_flight == RECALL_SERVER_CONCURRENCY, "together, bounded"
            assert server.errors == 0
    finally:
        await store.aclose()


async def test_a_busy_store_while_requests_are_served_loses_none_of_them(
    db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Taking the next requests finds the store locked (past a statement's busy wait) while
    the ones taken before are still being served: it is retried, and those go on. Before,
    the recall server restarted, which cancelled them: taken, never answered."""
    real = SqliteStore.take_recall_requests
    calls = 0

    async def locked_after_the_first(self: SqliteStore, limit: int
                                     ) -> list[tuple[str, str | None, str, int]]:
        nonlocal calls
        calls += 1
        if 2 <= calls <= 4:
            raise sqlite3.OperationalError("database is locked")
        return await real(self, limit)

    store = SqliteStore(db)
    await store.open()
    try:
        # A turn under another worker's live claim: every request waits out its barrier,
        # so the first ones are still being served when the store is found locked.
        await _handed_in(store, [_turn("held", "elsewhere")])
        _set_lease(db, "held", "another-host:1:w", time.time() + 3600)
        async with MemoryPipeline(shared(db, "producer")) as producer:
            for i in range(5):
                producer.queue_prefetch(f"question {i}", session_id=f"s{i}", user_id="u")
            await producer.flush()
            monkeypatch.setattr(SqliteStore, "take_recall_requests", locked_after_the_first)
            async with MemoryPipeline(shared(db, "worker")) as worker:
                await eventually(worker, lambda: worker.stats().recalls_served == 5,
                                 "every request answered")
                assert calls > 4
                assert worker.stats().part_restarts == 0
    finally:
        await store.aclose()


async def test_a_worker_prunes_recall_results_no_producer_will_read(db: Path) -> None:
    """Results are read within milliseconds of being written; before, they were kept for
    ever, one row per session that ever asked."""
    clock = FakeWallClock()
    store = SqliteStore(db, wall_clock=clock)
    await store.open()
    outbox = Outbox(db.with_name("ob"), segment_bytes=1 << 20, max_pending_turns=10,
                    max_pending_bytes=1 << 20, overflow="defer")
    await anyio.to_thread.run_sync(outbox.open)
    try:
        await store.put_recall_result("old", "u", "q", "block")
        clock.now += RESULTS_KEPT_S + 1
        await store.put_recall_result("new", "u", "q", "block")
        maintenance = Maintenance(shared(db, "worker"), store, outbox,
                                  conditions=Conditions(), commits=True, wall_clock=clock)
        await maintenance.round()
        assert [r[0] for r in await store.recall_results_since(0)] == ["new"]
    finally:
        await anyio.to_thread.run_sync(outbox.close)
        await store.aclose()


async def test_a_record_a_producer_cannot_read_goes_to_the_worker_not_around_it(
    db: Path,
) -> None:
    """Only workers write the store. A record a producer cannot even read (nested too deep,
    left by an earlier run) is handed in with its reason; the worker dead-letters it under
    its lease, and the records around it commit. Before, a producer isolated such a record
    by writing the dead letter into the store itself."""
    deep = _record(7).decode().replace('"d":null', '"d":' + "[" * 5000 + "]" * 5000)
    _leave_in_outbox(shared(db, "producer").producer_outbox_dir(0),
                     [_record(i) if i != 7 else deep.encode() for i in range(20)])
    async with MemoryPipeline(shared(db, "producer")) as producer:
        await producer.flush(timeout=WAIT_S)
    assert count_rows(db, "SELECT count(*) FROM messages") == 0
    assert count_rows(db, "SELECT count(*) FROM outbox") == 0, "the producer wrote no state"
    assert count_rows(db, "SELECT count(*) FROM inbox WHERE error IS NOT NULL") == 1
    async with MemoryPipeline(shared(db, "worker")) as worker:
        await eventually(worker, lambda: worker.stats().inbox_committed_turns == 19
                         and worker.stats().dead_letters == 1, "19 committed, 1 dead")
        dead = await worker.store.dead_letters()
    assert [d.key for d in dead] == ["k-7"] and "RecursionError" in dead[0].last_error
    assert count_rows(db, "SELECT count(*) FROM messages") == 19 * 2


def _leave_in_slot(settings: Settings, slot: int, n: int) -> list[str]:
    """A producer in ``slot`` that accepted ``n`` turns and died before handing them in."""
    outbox = Outbox(settings.producer_outbox_dir(slot), segment_bytes=1 << 20,
                    max_pending_turns=10**6, max_pending_bytes=2**40, overflow="defer")
    outbox.open()
    keys = []
    try:
        for i in range(n):
            key = f"gone{slot}-{i}"
            rows = turn_messages(f"left {key}", f"reply {key}", None)
            outbox.append(encode_payload(key, f"gone{slot}-{i % 7}", None, time.time(), rows,
                                         None).encode("ascii"), 2)
            keys.append(key)
    finally:
        outbox.close()
    return keys


async def test_a_worker_hands_in_gone_producers_slots_while_its_writer_commits(
    db: Path,
) -> None:
    """Invariant: every turn, the worker's own and those gone producers left, is stored
    exactly once, and the worker keeps working.

    Handing a slot in forwards its turns in a transaction on the writer's connection. It used
    to interleave with the writer's batch transactions there (executescript commits an open
    transaction first), and the worker failed: "cannot commit - no transaction is active".
    """
    settings = shared(db, "worker")
    left = [key for slot in (1, 2, 3) for key in _leave_in_slot(settings, slot, 2_000)]
    own = []
    async with MemoryPipeline(settings) as w:
        with anyio.fail_after(WAIT_S):
            i = 0
            # The writer commits the worker's own turns all along, while the maintainer
            # hands the slots in (its first round is a second after the start).
            while w.stats().inbox_committed_turns < len(left):
                for _ in range(300):
                    own.append(w.sync_turn(f"q{i}", f"a{i}", session_id=f"own{i % 11}").key)
                    i += 1
                await w.flush()
        assert w.state == "open", w.failure
    stored = stored_turns(db)
    keys = [k for rows in stored.values() for k, role, _ in rows if role == "user"]
    assert sorted(keys) == sorted(left + own)
