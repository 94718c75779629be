"""Our provider inside a real Hermes Agent run: hermes-agent 0.19's own ``AIAgent``, built as
``hermes -z`` (oneshot) builds it, talking to a stub OpenAI-compatible server on 127.0.0.1.

What is real: the plugin folder ``hermes-memory hermes install`` writes into a temporary
HERMES_HOME, enabled by ``memory.provider`` in its config.yaml and loaded by Hermes itself
(``plugins.memory``, at ``AIAgent`` init); the model endpoint resolved by Hermes's
``resolve_runtime_provider`` from that config.yaml (provider ``custom``, the stub's base_url,
a dummy key); ``run_conversation`` with its system prompt, its ``<memory-context>`` injection,
its tool loop (the ``file`` toolset's ``read_file`` on the local backend, on files in the
test's temporary folder) and its post-turn ``sync_all`` / ``queue_prefetch_all`` on the
memory manager's worker thread. Only ``file`` and ``memory`` toolsets are enabled: no
terminal, web, browser or skills tools, and ``memory`` is what lets Hermes expose a memory
provider's tools. The stub (tests/stub_openai.py) answers from a script keyed by the turn
(the number of user messages) and records every request body; Hermes streams (SSE).

The conversation, in one session, as the CLI drives it (history passed back each turn):

    1. read_file on a missing notes.txt fails       -> tool_calls row ok=0
    2. read_file on notes.md, which exists, works   -> ok=1, and it fixed row 1 (path changed)
       its request carries <procedural_guidance> for the failure of turn 1
    3. a plain answer                               -> its request carries <procedural_memory>
                                                       with the fix, and no guidance

Between turns nothing sleeps: the manager's ``flush_pending`` returns once Hermes's post-turn
calls reached the provider, the provider's ``flush`` once the turn is committed, and the
pipeline's ``wait_until`` once the recall Hermes queued for the next turn has landed.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sqlite3
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import structlog

from hermes_async_memory import HermesMemoryProvider, cli
from hermes_async_memory.hermes import config as hconfig
from hermes_async_memory.hermes.search_tool import SEARCH_TOOL, SYSTEM_PROMPT
from hermes_async_memory.procedural.tool import PROCEDURAL_TOOL
from hermes_async_memory.templates import warm_text

from .stub_openai import Reply, StubOpenAI, ToolCall

pytest.importorskip("agent.agent_init", reason="hermes-agent is not installed")

NAME = hconfig.PROVIDER_NAME
MODEL = "stub-model"
API_KEY = "sk-stub-not-a-key"
SESSION = "agent-run-s1"
# The file tools, plus "memory": Hermes exposes a memory provider's tools only with it.
TOOLSETS = ["file", "memory"]
WAIT_S = 10.0


pytestmark = pytest.mark.usefixtures("clean_env")


@dataclass(frozen=True, slots=True)
class Turn:
    user: str
    call: ToolCall | None  # what the model asks for first; None: it answers at once
    answer: str  # once the tool has answered (or at once)


def script(turns: list[Turn]) -> Callable[[dict[str, Any]], Reply]:
    """The model: the turn is the number of user messages in the request."""
    def reply(body: dict[str, Any]) -> Reply:
        messages = body["messages"]
        turn = turns[sum(m["role"] == "user" for m in messages) - 1]
        if turn.call is None or messages[-1]["role"] == "tool":
            return Reply(content=turn.answer)
        return Reply(tool_calls=[turn.call])
    return reply


@pytest.fixture
def hermes_process(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """What an AIAgent changes in the process, put back after the test: the environment
    (HERMES_SESSION_ID, TERMINAL_*), sys.stdout/stderr (wrapped), logging (a queue handler on
    the root logger, writing into HERMES_HOME/logs), and structlog (our plugin's
    ``register()`` configures it when nobody has)."""
    environ = dict(os.environ)
    monkeypatch.setattr(sys, "stdout", sys.stdout)
    monkeypatch.setattr(sys, "stderr", sys.stderr)
    root_level = logging.getLogger().level
    configured, saved = structlog.is_configured(), structlog.get_config()
    yield
    hermes_logging = sys.modules.get("hermes_logging")
    if hermes_logging is not None:
        hermes_logging._reset_queued_handlers()  # its own test-isolation helper
        hermes_logging._logging_initialized = False
    logging.getLogger().setLevel(root_level)
    if configured:
        structlog.configure(**saved)
    else:
        structlog.reset_defaults()
    os.environ.clear()
    os.environ.update(environ)


def install(home: Path, base_url: str) -> Path:
    """A HERMES_HOME with our plugin installed and enabled, and the stub as its model."""
    assert cli.main(["hermes", "install", "--hermes-home", str(home)]) == 0
    (home / "config.yaml").write_text(
        "model:\n"
        "  provider: custom\n"
        f"  base_url: {base_url}\n"
        f"  default: {MODEL}\n"
        "  context_length: 65536\n"
        "memory:\n"
        f"  provider: {NAME}\n",
        encoding="utf-8",
    )
    return home


def new_agent(home: Path, monkeypatch: pytest.MonkeyPatch, session_id: str = SESSION) -> Any:
    """``AIAgent`` as ``hermes -z`` makes one (hermes_cli/oneshot.py), with the session
    id the CLI would pass."""
    # run_agent loads $HERMES_HOME/.env and fixes its log folder when first imported: only
    # now, with HERMES_HOME set, and pointed at this home in case another test imported it.
    run_agent = importlib.import_module("run_agent")
    monkeypatch.setattr(run_agent, "_hermes_home", home)
    from hermes_cli.runtime_provider import resolve_runtime_provider
    from hermes_state import SessionDB

    runtime = resolve_runtime_provider(requested=None, explicit_api_key=API_KEY)
    return run_agent.AIAgent(
        model=MODEL, api_key=runtime["api_key"], base_url=runtime["base_url"],
        provider=runtime["provider"], api_mode=runtime["api_mode"], enabled_toolsets=TOOLSETS,
        quiet_mode=True, platform="cli", session_db=SessionDB(), session_id=session_id,
    )


def settle(agent: Any, provider: HermesMemoryProvider, query: str) -> None:
    """Wait, on events, until the turn is stored and the recall Hermes queued after it (for
    ``query``, the turn's user message) is in the cache its next prefetch reads."""
    assert agent._memory_manager.flush_pending(timeout=WAIT_S)  # sync_all, queue_prefetch_all
    provider.flush(WAIT_S)
    runtime = provider._require_runtime()
    session, user = provider.session_id, provider.user_id
    runtime.call(lambda mem: mem.wait_until(
        lambda: mem.prefetch_status(session, user_id=user).recall_query == query,
        timeout=WAIT_S), WAIT_S + 1)


def names(tools: list[dict[str, Any]]) -> set[str]:
    return {t["function"]["name"] for t in tools}


def test_a_hermes_agent_run_logs_its_tool_calls_and_carries_them_into_the_next_turn(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hermes_process: None) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.md").write_text("buy milk\n", encoding="utf-8")
    # Relative paths, as a model writes them: read_file resolves them in TERMINAL_CWD.
    turns = [
        Turn("Show me my notes in notes.txt", ToolCall("read_file", {"path": "notes.txt"}),
             "There is no notes.txt."),
        Turn("Then read notes.md", ToolCall("read_file", {"path": "notes.md"}),
             "Your notes say: buy milk."),
        Turn("What went wrong at first?", None, "notes.txt does not exist; notes.md does."),
    ]
    home = tmp_path / "hermes-home"
    monkeypatch.setenv("HERMES_HOME", str(home))
    monkeypatch.setenv("TERMINAL_ENV", "local")  # read_file on this host, whatever the shell says
    monkeypatch.setenv("TERMINAL_CWD", str(work))

    firsts: list[int] = []  # index of each turn's first request
    with StubOpenAI(script(turns), model=MODEL) as stub:
        install(home, stub.base_url)
        agent = new_agent(home, monkeypatch)
        history: list[dict[str, Any]] = []
        try:
            assert agent.base_url == stub.base_url  # no network: only the stub answers
            assert agent._memory_manager is not None, "Hermes did not load a memory provider"
            (provider,) = agent._memory_manager.providers
            assert isinstance(provider, HermesMemoryProvider)
            assert provider.settings is not None
            assert provider.settings.db_path == home / hconfig.DEFAULT_DB
            assert provider.session_id == SESSION
            for turn in turns:
                firsts.append(len(stub.chat_requests()))
                result = agent.run_conversation(turn.user, conversation_history=history,
                                                task_id=SESSION)
                assert result["completed"], (result.get("final_response"), stub.errors)
                assert result["final_response"] == turn.answer
                history = result["messages"]
                settle(agent, provider, turn.user)
        finally:
            # As the CLI's exit and `hermes -z` end a session.
            agent.shutdown_memory_provider(history)
            agent.close()
            agent._session_db.close()
        chats = stub.chat_requests()

    # One request per model step: tool call and answer, tool call and answer, answer.
    assert len(chats) == 5 and firsts == [0, 2, 4]
    first = chats[0]
    assert first["model"] == MODEL
    assert {"read_file", SEARCH_TOOL, PROCEDURAL_TOOL} <= names(first["tools"])
    assert not {"terminal", "web_search", "skill_view"} & names(first["tools"])
    system = first["messages"][0]
    assert system["role"] == "system"
    assert SYSTEM_PROMPT.splitlines()[0] in system["content"]
    assert SYSTEM_PROMPT in system["content"]  # system_prompt_block, verbatim
    tool_answer = chats[1]["messages"][-1]
    assert tool_answer["role"] == "tool" and "not found" in tool_answer["content"].lower()

    # Each turn's user message as sent, with what Hermes appended from prefetch().
    sent = [chats[i]["messages"][-1] for i in firsts]
    assert [m["role"] for m in sent] == ["user"] * 3
    assert all(m["content"].startswith(t.user) for m, t in zip(sent, turns, strict=True))
    assert "<procedural" not in sent[0]["content"]  # nothing logged yet
    second = sent[1]["content"]
    assert "<memory-context>" in second
    assert '<procedural_guidance tool="read_file"' in second
    assert 'failed: #1 (path="notes.txt")' in second.split("<procedural_guidance", 1)[1]
    third = sent[2]["content"]
    assert "<procedural_memory>" in third
    assert "<procedural_guidance" not in third  # the failure has been fixed since
    block = third.split("<procedural_memory>", 1)[1]
    assert "✗ #1: File not found: notes.txt" in block and "fixed by #2" in block
    assert 'fixed #1 with path: "notes.txt"→"notes.md"' in block

    conn = sqlite3.connect(home / hconfig.DEFAULT_DB)
    try:
        calls = conn.execute(
            "SELECT id, session_id, tool, arguments, ok, fixed_by, fixes FROM tool_calls "
            "ORDER BY id").fetchall()
    finally:
        conn.close()
    assert [(s, tool, json.loads(args), ok) for _, s, tool, args, ok, _, _ in calls] == [
        (SESSION, "read_file", {"path": "notes.txt"}, 0),
        (SESSION, "read_file", {"path": "notes.md"}, 1),
    ]
    (failed, _, _, _, _, fixed_by, _), (worked, _, _, _, _, _, fixes) = calls
    assert (fixed_by, fixes) == (worked, failed)


# Warm starts on, as the provider reads them when it initializes: any template will do
# (no evidence or success rate asked), and a new session's task type is "file".
WARM_ENV = {"WARM_START": "true", "WARM_TASK_TYPE": "file", "MIN_EVIDENCE": "0",
            "MIN_SUCCESS_RATE": "0"}
TEMPLATE = "notes-reading"
SESSION_A, SESSION_B = "agent-run-warm-a", "agent-run-warm-b"


@contextmanager
def agent_session(home: Path, monkeypatch: pytest.MonkeyPatch, session_id: str
                  ) -> Iterator[tuple[Any, HermesMemoryProvider, list[dict[str, Any]]]]:
    """A new ``AIAgent`` on ``session_id``, its provider (the one Hermes loaded) and its
    history, which ``converse`` fills; ended as the CLI's exit ends a session."""
    agent = new_agent(home, monkeypatch, session_id)
    history: list[dict[str, Any]] = []
    try:
        assert agent._memory_manager is not None, "Hermes did not load a memory provider"
        (provider,) = agent._memory_manager.providers
        assert isinstance(provider, HermesMemoryProvider)
        assert provider.session_id == session_id
        yield agent, provider, history
    finally:
        agent.shutdown_memory_provider(history)
        agent.close()
        agent._session_db.close()


def converse(agent: Any, provider: HermesMemoryProvider, turn: Turn,
             history: list[dict[str, Any]]) -> None:
    """One turn as the CLI drives it, then ``settle``."""
    result = agent.run_conversation(turn.user, conversation_history=list(history),
                                    task_id=provider.session_id)
    assert result["completed"], result.get("final_response")
    assert result["final_response"] == turn.answer
    history[:] = result["messages"]
    settle(agent, provider, turn.user)


def warm_block(text: str) -> str:
    """The ``<warm_start …>…</warm_start>`` block in ``text`` (which must hold one)."""
    assert text.count("<warm_start ") == 1, text
    return "<warm_start " + text.split("<warm_start ", 1)[1].split("</warm_start>", 1)[0]


def test_a_new_hermes_agent_session_starts_warm_from_a_template_of_an_earlier_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hermes_process: None) -> None:
    """Session A reads a file, through the agent; a template is made of it; a new session B
    (a new AIAgent, same HERMES_HOME) starts warm from it. B's first request carries the
    warm block once, in the system prompt: Hermes builds it (and caches it for the session,
    persisted in its state.db) at B's first ``run_conversation``, after ``AIAgent`` init has
    run the provider's ``initialize`` (which chose the template), so ``system_prompt_block``,
    called then, still sees B as new and appends the block after its instructions. Hermes
    calls ``prefetch_all`` after that, and the first prefetch does not repeat the block the
    system prompt already carries.
    """
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.md").write_text("buy milk\n", encoding="utf-8")
    read = Turn("Read my notes in notes.md", ToolCall("read_file", {"path": "notes.md"}),
                "Your notes say: buy milk.")
    again = Turn("What did I want to buy?", None, "Milk.")
    home = tmp_path / "hermes-home"
    monkeypatch.setenv("HERMES_HOME", str(home))
    monkeypatch.setenv("TERMINAL_ENV", "local")
    monkeypatch.setenv("TERMINAL_CWD", str(work))
    for name, value in WARM_ENV.items():
        monkeypatch.setenv(f"HERMES_MEMORY_TEMPLATE_{name}", value)

    model = [script([read])]  # each session's own script: both count turns from one
    with StubOpenAI(lambda body: model[0](body), model=MODEL) as stub:
        install(home, stub.base_url)
        with agent_session(home, monkeypatch, SESSION_A) as (agent, provider, history):
            assert provider.settings is not None and provider.settings.templates.warm_start
            converse(agent, provider, read, history)  # settled: A's turn is committed
            runtime = provider._require_runtime()
            template = runtime.call(lambda p: p.templates.extract(SESSION_A, TEMPLATE),
                                    WAIT_S)
        b_first = len(stub.chat_requests())
        model[0] = script([again])
        with agent_session(home, monkeypatch, SESSION_B) as (agent, provider, history):
            assert provider.settings is not None
            max_chars = provider.settings.templates.warm_max_chars
            converse(agent, provider, again, history)
            runtime = provider._require_runtime()
            stats = {s.task_type: s for s in runtime.call(lambda p: p.templates.stats(),
                                                          WAIT_S)}
        chats = stub.chat_requests()
    assert not stub.errors

    # A: a read_file call and the answer, with no template to start from.
    assert b_first == 2 and len(chats) == 3
    assert not any("<warm_start" in json.dumps(c) for c in chats[:b_first])
    assert template.task_type == "file" and template.source_session_id == SESSION_A
    (example,) = template.examples
    assert (example.tool, dict(example.arguments)) == ("read_file", {"path": "notes.md"})
    assert "buy milk" in example.result
    # B: started warm from it (and A cold), as recorded by the provider B's agent loaded.
    assert (stats["file"].warm.sessions, stats["file"].cold.sessions) == (1, 1)

    # B's one request: the block in the system prompt, not again in the user message.
    (request,) = chats[b_first:]
    system, user = request["messages"][0], request["messages"][-1]
    assert system["role"] == "system" and user["role"] == "user"
    text = warm_text(template, max_chars)  # what the provider hands Hermes, verbatim
    opening = f'<warm_start template="{TEMPLATE}"'
    assert text.startswith(opening)
    in_system = warm_block(system["content"])
    assert f"{SYSTEM_PROMPT}\n\n{text}" in system["content"]  # system_prompt_block's
    assert in_system.startswith(opening)
    assert 'read_file {"path": "notes.md"} -> ' in in_system  # A's call, and its result
    assert "buy milk" in in_system.split("read_file", 1)[1]
    assert "<warm_start" not in user["content"]
