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

from .fake_honcho import FakeHoncho
from .helpers import count_rows

WORKSPACE = "pipeline-ws"
WAIT_S = 60.0
OUTAGE_S = 30.0  # the scenario: the server is down this long


def honcho_config(fake: FakeHoncho, **changes: Any) -> HonchoConfig:
    values: dict[str, Any] = dict(
        base_url=fake.base_url, workspace_id=WORKSPACE, request_timeout_s=1.0,
        backoff_base_s=0.02, backoff_max_s=0.2, max_attempts=6, breaker_failures=4,
        breaker_cooldown_s=0.5, recall_deadline_s=1.0)
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
