"""Recall finds what the agent needs, on a small labelled set of our own (not LoCoMo):
stemmed forms match, stopwords do not crowd out the words that matter, the reply beside a
matching message shows with it, and an older store's index is rebuilt to stem while turns
are accepted and recalls are served, with nothing lost."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.recall import query_terms
from hermes_async_memory.recall.cache import RECALL_HEADER
from hermes_async_memory.recall.query import all_frequent
from hermes_async_memory.store import SCHEMA_VERSION, text_index

WAIT_S = 30


async def recall_lines(mem: MemoryPipeline, query: str, *, user: str = "u",
                       session: str = "asking") -> list[str]:
    """The recall part of the block a fresh session of ``user`` gets for ``query``."""
    mem.queue_prefetch(query, session_id=session, user_id=user)
    await mem.wait_until(
        lambda: mem.prefetch_status(session, user_id=user).recall_query == query,
        timeout=WAIT_S)
    block = mem.prefetch(query, session_id=session, user_id=user)
    if not block:
        return []
    head, _, rest = block.partition(RECALL_HEADER + "\n")
    assert not head  # a fresh session: no recent turns before the recall
    return rest.split("\n\n")[0].split("\n")


# (user text, assistant text) per turn, and (query, the text the first line must show).
LABELLED = [
    ("I went running along the river every morning last spring", "That is a lovely habit."),
    ("My daughter's teacher is called Mrs Okafor", "Noted, Mrs Okafor."),
    ("We adopted two kittens from the shelter in June", "Kittens! What are their names?"),
    ("Their names are Pepper and Miso", "Pepper and Miso, very cute."),
    ("I painted the garden fence blue over the weekend", "Blue sounds cheerful."),
    ("What is it that you would have done if it was there?",
     "I would have been there with them if it was what they were after."),
    ("It was not that it was the one they had been at", "So it is what it is, then."),
]
CASES = [
    # stemmed forms: "run" finds "running", "adopt" finds "adopted", "paint" finds "painted"
    ("where do I run?", "I went running along the river"),
    ("did we adopt any pets?", "We adopted two kittens"),
    ("what colour did I paint the fence", "I painted the garden fence blue"),
    # stopwords in the question and in the stored chatter do not outrank the word that
    # matters ("teacher"), and the answer to the reply-only question sits in the reply
    ("Who is the teacher that was there with them?", "Mrs Okafor"),
]


@pytest.fixture
async def labelled(tmp_path: Path):  # type: ignore[no-untyped-def]
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db")) as mem:
        for user_text, assistant_text in LABELLED:
            mem.sync_turn(user_text, assistant_text, session_id="talk", user_id="u")
        await mem.flush()
        yield mem


@pytest.mark.parametrize(("query", "expected"), CASES)
async def test_the_best_line_shows_what_answers(labelled: MemoryPipeline, query: str,
                                                expected: str) -> None:
    lines = await recall_lines(labelled, query)
    assert lines and expected in lines[0], lines


async def test_stopwords_and_inflections_fold_into_the_terms() -> None:
    terms = query_terms("What is it that they were running and what runs there?",
                        frozenset(), 8)
    assert terms == ["running"]  # "runs" is the same term; every other word is a stopword
    assert query_terms("Don't you think so?", frozenset(), 8) == ["think"]
    # A term the index finds in too many messages is left out by its stem.
    assert query_terms("runs to the shelter", frozenset({"run"}), 8) == ["shelter"]


def test_a_query_of_only_common_words_is_told_apart() -> None:
    """The inspector shows such a search newest first rather than rank much of the store:
    stopwords count as common, and a frequent term is known by its stem."""
    frequent = frozenset({"weather", "run"})
    assert all_frequent("what is the weather", frequent)  # stopwords and a frequent word
    assert all_frequent("you and I", frequent)  # stopwords only
    assert all_frequent("running runs", frequent)  # the index holds the stem
    assert not all_frequent("weather in lisbon", frequent)
    assert not all_frequent("?!", frequent)  # no word at all


async def test_the_reply_shows_beside_the_message_that_matched(
        labelled: MemoryPipeline) -> None:
    # Nothing in the reply matches "kittens names"? It does ("names"); ask for the
    # kittens alone: the matching message is the user's, the names are in the next turn.
    lines = await recall_lines(labelled, "kittens from the shelter")
    assert "We adopted two kittens" in lines[0]
    assert "assistant: Kittens! What are their names?" in lines[0]
    # The messages beside a hit are whole, in session order, each with its role.
    lines = await recall_lines(labelled, "who is Mrs Okafor", session="asking-2")
    first = lines[0]
    assert first.index("user: My daughter's teacher") < first.index(
        "assistant: Noted, Mrs Okafor.")


async def test_another_users_messages_never_show_beside_a_hit(tmp_path: Path) -> None:
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db")) as mem:
        # One session id, two users, their turns interleaved: ann's neighbours are ann's.
        mem.sync_turn("ann: the boat is called Aurora", "ann noted", session_id="shared",
                      user_id="ann")
        mem.sync_turn("bob: my pin is 4321", "bob secret kept", session_id="shared",
                      user_id="bob")
        mem.sync_turn("ann: Aurora sleeps four", "ann noted again", session_id="shared",
                      user_id="ann")
        await mem.flush()
        lines = await recall_lines(mem, "Aurora boat", user="ann")
        assert lines and all("bob" not in line and "4321" not in line for line in lines)


async def test_the_block_keeps_within_its_budget(tmp_path: Path) -> None:
    settings = Settings(db_path=tmp_path / "m.db", recall_limit=5, recall_chars_per_hit=200)
    async with MemoryPipeline(settings) as mem:
        for i in range(40):
            mem.sync_turn(f"walrus fact {i}: " + "walruses haul out on ice floes " * 8,
                          "interesting " * 30, session_id=f"s{i}", user_id="u")
        await mem.flush()
        lines = await recall_lines(mem, "walrus")
        assert 1 <= len(lines) <= 5
        assert sum(len(line) + 1 for line in lines) <= 200 * 5


def make_old_store(path: Path) -> None:
    """A store as version 11 left it: the same tables, a word index that does not stem."""
    conn = sqlite3.connect(path)
    try:
        conn.executescript("""
            DROP TRIGGER messages_fts_delete;
            DROP TABLE messages_vocab;
            DROP TABLE messages_fts;
            CREATE VIRTUAL TABLE messages_fts USING fts5(
                content, scope, content='messages', content_rowid='id',
                tokenize='unicode61 remove_diacritics 2');
            INSERT INTO messages_fts (messages_fts, rank) VALUES ('rank', 'bm25(1.0, 0.0)');
            INSERT INTO messages_fts (messages_fts) VALUES ('rebuild');
            CREATE VIRTUAL TABLE messages_vocab USING fts5vocab(messages_fts, 'col');
            CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
                INSERT INTO messages_fts(messages_fts, rowid, content, scope)
                VALUES ('delete', old.id, old.content, old.scope);
            END;
            DROP TABLE IF EXISTS index_rebuild;
            UPDATE schema_version SET version = 11;
        """)
    finally:
        conn.close()


def index_state(path: Path) -> tuple[str, int, int]:
    """The word index's definition, its document count and the number of messages; and
    FTS5's integrity check (raises when the index and the messages differ)."""
    conn = sqlite3.connect(path)
    try:
        conn.execute("INSERT INTO messages_fts (messages_fts, rank) "
                     "VALUES ('integrity-check', 1)")
        sql = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'messages_fts'"
                           ).fetchone()[0]
        docs = conn.execute("SELECT count(*) FROM messages_fts_docsize").fetchone()[0]
        messages = conn.execute("SELECT count(*) FROM messages").fetchone()[0]
        return sql, docs, messages
    finally:
        conn.close()


async def test_an_old_store_is_reindexed_while_turns_and_recalls_go_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Invariants: every turn accepted before, during and after the rebuild is stored once
    and in order per session; the rebuilt index holds every message once (FTS5's integrity
    check); recalls served during the rebuild answer from the old index; after it, stemmed
    forms match the old messages and the new."""
    path = tmp_path / "m.db"
    settings = Settings(db_path=path)
    async with MemoryPipeline(settings) as mem:
        for i in range(600):
            mem.sync_turn(f"old turn {i} about painting fences", f"old reply {i}",
                          session_id=f"s{i % 7}", user_id="u")
        await mem.flush()
    make_old_store(path)
    # Small slices; the rebuild holds after five of them (each step then does nothing)
    # until the test lets it go on, so that turns and recalls come while it is under way.
    monkeypatch.setattr(text_index, "REINDEX_SLICE", 25)
    go_on = asyncio.Event()
    steps = 0
    real_step = text_index.word_reindex_step

    async def held_step(db, slice_rows=None):  # type: ignore[no-untyped-def]
        nonlocal steps
        if steps >= 5 and not go_on.is_set():
            return await text_index.word_reindex_state(db)
        steps += 1
        return await real_step(db, slice_rows)

    monkeypatch.setattr("hermes_async_memory.store.messages.word_reindex_step", held_step)
    async with MemoryPipeline(settings) as mem:
        await mem.wait_until(lambda: steps >= 5, timeout=WAIT_S)
        assert mem.store.reindex is not None and not mem.store.word_index_stems
        during = mem.stats()
        assert (during.reindex_done, during.reindex_total) == (125, 1200)
        # Recalls meanwhile answer from the old index: the word as stored is found, its
        # stem is not yet.
        lines = await recall_lines(mem, "painting")
        assert lines and "painting fences" in lines[0]
        assert await recall_lines(mem, "paint", session="asking-2") == []
        for i in range(300):
            mem.sync_turn(f"new turn {i} about painted walls", f"new reply {i}",
                          session_id=f"s{i % 7}", user_id="u")
        await mem.flush()  # committed while the rebuild is under way
        assert mem.stats().reindex_total == 1200
        go_on.set()
        await mem.wait_until(lambda: mem.stats().reindex_total == 0, timeout=WAIT_S)
        assert mem.store.word_index_stems
        # Stemmed both ways now: neither word of the query is as the messages hold it.
        lines = await recall_lines(mem, "painted fence", session="after")
        assert lines and all("painting fences" in line for line in lines)
        lines = await recall_lines(mem, "paint wall", session="after-2")
        assert lines and all("painted walls" in line for line in lines)
    sql, docs, messages = index_state(path)
    assert "porter" in sql and docs == messages == 1800
    conn = sqlite3.connect(path)
    try:
        for s in range(7):
            texts = [r[0] for r in conn.execute(
                "SELECT content FROM messages WHERE session_id = ? AND role = 'user' "
                "ORDER BY id", (f"s{s}",))]
            expected = ([f"old turn {i} about painting fences" for i in range(600) if i % 7 == s]
                        + [f"new turn {i} about painted walls" for i in range(300)
                           if i % 7 == s])
            assert texts == expected
        assert conn.execute("SELECT count(*) FROM index_rebuild").fetchone()[0] == 0
        assert conn.execute("SELECT version FROM schema_version").fetchone()[0] == SCHEMA_VERSION
    finally:
        conn.close()


async def test_a_rebuild_cut_short_goes_on_at_the_next_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.db"
    settings = Settings(db_path=path)
    async with MemoryPipeline(settings) as mem:
        for i in range(200):
            mem.sync_turn(f"turn {i} on sailing boats", f"reply {i}", session_id="s",
                          user_id="u")
        await mem.flush()
    make_old_store(path)
    monkeypatch.setattr(text_index, "REINDEX_SLICE", 10)
    steps = 0
    real_step = text_index.word_reindex_step

    async def three_steps(db, slice_rows=None):  # type: ignore[no-untyped-def]
        nonlocal steps
        steps += 1
        if steps > 3:
            return await text_index.word_reindex_state(db)  # stalls: the process stops
        return await real_step(db, slice_rows)

    monkeypatch.setattr("hermes_async_memory.store.messages.word_reindex_step", three_steps)
    async with MemoryPipeline(settings) as mem:
        await mem.wait_until(lambda: steps > 3, timeout=WAIT_S)
        stopped_at = mem.stats().reindex_done
        assert 0 < stopped_at < 400
    monkeypatch.setattr("hermes_async_memory.store.messages.word_reindex_step", real_step)
    async with MemoryPipeline(settings) as mem:
        assert mem.stats().reindex_done == stopped_at  # goes on from where it was
        await mem.wait_until(lambda: mem.stats().reindex_total == 0, timeout=WAIT_S)
        assert any("sailing boats" in line for line in await recall_lines(mem, "sail"))
    sql, docs, messages = index_state(path)
    assert "porter" in sql and docs == messages == 400
