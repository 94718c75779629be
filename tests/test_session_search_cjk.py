"""Session search over text the word index cannot split into words (Chinese, Japanese,
Korean): found as substrings through the trigram index (or LIKE, for strings shorter than
three characters and on a SQLite without the trigram tokenizer), scoped as the word search,
gone with a deleted session, built for a store from before it; and hyphenated words marked
as one match."""
# ruff: noqa: RUF001 (Chinese text writes its comma full-width: meant)

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Iterator
from json.encoder import encode_basestring_ascii
from pathlib import Path
from typing import Any

import aiosqlite
import pytest

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.sessions import SearchHit, SessionReads, SessionWrites
from hermes_async_memory.sessions.transfer import export_sessions, import_sessions
from hermes_async_memory.store import SCHEMA_VERSION
from hermes_async_memory.store.text_index import (
    CJK_GLOB,
    CJK_RANGES,
    has_cjk,
    payload_has_cjk,
)
from hermes_async_memory.turns import encode_payload

from .helpers import file_rows as _rows
from .sqlite_faults import refusing_connection

ZH = "大别山项目计划书已经发给你了"
ZH_REPLY = "好的，我会在周五前准备大别山项目的预算。"
JA = "こんにちは世界、東京タワーに行きましょう"
KO = "안녕하세요, 회의는 내일 오전입니다"


def _ann_turns(p: MemoryPipeline) -> None:
    p.sync_turn(ZH, ZH_REPLY, session_id="zh", user_id="ann", metadata={"model": "m1"})
    p.sync_turn(JA, "東京タワーは素晴らしいです", session_id="ja", user_id="ann",
                metadata={"source": "telegram"})
    p.sync_turn(KO, "네, 알겠습니다", session_id="ko", user_id="ann")
    p.sync_turn("We built a full-text index, state-of-the-art search", "see P2.2 for details",
                session_id="en", user_id="ann")
    # Bob says the same things: none of it is ann's to find.
    p.sync_turn(ZH, "東京タワー和大别山项目", session_id="bob-1", user_id="bob")


@pytest.fixture
async def mem(tmp_path: Path) -> AsyncIterator[MemoryPipeline]:
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db", source="cli")) as pipeline:
        _ann_turns(pipeline)
        await pipeline.flush()
        yield pipeline


async def _find(mem: MemoryPipeline, query: str, **kw: Any) -> list[SearchHit]:
    kw.setdefault("user_id", "ann")
    return await SessionReads(mem).search(query, limit=100, **kw)


async def _snippets(mem: MemoryPipeline, query: str, **kw: Any) -> set[str]:
    return {h.snippet for h in await _find(mem, query, **kw)}


def _assert_index_matches_messages(db: Path) -> None:
    """The trigram index holds exactly the stored messages with CJK text, and is sound."""
    indexed = {r[0] for r in _rows(db, "SELECT id FROM messages_trgm_docsize")}
    with_cjk = {r[0] for r in _rows(db, "SELECT id, content FROM messages")
                if r[1] and has_cjk(r[1])}
    assert indexed == with_cjk
    _rows(db, "INSERT INTO messages_trgm (messages_trgm) VALUES ('integrity-check')")


async def test_cjk_text_is_found_in_chinese_japanese_and_korean_with_the_match_marked(
        mem: MemoryPipeline) -> None:
    assert await _snippets(mem, "大别山") == {
        ">>>大别山<<<项目计划书已经发给你了", "好的，我会在周五前准备>>>大别山<<<项目的预算。"}
    assert await _snippets(mem, "项目计划书") == {"大别山>>>项目计划书<<<已经发给你了"}
    assert await _snippets(mem, "東京タワー") == {
        "こんにちは世界、>>>東京タワー<<<に行きましょう", ">>>東京タワー<<<は素晴らしいです"}
    assert await _snippets(mem, "회의는") == {"안녕하세요, >>>회의는<<< 내일 오전입니다"}
    # Every word must be there (plain text), each marked; ranked by bm25 over the index.
    [hit] = await _find(mem, "大别山 预算")
    assert hit.snippet == "好的，我会在周五前准备>>>大别山<<<项目的>>>预算<<<。"
    assert hit.rank < 0 and (hit.session_id, hit.user_id, hit.model) == ("zh", "ann", "m1")
    assert hit.before is not None and hit.before.content == ZH
    # The word index alone keeps a CJK run as one word: these are found through the trigram
    # index only.
    assert _rows(mem.settings.db_path, "SELECT count(*) FROM messages_fts "
                 "WHERE messages_fts MATCH 'content:\"大别山\"'") == [(0,)]
    assert await _find(mem, "大别山项目计划书已经发给你了吗") == []


async def test_a_two_character_query_is_found_and_marked(mem: MemoryPipeline) -> None:
    assert await _snippets(mem, "项目") == {
        "大别山>>>项目<<<计划书已经发给你了", "好的，我会在周五前准备大别山>>>项目<<<的预算。"}
    assert await _snippets(mem, "世界") == {"こんにちは>>>世界<<<、東京タワーに行きましょう"}
    assert await _snippets(mem, "안녕") == {">>>안녕<<<하세요, 회의는 내일 오전입니다"}
    assert await _snippets(mem, "山") == {
        "大别>>>山<<<项目计划书已经发给你了", "好的，我会在周五前准备大别>>>山<<<项目的预算。"}
    # A short string beside a long one: the long one through the index, the short one checked.
    assert await _snippets(mem, "大别山 周五") == {
        "好的，我会在>>>周五<<<前准备>>>大别山<<<项目的预算。"}
    assert await _find(mem, "预算 计划") == []  # never in the same message


async def test_a_long_message_shows_the_text_around_its_match(tmp_path: Path) -> None:
    before, after = "这是一段很长的前缀用来把匹配位置推到文档中间" * 5, "后面还有很多内容" * 20
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db")) as mem:
        mem.sync_turn(before + "记忆断裂" + after, "好", session_id="s", user_id="u")
        await mem.flush()
        for query in ("记忆断裂", "断裂"):
            [hit] = await _find(mem, query, user_id="u")
            assert hit.snippet.startswith("…") and hit.snippet.endswith("…")
            assert hit.snippet.count(">>>") == 1
            assert f">>>{query}<<<" in hit.snippet
            shown = hit.snippet.strip("…").replace(">>>", "").replace("<<<", "")
            assert shown in before + "记忆断裂" + after and 60 <= len(shown) <= 110


async def test_cjk_search_is_scoped_and_filtered_as_the_word_search(
        mem: MemoryPipeline) -> None:
    for query in ("大别山项目", "项目", "東京タワー", "タワー"):  # the index, and LIKE
        assert {h.user_id for h in await _find(mem, query)} == {"ann"}, query
        assert {h.user_id for h in await _find(mem, query, user_id="bob")} == {"bob"}, query
        everyone = await _find(mem, query, user_id=None, all_users=True)
        assert {h.user_id for h in everyone} == {"ann", "bob"}, query
        assert await _find(mem, query, session_id="bob-1") == []  # bob's, not ann's
        assert await _find(mem, query, user_id="carol") == []
    assert {h.session_id for h in await _find(mem, "東京タワー", sources=["telegram"])} == {
        "ja"}
    assert await _find(mem, "東京タワー", exclude_sources=["telegram"]) == []
    assert {h.role for h in await _find(mem, "大别山", roles=["assistant"])} == {"assistant"}
    assert {h.role for h in await _find(mem, "项目", roles=["user"])} == {"user"}
    assert {h.session_id for h in await _find(mem, "项目", session_id="zh")} == {"zh"}
    assert await _find(mem, "项目", session_id="ja") == []


async def test_fts5_syntax_over_cjk_text(mem: MemoryPipeline) -> None:
    async def sessions(query: str) -> set[str]:
        return {h.session_id for h in await _find(mem, query, syntax="fts5")}

    assert await sessions("大别山项目 OR 東京タワー") == {"zh", "ja"}
    assert await sessions("大别山 NOT 预算计划") == {"zh"}
    assert await sessions('"大别山" AND "计划书"') == {"zh"}
    assert await sessions("项目 OR 世界") == {"zh", "ja"}  # short strings: LIKE
    assert await sessions("大别山 NOT 预算") == {"zh"}
    # An alternative without CJK text: found in every message (LIKE), not only the indexed.
    assert await sessions('"full-text" OR 東京タワー') == {"en", "ja"}
    assert await sessions("^東京 AND タワー") == {"ja"}
    assert await sessions("NEAR(大别山 预算)") == {"zh"}


async def test_cjk_pages_are_disjoint_and_cover_every_hit(tmp_path: Path) -> None:
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db")) as mem:
        for i in range(7):
            mem.sync_turn(f"第{i}次测试项目计划", "收到", session_id=f"s{i % 2}", user_id="u")
        await mem.flush()
        reads = SessionReads(mem)
        for query in ("项目计划", "项目"):
            every = await reads.search(query, user_id="u", limit=100)
            assert len(every) == 7
            pages = [await reads.search(query, user_id="u", limit=3, offset=o)
                     for o in (0, 3, 6, 9)]
            assert [len(p) for p in pages] == [3, 3, 1, 0]
            assert [h.message_id for p in pages for h in p] == [h.message_id for h in every]
        newest = await reads.search("项目计划", user_id="u", order="newest", limit=100)
        assert [h.message_id for h in newest] == sorted(
            (h.message_id for h in newest), reverse=True)


async def test_a_deleted_session_takes_its_cjk_text_out_of_the_index(
        mem: MemoryPipeline) -> None:
    db = mem.settings.db_path
    writes = SessionWrites(mem)
    await writes.delete("zh", user_id="ann")
    await mem.flush()
    for query in ("大别山", "大别山项目", "项目", "预算"):
        assert await _find(mem, query) == [], query
    assert {h.session_id for h in await _find(mem, "大别山", user_id="bob")} == {"bob-1"}
    _assert_index_matches_messages(db)
    # Prune takes an ended session the same way.
    await writes.end("ja", "done", user_id="ann")
    await mem.flush()
    result = await writes.prune(0)
    assert "ja" in result.deleted
    assert await _find(mem, "東京タワー") == []
    _assert_index_matches_messages(db)


async def test_imported_and_replaced_cjk_messages_are_found_and_the_old_ones_gone(
        mem: MemoryPipeline) -> None:
    db = mem.settings.db_path
    writes = SessionWrites(mem)
    lines = [line async for line in export_sessions(mem, session_id="zh")]
    await writes.delete("zh", user_id="ann")
    await mem.flush()
    assert await _find(mem, "大别山项目") == []
    result = await import_sessions(mem, lines)
    assert result.messages == 2
    hits = await _find(mem, "大别山项目")
    assert {h.snippet for h in hits} == {
        ">>>大别山项目<<<计划书已经发给你了", "好的，我会在周五前准备>>>大别山项目<<<的预算。"}
    assert all(h.rank < 0 for h in hits)  # through the index
    _assert_index_matches_messages(db)
    replace = getattr(writes, "replace_messages_nowait", None)
    if replace is None:  # no replacement of a session's messages in this version
        return
    replace("zh", [{"role": "user", "content": "换成了黄山旅游攻略"},
                   {"role": "assistant", "content": "黄山旅游攻略已保存"}], user_id="ann")
    await mem.flush()
    assert await _find(mem, "大别山项目") == []
    assert await _snippets(mem, "黄山旅游") == {
        "换成了>>>黄山旅游<<<攻略", ">>>黄山旅游<<<攻略已保存"}
    assert all(h.rank < 0 for h in await _find(mem, "黄山旅游"))
    _assert_index_matches_messages(db)


async def test_a_store_from_version_8_indexes_its_cjk_messages_when_opened(
        tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        _ann_turns(mem)
        await mem.flush()
    # As version 8 left it: no trigram index.
    conn = sqlite3.connect(db)
    conn.executescript("DROP TRIGGER messages_trgm_delete; DROP TABLE messages_trgm; "
                       "UPDATE schema_version SET version = 8;")
    conn.close()
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        assert _rows(db, "SELECT version FROM schema_version") == [(SCHEMA_VERSION,)]
        _assert_index_matches_messages(db)
        hits = await _find(mem, "大别山项目")
        assert {h.snippet for h in hits} == {
            ">>>大别山项目<<<计划书已经发给你了", "好的，我会在周五前准备>>>大别山项目<<<的预算。"}
        assert all(h.rank < 0 for h in hits)  # ranked: the index answered
        mem.sync_turn("新的大别山消息", "好", session_id="zh", user_id="ann")
        await mem.flush()
        assert len(await _find(mem, "大别山")) == 3
        _assert_index_matches_messages(db)


# A SQLite built without the trigram tokenizer: it refuses to make a table with it, as such
# a SQLite does (its message), and is otherwise the same.
_NoTrigram = refusing_connection("tokenize='trigram'", "no such tokenizer: trigram")


@pytest.fixture
def no_trigram(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    real = aiosqlite.connect

    def connect(database: Any, **kw: Any) -> aiosqlite.Connection:
        return real(database, factory=_NoTrigram, **kw)

    monkeypatch.setattr(aiosqlite, "connect", connect)
    yield


async def _like_only_checks(mem: MemoryPipeline) -> None:
    """What a store without the trigram index answers: everything, by LIKE (unranked)."""
    hits = await _find(mem, "大别山项目")
    assert {h.snippet for h in hits} == {
        ">>>大别山项目<<<计划书已经发给你了", "好的，我会在周五前准备>>>大别山项目<<<的预算。"}
    assert all(h.rank == 0 for h in hits)
    assert await _snippets(mem, "タワー", sources=["telegram"]) == {
        "こんにちは世界、東京>>>タワー<<<に行きましょう", "東京>>>タワー<<<は素晴らしいです"}
    assert {h.user_id for h in await _find(mem, "大别山")} == {"ann"}
    assert await _snippets(mem, "full-text") == {
        "We built a >>>full-text<<< index, state-of-the-art search"}


async def test_without_the_trigram_tokenizer_the_store_opens_and_search_uses_like(
        tmp_path: Path, no_trigram: None) -> None:
    db = tmp_path / "m.db"
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        _ann_turns(mem)
        await mem.flush()
        assert _rows(db, "SELECT count(*) FROM sqlite_master WHERE name LIKE 'messages_trgm%'"
                     ) == [(0,)]
        await _like_only_checks(mem)
        await SessionWrites(mem).delete("zh", user_id="ann")
        await mem.flush()
        assert await _find(mem, "大别山") == []


async def test_a_store_opened_without_the_tokenizer_is_reindexed_by_one_with_it(
        tmp_path: Path) -> None:
    """A store made with the index, opened where SQLite lacks the tokenizer (faked by
    naming one that does not exist: SQLite's own refusal), then where it has it again."""
    db = tmp_path / "m.db"
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        _ann_turns(mem)
        await mem.flush()

    def tokenizer(old: str, new: str) -> None:
        conn = sqlite3.connect(db)
        conn.execute("PRAGMA writable_schema = ON")
        conn.execute("UPDATE sqlite_master SET sql = replace(sql, ?, ?) "
                     "WHERE name = 'messages_trgm'", (f"tokenize='{old}'", f"tokenize='{new}'"))
        conn.commit()
        conn.close()

    tokenizer("trigram", "trigram_missing")
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        await _like_only_checks(mem)
        # Deletes and new CJK text go on; the index cannot follow them here.
        await SessionWrites(mem).delete("zh", user_id="ann")
        mem.sync_turn("新的大别山项目消息", "好", session_id="zh2", user_id="ann")
        await mem.flush()
        assert {h.session_id for h in await _find(mem, "大别山项目")} == {"zh2"}
    tokenizer("trigram_missing", "trigram")
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        _assert_index_matches_messages(db)
        hits = await _find(mem, "大别山项目")
        assert [(h.session_id, h.snippet) for h in hits] == [
            ("zh2", "新的>>>大别山项目<<<消息")]
        assert hits[0].rank < 0


def _code_points() -> list[int]:
    """Every code point of the Basic Multilingual Plane (not surrogates), and each range's
    edges past it."""
    edges = {c + d for lo, hi in CJK_RANGES for c in (lo, hi) for d in (-1, 0, 1)}
    bmp = [c for c in range(0x80, 0x10000) if not 0xD800 <= c <= 0xDFFF]
    return bmp + sorted(c for c in edges if c > 0xFFFF)


def test_the_index_fill_the_query_and_the_record_agree_on_what_cjk_is() -> None:
    """A query goes to the trigram index when ``has_cjk`` says so; the index takes the
    messages SQLite's GLOB picks, from the turns whose record ``payload_has_cjk`` picks: a
    character one of them misses would make its messages unfindable."""
    points = _code_points()
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t (c INTEGER, content TEXT)")
    conn.executemany("INSERT INTO t VALUES (?, ?)", [(c, f"a{chr(c)}b") for c in points])
    globbed = {r[0] for r in conn.execute(f"SELECT c FROM t WHERE content GLOB {CJK_GLOB}")}
    conn.close()
    expected = {c for c in points if any(lo <= c <= hi for lo, hi in CJK_RANGES)}
    assert globbed == expected
    assert {c for c in points if has_cjk(f"a{chr(c)}b")} == expected
    seen = {c for c in points if payload_has_cjk(encode_basestring_ascii(f"a{chr(c)}b"))}
    assert expected <= seen
    # The record may say yes for a little more (its high surrogate's whole block), not less.
    assert all(0x1B000 <= c <= 0x1B3FF for c in seen - expected)
    record = encode_payload("k", "s", "u", 1.0, [("user", "记忆", None, None, None, None, None,
                                                    None)], None)
    assert payload_has_cjk(record) and not payload_has_cjk(encode_payload(
        "k", "s", "u", 1.0, [("user", "naïve — “quoted”", None, None, None, None, None, None)],
        None))


async def test_hyphenated_words_are_marked_as_one_match(mem: MemoryPipeline) -> None:
    text = "We built a full-text index, state-of-the-art search"
    for query in ("full-text", "Full-Text", "full-text index"):
        [hit] = await _find(mem, query)
        assert hit.snippet.count(">>>full-text<<<") == 1, query
        assert hit.snippet.replace(">>>", "").replace("<<<", "") == text
    [hit] = await _find(mem, "state-of-the-art")
    assert hit.snippet == "We built a full-text index, >>>state-of-the-art<<< search"
    [hit] = await _find(mem, "state-of-the-art", syntax="fts5")  # bare, as FTS5 would refuse
    assert hit.snippet == "We built a full-text index, >>>state-of-the-art<<< search"
    [hit] = await _find(mem, "P2.2")
    assert hit.snippet == "see >>>P2.2<<< for details"
    # The words apart, in another order, are not the hyphenated word.
    assert await _find(mem, "text-full") == []


async def test_a_hyphenated_word_at_the_end_of_a_snippet_is_marked_whole(
        tmp_path: Path) -> None:
    """FTS5 cuts a snippet after its 32nd word, and closes the mark there, inside a phrase
    that starts before and ends after: the mark must close after the whole word."""
    filler = " ".join(f"w{i}" for i in range(29))
    tail = " ".join(f"t{i}" for i in range(40))
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db")) as mem:
        mem.sync_turn(f"{filler} state-of-the-art {tail}", "ok", session_id="s", user_id="u")
        mem.sync_turn("Run the chat-send command", "done", session_id="s", user_id="u")
        await mem.flush()
        [hit] = await _find(mem, "state-of-the-art", user_id="u")
        assert hit.snippet == f"{filler} >>>state-of-the-art<<<…"
        [hit] = await _find(mem, "state-of-the-art", user_id=None, all_users=True)
        assert hit.snippet == f"{filler} >>>state-of-the-art<<<…"
        # Hermes Agent's own check (TestFTS5Search.test_search_hyphenated_term_does_not_crash).
        [hit] = await _find(mem, "chat-send", user_id="u")
        assert "chat-send" in hit.snippet.lower()
