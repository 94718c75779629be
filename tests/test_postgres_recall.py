"""Recall from PostgreSQL, against a real server: what the local recall does (issue 26),
the server's ``english`` configuration stemming through a column filled and indexed after
the upgrade, the ``simple`` column answering until that index is valid, BM25 ranking over
the user's own messages, and the message beside a match shown in its line, never another
user's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from asyncpg import Pool, Record

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.backends.base import RecallRequest
from hermes_async_memory.postgres import open_pool, status, upgrade
from hermes_async_memory.postgres.recall import recall_block
from hermes_async_memory.postgres.schema import STEMMED_INDEX, build_stemmed_search

from .test_postgres_backend import pg_settings, replicated


@pytest.fixture
async def pool(pg_dsn: str) -> AsyncIterator[Pool[Record]]:
    async with open_pool(Settings(postgres_dsn=pg_dsn, postgres_pool_max_size=4)) as p:
        await upgrade(p)
        yield p


async def write(tmp_path: Path, dsn: str, turns: list[tuple[str, str, str, str]]) -> None:
    """(user, session, user text, reply) through a pipeline replicating to the database."""
    async with MemoryPipeline(pg_settings(tmp_path, dsn)) as mem:
        for user, session, text, reply in turns:
            mem.sync_turn(text, reply, session_id=session, user_id=user)
        await replicated(mem)


async def recall(pool: Pool[Record], query: str, user: str, limit: int = 5) -> str:
    return await recall_block(pool, RecallRequest(query, "asking", user, limit),
                              Settings(recall_limit=limit))


async def test_a_stemmed_form_matches_once_the_index_is_built_and_until_then_exact_words_do(
        tmp_path: Path, pg_dsn: str, pool: Pool[Record]) -> None:
    await write(tmp_path, pg_dsn, [
        ("alice", "s1", "I went running along the harbour every morning",
         "Then the lighthouse keeper must know you by now"),
        ("alice", "s1", "We talked about sourdough", "Flour, water, salt"),
    ])
    assert (await status(pool)).stemmed_index == "ready"
    block = await recall(pool, "does she still run?", "alice")
    assert "I went running along the harbour" in block
    # The reply beside the match is in its line.
    line = next(x for x in block.splitlines() if "running" in x)
    assert "lighthouse keeper" in line
    assert "sourdough" not in block

    # A database upgraded from version 5: its older rows have no stemmed vector and there
    # is no index yet. It answers through the simple column (the exact word matches, the
    # stemmed form does not) until build_stemmed_search fills them and builds the index.
    await pool.execute(f"DROP INDEX {STEMMED_INDEX}")
    await pool.execute("UPDATE messages SET search_stemmed = NULL")
    assert (await status(pool)).stemmed_index == "missing"
    async with open_pool(Settings(postgres_dsn=pg_dsn)) as fresh:
        assert "running along the harbour" in await recall(fresh, "running", "alice")
        assert await recall(fresh, "does she still run?", "alice") == ""
        assert await build_stemmed_search(fresh)
        assert not await build_stemmed_search(fresh)  # built once
    assert await pool.fetchval("SELECT count(*) FROM messages WHERE search_stemmed IS NULL") == 0
    assert (await status(pool)).stemmed_index == "ready"
    async with open_pool(Settings(postgres_dsn=pg_dsn)) as fresh:
        assert "running along the harbour" in await recall(fresh, "does she still run?",
                                                          "alice")


async def test_a_rare_word_outranks_a_word_the_user_says_all_the_time(
        tmp_path: Path, pg_dsn: str, pool: Pool[Record]) -> None:
    turns = [("alice", f"s{i % 3}", f"the boat needs paint again, day {i}", "noted")
             for i in range(30)]
    turns.insert(11, ("alice", "s1", "my boat is called Marigold", "a fine name"))
    await write(tmp_path, pg_dsn, turns)
    block = await recall(pool, "what is the boat called, Marigold?", "alice", limit=1)
    lines = block.splitlines()[1:]
    assert len(lines) == 1 and "my boat is called Marigold" in lines[0]


async def test_a_line_never_shows_another_users_message_of_the_same_session(
        tmp_path: Path, pg_dsn: str, pool: Pool[Record]) -> None:
    await write(tmp_path, pg_dsn, [
        ("alice", "shared", "where did I leave it?", "your locker code is under the blue mug"),
        ("bob", "shared", "bob's secret is the green door", "kept"),
        ("alice", "shared", "and the spare key?", "it hangs by the window"),
    ])
    block = await recall(pool, "where is the locker code?", "alice")
    line = next(x for x in block.splitlines() if "blue mug" in x)
    # The message after the match in the session is alice's next one, over bob's turn.
    assert "and the spare key?" in line
    assert "green door" not in block and "kept" not in block
    assert "green door" in await recall(pool, "secret", "bob")
    assert await recall(pool, "secret", "alice") == ""
