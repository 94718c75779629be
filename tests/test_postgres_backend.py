"""The PostgreSQL replica backend against a real server: pipelines with backend "postgres"
write every turn, key-value write and lifecycle event there exactly once and in per-session
order, whatever is resent; a second pipeline (another machine: its own SQLite file) recalls
the first one's writes for the same user only; an outage loses nothing and shows no
password."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import anyio
import asyncpg
import pytest
from structlog.testing import capture_logs

from hermes_async_memory import ConfigurationError, MemoryPipeline, SchemaVersionError, Settings
from hermes_async_memory.backends.base import BackendUnavailableError, TurnFailure
from hermes_async_memory.ops import encode_session_op
from hermes_async_memory.postgres import open_pool, upgrade
from hermes_async_memory.postgres.backend import PostgresBackend
from hermes_async_memory.turns import Turn

from .pg_server import PostgresServer

WAIT_S = 30.0


def pg_settings(tmp_path: Path, dsn: str, name: str = "a") -> Settings:
    return Settings(db_path=tmp_path / name / "memory.db", backend="postgres", postgres_dsn=dsn,
                    replica_max_attempts=3)


async def upgraded(dsn: str) -> None:
    async with open_pool(Settings(postgres_dsn=dsn)) as pool:
        await upgrade(pool)


@pytest.fixture
async def db(pg_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """The test's database, upgraded, and a connection to look into it."""
    await upgraded(pg_dsn)
    conn = await asyncpg.connect(pg_dsn)
    yield conn
    await conn.close()


async def replicated(mem: MemoryPipeline) -> None:
    """Wait until everything accepted is committed and no record waits for the database
    (checked at each change the pipeline makes: a replica write is one; no sleeping)."""
    await mem.flush(timeout=WAIT_S)
    with anyio.fail_after(WAIT_S):
        while True:
            mark = mem.change_mark()  # before the read: a change during it is not missed
            if (await mem.store.replica_counts("postgres")) == (0, 0):
                return
            await mem.next_change(since=mark)


async def stored_turns(db: asyncpg.Connection) -> dict[str, list[str]]:
    """Each session's user texts, in the session's stored order."""
    rows = await db.fetch("SELECT session_id, content FROM messages WHERE role = 'user' "
                          "ORDER BY session_id, seq, ordinal")
    out: dict[str, list[str]] = {}
    for r in rows:
        out.setdefault(r["session_id"], []).append(r["content"])
    return out


def accept(mem: MemoryPipeline, sessions: Sequence[str], turns: int, user: str = "alice",
           tag: str = "") -> dict[str, list[str]]:
    sent: dict[str, list[str]] = {}
    for i in range(turns):
        for s in sessions:
            text = f"{tag}{s} turn {i} about harbour lanterns"
            mem.sync_turn(text, f"reply {i}", session_id=s, user_id=user,
                          metadata={"input_tokens": 3, "output_tokens": 5})
            sent.setdefault(s, []).append(text)
    return sent


def test_backend_postgres_needs_a_dsn(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="postgres_dsn"):
        Settings(db_path=tmp_path / "m.db", backend="postgres")


async def test_a_schema_not_upgraded_is_a_clear_error_at_start(
        tmp_path: Path, pg_dsn: str) -> None:
    with pytest.raises(SchemaVersionError, match="hermes-memory db upgrade"):
        async with MemoryPipeline(pg_settings(tmp_path, pg_dsn)):
            pass


async def test_turns_of_several_sessions_are_stored_once_in_order(
        tmp_path: Path, pg_dsn: str, db: asyncpg.Connection) -> None:
    async with MemoryPipeline(pg_settings(tmp_path, pg_dsn)) as mem:
        sent = accept(mem, ["s1", "s2", "s3"], 40)
        await replicated(mem)
    assert await stored_turns(db) == sent
    dupes = await db.fetchval("SELECT count(*) FROM (SELECT turn_key, ordinal FROM messages "
                              "GROUP BY 1, 2 HAVING count(*) > 1) AS d")
    assert dupes == 0
    rows = await db.fetch("SELECT id, user_id, message_count, input_tokens, output_tokens "
                          "FROM sessions ORDER BY id")
    assert [tuple(r) for r in rows] == [(s, "alice", 80, 120, 200) for s in ("s1", "s2", "s3")]
    seqs = await db.fetch("SELECT DISTINCT session_id, seq FROM messages ORDER BY 1, 2")
    assert [r["seq"] for r in seqs if r["session_id"] == "s1"] == list(range(1, 41))


async def test_a_resend_with_maybe_sent_duplicates_nothing(
        tmp_path: Path, pg_dsn: str, db: asyncpg.Connection) -> None:
    """A batch whose commit went through but whose answer was lost (as a connection lost at
    COMMIT) is sent again by the replicator with maybe_sent: nothing is stored twice and
    the counters count each turn once."""
    calls: list[bool] = []

    class LostCommit(PostgresBackend):
        async def write(self, turns: Sequence[Turn], *, maybe_sent: bool = False) -> None:
            await super().write(turns, maybe_sent=maybe_sent)
            calls.append(maybe_sent)
            if len(calls) == 1:
                raise BackendUnavailableError(
                    [TurnFailure(t.key, t.session_id, "connection lost at commit", False)
                     for t in turns], written=0)

    settings = pg_settings(tmp_path, pg_dsn)
    async with MemoryPipeline(settings, LostCommit(settings)) as mem:
        mem.memory.store_nowait("alice", "colour", "blue")
        sent = accept(mem, ["s1", "s2"], 10)
        mem.sessions.end_nowait("s1", "done", user_id="alice")
        await replicated(mem)
        await mem.wait_until(lambda: len(calls) >= 2, timeout=WAIT_S)
    assert calls[:2] == [False, True]
    assert await stored_turns(db) == sent
    counts = await db.fetch("SELECT id, message_count, input_tokens, end_reason FROM sessions "
                            "ORDER BY id")
    assert [tuple(r) for r in counts] == [("s1", 20, 30, "done"), ("s2", 20, 30, None)]
    assert await db.fetchval("SELECT count(*) FROM memories") == 1
    assert await db.fetchval("SELECT count(*) FROM applied_records") == 2


async def test_a_resent_batch_holding_a_delete_does_not_bring_its_turns_back(
        tmp_path: Path, pg_dsn: str, db: asyncpg.Connection) -> None:
    settings = pg_settings(tmp_path, pg_dsn)
    one = Turn.build(key="t1", session_id="s1", user_id="bob", accepted_at=1.0,
                     messages=[("user", "one", None, None, None)], metadata=None)
    other = Turn.build(key="t2", session_id="s2", user_id="bob", accepted_at=1.0,
                       messages=[("user", "two", None, None, None)], metadata=None)
    delete = Turn.decode(encode_session_op("d1", "s1", "bob", 2.0, "delete"))
    backend = PostgresBackend(settings)
    await backend.startup()
    try:
        await backend.write([one, other, delete])
        await backend.write([one, other, delete], maybe_sent=True)
    finally:
        await backend.aclose()
    assert await stored_turns(db) == {"s2": ["two"]}
    assert await db.fetchval("SELECT message_count FROM sessions WHERE id = 's2'") == 1
    assert await db.fetchval("SELECT count(*) FROM sessions WHERE id = 's1'") == 0


async def test_lifecycle_delete_removes_the_session_there(
        tmp_path: Path, pg_dsn: str, db: asyncpg.Connection) -> None:
    async with MemoryPipeline(pg_settings(tmp_path, pg_dsn)) as mem:
        mem.sessions.describe_nowait("s1", user_id="alice", model="m-1",
                                     system_prompt="be brief")
        accept(mem, ["s1", "s2"], 3)
        mem.sessions.delete_nowait("s1", user_id="alice")
        mem.sync_turn("after the delete", "ok", session_id="s1", user_id="alice")
        await replicated(mem)
    stored = await stored_turns(db)
    assert stored["s1"] == ["after the delete"]
    assert len(stored["s2"]) == 3
    row = await db.fetchrow("SELECT message_count, model, system_prompt FROM sessions "
                            "WHERE id = 's1'")
    assert tuple(row) == (2, None, None)


async def test_key_value_writes_are_mirrored(
        tmp_path: Path, pg_dsn: str, db: asyncpg.Connection) -> None:
    async with MemoryPipeline(pg_settings(tmp_path, pg_dsn)) as mem:
        mem.memory.store_nowait("alice", "colour", "blue", {"why": "asked"})
        mem.memory.store_nowait("alice", "pet", "cat")
        mem.memory.store_nowait("alice", "colour", "green")
        mem.memory.delete_nowait("alice", "pet")
        mem.memory.store_nowait("bob", "colour", "red")
        await replicated(mem)
    rows = await db.fetch("SELECT user_id, key, value, metadata, created_at < updated_at "
                          "FROM memories ORDER BY user_id, key")
    assert [tuple(r) for r in rows] == [("alice", "colour", "green", None, True),
                                        ("bob", "colour", "red", None, False)]


async def test_nul_text_is_stored_as_the_replacement_character(
        tmp_path: Path, pg_dsn: str, db: asyncpg.Connection) -> None:
    async with MemoryPipeline(pg_settings(tmp_path, pg_dsn)) as mem:
        mem.sync_turn("nul\x00here", "and\x00there", session_id="s1", user_id="alice",
                      metadata={"note": "a\x00b"})
        mem.sync_turn("plain", "ok", session_id="s1", user_id="alice")
        await replicated(mem)
        assert mem.stats().replica_errors == 0
    rows = await db.fetch("SELECT content, metadata FROM messages ORDER BY seq, ordinal")
    assert [r["content"] for r in rows] == ["nul\ufffdhere", "and\ufffdthere", "plain", "ok"]
    assert json.loads(rows[0]["metadata"]) == {"note": "a\x00b"}


async def test_a_second_machine_recalls_the_same_users_writes_only(
        tmp_path: Path, pg_dsn: str, db: asyncpg.Connection) -> None:
    async with MemoryPipeline(pg_settings(tmp_path, pg_dsn, "a")) as a:
        a.sync_turn("my boat is called Marigold", "noted", session_id="s1", user_id="alice")
        a.sync_turn("my boat is called Thunder", "noted", session_id="s2", user_id="bob")
        await replicated(a)
    async with MemoryPipeline(pg_settings(tmp_path, pg_dsn, "b")) as b:
        b.queue_prefetch("what is my boat called", session_id="s9", user_id="alice")
        await b.wait_until(lambda: bool(b.prefetch(session_id="s9", user_id="alice")),
                           timeout=WAIT_S)
        block = b.prefetch(session_id="s9", user_id="alice")
    assert "Marigold" in block
    assert "Thunder" not in block
    assert block.splitlines()[1].startswith("- [")


async def test_an_outage_loses_nothing_and_shows_no_password(
        tmp_path: Path, pg_server: PostgresServer, pg_dsn: str,
        db: asyncpg.Connection) -> None:
    await db.close()
    with capture_logs() as logs:
        async with MemoryPipeline(pg_settings(tmp_path, pg_dsn)) as mem:
            sent = accept(mem, ["s1", "s2"], 5, tag="before ")
            await replicated(mem)
            pg_server.stop()
            try:
                during = accept(mem, ["s1", "s2"], 20, tag="during ")
                await mem.flush(timeout=WAIT_S)  # committed locally while the database is down
                await mem.wait_until(lambda: not mem.backend.available(), timeout=WAIT_S)
                assert mem.stats().replica_dead == 0
            finally:
                pg_server.start()
            await replicated(mem)
            assert mem.backend.available()
            assert mem.stats().replica_dead == 0
    conn = await asyncpg.connect(pg_dsn)
    try:
        stored = await stored_turns(conn)
    finally:
        await conn.close()
    assert stored == {s: sent[s] + during[s] for s in sent}
    assert any(e["event"] == "postgres_down" for e in logs)
    pg_server.assert_no_password(repr(logs))


async def test_a_refused_record_fails_alone_and_its_session_keeps_order(
        tmp_path: Path, pg_dsn: str, db: asyncpg.Connection) -> None:
    """The database refuses one turn of a batch of several sessions (a trigger stands in
    for whatever it may refuse): every other turn is stored, the refused one becomes the
    replica's only dead letter once its attempts are spent, and its session's later turns
    go in after it, in order."""
    await db.execute("""
        CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN RAISE EXCEPTION 'poison refused'; END $$;
        CREATE TRIGGER refuse_poison BEFORE INSERT ON messages FOR EACH ROW
            WHEN (NEW.content LIKE '%poison%') EXECUTE FUNCTION refuse_poison();
    """)
    sessions = ["s1", "s2", "s3", "s4"]
    with capture_logs() as logs:
        async with MemoryPipeline(pg_settings(tmp_path, pg_dsn)) as mem:
            sent = accept(mem, sessions, 6, tag="early ")
            mem.sync_turn("this is poison", "no", session_id="s2", user_id="alice")
            later = accept(mem, sessions, 6, tag="late ")
            await mem.flush(timeout=WAIT_S)
            with anyio.fail_after(WAIT_S):
                while True:  # until the refused turn is dead and the rest went in
                    mark = mem.change_mark()
                    if (await mem.store.replica_counts("postgres")) == (0, 1):
                        break
                    await mem.next_change(since=mark)
            # The stats count dead letters at the next maintenance round.
            await mem.wait_until(lambda: mem.stats().replica_dead == 1, timeout=WAIT_S)
    stored = await stored_turns(db)
    assert stored == {s: sent[s] + later[s] for s in sessions}
    refused = [e for e in logs if e["event"] == "postgres_record_refused"]
    assert refused and all("poison refused" in e["error"] for e in refused)
