"""What is handed to ``sync_turn`` is what comes back: every message as given (every key,
structured content, None, integer ids, NUL, lone surrogates), through every read (the rows'
``message``, the conversation, export -> import -> export); what JSON cannot hold as given is
refused before it is acknowledged; and each message's id is known when ``sync_turn`` returns."""

from __future__ import annotations

import json
import sqlite3
from typing import Any

import pytest

from hermes_async_memory import InvalidTurnError, MemoryPipeline, Settings
from hermes_async_memory.sessions.transfer import export_sessions, import_sessions

Message = dict[str, Any]


def call(cid: str, name: str, **args: object) -> Message:
    return {"id": cid, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


# Each shape Hermes hands over, and each value the hunt found changed on the way (issue 25).
SHAPES: dict[str, list[Message]] = {
    "user-led turn": [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call("c1", "weather", city="Oslo")],
         "reasoning": "I should look it up.", "finish_reason": "tool_calls"},
        {"role": "tool", "tool_call_id": "c1", "name": "weather", "tool_name": "weather",
         "content": "4°C, rain"},
        {"role": "assistant", "content": "4°C and rain.", "reasoning": "done",
         "reasoning_content": "short", "finish_reason": "stop"},
    ],
    "assistant-only step with tool calls": [
        {"role": "assistant", "content": "", "tool_calls": [call("c2", "clock")]},
    ],
    "tool results alone": [
        {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
        {"role": "tool", "tool_call_id": "c3", "content": "nothing"},
    ],
    "system and developer messages first": [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use metric units."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
    ],
    "two user messages in a row": [
        {"role": "user", "content": "one"},
        {"role": "user", "content": "two", "name": "ann"},
        {"role": "assistant", "content": "both"},
    ],
    "empty and None content": [
        {"role": "user", "content": ""},
        {"role": "assistant", "content": None},
        {"role": "assistant"},
    ],
    "structured content": [
        {"role": "user", "content": [
            {"type": "text", "text": "what is in this picture?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KG"}},
            {"type": "text", "text": "and this quokka?"}]},
        {"role": "assistant", "content": {"parts": [{"text": "a cat"}]}},
    ],
    "legacy function_call": [
        {"role": "assistant", "content": None,
         "function_call": {"name": "lookup", "arguments": "{}"}},
        {"role": "function", "name": "lookup", "content": "found"},
    ],
    "values a column would not hold": [
        {"role": "tool", "tool_call_id": 7, "name": 8, "content": "int ids"},
        {"role": "assistant", "content": "x", "token_count": "12", "tool_calls": []},
        {"role": "assistant", "content": "y", "tool_calls": None, "tool_call_id": None},
        {"role": "user", "content": "nul\x00inside", "custom": {"nested": [1, 2.5, None]}},
        {"role": "user", "content": "lone \ud800 surrogate", "timestamp": 1_700_000_000.25},
        {"role": "assistant", "content": "floats", "x": 0.1 + 0.2, "big": 2**70},
    ],
    # Tool calls of OpenAI's shape are encoded by orjson, and a record whose text is all
    # ASCII has its rows encoded by it too; anything else by the standard library.
    "tool calls, every kind of character, ASCII only": [
        {"role": "user", "content": "it's \"quoted\" \\ back\nslash\ttab \x01\x1f\x7f"},
        {"role": "assistant", "content": "", "tool_calls": [
            call("c'1", "write", text="it's \\ \" \x00 \x02"),
            {"id": "c2", "type": "function",
             "function": {"name": "grep", "arguments": '{"p": "a\'b\\n"}\n\x1f'}},
            {"id": "c3"}, {"type": "function", "function": {}}]},
        {"role": "tool", "tool_call_id": "c'1", "name": "write", "content": "ok ' \x02"},
        {"role": "assistant", "content": "done"},
    ],
    "tool calls beyond ASCII": [
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c-\u00e9", "type": "function",
             "function": {"name": "gr\u00fc\u00dfe",
                          "arguments": '{"t": "caf\u00e9 \u4e2d\u6587 \U0001F600 \u2028'
                                       ' \ufeff"}'}}]},
        {"role": "tool", "tool_call_id": "c-\u00e9", "name": "gr\u00fc\u00dfe",
         "content": "\u00e9"},
    ],
    # A turn whose rows' text is all ASCII has its rows written in one go; one beyond ASCII
    # anywhere but in the contents and calls, row by row.
    "ASCII text, a role, a call id and a tool name beyond ASCII": [
        {"role": "user", "content": "rename it"},
        {"role": "assistant", "content": "", "tool_calls": [call("c-1", "rename", to="b")]},
        {"role": "tool", "tool_call_id": "c-\u00fc", "name": "gr\u00fc\u00dfe", "content": "ok"},
        {"role": "r\u00f4le", "content": "done"},
    ],
    # The two commonest shapes (a text message, a tool's answer) have their rows made
    # directly (message_rows._plain_row) unless a column would not hold a value: then as any other.
    "common shapes, with values a column would not hold": [
        {"role": "user", "content": "two\x00keys"},
        {"role": "assistant", "content": "two \udc80 keys"},
        {"role": "tool", "tool_call_id": "c\x001", "name": "read", "content": "ok"},
        {"role": "tool", "tool_call_id": "c2", "name": "re\ud801ad", "content": "ok"},
        {"role": "tool", "tool_call_id": "c3", "name": "read", "content": "nul\x00"},
        {"role": "tool", "tool_call_id": "c4", "name": "read", "content": None},
        {"role": "tool", "tool_call_id": "c5", "name": "read", "content": "fine"},
        {"role": "user", "content": ""},
    ],
}


async def all_messages(mem: MemoryPipeline, session: str) -> list[Message]:
    return [r["message"] for r in await mem.get_messages(session)]


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_every_shape_comes_back_as_given_through_every_read(
        mem: MemoryPipeline, shape: str) -> None:
    given = SHAPES[shape]
    receipt = mem.sync_turn("q", "a", session_id="s", user_id="ann", messages=given,
                            metadata={"note": "a\x00b", "k": {"deep": [0.1]}})
    await mem.flush()
    rows = await mem.get_messages("s")
    assert [r["message"] for r in rows] == given
    # Each id was known when sync_turn returned: the turn's messages, consecutive.
    assert receipt.first_id is not None
    assert [r["id"] for r in rows] == list(range(receipt.first_id,
                                                 receipt.first_id + len(given)))
    assert rows[0]["metadata"] == {"note": "a\x00b", "k": {"deep": [0.1]}}
    # Tool results given in order after their calls stay where they are.
    assert await mem.sessions.conversation("s") == given
    # Export, delete, import, export: the same lines, the same messages.
    lines = [line async for line in export_sessions(mem)]
    await mem.sessions.delete("s")
    await mem.flush()
    result = await import_sessions(mem, lines)
    assert (result.imported, result.messages) == (1, len(given))
    assert await all_messages(mem, "s") == given
    assert [line async for line in export_sessions(mem)] == lines


async def test_a_turn_split_across_two_calls_is_stored_once_in_order(
        mem: MemoryPipeline) -> None:
    first = [{"role": "user", "content": "read notes.md"},
             {"role": "assistant", "content": "", "tool_calls": [call("c1", "read")]}]
    second = [{"role": "tool", "tool_call_id": "c1", "content": "buy milk"},
              {"role": "assistant", "content": "You wanted milk."}]
    a = mem.sync_turn("read notes.md", "", session_id="s", messages=first)
    b = mem.sync_turn("", "You wanted milk.", session_id="s", messages=second)
    assert a.first_id is not None and b.first_id == a.first_id + 2
    await mem.flush()
    assert await all_messages(mem, "s") == first + second
    session = await mem.store.get_session("s")
    assert session is not None
    assert (session["message_count"], session["tool_call_count"]) == (4, 1)


PLAIN_TEXTS = ["", "it's Ann's", '"quoted" \\ back\nslash\ttab', "café 中文 \U0001F600",
               "nul\x00inside", "lone \ud800 surrogate", "x" * 3000,
               "ctrl \x01\x1f del \x7f, escaped as text: \\u0027 \\n ''"]
# Ids whose part of the record is made once and kept (turns._scope_parts).
PLAIN_IDS = [("o'brien", "ann"), ("zoë-1", "zoë"), ("ann's", None), ("plain-ids", "ann")]


async def test_a_plain_turn_is_stored_as_the_same_turn_given_as_messages(
        mem: MemoryPipeline) -> None:
    """sync_turn(user, assistant) has a fast path of its own: every text comes back exactly as
    the same two messages given as a list do, and is found by search alike."""
    pairs = [(u, a) for u in PLAIN_TEXTS for a in PLAIN_TEXTS[::-1]]
    # A batch holding a NUL is committed through bound parameters, any other as one SQL
    # script: the turns without go first, in batches of their own.
    pairs.sort(key=lambda pair: "\x00" in pair[0] + pair[1])
    for i, (u, a) in enumerate(pairs):
        if "\x00" in u + a and "\x00" not in "".join(pairs[i - 1]):
            await mem.flush()
        mem.sync_turn(u, a, session_id=f"plain-{i}", user_id="ann")
        mem.sync_turn("", "", session_id=f"list-{i}", user_id="ann",
                      messages=[{"role": "user", "content": u},
                                {"role": "assistant", "content": a}])
    await mem.flush()
    for i, (u, a) in enumerate(pairs):
        plain, listed = await all_messages(mem, f"plain-{i}"), await all_messages(mem, f"list-{i}")
        assert plain == listed == [{"role": "user", "content": u},
                                   {"role": "assistant", "content": a}]
    hits = await mem.sessions.search("Ann's", user_id="ann")
    assert {h.session_id.split("-")[0] for h in hits} == {"plain", "list"}


async def test_a_plain_turn_keeps_its_ids_and_texts_turn_after_turn(mem: MemoryPipeline) -> None:
    """The ids' part of a plain turn's record is made at the session's first turn and kept:
    every turn of each session, ids with quotes or beyond ASCII, comes back in its session,
    under its user, in order, its texts as given."""
    texts = [t for t in PLAIN_TEXTS if "\x00" not in t]
    for round_ in range(3):
        for sid, uid in PLAIN_IDS:
            for t in texts:
                mem.sync_turn(f"{round_} {t}", t, session_id=sid, user_id=uid)
    await mem.flush()
    for sid, uid in PLAIN_IDS:
        got = await all_messages(mem, sid)
        assert got == [m for r in range(3) for t in texts
                       for m in ({"role": "user", "content": f"{r} {t}"},
                                 {"role": "assistant", "content": t})]
        session = await mem.sessions.get_session(sid)
        assert session is not None and session.user_id == uid


class _Alias(str):
    """An id that claims to be another: equal to it, and hashed as it."""

    def __eq__(self, other: object) -> bool:
        return other == "plain-ids" or str.__eq__(self, other)

    def __hash__(self) -> int:
        return hash("plain-ids")


async def test_an_id_is_stored_as_its_own_text_whatever_it_compares_equal_to(
        mem: MemoryPipeline) -> None:
    """The ids' part kept for a session is not reused for an id that only compares equal."""
    mem.sync_turn("first", "turn", session_id="plain-ids", user_id="ann")
    mem.sync_turn("second", "turn", session_id=_Alias("alias-ids"), user_id="ann")
    await mem.flush()
    assert [m["content"] for m in await all_messages(mem, "alias-ids")] == ["second", "turn"]
    assert [m["content"] for m in await all_messages(mem, "plain-ids")] == ["first", "turn"]


async def test_the_tool_calls_column_holds_the_same_text_however_the_calls_were_given(
        mem: MemoryPipeline, settings: Settings) -> None:
    """Calls of OpenAI's shape take the fast encoder; the same calls in another mapping type
    take the standard library's. A reader of the file sees one form."""
    calls = [call("c1", "read", path="caf\u00e9.md", n=3),
             {"id": "c2", "type": "function", "function": {"name": "t", "arguments": "{}"}}]
    fast = [{"role": "assistant", "content": "", "tool_calls": calls}]
    slow = [{"role": "assistant", "content": "", "tool_calls": [Call(c) for c in calls]}]
    mem.sync_turn("", "", session_id="fast", messages=fast)
    mem.sync_turn("", "", session_id="slow", messages=slow)
    await mem.flush()
    conn = sqlite3.connect(settings.db_path)
    try:
        texts = dict(conn.execute("SELECT session_id, tool_calls FROM messages"))
    finally:
        conn.close()
    assert texts["fast"] == texts["slow"]
    assert json.loads(texts["fast"]) == calls
    assert (await all_messages(mem, "slow"))[0]["tool_calls"] == calls


class Call(dict[str, Any]):
    """A tool call in a mapping type of the caller's own."""


async def test_structured_content_is_searchable_by_its_text(mem: MemoryPipeline) -> None:
    mem.sync_turn("", "", session_id="s", user_id="ann", messages=SHAPES["structured content"])
    await mem.flush()
    assert "quokka" in await mem.search("quokka", user_id="ann")
    hits = await mem.sessions.search("quokka", user_id="ann")
    assert [h.role for h in hits] == ["user"]


async def test_text_a_column_cannot_hold_is_kept_and_indexed_as_a_copy(
        mem: MemoryPipeline) -> None:
    mem.sync_turn("nul\x00word lone\ud800word", "fine", session_id="s", user_id="ann")
    await mem.flush()
    rows = await mem.get_messages("s")
    assert rows[0]["message"]["content"] == "nul\x00word lone\ud800word"
    assert rows[0]["content"] == "nul\ufffdword lone\ufffdword"  # what the index holds
    assert "nul" in await mem.search("nul", user_id="ann")
    assert mem.stats().sanitized_turns == 1


@pytest.mark.parametrize(("metadata", "messages", "why"), [
    ({1: "int", "1": "str"}, None, "key that is not a string"),
    ({"a": {(1, 2): "tuple key"}}, None, "key that is not a string"),
    ({"when": {1, 2}}, None, "not JSON-serialisable"),
    ({"x": float("inf")}, None, "not JSON-serialisable"),
    ({"source": "tele\x00gram"}, None, "metadata.source holds a NUL"),
    ({"model": "m\ud800"}, None, "metadata.model holds a lone surrogate"),
    (None, [{"content": "no role"}], "has no role"),
    (None, [{"role": "user", "content": "x", 3: "int key"}], "key that is not a string"),
    (None, [{"role": "user", "content": object()}], "not JSON-serialisable"),
    (None, [{"role": "assistant", "tool_calls": [{1: "x"}]}], "key that is not a string"),
    # Not the first key of its object: written after ", " (json.dumps's separator).
    (None, [{"role": "assistant", "tool_calls": [{"id": "c1", 1: "x", "1": "y"}]}],
     "key that is not a string"),
    (None, [{"role": "assistant", "tool_calls": [
        {"id": "c1", "function": {"name": "f", None: "x", True: "y"}}]}],
     "key that is not a string"),
    (None, [{"role": "tool", "content": "x", "name": "t", "extra": {2: "b"}}],
     "key that is not a string"),
    (None, [{"role": "assistant", "tool_calls": [
        {"id": "c\ud800", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
     "lone surrogate"),
    (None, "not a list", "must be a list"),
])
async def test_what_json_cannot_hold_as_given_is_refused_before_it_is_acknowledged(
        mem: MemoryPipeline, metadata: Any, messages: Any, why: str) -> None:
    with pytest.raises(InvalidTurnError, match=why):
        mem.sync_turn("q", "a", session_id="s", metadata=metadata, messages=messages)
    await mem.flush()
    assert await mem.get_messages("s") == []
    assert mem.stats().accepted_turns == 0


async def test_ids_follow_accept_order_across_a_restart(settings: Settings) -> None:
    """Ids are given as turns are accepted; a restart goes on above every id given."""
    async with MemoryPipeline(settings) as mem:
        first = [mem.sync_turn(f"q{i}", "a", session_id=f"s{i % 3}") for i in range(30)]
        await mem.sessions.delete("s0")  # its ids are never given again
        await mem.flush()
    async with MemoryPipeline(settings) as mem:
        later = mem.sync_turn("after", "restart", session_id="s1")
        await mem.flush()
        ids = [r["id"] for r in await mem.get_messages("s1")]
    given = [r.first_id for r in first]
    assert given == list(range(given[0], given[0] + 60, 2))  # two messages a turn
    assert later.first_id == max(i for i in given if i is not None) + 2
    assert ids == sorted(ids) and ids[-2:] == [later.first_id, later.first_id + 1]
