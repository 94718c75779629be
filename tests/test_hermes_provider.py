"""The Hermes Agent provider, driven by the real hermes-agent: its plugin loader, its
``MemoryManager`` (threads, timeouts, drain), over real SQLite files."""

from __future__ import annotations

import contextvars
import json
import os
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import structlog.testing

from hermes_async_memory import (
    HermesMemoryProvider,
    InvalidTurnError,
    PipelineClosedError,
    Settings,
    StoreError,
    cli,
)
from hermes_async_memory.hermes import config as hconfig
from hermes_async_memory.hermes.runtime import Runtime
from hermes_async_memory.hermes.search_tool import SEARCH_TOOL, SYSTEM_PROMPT
from hermes_async_memory.memory import MEMORY_TOOL

from .helpers import stored_turns

agent_memory_manager = pytest.importorskip("agent.memory_manager")
agent_memory_provider = pytest.importorskip("agent.memory_provider")
plugins_memory = pytest.importorskip("plugins.memory")
MemoryManager = agent_memory_manager.MemoryManager
MemoryProvider = agent_memory_provider.MemoryProvider

ROOT = Path(__file__).resolve().parents[1]
NAME = hconfig.PROVIDER_NAME
WAIT_S = 10.0


pytestmark = pytest.mark.usefixtures("clean_env", "restore_structlog")


@pytest.fixture
def provider(home: Path) -> Iterator[HermesMemoryProvider]:
    p = HermesMemoryProvider()
    p.initialize("s1", hermes_home=str(home), platform="cli", agent_context="primary",
                 agent_identity="coder", agent_workspace="hermes")
    yield p
    p.shutdown()


@pytest.fixture
def installed(home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A HERMES_HOME with the plugin folder ``hermes-memory hermes install`` writes, enabled
    in config.yaml as Hermes's loader needs."""
    assert cli.main(["hermes", "install", "--hermes-home", str(home)]) == 0
    (home / "config.yaml").write_text(f"memory:\n  provider: {NAME}\n", encoding="utf-8")
    monkeypatch.setenv("HERMES_HOME", str(home))
    return home


def db_of(home: Path) -> Path:
    return home / hconfig.DEFAULT_DB


def conversation(turns: int, session: str) -> list[tuple[str, str]]:
    return [(f"{session} question {i} about lisbon", f"{session} answer {i}") for i in range(turns)]


# -- discovery and loading ---------------------------------------------------------------


def test_hermes_discovers_and_loads_the_installed_plugin(installed: Path) -> None:
    assert plugins_memory._get_active_memory_provider() == NAME
    found = {name: (desc, ok) for name, desc, ok in plugins_memory.discover_memory_providers()}
    assert NAME in found
    description, available = found[NAME]
    assert available is True
    assert "hermes-async-memory" in description

    provider = plugins_memory.load_memory_provider(NAME)
    assert isinstance(provider, HermesMemoryProvider)
    assert isinstance(provider, MemoryProvider)
    assert provider.name == NAME
    assert provider.is_available()
    assert not db_of(installed).exists(), "loading must not open the store"


def test_the_plugin_name_is_not_a_bundled_provider() -> None:
    bundled = Path(plugins_memory.__file__).parent
    assert not (bundled / NAME).exists()


# -- the manager's life cycle -------------------------------------------------------------


def test_memory_manager_life_cycle_loses_nothing(installed: Path) -> None:
    provider = plugins_memory.load_memory_provider(NAME)
    mm = MemoryManager()
    mm.add_provider(provider)
    assert mm.has_tool(SEARCH_TOOL)
    assert mm.has_tool(MEMORY_TOOL)  # registered: Hermes drops a provider tool named "memory"
    # As run_agent does: hermes_home is injected by the manager from HERMES_HOME.
    mm.initialize_all(session_id="s1", platform="cli", agent_context="primary",
                      agent_identity="coder", agent_workspace="hermes")
    assert SEARCH_TOOL in mm.build_system_prompt()
    assert mm.prefetch_all("where do locals eat in lisbon?") == ""

    messages: list[dict[str, Any]] = []
    for i, (user, assistant) in enumerate(conversation(3, "s1")):
        mm.on_turn_start(i + 1, user, model="test-model")
        messages.append({"role": "user", "content": user})
        if i == 1:  # a turn with a tool call and its result
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "web_search", "arguments": "{}"}}]})
            messages.append({"role": "tool", "tool_call_id": "c1", "content": "tool says hi"})
        messages.append({"role": "assistant", "content": assistant})
        mm.sync_all(user, assistant, session_id="s1", messages=messages)
        mm.queue_prefetch_all(user, session_id="s1")
    assert mm.flush_pending(timeout=WAIT_S)  # the manager's worker ran every sync
    provider.flush(WAIT_S)  # and the pipeline committed them

    # prefetch_all passes session_id="": the provider falls back to its session.
    context = mm.prefetch_all("and the next question")
    assert "s1 question 2 about lisbon" in context
    assert "s1 answer 2" in context

    # /compress-style rotation: the new session records its parent.
    mm.on_session_switch("s2", parent_session_id="s1", reset=False, reason="compression")
    assert provider.session_id == "s2"
    mm.sync_all("s2 question about porto", "s2 answer", session_id="s2",
                messages=[{"role": "user", "content": "s2 question about porto"},
                          {"role": "assistant", "content": "s2 answer",
                           "usage": {"prompt_tokens": 120, "completion_tokens": 7}}])
    # /new: a reset flushes, and is not lineage.
    assert mm.flush_pending(timeout=WAIT_S)
    mm.on_session_switch("s3", parent_session_id="s2", reset=True, reason="new_session")
    found = json.loads(mm.handle_tool_call(SEARCH_TOOL, {"query": "lisbon"}))
    assert found["found"] and "s1 question" in found["results"]  # across sessions, same user

    mm.on_session_end(messages)
    mm.shutdown_all()
    assert mm.shutdown_drain_state == {
        "status": "drained", "abandoned_writes": 0, "abandoned_prefetches": 0,
        "active_tasks": 0,
    }

    db = db_of(installed)
    stored = stored_turns(db)
    s1 = [(role, content) for _, role, content in stored["s1"]]
    assert s1 == [
        ("user", "s1 question 0 about lisbon"), ("assistant", "s1 answer 0"),
        ("user", "s1 question 1 about lisbon"), ("assistant", ""), ("tool", "tool says hi"),
        ("assistant", "s1 answer 1"),
        ("user", "s1 question 2 about lisbon"), ("assistant", "s1 answer 2"),
    ]
    assert [c for _, _, c in stored["s2"]] == ["s2 question about porto", "s2 answer"]
    conn = sqlite3.connect(db)
    try:
        sessions = {r[0]: r[1:] for r in conn.execute(
            "SELECT id, source, user_id, model, parent_session_id FROM sessions")}
        ends = {r[0]: r[1:] for r in conn.execute(
            "SELECT id, end_reason, ended_at IS NOT NULL, input_tokens, output_tokens, "
            "tokens_estimated FROM sessions")}
        metadata = json.loads(conn.execute(
            "SELECT metadata FROM messages WHERE session_id = 's1' LIMIT 1").fetchone()[0])
        message_tokens = [r[0] for r in conn.execute(
            "SELECT token_count FROM messages WHERE session_id = 's2' ORDER BY id")]
    finally:
        conn.close()
    assert sessions["s1"] == ("cli", "local:coder", "test-model", None)
    assert sessions["s2"] == ("cli", "local:coder", "test-model", "s1")
    # Each session ended on record, with why: split by compression, left by /new, and the
    # current one at the session's end.
    assert [ends[s][:2] for s in ("s1", "s2", "s3")] == [
        ("compression", 1), ("new_session", 1), ("session_end", 1)]
    # s1's messages reported no usage: its counts are estimated (~4 characters a token),
    # and marked so; s2's assistant reported its usage.
    sent = [len(u) for u, _ in conversation(3, "s1")]
    sent[1] += len("tool says hi")  # the tool result went to the model in turn 1
    assert ends["s1"][2] == sum(-(-n // 4) for n in sent)
    assert ends["s1"][3] > 0 and ends["s1"][4] == 1
    assert ends["s2"][2:] == (120, 7, 0)
    # A message keeps the count it reported (the reply's completion tokens); the user
    # message reported none, and none is made up for it.
    assert message_tokens == [None, 7]
    assert metadata["agent_identity"] == "coder"
    assert metadata["agent_workspace"] == "hermes"


def test_shutdown_right_after_a_burst_abandons_nothing(installed: Path) -> None:
    """The CLI exit without flush_pending: the manager drains for 5 s, then abandons what is
    still queued. sync_turn does not wait on the store, so nothing is left to abandon."""
    provider = plugins_memory.load_memory_provider(NAME)
    mm = MemoryManager()
    mm.add_provider(provider)
    mm.initialize_all(session_id="s0", platform="cli", agent_context="primary")
    turns = 300
    for i in range(turns):
        mm.sync_all(f"burst user {i}", f"burst assistant {i}", session_id=f"s{i % 10}")
    mm.shutdown_all()
    state = mm.shutdown_drain_state
    assert state["abandoned_writes"] == 0 and state["status"] == "drained", state
    stored = stored_turns(db_of(installed))
    for s in range(10):
        users = [c for _, role, c in stored[f"s{s}"] if role == "user"]
        assert users == [f"burst user {i}" for i in range(s, turns, 10)]


# -- concurrency -----------------------------------------------------------------------------


def test_sixteen_threads_lose_nothing_duplicate_nothing_and_keep_session_order(
    provider: HermesMemoryProvider,
) -> None:
    threads_n, sessions_per_thread, turns_per_session = 16, 4, 30
    start = threading.Barrier(threads_n)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            start.wait(WAIT_S)
            for i in range(sessions_per_thread * turns_per_session):
                s = i % sessions_per_thread
                provider.sync_turn(f"t{t} s{s} u{i // sessions_per_thread}",
                                   f"t{t} s{s} a{i // sessions_per_thread}",
                                   session_id=f"t{t}-s{s}")
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads_n)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(WAIT_S * 3)
    assert not errors and not any(w.is_alive() for w in workers)
    provider.flush(WAIT_S)

    for t in range(threads_n):
        for s in range(sessions_per_thread):
            rows = provider.get_messages(f"t{t}-s{s}")
            got = [(r["role"], r["content"]) for r in rows]
            want = []
            for k in range(turns_per_session):
                want += [("user", f"t{t} s{s} u{k}"), ("assistant", f"t{t} s{s} a{k}")]
            assert got == want, f"session t{t}-s{s}"  # no loss, no duplicate, in order
            assert len({r["turn_key"] for r in rows}) == turns_per_session


# -- the turn's own messages (shape by shape: tests/test_hermes_turn_span.py) -------------


def test_this_turn_ignores_a_next_turn_appended_meanwhile(
        provider: HermesMemoryProvider) -> None:
    """Hermes hands its live list to a worker thread; the next user message may be there.
    The turn is stored as given: its tool call, its result, its reply, and the user message
    as Hermes holds it (not replaced by the cleaned text Hermes passes)."""
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "old"}, {"role": "assistant", "content": "old answer"},
        {"role": "user", "content": "raw /skill text\nwhat is up"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]},
        {"role": "tool", "tool_call_id": "c", "content": "result"},
        {"role": "assistant", "content": "final"},
        {"role": "user", "content": "the next turn, already started"},
    ]
    provider.sync_turn("what is up", "final", session_id="s1", messages=messages)
    provider.flush(WAIT_S)
    assert [r["message"] for r in provider.get_messages("s1")] == messages[2:6]
    assert messages[2]["content"] == "raw /skill text\nwhat is up", "the caller's list is kept"


def test_a_turn_whose_tool_messages_cannot_be_stored_is_refused_loudly(
    provider: HermesMemoryProvider,
) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"},
                {"role": "assistant", "content": "", "tool_calls": [{"bad": {1, 2}}]},
                {"role": "assistant", "content": "bye"}]
    with pytest.raises(InvalidTurnError, match="tool_calls"):
        provider.sync_turn("hello", "bye", session_id="s1", messages=messages)
    assert provider.refused_turns == 1
    provider.flush(WAIT_S)
    assert provider.get_messages("s1") == []  # nothing dropped silently: nothing stored


# -- hooks -------------------------------------------------------------------------------------


def test_memory_writes_are_mirrored_and_searchable(provider: HermesMemoryProvider) -> None:
    mm = MemoryManager()
    mm.add_provider(provider)
    mm.notify_memory_tool_write(
        json.dumps({"success": True}),
        {"action": "add", "target": "user", "content": "prefers tabs over spaces"},
        build_metadata=lambda: {"write_origin": "tool", "session_id": "s1"},
    )
    mm.on_memory_write("remove", "memory", "uses vim")
    provider.flush(WAIT_S)
    rows = provider.get_messages("s1")
    assert [r["content"] for r in rows] == [
        "[memory add: user]", "prefers tabs over spaces",
        "[memory remove: memory]", "(removed) uses vim",
    ]
    assert rows[1]["metadata"]["kind"] == "memory_write"
    assert rows[1]["metadata"]["provenance"]["write_origin"] == "tool"
    found = json.loads(provider.handle_tool_call(SEARCH_TOOL, {"query": "tabs spaces"}))
    assert "prefers tabs over spaces" in found["results"]


def test_builtin_memory_writes_become_the_users_key_value_memory(
    provider: HermesMemoryProvider,
) -> None:
    """Hermes's MEMORY.md / USER.md writes, as Hermes's manager sends them: add, then a
    replace and a remove that name their entry by a piece of its text (old_text)."""
    assert provider.user_id  # the CLI's per-profile user
    mm = MemoryManager()
    mm.add_provider(provider)

    def tool_write(**args: str) -> None:
        mm.notify_memory_tool_write(json.dumps({"success": True}), args,
                                    build_metadata=lambda: {"session_id": "s1"})

    def memory(**args: object) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(provider.handle_tool_call(MEMORY_TOOL, args))
        assert result["ok"], result
        return result

    tool_write(action="add", target="user", content="prefers tabs over spaces")
    tool_write(action="add", target="memory", content="the repo uses Python 3.11")
    tool_write(action="replace", target="user", content="prefers spaces, 4 of them",
               old_text="tabs over")
    assert [e["value"] for e in memory(action="query", query="spaces")["entries"]] == [
        "prefers spaces, 4 of them"]
    tool_write(action="remove", target="memory", content="", old_text="Python 3.11")
    keys = memory(action="list")["keys"]
    assert len(keys) == 1 and keys[0].startswith("user:")
    entry = memory(action="retrieve", key=keys[0])["entry"]
    assert entry["metadata"]["action"] == "replace"
    assert entry["metadata"]["provenance"] == {"session_id": "s1"}
    mm.on_delegation(task="summarise the logs", result="three errors found",
                     child_session_id="child-1")
    seen = memory(action="retrieve", key="delegation:child-1")["entry"]
    assert seen["value"] == "Task: summarise the logs\nResult: three errors found"
    assert seen["metadata"]["kind"] == "observation"


def test_delegation_is_stored_in_the_parent_session(provider: HermesMemoryProvider) -> None:
    mm = MemoryManager()
    mm.add_provider(provider)
    mm.on_delegation(task="summarise the logs", result="three errors found",
                                 child_session_id="child-1")
    provider.flush(WAIT_S)
    rows = provider.get_messages("s1")
    assert [r["content"] for r in rows] == [
        "[delegated to a subagent] summarise the logs", "three errors found"]
    assert rows[0]["metadata"]["child_session_id"] == "child-1"


def test_pre_compress_returns_memory_about_the_compressed_turns(
    provider: HermesMemoryProvider,
) -> None:
    provider.sync_turn("my cat is called Mirabelle", "noted", session_id="s1")
    provider.flush(WAIT_S)
    text = provider.on_pre_compress([
        {"role": "user", "content": "what was the cat called, Mirabelle?"},
        {"role": "assistant", "content": "..."},
    ])
    assert "Mirabelle" in text and SEARCH_TOOL in text
    assert provider.on_pre_compress([{"role": "user", "content": "zzzqqq"}]) == ""
    assert provider.on_pre_compress([]) == ""


@pytest.mark.parametrize("context", ["cron", "subagent", "flush"])
def test_non_primary_agents_do_not_write(home: Path, context: str) -> None:
    p = HermesMemoryProvider()
    p.initialize("s1", hermes_home=str(home), platform="cron", agent_context=context)
    try:
        p.sync_turn("cron prompt", "cron output", session_id="s1")
        p.on_memory_write("add", "user", "not from a user")
        p.on_delegation("t", "r")
        p.flush(WAIT_S)
        assert p.get_messages("s1") == []
        assert p.prefetch("anything") == ""  # reading still works
    finally:
        p.shutdown()


def test_providers_of_one_process_share_the_store(home: Path) -> None:
    """A gateway builds a provider per agent; the store admits one pipeline."""
    a, b = HermesMemoryProvider(), HermesMemoryProvider()
    a.initialize("chat-a", hermes_home=str(home), platform="telegram", user_id="alice")
    b.initialize("chat-b", hermes_home=str(home), platform="telegram", user_id="bob")
    a.sync_turn("alice likes green tea", "ok")
    b.sync_turn("bob likes coffee", "ok")
    a.shutdown()  # b's pipeline stays open
    b.flush(WAIT_S)
    assert [r["content"] for r in b.get_messages("chat-a")] == ["alice likes green tea", "ok"]
    # Recall is scoped to the platform user.
    assert "bob likes coffee" in b.search("coffee")
    assert b.search("green tea") == ""
    b.shutdown()
    assert set(stored_turns(db_of(home))) == {"chat-a", "chat-b"}


def test_the_loop_thread_runs_in_a_copy_of_the_initializing_context(home: Path) -> None:
    capture = structlog.testing.LogCapture()
    structlog.configure(processors=[structlog.contextvars.merge_contextvars, capture])
    structlog.contextvars.bind_contextvars(hermes_trace="t-1")
    p = HermesMemoryProvider()
    try:
        p.initialize("s1", hermes_home=str(home), platform="cli")
    finally:
        structlog.contextvars.clear_contextvars()  # the caller moves on; the loop keeps its copy
    try:
        p.sync_turn("u", "a")
        p.flush(WAIT_S)
    finally:
        p.shutdown()
    commits = [e for e in capture.entries if e["event"] == "batch_committed"]
    assert commits and all(e.get("hermes_trace") == "t-1" for e in commits)


def test_initialize_records_the_parent_session(home: Path) -> None:
    p = HermesMemoryProvider()
    p.initialize("child", hermes_home=str(home), platform="telegram", user_id="u1",
                 parent_session_id="parent")
    p.sync_turn("u", "a")
    p.shutdown()
    conn = sqlite3.connect(db_of(home))
    try:
        row = conn.execute(
            "SELECT source, user_id, parent_session_id FROM sessions WHERE id = 'child'"
        ).fetchone()
    finally:
        conn.close()
    assert row == ("telegram", "u1", "parent")


def test_a_store_another_process_holds_fails_initialize_loudly(home: Path) -> None:
    # A pipeline outside the registry, on its own loop thread: as another process would.
    holder = Runtime(Settings(db_path=db_of(home)))
    holder.start(contextvars.copy_context())
    try:
        p = HermesMemoryProvider()
        with pytest.raises(StoreError, match="in use"):
            p.initialize("s1", hermes_home=str(home), platform="cli")
        with pytest.raises(PipelineClosedError, match="not initialized"):
            p.sync_turn("u", "a")
        assert p.prefetch("q") == ""
    finally:
        assert holder.close(WAIT_S)


# -- tools ------------------------------------------------------------------------------------


def test_tool_errors_are_json_never_raised(home: Path) -> None:
    p = HermesMemoryProvider()
    closed = json.loads(p.handle_tool_call(SEARCH_TOOL, {"query": "x"}))
    assert "not initialized" in closed["error"]
    p.initialize("s1", hermes_home=str(home), platform="cli")
    try:
        for name, args in [("nope", {"query": "x"}), (SEARCH_TOOL, {}),
                           (SEARCH_TOOL, {"query": "x", "limit": 0}),
                           (SEARCH_TOOL, {"query": "x", "scope": "world"})]:
            assert "error" in json.loads(p.handle_tool_call(name, args))
        ok = json.loads(p.handle_tool_call(SEARCH_TOOL, {"query": "nothing here"}))
        assert ok == {"query": "nothing here", "scope": "user", "found": False, "results": ""}
    finally:
        p.shutdown()
    assert "error" in json.loads(p.handle_tool_call(SEARCH_TOOL, {"query": "x"}))


def test_the_memory_tool_stores_and_finds_entries_across_sessions(home: Path) -> None:
    p = HermesMemoryProvider()
    assert MEMORY_TOOL in [t["name"] for t in p.get_tool_schemas()]
    p.initialize("s1", hermes_home=str(home), platform="cli", agent_identity="coder")
    try:
        def call(args: object) -> dict[str, Any]:
            result: dict[str, Any] = json.loads(p.handle_tool_call(MEMORY_TOOL, args))  # type: ignore[arg-type]
            return result

        assert call({"action": "store", "key": "editor", "value": "helix, modal editing",
                     "metadata": {"why": "asked"}})["stored"] is True
        got = call({"action": "retrieve", "key": "editor"})
        assert got["found"] and got["entry"]["value"] == "helix, modal editing"
        assert got["entry"]["user_id"] == "local:coder"
        assert got["entry"]["metadata"] == {"why": "asked"}
        assert [e["key"] for e in call({"action": "query", "query": "modal"})["entries"]] == [
            "editor"]
        assert call({"action": "list"})["keys"] == ["editor"]
        info = call({"action": "info"})
        assert (info["backend"], info["is_cloud"], info["entries"]) == ("local (SQLite)", False,
                                                                       1)
    finally:
        p.shutdown()
    # Another session of the same user, after a restart.
    p = HermesMemoryProvider()
    p.initialize("s2", hermes_home=str(home), platform="cli", agent_identity="coder")
    try:
        assert json.loads(p.handle_tool_call(MEMORY_TOOL, {"action": "retrieve", "key": "editor"})
                          )["entry"]["value"] == "helix, modal editing"
        assert json.loads(p.handle_tool_call(MEMORY_TOOL, {"action": "delete", "key": "editor"})
                          )["deleted"] is True
        assert json.loads(p.handle_tool_call(MEMORY_TOOL, {"action": "list"}))["keys"] == []
    finally:
        p.shutdown()


@pytest.mark.parametrize(("args", "says"), [
    (None, "arguments must be a JSON object, got null"),
    ("not json", "arguments must be a JSON object"),
    ([1, 2], "arguments must be a JSON object, got list"),
    ({}, "action must be one of"),
    ({"action": "drop"}, "action must be one of"),
    ({"action": "store", "key": "k"}, "needs the argument 'value'"),
    ({"action": "store", "key": 7, "value": "v"}, "key must be a non-empty string, got int"),
    ({"action": "store", "key": "k", "value": ["v"]}, "value must be a string, got list"),
    ({"action": "store", "key": "k", "value": "v", "metadata": "x"}, "metadata must be"),
    ({"action": "store", "key": "k", "value": "v", "colour": 1}, "takes no argument colour"),
    ({"action": "retrieve"}, "needs the argument 'key'"),
    ({"action": "query", "query": 5}, "query must be a string, got int"),
    ({"action": "query", "query": "x", "limit": 0}, "limit must be an integer from 1 to 100"),
    ({"action": "query", "query": "x", "limit": "3"}, "limit must be an integer"),
    ({"action": "delete", "key": ""}, "key must be a non-empty string"),
    ({"action": "query", "query": 'NEAR("x" AND'}, None),  # user text is data: no error
])
def test_memory_tool_calls_with_bad_arguments_return_json_errors(
        provider: HermesMemoryProvider, args: object, says: str | None) -> None:
    out = json.loads(provider.handle_tool_call(MEMORY_TOOL, args))  # type: ignore[arg-type]
    if says is None:
        assert out["ok"] is True and out["entries"] == []
    else:
        assert out["ok"] is False and says in out["error"]


def test_calls_before_initialize_or_after_shutdown(home: Path) -> None:
    p = HermesMemoryProvider()
    assert p.prefetch("q") == ""
    with pytest.raises(PipelineClosedError):
        p.sync_turn("u", "a", session_id="s")
    p.initialize("s", hermes_home=str(home), platform="cli")
    p.shutdown()
    p.shutdown()  # idempotent
    assert p.prefetch("q") == ""
    with pytest.raises(PipelineClosedError):
        p.sync_turn("u", "a", session_id="s")


# -- configuration ----------------------------------------------------------------------------


def test_save_config_then_initialize_uses_it(home: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    p = HermesMemoryProvider()
    schema_keys = {f["key"] for f in p.get_config_schema()}
    assert {"db_path", "default_user_id", "recall_limit"} <= schema_keys
    p.save_config({"db_path": "$HERMES_HOME/custom/mem.db", "recall_limit": "7",
                   "default_user_id": "me"}, str(home))
    p.initialize("s1", hermes_home=str(home), platform="telegram")
    try:
        assert p.settings is not None
        assert p.settings.db_path == home / "custom" / "mem.db"
        assert p.settings.recall_limit == 7
        assert p.user_id == "me"
    finally:
        p.shutdown()
    # The environment wins over the file.
    monkeypatch.setenv("HERMES_MEMORY_RECALL_LIMIT", "3")
    assert hconfig.load(home).settings.recall_limit == 3


def test_template_settings_come_from_the_config_file_then_the_environment(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    HermesMemoryProvider().save_config(
        {"template_warm_start": True, "template_warm_task_type": "code",
         "template_warm_tags": "python,web", "template_min_evidence": 5}, str(home))
    t = hconfig.load(home, environ={}).settings.templates
    assert (t.warm_start, t.warm_task_type, t.warm_tags, t.min_evidence) == (
        True, "code", ("python", "web"), 5)
    t = hconfig.load(home, environ={"HERMES_MEMORY_TEMPLATE_MIN_EVIDENCE": "2"}
                     ).settings.templates
    assert (t.warm_start, t.min_evidence) == (True, 2)


@pytest.mark.parametrize("values", [{"recall_limit": "many"}, {"no_such_key": 1},
                                    {"recall_limit": True}, {"template_threshold": "2"},
                                    {"template_warm_start": "maybe"}])
def test_invalid_config_is_refused_and_not_written(home: Path, values: dict[str, Any]) -> None:
    with pytest.raises(hconfig.ConfigurationError):
        HermesMemoryProvider().save_config(values, str(home))
    assert not hconfig.config_path(home).exists()


def test_backup_paths_name_a_store_outside_hermes_home(
    home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HERMES_HOME", str(home))
    assert HermesMemoryProvider().backup_paths() == []  # inside HERMES_HOME: backed up anyway
    outside = tmp_path / "elsewhere" / "mem.db"
    monkeypatch.setenv("HERMES_MEMORY_DB_PATH", str(outside))
    p = HermesMemoryProvider()
    p.initialize("s1", hermes_home=str(home), platform="cli")
    try:
        paths = HermesMemoryProvider().backup_paths()  # no initialize needed
    finally:
        p.shutdown()
    assert str(outside) in paths
    assert str(outside.with_name("mem.db.outbox")) in paths


# -- import hygiene -----------------------------------------------------------------------------


def _python(code: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_MEMORY_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=60, check=False)


def test_importing_the_library_does_not_import_hermes_agent() -> None:
    result = _python(
        "import sys, hermes_async_memory as m\n"
        "assert 'agent' not in sys.modules and 'plugins' not in sys.modules, 'eager'\n"
        "assert 'hermes_async_memory.hermes.provider' not in sys.modules\n"
        "P = m.HermesMemoryProvider\n"
        "import agent.memory_provider as mp\n"
        "assert issubclass(P, mp.MemoryProvider)\n"
    )
    assert result.returncode == 0, result.stderr


def test_the_provider_imports_without_hermes_agent() -> None:
    result = _python(
        "import abc, sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'agent' or name.startswith('agent.'):\n"
        "            raise ImportError('hermes-agent hidden')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from hermes_async_memory import HermesMemoryProvider as P\n"
        "assert P.__mro__[1] is abc.ABC, P.__mro__\n"
        "assert P().name == 'hermes_async_memory'\n"
    )
    assert result.returncode == 0, result.stderr


def test_a_resumed_session_has_its_recent_turns_before_its_first_reply(home: Path) -> None:
    first = HermesMemoryProvider()
    first.initialize("resume-me", hermes_home=str(home), platform="telegram", user_id="u1")
    first.sync_turn("my parcel number is PX-5521", "noted the parcel number")
    first.shutdown()

    again = HermesMemoryProvider()  # a new process would start just like this
    again.initialize("resume-me", hermes_home=str(home), platform="telegram", user_id="u1")
    try:
        # The warm-up runs on the provider's loop thread: wait there for the pipeline's change.
        runtime = again._runtime
        assert runtime is not None
        runtime.call(lambda mem: mem.wait_until(
            lambda: "PX-5521" in again.prefetch("what was my parcel number"), timeout=WAIT_S),
            WAIT_S + 5)
        assert "noted the parcel number" in again.prefetch("")
    finally:
        again.shutdown()


# -- procedural memory -----------------------------------------------------------------------


def _tool_turn(goal: str, cid: str, path: str, answer: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": goal},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": cid, "type": "function",
                 "function": {"name": "read_file", "arguments": json.dumps({"path": path})}}]},
            {"role": "tool", "tool_call_id": cid, "content": json.dumps(answer)},
            {"role": "assistant", "content": f"done {cid}"}]


def test_the_procedural_tool_answers_with_the_fix_and_the_arguments_that_worked(
        provider: HermesMemoryProvider) -> None:
    from hermes_async_memory.procedural.tool import PROCEDURAL_TOOL

    assert PROCEDURAL_TOOL in [s["name"] for s in provider.get_tool_schemas()]
    for msgs in (_tool_turn("open the app config", "c1", "conf/app.tml",
                            {"error": "FileNotFoundError: conf/app.tml"}),
                 _tool_turn("open the app config", "c2", "conf/app.toml", {"content": "x=1"})):
        provider.sync_turn(msgs[0]["content"], msgs[-1]["content"], session_id="s1",
                           messages=msgs)
    provider.flush(WAIT_S)
    fix = json.loads(provider.handle_tool_call(
        PROCEDURAL_TOOL, {"action": "fix", "error": "FileNotFoundError"}))
    assert fix["ok"] and fix["found"]
    assert "conf/app.toml" in fix["answer"] and "conf/app.tml" in fix["answer"]
    args = json.loads(provider.handle_tool_call(
        PROCEDURAL_TOOL, {"action": "arguments", "goal": "open the config of the app"}))
    assert args["found"] and "conf/app.toml" in args["answer"]
    stats = json.loads(provider.handle_tool_call(PROCEDURAL_TOOL, {"action": "stats"}))
    assert "read_file" in stats["answer"] and "1/2" in stats["answer"]
    bad = json.loads(provider.handle_tool_call(PROCEDURAL_TOOL, {"action": "fix"}))
    assert not bad["ok"] and "error" in bad["error"]


def test_the_system_prompt_block_carries_the_tools_summary_when_enabled(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERMES_MEMORY_PROCEDURAL_SUMMARY", "true")
    p = HermesMemoryProvider()
    p.initialize("s1", hermes_home=str(home), platform="cli")
    try:
        assert "<procedural_memory_summary>" not in p.system_prompt_block()  # nothing yet
        msgs = _tool_turn("open the app config", "c1", "conf/app.toml", {"content": "x=1"})
        p.sync_turn(msgs[0]["content"], msgs[-1]["content"], session_id="s1", messages=msgs)
        p.flush(WAIT_S)
        block = p.system_prompt_block()
        assert block.startswith(SYSTEM_PROMPT)
        assert "<procedural_memory_summary>" in block and "read_file" in block
    finally:
        p.shutdown()
    monkeypatch.delenv("HERMES_MEMORY_PROCEDURAL_SUMMARY")
    q = HermesMemoryProvider()
    q.initialize("s1", hermes_home=str(home), platform="cli")
    try:
        assert q.system_prompt_block() == SYSTEM_PROMPT  # off by default
    finally:
        q.shutdown()


def test_a_new_session_starts_warm_from_the_best_template_and_its_end_is_recorded(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("WARM_START", "true"), ("MIN_EVIDENCE", "0"),
                        ("MIN_SUCCESS_RATE", "0"), ("WARM_TASK_TYPE", "file")):
        monkeypatch.setenv(f"HERMES_MEMORY_TEMPLATE_{name}", value)
    first = HermesMemoryProvider()
    first.initialize("s1", hermes_home=str(home), platform="cli")
    try:
        for msgs in (_tool_turn("open the app config", "c1", "conf/app.toml", {"content": "x"}),
                     _tool_turn("open the readme", "c2", "README.md", {"content": "# app"})):
            first.sync_turn(msgs[0]["content"], msgs[-1]["content"], session_id="s1",
                            messages=msgs)
        assert first.prefetch("") == ""  # no template yet: s1 started cold
        first.flush(WAIT_S)
        runtime = first._require_runtime()
        template = runtime.call(lambda p: p.templates.extract("s1", "config-reading"), WAIT_S)
        assert template.task_type == "file"
        first.on_session_end([])
    finally:
        first.shutdown()
    second = HermesMemoryProvider()
    second.initialize("s2", hermes_home=str(home), platform="cli")
    try:
        block = second.system_prompt_block()
        assert block == second.system_prompt_block()  # asked again while new: the same
        assert block.startswith(SYSTEM_PROMPT)
        assert '<warm_start template="config-reading"' in block and "conf/app.toml" in block
        assert "<warm_start" not in second.prefetch("")  # the system prompt carried it
        assert "<warm_start" not in second.system_prompt_block()  # the session is not new
        msgs = _tool_turn("open the config", "c3", "conf/app.toml", {"content": "x"})
        second.sync_turn(msgs[0]["content"], msgs[-1]["content"], session_id="s2",
                         messages=msgs)
        second.on_session_end([])
        runtime = second._require_runtime()
        stats = {s.task_type: s for s in runtime.call(lambda p: p.templates.stats(), WAIT_S)}
        stored = runtime.call(lambda p: p.templates.get("config-reading"), WAIT_S)
    finally:
        second.shutdown()
    assert stored is not None and stored.usage_count == 1 and stored.successes >= 1
    assert stats["file"].warm.sessions == 1 and stats["file"].cold.sessions == 1


def test_a_host_whose_system_prompt_came_first_gets_the_warm_start_in_the_first_prefetch(
        home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("WARM_START", "true"), ("MIN_EVIDENCE", "0"),
                        ("MIN_SUCCESS_RATE", "0"), ("WARM_TASK_TYPE", "file")):
        monkeypatch.setenv(f"HERMES_MEMORY_TEMPLATE_{name}", value)
    p = HermesMemoryProvider()
    p.initialize("s1", hermes_home=str(home), platform="cli")
    try:
        msgs = _tool_turn("open the app config", "c1", "conf/app.toml", {"content": "x"})
        p.sync_turn(msgs[0]["content"], msgs[-1]["content"], session_id="s1", messages=msgs)
        p.flush(WAIT_S)
        p._require_runtime().call(lambda q: q.templates.extract("s1", "cfg"), WAIT_S)
        p.on_session_switch("s2", reset=True)  # a new session; no system prompt asked for
        first = p.prefetch("")
        assert first.startswith('<warm_start template="cfg"') and "conf/app.toml" in first
        assert "<warm_start" not in p.prefetch("")
        assert "<warm_start" not in p.system_prompt_block()
    finally:
        p.shutdown()
