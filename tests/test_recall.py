"""Recall: hostile input is stored safely or refused clearly; users never see each other."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.recall import match_expression, query_terms

FTS_SYNTAX = ['"', '""', "*", "NEAR(", "NEAR(a b", "AND", "OR", "NOT", "-", ":", "a:b",
              "^start", "(unbalanced", "col:", "{scope}: x", "'", "\\", "+", "a AND OR b"]
SQL_FRAGMENTS = ["'; DROP TABLE messages; --", "1 OR 1=1", "\") UNION SELECT * FROM sessions --"]


@pytest.mark.parametrize("text", FTS_SYNTAX + SQL_FRAGMENTS)
async def test_query_syntax_and_sql_are_stored_verbatim_and_searchable(
    mem: MemoryPipeline, text: str
) -> None:
    content = f"marker {text} tail"
    mem.sync_turn(content, "ack", session_id="s", user_id="u")
    await mem.flush()
    assert (await mem.get_messages("s"))[0]["content"] == content
    # As a query it is plain words, never syntax: no error, and the marker is found.
    assert "marker" in await mem.search(f"{text} marker", user_id="u")
    await mem.search(text, user_id="u")
    mem.queue_prefetch(text, session_id="s", user_id="u")
    mem.queue_prefetch(f"marker {text}", session_id="s", user_id="u")
    await mem.wait_until(
        lambda: mem.prefetch_status("s", user_id="u").recall_query is not None, timeout=10)
    assert mem.stats().recall_errors == 0


async def test_tables_survive_sql_fragments(mem: MemoryPipeline, settings: Settings) -> None:
    for text in SQL_FRAGMENTS:
        mem.sync_turn(text, text, session_id=text, user_id=text)
    await mem.flush()
    conn = sqlite3.connect(settings.db_path)
    try:
        assert conn.execute("SELECT count(*) FROM messages").fetchone()[0] == 2 * len(SQL_FRAGMENTS)
        assert conn.execute("SELECT count(*) FROM sessions").fetchone()[0] == len(SQL_FRAGMENTS)
    finally:
        conn.close()


async def test_lone_surrogates_are_kept_and_indexed_with_a_replacement_char(
        mem: MemoryPipeline) -> None:
    mem.sync_turn("broken \ud800 surrogate quokka", "reply \udfff", session_id="s", user_id="u")
    await mem.flush()
    stored = await mem.get_messages("s")
    assert stored[0]["content"] == "broken \ufffd surrogate quokka"  # the indexed copy
    assert stored[1]["content"] == "reply \ufffd"
    assert [m["message"]["content"] for m in stored] == ["broken \ud800 surrogate quokka",
                                                         "reply \udfff"]  # as given
    assert "quokka" in await mem.search("quokka", user_id="u")
    assert mem.stats().sanitized_turns == 1


async def test_nul_bytes_emoji_and_rtl_text_round_trip(mem: MemoryPipeline) -> None:
    texts = [
        "before\x00after nulword",
        "party 🎉🦜 time emojiword 👩‍👩‍👧",
        "שלום עולם hebrewword",
        "مرحبا بالعالم arabicword",
        "mixed \u202eRTL override\u202c ltrword",
    ]
    for i, text in enumerate(texts):
        mem.sync_turn(text, f"reply {i}", session_id="s", user_id="u")
    await mem.flush()
    stored = [m["message"]["content"] for m in await mem.get_messages("s")
              if m["role"] == "user"]
    assert stored == texts  # as given, NUL and all (the index holds NUL as U+FFFD)
    for word in ("nulword", "emojiword", "עולם", "بالعالم", "ltrword"):
        assert word in await mem.search(word, user_id="u"), word


async def test_five_megabyte_message_is_stored_and_recallable(mem: MemoryPipeline) -> None:
    filler = "lorem ipsum dolor sit amet " * 200_000  # 5.4 MB
    text = filler[:2_500_000] + " needleword " + filler[2_500_000:]
    assert len(text.encode()) > 5_000_000
    mem.sync_turn(text, "that was long", session_id="big", user_id="u")
    mem.sync_turn("small one after", "ok", session_id="big", user_id="u")
    await mem.flush()
    stored = await mem.get_messages("big")
    assert stored[0]["content"] == text
    assert stored[2]["content"] == "small one after"
    assert "needleword" in await mem.search("needleword", user_id="u")
    assert len(mem.prefetch("", session_id="big")) < 10_000  # the block stays compact


async def test_recall_never_crosses_users(mem: MemoryPipeline) -> None:
    mem.sync_turn("my bank pin is zebra4417", "noted", session_id="a1", user_id="alice")
    mem.sync_turn("the zebra at the zoo", "nice", session_id="b1", user_id="bob")
    mem.sync_turn("what about zebra4417", "hm", session_id="b2", user_id="bob")
    await mem.flush()
    for query in ("zebra4417 bank pin", "zebra", "pin", "bank"):
        block = await mem.search(query, user_id="bob")
        assert "bank pin" not in block and "zebra4417\n" not in block
    assert "bank pin" in await mem.search("zebra4417 bank pin", user_id="alice")
    mem.queue_prefetch("zebra4417 bank pin", session_id="b1", user_id="bob")
    await mem.wait_until(
        lambda: mem.prefetch_status("b1", user_id="bob").recall_query is not None, timeout=10)
    assert "bank pin" not in mem.prefetch("", session_id="b1", user_id="bob")
    assert "zebra at the zoo" in mem.prefetch("", session_id="b1", user_id="bob")


async def test_sessions_without_a_user_recall_only_their_own_rows(mem: MemoryPipeline) -> None:
    mem.sync_turn("alpha secret papaya", "x", session_id="one")
    mem.sync_turn("beta talks about papaya", "y", session_id="two")
    await mem.flush()
    assert "alpha secret" in await mem.search("papaya", session_id="one")
    assert "alpha secret" not in await mem.search("papaya", session_id="two")


async def test_very_frequent_terms_are_dropped(tmp_path) -> None:  # type: ignore[no-untyped-def]
    settings = Settings(db_path=tmp_path / "m.db", frequent_term_rows=10)
    async with MemoryPipeline(settings) as mem:
        for i in range(30):
            mem.sync_turn(f"the weather today {i}", "the answer", session_id="s", user_id="u")
        mem.sync_turn("the rare aardvark", "ok", session_id="s", user_id="u")
        await mem.flush()
        terms = await mem.store.refresh_frequent_terms(settings.frequent_term_rows, 0.5)
        assert "the" in terms and "aardvark" not in terms
        assert query_terms("the aardvark", terms, 8) == ["aardvark"]
        block = await mem.search("the aardvark", user_id="u")
        assert "aardvark" in block and "weather" not in block


def test_every_token_is_quoted() -> None:
    terms = query_terms('NEAR(a "b" c*) AND -d:e', frozenset(), 8)
    expr = match_expression(terms, "uabc")
    assert expr.startswith('scope:"uabc" AND content:(')
    for t in terms:
        assert f'"{t}"' in expr
    assert "*" not in expr and "NEAR(" not in expr and "-" not in expr


def test_query_terms_are_capped_and_longest_first() -> None:
    terms = query_terms("a bb ccc dddd eeeee ffffff ggggggg hhhhhhhh iiiiiiiii", frozenset(), 3)
    assert terms == ["iiiiiiiii", "hhhhhhhh", "ggggggg"]


async def test_warm_ups_are_a_bounded_queue_and_the_excess_is_shed_and_counted(
    tmp_path: Path,
) -> None:
    """Before, warm() of 200,000 distinct sessions started 200,000 tasks (674 MB)."""
    settings = Settings(db_path=tmp_path / "m.db", max_pending_warms=100)
    async with MemoryPipeline(settings) as mem:
        for i in range(20):
            mem.sync_turn(f"stored turn {i}", "r", session_id=f"s{i}", user_id="u")
    async with MemoryPipeline(settings) as mem:
        tasks_before = len(asyncio.all_tasks())
        for i in range(20_000):
            mem.warm(f"s{i}", user_id="u")
        stats = mem.stats()
        assert stats.warm_backlog <= 100
        assert stats.warms_shed >= 20_000 - 100
        assert len(asyncio.all_tasks()) == tasks_before
        await mem.wait_until(lambda: mem.stats().warm_backlog == 0, timeout=30)
        # What was not shed was warmed: the first sessions asked for, which hold turns.
        assert "stored turn 0" in mem.prefetch(session_id="s0", user_id="u")
        assert mem.stats().sessions_warmed == 20
