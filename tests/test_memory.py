"""Key-value memory per user: durable writes through the outbox, read-your-writes, ranked
search, isolation, and exactly-once in-order commits across SIGKILL."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.errors import FlushTimeoutError, InvalidTurnError, PipelineClosedError
from hermes_async_memory.memory import InvalidEntryError, MemoryEntry

from .test_outbox import run_child_until

HOSTILE = ['"', '""', "'", "NEAR(", "a AND", "OR", "NOT x", "*", "key:value", "(", ")", "^x",
           "'; DROP TABLE memories; --", "\\", "-x", "+", "ünïcödé", "", "   ", "x" * 5000]


async def test_store_retrieve_update_delete_on_a_real_file(settings: Settings) -> None:
    async with MemoryPipeline(settings) as mem:
        kv = mem.memory
        first = await kv.store("ann", "editor", "vim", {"source": "chat", "n": 1})
        # Read-your-writes: no flush in between.
        got = await kv.retrieve("ann", "editor")
        assert got == MemoryEntry("editor", "vim", "ann", first.accepted_at, first.accepted_at,
                                  {"source": "chat", "n": 1})
        second = await kv.store("ann", "editor", "helix")
        got = await kv.retrieve("ann", "editor")
        assert got is not None
        assert (got.value, got.metadata) == ("helix", {})
        assert got.created_at == first.accepted_at  # an update keeps created_at
        assert got.updated_at == second.accepted_at > first.accepted_at
        await kv.store("ann", "shell", "fish")
        assert await kv.list_keys("ann") == ["shell", "editor"]  # most recently updated first
        await kv.delete("ann", "editor")
        assert await kv.retrieve("ann", "editor") is None
        assert await kv.list_keys("ann") == ["shell"]
        await kv.delete("ann", "never-stored")  # deleting what is absent is no error
    # The entries are in the file, not in the process.
    async with MemoryPipeline(settings) as mem:
        got = await mem.memory.retrieve("ann", "shell")
        assert got is not None and got.value == "fish"
        assert await mem.memory.counts() == (1, 1)


def test_an_entry_needs_only_a_key_and_a_value() -> None:
    before = time.time()
    entry = MemoryEntry("editor", "vim")
    assert (entry.key, entry.value, entry.user_id, entry.metadata) == ("editor", "vim", "", {})
    assert before <= entry.created_at <= time.time()
    assert entry.updated_at == entry.created_at  # not updated since
    assert MemoryEntry("k", "v").metadata is not entry.metadata  # each its own
    # Given times are kept; an updated_at left out is the created_at given.
    assert MemoryEntry("k", "v", "ann", 5.0).updated_at == 5.0
    full = MemoryEntry("k", "v", "ann", 5.0, 7.0, {"n": 1})
    assert (full.created_at, full.updated_at, full.metadata) == (5.0, 7.0, {"n": 1})
    named = MemoryEntry(key="k", value="v", user_id="ann")
    assert named.user_id == "ann" and named.updated_at == named.created_at > 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        entry.value = "emacs"  # type: ignore[misc]


async def test_users_never_see_each_others_entries(mem: MemoryPipeline) -> None:
    kv = mem.memory
    await kv.store("ann", "pet", "a cat named Miso")
    await kv.store("bob", "pet", "a dog named Rex")
    await kv.store("bob", "car", "a red bike, no car")
    ann = await kv.retrieve("ann", "pet")
    assert ann is not None and ann.value == "a cat named Miso"
    assert await kv.list_keys("ann") == ["pet"]
    assert [e.value for e in await kv.query("ann", "dog cat named")] == ["a cat named Miso"]
    assert {e.key for e in await kv.query("bob", "named red")} == {"pet", "car"}
    assert await kv.retrieve("ann", "car") is None


async def test_query_is_ranked_full_text_and_user_text_is_data(mem: MemoryPipeline) -> None:
    kv = mem.memory
    await kv.store("ann", "deploy", "we deploy with ansible every friday")
    await kv.store("ann", "friday", "friday friday standup notes")
    await kv.store("ann", "lunch", "sushi on mondays")
    await kv.store("ann", "near", "NEAR AND OR NOT are words here")
    await mem.flush()
    hits = await kv.query("ann", "friday")
    assert [e.key for e in hits] == ["friday", "deploy"]  # the key's match counts most
    assert [e.key for e in await kv.query("ann", "ansible Friday", limit=1)] == ["deploy"]
    assert [e.key for e in await kv.query("ann", 'NEAR("and"')] == ["near"]
    for text in HOSTILE:
        result = await kv.query("ann", text)
        assert all(isinstance(e, MemoryEntry) for e in result), text
    assert await kv.query("ann", "nothing matches this") == []


async def test_query_sees_writes_not_yet_committed_in_order(mem: MemoryPipeline) -> None:
    kv = mem.memory
    await kv.store("ann", "colour", "blue")
    await mem.flush()
    # Accepted, not committed yet: the writer has not run since (we hold the loop).
    kv.store_nowait("ann", "colour", "green")
    kv.store_nowait("ann", "fruit", "green apples")
    kv.delete_nowait("ann", "fruit")
    hits = await kv.query("ann", "green blue")
    assert [(e.key, e.value) for e in hits] == [("colour", "green")]


async def test_put_delete_put_in_one_batch_ends_as_a_fresh_entry(mem: MemoryPipeline) -> None:
    kv = mem.memory
    old = await kv.store("ann", "k", "old")
    await mem.flush()
    # Three records accepted back to back, whatever batches they fall into.
    kv.store_nowait("ann", "k", "middle")
    kv.delete_nowait("ann", "k")
    last = kv.store_nowait("ann", "k", "new")
    kv.store_nowait("ann", "j", "x")
    kv.store_nowait("ann", "j", "y")
    await mem.flush()
    got = await kv.retrieve("ann", "k")
    assert got is not None and got.value == "new"
    assert got.created_at == got.updated_at == last.accepted_at != old.accepted_at
    j = await kv.retrieve("ann", "j")
    assert j is not None and j.value == "y" and j.created_at < j.updated_at


@pytest.mark.parametrize(("call", "message"), [
    (lambda kv: kv.store_nowait("ann", "", "v"), "key must be a non-empty string"),
    (lambda kv: kv.store_nowait("ann", 5, "v"), "key must be a non-empty string, got int"),
    (lambda kv: kv.store_nowait("ann", "k", None), "value must be a string, got null"),
    (lambda kv: kv.store_nowait("ann", "k", "a\x00b"), "value holds a NUL character"),
    (lambda kv: kv.store_nowait("ann", "k", "\ud800"), "value holds a lone surrogate"),
    (lambda kv: kv.store_nowait("ann", "k", "v", ["x"]), "metadata must be an object"),
    (lambda kv: kv.store_nowait("ann", "k", "v", {"x": float("nan")}), "not JSON"),
    (lambda kv: kv.store_nowait("ann", "k", "v", {"x": object()}), "not JSON"),
    (lambda kv: kv.store_nowait("", "k", "v"), "user_id must be a non-empty string"),
    (lambda kv: kv.store_nowait("a\x01b", "k", "v"), "reserved character"),
    (lambda kv: kv.store_nowait("ann", "k" * 513, "v"), "longer than 512"),
    (lambda kv: kv.store_nowait("ann", "k", "v" * (17 << 20)), "max_turn_bytes"),
    (lambda kv: kv.delete_nowait("ann", None), "key must be a non-empty string, got null"),
])
async def test_bad_input_is_refused_before_it_is_acknowledged(
        mem: MemoryPipeline, call: object, message: str) -> None:
    before = mem.stats().accepted_turns
    with pytest.raises(InvalidEntryError, match=message.replace("(", r"\(")) as err:
        call(mem.memory)  # type: ignore[operator]
    assert isinstance(err.value, InvalidTurnError)  # one family with the turn's refusals
    assert mem.stats().accepted_turns == before
    await mem.flush()
    assert await mem.memory.counts() == (0, 0)


async def test_a_session_id_can_never_be_a_users_key_value_lane(mem: MemoryPipeline) -> None:
    with pytest.raises(InvalidTurnError, match="reserved"):
        mem.sync_turn("u", "a", session_id="\x01kv\x01ann")


async def test_blocking_form_works_from_another_thread(mem: MemoryPipeline) -> None:
    blocking = mem.memory.blocking(timeout_s=10)
    out: dict[str, object] = {}

    def agent_thread() -> None:
        blocking.store("ann", "tz", "Europe/Paris")
        out["entry"] = blocking.retrieve("ann", "tz")
        out["keys"] = blocking.list_keys("ann")
        out["hits"] = blocking.query("ann", "paris")

    thread = threading.Thread(target=agent_thread)
    thread.start()
    await asyncio.to_thread(thread.join)
    entry = out["entry"]
    assert isinstance(entry, MemoryEntry) and entry.value == "Europe/Paris"
    assert out["keys"] == ["tz"]
    assert [e.key for e in out["hits"]] == ["tz"]  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="deadlock"):
        blocking.retrieve("ann", "tz")  # on the loop's own thread


async def test_a_closed_pipeline_refuses_writes_and_reads(settings: Settings) -> None:
    mem = MemoryPipeline(settings)
    async with mem:
        assert mem.memory.is_available()
    assert not mem.memory.is_available()
    with pytest.raises(PipelineClosedError):
        mem.memory.store_nowait("ann", "k", "v")
    with pytest.raises(PipelineClosedError):
        await mem.memory.retrieve("ann", "k")


async def test_sigkill_during_key_value_writes_loses_none_and_keeps_order(
        tmp_path: Path) -> None:
    """Invariant, per user: every acknowledged step's writes are committed exactly once, in
    order: the ``k<i>`` present are exactly those a prefix of steps leaves (every third step
    deletes the one before it), and ``counter`` is that prefix's last step (or the one before,
    when the kill fell between a step's two writes)."""
    db = tmp_path / "m.db"
    receipts = run_child_until(db, "kv", acks=3000)
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        await mem.flush()
        for user in ("ann", "bob", "cy"):
            acked = max(i for _, u, i in receipts if u == user)
            keys = set(await mem.memory.list_keys(user))
            counter = await mem.memory.retrieve(user, "counter")
            assert counter is not None
            last = int(counter.value)
            assert last >= acked, f"{user}: acknowledged step {acked} lost"
            steps = {int(k[1:]) for k in keys if k.startswith("k")}
            top = max(steps)
            assert top in (last, last + 1), f"{user}: counter {last}, newest key k{top}"
            # Steps before the last one completed: their deletes are in.
            expected = {i for i in range(top + 1) if not (i % 3 == 1 and i + 1 < top)}
            # The last step's delete of k<top-1> comes after its counter: in, or not yet.
            cut_short = expected - {top - 1} if top % 3 == 2 and top == last else expected
            assert steps in (expected, cut_short), f"{user}: keys out of order or duplicated"
            entry = await mem.memory.retrieve(user, f"k{top}")
            assert entry is not None and entry.metadata == {"step": top}
    done = sqlite3.connect(db).execute(
        "SELECT count(*) FROM outbox WHERE status = 'done'").fetchone()[0]
    assert done >= 3 * 2 * len({i for _, _, i in receipts})  # every write committed once


async def test_a_producers_settled_waits_for_the_worker_to_commit(tmp_path: Path) -> None:
    """settled() means committed for every reader of the store: for a producer, by the worker,
    not just handed in to the shared inbox (where no worker is running, it times out)."""
    db = tmp_path / "m.db"
    producer_settings = Settings(db_path=db, role="producer", shared_poll_ms=5.0)
    async with MemoryPipeline(producer_settings) as producer:
        await producer.memory.store("ann", "lang", "python")
        with pytest.raises(FlushTimeoutError):
            await producer.memory.settled("ann", timeout_s=0.2)
        async with MemoryPipeline(Settings(db_path=db, role="worker",
                                           shared_poll_ms=5.0)) as worker:
            await producer.memory.store("ann", "os", "linux")
            await producer.memory.settled("ann")
            assert await worker.store.memory_counts() == (2, 1)


async def test_a_producers_writes_are_read_back_before_any_worker_commits_them(
        tmp_path: Path) -> None:
    """Several processes: a producer forwards its writes to the shared inbox; with no worker
    running they wait there, and reads (from this producer or another) still see them."""
    db = tmp_path / "m.db"
    one = Settings(db_path=db, role="producer", shared_poll_ms=5.0)
    async with MemoryPipeline(one) as producer, MemoryPipeline(one) as other:
        kv = producer.memory
        first = await kv.store("ann", "lang", "python", {"v": 1})
        await kv.store("ann", "lang", "rust")
        await kv.store("ann", "os", "linux")
        await kv.delete("ann", "os")
        await producer.flush()  # handed in: in the inbox, not in the store
        assert await producer.store.memory_counts() == (0, 0)
        for reader in (producer, other):
            got = await reader.memory.retrieve("ann", "lang")
            assert got is not None and (got.value, got.created_at) == ("rust", first.accepted_at)
            assert await reader.memory.list_keys("ann") == ["lang"]
            assert [e.value for e in await reader.memory.query("ann", "rust linux")] == ["rust"]
    async with MemoryPipeline(Settings(db_path=db, role="worker", shared_poll_ms=5.0)) as worker:
        await worker.wait_until(lambda: worker.stats().inbox_committed_turns == 4, timeout=30)
        assert await worker.store.memory_counts() == (1, 1)
        got = await worker.memory.retrieve("ann", "lang")
        assert got is not None and (got.value, got.created_at) == ("rust", first.accepted_at)
    # An update still in the inbox, of an entry committed before: a query shows the update
    # with the entry's own created_at (read from the store), as the commit will.
    async with MemoryPipeline(one) as producer:
        await producer.memory.store("ann", "lang", "zig")
        await producer.flush()
        hits = await producer.memory.query("ann", "zig")
        assert [(e.value, e.created_at) for e in hits] == [("zig", first.accepted_at)]
