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
