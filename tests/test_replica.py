"""The replica backend's own outbox: every committed turn reaches the backend exactly once, in
per-session order, across restarts, refusals and outages.

The backend here is a real ``Backend`` that keeps turns in memory and can be told to refuse
turns, to be unreachable, or to hold writes: faults of a remote service that a test on one
machine cannot otherwise cause. (tests/test_honcho_backend.py runs the Honcho backend against
an HTTP server.)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from hermes_async_memory import InMemoryBackend, MemoryPipeline, Settings, cli
from hermes_async_memory.backends.base import (
    BackendUnavailableError,
    BackendWriteError,
    RecallRequest,
    TurnFailure,
)
from hermes_async_memory.ops import encode_session_op, parse_session_record
from hermes_async_memory.replicator import Replicator
from hermes_async_memory.retry import Backoff
from hermes_async_memory.store import SqliteStore
from hermes_async_memory.turns import Turn

from .helpers import count_rows

WAIT_S = 30.0


async def eventually(mem: MemoryPipeline, check: Callable[[], bool], what: str) -> None:
    """Wait for ``check``: the pipeline wakes its waiters after every replica write,
    recall and commit."""
    try:
        await mem.wait_until(check, timeout=WAIT_S)
    except TimeoutError:
        raise AssertionError(f"not within {WAIT_S} s: {what}") from None


class ScriptedBackend(InMemoryBackend):
    """Keeps what it is sent; refuses the turns in ``refuse``; unreachable while ``down``;
    holds every write while ``hold`` is set; answers recalls with ``answer`` unless down."""

    name = "scripted"
    recalls = True

    def __init__(self) -> None:
        super().__init__()
        self.refuse: set[str] = set()
        self.hold_back: set[str] = set()  # failed as never sent (behind a failed batch, say)
        self.down = False
        self.hold: anyio.Event | None = None
        self.called = anyio.Event()  # set by the first write
        self.calls = 0
        self.maybe_sent_calls = 0
        self.answer: str | None = None

    async def write(self, turns: Sequence[Turn], *, maybe_sent: bool = False) -> None:
        self.calls += 1
        self.called.set()
        self.maybe_sent_calls += maybe_sent
        if self.hold is not None:
            await self.hold.wait()
        if self.down:
            raise BackendUnavailableError(
                [TurnFailure(t.key, t.session_id, "down", False) for t in turns], written=0)
        failures = [TurnFailure(t.key, t.session_id, "refused: 422 bad message", True)
                    for t in turns if t.key in self.refuse]
        failures += [TurnFailure(t.key, t.session_id, "not attempted", False, attempted=False)
                     for t in turns if t.key in self.hold_back]
        failed = self.refuse | self.hold_back
        await super().write([t for t in turns if t.key not in failed], maybe_sent=maybe_sent)
        if failures:
            raise BackendWriteError(failures, written=len(turns) - len(failures))

    async def recall(self, request: RecallRequest) -> str | None:
        if self.down:
            raise ConnectionError("backend down")
        return self.answer

    def keys(self, session_id: str) -> list[str]:
        return [t.key for t in self.turns[session_id]]


def settings(tmp_path: Path) -> Settings:
    return Settings(db_path=tmp_path / "memory.db", commit_retry_base_s=0.001)


async def test_every_committed_turn_reaches_the_backend_once_in_session_order(
    tmp_path: Path,
) -> None:
    backend = ScriptedBackend()
    accepted: dict[str, list[str]] = {}
    async with MemoryPipeline(settings(tmp_path), backend) as mem:
        for i in range(1200):
            sid = f"s{i % 30}"
            accepted.setdefault(sid, []).append(
                mem.sync_turn(f"q{i}", f"a{i}", session_id=sid, user_id=f"u{i % 4}").key)
        await mem.flush()
        await eventually(mem, lambda: mem.stats().replicated_turns == 1200, "all replicated")
        assert mem.stats().replica_errors == 0
    for sid, keys in accepted.items():
        assert backend.keys(sid) == keys, f"{sid}: each turn once, in accept order"
    sent = backend.turns["s0"][0]
    assert sent.user_text == "q0" and sent.assistant_text == "a0" and sent.user_id == "u0"
    assert count_rows(tmp_path / "memory.db", "SELECT count(*) FROM replica_outbox") == 0


async def test_turns_not_yet_replicated_at_close_are_sent_by_the_next_start_once(
    tmp_path: Path,
) -> None:
    backend = ScriptedBackend()
    backend.hold = anyio.Event()  # the backend never answers during the first run
    keys = []
    async with MemoryPipeline(settings(tmp_path), backend) as mem:
        for i in range(50):
            keys.append(mem.sync_turn(f"q{i}", f"a{i}", session_id="s").key)
        await mem.flush()
        with anyio.fail_after(WAIT_S):
            await backend.called.wait()  # a write is in flight
    assert backend.keys("s") == []
    assert count_rows(tmp_path / "memory.db", "SELECT count(*) FROM replica_outbox") == 50

    again = ScriptedBackend()
    async with MemoryPipeline(settings(tmp_path), again) as mem:
        await eventually(mem, lambda: mem.stats().replicated_turns == 50, "the backlog went out")
    assert again.keys("s") == keys
    assert again.maybe_sent_calls >= 1, "a replay says the turns may have been sent already"


async def test_a_refused_turn_is_a_dead_letter_and_its_session_goes_on(tmp_path: Path) -> None:
    backend = ScriptedBackend()
    async with MemoryPipeline(settings(tmp_path), backend) as mem:
        first = mem.sync_turn("fine", "ok", session_id="s").key
        await mem.flush()
        await eventually(mem, lambda: mem.stats().replicated_turns == 1, "first replicated")
        bad = mem.sync_turn("refused one", "ok", session_id="s").key
        backend.refuse.add(bad)
        later = [mem.sync_turn(f"later {i}", "ok", session_id="s").key for i in range(3)]
        await mem.flush()
        await eventually(mem, lambda: mem.stats().replicated_turns == 4, "the later turns went out")
        await eventually(mem, lambda: mem.stats().replica_dead == 1, "the dead letter is counted")
    assert backend.keys("s") == [first, *later]
    conn_rows = count_rows(
        tmp_path / "memory.db",
        f"SELECT count(*) FROM replica_outbox WHERE status = 'dead' AND turn_key = '{bad}' "
        "AND last_error LIKE '%422 bad message%'")
    assert conn_rows == 1


async def test_an_unreachable_backend_loses_nothing_and_counts_no_attempts(
    tmp_path: Path,
) -> None:
    backend = ScriptedBackend()
    backend.down = True
    async with MemoryPipeline(settings(tmp_path).replace(replica_max_attempts=2), backend) as mem:
        keys = [mem.sync_turn(f"q{i}", "a", session_id="s").key for i in range(20)]
        await mem.flush()
        await eventually(mem, lambda: backend.calls >= 4, "several tries while down")
        assert mem.stats().replica_dead == 0
        sends_while_down = backend.calls
        backend.down = False
        await eventually(mem, lambda: mem.stats().replicated_turns == 20, "caught up")
    assert backend.keys("s") == keys
    # Tried before, even uncounted: the backend is told to check what it already holds.
    assert backend.maybe_sent_calls >= backend.calls - sends_while_down >= 1


async def test_a_turn_the_backend_never_sent_uses_up_no_attempts(tmp_path: Path) -> None:
    backend = ScriptedBackend()
    async with MemoryPipeline(settings(tmp_path).replace(replica_max_attempts=1), backend) as mem:
        held = mem.sync_turn("held back", "a", session_id="s").key
        backend.hold_back.add(held)
        await mem.flush()
        await eventually(mem, lambda: backend.calls >= 3 or mem.stats().replica_dead > 0,
                         "held back three times")
        assert mem.stats().replica_dead == 0, "a turn never sent is not given up"
        backend.hold_back.clear()
        await eventually(mem, lambda: mem.stats().replicated_turns == 1, "sent at last")
    assert backend.keys("s") == [held]


async def test_prefetch_keeps_the_last_good_backend_block_marked_stale_while_it_fails(
    tmp_path: Path,
) -> None:
    backend = ScriptedBackend()
    backend.answer = "From the backend: the user prefers tea."

    async def recalled(mem: MemoryPipeline, query: str, *, fails: bool = False) -> None:
        before = mem.stats().recalls_run
        mem.queue_prefetch(query, session_id="s", user_id="u")
        # It ran: its block is in, or (the backend failing) the last good one is stale. A
        # recall counts as run when it starts, before its block lands.
        await eventually(mem, lambda: mem.stats().recalls_run > before and (
            mem.prefetch_status("s", user_id="u").stale if fails
            else mem.prefetch_status("s", user_id="u").recall_query == query),
            "the recall ran")

    async with MemoryPipeline(settings(tmp_path), backend) as mem:
        mem.sync_turn("i like tea", "noted", session_id="s", user_id="u")
        await mem.flush()
        await recalled(mem, "what do I like")
        status = mem.prefetch_status("s", user_id="u")
        assert status.source == "scripted" and not status.stale
        assert "prefers tea" in mem.prefetch("", session_id="s", user_id="u")

        backend.down = True
        await recalled(mem, "what do I like now", fails=True)
        status = mem.prefetch_status("s", user_id="u")
        assert status.source == "scripted" and status.stale
        assert "prefers tea" in mem.prefetch("", session_id="s", user_id="u")

        backend.down = False
        await recalled(mem, "and now")
        assert not mem.prefetch_status("s", user_id="u").stale


async def test_without_a_good_backend_block_the_local_store_answers(tmp_path: Path) -> None:
    backend = ScriptedBackend()
    backend.down = True
    async with MemoryPipeline(settings(tmp_path), backend) as mem:
        mem.sync_turn("my locker code is 4471", "noted", session_id="s", user_id="u")
        await mem.flush()
        mem.queue_prefetch("locker code", session_id="s2", user_id="u")
        await eventually(
            mem, lambda: mem.prefetch_status("s2", user_id="u").recall_query is not None,
            "the recall ran")
        assert "4471" in mem.prefetch("", session_id="s2", user_id="u")
        assert mem.prefetch_status("s2", user_id="u").source == "local"


async def test_a_backend_dead_letter_is_listed_and_replayed_from_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    backend = ScriptedBackend()
    db = str(tmp_path / "memory.db")
    async with MemoryPipeline(settings(tmp_path), backend) as mem:
        bad = mem.sync_turn("refused at first", "ok", session_id="s").key
        backend.refuse.add(bad)
        await mem.flush()
        await eventually(mem, lambda: mem.stats().replica_dead == 1, "dead-lettered")
        capsys.readouterr()

        assert cli.main(["dead-letters", "list", "--db", db]) == 0
        assert "1 dead letters of backend 'scripted'" in capsys.readouterr().out
        assert cli.main(["dead-letters", "list", "--backend", "scripted", "--db", db]) == 0
        listed = capsys.readouterr().out
        assert bad in listed and "422 bad message" in listed

        backend.refuse.clear()  # the backend was fixed
        assert cli.main(["dead-letters", "replay", "--backend", "scripted", bad,
                         "--db", db]) == 0
        assert "1 dead letters of backend 'scripted' queued" in capsys.readouterr().out
        await eventually(mem, lambda: backend.keys("s") == [bad], "sent again")
        assert backend.maybe_sent_calls >= 1, "a replay first asks what the backend holds"
        assert cli.main(["dead-letters", "replay", "--backend", "scripted", "nope",
                         "--db", db]) == 1


async def test_status_shows_what_a_backend_still_lacks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    backend = ScriptedBackend()
    backend.down = True
    db = str(tmp_path / "memory.db")
    async with MemoryPipeline(settings(tmp_path), backend) as mem:
        for i in range(7):
            mem.sync_turn(f"q{i}", "a", session_id="s")
        await mem.flush()
        capsys.readouterr()
        assert cli.main(["status", "--db", db]) == 0
        assert "replica scripted  7 turns to send, 0 dead letters" in capsys.readouterr().out


async def test_two_sessions_of_one_user_get_their_own_backend_recall(tmp_path: Path) -> None:
    both_in_flight = anyio.Event()
    in_flight: set[str] = set()

    class PerSession(ScriptedBackend):
        async def recall(self, request: RecallRequest) -> str | None:
            in_flight.add(request.session_id)
            if len(in_flight) == 2:
                both_in_flight.set()
            with anyio.fail_after(WAIT_S):
                await both_in_flight.wait()  # each waits for the other: both at once
            return f"context of {request.session_id}"

    backend = PerSession()
    async with MemoryPipeline(settings(tmp_path), backend) as mem:
        mem.queue_prefetch("same question", session_id="a", user_id="u")
        mem.queue_prefetch("same question", session_id="b", user_id="u")
        await eventually(mem, lambda: mem.stats().recalls_run == 2, "both ran")
        # Each lands when its own recall is done (after the backend answers, the session's
        # procedural block is read): wait for each.
        for sid in ("a", "b"):
            await eventually(mem, lambda sid=sid: f"context of {sid}" in mem.prefetch(
                "", session_id=sid, user_id="u"), f"{sid}'s own")


# -- session lifecycle records -------------------------------------------------------------


def _turn(key: str, session_id: str) -> Turn:
    return Turn.build(key=key, session_id=session_id, user_id="u", accepted_at=time.time(),
                      messages=[("user", f"hello from {key}", None, None, None),
                                ("assistant", "hi", None, None, None)], metadata=None)


def _event(key: str, session_id: str, action: str, **fields: Any) -> Turn:
    return Turn.decode(encode_session_op(key, session_id, "u", time.time(), action, **fields))


def _imported(key: str, session_id: str, started_at: float) -> Turn:
    message = [1_000_000, "old-turn", 0, "user", "imported hello", None, None, None, started_at,
               "u", None, None]
    row = {"source": "cli", "user_id": "u", "started_at": started_at, "updated_at": started_at}
    return _event(key, session_id, "import", row=row, messages=[message], started_at=started_at)


async def test_lifecycle_records_wait_for_the_backend_when_they_changed_their_session(
    tmp_path: Path
) -> None:
    """Each lifecycle record that changed its session waits for the replica backend in the
    session's lane, in commit order: a describe with the session's row as it left it; a
    delete committed with the session's unsent turn keeps its own row (the turn's goes with
    the session); an import that inserted its session, once. A prune that kept its session
    and an import that inserted nothing queue nothing: the backend must not undo or repeat
    what the store did not do."""
    store = SqliteStore(tmp_path / "m.db")
    await store.open()
    try:
        store.replica = "scripted"
        await store.commit([_turn("t1", "s1")])
        await store.commit([_event("describe", "s1", "describe", fields={"model": "m-2"})])
        # Prune's form: s1 has not ended, so it stays, and Honcho must keep it too.
        await store.commit([_event("prune", "s1", "delete", ended_before=time.time() + 60)])
        await store.commit([_turn("t2", "s2"), _event("delete", "s2", "delete")])
        await store.commit([_imported("import", "s3", 1000.0)])
        await store.commit([_imported("import-again", "s3", 1000.0)])  # already there
        await store.commit([_imported("import-other", "s1", 1000.0)])  # another s1 is there
        rows = await store.replica_pending("scripted", 10, 10)
    finally:
        await store.aclose()
    assert [(r.turn_key, r.session_id) for r in rows] == [
        ("t1", "s1"), ("describe", "s1"), ("delete", "s2"), ("import", "s3")]
    describe = parse_session_record(rows[1].payload or "")
    assert describe is not None and describe.snapshot is not None
    assert (describe.snapshot["model"], describe.snapshot["message_count"]) == ("m-2", 2)
    imported = parse_session_record(rows[3].payload or "")
    assert imported is not None and imported.snapshot is not None
    assert (imported.snapshot["source"], imported.snapshot["started_at"]) == ("cli", 1000.0)


@pytest.mark.parametrize("announced", ["during the read", "after the read"])
async def test_a_commit_the_read_already_took_does_not_keep_the_replicator_busy(
    tmp_path: Path, announced: str
) -> None:
    """A commit lands in the database before the writer announces it. When the replicator's
    read took its records first, their write empties the outbox, and the replicator says
    it is idle (stats then show 0 pending) as soon as that write is done. A commit the read
    did not take keeps it busy."""
    store = SqliteStore(tmp_path / "m.db")
    await store.open()
    backend = ScriptedBackend()
    backend.hold = anyio.Event()
    progress = [anyio.Event()]  # set at each of the replicator's progress reports
    reports: list[tuple[int, bool]] = []  # (replicated, idle) at each

    def report() -> None:
        reports.append((replicator.replicated, replicator.idle))
        progress[0].set()

    async def next_progress() -> None:
        progress[0] = anyio.Event()
        await progress[0].wait()

    replicator = Replicator(store, backend, max_attempts=3, backoff=Backoff(base_s=0.001),
                            on_progress=report)
    read = store.replica_pending
    reads = 0

    async def reading(name: str, sessions: int, limit: int) -> list[Any]:
        nonlocal reads
        reads += 1
        rows = await read(name, sessions, limit)
        if reads == 2 and announced == "during the read":
            replicator.wake(["t1", "t2"])  # the writer's announcement, late
        return rows

    store.replica_pending = reading  # type: ignore[method-assign]
    try:
        store.replica = "scripted"
        async with anyio.create_task_group() as tg:
            tg.start_soon(replicator.run)
            with anyio.fail_after(WAIT_S):
                while reads < 1 or not replicator.idle:  # the first read found nothing
                    await next_progress()
                # Committed before the announcement; the replicator is woken to read them
                # by an earlier commit's announcement (of another turn, "t0").
                await store.commit([_turn("t0", "s0"), _turn("t1", "s1"), _turn("t2", "s2")])
                replicator.wake(["t0"])
                await backend.called.wait()
                if announced == "after the read":
                    replicator.wake(["t1", "t2"])
                done = anyio.Event()
                progress[0] = done
                backend.hold.set()
                await done.wait()
                # Reported with the write: every committed record was written, nothing
                # waits, and no further read was needed to say so.
                assert reports[-1] == (3, True)
                # A commit the read did not take: busy until it is written.
                await store.commit([_turn("t3", "s0")])
                replicator.wake(["t3"])
                assert not replicator.idle
                while replicator.replicated < 4 or not replicator.idle:
                    await next_progress()
            tg.cancel_scope.cancel()
    finally:
        await store.aclose()
    assert backend.keys("s0") == ["t0", "t3"] and backend.keys("s2") == ["t2"]
