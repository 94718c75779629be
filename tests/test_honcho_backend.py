"""HonchoBackend against a Honcho-compatible server over real HTTP, with the real honcho-ai SDK.

Every test states what a user would notice: turns arrive in order and exactly once, failures
name the turns and the reason, the API key never shows. Waiting is on conditions (the
backend's backoff sleeps, events) under ``anyio.fail_after``, never on a fixed sleep.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from hermes_async_memory.backends import (
    CircuitOpenError,
    HonchoBackend,
    HonchoConfig,
    HonchoWriteError,
    RecallRequest,
)
from hermes_async_memory.backends.honcho import INDEX_FIELD, KEY_FIELD, honcho_id
from hermes_async_memory.errors import ConfigurationError
from hermes_async_memory.ops import SNAPSHOT_FIELD, encode_session_op
from hermes_async_memory.turns import Turn

from .fake_honcho import FakeHoncho

WORKSPACE = "test-ws"
SECRET = "hk-test-SECRET-do-not-log-4242"


# -- fixtures ----------------------------------------------------------------------------


class Sleeps:
    """The backend's backoff sleep: records each delay, then really sleeps it."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self._waiters: list[tuple[int, anyio.Event]] = []

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        for n, event in self._waiters:
            if len(self.delays) >= n:
                event.set()
        await anyio.sleep(delay)

    async def wait_for(self, n: int) -> None:
        """Until the backend has backed off ``n`` times."""
        if len(self.delays) >= n:
            return
        event = anyio.Event()
        self._waiters.append((n, event))
        await event.wait()


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


MakeBackend = Callable[..., HonchoBackend]


@pytest.fixture
async def make_backend(fake: FakeHoncho) -> AsyncIterator[MakeBackend]:
    made: list[HonchoBackend] = []

    def make(*, sleep: Any = None, clock: Any = None, **changes: Any) -> HonchoBackend:
        values: dict[str, Any] = dict(
            base_url=fake.base_url, workspace_id=WORKSPACE, request_timeout_s=5.0,
            backoff_base_s=0.01, backoff_max_s=0.04, max_attempts=5,
            breaker_failures=50, breaker_cooldown_s=30.0, max_inflight_s=0.3)
        values.update(changes)
        kwargs: dict[str, Any] = {}
        if sleep is not None:
            kwargs["sleep"] = sleep
        if clock is not None:
            kwargs["clock"] = clock
        backend = HonchoBackend(HonchoConfig(**values), **kwargs)
        made.append(backend)
        return backend

    yield make
    for b in made:
        await b.aclose()


def turn(session_id: str, n: int, user_id: str | None = "ada", *, user_text: str | None = None,
         assistant_text: str | None = None) -> Turn:
    return Turn.build(
        key=f"k-{session_id}-{n}", session_id=session_id, user_id=user_id,
        accepted_at=time.time(),
        messages=[("user", user_text or f"question {n} of {session_id}", None, None, None),
                  ("assistant", assistant_text or f"answer {n} of {session_id}", None, None,
                   None)],
        metadata=None)


def stored(fake: FakeHoncho, session_id: str) -> list[tuple[str, int]]:
    """(turn key, index in turn) of the session's messages on the server, in order."""
    return [(m["metadata"][KEY_FIELD], m["metadata"][INDEX_FIELD])
            for m in fake.session_messages(honcho_id(session_id), WORKSPACE)]


def expected(turns: list[Turn]) -> list[tuple[str, int]]:
    return [(t.key, i) for t in turns for i in range(t.n_messages)]


# -- the fake is faithful ------------------------------------------------------------------


async def test_the_real_sdk_parses_every_route_of_the_fake(fake: FakeHoncho) -> None:
    from honcho import Honcho, MessageCreateParams, NotFoundError, UnprocessableEntityError
    from honcho.api_types import SessionPeerConfig

    honcho = Honcho(base_url=fake.base_url, workspace_id=WORKSPACE, max_retries=0)
    alice = await honcho.aio.peer("alice")
    await honcho.aio.peer("bot")
    session = await honcho.aio.session("s1", peers=[
        ("alice", SessionPeerConfig(observe_me=True)),
        ("bot", SessionPeerConfig(observe_me=False, observe_others=True))])
    await session.aio.add_peers([("carol", SessionPeerConfig())])
    assert (await session.aio.get_peer_configuration("bot")).observe_others is True
    await session.aio.set_peer_configuration("bot", SessionPeerConfig(observe_me=True))
    assert {p.id for p in await session.aio.peers()} == {"alice", "bot", "carol"}
    added = await session.aio.add_messages([
        MessageCreateParams(content="I hike in Lisbon", peer_id="alice",
                            metadata={"turn_key": "k1", "turn_msg": 0}),
        MessageCreateParams(content="Lisbon has hills", peer_id="bot",
                            metadata={"turn_key": "k1", "turn_msg": 1})])
    assert [m.content for m in added] == ["I hike in Lisbon", "Lisbon has hills"]
    page = await session.aio.messages(filters={"metadata": {"turn_key": {"in": ["k1"]}}},
                                      size=100)
    assert [m.metadata["turn_msg"] for m in page.items] == [0, 1]
    none = await session.aio.messages(filters={"metadata": {"turn_key": {"in": ["k2"]}}})
    assert none.items == [] and not none.has_next_page()
    ctx = await session.aio.context(tokens=100, summary=True, peer_target="alice",
                                    search_query="hike")
    assert [m.content for m in ctx.messages] == ["I hike in Lisbon", "Lisbon has hills"]
    assert "hike" in (ctx.peer_representation or "")
    assert "hike" in await alice.aio.representation(search_query="hike", search_top_k=3)
    await alice.aio.set_card(["hikes"])
    assert await alice.aio.get_card() == ["hikes"]
    assert len(await session.aio.search("lisbon", limit=5)) == 2
    assert len(await honcho.aio.search("lisbon", filters={"metadata": {"turn_key": "k1"}})) == 2
    assert len(await alice.aio.search("lisbon")) == 1
    answer = await alice.aio.chat("where does alice hike", session="s1", reasoning_level="low")
    assert answer is not None and "Lisbon" in answer
    with pytest.raises(UnprocessableEntityError):  # the server's batch limit
        await session.aio.add_messages([MessageCreateParams(content="x", peer_id="alice")] * 101)
    with pytest.raises(UnprocessableEntityError):  # the server's id pattern
        await honcho.aio.session("not valid!")
    await session.aio.set_metadata({"model": "m-1"})
    assert await session.aio.get_metadata() == {"model": "m-1"}
    await session.aio.delete()  # the session goes, with its messages
    assert fake.session("s1", WORKSPACE) is None and fake.session_messages("s1") == []
    with pytest.raises(NotFoundError):
        await session.aio.delete()


# -- writing -----------------------------------------------------------------------------


async def test_turns_of_50_sessions_arrive_in_order_exactly_once(
        fake: FakeHoncho, make_backend: MakeBackend) -> None:
    backend = make_backend()
    # Sessions of 1..70 turns, so some need several calls of at most 100 messages; the
    # turns interleave across sessions in accept order, as the pipeline hands them over.
    per_session = {f"s{i:02d}": [turn(f"s{i:02d}", n, user_id=f"u{i % 7}")
                                 for n in range(1 + (i * 7) % 70)] for i in range(50)}
    accept_order: list[Turn] = []
    for n in range(70):
        accept_order += [ts[n] for ts in per_session.values() if n < len(ts)]
    third = len(accept_order) // 3
    chunks = [accept_order[:third], accept_order[third:2 * third], accept_order[2 * third:]]
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:  # three writes at once, in call order
            for chunk in chunks:
                tg.start_soon(backend.write, chunk)

    for sid, turns in per_session.items():
        assert stored(fake, sid) == expected(turns), sid
    assert fake.calls["session"] == 50  # configured once each
    assert fake.calls["peer"] == 1 and fake.calls["workspace"] == 1
    assert fake.max_in_flight <= backend.config.write_concurrency
    assert backend.stats()["turns_written"] == len(accept_order)


async def test_one_call_per_session_when_its_turns_fit(
        fake: FakeHoncho, make_backend: MakeBackend) -> None:
    backend = make_backend()
    turns = [turn(f"s{s}", n) for n in range(20) for s in range(50)]  # 40 messages a session
    await backend.write(turns)
    assert fake.calls["add_messages"] == 50
    assert fake.total_calls() == 50 + 50 + 2  # + session set-up, workspace, assistant peer
    later = [turn(f"s{s}", n) for n in range(20, 40) for s in range(50)]
    before = fake.total_calls()
    await backend.write(later)
    assert fake.total_calls() - before == 50  # known sessions: messages only


async def test_server_errors_are_retried_without_duplicates(
        fake: FakeHoncho, make_backend: MakeBackend) -> None:
    sleeps = Sleeps()
    backend = make_backend(sleep=sleeps)
    await backend.write([turn("warm", 0)])
    fake.fail("add_messages", times=3, status=500)
    turns = [turn("s1", n) for n in range(4)]
    with anyio.fail_after(10):
        await backend.write(turns)
    assert stored(fake, "s1") == expected(turns)
    # Backoff from backoff_base_s (0.01 s), doubling, capped at backoff_max_s (0.04 s),
    # with up to half of each wait taken off at random.
    assert len(sleeps.delays) == 3
    for delay, full in zip(sleeps.delays, (0.01, 0.02, 0.04), strict=True):
        assert full / 2 <= delay <= full

    # A 500 that comes after the server stored the batch: the retry finds it and sends
    # nothing again.
    fake.fail_after_commit(1)
    more = [turn("s1", n) for n in range(4, 8)]
    with anyio.fail_after(10):
        await backend.write(more)
    assert stored(fake, "s1") == expected(turns + more)
    assert backend.stats()["resend_skipped"] == 8


async def test_429_waits_as_long_as_retry_after_says(
        fake: FakeHoncho, make_backend: MakeBackend) -> None:
    sleeps = Sleeps()
    backend = make_backend(sleep=sleeps)
    await backend.write([turn("s1", 0)])
    fake.fail("add_messages", times=1, status=429, retry_after="0.3")
    with anyio.fail_after(10):
        await backend.write([turn("s1", 1)])
    first, second = fake.route_times("add_messages")[-2:]
    assert second - first >= 0.3
    assert sleeps.delays == [pytest.approx(0.3, rel=0.11)]
    assert stored(fake, "s1") == expected([turn("s1", 0), turn("s1", 1)])
    assert fake.calls["list_messages"] == 0  # a 429 means not applied: no check needed


async def test_a_retry_after_beyond_the_limit_fails_the_batch_for_later(
        fake: FakeHoncho, make_backend: MakeBackend) -> None:
    backend = make_backend(retry_after_max_s=5.0)
    fake.fail("add_messages", times=1, status=429, retry_after="120")
    with anyio.fail_after(5), pytest.raises(HonchoWriteError) as info:
        await backend.write([turn("s1", 0)])
    (failure,) = info.value.failures
    assert failure.permanent is False and "Retry-After 120" in failure.reason


async def test_a_response_lost_after_the_commit_is_not_sent_twice(
        fake: FakeHoncho, make_backend: MakeBackend) -> None:
    backend = make_backend(request_timeout_s=0.3)
    await backend.write([turn("s1", 0)])
    fake.hang_after_commit(1)
    turns = [turn("s1", n) for n in range(1, 4)]
    with anyio.fail_after(10):
        await backend.write(turns)
    assert stored(fake, "s1") == expected([turn("s1", 0), *turns])
    assert fake.calls["add_messages"] == 2  # the first write's, and the one that timed out
    assert fake.calls["list_messages"] == 1
    assert backend.stats()["resend_skipped"] == 6


async def test_writes_go_through_once_the_server_is_back(
        fake: FakeHoncho, make_backend: MakeBackend) -> None:
    sleeps = Sleeps()
    backend = make_backend(sleep=sleeps, max_attempts=200, request_timeout_s=1.0)
    await backend.write([turn("s1", 0)])
    await anyio.to_thread.run_sync(fake.down)
    turns = [turn(sid, n) for n in range(1, 4) for sid in ("s1", "s2")]
    with anyio.fail_after(15):
        async with anyio.create_task_group() as tg:
            tg.start_soon(backend.write, turns)
            await sleeps.wait_for(3)  # refused three times
            await anyio.to_thread.run_sync(fake.up)
    assert stored(fake, "s1") == expected([turn("s1", 0), *[t for t in turns
                                                              if t.session_id == "s1"]])
    assert stored(fake, "s2") == expected([t for t in turns if t.session_id == "s2"])


async def test_a_refused_turn_fails_with_the_reason_and_the_rest_is_written(
        fake: FakeHoncho, make_backend: MakeBackend) -> None:
    backend = make_backend()
    fake.refuse_content("POISON")
    s1 = [turn("s1", n, user_text="POISON here" if n == 3 else None) for n in range(6)]
    s2 = [turn("s2", n) for n in range(3)]
    with anyio.fail_after(10), pytest.raises(HonchoWriteError) as info:
        await backend.write(s1 + s2)
    (failure,) = info.value.failures
    assert failure.key == s1[3].key and failure.permanent
    assert "422" in failure.reason and "content refused by the server" in failure.reason
    assert info.value.failed_keys == {s1[3].key} and info.value.written == 8
    assert stored(fake, "s1") == expected(s1[:3] + s1[4:])
    assert stored(fake, "s2") == expected(s2)

    later = turn("s1", 6)
    await backend.write([later])  # the session goes on
    assert stored(fake, "s1") == expected(s1[:3] + s1[4:] + [later])


async def test_a_batch_out_of_attempts_fails_with_the_rest_of_its_session(
        fake: FakeHoncho, make_backend: MakeBackend) -> None:
    backend = make_backend(max_attempts=2)
    await backend.write([turn("s1", 0)])
    fake.fail("add_messages", times=2, status=502)
    turns = [turn("s1", n) for n in range(1, 121)]  # 240 messages: three calls
    with anyio.fail_after(10), pytest.raises(HonchoWriteError) as info:
        await backend.write(turns)
    failures = info.value.failures
    assert [f.key for f in failures] == [t.key for t in turns]  # all of them, in order
    assert not any(f.permanent for f in failures)
    assert "gave up after 2 attempts" in failures[0].reason
    assert "not attempted" in failures[-1].reason
    # The first call's 50 turns were sent and failed; the 70 behind them were never sent.
    assert [f.attempted for f in failures] == [True] * 50 + [False] * 70
    assert stored(fake, "s1") == expected([turn("s1", 0)])  # nothing out of order

    await backend.write(turns)  # later, the same turns go through, in order
    assert stored(fake, "s1") == expected([turn("s1", 0), *turns])


# -- session lifecycle records -----------------------------------------------------------


def record(session_id: str, key: str, action: str, snapshot: dict[str, Any] | None = None,
           **fields: Any) -> Turn:
    """A session lifecycle record as the replica outbox hands it over: with the snapshot of
    the local row that a describe, an end or an import carries."""
    payload = encode_session_op(key, session_id, "ada", time.time(), action, **fields)
    if snapshot is not None:
        payload = json.dumps({**json.loads(payload), SNAPSHOT_FIELD: snapshot})
    return Turn.decode(payload)


LIFECYCLE_ROUTES = ("add_messages", "delete_session", "update_session")


async def test_lifecycle_records_run_in_their_sessions_order_within_one_write(
        fake: FakeHoncho, make_backend: MakeBackend) -> None:
    """In one write, a session's delete and describe run between its turns in commit
    order: the turn before the delete goes with it, the turns after it are in the session
    made anew, and the session's metadata is the describe's snapshot of the local row."""
    backend = make_backend()
    t0, t1, t2 = (turn("s", n) for n in range(3))
    snapshot = {"model": "model-9", "end_reason": None}
    describe = record("s", "desc", "describe", snapshot, fields={"model": "model-9"})
    await backend.write([t0, record("s", "del", "delete"), t1, describe, t2])
    assert stored(fake, "s") == expected([t1, t2])
    assert fake.route_sequence(*LIFECYCLE_ROUTES) == [
        "add_messages", "delete_session", "add_messages", "update_session", "add_messages"]
    session = fake.session("s", WORKSPACE)
    assert session is not None and session["metadata"] == {**snapshot, "session_id": "s"}
    assert set(session["peers"]) == {backend.assistant, backend.user_peer_name("ada", "s")}
    assert backend.stats()["turns_written"] == 5


async def test_a_metadata_call_that_a_later_one_overwrites_is_not_made(
        fake: FakeHoncho, make_backend: MakeBackend) -> None:
    """A session described at each turn start, sent as a backlog: only the last snapshot is
    sent (the earlier ones would be overwritten in the same write), so the turns before it
    go in one batch and the turn after it in another; every record counts as written."""
    backend = make_backend()
    units: list[Turn] = []
    for n in range(5):
        units += [record("s", f"desc-{n}", "describe", {"message_count": 2 * n},
                         fields={"model": "m"}), turn("s", n)]
    await backend.write(units)
    assert stored(fake, "s") == expected(units[1::2])
    assert fake.route_sequence(*LIFECYCLE_ROUTES) == [
        "add_messages", "update_session", "add_messages"]
    session = fake.session("s", WORKSPACE)
    assert session is not None and session["metadata"]["message_count"] == 8
    assert backend.stats()["turns_written"] == 10


async def test_a_refused_lifecycle_call_fails_its_record_alone_and_the_session_goes_on(
        fake: FakeHoncho, make_backend: MakeBackend) -> None:
    """A lifecycle call the server refuses fails that record alone, for good, with the
    server's reason; the session's later turns are still written. A 404 on a delete is no
    failure: Honcho does not have the session, as asked."""
    backend = make_backend()
    fake.fail("update_session", times=1, status=422, detail="metadata refused")
    before, after = turn("s", 0), turn("s", 1)
    describe = record("s", "desc", "describe", {"model": "m"}, fields={"model": "m"})
    with anyio.fail_after(10), pytest.raises(HonchoWriteError) as info:
        await backend.write([before, describe, after])
    (failure,) = info.value.failures
    assert failure.key == "desc" and failure.permanent and "metadata refused" in failure.reason
    assert stored(fake, "s") == expected([before, after])
    await backend.write([record("never-there", "gone", "delete")])
    assert fake.route_statuses("delete_session") == [404]


async def test_a_lifecycle_call_out_of_attempts_holds_back_the_rest_of_its_session(
        fake: FakeHoncho, make_backend: MakeBackend) -> None:
    """A delete still failing after max_attempts fails (tried, not for good), and the
    session's turn behind it is not sent before it: it fails as never attempted. The next
    write sends both, in order."""
    backend = make_backend(max_attempts=2)
    first, later = turn("s", 0), turn("s", 1)
    await backend.write([first])
    fake.fail("delete_session", times=2, status=502)
    delete = record("s", "del", "delete")
    with anyio.fail_after(10), pytest.raises(HonchoWriteError) as info:
        await backend.write([delete, later])
    assert [(f.key, f.permanent, f.attempted) for f in info.value.failures] == [
        ("del", False, True), (later.key, False, False)]
    assert stored(fake, "s") == expected([first])
    await backend.write([delete, later])
    assert stored(fake, "s") == expected([later])


async def test_the_api_key_is_sent_but_never_logged_or_shown(
        fake: FakeHoncho, make_backend: MakeBackend, caplog: pytest.LogCaptureFixture) -> None:
    fake.api_key = SECRET
    caplog.set_level(logging.DEBUG)
    backend = make_backend(api_key=SECRET)
    with capture_logs() as logs:
        await backend.write([turn("s1", 0)])  # accepted: the key went out
        fake.fail("add_messages", times=1, status=500)
        fake.refuse_content("POISON")
        with pytest.raises(HonchoWriteError) as refused:
            await backend.write([turn("s1", 1), turn("s1", 2, user_text="POISON")])
        await backend.recall_with_source(RecallRequest("question", "nowhere", "ada", 5))
        wrong = make_backend(api_key="hk-wrong-key")
        with pytest.raises(HonchoWriteError) as unauthorized:
            await wrong.write([turn("s1", 3)])
    assert stored(fake, "s1") == expected([turn("s1", 0), turn("s1", 1)])
    assert "401" in unauthorized.value.failures[0].reason
    assert not unauthorized.value.failures[0].permanent
    assert any(e["event"] == "honcho_retry" for e in logs)
    shown = [repr(logs), caplog.text, repr(backend), str(backend), repr(backend.config),
             str(backend.stats()), str(refused.value), repr(refused.value.failures),
             str(unauthorized.value), repr(HonchoConfig.from_env({"HONCHO_API_KEY": SECRET}))]
    for text in shown:
        assert SECRET not in text


async def test_the_circuit_opens_fails_fast_and_recovers(
        fake: FakeHoncho, make_backend: MakeBackend) -> None:
    clock = FakeClock()
    backend = make_backend(clock=clock, breaker_failures=3, breaker_cooldown_s=30.0,
                           max_attempts=10)
    await backend.write([turn("s1", 0)])
    fake.fail("*", times=1000, status=503)
    with anyio.fail_after(10), pytest.raises(HonchoWriteError) as info:
        await backend.write([turn("s1", 1)])
    assert "circuit open" in info.value.failures[0].reason
    assert info.value.failures[0].attempted, "it was sent three times before the circuit opened"
    assert fake.total_calls() == 4 + 3  # the first write's 4, then 3 failures opened it
    assert backend.breaker.state == "open"

    calls = fake.total_calls()
    with pytest.raises(CircuitOpenError) as held:  # fails fast: nothing reaches the server
        await backend.write([turn("s1", 1), turn("s2", 0)])
    assert fake.total_calls() == calls
    assert not any(f.attempted for f in held.value.failures)

    clock.t += 31  # cooled down: one probe, which fails, and the circuit opens again
    with pytest.raises(HonchoWriteError):
        await backend.write([turn("s1", 1)])
    assert fake.total_calls() == calls + 1 and backend.breaker.state == "open"

    fake.clear_faults()
    clock.t += 31
    turns = [turn("s1", 1), *[turn(f"s{i}", 0) for i in range(2, 12)]]
    with anyio.fail_after(10):
        await backend.write(turns)  # the probe succeeds, the other sessions follow it
    assert backend.breaker.state == "closed" and backend.breaker.opened == 2
    assert stored(fake, "s1") == expected([turn("s1", 0), turn("s1", 1)])
    assert all(stored(fake, f"s{i}") == expected([turn(f"s{i}", 0)]) for i in range(2, 12))
    # s1's turn 1 failed in three writes and s2's turn 0 in one: two turns failed.
    assert backend.stats()["turns_failed"] == 2


async def test_a_turn_that_fails_in_several_writes_counts_as_one_failed_turn(
        fake: FakeHoncho, make_backend: MakeBackend) -> None:
    """turns_failed counts turns, not attempts or writes: two turns that fail in three writes
    of two attempts each count 2; written at the fourth, they still count 2 (they did fail),
    and a turn that fails afterwards counts once more. (The fourth write, which says they may
    have been sent, need not wait out the in-flight time since the backend started: they came
    to it as new turns, so no earlier run sent them.)"""
    backend = make_backend(max_attempts=2, max_inflight_s=60.0)
    await backend.write([turn("s1", 0)])
    turns = [turn("s1", 1), turn("s1", 2)]
    fake.fail("add_messages", times=6, status=503)
    for _ in range(3):
        with anyio.fail_after(10), pytest.raises(HonchoWriteError) as info:
            await backend.write(turns)
        assert info.value.failed_keys == {t.key for t in turns}
    assert fake.calls["add_messages"] == 1 + 6
    assert backend.stats()["turns_failed"] == 2
    with anyio.fail_after(10):
        await backend.write(turns, maybe_sent=True)
    assert stored(fake, "s1") == expected([turn("s1", 0), *turns])
    stats = backend.stats()
    assert (stats["turns_written"], stats["turns_failed"], stats["inflight_waits"]) == (3, 2, 0)

    fake.fail("add_messages", times=2, status=503)
    with anyio.fail_after(10), pytest.raises(HonchoWriteError):
        await backend.write([turn("s1", 3)])
    assert backend.stats()["turns_failed"] == 3


async def test_a_replay_sends_only_what_the_server_lacks(
        fake: FakeHoncho, make_backend: MakeBackend) -> None:
    backend = make_backend()
    turns = [turn("s1", n) for n in range(6)]
    await backend.write(turns[:4])
    await backend.write(turns[2:], maybe_sent=True)  # say, after a crash mid-replication
    assert stored(fake, "s1") == expected(turns)
    assert backend.stats()["resend_skipped"] == 4


async def test_long_messages_are_split_rather_than_refused(
        fake: FakeHoncho, make_backend: MakeBackend) -> None:
    backend = make_backend()
    text = "".join(f"{i:05d} " for i in range(10_000))  # 60,000 characters
    await backend.write([turn("s1", 0, assistant_text=text)])
    rows = fake.session_messages("s1", WORKSPACE)
    assert [r["metadata"]["role"] for r in rows] == ["user"] + ["assistant"] * 3
    assert "".join(r["content"] for r in rows[1:]) == text


async def test_ids_are_made_to_fit_the_server_and_stay_apart(
        fake: FakeHoncho, make_backend: MakeBackend) -> None:
    assert honcho_id("plain-id_42") == "plain-id_42"
    odd = ["chat:42/é", "chat:42/e", "chat_42_e", "a" * 600, "x-h0123456789abcdef", ""]
    mapped = [honcho_id(raw) for raw in odd]
    assert mapped == [honcho_id(raw) for raw in odd]  # deterministic
    assert len(set(mapped)) == len(odd)  # distinct, also from the kept "chat_42_e"
    assert all(0 < len(m) <= 512 and m.replace("-", "").replace("_", "").isalnum()
               for m in mapped)

    backend = make_backend()
    turns = [turn("chat:42/é", 0, user_id="ada@example.com"), turn("chat:42/e", 0)]
    await backend.write(turns)
    assert stored(fake, "chat:42/é") == expected(turns[:1])
    assert stored(fake, "chat:42/e") == expected(turns[1:])
    assert fake.session_messages(honcho_id("chat:42/é"))[0]["peer_id"] == honcho_id(
        "user-ada@example.com")


async def test_sessions_can_be_left_to_the_server_defaults(
        fake: FakeHoncho, make_backend: MakeBackend) -> None:
    backend = make_backend(configure_sessions=False)
    turns = [turn(f"s{s}", n) for n in range(3) for s in range(5)]
    await backend.write(turns)
    assert fake.calls["session"] == 0 and fake.calls["add_messages"] == 5
    assert all(stored(fake, f"s{s}") == expected([t for t in turns if t.session_id == f"s{s}"])
               for s in range(5))


# -- recall ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["context", "representation", "card", "search", "chat"])
async def test_recall_answers_from_the_configured_source(
        fake: FakeHoncho, make_backend: MakeBackend, mode: str) -> None:
    backend = make_backend(recall_mode=mode)
    await backend.write([
        turn("s1", 0, user_text="I go hiking in Lisbon", assistant_text="Lisbon hills, nice"),
        turn("s1", 1, user_text="my cat is called Miso", assistant_text="Hello Miso")])
    user_peer = backend.user_peer_name("ada", "s1")
    fake.cards[(WORKSPACE, user_peer, user_peer)] = ["Hikes in Lisbon", "Has a cat, Miso"]
    block, source = await backend.recall_with_source(
        RecallRequest("hiking in Lisbon", "s1", "ada", 5))
    assert source == f"honcho:{mode}" and backend.last_recall_source == source
    assert block is not None and "Lisbon" in block


async def test_recall_falls_back_to_the_local_store(
        fake: FakeHoncho, make_backend: MakeBackend) -> None:
    request = RecallRequest("hiking", "s1", "ada", 5)
    off = make_backend(recall_mode="off")
    assert await off.recall_with_source(request) == (None, "local:off")

    backend = make_backend(recall_mode="chat", recall_deadline_s=0.2)
    assert await backend.recall_with_source(request) == (None, "local:empty")  # nothing yet
    await backend.write([turn("s1", 0, user_text="hiking")])
    fake.route_delays["peer_chat"] = 2.0
    started = time.monotonic()
    assert await backend.recall_with_source(request) == (None, "local:timeout")
    assert time.monotonic() - started < 1.0

    fake.route_delays.clear()
    fake.fail("peer_chat", times=1, status=500)
    assert await backend.recall_with_source(request) == (None, "local:error")
    assert backend.stats()["recall_sources"] == {
        "local:empty": 1, "local:timeout": 1, "local:error": 1}


# -- configuration ------------------------------------------------------------------------


def test_config_from_env() -> None:
    config = HonchoConfig.from_env({
        "HONCHO_API_KEY": SECRET, "HONCHO_BASE_URL": "https://honcho.example.com",
        "HONCHO_WORKSPACE_ID": "prod", "HONCHO_ASSISTANT_PEER": "hermes-bot",
        "HONCHO_USER_PEER_PREFIX": "u-", "HONCHO_RECALL_MODE": "chat",
        "HONCHO_WRITE_CONCURRENCY": "8", "HONCHO_CONFIGURE_SESSIONS": "false"})
    assert (config.workspace_id, config.assistant_peer, config.user_peer_prefix) == (
        "prod", "hermes-bot", "u-")
    assert config.recall_mode == "chat" and config.write_concurrency == 8
    assert config.configure_sessions is False and config.api_key == SECRET
    assert SECRET not in repr(config)
    assert HonchoConfig.from_env({"HONCHO_BASE_URL": "http://localhost:8000"}).api_key is None
    with pytest.raises(ConfigurationError, match="api_key is required"):
        HonchoConfig.from_env({"HONCHO_BASE_URL": "https://api.honcho.dev"})
    with pytest.raises(ConfigurationError, match="HONCHO_WRITE_CONCURRENCY"):
        HonchoConfig.from_env({"HONCHO_API_KEY": "k", "HONCHO_WRITE_CONCURRENCY": "many"})
    with pytest.raises(ConfigurationError, match="recall_mode"):
        HonchoConfig(base_url="http://127.0.0.1:1", recall_mode="psychic")  # type: ignore[arg-type]


def test_the_library_imports_without_the_sdk() -> None:
    # Most deployments never use Honcho: importing the backend must not cost them the SDK's
    # imports (or fail when the honcho extra is not installed).
    code = ("import sys, hermes_async_memory\n"
            "from hermes_async_memory.backends.honcho import HonchoBackend, HonchoConfig\n"
            "HonchoBackend(HonchoConfig(base_url='http://127.0.0.1:1'))\n"
            "print(sorted({'honcho', 'httpx', 'pydantic'} & set(sys.modules)))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]"
