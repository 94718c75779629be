"""The pipeline with Honcho as its replica backend, against a Honcho-compatible server on
127.0.0.1 spoken to by the real honcho-ai SDK over real HTTP.

Invariants checked on every turn: each committed turn reaches Honcho exactly once, in its
session's accept order; nothing is lost through server errors, rate limits, responses that
time out after the server committed, an outage, or a message the server refuses.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.backends import HonchoBackend, HonchoConfig
from hermes_async_memory.backends.honcho import INDEX_FIELD, KEY_FIELD, honcho_id
from hermes_async_memory.backends.honcho.mapping import IMPORTED_FIELD

from .fake_honcho import FakeHoncho
from .helpers import count_rows

WORKSPACE = "pipeline-ws"
WAIT_S = 60.0
OUTAGE_S = 30.0  # the scenario: the server is down this long


def honcho_config(fake: FakeHoncho, **changes: Any) -> HonchoConfig:
    values: dict[str, Any] = dict(
        base_url=fake.base_url, workspace_id=WORKSPACE, request_timeout_s=1.0,
        backoff_base_s=0.02, backoff_max_s=0.2, max_attempts=6, breaker_failures=4,
        breaker_cooldown_s=0.5, recall_deadline_s=1.0,
        # The fake server answers or fails at once: a request it timed out is over by then.
        max_inflight_s=0.5)
    values.update(changes)
    return HonchoConfig(**values)


def settings(tmp_path: Path, **changes: Any) -> Settings:
    return Settings(db_path=tmp_path / "memory.db", **changes)


def on_server(fake: FakeHoncho, session_id: str) -> list[tuple[str, int]]:
    """(turn key, message index in the turn) of the session's messages on the server."""
    return [(m["metadata"][KEY_FIELD], m["metadata"][INDEX_FIELD])
            for m in fake.session_messages(honcho_id(session_id), WORKSPACE)]


def each_once_in_order(keys: list[str]) -> list[tuple[str, int]]:
    return [(k, i) for k in keys for i in range(2)]  # a user and an assistant message


async def eventually(mem: MemoryPipeline, check: Callable[[], bool], what: str) -> None:
    """Wait for ``check``: the pipeline wakes its waiters after each replica write, recall
    and commit."""
    try:
        await mem.wait_until(check, timeout=WAIT_S)
    except TimeoutError:
        raise AssertionError(f"not within {WAIT_S} s: {what}") from None


def accept(mem: MemoryPipeline, sessions: int, turns: int, prefix: str = "s",
           text: Callable[[int, int], str] | None = None) -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    for n in range(turns):
        for i in range(sessions):
            sid = f"{prefix}{i}"
            user = text(i, n) if text else f"question {n} of {sid}"
            keys.setdefault(sid, []).append(
                mem.sync_turn(user, f"answer {n}", session_id=sid, user_id=f"u{i % 5}").key)
    return keys


async def test_turns_of_50_sessions_reach_honcho_in_order_exactly_once(
    tmp_path: Path, fake: FakeHoncho
) -> None:
    config = honcho_config(fake)
    async with MemoryPipeline(settings(tmp_path, backend="honcho", honcho=config)) as mem:
        assert isinstance(mem.backend, HonchoBackend)
        keys = accept(mem, 50, 6)
        await mem.flush()
        await eventually(mem, lambda: mem.stats().replicated_turns == 300, "all replicated")
    for sid, ks in keys.items():
        assert on_server(fake, sid) == each_once_in_order(ks), sid
    assert count_rows(tmp_path / "memory.db", "SELECT count(*) FROM replica_outbox") == 0


async def test_500s_429s_and_timeouts_after_commit_lose_and_duplicate_nothing(
    tmp_path: Path, fake: FakeHoncho
) -> None:
    fake.fail("add_messages", times=3, status=500)
    fake.fail("add_messages", times=1, status=429, retry_after="0.2")
    fake.hang_after_commit(2)  # committed on the server; the client times out and resends
    backend = HonchoBackend(honcho_config(fake, breaker_failures=50))
    async with MemoryPipeline(settings(tmp_path), backend) as mem:
        keys = accept(mem, 10, 8)
        await mem.flush()
        await eventually(mem, lambda: mem.stats().replicated_turns == 80, "all replicated")
        assert mem.stats().replica_dead == 0
    for sid, ks in keys.items():
        assert on_server(fake, sid) == each_once_in_order(ks), sid
    stats = backend.stats()
    assert stats["retries"], "the faults were met and retried"


async def test_a_30_s_outage_loses_nothing_and_prefetch_serves_the_last_good_block_stale(
    tmp_path: Path, fake: FakeHoncho
) -> None:
    backend = HonchoBackend(honcho_config(fake))
    async with MemoryPipeline(settings(tmp_path), backend) as mem:
        before = accept(mem, 5, 2, text=lambda i, n: f"I keep bees in hive {i} number {n}")
        await mem.flush()
        await eventually(mem, lambda: mem.stats().replicated_turns == 10, "replicated")
        mem.queue_prefetch("bees", session_id="s0", user_id="u0")
        await eventually(mem, lambda: mem.prefetch_status("s0", user_id="u0").source == "honcho",
                         "recalled")
        good = mem.prefetch("", session_id="s0", user_id="u0")
        assert "bees" in good and not mem.prefetch_status("s0", user_id="u0").stale

        fake.down()
        during = accept(mem, 5, 4, prefix="s")
        await mem.flush()  # durable in the store; Honcho cannot have them yet
        runs = mem.stats().recalls_run
        mem.queue_prefetch("bees again", session_id="s0", user_id="u0")
        await eventually(mem, lambda: mem.stats().recalls_run > runs
                         and mem.prefetch_status("s0", user_id="u0").stale, "the recall ran")
        status = mem.prefetch_status("s0", user_id="u0")
        assert status.source == "honcho" and status.stale, "the last good block, marked stale"
        assert "bees" in mem.prefetch("", session_id="s0", user_id="u0")
        await anyio.sleep(OUTAGE_S)  # the outage itself, not a wait for the pipeline
        assert mem.stats().replica_dead == 0, "an outage is not a reason to give a turn up"
        fake.up()
        await eventually(mem, lambda: mem.stats().replicated_turns == 30, "the backlog caught up")
        runs = mem.stats().recalls_run
        mem.queue_prefetch("bees now", session_id="s0", user_id="u0")
        await eventually(mem, lambda: mem.prefetch_status("s0", user_id="u0").recall_query
                         == "bees now", "the recall ran")
        assert not mem.prefetch_status("s0", user_id="u0").stale
    for sid in before:
        assert on_server(fake, sid) == each_once_in_order(before[sid] + during[sid]), sid


async def test_a_message_honcho_refuses_is_a_dead_letter_and_its_session_goes_on(
    tmp_path: Path, fake: FakeHoncho
) -> None:
    fake.refuse_content("POISON")
    backend = HonchoBackend(honcho_config(fake))
    async with MemoryPipeline(settings(tmp_path), backend) as mem:
        first = mem.sync_turn("fine", "ok", session_id="s", user_id="u").key
        bad = mem.sync_turn("this one is POISON", "ok", session_id="s", user_id="u").key
        later = [mem.sync_turn(f"later {n}", "ok", session_id="s", user_id="u").key
                 for n in range(3)]
        await mem.flush()
        await eventually(mem, lambda: mem.stats().replicated_turns == 4, "the others went out")
        await eventually(mem, lambda: mem.stats().replica_dead == 1, "the refused one is dead")
    assert on_server(fake, "s") == each_once_in_order([first, *later])
    reason = count_rows(
        tmp_path / "memory.db",
        f"SELECT count(*) FROM replica_outbox WHERE status = 'dead' AND turn_key = '{bad}' "
        "AND last_error LIKE '%422%'")
    assert reason == 1, "the dead letter keeps the server's reason"


async def test_turns_behind_a_failing_batch_use_up_no_attempts(
    tmp_path: Path, fake: FakeHoncho
) -> None:
    # 120 turns of one session are 240 messages: calls of 50, 50 and 20 turns. The first call
    # fails every time until its 50 turns are dead letters. The 70 turns behind it were never
    # sent: they must keep their attempts, and arrive, in order, once the session moves on.
    backend = HonchoBackend(honcho_config(fake, max_attempts=1, breaker_failures=50))
    # One commit for the 120 turns, so that the replicator sends them in one write.
    config = settings(tmp_path, replica_max_attempts=2, max_wait_ms=500.0)
    async with MemoryPipeline(config, backend) as mem:
        first = mem.sync_turn("hello", "hi", session_id="s", user_id="u").key
        await mem.flush()
        await eventually(mem, lambda: mem.stats().replicated_turns == 1, "the session exists")
        fake.fail("add_messages", times=2, status=502)  # the first call, and its one retry
        keys = [mem.sync_turn(f"question {n}", f"answer {n}", session_id="s", user_id="u").key
                for n in range(120)]
        await mem.flush()
        await eventually(mem, lambda: mem.stats().replicated_turns + mem.stats().replica_dead
                         == 121, "every turn written or given up")
        stats = mem.stats()
    assert stats.replica_dead == 50, "only the turns of the failed call are given up"
    assert on_server(fake, "s") == each_once_in_order([first, *keys[50:]])
    never_sent = count_rows(
        tmp_path / "memory.db",
        "SELECT count(*) FROM replica_outbox WHERE status = 'dead' AND attempts = 2")
    assert never_sent == 50, "each dead letter failed its two sends"


async def test_turns_held_back_by_the_open_circuit_use_up_no_attempts(
    tmp_path: Path, fake: FakeHoncho
) -> None:
    # Sessions s0 and s1 are written first (two lanes); s2 waits for a lane. s0's or s1's
    # call fails with a 502 and opens the circuit; the other's call hangs until it times out.
    # s2's lane starts while the circuit is open: its turns are held back, never sent. The
    # hung call's retry then probes after the cool-down and closes the circuit again, so the
    # write ends with the circuit closed: no outage, and the held-back turns must still keep
    # their attempts.
    backend = HonchoBackend(honcho_config(
        fake, write_concurrency=2, breaker_failures=1, breaker_cooldown_s=0.5,
        request_timeout_s=1.5, max_attempts=2))
    config = settings(tmp_path, replica_max_attempts=1, max_wait_ms=500.0)  # one write
    async with MemoryPipeline(config, backend) as mem:
        before = accept(mem, 3, 1)
        await mem.flush()
        await eventually(mem, lambda: mem.stats().replicated_turns == 3, "the sessions exist")
        fake.fail("add_messages", times=1, status=502)
        fake.hang_after_commit(1)
        during = accept(mem, 3, 3)
        await mem.flush()
        await eventually(mem, lambda: mem.stats().replicated_turns + mem.stats().replica_dead
                         == 12, "every turn written or given up")
        stats = mem.stats()
    assert stats.replica_dead == 3, "only the turns of the call that failed are given up"
    assert on_server(fake, "s2") == each_once_in_order(before["s2"] + during["s2"])
    complete = [sid for sid in ("s0", "s1")
                if on_server(fake, sid) == each_once_in_order(before[sid] + during[sid])]
    assert len(complete) == 1, "the hung call's turns went through, once"


# -- session lifecycle -------------------------------------------------------------------


def conversation(mem: MemoryPipeline, session_id: str, turns: int) -> list[str]:
    return [mem.sync_turn(f"question {n} of {session_id}", f"answer {n}", session_id=session_id,
                          user_id="u1").key for n in range(turns)]


async def replicated(mem: MemoryPipeline, records: int, what: str) -> None:
    """Wait until ``records`` records in all have been written to Honcho (none given up)."""
    await mem.flush()
    await eventually(mem, lambda: mem.stats().replicated_turns == records, what)
    assert mem.stats().replica_dead == 0


async def test_describe_end_and_delete_reach_honcho_after_the_sessions_turns(
    tmp_path: Path, fake: FakeHoncho
) -> None:
    """A describe, an end and a delete reach Honcho in their session's order: s1's Honcho
    metadata becomes its local row (model, source, model config, end and its reason; the
    system prompt only as its length), s2, whose turns Honcho had, is gone from Honcho with
    its messages, and s1's turns are there exactly once, in order."""
    backend = HonchoBackend(honcho_config(fake))
    async with MemoryPipeline(settings(tmp_path), backend) as mem:
        keys = {sid: conversation(mem, sid, 3) for sid in ("s1", "s2")}
        await replicated(mem, 6, "the turns replicated")
        assert on_server(fake, "s2") == each_once_in_order(keys["s2"]), "Honcho has s2"
        mem.sessions.describe_nowait("s1", source="cli", model="model-7",
                                     model_config={"temperature": 0.2},
                                     system_prompt="Be brief. " * 500)
        mem.sessions.end_nowait("s1", "user_exit")
        mem.sessions.delete_nowait("s2")
        await replicated(mem, 9, "the lifecycle records replicated")
        local = await mem.sessions.get_session("s1")
    assert local is not None
    s1 = fake.session(honcho_id("s1"), WORKSPACE)
    assert s1 is not None
    md = s1["metadata"]
    assert (md["session_id"], md["source"], md["model"], md["user_id"]) == (
        "s1", "cli", "model-7", "u1")
    assert md["model_config"] == {"temperature": 0.2}
    assert (md["ended_at"], md["end_reason"]) == (local.ended_at, "user_exit")
    assert md["message_count"] == 6 and md["started_at"] == local.started_at
    assert "system_prompt" not in md and md["system_prompt_chars"] == 5000
    assert fake.session(honcho_id("s2"), WORKSPACE) is None, "the delete reached Honcho"
    assert fake.session_messages(honcho_id("s2")) == [], "its messages went with it"
    assert on_server(fake, "s1") == each_once_in_order(keys["s1"])
    assert count_rows(tmp_path / "memory.db", "SELECT count(*) FROM replica_outbox") == 0


async def test_a_turn_after_a_delete_starts_the_honcho_session_anew(
    tmp_path: Path, fake: FakeHoncho
) -> None:
    """A delete reaches Honcho before the session's turn accepted after it: Honcho ends up
    with the new turn alone in the session (its peers set up again), neither the old turns
    nor an empty session. (test_honcho_backend checks the order within one write.)"""
    backend = HonchoBackend(honcho_config(fake))
    async with MemoryPipeline(settings(tmp_path), backend) as mem:
        conversation(mem, "s", 2)
        await replicated(mem, 2, "the first turns replicated")
        mem.sessions.delete_nowait("s")
        later = mem.sync_turn("a new start", "welcome back", session_id="s", user_id="u1").key
        await replicated(mem, 4, "the delete and the later turn replicated")
    assert on_server(fake, "s") == each_once_in_order([later])
    s = fake.session(honcho_id("s"), WORKSPACE)
    assert s is not None and set(s["peers"]) == {backend.assistant,
                                                 backend.user_peer_name("u1", "s")}


async def test_an_imported_session_reaches_honcho_once_however_often_it_is_imported(
    tmp_path: Path, fake: FakeHoncho
) -> None:
    """An imported session's messages reach Honcho exactly once, in order, each with the
    key of the turn it was part of, and its metadata with them: importing the file again
    changes nothing, and importing it after a local delete replaces Honcho's copy (the
    delete reaches Honcho first) rather than adding a second one."""
    async with MemoryPipeline(Settings(db_path=tmp_path / "source.db")) as source:
        keys = conversation(source, "imp", 4)
        source.sessions.describe_nowait("imp", model="model-3")
        source.sessions.end_nowait("imp", "done")
        await source.flush()
        lines = [line async for line in source.sessions.export(session_id="imp")]
    expected = [(k, text) for n, k in enumerate(keys)
                for text in (f"question {n} of imp", f"answer {n}")]

    def on_honcho() -> list[tuple[str, str]]:
        return [(m["metadata"][IMPORTED_FIELD], m["content"])
                for m in fake.session_messages(honcho_id("imp"), WORKSPACE)]

    backend = HonchoBackend(honcho_config(fake))
    async with MemoryPipeline(settings(tmp_path), backend) as mem:
        first = await mem.sessions.import_lines(lines)
        again = await mem.sessions.import_lines(lines)
        assert (first.imported, again.imported, again.skipped) == (1, 0, 1)
        await replicated(mem, 1, "the import replicated")
        assert on_honcho() == expected
        mem.sessions.delete_nowait("imp")
        await mem.flush()
        assert (await mem.sessions.import_lines(lines)).imported == 1
        await replicated(mem, 3, "the delete and the import again replicated")
    assert on_honcho() == expected
    s = fake.session(honcho_id("imp"), WORKSPACE)
    assert s is not None
    assert (s["metadata"]["model"], s["metadata"]["end_reason"]) == ("model-3", "done")


async def test_a_delete_that_meets_a_500_is_retried_and_lands_once(
    tmp_path: Path, fake: FakeHoncho
) -> None:
    """A server error on the delete is retried, not given up: the session is deleted on
    Honcho by exactly one successful call after the failed one (no second delete, no dead
    letter), and its messages are gone."""
    backend = HonchoBackend(honcho_config(fake))
    async with MemoryPipeline(settings(tmp_path), backend) as mem:
        conversation(mem, "s", 2)
        await replicated(mem, 2, "the turns replicated")
        fake.fail("delete_session", times=1, status=500)
        mem.sessions.delete_nowait("s")
        await replicated(mem, 3, "the delete replicated")
    assert fake.route_statuses("delete_session") == [500, 200]
    assert fake.session(honcho_id("s"), WORKSPACE) is None
    assert fake.session_messages(honcho_id("s")) == []
    assert backend.stats()["retries"] == 1
