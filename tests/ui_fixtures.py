"""A store file filled the way a running agent fills it, for the memory inspector's tests.

Everything goes in through the library's public API (``sync_turn`` with OpenAI messages,
session lifecycle, key-value memory, templates), and one turn is refused by the store, so a
dead letter is there with its reason, as ``test_admin_cli`` makes one.

``store_mid_reindex`` makes a store whose word index is being rebuilt after an upgrade, as a
worker stopped part way through leaves it, for what the inspector and ``status`` show then.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.memory.api import KeyValueMemory
from hermes_async_memory.sessions.lifecycle import SessionWrites
from hermes_async_memory.store import Batch, SqliteStore, text_index
from hermes_async_memory.templates.store import TemplateStore

from .test_recall_relevance import make_old_store

HOSTILE = "<script>document.title='owned'</script><img src=x onerror=alert(1)>"
POISON = "POISON-TURN"


class _Picky(SqliteStore):
    """Refuses the turn holding POISON as a constraint or a driver would."""

    async def commit_batch(self, batch: Batch) -> None:
        if any(POISON in t.user_text for t in batch.turns):
            raise sqlite3.DataError("value rejected by the store: " + POISON)
        await super().commit_batch(batch)


def call(cid: str, name: str, **args: Any) -> dict[str, Any]:
    return {"id": cid, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def tool_turn(goal: str, calls: list[dict[str, Any]], answers: dict[str, Any],
              reply: str) -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": goal},
                                  {"role": "assistant", "content": "", "tool_calls": calls}]
    for cid, content in answers.items():
        msgs.append({"role": "tool", "tool_call_id": cid, "content": json.dumps(content)})
    msgs.append({"role": "assistant", "content": reply})
    return msgs


@dataclass(frozen=True)
class Fixture:
    db: Path
    settings: Settings
    users: tuple[str, ...]
    dead_key: str  # the turn the store refused
    hostile_session: str  # holds HOSTILE in a user message and a key-value value


async def fill_store(tmp: Path) -> Fixture:
    settings = Settings(db_path=tmp / "memory.db", commit_retry_base_s=0.001)
    mem = MemoryPipeline(settings, store=_Picky(settings.db_path))
    await mem.start()
    try:
        sessions = SessionWrites(mem)
        await sessions.describe("ada-1", user_id="ada", source="cli", model="gpt-test")
        for n in range(4):
            mem.sync_turn(f"how do I deploy the billing service, step {n}?",
                          f"Run the deploy pipeline for billing (step {n}).",
                          session_id="ada-1", user_id="ada")
        mem.sync_turn(f"remember this: {HOSTILE}", "Noted, stored as text.",
                      session_id="ada-1", user_id="ada")
        # A compression split: ada-2 continues ada-1.
        await sessions.describe("ada-2", user_id="ada", source="cli", model="gpt-test",
                                parent_session_id="ada-1")
        steps = [
            tool_turn("run the tests", [call("t1", "terminal", command="pytest tests")],
                      {"t1": {"output": "ERROR: file not found: tests", "exit_code": 4}},
                      "The tests folder is missing."),
            tool_turn("run the tests", [call("t2", "terminal", command="python -m pytest -q")],
                      {"t2": {"output": "12 passed", "exit_code": 0}}, "All 12 tests pass."),
            tool_turn("open the entry point", [call("r1", "read_file", path="src/main.py")],
                      {"r1": {"content": "def main(): ..."}}, "Here is main.py."),
        ]
        for msgs in steps:
            mem.sync_turn(msgs[0]["content"], msgs[-1]["content"], session_id="ada-2",
                          user_id="ada", messages=msgs)
        await sessions.describe("bob-1", user_id="bob", source="telegram", model="gpt-other")
        for n in range(3):
            mem.sync_turn(f"what is the capital of France? ({n})",
                          "Paris is the capital of France.", session_id="bob-1",
                          user_id="bob")
        mem.sync_turn(POISON, "never stored", session_id="bob-1", user_id="bob")
        await mem.flush()
        await sessions.end("ada-1", "compressed", user_id="ada")
        kv = KeyValueMemory(mem)
        await kv.store("ada", "editor", "vim, with 4-space indents")
        await kv.store("ada", "note", HOSTILE)
        await kv.store("bob", "city", "Paris")
        await mem.flush()
        await TemplateStore(mem).extract("ada-2", "test-runner", description="runs tests",
                                         tags=["python"])
        await mem.flush()
        [dead] = await mem.store.dead_letters()
    finally:
        await mem.aclose()
    return Fixture(settings.db_path, settings, ("ada", "bob"), dead.key, "ada-1")


@contextlib.contextmanager
def http_worker(db: Path, *args: str, host: str = "127.0.0.1",
                env: dict[str, str] | None = None) -> Iterator[dict[str, Any]]:
    """``hermes-memory worker --http HOST:0 ARGS`` on ``db``; yields its
    "http_listening" log line (``port``, ``url``, ``ui``); stopped with SIGTERM after, and
    must exit 0. A worker that says nothing for 30 s is killed (its output then ends)."""
    exe = shutil.which("hermes-memory", path=str(Path(sys.executable).parent))
    assert exe is not None
    proc = subprocess.Popen(
        [exe, "worker", "--http", f"{host}:0", *args, "--log-format", "json"],
        env={**os.environ, "HERMES_MEMORY_DB_PATH": str(db), **(env or {})},
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    watchdog = threading.Timer(30.0, proc.kill)
    watchdog.start()
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            event = json.loads(line)
            if event.get("event") == "http_listening":
                watchdog.cancel()
                yield event
                break
        else:
            raise AssertionError(f"the worker never listened (exit {proc.wait(30)})")
    finally:
        watchdog.cancel()
        proc.terminate()
        assert proc.wait(30) == 0


async def store_mid_reindex(tmp: Path, *, turns: int = 600, indexed: int = 125) -> Settings:
    """A store made before the word index stemmed (``make_old_store``: schema version 11)
    with ``turns`` turns (two messages each), then opened once by this version, which
    migrates it and starts the index's rebuild, and left after one slice of ``indexed``
    messages: a worker stopped part way through. A read-only open (the inspector, ``status``)
    does not go on with it, so the progress stays where it is."""
    settings = Settings(db_path=tmp / "memory.db")
    async with MemoryPipeline(settings) as mem:
        for i in range(turns):
            mem.sync_turn(f"turn {i} about painting fences", f"reply {i}",
                          session_id=f"s{i % 7}", user_id="ada")
        await mem.flush()
    make_old_store(settings.db_path)
    store = SqliteStore(settings.db_path)
    await store.open()
    try:
        progress = await text_index.word_reindex_step(store.writer, indexed)
    finally:
        await store.aclose()
    assert progress is not None and (progress.indexed, progress.total) == (indexed, 2 * turns)
    return settings
