"""Procedural memory and templates in the shared PostgreSQL store, against a real server:
a pipeline with backend "postgres" logs the same tool calls there as in its SQLite file, and
once the derived jobs ran (claimed as a worker claims them) the same fixes, also when calls
and their answers come in separate records (message by message); a resend logs nothing; the
bound job trims the oldest calls; template saves, starts, ends and deletes give the same
counts and detached sessions as SQLite. Backends that keep no templates get none."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
from asyncpg import Pool, Record

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.backends.memory import InMemoryBackend
from hermes_async_memory.ops import OP_TEMPLATE
from hermes_async_memory.postgres import jobs, open_pool
from hermes_async_memory.postgres.backend import PostgresBackend
from hermes_async_memory.postgres.derived import DERIVED_HANDLERS, PROCEDURAL
from hermes_async_memory.templates import Template
from hermes_async_memory.turns import Turn

from .fixtures_conversations import CODE_SESSION
from .test_postgres_backend import WAIT_S, pg_settings, upgraded
from .test_procedural_log import SESSION, call, turn
from .test_procedural_records import answer, calling, reply, user
from .test_templates_store import calls_session, write

KINDS = list(DERIVED_HANDLERS)

# A recorded session's calls (test_procedural_log.SESSION: failures fixed by later calls,
# one never fixed, one never answered), then malformed calls that must log as SQLite logs
# them, then a turn whose answer says how long it took and one with calls in a second
# assistant message.
ODD = [
    {"role": "user", "content": "odd"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "n1", "type": "function", "function": {"name": "t", "arguments": "not json"}},
        {"id": "n2", "type": "function", "function": {"arguments": "{}"}},  # no name
        {"id": "n3", "type": "function", "function": {"name": "t", "arguments": None}},
        {"type": "function", "function": {"name": "t", "arguments": '{"a":  [1, 2.50]}'}},
        {"id": 7, "type": "function", "function": {"name": "t", "arguments": {"x": "é"}}},
        "a string", 7]},
    {"role": "tool", "tool_call_id": "n1", "content": None},
    {"role": "tool", "tool_call_id": "n3", "content": "x" * 5000},
    {"role": "tool", "tool_call_id": "n3", "content": "a second answer is not the answer"},
    {"role": "tool", "tool_call_id": "7", "content": "ValueError: seven"},
    {"role": "assistant", "content": "done"}]
TWO_MESSAGES = [
    {"role": "user", "content": "read both"},
    {"role": "assistant", "content": "", "tool_calls": [call("m1", "read_file", path="a")]},
    {"role": "tool", "tool_call_id": "m1", "content": json.dumps({"error": "EACCES"})},
    {"role": "assistant", "content": "", "tool_calls": [call("m2", "read_file", path="b")]},
    {"role": "tool", "tool_call_id": "m2", "content": json.dumps({"ok": True,
                                                                  "duration_s": 1.5})},
    {"role": "assistant", "content": "both read"}]
# Turns of no user: their fixes stay within the session.
NO_USER = [
    turn("build", [call("u1", "terminal", command="make")], {"u1": {"exit_code": 2}}),
    turn("build again", [call("u2", "terminal", command="make -j1")], {"u2": {"exit_code": 0}}),
]

CALL_COLUMNS = ("call_id, c.session_id, c.user_id, tool, arguments, result, ok, error_type, "
                "error_message, duration_ms, goal, at")


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[Pool[Record]]:
    """The test's database, upgraded, and a pool to look into it and run its jobs."""
    await upgraded(pg_dsn)
    async with open_pool(Settings(postgres_dsn=pg_dsn, postgres_pool_max_size=4)) as p:
        yield p


async def replicated(mem: MemoryPipeline, backend: str = "postgres") -> None:
    """Everything accepted is committed locally and no record waits for ``backend``."""
    await mem.flush(timeout=WAIT_S)
    with anyio.fail_after(WAIT_S):
        while True:
            mark = mem.change_mark()
            if (await mem.store.replica_counts(backend)) == (0, 0):
                return
            await mem.next_change(since=mark)


async def run_jobs(pool: Pool[Record], kinds: Sequence[str] = KINDS) -> list[jobs.Job]:
    """Claim and run every queued job of ``kinds``, as a worker does; returns them."""
    done: list[jobs.Job] = []
    while claimed := await jobs.claim(pool, "test-worker", kinds, lease_s=60, limit=10):
        for job in claimed:
            await DERIVED_HANDLERS[job.kind](pool, job)
            await jobs.complete(pool, job)
            done.append(job)
    return done


def send(mem: MemoryPipeline, turns: Sequence[list[dict[str, Any]]], session: str,
         user: str | None) -> None:
    for msgs in turns:
        mem.sync_turn(msgs[0]["content"], msgs[-1]["content"] or "", session_id=session,
                      user_id=user, messages=msgs)


def local_calls(db: Path) -> dict[tuple[str, int, str], tuple[Any, ...]]:
    """SQLite's log: each call by (turn, message ordinal, call id), with its fix links by
    the same names."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            f"SELECT m.turn_key, m.ordinal, c.id, c.fixes, c.fixed_by, {CALL_COLUMNS} "
            "FROM tool_calls AS c JOIN messages AS m ON m.id = c.message_id").fetchall()
    return named(rows)


async def shared_calls(pool: Pool[Record]) -> dict[tuple[str, int, str], tuple[Any, ...]]:
    rows = await pool.fetch(
        f"SELECT m.turn_key, m.ordinal, c.id, c.fixes, c.fixed_by, {CALL_COLUMNS} "
        "FROM tool_calls AS c JOIN messages AS m ON m.id = c.message_id")
    return named([tuple(r) for r in rows])


def named(rows: Sequence[Sequence[Any]]) -> dict[tuple[str, int, str], tuple[Any, ...]]:
    names = {r[2]: (r[0], r[1], r[5]) for r in rows}
    return {(r[0], r[1], r[5]): (*r[5:11], bool(r[11]), *r[12:],
                                 names.get(r[3]) if r[3] else None,
                                 names.get(r[4]) if r[4] else None) for r in rows}


async def check_calls(pool: Pool[Record], *, settled: bool) -> int:
    """The invariants of every row of the shared log; returns how many rows there are.
    A call belongs to a message of its session, user and time; a fix link goes both ways,
    from a later success to a failure of the same tool and user (and session, without a
    user); once the jobs ran (``settled``), nothing is pending and each user's count is
    their calls'."""
    rows = {r["id"]: r for r in await pool.fetch(
        "SELECT c.*, m.session_id AS m_session, coalesce(m.user_id, '') AS m_user, "
        "m.timestamp AS m_at, m.tool_calls IS NOT NULL AS m_calls "
        "FROM tool_calls AS c LEFT JOIN messages AS m ON m.id = c.message_id")}
    for r in rows.values():
        assert (r["m_session"], r["m_user"], r["m_at"], r["m_calls"]) == (
            r["session_id"], r["user_id"], r["at"], True), dict(r)
        assert r["ok"] is (r["error_type"] is None), dict(r)
        if r["fixes"] is not None:
            f = rows[r["fixes"]]
            assert r["ok"] and not f["ok"] and f["fixed_by"] == r["id"] and f["id"] < r["id"]
            assert (f["tool"], f["user_id"]) == (r["tool"], r["user_id"])
            assert r["user_id"] or f["session_id"] == r["session_id"]
            assert f["arguments"] != r["arguments"]
        if r["fixed_by"] is not None:
            assert rows[r["fixed_by"]]["fixes"] == r["id"]
        assert not (settled and r["pending"]), dict(r)
    if settled:
        counts = {r["user_id"]: r["n"] for r in await pool.fetch(
            "SELECT user_id, n FROM tool_log_counts")}
        assert counts == {u: sum(1 for r in rows.values() if r["user_id"] == u)
                          for u in {r["user_id"] for r in rows.values()}}
    return len(rows)


async def test_tool_calls_and_their_fixes_are_the_local_stores(
        tmp_path: Path, pg_dsn: str, pool: Pool[Record]) -> None:
    settings = pg_settings(tmp_path, pg_dsn)
    async with MemoryPipeline(settings) as mem:
        send(mem, SESSION, "s1", "ann")
        send(mem, [ODD, TWO_MESSAGES], "s2", "ann")
        send(mem, NO_USER, "s3", None)
        await replicated(mem)
    local = local_calls(settings.db_path)
    assert len(local) == 15

    before = await shared_calls(pool)
    assert await check_calls(pool, settled=False) == len(local)
    assert before == {k: (*v[:-2], None, None) for k, v in local.items()}  # no fix yet
    queued = await pool.fetch("SELECT key FROM jobs ORDER BY key")
    assert [r["key"] for r in queued] == ["procedural:", "procedural:ann"]

    assert len(await run_jobs(pool)) == 2
    assert await shared_calls(pool) == local
    assert await check_calls(pool, settled=True) == len(local)
    fixed = {k[2]: v[-2][2] for k, v in local.items() if v[-2]}  # call: the one it fixed
    assert fixed == {"a2": "a1", "b2": "b1", "m2": "m1", "u2": "u1"}


def built(key: str, user: str, *calls: tuple[str, bool], session: str = "s1",
          at: float = 1.0) -> Turn:
    """A turn of ``user`` making ``calls`` (id, success) in one assistant message."""
    made = [call(cid, "terminal", command=f"run {cid}") for cid, _ in calls]
    return Turn.build(key=key, session_id=session, user_id=user, accepted_at=at, messages=[
        ("user", f"goal of {key}", None, None, None),
        ("assistant", "", json.dumps(made), None, None),
        *[("tool", json.dumps({"exit_code": 0 if ok else 1}), None, cid, None)
          for cid, ok in calls],
        ("assistant", "done", None, None, None)], metadata=None)


async def test_a_resend_logs_no_call_twice_and_queues_one_job_per_user(
        tmp_path: Path, pg_dsn: str, pool: Pool[Record]) -> None:
    one = built("t1", "bob", ("c1", False), ("c2", True))
    two = built("t2", "bob", ("c3", True), session="s2")
    three = built("t3", "eve", ("c4", False))
    backend = PostgresBackend(pg_settings(tmp_path, pg_dsn))
    await backend.startup()
    try:
        await backend.write([one, two])
        await backend.write([one, two, three], maybe_sent=True)
        await backend.write([one, two, three], maybe_sent=True)
    finally:
        await backend.aclose()
    assert await check_calls(pool, settled=False) == 4
    assert [tuple(r) for r in await pool.fetch(
        "SELECT call_id, ok, pending FROM tool_calls ORDER BY id")] == [
        ("c1", False, True), ("c2", True, True), ("c3", True, True), ("c4", False, True)]
    assert [tuple(r) for r in await pool.fetch(
        "SELECT id, tool_call_count FROM sessions ORDER BY id")] == [("s1", 3), ("s2", 1)]
    assert [r["key"] for r in await pool.fetch("SELECT key FROM jobs ORDER BY key")] == [
        "procedural:bob", "procedural:eve"]
    assert len(await run_jobs(pool)) == 2
    assert await check_calls(pool, settled=True) == 4
    assert await pool.fetchval("SELECT count(*) FROM tool_calls WHERE fixes IS NOT NULL") == 1


async def test_a_job_run_twice_changes_nothing_and_a_write_during_a_run_is_not_lost(
        tmp_path: Path, pg_dsn: str, pool: Pool[Record]) -> None:
    backend = PostgresBackend(pg_settings(tmp_path, pg_dsn))
    await backend.startup()
    try:
        await backend.write([built("t1", "bob", ("c1", False))])
        [job] = await jobs.claim(pool, "worker-1", KINDS, lease_s=60)
        # Written while the job is claimed and has not started: the run reads it.
        await backend.write([built("t2", "bob", ("c2", True), at=2.0)])
        await DERIVED_HANDLERS[job.kind](pool, job)
        after_one = sorted(tuple(r) for r in await pool.fetch("SELECT * FROM tool_calls"))
        # The worker died before completing: the job runs again, to the same effect.
        await DERIVED_HANDLERS[job.kind](pool, job)
        assert sorted(tuple(r) for r in await pool.fetch("SELECT * FROM tool_calls")) == (
            after_one)
        assert await check_calls(pool, settled=True) == 2
        # Written while the job runs (it gave up its key): a new job is queued for it.
        await backend.write([built("t3", "bob", ("c3", False), at=3.0)])
        await jobs.complete(pool, job)
    finally:
        await backend.aclose()
    [again] = await run_jobs(pool)
    assert (again.kind, again.key) == (PROCEDURAL, "procedural:bob")
    assert await check_calls(pool, settled=True) == 3
    assert await pool.fetchval("SELECT fixes FROM tool_calls WHERE call_id = 'c2'") == (
        await pool.fetchval("SELECT id FROM tool_calls WHERE call_id = 'c1'"))


async def test_a_write_that_found_the_jobs_key_taken_is_read_by_that_job(
        tmp_path: Path, pg_dsn: str, pool: Pool[Record]) -> None:
    """The write queued no job (its user's is claimed) and commits only after the job
    started: the job waits for it as it gives up its key, then reads its calls."""
    enqueued, resume = anyio.Event(), anyio.Event()

    class Paused(PostgresBackend):
        async def _enqueue_derived(self, conn: Any, written: Any) -> None:
            await super()._enqueue_derived(conn, written)
            if written.procedural:
                enqueued.set()
                await resume.wait()  # the transaction stays open

    settings = pg_settings(tmp_path, pg_dsn)
    backend, paused = PostgresBackend(settings), Paused(settings)
    await backend.startup()
    await paused.startup()
    try:
        await backend.write([built("t1", "bob", ("c1", False))])
        [job] = await jobs.claim(pool, "worker-1", KINDS, lease_s=60)
        async with anyio.create_task_group() as tg:
            tg.start_soon(paused.write, [built("t2", "bob", ("c2", True), at=2.0)])
            await enqueued.wait()
            tg.start_soon(DERIVED_HANDLERS[job.kind], pool, job)
            # Until the job waits for the write's lock, as the server shows it (no event
            # says so: its view is polled).
            with anyio.fail_after(WAIT_S):
                while not await pool.fetchval(  # noqa: ASYNC110
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                        "AND query LIKE 'UPDATE jobs SET key = NULL%'"):
                    await anyio.sleep(0.01)
            resume.set()
        await jobs.complete(pool, job)
    finally:
        await paused.aclose()
        await backend.aclose()
    assert await run_jobs(pool) == []
    assert await check_calls(pool, settled=True) == 2
    assert await pool.fetchval("SELECT fixes FROM tool_calls WHERE call_id = 'c2'") == (
        await pool.fetchval("SELECT id FROM tool_calls WHERE call_id = 'c1'"))


async def test_the_bound_job_trims_each_users_oldest_calls(
        tmp_path: Path, pg_dsn: str, pool: Pool[Record]) -> None:
    settings = pg_settings(tmp_path, pg_dsn).replace(tool_log_max_per_user=20)
    backend = PostgresBackend(settings)
    await backend.startup()
    try:
        for w in range(3):  # three writes of 20 calls, one job
            await backend.write([built(f"t{i}", "ann", (f"c{i}", True), at=float(i))
                                 for i in range(w * 20, w * 20 + 20)])
        await backend.write([built("b0", "bob", ("b0", True))])
    finally:
        await backend.aclose()
    assert await check_calls(pool, settled=False) == 61
    [ann] = await jobs.claim(pool, "worker-1", [PROCEDURAL], lease_s=60)
    await DERIVED_HANDLERS[PROCEDURAL](pool, ann)
    await DERIVED_HANDLERS[PROCEDURAL](pool, ann)  # run again: no second trim
    await jobs.complete(pool, ann)
    await run_jobs(pool)
    kept = [r["call_id"] for r in await pool.fetch(
        "SELECT call_id FROM tool_calls WHERE user_id = 'ann' ORDER BY id DESC")]
    assert kept == [f"c{i}" for i in range(59, 39, -1)]  # the newest 20
    assert await check_calls(pool, settled=True) == 21


def each(mem: MemoryPipeline, session: str, messages: Sequence[dict[str, Any]],
         user_id: str | None) -> None:
    """Each message its own record, as Hermes's session store writes them."""
    for m in messages:
        mem.sessions.append_nowait(session, [m], user_id=user_id)


# Two calls of one message answered in the other order, the second a success of the first's
# tool; a third never answered, closed by the reply after a success of its tool.
OUT_OF_ORDER = [user("read both"),
                calling(call("p1", "read_file", path="a"), call("p2", "read_file", path="b"),
                        call("p3", "terminal", command="x")),
                answer("p2", {"content": "b"}), answer("p1", {"error": "EACCES"}),
                calling(call("p4", "terminal", command="y")), answer("p4", {"exit_code": 0}),
                reply()]


async def test_calls_answered_in_later_records_are_the_local_stores(
        tmp_path: Path, pg_dsn: str, pool: Pool[Record]) -> None:
    """Message by message, some replicated before the others: the same calls, answers and
    fixes as SQLite's; a call awaits its answer in both until a later record or its
    session's end settles it, and no job takes it meanwhile."""
    settings = pg_settings(tmp_path, pg_dsn)
    recorded = [m for msgs in SESSION for m in msgs]
    async with MemoryPipeline(settings) as mem:
        for i, m in enumerate(recorded):
            each(mem, "s1", [m], "ann")
            if i % 5 == 4:
                await replicated(mem)
        each(mem, "s2", OUT_OF_ORDER[:3], "ann")
        await replicated(mem)
        each(mem, "s2", OUT_OF_ORDER[3:], "ann")
        # A reused call id: the second turn's answer is not the first's.
        each(mem, "s3", [user("one"), calling(call("call_0", "terminal", command="a"))], "bob")
        await replicated(mem)
        each(mem, "s3", [user("two"), calling(call("call_0", "terminal", command="b")),
                         answer("call_0", {"exit_code": 0}), reply()], "bob")
        each(mem, "s4", [user("go"), calling(call("e1", "terminal", command="z"))], None)
        await replicated(mem)
        await run_jobs(pool)
        assert [tuple(r) for r in await pool.fetch(
            "SELECT call_id, awaiting, pending FROM tool_calls WHERE awaiting")] == [
            ("e1", True, True)]
        await mem.sessions.end("s4", "user_exit")
        await replicated(mem)
    local = local_calls(settings.db_path)
    assert len(local) == 7 + 4 + 2 + 1
    await run_jobs(pool)
    assert await shared_calls(pool) == local
    assert await check_calls(pool, settled=True) == len(local)
    fixed = {k[2]: v[-2][2] for k, v in local.items() if v[-2]}  # call: the one it fixed
    assert fixed == {"a2": "a1", "b2": "b1", "p2": "p1", "p4": "p3", "call_0": "call_0"}
    outcomes = sorted((v[1], v[0], v[4], v[6], v[7]) for v in local.values()
                      if v[1] in ("s3", "s4"))
    assert outcomes == [("s3", "call_0", '{"command":"a"}', False, "no_result"),
                        ("s3", "call_0", '{"command":"b"}', True, None),
                        ("s4", "e1", '{"command":"z"}', False, "no_result")]


def record(key: str, role: str, content: str | None = None, *, calls: Any = None,
           call_id: str | None = None, at: float = 1.0) -> Turn:
    """One message of bob's session s1, as its own record."""
    return Turn.build(key=key, session_id="s1", user_id="bob", accepted_at=at, messages=[
        (role, content, None if calls is None else json.dumps(calls), call_id, None)],
        metadata=None)


async def test_a_call_settled_after_its_users_job_ran_is_taken_by_the_next(
        tmp_path: Path, pg_dsn: str, pool: Pool[Record]) -> None:
    """The job skips a call awaiting its answer; settled later (after a success of its tool
    that came after it), the next job counts it once and marks it as in order."""
    backend = PostgresBackend(pg_settings(tmp_path, pg_dsn))
    await backend.startup()
    try:
        await backend.write([
            record("r1", "user", "fix the build"),
            record("r2", "assistant", "", calls=[call("c1", "terminal", command="make"),
                                                 call("c2", "terminal", command="make -j1")]),
            record("r3", "tool", json.dumps({"exit_code": 0}), call_id="c2")])
        await run_jobs(pool)
        assert [tuple(r) for r in await pool.fetch(
            "SELECT call_id, awaiting, pending, fixes FROM tool_calls ORDER BY id")] == [
            ("c1", True, True, None), ("c2", False, False, None)]
        assert await pool.fetchval("SELECT n FROM tool_log_counts WHERE user_id = 'bob'") == 1
        await backend.write([record("r4", "tool", json.dumps({"exit_code": 2}),
                                    call_id="c1", at=2.0),
                             record("r5", "assistant", "the build passes", at=3.0)])
    finally:
        await backend.aclose()
    assert [j.key for j in await run_jobs(pool)] == ["procedural:bob"]
    assert await check_calls(pool, settled=True) == 2
    assert [tuple(r) for r in await pool.fetch(
        "SELECT call_id, ok, error_type, goal FROM tool_calls ORDER BY id")] == [
        ("c1", False, "exit_code", "fix the build"), ("c2", True, None, "fix the build")]
    assert await pool.fetchval("SELECT fixes FROM tool_calls WHERE call_id = 'c2'") == (
        await pool.fetchval("SELECT id FROM tool_calls WHERE call_id = 'c1'"))


TEMPLATE_COLUMNS = ("name, task_type, tags, description, source_session_id, document, "
                    "signature, usage_count, successes, failures, created_at, updated_at")
SESSION_COLUMNS = ("session_id, template, task_type, started_at, ended_at, ok, first_calls, "
                   "first_errors, detached")


def local_templates(db: Path) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    with sqlite3.connect(db) as conn:
        templates = conn.execute(f"SELECT {TEMPLATE_COLUMNS} FROM templates ORDER BY name")
        sessions = conn.execute(f"SELECT {SESSION_COLUMNS} FROM template_sessions "
                                "ORDER BY session_id")
        return [tuple(r) for r in templates], [
            (*r[:5], None if r[5] is None else bool(r[5]), *r[6:8], bool(r[8]))
            for r in sessions]


async def shared_templates(pool: Pool[Record]
                           ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """PostgreSQL's templates and their sessions, checked: a template's counts are what it
    came with and its sessions that a delete did not detach; a session attached to a name
    has a template of that name."""
    templates = await pool.fetch(f"SELECT {TEMPLATE_COLUMNS}, base_usage, base_successes, "
                                 "base_failures FROM templates ORDER BY name")
    sessions = await pool.fetch(f"SELECT {SESSION_COLUMNS} FROM template_sessions "
                                "ORDER BY session_id")
    names = {t["name"] for t in templates}
    for s in sessions:
        assert s["template"] is None or s["detached"] or s["template"] in names, dict(s)
    for t in templates:
        mine = [s for s in sessions if s["template"] == t["name"] and not s["detached"]]
        assert (t["usage_count"], t["successes"], t["failures"]) == (
            t["base_usage"] + len(mine), t["base_successes"] + sum(s["ok"] is True for s in mine),
            t["base_failures"] + sum(s["ok"] is False for s in mine)), dict(t)
    return [tuple(t)[:12] for t in templates], [tuple(s) for s in sessions]


async def test_templates_are_mirrored_with_the_local_stores_counts(
        tmp_path: Path, pg_dsn: str, pool: Pool[Record]) -> None:
    settings = pg_settings(tmp_path, pg_dsn)
    async with MemoryPipeline(settings) as mem:
        write(mem, "c1", CODE_SESSION)
        for sid, outcomes in (("w1", [[True, True]]), ("w2", [[False], [True]]),
                              ("w3", [[True]]), ("k1", [[False, False]])):
            write(mem, sid, calls_session(outcomes, tag=sid))
        await mem.flush(timeout=WAIT_S)
        made = await mem.templates.extract("c1", "fix-tests", tags=["Python"])
        imported = Template.from_dict({**made.to_dict(), "name": "imported",
                                       "usage_count": 5, "successes": 3, "failures": 1,
                                       "source_session_id": "elsewhere"})
        await mem.templates.save(imported)
        await mem.templates.start("w1", "fix-tests")
        await mem.templates.start("w2", "fix-tests")
        await mem.templates.start("w3", "imported")
        await mem.templates.start("w3", "fix-tests")  # a session starts once
        mem.templates.start_nowait("k1", None, "code")
        await mem.templates.end("w1", feedback=True)
        await mem.templates.end("w2", feedback=True)
        await mem.templates.end("w2", feedback=False)  # ended again: replaces the outcome
        await mem.templates.end("w3", feedback=True)
        await mem.templates.end("k1", feedback=False)
        await mem.sessions.delete("w3")  # its template keeps what it counted
        await replicated(mem)
        assert {j.key for j in await run_jobs(pool)} == {
            "template_stats:fix-tests", "template_stats:imported", "procedural:ada"}
        local = local_templates(settings.db_path)
        assert await shared_templates(pool) == local
        assert [t[7:10] for t in local[0]] == [(2, 1, 1), (6, 4, 1)]

        await mem.templates.delete("fix-tests")  # its sessions are detached
        await replicated(mem)
        assert await shared_templates(pool) == local_templates(settings.db_path)
        assert [s[-1] for s in local_templates(settings.db_path)[1]] == [False, True, True]

        await mem.templates.save(made)  # saved again: the detached sessions do not count
        write(mem, "w4", calls_session([[True]], tag="w4"))
        await mem.templates.start("w4", "fix-tests")
        await mem.templates.end("w4", feedback=True)
        await replicated(mem)
        await run_jobs(pool)
        local = local_templates(settings.db_path)
        assert await shared_templates(pool) == local
        assert [t[7:10] for t in local[0]] == [(1, 1, 0), (6, 4, 1)]


async def test_backends_that_keep_no_templates_get_none(tmp_path: Path) -> None:
    backend = InMemoryBackend()
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db"), backend) as mem:
        write(mem, "c1", CODE_SESSION)
        await mem.flush(timeout=WAIT_S)
        await mem.templates.extract("c1", "fix-tests")
        await mem.templates.start("s2", "fix-tests")
        mem.sync_turn("hello", "hi", session_id="s2", user_id="ada")
        await mem.templates.end("s2", feedback=True)
        await replicated(mem, backend.name)
        assert (await mem.templates.get("fix-tests")) is not None
    kinds = {t.kind for held in backend.turns.values() for t in held}
    assert kinds == {"turn"} and OP_TEMPLATE not in kinds
    assert sum(len(held) for held in backend.turns.values()) > 0
