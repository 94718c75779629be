"""Which of the messages Hermes hands ``sync_turn`` are stored, through the real provider
over a real store file: Hermes passes its whole conversation (its live list, read on a worker
thread), and each turn's span of it must be stored once, every message as Hermes holds it.

Each test reads back what was stored (``get_messages`` rows' ``message``) and compares it
with the dicts handed over; the turns are told apart by their turn keys."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from hermes_async_memory import HermesMemoryProvider, InvalidTurnError
from hermes_async_memory.hermes import config as hconfig
from hermes_async_memory.hermes.turn_messages import (
    TurnCursors,
    token_counts,
    turn_end,
    turn_start,
)

from .helpers import stored_turns

Message = dict[str, Any]
WAIT_S = 10.0
S = "s1"

pytestmark = pytest.mark.usefixtures("clean_env", "restore_structlog")


@pytest.fixture
def provider(home: Path) -> Iterator[HermesMemoryProvider]:
    p = HermesMemoryProvider()
    p.initialize(S, hermes_home=str(home), platform="cli", agent_context="primary")
    yield p
    p.shutdown()


def user(text: Any, **extra: Any) -> Message:
    return {"role": "user", "content": text, **extra}


def reply(text: Any, **extra: Any) -> Message:
    return {"role": "assistant", "content": text, **extra}


def step(cid: str, name: str = "read_file", content: Any = "", **args: Any) -> Message:
    """An assistant step that calls a tool (as Hermes keeps it, with its reasoning)."""
    return {"role": "assistant", "content": content, "reasoning": f"call {name}",
            "finish_reason": "tool_calls",
            "tool_calls": [{"id": cid, "type": "function",
                            "function": {"name": name, "arguments": json.dumps(args)}}]}


def result(cid: str, content: Any, name: str = "read_file") -> Message:
    return {"role": "tool", "tool_call_id": cid, "name": name, "content": content}


def stored(p: HermesMemoryProvider, session: str = S) -> list[list[Message]]:
    """The session's stored turns, each its messages as read back (``rows[i]["message"]``)."""
    p.flush(WAIT_S)
    turns: dict[str, list[Message]] = {}
    for row in p.get_messages(session):
        turns.setdefault(row["turn_key"], []).append(row["message"])
    return list(turns.values())


def sync(p: HermesMemoryProvider, live: list[Message], user_text: str, reply_text: str,
         session: str = S) -> None:
    """``sync_turn`` as Hermes's manager calls it, checking that the list and its dicts
    are left exactly as they were."""
    before = copy.deepcopy(live)
    ids = [id(m) for m in live]
    p.sync_turn(user_text, reply_text, session_id=session, messages=live)
    assert live == before and [id(m) for m in live] == ids, "the caller's list was changed"


# -- the shapes of a turn ---------------------------------------------------------------


def test_a_user_led_turn_with_tool_calls_is_stored_whole_and_as_given(
        provider: HermesMemoryProvider) -> None:
    live = [user("what is in notes.md?", timestamp=1_700_000_000.5),
            step("c1", path="notes.md"),
            result("c1", "buy milk"),
            reply("Your notes say: buy milk.", finish_reason="stop",
                  usage={"prompt_tokens": 40, "completion_tokens": 6})]
    sync(provider, live, "what is in notes.md?", "Your notes say: buy milk.")
    assert stored(provider) == [live]
    rows = provider.get_messages(S)
    assert [r["message"] for r in rows] == live  # each one, every key
    assert rows[0]["content"] == "what is in notes.md?"  # the prefetch cache reads these


def test_the_turns_of_a_conversation_are_each_stored_once(
        provider: HermesMemoryProvider) -> None:
    live: list[Message] = []
    turns = []
    for i in range(3):
        turn = [user(f"question {i}"), reply(f"answer {i}")]
        if i == 1:
            turn[1:1] = [step("c1", path="a.txt"), result("c1", "text of a")]
        live += turn
        turns.append(turn)
        sync(provider, live, f"question {i}", f"answer {i}")
    assert stored(provider) == turns


def test_a_turn_split_across_two_calls_stores_each_message_once(
        provider: HermesMemoryProvider) -> None:
    """Hermes syncing as its list grows: an assistant-only step, then tool results alone,
    then the rest of the turn."""
    live = [user("compare a.txt and b.txt"), step("c1", path="a.txt")]
    sync(provider, live, "compare a.txt and b.txt", "They differ.")
    live += [result("c1", "alpha")]
    sync(provider, live, "compare a.txt and b.txt", "They differ.")
    live += [step("c2", content="now b", path="b.txt"), result("c2", "beta"),
             reply("They differ.")]
    sync(provider, live, "compare a.txt and b.txt", "They differ.")
    sync(provider, live, "compare a.txt and b.txt", "They differ.")  # nothing new: nothing
    assert stored(provider) == [live[:2], live[2:3], live[3:]]


def test_tool_results_alone_and_assistant_only_steps(provider: HermesMemoryProvider) -> None:
    live = [user("run both"), step("c1", name="a"), step("c2", name="b")]
    sync(provider, live, "run both", "done")
    live += [result("c1", "1", name="a"), result("c2", "2", name="b")]
    sync(provider, live, "run both", "done")
    live += [reply("done")]
    sync(provider, live, "run both", "done")
    assert stored(provider) == [live[:3], live[3:5], live[5:]]


@pytest.mark.parametrize(("lead", "why"), [
    ([{"role": "system", "content": "You are terse."}], "a system message"),
    ([{"role": "developer", "content": "Use metric units."}], "a leading developer message"),
    ([user("first, unanswered")], "two users in a row"),
    ([{"role": "system", "content": "Summary of earlier turns."},
      {"role": "developer", "content": "be brief"}, user("one"), user("two", name="ann")],
     "all of them"),
])
def test_what_leads_a_turn_is_stored_with_it(provider: HermesMemoryProvider,
                                             lead: list[Message], why: str) -> None:
    history = [user("earlier question"), reply("earlier answer")]
    turn = [*lead, user("how far is Oslo?"), reply("About 500 km.")]
    live = history + turn
    sync(provider, live, "how far is Oslo?", "About 500 km.")
    assert stored(provider) == [turn], why
    # At the list's start too (a new conversation that opens with a system prompt).
    sync(provider, turn, "how far is Oslo?", "About 500 km.", session="fresh")
    assert stored(provider, "fresh") == [turn], why


def test_a_list_that_already_holds_the_next_user_message(
        provider: HermesMemoryProvider) -> None:
    """Hermes's worker read the live list after the next turn began."""
    turn1 = [user("read notes"), step("c1", path="notes.md"), result("c1", "milk"),
             reply("It says milk.")]
    live = [*turn1, user("and the other file?")]
    sync(provider, live, "read notes", "It says milk.")
    assert stored(provider) == [turn1]  # the tool call, its result and the real reply
    turn2 = [step("c2", path="other.md"), result("c2", "eggs"), reply("Eggs.")]
    live += turn2
    sync(provider, live, "and the other file?", "Eggs.")
    assert stored(provider) == [turn1, [live[4], *turn2]]


def test_the_next_turn_already_under_way_is_left_for_its_own_call(
        provider: HermesMemoryProvider) -> None:
    turn1 = [user("first"), reply("one")]
    turn2 = [user("second"), step("c1", path="x"), result("c1", "x")]
    sync(provider, turn1 + turn2, "first", "one")
    assert stored(provider) == [turn1]
    turn2.append(reply("two"))
    sync(provider, turn1 + turn2, "second", "two")
    assert stored(provider) == [turn1, turn2]


@pytest.mark.parametrize(("in_list", "handed"), [
    ("Done, I edited both files.", "Done, I edited both files.\n\n⚠ 1 write failed: b.txt"),
    ("Done, I edited both files.\n", "Done, I edited both files."),
    ("  Done.  ", "Done."),
    ("Done, I edited both files. Anything else?", "Done, I edited both files."),
])
def test_a_final_reply_that_differs_from_assistant_content_by_a_suffix_or_whitespace(
        provider: HermesMemoryProvider, in_list: str, handed: str) -> None:
    turn = [user("edit a and b"), step("c1", name="patch"), result("c1", "ok", name="patch"),
            reply(in_list)]
    next_turn = [user("thanks"), reply("You are welcome.")]  # the worker ran late
    sync(provider, turn + next_turn, "edit a and b", handed)
    assert stored(provider) == [turn]


def test_a_reply_transformed_beyond_recognition_ends_the_turn_at_the_last_reply(
        provider: HermesMemoryProvider) -> None:
    turn = [user("hi"), step("c1", name="clock"), result("c1", "12:00", name="clock"),
            reply("It is noon.")]
    sync(provider, [*turn, user("next")], "hi", "[transformed by a plugin]")
    assert stored(provider) == [turn]
    # An old reply that happens to match is not taken for it: history is not stored again.
    history = [user("ping"), reply("OK."), user("more"), reply("More.")]
    turn = [user("and now?"), reply("Now this.")]
    sync(provider, history + turn, "and now?", "OK.", session="s2")
    assert stored(provider, "s2") == [turn]


def test_the_matching_reply_wins_over_a_later_one(provider: HermesMemoryProvider) -> None:
    """The worker ran late: the next turn is complete in the list too."""
    turn1 = [user("first"), reply("the first answer")]
    turn2 = [user("second"), reply("the second answer")]
    sync(provider, turn1 + turn2, "first", "the first answer")
    sync(provider, turn1 + turn2, "second", "the second answer")
    assert stored(provider) == [turn1, turn2]


def test_calls_that_run_turns_behind_store_every_turn_once_in_order(
        provider: HermesMemoryProvider) -> None:
    """Hermes's memory thread ran four turns behind: every call, the session's first
    included, finds the list holding all four. Invariant: each turn stored once, in
    order, each with its own messages."""
    turns = [[user(f"question {k}"), reply(f"answer {k}")] for k in range(4)]
    live = [m for turn in turns for m in turn]
    for k in range(4):
        sync(provider, live, f"question {k}", f"answer {k}")
    assert stored(provider) == turns
    # The same on a session whose history holds a turn from before this provider: the
    # first call still stores only its own turn.
    old = [user("before"), reply("answer 1")]  # the same reply text as a later turn
    later = [[user(f"q{k}"), reply(f"answer {k}")] for k in range(3)]
    live = old + [m for turn in later for m in turn]
    for k in range(3):
        sync(provider, live, f"q{k}", f"answer {k}", session="s2")
    assert stored(provider, "s2") == later


def test_empty_and_none_content(provider: HermesMemoryProvider) -> None:
    live = [user(""), step("c1", content=None, name="clock"), result("c1", None, name="clock"),
            reply("", refusal=None), user(None)]
    sync(provider, live, "(empty)", "(empty)")
    live.append({"role": "assistant"})
    sync(provider, live, "(empty)", "(empty)")
    turns = stored(provider)
    assert turns == [live[:4], live[4:]]  # the first ends at its reply; the user after is next
    assert turns[0][1]["content"] is None and turns[0][2]["content"] is None
    assert turns[1] == [{"role": "user", "content": None}, {"role": "assistant"}]


def test_structured_content(provider: HermesMemoryProvider) -> None:
    picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KG"}}
    turn = [user([{"type": "text", "text": "what is this?"}, picture]),
            reply([{"type": "text", "text": "A quokka."}, {"type": "text", "text": "Smiling."}])]
    live = [*turn, user([{"type": "text", "text": "and this?"}, picture])]
    sync(provider, live, "what is this?", "A quokka.\nSmiling.")  # as Hermes flattens them
    assert stored(provider) == [turn]
    assert provider.get_messages(S)[1]["content"] == "A quokka.\nSmiling."  # indexed text


# -- rewritten lists, interruptions, restarts ----------------------------------------------


def test_after_undo_the_next_turn_is_stored_once(provider: HermesMemoryProvider) -> None:
    t1, t2 = [user("one"), reply("ok")], [user("two"), reply("ok")]
    sync(provider, t1, "one", "ok")
    sync(provider, t1 + t2, "two", "ok")
    # /undo drops turn 2 (Hermes slices its list); the next reply happens to be the same
    # text, at the same place in the list.
    t3 = [user("three"), reply("ok")]
    sync(provider, t1 + t3, "three", "ok")
    t4 = [user("four"), step("c1", name="x"), result("c1", "y", name="x"), reply("done")]
    sync(provider, t1 + t3 + t4, "four", "done")
    assert stored(provider) == [t1, t2, t3, t4]  # stored turns stay: they are history


def test_undo_as_hermes_signals_it(provider: HermesMemoryProvider) -> None:
    t1, t2 = [user("one"), reply("1")], [user("two"), reply("2")]
    sync(provider, t1, "one", "1")
    sync(provider, t1 + t2, "two", "2")
    # /undo, and the same question gets the same answer: a turn of its own, stored again
    # (the list at the cursor looks as it did; Hermes's signal tells it apart).
    provider.on_session_switch(S, parent_session_id="", reset=False, rewound=True)
    t2b = [user("two"), reply("2")]
    sync(provider, t1 + t2b, "two", "2")
    assert stored(provider) == [t1, t2, t2b]


def test_a_retried_turn_is_stored_as_the_new_turn_it_is(provider: HermesMemoryProvider) -> None:
    t1, t2 = [user("one"), reply("1")], [user("two"), reply("2")]
    sync(provider, t1, "one", "1")
    sync(provider, t1 + t2, "two", "2")
    retried = [user("two"), reply("2, better")]  # /retry: the same question, a new reply
    sync(provider, t1 + retried, "two", "2, better")
    assert stored(provider) == [t1, t2, retried]


def test_a_compressed_list_starts_again_from_the_current_turn(
        provider: HermesMemoryProvider) -> None:
    history = [m for i in range(4) for m in (user(f"q{i}"), reply(f"a{i}"))]
    for i in range(4):
        sync(provider, history[:2 * i + 2], f"q{i}", f"a{i}")
    summary = [{"role": "user", "content": "[Summary of the conversation so far] ..."},
               reply("Understood.")]
    turn = [user("q4"), reply("a4")]
    sync(provider, summary + history[-2:] + turn, "q4", "a4")
    assert stored(provider) == [history[2 * i:2 * i + 2] for i in range(4)] + [turn]


def test_an_interrupted_turn_is_stored_with_the_next_turn(
        provider: HermesMemoryProvider) -> None:
    t1 = [user("one"), reply("1")]
    sync(provider, t1, "one", "1")
    # Turn two is interrupted (/stop during a tool): Hermes closes it and does not sync it.
    interrupted = [user("scan the disk"), step("c1", name="du"), result("c1", "...", name="du"),
                   reply("Operation interrupted.")]
    t3 = [user("never mind, what time is it?"), step("c2", name="clock"),
          result("c2", "noon", name="clock"), reply("Noon.")]
    sync(provider, t1 + interrupted + t3, "never mind, what time is it?", "Noon.")
    assert stored(provider) == [t1, interrupted + t3]


def test_on_first_sight_earlier_history_is_not_sent_again(home: Path) -> None:
    """A restarted process sees a resumed session's whole list: only its new turn is stored,
    not the history the earlier process stored already."""
    t1, t2 = [user("one"), reply("1")], [user("two"), step("c1"), result("c1", "r"), reply("2")]
    first = HermesMemoryProvider()
    first.initialize(S, hermes_home=str(home), platform="cli")
    try:
        sync(first, t1, "one", "1")
        sync(first, t1 + t2, "two", "2")
    finally:
        first.shutdown()
    again = HermesMemoryProvider()
    again.initialize(S, hermes_home=str(home), platform="cli")
    try:
        t3 = [user("three"), reply("3")]
        sync(again, t1 + t2 + t3, "three", "3")
        assert stored(again) == [t1, t2, t3]
    finally:
        again.shutdown()


def test_sessions_keep_their_own_place(provider: HermesMemoryProvider) -> None:
    a1, b1 = [user("a one"), reply("A1")], [user("b one"), reply("B1")]
    a2, b2 = [user("a two"), reply("A2")], [user("b two"), reply("B2")]
    sync(provider, a1, "a one", "A1", session="a")
    sync(provider, b1, "b one", "B1", session="b")
    sync(provider, a1 + a2, "a two", "A2", session="a")
    sync(provider, b1 + b2, "b two", "B2", session="b")
    assert stored(provider, "a") == [a1, a2]
    assert stored(provider, "b") == [b1, b2]


def test_the_bookkeeping_keys_hermes_adds_later_do_not_count_as_a_rewrite(
        provider: HermesMemoryProvider) -> None:
    t1 = [user("one"), reply("1")]
    sync(provider, t1, "one", "1")
    t1[1]["_db_persisted"] = True  # stamped by Hermes's session flush after the sync
    t1[0]["timestamp"] = 1_700_000_000.0
    t2 = [user("two"), reply("2")]
    sync(provider, t1 + t2, "two", "2")
    assert stored(provider) == [[{"role": "user", "content": "one"},
                                 {"role": "assistant", "content": "1"}], t2]


# -- refused turns ------------------------------------------------------------------------


def test_a_turn_the_store_refuses_raises_is_counted_and_does_not_block_the_next(
        provider: HermesMemoryProvider) -> None:
    first = [user("hi"), reply("hello")]
    sync(provider, first, "hi", "hello")
    bad = [user("hello"), reply("", tool_calls=[{"bad": {1, 2}}]), reply("bye")]
    with capture_logs() as logs, pytest.raises(InvalidTurnError):
        provider.sync_turn("hello", "bye", session_id=S, messages=first + bad)
    assert provider.refused_turns == 1
    (refusal,) = [e for e in logs if e["event"] == "hermes_turn_refused"]
    assert refusal["log_level"] == "error" and refusal["span"] == (2, 5)
    assert stored(provider) == [first]  # not in part: not the texts, not the other messages
    good = [user("again"), reply("fine")]
    sync(provider, first + bad + good, "again", "fine")
    assert stored(provider) == [first, good]
    assert provider.refused_turns == 1


def test_hermes_logs_a_refused_turn(provider: HermesMemoryProvider,
                                    caplog: pytest.LogCaptureFixture) -> None:
    mm = pytest.importorskip("agent.memory_manager").MemoryManager()
    mm.add_provider(provider)
    mm.sync_all("hello", "bye", session_id=S,
                messages=[user("hello"), reply("bye", custom={1: "a key JSON turns to text"})])
    assert mm.flush_pending(timeout=WAIT_S)
    assert provider.refused_turns == 1
    assert any("sync_turn failed" in r.getMessage() for r in caplog.records)
    mm.sync_all("hi", "ok", session_id=S, messages=[user("hi"), reply("ok")])
    assert mm.flush_pending(timeout=WAIT_S)
    assert stored(provider) == [[user("hi"), reply("ok")]]


def test_a_store_error_leaves_the_span_for_the_next_call(
        provider: HermesMemoryProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    from hermes_async_memory import QueueFullError

    runtime = provider._require_runtime()
    real = runtime.sync_turn

    def full(*args: Any, **kwargs: Any) -> Any:
        raise QueueFullError("the backlog is full")

    t0, t1, t2 = ([user(f"q{i}"), reply(f"a{i}")] for i in range(3))
    sync(provider, t0, "q0", "a0")
    monkeypatch.setattr(runtime, "sync_turn", full)
    with pytest.raises(QueueFullError):
        provider.sync_turn("q1", "a1", session_id=S, messages=t0 + t1)
    monkeypatch.setattr(runtime, "sync_turn", real)
    sync(provider, t0 + t1 + t2, "q2", "a2")
    assert stored(provider) == [t0, t1 + t2]  # nothing lost, nothing twice
    assert provider.refused_turns == 0


def test_a_store_error_on_first_sight_keeps_the_turn_for_the_next_call(
        provider: HermesMemoryProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    from hermes_async_memory import DiskFullError

    runtime = provider._require_runtime()
    real = runtime.sync_turn

    def full(*args: Any, **kwargs: Any) -> Any:
        raise DiskFullError("no space left")

    history, t1, t2 = ([user(f"q{i}"), reply(f"a{i}")] for i in range(3))
    monkeypatch.setattr(runtime, "sync_turn", full)
    with pytest.raises(DiskFullError):
        provider.sync_turn("q1", "a1", session_id=S, messages=history + t1)
    monkeypatch.setattr(runtime, "sync_turn", real)
    sync(provider, history + t1 + t2, "q2", "a2")
    assert stored(provider) == [t1 + t2]  # from the failed turn's start, not the history


# -- token accounting, and the rules on their own ------------------------------------------


def test_token_counts_are_those_of_the_stored_span(provider: HermesMemoryProvider,
                                                   home: Path) -> None:
    t1 = [user("one"), reply("1", usage={"prompt_tokens": 10, "completion_tokens": 1})]
    t2 = [user("two"), {**step("c1"), "usage": {"prompt_tokens": 20, "completion_tokens": 3}},
          result("c1", "r"), reply("2", usage={"prompt_tokens": 30, "completion_tokens": 2})]
    sync(provider, t1, "one", "1")
    sync(provider, [*t1, *t2, user("three")], "two", "2")
    provider.flush(WAIT_S)
    import sqlite3

    conn = sqlite3.connect(home / hconfig.DEFAULT_DB)
    try:
        row = conn.execute("SELECT input_tokens, output_tokens, tokens_estimated FROM sessions "
                           "WHERE id = ?", (S,)).fetchone()
    finally:
        conn.close()
    assert row == (60, 6, 0)
    assert [c for _, _, c in stored_turns(home / hconfig.DEFAULT_DB)[S]] == [
        "one", "1", "two", "", "r", "2"]
    # Estimated from structured content's text parts when nothing reports usage.
    assert token_counts([user([{"type": "text", "text": "x" * 8}]), reply("y" * 5)],
                        "", "") == (2, 2, True)


def test_turn_end_and_start_on_their_own() -> None:
    live = [{"role": "system", "content": "s"}, user("u0"), reply("r0"),
            {"role": "developer", "content": "d"}, user("u1"), user("u2"), step("c"),
            result("c", "t"), reply("r1 with a footer"), user("next")]
    end = turn_end(live, 0, "r1")
    assert end == 9
    assert turn_start(live, end) == 3
    assert turn_start(live[2:], 1) == 0  # a lone reply at the list's start
    assert turn_end(live, 9, "anything") == len(live)  # nothing but a user message after
    assert turn_end([], 0, "x") == 0


def test_the_remembered_sessions_are_bounded() -> None:
    cursors = TurnCursors(max_sessions=3)
    for i in range(5):
        span = cursors.span(f"s{i}", [user("u"), reply("r")], "r")
        cursors.advance(f"s{i}", span)
    assert len(cursors) == 3 and "s0" not in cursors and "s4" in cursors
    with pytest.raises(InvalidTurnError):
        cursors.span("s", "not a list", "r")


def test_messages_that_are_not_a_list_are_refused_loudly(
        provider: HermesMemoryProvider) -> None:
    with pytest.raises(InvalidTurnError, match="list"):
        provider.sync_turn("u", "a", session_id=S, messages="u a")  # type: ignore[arg-type]
    assert provider.refused_turns == 1
    assert stored(provider) == []
