"""The PostgreSQL store's schema against a real server (the ``pg_server`` fixture): upgrade,
its lock, the version check at start, ``hermes-memory db``, and what the tables promise
(idempotency keys, scoped full-text search)."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from collections.abc import AsyncIterator

import anyio
import asyncpg
import pytest
from asyncpg import Pool, Record

from hermes_async_memory import SchemaVersionError, Settings, cli
from hermes_async_memory.postgres import check, open_pool, status, upgrade
from hermes_async_memory.postgres.schema import (
    MIGRATIONS,
    SCHEMA_VERSION,
    SEARCH_CHARS,
    UPGRADE_LOCK_ID,
)
from hermes_async_memory.turns import scope_token_for, scope_tokens

from .pg_server import PostgresServer
from .processes import child_env

TABLES = {"schema_version", "sessions", "messages", "memories", "applied_records",
          "tool_calls", "tool_log_counts", "templates", "template_sessions", "jobs",
          "recall_results"}
WAIT_S = 30.0
RUN_TIMEOUT_S = 60.0


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[Pool[Record]]:
    async with open_pool(Settings(postgres_dsn=pg_dsn, postgres_pool_max_size=4)) as p:
        yield p


async def tables(pool: Pool[Record]) -> set[str]:
    rows = await pool.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
    return {r["tablename"] for r in rows}


async def schema_snapshot(pool: Pool[Record]) -> list[tuple[object, ...]]:
    """Every column, index and version row: what an upgrade could change."""
    columns = await pool.fetch(
        "SELECT table_name, column_name, data_type, is_nullable, column_default, "
        "generation_expression FROM information_schema.columns WHERE table_schema = 'public' "
        "ORDER BY 1, 2")
    indexes = await pool.fetch(
        "SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'public' ORDER BY 1")
    versions = await pool.fetch("SELECT version, name, applied_at FROM schema_version "
                                "ORDER BY version")
    return [tuple(r) for r in [*columns, *indexes, *versions]]


async def test_upgrade_on_an_empty_database_creates_every_table(pool: Pool[Record]) -> None:
    assert await tables(pool) == set()

    done = await upgrade(pool)

    assert (done.from_version, done.to_version) == (0, SCHEMA_VERSION)
    assert [m.version for m in done.applied] == list(range(1, SCHEMA_VERSION + 1))
    assert await tables(pool) == TABLES
    assert await check(pool) == SCHEMA_VERSION
    found = await status(pool)
    assert found.current and not found.pending
    assert [a.name for a in found.applied] == [m.name for m in MIGRATIONS]


async def test_a_second_upgrade_changes_nothing(pool: Pool[Record]) -> None:
    await upgrade(pool)
    before = await schema_snapshot(pool)

    again = await upgrade(pool)

    assert again.applied == ()
    assert (again.from_version, again.to_version) == (SCHEMA_VERSION, SCHEMA_VERSION)
    assert await schema_snapshot(pool) == before


async def test_concurrent_upgrades_apply_each_migration_once(
        pool: Pool[Record], pg_dsn: str) -> None:
    """Two processes' pools upgrade at once: both start while the upgrade lock is held (so
    they overlap for sure), then one applies every migration and the other none."""
    settings = Settings(postgres_dsn=pg_dsn, postgres_pool_max_size=1)
    async with open_pool(settings) as first, open_pool(settings) as second:
        holder = await asyncpg.connect(pg_dsn)
        try:
            tx = holder.transaction()
            await tx.start()
            await holder.execute("SELECT pg_advisory_xact_lock($1)", UPGRADE_LOCK_ID)
            upgrades = [asyncio.ensure_future(upgrade(first)),
                        asyncio.ensure_future(upgrade(second))]
            with anyio.fail_after(WAIT_S):
                while await lock_waiters(pool) < 2:
                    assert not any(u.done() for u in upgrades)
            await tx.commit()
            with anyio.fail_after(WAIT_S):
                results = await asyncio.gather(*upgrades)
        finally:
            await holder.close()

    applied = sorted(len(r.applied) for r in results)
    assert applied == [0, SCHEMA_VERSION]
    rows = await pool.fetch("SELECT version FROM schema_version ORDER BY version")
    assert [r["version"] for r in rows] == list(range(1, SCHEMA_VERSION + 1))
    assert await tables(pool) == TABLES


async def lock_waiters(pool: Pool[Record]) -> int:
    """Connections waiting for the upgrade lock (an advisory lock not granted yet)."""
    count = await pool.fetchval(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
    return int(count)


async def test_an_older_schema_is_refused_until_upgraded(pool: Pool[Record]) -> None:
    with pytest.raises(SchemaVersionError) as empty:
        await check(pool)
    assert "no hermes-memory schema yet" in str(empty.value)
    assert "run `hermes-memory db upgrade`" in str(empty.value)

    await upgrade(pool, target=1)  # a database a previous release made
    with pytest.raises(SchemaVersionError) as old:
        await check(pool)
    assert (old.value.found, old.value.expected) == (1, SCHEMA_VERSION)
    assert f"has schema version 1, and this library needs version {SCHEMA_VERSION}" in str(
        old.value)
    assert "run `hermes-memory db upgrade`" in str(old.value)
    assert [m.version for m in (await status(pool)).pending] == list(
        range(2, SCHEMA_VERSION + 1))

    done = await upgrade(pool)
    assert done.from_version == 1
    assert [m.version for m in done.applied] == list(range(2, SCHEMA_VERSION + 1))
    assert await check(pool) == SCHEMA_VERSION


async def test_a_newer_schema_is_refused_and_left_alone(pool: Pool[Record]) -> None:
    await upgrade(pool)
    newer = SCHEMA_VERSION + 1
    await pool.execute("INSERT INTO schema_version (version, name) VALUES ($1, 'future')",
                       newer)
    before = await schema_snapshot(pool)

    with pytest.raises(SchemaVersionError, match="newer than this library") as at_start:
        await check(pool)
    assert at_start.value.found == newer
    with pytest.raises(SchemaVersionError, match="newer than this library"):
        await upgrade(pool)
    assert await schema_snapshot(pool) == before


async def insert_message(pool: Pool[Record], *, turn_key: str, ordinal: int, content: str,
                         user_id: str | None, session_id: str, seq: int = 1) -> int:
    """One message row as a replicator would write it: once, whatever it sends again."""
    result = await pool.execute(
        "INSERT INTO messages (session_id, seq, turn_key, ordinal, role, content, timestamp, "
        "user_id, scope) VALUES ($1, $2, $3, $4, 'user', $5, 0, $6, $7) "
        "ON CONFLICT (turn_key, ordinal) DO NOTHING",
        session_id, seq, turn_key, ordinal, content, user_id,
        scope_tokens(user_id, session_id))
    return int(result.split()[-1])  # "INSERT 0 n"


async def scoped_search(pool: Pool[Record], words: str, *, user_id: str | None = None,
                        session_id: str | None = None) -> list[str]:
    token = scope_token_for(user_id, None) if user_id else scope_token_for(None, session_id)
    rows = await pool.fetch(
        "SELECT content FROM messages "
        "WHERE search @@ (to_tsquery('simple', $1 || ':A') && plainto_tsquery('simple', $2)) "
        "ORDER BY id", token, words)
    return [r["content"] for r in rows]


async def test_a_message_sent_again_is_stored_once(pool: Pool[Record]) -> None:
    await upgrade(pool)
    first = await insert_message(pool, turn_key="t1", ordinal=0, content="hello",
                                 user_id="alice", session_id="s1")
    again = await insert_message(pool, turn_key="t1", ordinal=0, content="hello",
                                 user_id="alice", session_id="s1")
    assert (first, again) == (1, 0)
    applied = [await pool.execute(
        "INSERT INTO applied_records (record_key, kind) VALUES ('kv:1', 'kv') "
        "ON CONFLICT DO NOTHING") for _ in range(2)]
    assert applied == ["INSERT 0 1", "INSERT 0 0"]
    assert await pool.fetchval("SELECT count(*) FROM messages") == 1


async def test_full_text_search_is_scoped_to_the_user_or_the_session(
        pool: Pool[Record]) -> None:
    await upgrade(pool)
    await insert_message(pool, turn_key="a1", ordinal=0, user_id="alice", session_id="sa",
                         content="The deploy of the Billing service failed")
    await insert_message(pool, turn_key="b1", ordinal=0, user_id="bob", session_id="sb",
                         content="the billing deploy went fine")
    # Bob writes Alice's scope token as a word: it is text, never a scope.
    await insert_message(pool, turn_key="b2", ordinal=0, user_id="bob", session_id="sb",
                         content=f"{scope_token_for('alice', None)} billing")
    await insert_message(pool, turn_key="n1", ordinal=0, user_id=None, session_id="lone",
                         content="billing without a user")

    assert await scoped_search(pool, "billing deploy", user_id="alice") == [
        "The deploy of the Billing service failed"]
    assert len(await scoped_search(pool, "billing", user_id="bob")) == 2
    # 'simple': no stop words dropped, no stemming ("failed" is not "fail").
    assert await scoped_search(pool, "the", user_id="alice") != []
    assert await scoped_search(pool, "fail", user_id="alice") == []
    assert await scoped_search(pool, "billing", session_id="lone") == [
        "billing without a user"]


async def test_a_huge_message_is_stored_and_its_head_searchable(pool: Pool[Record]) -> None:
    """A 16 MiB message of distinct words (a log dump) would make a tsvector past its 1 MB
    limit and fail its insert; only its first SEARCH_CHARS characters are indexed."""
    await upgrade(pool)
    rnd = random.Random(7)
    words = [f"w{rnd.getrandbits(40):x}" for _ in range(16 * 1024 * 1024 // 12)]
    content = " ".join(words)
    assert len(content) > 100 * SEARCH_CHARS

    assert await insert_message(pool, turn_key="big", ordinal=0, content=content,
                                user_id="alice", session_id="s") == 1
    assert await scoped_search(pool, words[0], user_id="alice") == [content]
    assert await scoped_search(pool, words[-1], user_id="alice") == []


# hermes-memory db


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["db", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def hermes_memory(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hermes_async_memory.cli", *args], capture_output=True,
        text=True, env=child_env(**env), timeout=RUN_TIMEOUT_S, check=False)


def test_cli_db_status_and_upgrade(pg_dsn: str, pg_server: PostgresServer,
                                   capsys: pytest.CaptureFixture[str],
                                   monkeypatch: pytest.MonkeyPatch, clean_env: None) -> None:
    monkeypatch.setenv("DATABASE_URL", pg_dsn)
    database = pg_dsn.rsplit("/", 1)[1]

    code, out, err = run_cli(capsys, "status")
    assert code == 0, err
    assert f"0 (this library: {SCHEMA_VERSION})" in out
    assert f"{SCHEMA_VERSION} migrations pending: run `hermes-memory db upgrade`" in out
    assert "hermes:***@127.0.0.1" in out

    code, out, err = run_cli(capsys, "upgrade")
    assert code == 0, err
    assert [line.split()[1] for line in out.splitlines() if line.startswith("applied ")] == [
        str(m.version) for m in MIGRATIONS]
    assert f'database "{database}"' in out
    assert f"schema version {SCHEMA_VERSION} (was 0)" in out

    code, out, err = run_cli(capsys, "upgrade")
    assert code == 0, err
    assert f"schema version {SCHEMA_VERSION}, up to date" in out

    monkeypatch.delenv("DATABASE_URL")
    code, out, err = run_cli(capsys, "status", "--json", "--dsn", pg_dsn)
    assert code == 0, err
    report = json.loads(out)
    assert report["current"] is True
    assert report["version"] == report["expected"] == SCHEMA_VERSION
    assert report["database"] == database
    assert report["dsn"].startswith("postgresql://hermes:***@")
    pg_server.assert_no_password(out + err)


def test_cli_db_without_a_dsn_is_a_usage_error(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch,
                                               clean_env: None) -> None:
    monkeypatch.delenv("DATABASE_URL", raising=False)
    code, _, err = run_cli(capsys, "upgrade")
    assert code == 2
    assert err.count("\n") == 1
    assert "DATABASE_URL" in err


def test_cli_db_errors_are_one_line_without_the_password(
        pg_dsn: str, pg_server: PostgresServer) -> None:
    wrong = pg_server.dsn(pg_dsn.rsplit("/", 1)[1], password=pg_server.app_password + "x")

    refused = hermes_memory("db", "upgrade", DATABASE_URL=wrong)

    assert refused.returncode == 1
    assert refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("hermes-memory: error: PostgreSQL at postgresql://hermes:"
                                     "***@127.0.0.1:")
    assert "password authentication failed" in refused.stderr
    pg_server.assert_no_password(refused.stdout + refused.stderr)

    async def make_newer() -> None:
        async with open_pool(Settings(postgres_dsn=pg_dsn)) as p:
            await upgrade(p)
            await p.execute("INSERT INTO schema_version (version, name) VALUES ($1, 'x')",
                            SCHEMA_VERSION + 1)

    anyio.run(make_newer)
    newer = hermes_memory("db", "upgrade", "--dsn", pg_dsn)
    assert newer.returncode == 1
    assert newer.stderr.count("\n") == 1, newer.stderr
    assert "newer than this library" in newer.stderr
    pg_server.assert_no_password(newer.stdout + newer.stderr)
