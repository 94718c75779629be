"""The session store's writes beyond a turn (what Hermes Agent's session store needs), each a
record in the session's lane of the outbox: messages of any role appended, a session's
messages replaced, its fields set or filled, its usage accounted per model and route, its
end cleared, first-wins ends, prune by start, and children detached from a deleted parent."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import pytest

from hermes_async_memory import InvalidTurnError, MemoryPipeline
from hermes_async_memory.sessions.lifecycle import DAY_S, InvalidSessionError


def row(db: Path, sql: str, *params: object) -> dict[str, Any] | None:
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        found = conn.execute(sql, params).fetchone()
    return None if found is None else dict(found)


def session(mem: MemoryPipeline, sid: str) -> dict[str, Any]:
    found = row(mem.settings.db_path, "SELECT * FROM sessions WHERE id = ?", sid)
    assert found is not None, sid
    return found


def usage_rows(mem: MemoryPipeline, sid: str) -> list[tuple[Any, ...]]:
    with sqlite3.connect(mem.settings.db_path) as conn:
        return conn.execute(
            "SELECT model, billing_provider, billing_base_url, billing_mode, task, "
            "api_call_count, input_tokens, output_tokens, estimated_cost_usd "
            "FROM session_model_usage WHERE session_id = ? ORDER BY model, billing_base_url",
            (sid,)).fetchall()


async def test_messages_of_any_role_are_appended_with_their_ids_and_timestamps(
        mem: MemoryPipeline) -> None:
    w = mem.sessions
    first = w.append_nowait("s", [{"role": "system", "content": "Be brief."}], user_id="ann")
    calls = [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": "{}"}}]
    second = w.append_nowait("s", [
        {"role": "assistant", "content": "", "tool_calls": calls, "timestamp": 1000.0},
        {"role": "tool", "tool_call_id": "c1", "content": "a.txt", "timestamp": 999.0}],
        user_id="ann")
    assert first.first_id is not None and second.first_id == first.first_id + 1
    await mem.flush()
    rows = await mem.get_messages("s")
    assert [(r["id"], r["role"]) for r in rows] == [
        (first.first_id, "system"), (second.first_id, "assistant"),
        (second.first_id + 1, "tool")]
    assert [r["timestamp"] for r in rows[1:]] == [1000.0, 999.0]  # as given, order by id
    s = session(mem, "s")
    assert (s["message_count"], s["tool_call_count"], s["user_id"]) == (3, 1, "ann")
    with pytest.raises(InvalidTurnError, match="at least one message"):
        w.append_nowait("s", [])


async def test_replace_gives_way_to_the_new_messages_index_and_counts(
        mem: MemoryPipeline) -> None:
    mem.sync_turn("old words about zebras", "old reply", session_id="s", user_id="ann")
    await mem.flush()
    receipt = mem.sessions.replace_messages_nowait("s", [
        {"role": "user", "content": [{"type": "text", "text": "new words about okapis"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "d", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
    ], user_id="ann")
    await mem.flush()
    rows = await mem.get_messages("s")
    assert [r["id"] for r in rows] == [receipt.first_id, (receipt.first_id or 0) + 1]
    assert rows[0]["message"]["content"][0]["text"] == "new words about okapis"
    assert "zebras" not in await mem.search("zebras", user_id="ann")
    assert "okapis" in await mem.search("okapis", user_id="ann")
    s = session(mem, "s")
    assert (s["message_count"], s["tool_call_count"]) == (2, 2)


async def test_replace_active_only_keeps_what_the_host_set_aside(mem: MemoryPipeline) -> None:
    mem.sync_turn("kept aside", "also aside", session_id="s")
    await mem.flush()
    with sqlite3.connect(mem.settings.db_path) as conn:
        conn.execute("UPDATE messages SET active = 0 WHERE session_id = 's'")
    mem.sync_turn("live", "reply", session_id="s")
    await mem.flush()
    mem.sessions.replace_messages_nowait("s", [{"role": "user", "content": "rewritten"}],
                                         active_only=True)
    await mem.flush()
    rows = await mem.get_messages("s")
    assert [(r["content"], r["active"]) for r in rows] == [
        ("kept aside", 0), ("also aside", 0), ("rewritten", 1)]
    assert session(mem, "s")["message_count"] == 1  # its active messages


async def test_update_sets_fills_and_creates(mem: MemoryPipeline) -> None:
    w = mem.sessions
    w.update_nowait("s", user_id="u1", create=True, fields={"source": "telegram"},
                    fill={"chat_id": "c1", "model": None})
    w.update_nowait("s", create=True, fields={"cwd": "/repo"},
                    fill={"source": "cli", "chat_id": "c2", "model": "m1",
                          "model_config": {"t": 1}})
    w.update_nowait("s", fields={"title": "Plans", "git_branch": "main",
                                 "estimated_cost_usd": 2, "archived": 1})
    w.update_nowait("nobody", fields={"title": "never made"})  # no row: left alone
    await mem.flush()
    s = session(mem, "s")
    assert (s["source"], s["user_id"], s["chat_id"], s["model"], s["cwd"], s["title"],
            s["git_branch"], s["estimated_cost_usd"], s["archived"]) == (
        "telegram", "u1", "c1", "m1", "/repo", "Plans", "main", 2.0, 1)
    assert s["model_config"] == '{"t":1}'
    assert row(mem.settings.db_path, "SELECT 1 FROM sessions WHERE id = 'nobody'") is None
    for bad, why in (({"nope": 1}, "not a session field"), ({"title": 3}, "must be a string"),
                     ({"title": "a\x00b"}, "NUL"), ({"parent_session_id": "s"}, "differ")):
        with pytest.raises(InvalidSessionError, match=why):
            w.update_nowait("s", fields=bad)


async def test_usage_is_accounted_per_model_and_route(mem: MemoryPipeline) -> None:
    w = mem.sessions
    w.update_nowait("s", create=True, fields={"model": "primary"})
    # The first call that accounts usage on another route replaces the requested one.
    w.record_usage_nowait("s", input_tokens=100, output_tokens=10, model="fallback",
                          billing_provider="zai", api_call_count=1, estimated_cost_usd=0.5)
    # After that the route only fills; each call's share goes under its own route.
    w.record_usage_nowait("s", input_tokens=50, model="other", billing_provider="b",
                          billing_base_url="https://b/v1", api_call_count=2)
    # No route given: the session's (whose empty base URL the call before filled).
    w.record_usage_nowait("s", input_tokens=5)
    await mem.flush()
    s = session(mem, "s")
    assert (s["model"], s["billing_provider"], s["billing_base_url"], s["input_tokens"],
            s["output_tokens"], s["api_call_count"], s["estimated_cost_usd"]) == (
        "fallback", "zai", "https://b/v1", 155, 10, 3, 0.5)
    assert usage_rows(mem, "s") == [
        ("fallback", "zai", "", "", "", 1, 100, 10, 0.5),
        ("fallback", "zai", "https://b/v1", "", "", 0, 5, 0, 0.0),
        ("other", "b", "https://b/v1", "", "", 2, 50, 0, 0.0)]
    # Absolute totals set the row and add no per-model share.
    w.record_usage_nowait("s", input_tokens=1000, output_tokens=100, api_call_count=9,
                          absolute=True)
    await mem.flush()
    s = session(mem, "s")
    assert (s["input_tokens"], s["output_tokens"], s["api_call_count"]) == (1000, 100, 9)
    assert len(usage_rows(mem, "s")) == 3
    with pytest.raises(InvalidSessionError, match="integer >= 0"):
        w.record_usage_nowait("s", input_tokens=-1)


async def test_first_wins_end_and_reopen(mem: MemoryPipeline) -> None:
    w = mem.sessions
    w.update_nowait("s", create=True)
    first = w.end_nowait("s", "compression", first_wins=True)
    w.end_nowait("s", "resumed_other", first_wins=True)
    w.end_nowait("ghost", "x", first_wins=True)  # no row: none is made
    await mem.flush()
    s = session(mem, "s")
    assert (s["end_reason"], s["ended_at"]) == ("compression", first.accepted_at)
    assert row(mem.settings.db_path, "SELECT 1 FROM sessions WHERE id = 'ghost'") is None
    w.reopen_nowait("s")
    w.end_nowait("s", "user_exit", first_wins=True)
    await mem.flush()
    assert session(mem, "s")["end_reason"] == "user_exit"


async def test_a_deleted_or_pruned_parents_children_are_detached(mem: MemoryPipeline) -> None:
    w = mem.sessions
    for sid, parent in (("a", None), ("b", "a"), ("c", "b"), ("d", "c")):
        w.update_nowait(sid, create=True, fields={"parent_session_id": parent})
        w.end_nowait(sid, "compression")
    await mem.flush()
    with sqlite3.connect(mem.settings.db_path) as conn:  # a and b started long ago
        conn.execute("UPDATE sessions SET started_at = started_at - 200 * ? "
                     "WHERE id IN ('a', 'b')", (DAY_S,))
    result = await w.prune(90, by="started")
    assert sorted(result.deleted) == ["a", "b"]
    assert session(mem, "c")["parent_session_id"] is None
    assert session(mem, "d")["parent_session_id"] == "c"
    await w.delete("c")
    await mem.flush()
    assert session(mem, "d")["parent_session_id"] is None


def tool_hits(mem: MemoryPipeline, word: str) -> list[int]:
    with sqlite3.connect(mem.settings.db_path) as conn:
        return [r[0] for r in conn.execute(
            "SELECT rowid FROM messages_tools WHERE messages_tools MATCH ? ORDER BY rowid",
            (word,))]


def index_intact(mem: MemoryPipeline, table: str) -> None:
    with sqlite3.connect(mem.settings.db_path) as conn:  # raises when the index is corrupt
        conn.execute(f"INSERT INTO {table} ({table}, rank) VALUES ('integrity-check', 0)")


async def test_tool_names_and_calls_are_indexed_beside_the_text(mem: MemoryPipeline) -> None:
    w = mem.sessions
    calls = [{"id": "c1", "type": "function",
              "function": {"name": "web_search", "arguments": '{"q": "okapis"}'}}]
    first = w.append_nowait("s", [
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "tool_name": "web_search", "content": "zoo"},
        {"role": "user", "content": "no tools here"}], user_id="ann").first_id
    assert first is not None
    await mem.flush()
    assert tool_hits(mem, "okapis") == [first]
    assert tool_hits(mem, "web_search") == [first, first + 1]
    assert tool_hits(mem, "tools") == []  # the text is the word index's, not this one's
    assert "okapis" not in await mem.search("okapis", user_id="ann")  # recall: text only
    # The session search finds a message by its text or its tool text, each once.
    hits = await w.search("web_search", user_id="ann")
    assert sorted(h.message_id for h in hits) == [first, first + 1]
    assert [h.message_id for h in await w.search("okapis", user_id="ann")] == [first]
    assert [h.message_id for h in await w.search("tools", user_id="ann")] == [first + 2]
    assert [h.message_id for h in await w.search("web_search", user_id="ann", order="newest",
                                         limit=1, offset=1)] == [first]
    assert await w.search("okapis", user_id="bob") == []  # scoped, as the text is
    # A replacement and a delete take their messages' entries along.
    replaced = w.replace_messages_nowait("s", [
        {"role": "tool", "tool_name": "calendar", "content": "busy"}], user_id="ann").first_id
    await mem.flush()
    assert tool_hits(mem, "web_search") == [] and tool_hits(mem, "calendar") == [replaced]
    index_intact(mem, "messages_tools")
    await w.delete("s")
    await mem.flush()
    assert tool_hits(mem, "calendar") == []
    index_intact(mem, "messages_tools")


async def test_compaction_sets_the_live_messages_aside(mem: MemoryPipeline) -> None:
    w = mem.sessions
    w.append_nowait("s", [{"role": "user", "content": "long ago"},
                          {"role": "assistant", "content": "indeed"}])
    w.replace_messages_nowait("s", [{"role": "user", "content": "summary"}], compact=True)
    await mem.flush()
    rows = await mem.get_messages("s")
    assert [(r["content"], r["active"]) for r in rows] == [
        ("long ago", 0), ("indeed", 0), ("summary", 1)]
    assert row(mem.settings.db_path, "SELECT count(*) AS n FROM messages WHERE compacted = 1"
               ) == {"n": 2}
    assert session(mem, "s")["message_count"] == 1  # the live ones


async def test_meta_is_set_replaced_and_removed_in_order(mem: MemoryPipeline) -> None:
    w = mem.sessions
    w.set_meta_nowait("last_auto_prune", "1")
    w.set_meta_nowait("last_auto_prune", "2")
    w.set_meta_nowait("other", "x")
    w.set_meta_nowait("other", None)
    await mem.flush()
    assert await mem.store.meta_value("last_auto_prune") == "2"
    assert await mem.store.meta_value("other") is None
    for key, value, why in (("", "v", "non-empty"), ("k", 3, "must be a string"),
                            ("k", "a\x00b", "NUL"), ("k", "\ud835", "surrogate")):
        with pytest.raises(InvalidSessionError, match=why):
            w.set_meta_nowait(key, value)  # type: ignore[arg-type]


async def test_compression_lock_is_one_holders_lease(mem: MemoryPipeline) -> None:
    w = mem.sessions
    assert await w.compression_lock("s", "a", ttl_s=10, now=1000.0)
    assert await w.compression_lock("s", "a", ttl_s=10, now=1001.0)  # still a's
    assert not await w.compression_lock("s", "b", ttl_s=10, now=1005.0)
    assert await w.compression_lock("s", "a", "refresh", ttl_s=10, now=1005.0)
    assert await mem.store.compression_lock("s") == ("a", 1015.0)
    assert not await w.compression_lock("s", "b", "refresh", ttl_s=10, now=1006.0)
    assert not await w.compression_lock("s", "a", "refresh", ttl_s=10, now=1016.0)  # ended
    assert await w.compression_lock("s", "b", ttl_s=10, now=1016.0)  # an ended lease goes
    assert await w.compression_lock("s", "a", "release", now=1017.0)  # not a's: nothing
    assert await mem.store.compression_lock("s") == ("b", 1026.0)
    assert await w.compression_lock("s", "b", "release", now=1017.0)
    assert await mem.store.compression_lock("s") is None
    with pytest.raises(InvalidSessionError, match="mode"):
        w.compression_lock_nowait("s", "a", "steal")


async def test_a_filtered_prune_picks_by_the_filters_and_keeps_what_changed(
        mem: MemoryPipeline) -> None:
    from hermes_async_memory.store import SessionFilter
    w = mem.sessions
    for sid, title, model in (("a", "Smoke test", "gpt-5"), ("b", "smoke 2", "sonnet"),
                              ("c", "real work", "gpt-5"), ("d", "smoke, open", "gpt-5")):
        w.update_nowait(sid, create=True, fields={"title": title, "model": model})
        if sid != "d":
            w.end_nowait(sid, "done")
    await mem.flush()
    result = await w.prune(None, where=SessionFilter(title_like="SMOKE", model_like="gpt"))
    assert (result.cutoff, result.candidates, result.deleted) == (None, ("a",), ("a",))
    # Picked, then changed before its delete commits: it stays.
    picked = await mem.store.prunable_sessions(None, None, where=SessionFilter(
        title_like="smoke"))
    assert [sid for sid, _ in picked] == ["b"]
    w.update_nowait("b", fields={"archived": 1})
    w._accept("b", None, "delete", unchanged_before=0.0)  # picked before its last change
    await mem.flush()
    assert session(mem, "b")["archived"] == 1
    assert (await w.prune(None, where=SessionFilter(archived=False))).deleted == ("c",)
    assert session(mem, "d")["ended_at"] is None  # never an open session
    with pytest.raises(TypeError, match="unknown session filter"):
        SessionFilter.of(bogus=1)
    with pytest.raises(TypeError, match="mistyped"):
        SessionFilter.of(min_messages="3")


async def test_a_messages_fields_are_set_where_it_is_still_the_one(mem: MemoryPipeline) -> None:
    w = mem.sessions
    first = w.append_nowait("s", [{"role": "user", "content": "hi", "finish_reason": "x"},
                                  {"role": "user", "content": "again"}]).first_id
    assert first is not None
    w.set_message_fields_nowait("s", first + 1, {"api_content": "hi + recalled"},
                                only_if_latest="user")
    w.set_message_fields_nowait("s", first, {"api_content": "stale"},
                                only_if_latest="user")  # no longer the newest: nothing
    w.set_message_fields_nowait("s", first, {"finish_reason": None, "effect": [1, "é"]})
    w.set_message_fields_nowait("other", first, {"api_content": "not its session"})
    await mem.flush()
    rows = {r["id"]: r["message"] for r in await mem.get_messages("s")}
    assert rows[first + 1] == {"role": "user", "content": "again",
                               "api_content": "hi + recalled"}
    assert rows[first] == {"role": "user", "content": "hi", "effect": [1, "é"]}
    assert row(mem.settings.db_path, "SELECT api_content FROM messages WHERE id = ?",
               first + 1) == {"api_content": "hi + recalled"}  # the generated column follows
    for values, why in (({"content": "x"}, "cannot be set"), ({"a b": 1}, "cannot be set"),
                        ({"x": "\ud835"}, "storable"), ({}, "non-empty")):
        with pytest.raises(InvalidSessionError, match=why):
            w.set_message_fields_nowait("s", first, values)


async def test_an_update_fills_the_sessions_user_and_never_replaces_it(
        mem: MemoryPipeline) -> None:
    w = mem.sessions
    w.update_nowait("s", create=True)
    w.update_nowait("s", user_id="ann", fields={"chat_id": "c1"})
    w.update_nowait("s", user_id="bob", fields={"chat_id": "c2"})
    await mem.flush()
    assert (session(mem, "s")["user_id"], session(mem, "s")["chat_id"]) == ("ann", "c2")


async def test_messages_are_set_aside_from_an_id_and_taken_back(mem: MemoryPipeline) -> None:
    w = mem.sessions
    first = w.append_nowait("s", [{"role": "user", "content": f"m{i}"} for i in range(4)]
                            ).first_id
    assert first is not None
    w.set_active_nowait("s", first + 2, False, rewind=True)
    w.set_active_nowait("s", first + 2, False, rewind=True)  # again: only counted
    await mem.flush()
    rows = await mem.get_messages("s")
    assert [r["active"] for r in rows] == [1, 1, 0, 0]
    assert session(mem, "s")["rewind_count"] == 2
    assert [h.message_id for h in await w.search("m3", session_id="s")] == [first + 3]
    w.set_active_nowait("s", first + 3, True)
    await mem.flush()
    assert [r["active"] for r in await mem.get_messages("s")] == [1, 1, 0, 1]
    with pytest.raises(InvalidSessionError, match="integer"):
        w.set_active_nowait("s", -1, True)
