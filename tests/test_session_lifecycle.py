"""Session lifecycle through the durable path: describe, end, delete and prune are records in
the session's lane, so they commit after the session's earlier turns and before its later
ones; a pending turn never brings a deleted session back, and prune spares open sessions and
sessions with pending turns."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.sessions.lifecycle import InvalidSessionError, SessionWrites
from hermes_async_memory.sessions.transfer import (
    ImportResult,
    InvalidImportError,
    export_sessions,
    import_sessions,
)


def rows(db: Path, sql: str, *params: object) -> list[tuple[object, ...]]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql, params).fetchall()


def session_row(db: Path, sid: str) -> dict[str, object] | None:
    with sqlite3.connect(db) as conn:
        conn.row_factory = sqlite3.Row
        row = conn.execute("SELECT * FROM sessions WHERE id = ?", (sid,)).fetchone()
    return None if row is None else dict(row)


def fts_hits(db: Path, word: str) -> int:
    return int(rows(db, "SELECT count(*) FROM messages_fts WHERE messages_fts MATCH ?",
                    f'content:"{word}"')[0][0])


async def test_describe_and_end_fill_the_session_row(mem: MemoryPipeline) -> None:
    db = mem.settings.db_path
    writes = SessionWrites(mem)
    mem.sync_turn("hello", "hi", session_id="s1", user_id="ann")
    writes.describe_nowait("s1", user_id="ann", source="telegram", model="m-large",
                           model_config={"temperature": 0.2, "tools": ["a", "b"]},
                           system_prompt="You are terse.", parent_session_id="s0")
    await mem.flush()
    row = session_row(db, "s1")
    assert row is not None
    assert (row["source"], row["user_id"], row["model"], row["parent_session_id"],
            row["system_prompt"]) == ("telegram", "ann", "m-large", "s0", "You are terse.")
    assert row["model_config"] == '{"temperature":0.2,"tools":["a","b"]}'
    assert row["message_count"] == 2 and row["ended_at"] is None
    # A later describe changes only what it carries.
    writes.describe_nowait("s1", system_prompt="You are verbose.")
    receipt = writes.end_nowait("s1", "user_exit")
    await mem.flush()
    row = session_row(db, "s1")
    assert row is not None
    assert (row["model"], row["system_prompt"], row["end_reason"]) == (
        "m-large", "You are verbose.", "user_exit")
    assert row["ended_at"] == pytest.approx(receipt.accepted_at)
    # Ending a session that never stored a turn puts its end on record.
    writes.end_nowait("empty", "timeout", user_id="bob")
    await mem.flush()
    row = session_row(db, "empty")
    assert row is not None and (row["end_reason"], row["user_id"], row["message_count"]) == (
        "timeout", "bob", 0)


async def test_lifecycle_events_share_a_batch_unless_their_session_comes_again(
        tmp_path: Path) -> None:
    """A gateway starting many sessions at once: each one's describe commits with the other
    sessions' turns (one transaction, not one per event); an event whose session has a
    later record in the batch still ends it, so the later one wins."""
    settings = Settings(db_path=tmp_path / "m.db", max_wait_ms=50)
    async with MemoryPipeline(settings) as mem:
        writes = SessionWrites(mem)
        for i in range(40):
            writes.describe_nowait(f"s{i}", model="m-start")
            mem.sync_turn(f"hello {i}", "hi", session_id=f"other{i}")
        mem.sync_turn("first", "ok", session_id="x", metadata={"model": "m-turn"})
        writes.describe_nowait("x", model="m-described")
        mem.sync_turn("second", "ok", session_id="x", metadata={"model": "m-later"})
        await mem.flush()
        batches = mem.stats().batches_committed
    assert batches <= 3  # was 42: one per event, and the rest
    assert [session_row(settings.db_path, f"s{i}")["model"] for i in range(40)] == [
        "m-start"] * 40
    x = session_row(settings.db_path, "x")
    assert x is not None and x["model"] == "m-later" and x["message_count"] == 4


async def test_delete_takes_the_pending_turns_before_it_and_not_those_after(
        mem: MemoryPipeline) -> None:
    db = mem.settings.db_path
    writes = SessionWrites(mem)
    mem.sync_turn("committed zebra", "ok", session_id="s1", user_id="ann")
    await mem.flush()
    await mem.search("zebra", user_id="ann")  # a recall block cached in the store
    mem.queue_prefetch("zebra", session_id="s1", user_id="ann")
    # Accepted back to back, so they commit in the same writer round: the delete must run
    # after the first turn's messages and before the second's.
    mem.sync_turn("pending walrus", "ok", session_id="s1", user_id="ann")
    writes.delete_nowait("s1", user_id="ann")
    mem.sync_turn("after narwhal", "ok", session_id="s1", user_id="ann")
    await mem.flush()
    texts = [m["content"] for m in await mem.get_messages("s1")]
    assert texts == ["after narwhal", "ok"]  # the session started anew after the delete
    assert fts_hits(db, "zebra") == 0 and fts_hits(db, "walrus") == 0
    assert fts_hits(db, "narwhal") == 1
    row = session_row(db, "s1")
    assert row is not None and row["message_count"] == 2
    assert rows(db, "SELECT count(*) FROM recall_results WHERE session_id = 's1' "
                    "AND block LIKE '%zebra%'") == [(0,)]
    assert "zebra" not in mem.prefetch("", session_id="s1", user_id="ann")
    assert "walrus" not in await mem.search("walrus zebra", user_id="ann")


async def test_a_deleted_session_stays_deleted_across_a_restart(settings: Settings) -> None:
    async with MemoryPipeline(settings) as mem:
        mem.sync_turn("one", "two", session_id="gone", user_id="ann")
        mem.sync_turn("keep me", "yes", session_id="kept", user_id="ann")
        SessionWrites(mem).delete_nowait("gone")
        await mem.flush()
    async with MemoryPipeline(settings) as mem:
        await mem.flush()
        assert await mem.get_messages("gone") == []
        assert [m["content"] for m in await mem.get_messages("kept")] == ["keep me", "yes"]
    assert session_row(settings.db_path, "gone") is None


async def test_prune_removes_only_ended_sessions_idle_past_the_cutoff(
        mem: MemoryPipeline) -> None:
    db = mem.settings.db_path
    writes = SessionWrites(mem)
    for sid, source in (("old-a", "cli"), ("old-b", "cli"), ("busy", "cli"), ("tg", "telegram"),
                        ("open", "cli")):
        mem.sync_turn(f"text of {sid}", "reply", session_id=sid, user_id="ann",
                      metadata={"source": source})
    for sid in ("old-a", "old-b", "busy", "tg"):
        writes.end_nowait(sid, "done")
    await mem.flush()
    # A turn of an ended session, accepted before the prune and not committed yet.
    mem.sync_turn("late words", "reply", session_id="busy", user_id="ann")
    result = await writes.prune(0, source="cli")
    assert set(result.candidates) >= {"old-a", "old-b"}
    assert "open" not in result.candidates and "tg" not in result.candidates
    assert sorted(result.deleted) == ["old-a", "old-b"]
    left = {r[0] for r in rows(db, "SELECT id FROM sessions")}
    assert left == {"busy", "tg", "open"}
    assert rows(db, "SELECT count(*) FROM messages WHERE session_id IN ('old-a', 'old-b')") == [
        (0,)]
    assert fts_hits(db, "late") == 1
    # Without a source, the telegram session goes too; the busy one is recent now.
    result = await writes.prune(1)
    assert result.deleted == ()
    result = await writes.prune(0)
    assert set(result.deleted) == {"tg", "busy"}
    assert {r[0] for r in rows(db, "SELECT id FROM sessions")} == {"open"}


@pytest.mark.parametrize(("call", "message"), [
    (lambda w: w.end_nowait("s", ""), "reason"),
    (lambda w: w.end_nowait("s", 5), "reason"),
    (lambda w: w.end_nowait("", "x"), "session_id"),
    (lambda w: w.end_nowait("s\x00", "x"), "NUL"),
    (lambda w: w.describe_nowait("s"), "at least one field"),
    (lambda w: w.describe_nowait("s", model_config=[1]), "model_config"),
    (lambda w: w.describe_nowait("s", model_config={"x": float("nan")}), "model_config"),
    (lambda w: w.describe_nowait("s", model_config={"x": object()}), "model_config"),
    (lambda w: w.describe_nowait("s", system_prompt=b"x"), "system_prompt"),
    (lambda w: w.describe_nowait("s", parent_session_id="s"), "parent_session_id"),
    (lambda w: w.describe_nowait("s", source=""), "source"),
    (lambda w: w.delete_nowait(None), "session_id"),
])
async def test_bad_lifecycle_input_is_refused_before_it_is_accepted(
        mem: MemoryPipeline, call: object, message: str) -> None:
    before = mem.stats().accepted_turns if hasattr(mem.stats(), "accepted_turns") else None
    with pytest.raises(InvalidSessionError, match=message):
        call(SessionWrites(mem))  # type: ignore[operator]
    if before is not None:
        assert mem.stats().accepted_turns == before


async def test_prune_refuses_a_bad_age(mem: MemoryPipeline) -> None:
    for bad in (-1, float("nan"), "3", True):
        with pytest.raises(InvalidSessionError, match="older_than_days"):
            await SessionWrites(mem).prune(bad)  # type: ignore[arg-type]


# -- export and import -----------------------------------------------------------------------

TOOL_TURN = [
    {"role": "user", "content": "What time is it in Lisbon? ' quoted"},
    {"role": "assistant", "content": "", "usage": {"prompt_tokens": 40, "completion_tokens": 12},
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "clock", "arguments": "{\"city\": \"Lisbon\"}"}}]},
    {"role": "tool", "tool_call_id": "c1", "name": "clock", "content": "14:05"},
    {"role": "assistant", "content": "It is 14:05 in Lisbon. ünïcödé", "token_count": 9},
]
TOOL_TURN_TOKENS = [None, 12, None, 9]  # what each message reported, in order


async def exported(mem: MemoryPipeline, **kw: str) -> list[str]:
    return [line async for line in export_sessions(mem, **kw)]


async def filled_sessions(mem: MemoryPipeline) -> None:
    writes = SessionWrites(mem)
    for i in range(3):
        mem.sync_turn(f"question {i} about trams", f"answer {i}", session_id="a1",
                      user_id="ann", metadata={"model": "m-1", "input_tokens": 10 + i})
    mem.sync_turn("", "", session_id="a2", user_id="ann", messages=TOOL_TURN,
                  metadata={"source": "telegram", "parent_session_id": "a1"})
    mem.sync_turn("bob's words", "ok", session_id="b1", user_id="bob")
    writes.describe_nowait("a1", model_config={"temperature": 0.5}, system_prompt="Be brief.")
    writes.end_nowait("a1", "compression")
    await mem.flush()


# Hermes Agent's session columns (schema 8), each set to a value other than its default.
HERMES_FIELDS = {
    "session_key": "agent:main:telegram:dm:42", "chat_id": "42", "chat_type": "dm",
    "thread_id": "t-7", "display_name": "Ann", "origin_json": '{"platform": "telegram"}',
    "expiry_finalized": 1, "cache_read_tokens": 120, "cache_write_tokens": 30,
    "reasoning_tokens": 15, "cwd": "/home/ann/project", "git_branch": "feature/ünïcode",
    "git_repo_root": "/home/ann/project", "billing_provider": "openrouter",
    "billing_base_url": "https://openrouter.ai/api/v1", "billing_mode": "metered",
    "estimated_cost_usd": 0.0123, "actual_cost_usd": 0.0125, "cost_status": "final",
    "cost_source": "provider", "pricing_version": "2026-11", "title": "Trams of Lisbon",
    "api_call_count": 3, "handoff_state": "idle", "handoff_platform": "cli",
    "handoff_error": "none", "compression_failure_cooldown_until": 1_800_000_000.5,
    "compression_failure_error": "too long", "compression_fallback_streak": 2,
    "profile_name": "work", "rewind_count": 1, "archived": 1,
}


async def test_export_delete_import_gives_back_the_same_bytes(mem: MemoryPipeline) -> None:
    await filled_sessions(mem)
    # What Hermes Agent's session store keeps beside ours comes back too.
    with sqlite3.connect(mem.settings.db_path) as conn:
        conn.execute(f"UPDATE sessions SET {', '.join(f'{k} = ?' for k in HERMES_FIELDS)} "
                     "WHERE id = 'a2'", list(HERMES_FIELDS.values()))
    before = await exported(mem)
    a2 = json.loads(before[1])
    assert {k: a2[k] for k in HERMES_FIELDS} == HERMES_FIELDS
    assert [json.loads(line)["id"] for line in before] == ["a1", "a2", "b1"]
    tokens = [m["token_count"] for m in await mem.sessions.messages("a2")]
    assert tokens == TOOL_TURN_TOKENS
    writes = SessionWrites(mem)
    for sid in ("a1", "a2", "b1"):
        writes.delete_nowait(sid)
    await mem.flush()
    assert await exported(mem) == []
    assert (await mem.search("trams", user_id="ann")) == ""
    result = await import_sessions(mem, before)
    assert result == ImportResult(imported=3, skipped=0, messages=12)
    assert await exported(mem) == before  # byte for byte: ids, rows, messages
    row = session_row(mem.settings.db_path, "a2")
    assert row is not None and {k: row[k] for k in HERMES_FIELDS} == HERMES_FIELDS
    assert [m["token_count"] for m in await mem.sessions.messages("a2")] == TOOL_TURN_TOKENS
    # Imported messages are searchable again, in their user's scope only.
    assert "question 1 about trams" in await mem.search("trams", user_id="ann")
    assert await mem.search("trams", user_id="bob") == ""
    # A second import of the same lines changes nothing.
    again = await import_sessions(mem, before)
    assert again == ImportResult(imported=0, skipped=3, messages=0)
    assert await exported(mem) == before
    db = mem.settings.db_path
    assert fts_hits(db, "trams") == 3  # indexed once


async def test_import_into_a_store_whose_ids_are_taken_keeps_every_message(
        tmp_path: Path) -> None:
    async with MemoryPipeline(Settings(db_path=tmp_path / "a.db")) as mem:
        await filled_sessions(mem)
        lines = await exported(mem)
    async with MemoryPipeline(Settings(db_path=tmp_path / "b.db")) as other:
        for i in range(6):  # takes message ids 1..12
            other.sync_turn(f"other {i}", "x", session_id="z9", user_id="zed")
        await other.flush()
        result = await import_sessions(other, lines)
        assert result.imported == 3
        got = {json.loads(line)["id"]: json.loads(line) for line in await exported(other)}
        want = {json.loads(line)["id"]: json.loads(line) for line in lines}
        for sid, session in want.items():
            mine = got[sid]
            strip = [{k: v for k, v in m.items() if k != "id"} for m in session["messages"]]
            assert [{k: v for k, v in m.items() if k != "id"}
                    for m in mine["messages"]] == strip  # same messages, in order
            assert {k: v for k, v in mine.items() if k != "messages"} == {
                k: v for k, v in session.items() if k != "messages"}
        assert [m["content"] for m in got["z9"]["messages"]][:2] == ["other 0", "x"]
        assert fts_hits(other.settings.db_path, "trams") == 3


@pytest.mark.parametrize(("line", "message"), [
    ("not json", "line 1: not JSON"),
    ("[1]", "not a JSON object"),
    ('{"id": "", "started_at": 1, "messages": []}', "id must be"),
    ('{"id": "s", "started_at": "x", "messages": []}', "started_at"),
    ('{"id": "s", "started_at": 1, "messages": {}}', "messages must be a list"),
    ('{"id": "s", "started_at": 1, "messages": [{"id": 0, "turn_key": "k", "role": "user",'
     ' "timestamp": 1}]}', "id must be a positive integer"),
    ('{"id": "s", "started_at": 1, "messages": [{"id": 1, "turn_key": "k", "role": "user",'
     ' "timestamp": 1, "content": 5}]}', "content must be"),
    ('{"id": "s", "started_at": 1, "messages": [{"id": 1, "turn_key": "k", "role": "user",'
     ' "timestamp": 1, "token_count": -1}]}', "token_count must be null or an integer"),
    ('{"id": "s", "started_at": 1, "messages": [{"id": 1, "turn_key": "k", "role": "user",'
     ' "timestamp": 1}, {"id": 1, "turn_key": "k", "role": "assistant", "timestamp": 2}]}',
     "two messages have one id"),
])
async def test_a_bad_import_line_is_refused_with_its_line_number(
        mem: MemoryPipeline, line: str, message: str) -> None:
    with pytest.raises(InvalidImportError, match=message):
        await import_sessions(mem, [line])
    assert await exported(mem) == []


async def test_a_delete_committed_beside_a_turn_holding_nul_still_lands(
        mem: MemoryPipeline) -> None:
    """A batch holding text with U+0000 binds its rows one statement at a time; a lifecycle
    event in that batch holds several statements, and must still apply, and the turn commit,
    in that one transaction."""
    mem.sync_turn("first", "ok", session_id="gone", user_id="ann")
    await mem.flush()
    # On the loop thread with no await between: the writer takes both in one batch.
    mem.sync_turn("a\x00b", "kept", session_id="nul", user_id="ann")
    SessionWrites(mem).delete_nowait("gone")
    await mem.flush()
    assert mem.stats().dead_letters == 0
    assert await mem.sessions.get_session("gone") is None
    assert [m["message"]["content"] for m in await mem.sessions.messages("nul")] == [
        "a\x00b", "kept"]
