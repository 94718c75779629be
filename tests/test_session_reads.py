"""Session store reads: listings newest first with paging and filters, one session with
every column, the conversation in OpenAI chat format with tool results after their calls,
the parent chain both ways, counts, and the same reads from another thread."""

from __future__ import annotations

import asyncio
import itertools
import json
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.errors import PipelineClosedError
from hermes_async_memory.sessions import (
    InvalidSearchError,
    SessionChain,
    SessionCounts,
    SessionInfo,
    SessionReads,
)
from hermes_async_memory.store import sessions as store_sessions


def _call(call_id: str, name: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}


@pytest.fixture
async def mem(tmp_path: Path) -> AsyncIterator[MemoryPipeline]:
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db", source="cli")) as pipeline:
        yield pipeline


async def _sessions(mem: MemoryPipeline, specs: list[tuple[str, str | None, dict[str, Any]]]
                    ) -> None:
    """One turn per session, each committed before the next is accepted: their start times
    are in this order."""
    for session, user, metadata in specs:
        mem.sync_turn(f"hello from {session}", f"reply in {session}", session_id=session,
                      user_id=user, metadata=metadata)
        await mem.flush()


async def test_list_is_newest_first_with_paging_and_filters(mem: MemoryPipeline) -> None:
    await _sessions(mem, [
        ("s1", "ann", {}), ("s2", "bob", {"source": "telegram"}), ("s3", "ann", {}),
        ("s4", "ann", {"source": "telegram"}), ("s5", None, {}),
    ])
    reads = SessionReads(mem)
    listed = await reads.list_sessions()
    assert [s.id for s in listed] == ["s5", "s4", "s3", "s2", "s1"]
    assert all(a.started_at > b.started_at for a, b in itertools.pairwise(listed))
    pages = [await reads.list_sessions(limit=2, offset=o) for o in (0, 2, 4, 6)]
    assert [[s.id for s in p] for p in pages] == [["s5", "s4"], ["s3", "s2"], ["s1"], []]
    assert [s.id for s in await reads.list_sessions(source="telegram")] == ["s4", "s2"]
    assert [s.id for s in await reads.list_sessions(source="cli", user_id="ann")] == [
        "s3", "s1"]
    assert [s.id for s in await reads.list_sessions(user_id="ann", limit=1, offset=1)] == [
        "s3"]
    assert await reads.list_sessions(source="discord") == []
    with pytest.raises(InvalidSearchError, match="limit must be an integer from 1 to 1000"):
        await reads.list_sessions(limit=0)
    with pytest.raises(InvalidSearchError, match="offset must be an integer"):
        await reads.list_sessions(offset=-1)


async def test_get_session_has_every_column_decoded(mem: MemoryPipeline) -> None:
    mem.sync_turn("q", "a", session_id="s", user_id="ann", messages=[
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "",
         "tool_calls": [_call("c1", "search"), _call("c2", "search")]},
        {"role": "tool", "tool_call_id": "c1", "content": "found"},
        {"role": "tool", "tool_call_id": "c2", "content": "found too"},
        {"role": "assistant", "content": "a"},
    ], metadata={"source": "telegram", "model": "m1", "parent_session_id": "root",
                 "input_tokens": 12, "output_tokens": 5})
    await mem.flush()
    reads = SessionReads(mem)
    info = await reads.get_session("s")
    assert info is not None
    assert (info.id, info.source, info.user_id, info.model, info.parent_session_id) == (
        "s", "telegram", "ann", "m1", "root")
    # Calls are counted as Hermes counts them: the entries of the assistants' tool_calls.
    assert (info.message_count, info.tool_call_count) == (5, 2)
    assert (info.input_tokens, info.output_tokens) == (12, 5)
    assert info.started_at <= info.updated_at
    assert (info.ended, info.end_reason, info.model_config, info.system_prompt,
            info.tokens_estimated) == (False, None, None, None, False)
    # The columns the session store's writes fill (set here as a host's write would leave
    # them): decoded, and the same in as_dict, which is JSON as it is.
    with sqlite3.connect(mem.settings.db_path) as db:
        db.execute("UPDATE sessions SET model_config = ?, system_prompt = 'be brief', "
                   "tokens_estimated = 1, ended_at = updated_at + 1, end_reason = 'user_exit' "
                   "WHERE id = 's'", (json.dumps({"temperature": 0.2, "tools": ["a"]}),))
    db.close()
    info = await reads.get_session("s")
    assert info is not None
    assert info.model_config == {"temperature": 0.2, "tools": ["a"]}
    assert (info.system_prompt, info.tokens_estimated, info.ended, info.end_reason) == (
        "be brief", True, True, "user_exit")
    as_dict = json.loads(json.dumps(info.as_dict()))
    assert as_dict["model_config"] == {"temperature": 0.2, "tools": ["a"]}
    assert as_dict["ended"] is True and as_dict["tokens_estimated"] is True
    assert set(as_dict) >= {
        "id", "source", "user_id", "model", "parent_session_id", "started_at", "updated_at",
        "ended_at", "end_reason", "message_count", "tool_call_count", "input_tokens",
        "output_tokens", "model_config", "system_prompt", "tokens_estimated"}
    assert await reads.get_session("never-stored") is None
    with pytest.raises(InvalidSearchError, match="session_id must be a non-empty string"):
        await reads.get_session("")


async def test_conversation_puts_each_tool_result_after_its_call(mem: MemoryPipeline) -> None:
    # Turn 1: two calls in parallel, the second answered first; a third whose result only
    # arrives with the next turn.
    mem.sync_turn("weather and time?", "", session_id="s", user_id="ann", messages=[
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather and time?"},
        {"role": "assistant", "content": "",
         "tool_calls": [_call("c1", "weather"), _call("c2", "clock")]},
        {"role": "tool", "tool_call_id": "c2", "name": "clock", "content": "12:00"},
        {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "rain"},
        {"role": "assistant", "content": "Rain, noon. Checking the news.",
         "tool_calls": [_call("c3", "news")]},
    ])
    # Turn 2: the late result, a result whose call was never stored, and a call id the
    # model reuses (c1 again): its result belongs to the nearest call before it.
    mem.sync_turn("and the news?", "Quiet day.", session_id="s", user_id="ann", messages=[
        {"role": "user", "content": "and the news?"},
        {"role": "tool", "tool_call_id": "c3", "name": "news", "content": "nothing new"},
        {"role": "tool", "tool_call_id": "lost", "content": "orphan result"},
        {"role": "assistant", "content": "", "tool_calls": [_call("c1", "weather")]},
        {"role": "tool", "tool_call_id": "c1", "content": "sun"},
        {"role": "assistant", "content": "Quiet day."},
    ])
    await mem.flush()
    chat = await SessionReads(mem).conversation("s")
    assert chat == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "weather and time?"},
        {"role": "assistant", "content": "",
         "tool_calls": [_call("c1", "weather"), _call("c2", "clock")]},
        {"role": "tool", "content": "rain", "tool_call_id": "c1", "name": "weather"},
        {"role": "tool", "content": "12:00", "tool_call_id": "c2", "name": "clock"},
        {"role": "assistant", "content": "Rain, noon. Checking the news.",
         "tool_calls": [_call("c3", "news")]},
        {"role": "tool", "content": "nothing new", "tool_call_id": "c3", "name": "news"},
        {"role": "user", "content": "and the news?"},
        {"role": "tool", "content": "orphan result", "tool_call_id": "lost"},
        {"role": "assistant", "content": "", "tool_calls": [_call("c1", "weather")]},
        {"role": "tool", "content": "sun", "tool_call_id": "c1"},
        {"role": "assistant", "content": "Quiet day."},
    ]
    assert await SessionReads(mem).conversation("empty") == []


async def test_chain_walks_up_oldest_first_and_down_breadth_first(mem: MemoryPipeline) -> None:
    await _sessions(mem, [
        ("root", "ann", {}),
        ("child-b", "ann", {"parent_session_id": "root"}),
        ("child-a", "ann", {"parent_session_id": "root"}),
        ("grandchild", "ann", {"parent_session_id": "child-b"}),
        ("great", "ann", {"parent_session_id": "grandchild"}),
        ("unrelated", "ann", {}),
    ])
    reads = SessionReads(mem)

    def ids(infos: tuple[SessionInfo, ...]) -> list[str]:
        return [s.id for s in infos]

    root = await reads.chain("root")
    assert ids(root.ancestors) == []
    # Children first (by start time), then grandchildren.
    assert ids(root.descendants) == ["child-b", "child-a", "grandchild", "great"]
    assert (root.missing_parent, root.truncated) == (None, False)
    mid = await reads.chain("grandchild")
    assert ids(mid.ancestors) == ["root", "child-b"]
    assert ids(mid.descendants) == ["great"]
    leaf = await reads.chain("great")
    assert ids(leaf.ancestors) == ["root", "child-b", "grandchild"]
    assert leaf.descendants == ()
    assert json.loads(json.dumps(leaf.as_dict()))["ancestors"][0]["id"] == "root"
    alone = await reads.chain("unrelated")
    assert alone == SessionChain("unrelated", (), ())


async def test_chain_survives_cycles_and_missing_parents(mem: MemoryPipeline) -> None:
    await _sessions(mem, [
        ("x", "ann", {"parent_session_id": "y"}),
        ("y", "ann", {"parent_session_id": "z"}),
        ("z", "ann", {"parent_session_id": "x"}),
        ("self", "ann", {"parent_session_id": "self"}),
        ("orphan", "ann", {"parent_session_id": "gone"}),
        ("orphan-child", "ann", {"parent_session_id": "orphan"}),
    ])
    reads = SessionReads(mem)
    x = await reads.chain("x")
    # Up: y, then z; z's parent is x itself, where the walk stops. Oldest first.
    assert [s.id for s in x.ancestors] == ["z", "y"]
    assert [s.id for s in x.descendants] == ["z", "y"]
    assert (x.missing_parent, x.truncated) == (None, False)
    me = await reads.chain("self")
    assert (me.ancestors, me.descendants) == ((), ())
    orphan = await reads.chain("orphan-child")
    assert [s.id for s in orphan.ancestors] == ["orphan"]
    assert orphan.missing_parent == "gone"
    # A session never stored itself still has the children that name it.
    gone = await reads.chain("gone")
    assert gone.ancestors == () and [s.id for s in gone.descendants] == [
        "orphan", "orphan-child"]


async def test_chain_bounds_are_reported_as_truncated(
        mem: MemoryPipeline, monkeypatch: pytest.MonkeyPatch) -> None:
    await _sessions(mem, [
        ("g0", "ann", {}), ("g1", "ann", {"parent_session_id": "g0"}),
        ("g2", "ann", {"parent_session_id": "g1"}), ("g3", "ann", {"parent_session_id": "g2"}),
        ("g1-b", "ann", {"parent_session_id": "g0"}),
    ])
    reads = SessionReads(mem)
    monkeypatch.setattr(store_sessions, "MAX_ANCESTORS", 2)
    monkeypatch.setattr(store_sessions, "MAX_DESCENDANTS", 2)
    up = await reads.chain("g3")
    assert [s.id for s in up.ancestors] == ["g1", "g2"] and up.truncated
    down = await reads.chain("g0")
    assert [s.id for s in down.descendants] == ["g1", "g1-b"] and down.truncated
    whole = await reads.chain("g2")  # within both bounds
    assert [s.id for s in whole.ancestors] == ["g0", "g1"] and not whole.truncated


async def test_counts_by_source_user_and_session(mem: MemoryPipeline) -> None:
    await _sessions(mem, [
        ("s1", "ann", {}), ("s2", "ann", {"source": "telegram"}), ("s3", "bob", {}),
    ])
    mem.sync_turn("more", "still more", session_id="s1", user_id="ann")
    mem.sync_turn("anonymous", "turn", session_id="s4")
    await mem.flush()
    reads = SessionReads(mem)
    assert await reads.counts() == SessionCounts(sessions=4, messages=10)
    assert await reads.counts(user_id="ann") == SessionCounts(2, 6)
    assert await reads.counts(source="telegram") == SessionCounts(1, 2)
    assert await reads.counts(source="cli", user_id="ann") == SessionCounts(1, 4)
    assert await reads.counts(session_id="s1") == SessionCounts(1, 4)
    assert await reads.counts(session_id="s1", user_id="bob") == SessionCounts(0, 0)
    assert await reads.counts(source="discord") == SessionCounts(0, 0)
    assert (await reads.counts()).as_dict() == {"sessions": 4, "messages": 10}


async def test_blocking_reads_from_another_thread(mem: MemoryPipeline) -> None:
    await _sessions(mem, [("s1", "ann", {"parent_session_id": "s0"}), ("s2", "ann", {})])
    reads = SessionReads(mem)
    blocking = reads.blocking(timeout_s=10)

    def in_thread() -> tuple[Any, ...]:
        return (blocking.search("hello", user_id="ann"), blocking.list_sessions(limit=1),
                blocking.get_session("s1"), blocking.conversation("s1"),
                blocking.chain("s1"), blocking.counts(user_id="ann"))

    hits, listed, info, chat, chain, counts = await asyncio.to_thread(in_thread)
    assert hits == await reads.search("hello", user_id="ann")
    assert [s.id for s in listed] == ["s2"]
    assert info == await reads.get_session("s1")
    assert chat == [{"role": "user", "content": "hello from s1"},
                    {"role": "assistant", "content": "reply in s1"}]
    assert chain.missing_parent == "s0"
    assert counts == SessionCounts(2, 4)
    # On the loop's own thread a blocking read would wait for itself.
    with pytest.raises(RuntimeError, match="deadlock"):
        blocking.counts()
    # Its errors are the async reads' errors.
    with pytest.raises(InvalidSearchError):
        await asyncio.to_thread(blocking.search, "NOT", user_id="ann", syntax="fts5")


async def test_reads_need_an_open_pipeline(tmp_path: Path) -> None:
    mem = MemoryPipeline(Settings(db_path=tmp_path / "m.db"))
    reads = SessionReads(mem)
    with pytest.raises(PipelineClosedError):
        await reads.list_sessions()
    with pytest.raises(PipelineClosedError):
        reads.blocking().counts()
    async with mem:
        assert await reads.counts() == SessionCounts(0, 0)
    with pytest.raises(PipelineClosedError):
        await reads.conversation("s")
