"""The pipeline end to end: accept, group commit, flush barrier, prefetch, shutdown."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from hermes_async_memory import (
    FlushTimeoutError,
    InvalidTurnError,
    MemoryPipeline,
    PipelineClosedError,
    QueueFullError,
    Settings,
    maintenance,
)
from hermes_async_memory.store import SqliteStore

from .helpers import count_rows, stored_turns

SESSIONS = 1000
TURNS = 20


async def test_concurrent_sessions_store_every_turn_once_in_order(settings: Settings) -> None:
    """Invariant: no loss, no duplicate, per-session order, and read-your-writes in prefetch.

    1,000 sessions x 20 turns are issued by 1,000 concurrent tasks, interleaved.
    """
    receipts = []
    async with MemoryPipeline(settings) as mem:

        async def talk(i: int) -> None:
            for n in range(TURNS):
                receipts.append(
                    mem.sync_turn(f"s{i} question {n}", f"s{i} answer {n}",
                                  session_id=f"s{i}", user_id=f"u{i % 50}")
                )
                await anyio.lowlevel.checkpoint()

        async with anyio.create_task_group() as tg:
            for i in range(SESSIONS):
                tg.start_soon(talk, i)
        await mem.flush()

        stored = stored_turns(settings.db_path)
        assert len(stored) == SESSIONS
        for i in range(SESSIONS):
            rows = stored[f"s{i}"]
            expected = []
            for n in range(TURNS):
                expected += [("user", f"s{i} question {n}"), ("assistant", f"s{i} answer {n}")]
            assert [(role, content) for _, role, content in rows] == expected, f"session s{i}"
            block = mem.prefetch("anything", session_id=f"s{i}", user_id=f"u{i % 50}")
            assert f"s{i} question {TURNS - 1}" in block
            assert f"s{i} answer {TURNS - 1}" in block
            status = mem.prefetch_status(f"s{i}", user_id=f"u{i % 50}")
            assert status.turns_committed == TURNS
        keys = Counter(key for rows in stored.values() for key, _, _ in rows)
        assert len(keys) == SESSIONS * TURNS
        assert set(keys.values()) == {2}
        assert {r.key for r in receipts} == set(keys)
        assert mem.stats().committed_turns == SESSIONS * TURNS


async def test_flush_is_a_barrier_and_turns_are_recallable(mem: MemoryPipeline) -> None:
    for i in range(50):
        mem.sync_turn(f"the migration to postgres step {i}", "ok", session_id="a", user_id="ann")
    await mem.flush()
    block = await mem.search("postgres migration", user_id="ann")
    assert "postgres" in block
    messages = await mem.get_messages("a")
    assert [m["content"] for m in messages[::2]] == [
        f"the migration to postgres step {i}" for i in range(50)
    ]


async def test_uncommitted_counts_what_is_accepted_and_not_yet_settled(
        mem: MemoryPipeline) -> None:
    """Accepted without yielding to the loop, nothing can have been committed: the count is
    every turn; after flush() it is none."""
    assert (mem.uncommitted(), mem.pending()) == (0, False)
    for i in range(30):
        mem.sync_turn(f"turn {i}", "ok", session_id=f"s{i % 3}", user_id="ann")
    assert (mem.uncommitted(), mem.pending()) == (30, True)
    await mem.flush()
    assert (mem.uncommitted(), mem.pending()) == (0, False)
    assert mem.stats().committed_turns == 30


async def test_a_wait_for_nothing_uncommitted_wakes_when_the_writer_settles(
        settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """``wait_until`` checks its predicate after every change the pipeline makes, and the
    writer settling a batch (the backlog shrinks) is one. The commit's own change comes
    before the settle, and the maintenance's round, the only one after it here, is put off
    for an hour: a settle that woke no one would leave each wait to its deadline."""
    monkeypatch.setattr(maintenance, "EVERY_S", 3600.0)
    async with MemoryPipeline(settings) as mem:
        for round_ in range(3):
            for i in range(20):
                mem.sync_turn(f"turn {round_} {i}", "ok", session_id=f"s{i % 4}", user_id="ann")
            with anyio.fail_after(30):
                await mem.wait_until(lambda: mem.uncommitted() == 0)
            assert mem.stats().committed_turns == 20 * (round_ + 1)
            assert mem.stats().pending_turns == 0


async def test_queue_prefetch_fills_the_cache_for_the_next_turn(mem: MemoryPipeline) -> None:
    mem.sync_turn("my cat is called Mittens", "noted", session_id="old", user_id="bob")
    mem.sync_turn("unrelated chatter", "sure", session_id="new", user_id="bob")
    await mem.flush()
    assert "Mittens" not in mem.prefetch("", session_id="new", user_id="bob")
    mem.queue_prefetch("what is my cat called", session_id="new", user_id="bob")
    await mem.wait_until(
        lambda: mem.prefetch_status("new", user_id="bob").recall_query is not None, timeout=10)
    block = mem.prefetch("what is my cat called", session_id="new", user_id="bob")
    assert "Mittens" in block
    status = mem.prefetch_status("new", user_id="bob")
    assert status.recall_query == "what is my cat called"
    assert status.source == "local" and not status.stale


async def test_prefetch_of_an_unknown_session_is_empty(mem: MemoryPipeline) -> None:
    assert mem.prefetch("hello", session_id="nobody") == ""
    assert mem.prefetch_status("nobody").cached is False
    assert mem.stats().recall_misses == 1


async def test_newer_query_replaces_an_older_one_not_started(mem: MemoryPipeline) -> None:
    mem.sync_turn("apples are red", "yes", session_id="s", user_id="u")
    mem.sync_turn("bananas are yellow", "yes", session_id="s", user_id="u")
    await mem.flush()
    # Both queued before the recall workers get the loop: only the newer one runs.
    mem.queue_prefetch("apples", session_id="s", user_id="u")
    mem.queue_prefetch("bananas", session_id="s", user_id="u")
    await mem.wait_until(
        lambda: mem.prefetch_status("s", user_id="u").recall_query is not None, timeout=10)
    assert mem.prefetch_status("s", user_id="u").recall_query == "bananas"
    assert mem.stats().recalls_run == 1


async def test_identical_recalls_in_flight_are_shared(settings: Settings) -> None:
    release = anyio.Event()
    started = anyio.Event()

    class SlowStore(SqliteStore):
        async def recall_pool(self, match: str, pool: int, shown: int):  # type: ignore[no-untyped-def]
            started.set()
            await release.wait()
            return await super().recall_pool(match, pool, shown)

    store = SlowStore(settings.db_path, readers=settings.recall_workers)
    async with MemoryPipeline(settings, store=store) as mem:
        mem.sync_turn("the deploy key rotates weekly", "ok", session_id="s1", user_id="team")
        mem.sync_turn("hi", "hi", session_id="s2", user_id="team")
        await mem.flush()
        mem.queue_prefetch("deploy key", session_id="s1", user_id="team")
        with anyio.fail_after(10):
            await started.wait()
        mem.queue_prefetch("deploy key", session_id="s2", user_id="team")
        # The second recall finds the first in flight and waits on it: nothing changes in the
        # cache until the search is released, so nothing to wait on but the count.
        with anyio.fail_after(10):
            while mem.stats().recalls_shared == 0:
                await anyio.lowlevel.checkpoint()
        release.set()
        await mem.wait_until(
            lambda: mem.prefetch_status("s2", user_id="team").recall_query is not None,
            timeout=10)
        assert mem.stats().recalls_run == 1
        assert "deploy key rotates" in mem.prefetch("", session_id="s1", user_id="team")
        assert "deploy key rotates" in mem.prefetch("", session_id="s2", user_id="team")


async def test_full_queue_defers_durably_and_keeps_order(tmp_path: Path) -> None:
    settings = Settings(db_path=tmp_path / "m.db", max_queued_turns=100)
    async with MemoryPipeline(settings) as mem:
        receipts = [
            mem.sync_turn(f"turn {i}", f"reply {i}", session_id=f"s{i % 3}") for i in range(1000)
        ]
        assert not any(r.deferred for r in receipts[:100])
        assert all(r.deferred for r in receipts[100:])
        await mem.flush()
    stored = stored_turns(settings.db_path)
    for s in range(3):
        users = [c for _, role, c in stored[f"s{s}"] if role == "user"]
        assert users == [f"turn {i}" for i in range(1000) if i % 3 == s]


async def test_reject_policy_raises_and_stores_nothing_for_the_rejected(tmp_path: Path) -> None:
    settings = Settings(db_path=tmp_path / "m.db", max_queued_turns=10, overflow="reject")
    async with MemoryPipeline(settings) as mem:
        for i in range(10):
            mem.sync_turn(f"turn {i}", "r", session_id="s")
        with pytest.raises(QueueFullError):
            mem.sync_turn("one too many", "r", session_id="s")
        await mem.flush()
        mem.sync_turn("after the drain", "r", session_id="s")
        await mem.flush()
    users = [c for _, role, c in stored_turns(settings.db_path)["s"] if role == "user"]
    assert users == [f"turn {i}" for i in range(10)] + ["after the drain"]


async def test_aclose_commits_ten_thousand_pending_turns(settings: Settings) -> None:
    mem = MemoryPipeline(settings)
    await mem.start()
    for i in range(10_000):
        mem.sync_turn(f"pending {i}", f"reply {i}", session_id=f"s{i % 100}")
    assert mem.stats().committed_turns == 0
    await mem.aclose()
    assert count_rows(settings.db_path) == 20_000
    assert not list(settings.outbox_dir.glob("*.seg"))


async def test_tiny_deadline_leaves_the_rest_for_the_next_start(settings: Settings) -> None:
    mem = MemoryPipeline(settings)
    await mem.start()
    keys = [mem.sync_turn(f"pending {i}", "r", session_id=f"s{i % 10}").key for i in range(10_000)]
    await mem.aclose(deadline_s=0)
    committed_first = count_rows(settings.db_path) // 2
    assert committed_first < 10_000  # the deadline stopped the drain
    assert list(settings.outbox_dir.glob("*.seg"))

    async with MemoryPipeline(settings) as again:
        await again.flush()
        assert again.stats().committed_turns == 10_000 - committed_first
    stored = stored_turns(settings.db_path)
    got = Counter(key for rows in stored.values() for key, role, _ in rows if role == "user")
    assert set(got) == set(keys) and set(got.values()) == {1}
    for s in range(10):
        users = [c for _, role, c in stored[f"s{s}"] if role == "user"]
        assert users == [f"pending {i}" for i in range(10_000) if i % 10 == s]


async def test_a_restart_in_the_process_waits_for_an_outbox_close_the_deadline_abandoned(
        settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A close past aclose's deadline goes on on its thread, holding the outbox's lock: a new
    pipeline on the same store waits for it to let go (not OutboxBusyError), then commits
    every pending turn once."""
    import threading

    from hermes_async_memory.outbox import log as outbox_log

    let_close_finish = threading.Event()
    opener_waits = threading.Event()
    real_close, real_await = outbox_log.Outbox.close, outbox_log._await_own_close

    def held_close(self: outbox_log.Outbox) -> None:
        let_close_finish.wait()
        real_close(self)

    def noted_await(directory: Path) -> None:
        opener_waits.set()
        real_await(directory)

    monkeypatch.setattr(outbox_log.Outbox, "close", held_close)
    monkeypatch.setattr(outbox_log, "_await_own_close", noted_await)
    mem = MemoryPipeline(settings)
    await mem.start()
    keys = [mem.sync_turn(f"pending {i}", "r", session_id=f"s{i % 3}").key for i in range(300)]
    await mem.aclose(deadline_s=0)  # returns with the close still running
    committed_first = count_rows(settings.db_path) // 2

    again = MemoryPipeline(settings)
    async with anyio.create_task_group() as tg:
        tg.start_soon(again.start)
        await anyio.to_thread.run_sync(opener_waits.wait)
        let_close_finish.set()
    try:
        await again.flush()
        assert again.stats().committed_turns == 300 - committed_first
    finally:
        await again.aclose()
    stored = stored_turns(settings.db_path)
    got = Counter(key for rows in stored.values() for key, role, _ in rows if role == "user")
    assert set(got) == set(keys) and set(got.values()) == {1}


async def test_aclose_is_idempotent_and_closes_the_api(settings: Settings) -> None:
    mem = MemoryPipeline(settings)
    await mem.start()
    mem.sync_turn("x", "y", session_id="s")
    async with anyio.create_task_group() as tg:
        tg.start_soon(mem.aclose)
        tg.start_soon(mem.aclose)
    await mem.aclose()
    with pytest.raises(PipelineClosedError):
        mem.sync_turn("late", "turn", session_id="s")
    with pytest.raises(PipelineClosedError):
        mem.queue_prefetch("late", session_id="s")
    with pytest.raises(PipelineClosedError):
        await mem.flush()
    assert count_rows(settings.db_path) == 2


async def test_flush_timeout_is_typed_and_loses_nothing(settings: Settings) -> None:
    release = anyio.Event()

    class StuckStore(SqliteStore):
        async def commit_batch(self, batch):  # type: ignore[no-untyped-def]
            await release.wait()
            await super().commit_batch(batch)

    async with MemoryPipeline(settings, store=StuckStore(settings.db_path)) as mem:
        mem.sync_turn("waiting", "turn", session_id="s")
        with pytest.raises(FlushTimeoutError) as info:
            await mem.flush(timeout=0.05)
        assert isinstance(info.value, TimeoutError)
        release.set()
        await mem.flush()
        assert [m["content"] for m in await mem.get_messages("s")] == ["waiting", "turn"]


async def test_invalid_turns_get_typed_errors_and_the_pipeline_goes_on(
    mem: MemoryPipeline, settings: Settings
) -> None:
    bad_calls = [
        dict(user_content="x", assistant_content="y", session_id=""),
        dict(user_content="x", assistant_content="y", session_id=None),
        dict(user_content="x", assistant_content="y", session_id=42),
        dict(user_content=3.5, assistant_content="y", session_id="s"),
        dict(user_content="x", assistant_content="y", session_id="s", metadata={"o": object()}),
        dict(user_content="x", assistant_content="y", session_id="s", metadata="not a dict"),
        dict(user_content="x", assistant_content="y", session_id="\ud800bad"),
        dict(user_content="x", assistant_content="y", session_id="nul\x00id"),
        dict(user_content="x", assistant_content="y", session_id="s", user_id="u\x00"),
        dict(user_content="x", assistant_content="y", session_id="s", metadata={"f": float("nan")}),
        dict(user_content="x", assistant_content="y", session_id="s", messages="oops"),
        dict(user_content="x", assistant_content="y", session_id="s", messages=[7]),
    ]
    for call in bad_calls:
        with pytest.raises(InvalidTurnError):
            mem.sync_turn(**call)  # type: ignore[arg-type]
    mem.sync_turn("still", "working", session_id="s")
    await mem.flush()
    assert count_rows(settings.db_path) == 2


async def test_prefetch_refuses_bad_ids_typed_and_answers_a_warm_session(
        mem: MemoryPipeline) -> None:
    """prefetch's warm path is one lookup; an id that is not one is still refused, typed,
    whether or not it could be a key (an unhashable one too), and counts no hit."""
    mem.sync_turn("remember the blue door", "noted", session_id="s", user_id="u")
    await mem.flush()
    block = mem.prefetch(session_id="s", user_id="u")
    assert "blue door" in block
    assert mem.prefetch(session_id="s", user_id="u") == block
    hits = mem.stats().recall_hits
    for bad in ("", "x" * 513, "a\x00b", ["s"], 7, None):
        with pytest.raises(InvalidTurnError):
            mem.prefetch(session_id=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidTurnError):
            mem.prefetch(session_id="s", user_id=bad or ["u"])  # type: ignore[arg-type]
    assert mem.stats().recall_hits == hits


async def test_oversized_turn_is_refused_clearly(tmp_path: Path) -> None:
    settings = Settings(db_path=tmp_path / "m.db", max_turn_bytes=1024)
    async with MemoryPipeline(settings) as mem:
        with pytest.raises(InvalidTurnError, match="max_turn_bytes"):
            mem.sync_turn("x" * 2000, "y", session_id="s")
        mem.sync_turn("small", "fine", session_id="s")
        await mem.flush()
    assert count_rows(tmp_path / "m.db") == 2


async def test_openai_messages_are_stored_as_given_with_tool_calls(mem: MemoryPipeline) -> None:
    """``messages=`` is the turn: every message handed over is stored, in order, as given."""
    history = [
        {"role": "user", "content": "what is the weather in Oslo"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "4°C, rain"},
        {"role": "assistant", "content": "It is 4°C and raining in Oslo."},
    ]
    mem.sync_turn("what is the weather in Oslo", "It is 4°C and raining in Oslo.",
                  session_id="s", messages=history, metadata={"model": "m1", "input_tokens": 12})
    await mem.flush()
    stored = await mem.get_messages("s")
    assert [m["message"] for m in stored] == history
    assert [m["id"] for m in stored] == list(range(stored[0]["id"], stored[0]["id"] + 4))
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[1]["tool_calls"][0]["function"]["name"] == "weather"
    assert stored[2]["tool_call_id"] == "c1" and stored[2]["tool_name"] == "weather"
    assert stored[0]["metadata"] == {"model": "m1", "input_tokens": 12}
    session = await mem.store.get_session("s")
    assert session is not None
    assert session["message_count"] == 4 and session["tool_call_count"] == 1  # one call
    assert session["input_tokens"] == 12 and session["model"] == "m1"


async def test_sessions_are_created_lazily_with_source_and_parent(mem: MemoryPipeline) -> None:
    assert await mem.store.get_session("child") is None
    mem.sync_turn("a", "b", session_id="child", user_id="u",
                  metadata={"source": "telegram", "parent_session_id": "root"})
    await mem.flush()
    session = await mem.store.get_session("child")
    assert session is not None
    assert session["source"] == "telegram"
    assert session["parent_session_id"] == "root"
    assert session["user_id"] == "u"


async def test_a_recall_queued_right_after_a_turn_finds_that_turn(mem: MemoryPipeline) -> None:
    # No flush in between: the recall waits for the turns accepted before it was queued.
    mem.sync_turn("my flight to Lisbon leaves at 7", "noted", session_id="trip", user_id="eve")
    mem.queue_prefetch("when is my Lisbon flight", session_id="trip", user_id="eve")
    await mem.wait_until(
        lambda: mem.prefetch_status("trip", user_id="eve").recall_query is not None, timeout=10)
    # The recall found the turn; the block does not repeat what its recent turns show.
    assert mem.stats().recalls_run == 1
    block = mem.prefetch("", session_id="trip", user_id="eve")
    assert block.count("my flight to Lisbon leaves at 7") == 1


async def test_shutdown_keeps_its_deadline_when_the_store_is_locked(tmp_path: Path) -> None:
    import sqlite3

    settings = Settings(db_path=tmp_path / "m.db", busy_timeout_ms=200,
                        commit_retry_base_s=0.01)
    mem = MemoryPipeline(settings)
    await mem.start()
    other = sqlite3.connect(settings.db_path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock throughout
    try:
        keys = [mem.sync_turn(f"t{i}", "r", session_id="s").key for i in range(500)]
        # Deadline 0.2 s, plus at most the statement in flight (one busy timeout).
        with anyio.fail_after(3):
            await mem.aclose(deadline_s=0.2)
    finally:
        other.execute("COMMIT")
        other.close()
    async with MemoryPipeline(settings) as again:
        await again.flush()
        assert [m["turn_key"] for m in await again.get_messages("s")][::2] == keys


async def test_flush_and_close_cut_a_long_group_commit_window_short(tmp_path: Path) -> None:
    # A ten-minute window: without the cut, flush would time out and close would wait.
    settings = Settings(db_path=tmp_path / "memory.db", max_wait_ms=600_000)
    mem = MemoryPipeline(settings)
    await mem.start()
    try:
        mem.sync_turn("first", "one", session_id="s")
        await mem.flush(timeout=10)
        assert [m["content"] for m in await mem.get_messages("s")] == ["first", "one"]
        mem.sync_turn("second", "two", session_id="s")
    finally:
        with anyio.fail_after(10):
            await mem.aclose()
    assert mem.stats().committed_turns == 2


async def test_a_resumed_session_gets_its_stored_recent_turns_back(tmp_path: Path) -> None:
    settings = Settings(db_path=tmp_path / "memory.db", recent_turns=2)
    async with MemoryPipeline(settings) as first:
        for n in range(3):
            first.sync_turn(f"question {n} about the boiler", f"answer {n}",
                            session_id="resumed", user_id="ada")
    async with MemoryPipeline(settings) as second:  # a new process: the cache is empty
        assert second.prefetch("", session_id="resumed", user_id="ada") == ""
        second.warm("resumed", user_id="ada")
        await second.wait_until(
            lambda: "boiler" in second.prefetch("", session_id="resumed", user_id="ada"),
            timeout=10)
        block = second.prefetch("", session_id="resumed", user_id="ada")
        assert "question 1" in block and "question 2" in block and "answer 2" in block
        assert "question 0" not in block, "only the last recent_turns turns"
        status = second.prefetch_status("resumed", user_id="ada")
        assert status.turns_committed == 2
        # Another user's session of the same name is not theirs to see.
        assert second.prefetch("", session_id="resumed", user_id="bob") == ""
        # A queued recall for another resumed session warms it first, too.
        second.queue_prefetch("boiler", session_id="other", user_id="ada")
        await second.wait_until(
            lambda: second.prefetch_status("other", user_id="ada").recall_query is not None,
            timeout=10)
        assert "boiler" in second.prefetch("", session_id="other", user_id="ada")


async def test_a_resumed_session_keeps_its_history_when_a_new_turn_comes_first(
    tmp_path: Path,
) -> None:
    settings = Settings(db_path=tmp_path / "memory.db", recent_turns=3)
    async with MemoryPipeline(settings) as first:
        for n in range(2):
            first.sync_turn(f"old question {n}", f"old answer {n}", session_id="r")
    async with MemoryPipeline(settings) as second:
        second.sync_turn("new question", "new answer", session_id="r")
        await second.flush()
        second.queue_prefetch("question", session_id="r")  # warms the session first
        await second.wait_until(
            lambda: second.prefetch_status("r").recall_query is not None, timeout=10)
        block = second.prefetch("", session_id="r")
        assert block.index("old question 0") < block.index("old question 1") < \
            block.index("new question"), "stored history first, then this process's turn"
