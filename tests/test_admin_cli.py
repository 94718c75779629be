"""``hermes-memory status | search | sessions | dead-letters`` over real store files.

Stores are filled through the real pipeline; commands run in-process through ``cli.main``
(on a worker thread, so an open pipeline's loop keeps running) and, for the paths a user
meets first, as subprocesses.
"""

from __future__ import annotations

import json
import os
import pty
import select
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from hermes_async_memory import MemoryPipeline, Settings, cli
from hermes_async_memory.store import Batch, SqliteStore
from hermes_async_memory.turns import Turn

from .helpers import count_rows, stored_turns
from .test_cli import RUN_TIMEOUT_S, child_env, hermes_memory

# (session, user, user text, assistant text), in the order they are said.
CONVERSATION = [
    ("a1", "ada", "Where do locals eat in Lisbon?",
     "Two streets north of the station there is a small counter."),
    ("a1", "ada", "And the tram to Belém?", "Line 15 from Praça da Figueira."),
    ("b1", "bob", "My Lisbon hotel door code is swordfish", "Noted: swordfish, Lisbon hotel."),
    ("a2", "ada", "Are Lisbon museums open on Monday?", "Most close on Monday; tiles too."),
    ("b1", "bob", "Book a table for eight", "Done."),
    ("n1", None, "Lisbon weather tomorrow?", "Sunny, 24 degrees."),
    ("a1", "ada", "Thanks!\nSecond line.", "You're welcome."),
]
# A turn with a tool call, passed as the OpenAI-style history Hermes hands over.
TOOL_TURN = [
    {"role": "user", "content": "What time is it in Lisbon?"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "clock", "arguments": '{"tz": "Europe/Lisbon"}'}}]},
    {"role": "tool", "content": "14:05", "tool_call_id": "c1", "name": "clock"},
    {"role": "assistant", "content": "It is 14:05 in Lisbon."},
]


@dataclass
class Run:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


@pytest.fixture(autouse=True)
def _quiet_logs() -> Iterator[None]:
    # The pipeline's log lines would otherwise land on the stdout the commands print to.
    with capture_logs():
        yield


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Any:
    async def run(*argv: str) -> Run:
        capsys.readouterr()
        code = await anyio.to_thread.run_sync(cli.main, list(argv))
        out, err = capsys.readouterr()
        return Run(code, out, err)

    return run


def one_error_line(err: str) -> str:
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("hermes-memory: error: "), lines[0]
    return lines[0]


@pytest.fixture
async def filled(tmp_path: Path) -> AsyncIterator[Settings]:
    """A closed store holding CONVERSATION and TOOL_TURN (on a2), all committed."""
    settings = Settings(db_path=tmp_path / "memory.db")
    async with MemoryPipeline(settings) as mem:
        for session, user, question, answer in CONVERSATION:
            mem.sync_turn(question, answer, session_id=session, user_id=user)
        mem.sync_turn("", "", session_id="a2", user_id="ada", messages=TOOL_TURN,
                      metadata={"model": "m-1", "input_tokens": 12, "output_tokens": 5})
        await mem.flush()
    yield settings


def expected_messages(session: str) -> list[tuple[str, str]]:
    out = []
    for s, _, question, answer in CONVERSATION:
        if s == session:
            out += [("user", question), ("assistant", answer)]
    if session == "a2":
        out += [(m["role"], m["content"]) for m in TOOL_TURN]
    return out


# -- status ----------------------------------------------------------------------------


async def test_status_counts_stored_turns_and_the_ones_a_quick_shutdown_left(
    tmp_path: Path, run_cli: Any
) -> None:
    settings = Settings(db_path=tmp_path / "memory.db", max_batch=20)
    started = time.time()
    mem = MemoryPipeline(settings)
    await mem.start()
    for i in range(1000):
        mem.sync_turn(f"question {i}", f"answer {i}", session_id=f"s{i % 10}", user_id="ada")
    await mem.aclose(deadline_s=0)
    committed = count_rows(settings.db_path) // 2
    assert committed < 1000  # the deadline left turns in the outbox

    status = await run_cli("status", "--db", str(settings.db_path), "--json")

    assert status.code == 0, status.err
    report = status.json()
    assert report["messages"] == 2 * committed
    assert report["sessions"] == count_rows(settings.db_path, "SELECT count(*) FROM sessions")
    assert report["outbox_pending_turns"] == 1000 - committed
    assert 0 <= report["lag_s"] <= time.time() - started + 1
    assert report["dead_letters"] == 0
    text = await run_cli("status", "--db", str(settings.db_path))
    assert f"{1000 - committed} turns accepted, not committed yet" in text.out

    async with MemoryPipeline(settings) as again:  # commits what was left, exactly once
        await again.flush()
    after = (await run_cli("status", "--db", str(settings.db_path), "--json")).json()
    assert after["messages"] == 2000
    assert after["outbox_pending_turns"] == 0 and after["lag_s"] is None


async def test_status_reads_beside_a_running_pipeline(tmp_path: Path, run_cli: Any) -> None:
    settings = Settings(db_path=tmp_path / "memory.db")
    gate = anyio.Event()

    class Gated(SqliteStore):
        async def commit_batch(self, batch: Batch) -> None:
            await gate.wait()
            await super().commit_batch(batch)

    db = str(settings.db_path)
    async with MemoryPipeline(settings, store=Gated(settings.db_path)) as mem:
        try:
            for i in range(5):
                mem.sync_turn(f"held {i}", "r", session_id="s", user_id="ada")

            while_held = (await run_cli("status", "--db", db, "--json")).json()

            assert while_held["messages"] == 0
            assert while_held["outbox_pending_turns"] == 5
            assert while_held["lag_s"] >= 0
        finally:
            gate.set()
        await mem.flush()
        committed = (await run_cli("status", "--db", db, "--json")).json()
        assert committed["messages"] == 10 and committed["sessions"] == 1
        assert committed["outbox_pending_turns"] == 0


async def test_status_counts_turns_in_a_producers_outbox_and_in_the_inbox(
    tmp_path: Path, run_cli: Any
) -> None:
    db = tmp_path / "memory.db"
    producer = MemoryPipeline(Settings(db_path=db, role="producer", max_batch=20))
    await producer.start()
    try:
        for i in range(300):
            producer.sync_turn(f"q{i}", f"a{i}", session_id=f"s{i % 5}")
        await producer.flush()  # handed in: in the inbox, and still in the producer's segment

        handed_in = (await run_cli("status", "--db", str(db), "--json")).json()

        assert handed_in["messages"] == 0
        assert handed_in["outbox_pending_turns"] == handed_in["inbox_turns"] == 300
        for i in range(300, 600):
            producer.sync_turn(f"q{i}", f"a{i}", session_id=f"s{i % 5}")
    finally:
        await producer.aclose(deadline_s=0)  # most of these stay in the producer's outbox slot
    assert list(db.parent.glob("memory.db.outbox-p*/*.seg"))
    stopped = (await run_cli("status", "--db", str(db), "--json")).json()
    assert stopped["outbox_pending_turns"] == 600
    assert stopped["inbox_turns"] == count_rows(db, "SELECT count(*) FROM inbox") < 600


# -- search ----------------------------------------------------------------------------


async def test_search_by_user_never_returns_another_users_text(
    filled: Settings, run_cli: Any
) -> None:
    db = str(filled.db_path)

    ada = await run_cli("search", "Lisbon", "--user", "ada", "--db", db, "--json")

    assert ada.code == 0, ada.err
    hits = ada.json()
    ada_lisbon = [content for s in ("a1", "a2") for _, content in expected_messages(s)
                  if "lisbon" in content.lower()]
    # And the tool call asking the clock for Europe/Lisbon: found by its arguments.
    assert len(hits) == len(ada_lisbon) + 1
    assert {h["session_id"] for h in hits} <= {"a1", "a2"}
    assert not any("swordfish" in h["snippet"] for h in hits)
    # Bob's secret is found for bob, and never for ada, however the query is written.
    bob = await run_cli("search", "swordfish", "--user", "bob", "--db", db, "--json")
    assert [h["session_id"] for h in bob.json()] == ["b1", "b1"]
    for query in ("swordfish", 'lisbon" OR swordfish*', "scope:* OR swordfish", "NEAR(swordfish)"):
        probe = await run_cli("search", query, "--user", "ada", "--db", db, "--json")
        assert probe.code == 0, probe.err
        assert not any("swordfish" in h["snippet"] for h in probe.json()), query


async def test_search_by_session_and_the_text_output(filled: Settings, run_cli: Any) -> None:
    db = str(filled.db_path)

    session = await run_cli("search", "Lisbon", "--session", "n1", "--db", db, "--json")
    both = await run_cli("search", "swordfish", "--user", "ada", "--session", "b1", "--db", db,
                         "--json")
    text = await run_cli("search", "tram", "--user", "ada", "--db", db)
    nothing = await run_cli("search", "zeppelin", "--user", "ada", "--db", db)

    assert [(h["session_id"], h["role"]) for h in session.json()] == [("n1", "user")]
    assert both.json() == []  # b1 is bob's session, not ada's
    header, line = text.out.splitlines()
    assert header.split() == ["SESSION", "SOURCE", "ROLE", "TIME", "SNIPPET"]
    assert line.startswith("a1") and "user" in line and ">>>tram<<< to Belém" in line
    assert nothing.out.strip() == "no matches"


async def test_search_without_a_scope_is_a_usage_error(filled: Settings, run_cli: Any) -> None:
    result = await run_cli("search", "Lisbon", "--db", str(filled.db_path))

    assert result.code == 2
    assert "--user, --session or --all-users" in one_error_line(result.err)


async def add_telegram_session(settings: Settings) -> None:
    """a3: ada's, from telegram, split from a1 (its parent), its reply reporting its usage."""
    async with MemoryPipeline(settings) as mem:
        mem.sync_turn("", "", session_id="a3", user_id="ada", messages=[
            {"role": "user", "content": "Lisbon trains on Sunday?"},
            {"role": "assistant", "content": "Every hour from Rossio to Sintra.",
             "usage": {"prompt_tokens": 30, "completion_tokens": 9}}],
            metadata={"source": "telegram", "parent_session_id": "a1", "input_tokens": 30,
                      "output_tokens": 9})
        await mem.flush()


async def test_search_filters_syntax_and_paging_from_the_shell(
    filled: Settings, run_cli: Any
) -> None:
    await add_telegram_session(filled)
    db = str(filled.db_path)

    async def ids(*argv: str) -> list[tuple[str, str]]:
        result = await run_cli("search", *argv, "--db", db, "--json")
        assert result.code == 0, result.err
        return [(h["session_id"], h["role"]) for h in result.json()]

    ada_lisbon = await ids("Lisbon", "--user", "ada")
    assert {s for s, _ in ada_lisbon} == {"a1", "a2", "a3"}
    assert await ids("Lisbon", "--user", "ada", "--source", "telegram") == [("a3", "user")]
    assert "a3" not in {s for s, _ in await ids("Lisbon", "--user", "ada",
                                                "--exclude-source", "telegram")}
    assert {r for _, r in await ids("Lisbon", "--user", "ada", "--role", "assistant")} == {
        "assistant"}
    # Pages: two of two, then the next two, are the first four.
    first = await ids("Lisbon", "--user", "ada", "--limit", "2")
    second = await ids("Lisbon", "--user", "ada", "--limit", "2", "--offset", "2")
    assert first + second == (await ids("Lisbon", "--user", "ada", "--limit", "4"))
    assert len(first) == len(second) == 2
    # FTS5 syntax when asked for; in plain text the same words are data.
    assert await ids('"tram to"', "--syntax", "fts5", "--user", "ada") == [("a1", "user")]
    assert await ids("tram NOT Belém", "--syntax", "fts5", "--user", "ada") == []
    assert await ids("tram NOT Belém", "--user", "ada") == []  # plain: every word, "not" too
    assert await ids("Sint*", "--syntax", "fts5", "--user", "ada") == [("a3", "assistant")]
    broken = await run_cli("search", '"unclosed', "--syntax", "fts5", "--user", "ada",
                           "--db", db)
    assert broken.code == 2 and broken.out == ""
    assert "never closed" in one_error_line(broken.err)
    # An administrator's search reads everyone's; a hit carries its context.
    everyone = await run_cli("search", "swordfish", "--all-users", "--db", db, "--json")
    hits = everyone.json()
    assert {h["session_id"] for h in hits} == {"b1"}
    assert hits[0]["source"] == "api" and ">>>swordfish<<<" in hits[0]["snippet"]
    by_role = {h["role"]: h for h in hits}
    assert by_role["user"]["after"] == {"role": "assistant",
                                        "content": "Noted: swordfish, Lisbon hotel."}
    assert by_role["assistant"]["before"]["content"] == "My Lisbon hotel door code is swordfish"
    assert by_role["assistant"]["after"]["content"] == "Book a table for eight"


# -- sessions --------------------------------------------------------------------------


async def test_sessions_list_newest_first_and_by_user(filled: Settings, run_cli: Any) -> None:
    db = str(filled.db_path)

    everyone = (await run_cli("sessions", "list", "--db", db, "--json")).json()
    ada = (await run_cli("sessions", "list", "--user", "ada", "--db", db, "--json")).json()
    one = (await run_cli("sessions", "list", "--limit", "1", "--db", db, "--json")).json()
    text = await run_cli("sessions", "list", "--user", "bob", "--db", db)

    assert {s["id"]: s["message_count"] for s in everyone} == {
        s: len(expected_messages(s)) for s in ("a1", "a2", "b1", "n1")
    }
    assert [s["started_at"] for s in everyone] == sorted(
        (s["started_at"] for s in everyone), reverse=True)
    assert {s["id"] for s in ada} == {"a1", "a2"}
    assert one == everyone[:1]
    assert [line.split()[:4] for line in text.out.splitlines()] == [
        ["SESSION", "USER", "SOURCE", "MESSAGES"], ["b1", "bob", "api", "4"]]


async def test_sessions_show_prints_the_messages_in_order(filled: Settings, run_cli: Any) -> None:
    db = str(filled.db_path)

    shown = await run_cli("sessions", "show", "a2", "--db", db, "--json")
    text = await run_cli("sessions", "show", "a1", "--db", db)

    record = shown.json()
    assert record["id"] == "a2" and record["user_id"] == "ada" and record["model"] == "m-1"
    assert record["tool_call_count"] == 1 and record["input_tokens"] == 12  # one call
    assert [(m["role"], m["content"]) for m in record["messages"]] == expected_messages("a2")
    assert record["messages"][3]["tool_calls"] == TOOL_TURN[1]["tool_calls"]
    positions = [text.out.index(content) for _, content in expected_messages("a1")
                 if content.isascii() and "\n" not in content]
    assert positions == sorted(positions)
    assert "  Thanks!\n  Second line." in text.out


async def test_sessions_reads_by_source_chain_conversation_and_counts(
    filled: Settings, run_cli: Any
) -> None:
    await add_telegram_session(filled)
    db = str(filled.db_path)
    ended = await run_cli("sessions", "end", "a1", "--reason", "compression", "--db", db)
    assert ended.code == 0, ended.err

    telegram = (await run_cli("sessions", "list", "--source", "telegram", "--db", db,
                              "--json")).json()
    assert [s["id"] for s in telegram] == ["a3"]
    everyone = (await run_cli("sessions", "list", "--db", db, "--json")).json()
    page = (await run_cli("sessions", "list", "--limit", "2", "--offset", "1", "--db", db,
                          "--json")).json()
    assert page == everyone[1:3]

    # show: the end and its reason, and each message's reported token count.
    a1 = await run_cli("sessions", "show", "a1", "--db", db)
    assert "ended     " in a1.out and "(compression)" in a1.out
    a3 = (await run_cli("sessions", "show", "a3", "--db", db, "--json")).json()
    assert a3["parent_session_id"] == "a1" and a3["source"] == "telegram"
    assert (a3["input_tokens"], a3["output_tokens"], a3["tokens_estimated"]) == (30, 9, False)
    assert [m["token_count"] for m in a3["messages"]] == [None, 9]
    assert "assistant (9 tokens):" in (await run_cli("sessions", "show", "a3", "--db", db)).out

    # conversation: OpenAI chat format, the tool result right after its call.
    conversation = (await run_cli("sessions", "conversation", "a2", "--db", db)).json()
    assert [m["role"] for m in conversation][-4:] == ["user", "assistant", "tool", "assistant"]
    assert conversation[-2] == {"role": "tool", "content": "14:05", "tool_call_id": "c1",
                                "name": "clock"}
    assert conversation[-3]["tool_calls"] == TOOL_TURN[1]["tool_calls"]

    # chain: both ways.
    up = (await run_cli("sessions", "chain", "a3", "--db", db, "--json")).json()
    down = (await run_cli("sessions", "chain", "a1", "--db", db, "--json")).json()
    assert [s["id"] for s in up["ancestors"]] == ["a1"] and up["descendants"] == []
    assert [s["id"] for s in down["descendants"]] == ["a3"] and down["ancestors"] == []
    text = await run_cli("sessions", "chain", "a3", "--db", db)
    assert [line.split()[:2] for line in text.out.splitlines()[1:]] == [
        ["ancestor", "a1"], ["this", "a3"]]

    # counts, by user and source.
    ada = (await run_cli("sessions", "counts", "--user", "ada", "--db", db, "--json")).json()
    assert ada == {"sessions": 3, "messages": sum(
        len(expected_messages(s)) for s in ("a1", "a2")) + 2}
    assert (await run_cli("sessions", "counts", "--source", "telegram", "--db", db)
            ).out.strip() == "1 sessions, 2 messages"
    # Bad ids are usage errors, one line each.
    for argv in (["sessions", "list", "--user", "bad\x00id"],
                 ["sessions", "conversation", "nope"], ["sessions", "chain", "nope"]):
        result = await run_cli(*argv, "--db", db)
        assert result.code in (1, 2) and result.out == "", argv
        one_error_line(result.err)


async def test_lifecycle_writes_go_through_a_running_worker_that_holds_the_store(
    tmp_path: Path, run_cli: Any
) -> None:
    """With a worker holding the outbox, the CLI cannot open the store's pipeline: it hands
    the event to the worker through the shared inbox and waits for it to commit."""
    settings = Settings(db_path=tmp_path / "memory.db", role="worker")
    db = str(settings.db_path)
    async with MemoryPipeline(settings) as worker:
        for sid in ("w1", "w2", "w3"):
            worker.sync_turn(f"hello from {sid}", "hi", session_id=sid, user_id="ada")
        await worker.flush()

        ended = await run_cli("sessions", "end", "w1", "--reason", "done", "--db", db, "--json")
        deleted = await run_cli("sessions", "delete", "w2", "--db", db, "--json")

        assert ended.code == 0, ended.err
        assert deleted.code == 0, deleted.err
        # Committed by the worker before the commands returned.
        shown = await worker.sessions.get_session("w1")
        assert shown is not None and shown.end_reason == "done"
        assert await worker.sessions.get_session("w2") is None
        assert await worker.sessions.get_session("w3") is not None
    assert sorted(stored_turns(settings.db_path)) == ["w1", "w3"]


async def test_sessions_show_of_an_unknown_id_is_one_line_and_exit_1(
    filled: Settings, run_cli: Any
) -> None:
    result = await run_cli("sessions", "show", "no-such-session", "--db", str(filled.db_path))

    assert result.code == 1
    assert "no-such-session" in one_error_line(result.err)
    assert result.out == ""


async def test_sessions_export_round_trips_every_session_and_message(
    filled: Settings, run_cli: Any, tmp_path: Path
) -> None:
    out = tmp_path / "export.jsonl"

    result = await run_cli("sessions", "export", "--output", str(out),
                           "--db", str(filled.db_path))

    assert result.code == 0, result.err
    assert result.err == ""  # stderr is no terminal here: no progress bar
    assert "exported 4 sessions (18 messages)" in result.out
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    store = SqliteStore(filled.db_path, readers=1)
    await store.open()
    try:
        for record in lines:
            messages = record.pop("messages")
            assert record == await store.get_session(record["id"])
            assert messages == await store.get_messages(record["id"])
    finally:
        await store.aclose()
    assert sorted(r["id"] for r in lines) == ["a1", "a2", "b1", "n1"]
    assert not list(tmp_path.glob(".export.jsonl.*"))  # no partial file left behind


async def test_sessions_export_to_stdout_in_a_subprocess(filled: Settings) -> None:
    result = await anyio.to_thread.run_sync(
        lambda: hermes_memory("sessions", "export", "--user", "ada", "--db", str(filled.db_path))
    )

    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["id"] for r in records] == ["a1", "a2"]  # oldest first
    for r in records:
        assert [(m["role"], m["content"]) for m in r["messages"]] == expected_messages(r["id"])


def test_sessions_export_shows_progress_when_stderr_is_a_terminal(
    filled: Settings, tmp_path: Path
) -> None:
    out = tmp_path / "export.jsonl"
    controller, terminal = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hermes_async_memory.cli", "sessions", "export", "--output",
         str(out), "--db", str(filled.db_path)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=terminal, env=child_env(),
    )
    os.close(terminal)
    seen = b""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([controller], [], [], 1.0)
            if not ready:
                continue
            try:
                chunk = os.read(controller, 4096)
            except OSError:  # EIO: the child has closed the terminal
                break
            if not chunk:
                break
            seen += chunk
        stdout, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        os.close(controller)
        if proc.poll() is None:
            proc.kill()

    assert proc.returncode == 0, seen
    assert b"exporting sessions" in seen
    assert b"exported 4 sessions" in stdout
    assert len(out.read_text(encoding="utf-8").splitlines()) == 4


# -- dead letters ----------------------------------------------------------------------


async def test_a_dead_letter_is_listed_replayed_under_its_key_and_stored_once(
    tmp_path: Path, run_cli: Any
) -> None:
    settings = Settings(db_path=tmp_path / "memory.db", commit_retry_base_s=0.001, max_batch=20)

    class Picky(SqliteStore):
        """Rejects one turn the way a constraint or a driver would (as in test_store)."""

        async def commit_batch(self, batch: Batch) -> None:
            if any("POISON" in t.user_text for t in batch.turns):
                raise sqlite3.DataError("value rejected by the store")
            await super().commit_batch(batch)

    mem = MemoryPipeline(settings, store=Picky(settings.db_path))
    await mem.start()
    for i in range(10):
        mem.sync_turn("POISON" if i == 3 else f"turn {i}", "r", session_id=f"s{i % 2}")
    await mem.flush()
    for i in range(10, 500):  # left in the outbox, beside the dead turn's record
        mem.sync_turn(f"turn {i}", "r", session_id=f"s{i % 2}")
    await mem.aclose(deadline_s=0)
    assert list(settings.outbox_dir.glob("*.seg"))
    db = str(settings.db_path)

    listed = await run_cli("dead-letters", "list", "--db", db, "--json")
    text = await run_cli("dead-letters", "list", "--db", db)

    [dead] = listed.json()
    assert dead["session_id"] == "s1" and "value rejected" in dead["last_error"]
    assert dead["attempts"] == 1
    assert dead["key"] in text.out and "value rejected" in text.out
    assert (await run_cli("status", "--db", db, "--json")).json()["dead_letters"] == 1

    replay = await run_cli("dead-letters", "replay", dead["key"], "--db", db)

    assert replay.code == 0, replay.err
    assert "1 replayed, 0 failed" in replay.out
    assert (await run_cli("dead-letters", "list", "--db", db)).out.strip() == "no dead letters"
    assert count_rows(settings.db_path, "SELECT count(*) FROM outbox WHERE status = 'done' "
                      f"AND key = '{dead['key']}'") == 1
    found = await run_cli("search", "POISON", "--session", "s1", "--db", db, "--json")
    assert [h["role"] for h in found.json()] == ["user"]  # indexed for search too

    again = await run_cli("dead-letters", "replay", dead["key"], "--db", db)
    assert again.code == 1
    assert "not a dead letter" in again.out
    one_error_line(again.err)

    # The next start reads the dead turn's record back from the outbox and skips it: the
    # key is stored. Every turn is there exactly once.
    async with MemoryPipeline(settings) as restarted:
        await restarted.flush()
    users = [(key, c) for rows in stored_turns(settings.db_path).values()
             for key, role, c in rows if role == "user"]
    assert sorted(c for _, c in users) == sorted(
        ["POISON"] + [f"turn {i}" for i in range(500) if i != 3])
    assert len({key for key, _ in users}) == 500
    shown = (await run_cli("sessions", "show", "s1", "--db", db, "--json")).json()
    assert shown["message_count"] == len(shown["messages"]) == 500


async def test_a_turn_that_fails_again_stays_dead_with_the_new_error(
    tmp_path: Path, run_cli: Any
) -> None:
    db = tmp_path / "memory.db"
    store = SqliteStore(db, readers=1)
    await store.open()
    good = Turn.build(key="k-good", session_id="s-x", user_id="ada", accepted_at=time.time(),
                      messages=[("user", "replay me", None, None, None),
                                ("assistant", "replayed", None, None, None)], metadata=None)
    bad = good._replace(key="k-bad")
    try:
        await store.dead_letter(good, "DataError: value rejected", 5, good.encode())
        # What the pipeline keeps when a turn cannot even be encoded: not a record.
        await store.dead_letter(bad, "UnicodeEncodeError: no", 5, b"(('user', 'x'),)")
    finally:
        await store.aclose()

    result = await run_cli("dead-letters", "replay", "--all", "--db", str(db))

    assert result.code == 1
    assert "1 of 2 dead letters were not replayed" in one_error_line(result.err)
    assert "1 replayed, 1 failed" in result.out
    [left] = (await run_cli("dead-letters", "list", "--db", str(db), "--json")).json()
    assert left["key"] == "k-bad"
    assert left["last_error"].startswith("JSONDecodeError") and left["attempts"] == 6
    assert stored_turns(db)["s-x"] == [("k-good", "user", "replay me"),
                                       ("k-good", "assistant", "replayed")]


async def test_replay_needs_keys_or_all(filled: Settings, run_cli: Any) -> None:
    neither = await run_cli("dead-letters", "replay", "--db", str(filled.db_path))
    both = await run_cli("dead-letters", "replay", "k1", "--all", "--db", str(filled.db_path))

    for result in (neither, both):
        assert result.code == 2
        assert "--all" in one_error_line(result.err)


# -- errors ----------------------------------------------------------------------------

COMMANDS = [
    ["status"], ["search", "x", "--user", "u"], ["sessions", "list"], ["sessions", "show", "s"],
    ["sessions", "export"], ["dead-letters", "list"], ["dead-letters", "replay", "--all"],
]


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
async def test_a_missing_store_is_one_line_and_exit_1_and_is_not_created(
    tmp_path: Path, run_cli: Any, argv: list[str]
) -> None:
    missing = tmp_path / "nowhere.db"

    result = await run_cli(*argv, "--db", str(missing))

    assert result.code == 1
    assert f"no memory store at {missing}" in one_error_line(result.err)
    assert not missing.exists()


def test_the_default_store_comes_from_the_environment(filled: Settings, tmp_path: Path) -> None:
    found = hermes_memory("sessions", "list", "--json", HERMES_MEMORY_DB_PATH=str(filled.db_path))
    missing = hermes_memory("status", HERMES_MEMORY_DB_PATH=str(tmp_path / "gone.db"))

    assert found.returncode == 0, found.stderr
    assert len(json.loads(found.stdout)) == 4
    assert missing.returncode == 1
    assert "gone.db" in one_error_line(missing.stderr)


def test_a_file_that_is_not_sqlite_is_one_line_and_exit_1(tmp_path: Path) -> None:
    bogus = tmp_path / "notes.db"
    bogus.write_bytes(b"this is not an SQLite file, it only has its name" * 100)

    result = hermes_memory("status", "--db", str(bogus))

    assert result.returncode == 1
    assert "not a database" in one_error_line(result.stderr)


@pytest.mark.parametrize("argv", COMMANDS, ids=" ".join)
async def test_another_programs_sqlite_file_is_refused_and_left_alone(
    tmp_path: Path, run_cli: Any, argv: list[str]
) -> None:
    other = tmp_path / "other.sqlite"
    with sqlite3.connect(other) as conn:
        conn.execute("CREATE TABLE notes (body TEXT)")
    conn.close()

    result = await run_cli(*argv, "--db", str(other))

    assert result.code == 1
    assert "is not a hermes-memory store" in one_error_line(result.err)
    with sqlite3.connect(other) as conn:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master")]
    conn.close()
    assert tables == ["notes"]


def test_an_invalid_environment_setting_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = hermes_memory("status", "--db", str(tmp_path / "m.db"),
                           HERMES_MEMORY_BUSY_TIMEOUT_MS="soon")

    assert result.returncode == 2
    assert "HERMES_MEMORY_BUSY_TIMEOUT_MS" in one_error_line(result.stderr)


def test_help_lists_the_admin_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("status", "search", "sessions", "dead-letters"):
        assert command in out


async def test_sessions_end_delete_and_prune_from_the_cli(filled: Settings,
                                                         run_cli: Any) -> None:
    db = str(filled.db_path)
    ended = await run_cli("sessions", "end", "a1", "--reason", "user_exit", "--db", db,
                          "--json")
    assert ended.code == 0 and ended.json() == {"session_id": "a1", "ended": True,
                                                "reason": "user_exit"}
    shown = await run_cli("sessions", "show", "a1", "--db", db, "--json")
    assert (shown.json()["end_reason"], shown.json()["ended_at"] is not None) == (
        "user_exit", True)
    deleted = await run_cli("sessions", "delete", "b1", "--db", db)
    assert (deleted.code, deleted.out.strip()) == (0, "deleted b1")
    gone = await run_cli("sessions", "show", "b1", "--db", db)
    assert gone.code != 0 and "no session 'b1'" in one_error_line(gone.err)
    found = await run_cli("search", "swordfish", "--user", "bob", "--db", db, "--json")
    assert found.code == 0 and found.json() == []  # its index rows went with it
    # a1 ended; a2 and n1 are open: prune takes a1 only.
    pruned = await run_cli("sessions", "prune", "--older-than", "0", "--db", db, "--json")
    assert pruned.code == 0 and pruned.json()["deleted"] == ["a1"]
    listed = await run_cli("sessions", "list", "--db", db, "--json")
    assert sorted(s["id"] for s in listed.json()) == ["a2", "n1"]
    bad = await run_cli("sessions", "prune", "--older-than", "-3", "--db", db)
    assert bad.code != 0 and "older_than_days" in one_error_line(bad.err)


async def test_sessions_export_delete_import_round_trip_from_the_cli(
        filled: Settings, run_cli: Any, tmp_path: Path) -> None:
    db = str(filled.db_path)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    assert (await run_cli("sessions", "export", "-o", str(first), "--db", db)).code == 0
    for sid in ("a1", "a2", "b1", "n1"):
        assert (await run_cli("sessions", "delete", sid, "--db", db)).code == 0
    assert (await run_cli("sessions", "list", "--db", db, "--json")).json() == []
    imported = await run_cli("sessions", "import", str(first), "--db", db, "--json")
    assert imported.code == 0
    assert imported.json() == {"imported": 4, "skipped": 0,
                               "messages": sum(len(json.loads(line)["messages"])
                                               for line in first.read_text().splitlines()),
                               "detached": []}
    assert (await run_cli("sessions", "export", "-o", str(second), "--db", db)).code == 0
    assert second.read_bytes() == first.read_bytes()
    again = await run_cli("sessions", "import", str(first), "--db", db)
    assert again.out.strip() == "imported 0 sessions (0 messages); 4 already there, skipped"
    missing = await run_cli("sessions", "import", str(tmp_path / "nope.jsonl"), "--db", db)
    assert missing.code != 0 and "no file" in one_error_line(missing.err)
