"""Exactly once when Honcho commits a request after its client gave up (issue 14).

Honcho does not abort a request whose client disconnected, and runs a session's writes one
after the other: a batch the client timed out on may commit seconds later, and a resend
queued behind it commits too. The Honcho-compatible server (tests/fake_honcho.py) does the
same over real HTTP: ``hold_writes`` keeps add_messages requests on the server, past the
client's timeout, until the test lets them commit or drops them.

The backend is told the server's worst in-flight time (``max_inflight_s``); it must neither
check nor resend before that has passed since the request went out. The tests release a held
request only once the backend has started that wait (its sleep, recorded), so they need no
fixed sleep; every message is then checked by its idempotency key and index.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.backends import HonchoBackend, HonchoConfig
from hermes_async_memory.errors import ConfigurationError
from hermes_async_memory.hermes import config as hermes_config

from .fake_honcho import FakeHoncho
from .helpers import count_rows
from .test_honcho_backend import WORKSPACE, expected, stored, turn

TIMEOUT_S = 0.2  # the client's request timeout
INFLIGHT_S = 1.0  # the server's worst in-flight time, as the backend is told
LONG_S = 0.5  # a sleep this long is the in-flight wait (the backoff is at most 0.04 s)
WAIT_S = 20.0


class Waits:
    """The backend's sleep: records each delay, tells the test when the backend starts to
    wait out the in-flight time, then really sleeps."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self.long = 0
        self._changed = anyio.Event()

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        if delay >= LONG_S:
            self.long += 1
            self._changed.set()
            self._changed = anyio.Event()
        await anyio.sleep(delay)

    async def in_flight_wait(self, n: int = 1) -> None:
        """Until the backend has started its ``n``-th in-flight wait."""
        while self.long < n:
            await self._changed.wait()


def config(fake: FakeHoncho, **changes: Any) -> HonchoConfig:
    values: dict[str, Any] = dict(
        base_url=fake.base_url, workspace_id=WORKSPACE, request_timeout_s=TIMEOUT_S,
        max_inflight_s=INFLIGHT_S, backoff_base_s=0.01, backoff_max_s=0.04, max_attempts=5,
        breaker_failures=50)
    values.update(changes)
    return HonchoConfig(**values)


Make = Callable[[Waits], HonchoBackend]


@pytest.fixture
async def make(fake: FakeHoncho) -> AsyncIterator[Make]:
    """A backend on the test's server whose sleeps go through ``waits``; closed at the end."""
    made: list[HonchoBackend] = []

    def build(waits: Waits) -> HonchoBackend:
        made.append(HonchoBackend(config(fake), sleep=waits))
        return made[-1]

    yield build
    for backend in made:
        await backend.aclose()


async def thread_wait(fn: Any, *args: Any) -> None:
    """A blocking wait of the fake server's (it runs in a thread of its own)."""
    await anyio.to_thread.run_sync(functools.partial(fn, *args), abandon_on_cancel=True)


async def test_a_batch_the_server_commits_after_the_client_gave_up_is_stored_once(
        fake: FakeHoncho, make: Make) -> None:
    waits = Waits()
    backend = make(waits)
    first = turn("s1", 0)
    await backend.write([first])  # the session exists
    held = fake.hold_writes(1)
    turns = [turn("s1", n) for n in range(1, 6)]
    with anyio.fail_after(WAIT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(backend.write, turns)
            await waits.in_flight_wait()  # the client timed out, and waits
            held.release()  # only now does the server commit the batch
    assert stored(fake, "s1") == expected([first, *turns])  # each message once, in order
    assert held.committed == 1
    assert fake.calls["add_messages"] == 2, "no resend: the check found the late commit"
    assert fake.calls["list_messages"] == 1
    # The check went out only once the in-flight time had passed since the request was sent
    # (the server saw it come in a little later; without the wait, it checks a backoff after
    # the timeout).
    check_ended = fake.route_times("list_messages")[0]
    assert check_ended - held.arrivals[0] >= INFLIGHT_S - TIMEOUT_S
    stats = backend.stats()
    assert (stats["turns_written"], stats["turns_failed"]) == (6, 0)
    assert (stats["inflight_waits"], stats["resend_skipped"]) == (1, 10)


async def test_a_lost_batch_is_resent_after_the_wait_and_checked_again_before_each_resend(
        fake: FakeHoncho, make: Make) -> None:
    """The first request is lost on the server (nothing stored): after the in-flight time
    the check finds nothing, and the batch goes again. That resend times out too, and commits
    late: the backend waits again and checks again, and sends no third copy."""
    waits = Waits()
    backend = make(waits)
    first = turn("s1", 0)
    await backend.write([first])
    lost, late = fake.hold_writes(1), fake.hold_writes(1)
    turns = [turn("s1", n) for n in range(1, 4)]
    with anyio.fail_after(WAIT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(backend.write, turns)
            await waits.in_flight_wait(1)
            lost.lose()
            await waits.in_flight_wait(2)
            late.release()
    assert stored(fake, "s1") == expected([first, *turns])
    assert (lost.lost, late.committed) == (1, 1)
    assert fake.calls["add_messages"] == 3  # the first write, the lost one, the resend
    assert fake.calls["list_messages"] == 2  # before the resend, and after it
    assert late.arrivals[0] - lost.arrivals[0] >= INFLIGHT_S - TIMEOUT_S
    stats = backend.stats()
    assert (stats["turns_written"], stats["turns_failed"], stats["inflight_waits"]) == (4, 0, 2)


async def test_a_gateway_timeout_is_waited_out_a_server_error_is_not(
        fake: FakeHoncho, make: Make) -> None:
    """A 504 comes from a gateway that gave up on the server, which may still commit the
    request: the backend waits out the in-flight time before its check. A 500 comes from the
    server itself, done with the request: the check follows the backoff."""
    waits = Waits()
    backend = make(waits)
    turns = [turn("s1", n) for n in range(4)]
    await backend.write(turns[:1])
    fake.fail("add_messages", times=1, status=504)
    with anyio.fail_after(WAIT_S):
        await backend.write(turns[1:2])
    assert waits.long == 1 and backend.stats()["inflight_waits"] == 1
    fake.fail("add_messages", times=1, status=500)
    with anyio.fail_after(WAIT_S):
        await backend.write(turns[2:])
    assert waits.long == 1 and backend.stats()["inflight_waits"] == 1
    assert stored(fake, "s1") == expected(turns)
    assert fake.calls["list_messages"] == 2


async def test_while_a_session_waits_the_other_sessions_of_its_write_are_written(
        fake: FakeHoncho, make: Make) -> None:
    waits = Waits()
    backend = make(waits)
    held = fake.hold_writes(1, session="s1")
    s1 = [turn("s1", n) for n in range(3)]
    s2 = [turn("s2", n) for n in range(3)]
    with anyio.fail_after(WAIT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(backend.write, [*s1, *s2])
            await waits.in_flight_wait()
            await thread_wait(fake.wait_until, lambda: len(stored(fake, "s2")) == 6)
            assert held.committed == 0, "s2 was written while s1 waited"
            held.release()
    assert stored(fake, "s1") == expected(s1)
    assert stored(fake, "s2") == expected(s2)


async def test_a_shutdown_does_not_wait_and_the_next_run_checks_after_the_in_flight_time(
        fake: FakeHoncho, make: Make) -> None:
    """A write cancelled while it waits out the in-flight time (a shutdown) ends at once and
    sends nothing more. The next run (a new backend) is told the turns may have been sent: it
    checks only once the in-flight time has passed since it started, so it sees the earlier
    run's request that committed meanwhile, and sends nothing twice."""
    waits = Waits()
    backend = make(waits)
    first = turn("s1", 0)
    await backend.write([first])
    held = fake.hold_writes(1)
    turns = [turn("s1", n) for n in range(1, 4)]
    with anyio.fail_after(WAIT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(backend.write, turns)
            await waits.in_flight_wait()
            tg.cancel_scope.cancel()
    assert fake.calls["list_messages"] == 0 and fake.calls["add_messages"] == 2
    await backend.aclose()

    again_waits = Waits()
    again = make(again_waits)
    with anyio.fail_after(WAIT_S):
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(again.write, turns, maybe_sent=True))
            await again_waits.in_flight_wait()
            held.release()
    assert stored(fake, "s1") == expected([first, *turns])
    assert fake.calls["add_messages"] == 2 and fake.calls["list_messages"] == 1
    assert again.stats()["resend_skipped"] == 6


async def test_the_issue_through_the_pipeline_each_message_once_and_nothing_pending(
        tmp_path: Path, fake: FakeHoncho) -> None:
    """Issue 14 as it was seen: the server's messages table is locked while the pipeline
    writes three sessions, so every request outlives the client's timeout and commits late.
    Each message is stored once, and as soon as the replica outbox is empty,
    ``stats().replica_pending`` says 0."""
    waits = Waits()
    backend = HonchoBackend(config(fake), sleep=waits)
    async with MemoryPipeline(Settings(db_path=tmp_path / "memory.db"), backend) as mem:
        # One turn replicated first. The turns below may commit in several batches, some
        # read by the replicator before their commit is announced to it: replica_pending is
        # 0 all the same once the last of them is replicated.
        mem.sync_turn("hello", "hi", session_id="w", user_id="ada")
        await mem.flush()
        await mem.wait_until(lambda: mem.stats().replicated_turns == 1, timeout=WAIT_S)
        locked = fake.hold_writes(None)  # every write waits until the lock ends
        keys = {sid: [mem.sync_turn(f"question {n} of {sid}", f"answer {n}", session_id=sid,
                                    user_id="ada").key for n in range(count)]
                for sid, count in (("a", 4), ("b", 3), ("c", 3))}
        total = 1 + sum(len(k) for k in keys.values())
        await mem.flush()
        with anyio.fail_after(WAIT_S):
            # (The hello may have waited too: committed before the replicator's first look,
            # it counts as left by an earlier run.)
            await waits.in_flight_wait(waits.long + 1)
        locked.release()
        pending_when_done: list[int] = []

        def replicated() -> bool:
            stats = mem.stats()
            if stats.replicated_turns < total:
                return False
            pending_when_done.append(stats.replica_pending)
            return True

        await mem.wait_until(replicated, timeout=WAIT_S)
        assert pending_when_done == [0]
        assert mem.stats().replica_pending == 0 and mem.stats().replica_dead == 0
    assert count_rows(tmp_path / "memory.db", "SELECT count(*) FROM replica_outbox") == 0
    for sid, ks in keys.items():
        assert stored(fake, sid) == [(k, i) for k in ks for i in range(2)], sid
    assert locked.committed == locked.received >= 1
    stats = backend.stats()
    assert stats["turns_failed"] == 0 and stats["inflight_waits"] >= 1


def test_the_in_flight_time_is_a_setting() -> None:
    assert HonchoConfig(base_url="http://127.0.0.1:1").max_inflight_s == 10.0
    config = HonchoConfig.from_env({"HONCHO_BASE_URL": "http://127.0.0.1:1",
                                    "HONCHO_MAX_INFLIGHT_S": "2.5"})
    assert config.max_inflight_s == 2.5
    with pytest.raises(ConfigurationError, match="max_inflight_s"):
        HonchoConfig(base_url="http://127.0.0.1:1", max_inflight_s=-1)
    resolved = hermes_config.resolve(
        Path("/nonexistent-hermes-home"),
        {"backend": "honcho", "honcho_base_url": "http://127.0.0.1:8000",
         "honcho_max_inflight_s": 4}, {})
    assert resolved.settings.honcho is not None
    assert resolved.settings.honcho.max_inflight_s == 4.0


def test_a_held_request_times_out_the_client_and_still_commits(fake: FakeHoncho) -> None:
    """The fault itself, with a plain HTTP client: the server holds the request past the
    client's timeout, and stores it when released."""
    import httpx

    held = fake.hold_writes(1)
    url = f"{fake.base_url}/v3/workspaces/{WORKSPACE}/sessions/raw/messages"
    body = {"messages": [{"content": "hi", "peer_id": "ada", "metadata": {"turn_key": "k"}}]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=body, timeout=TIMEOUT_S)
    held.wait_received(1)
    assert fake.session_messages("raw", WORKSPACE) == []
    held.release()
    held.wait_committed(1)
    assert [m["content"] for m in fake.session_messages("raw", WORKSPACE)] == ["hi"]
