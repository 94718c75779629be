"""Hermes's session store (``hermes_async_memory.hermes.state.SessionDB``) across SIGKILL:
a gateway-style child writes from several threads at once and is killed mid-stream; the next
start commits what the outbox holds, and every acknowledged write is there exactly once, in
order. And Hermes Agent's own ``state.db`` is refused, untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import sqlite3
import subprocess
import sys
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hermes_async_memory import ForeignStoreError
from hermes_async_memory.hermes.state import SessionDB

from .child_hermes_state import (
    APPEND_KINDS,
    SCRIPT,
    SLOTS,
    call_for,
    marker,
    parse_session,
    session_name,
)
from .processes import ROOT, child_env

CHILD = Path(__file__).with_name("child_hermes_state.py")
THREADS = 6
# The acknowledgements after which each round's child is killed (a few thousand calls a
# second: each round runs about a second).
KILL_AFTER = (1_500, 3_000, 6_000)
# Generous bounds for a busy two-core CI; nothing waits this long when things work.
LINE_TIMEOUT_S = 30.0
EXIT_TIMEOUT_S = 30.0
# A group-commit window this long keeps the child's writer from committing anything: what
# the next start finds of that round, the outbox replay puts there.
NEVER_COMMIT = {"HERMES_MEMORY_MAX_WAIT_MS": "600000", "HERMES_MEMORY_MAX_BATCH": "100000"}

pytestmark = pytest.mark.usefixtures("clean_env")


@pytest.fixture(autouse=True)
def _no_remote_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent's SessionDB is the embedded local store whatever the shell has set."""
    monkeypatch.delenv("HONCHO_API_KEY", raising=False)
    monkeypatch.delenv("DATABASE_URL", raising=False)


@dataclass(frozen=True)
class Ack:
    session: str
    n: int
    op: str
    id: int | None


# -- the child ------------------------------------------------------------------------------


def run_child_until(db: Path, round_: int, acks: int, log: Path,
                    env: dict[str, str] | None = None) -> list[Ack]:
    """Start the child on ``db`` for ``round_``, SIGKILL it once ``acks`` acknowledgements
    arrived (the kill decided by its output, never by a timer), and return every
    acknowledgement it printed before it died, in print order."""
    extra = dict(env or {})
    child_environ = child_env(**extra)
    for key in ("HONCHO_API_KEY", "DATABASE_URL"):
        child_environ.pop(key, None)
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(db), str(round_), str(THREADS)],
            stdout=subprocess.PIPE, stderr=err, text=True, env=child_environ, cwd=ROOT)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, name="child-stdout", daemon=True)
    reader.start()
    got: list[Ack] = []
    killed = ready = False
    try:
        while True:
            try:
                line = lines.get(timeout=LINE_TIMEOUT_S)
            except queue.Empty:
                pytest.fail(f"round {round_}: no line from the child in {LINE_TIMEOUT_S} s "
                            f"({len(got)} acks so far); stderr: {tail(log)}")
            if line is None:  # EOF: the child is gone, and every line it wrote was read
                break
            if not line.endswith("\n"):
                continue  # cannot happen (one small write per line); never counted
            if line.startswith("READY"):
                ready = True
            elif line.startswith("ERROR"):
                pytest.fail(f"round {round_}: the child failed: {line}\nstderr: {tail(log)}")
            elif line.startswith("ACK "):
                rec = json.loads(line[4:])
                got.append(Ack(rec["s"], rec["n"], rec["op"], rec["id"]))
            if not killed and len(got) >= acks:
                os.kill(proc.pid, signal.SIGKILL)
                killed = True
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(EXIT_TIMEOUT_S)
        reader.join(EXIT_TIMEOUT_S)
        if proc.stdout is not None:
            proc.stdout.close()
    assert ready, f"round {round_}: the child never opened the store: {tail(log)}"
    assert killed, (f"round {round_}: the child exited before the kill point "
                    f"({len(got)} acks): {tail(log)}")
    assert proc.returncode == -signal.SIGKILL, proc.returncode
    return got


def tail(log: Path, n: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no stderr)"


# -- the check --------------------------------------------------------------------------------


def expected_message(session: str, n: int) -> dict[str, Any]:
    """The message call ``n`` of ``session`` appended, as ``get_messages`` gives it back."""
    kind, method, args = call_for(session, n)
    assert method == "append_message" and kind in APPEND_KINDS
    return {"session_id": session, "role": args["role"], "content": args["content"],
            "tool_calls": args.get("tool_calls"), "tool_call_id": args.get("tool_call_id"),
            "tool_name": args.get("tool_name"), "finish_reason": args.get("finish_reason"),
            "token_count": args.get("token_count")}


def call_of(session: str, content: Any) -> int:
    """Which call of ``session`` wrote a stored message: the number its marker names."""
    text = json.dumps(content)
    prefix = f"<{session}#"
    start = text.find(prefix)
    assert start >= 0, f"{session}: a stored message no call of it sent: {content!r}"
    n = int(text[start + len(prefix):text.index(">", start)])
    assert 0 <= n < len(SCRIPT) and marker(session, n) in text, content
    return n


def check_store(db_path: Path, acks_by_round: dict[int, list[Ack]]) -> dict[str, int]:
    """Open the store (its start commits what the outbox holds) and check, for every round:

    - every acknowledged append is stored exactly once, under the id its call returned, in
      its session, with the role, content (text or parts), tool calls, tool call id, tool
      name, finish reason, token count and explicit timestamp it was given;
    - a session's stored messages are exactly its acknowledged appends in acknowledgement
      order (their ids increase in that order), then at most the one append that was in
      flight unacknowledged when the kill landed (a session's calls are made one at a time);
      nothing twice, nothing that was never sent;
    - every acknowledged create, token count, working directory and end is there, and the
      one call in flight may be there or not (never twice: token counts add up exactly);
    - ``message_count`` and ``tool_call_count`` match the stored messages;
    - the store holds no session and no message besides these.
    """
    all_ids = [a.id for acks in acks_by_round.values() for a in acks if a.id is not None]
    assert len(all_ids) == len(set(all_ids)), "one message id acknowledged for two appends"
    with SessionDB(db_path=db_path) as db:
        conn = db._conn  # everything the start recovered is committed when this returns
        stored_sessions = {r[0] for r in conn.execute("SELECT id FROM sessions")}
        sessions_with_messages = {
            r[0] for r in conn.execute("SELECT DISTINCT session_id FROM messages")}
        total_messages = conn.execute("SELECT count(*) FROM messages").fetchone()[0]
        assert sessions_with_messages <= stored_sessions, "messages without their session"

        checked_messages = in_flight = 0
        known: set[str] = set()
        for round_, acks in acks_by_round.items():
            by_session: dict[str, list[Ack]] = defaultdict(list)
            for a in acks:
                by_session[a.session].append(a)
            # The session each slot could have been creating when the kill landed.
            maybe_new: set[str] = set()
            for slot in range(SLOTS):
                mine = [a for a in acks if parse_session(a.session)[1] == slot]
                if not mine:
                    maybe_new.add(session_name(round_, slot, 0))
                elif mine[-1].n == len(SCRIPT) - 1:
                    maybe_new.add(session_name(round_, slot, parse_session(mine[-1].session)[2]
                                               + 1))
            for session in stored_sessions:
                if session.startswith(f"r{round_}-") and session not in by_session:
                    assert session in maybe_new, f"{session}: a session never created"
                    assert db.get_messages(session, include_inactive=True) == [], session
                    known.add(session)
            for session, mine in by_session.items():
                count, unacked = check_session(db, session, mine)
                checked_messages += count
                in_flight += unacked
                known.add(session)
        assert stored_sessions <= known, f"unknown sessions: {stored_sessions - known}"
        assert total_messages == checked_messages, "messages outside the checked sessions"
        assert db.message_count() == total_messages
    return {"sessions": len(stored_sessions), "messages": total_messages,
            "unacknowledged_messages": in_flight}


def check_session(db: SessionDB, session: str, acks: list[Ack]) -> tuple[int, int]:
    """The invariant for one session (see ``check_store``); returns how many messages it
    has, and how many of them were in flight unacknowledged."""
    done = [a.n for a in acks]
    # Acknowledgements of one session come in call order (the child's protocol).
    assert done == list(range(len(done))), f"{session}: acks out of call order: {done}"
    in_flight = len(done) if len(done) < len(SCRIPT) else None
    acked_appends = [a for a in acks if a.op == "append_message"]
    ids = [a.id for a in acked_appends]
    assert all(isinstance(i, int) for i in ids), f"{session}: an append without an id"
    assert ids == sorted(ids) and len(set(ids)) == len(ids), (
        f"{session}: ids do not increase in acknowledgement order: {ids}")

    row = db.get_session(session)
    assert row is not None, f"{session}: its acknowledged create_session was lost"
    messages = db.get_messages(session, include_inactive=True)
    calls = [call_of(session, m["content"]) for m in messages]
    assert len(calls) == len(set(calls)), f"{session}: a message stored twice: {calls}"
    assert [m["id"] for m in messages] == sorted(m["id"] for m in messages)

    # Exactly the acknowledged appends, in order, under their ids; then at most the one in
    # flight.
    acked_calls = [a.n for a in acked_appends]
    assert calls[:len(acked_calls)] == acked_calls, (
        f"{session}: acknowledged appends {acked_calls}, stored {calls}")
    extra = calls[len(acked_calls):]
    assert extra in ([], [in_flight]), f"{session}: unacknowledged messages {extra}"
    assert [m["id"] for m in messages[:len(ids)]] == ids, (
        f"{session}: stored under other ids than acknowledged")
    if extra:
        assert SCRIPT[extra[0]] in APPEND_KINDS
        assert messages[-1]["id"] > (ids[-1] if ids else 0)
    for m, n in zip(messages, calls, strict=True):
        want = expected_message(session, n)
        got = {k: m[k] for k in want}
        assert got == want, f"{session} call {n}: stored {got}, sent {want}"
        assert m["active"] == 1, f"{session} call {n}: stored inactive"
        _, _, args = call_for(session, n)
        if "timestamp" in args:
            assert m["timestamp"] == args["timestamp"], f"{session} call {n}: timestamp"
        assert isinstance(m["timestamp"], float) and m["timestamp"] > 0

    # The session's row: what was acknowledged, and maybe the call in flight, once.
    def ran(kind: str) -> tuple[list[int], list[int]]:
        """(acknowledged calls of ``kind``, the in-flight one if it is of ``kind``)."""
        return ([n for n in done if SCRIPT[n] == kind],
                [in_flight] if in_flight is not None and SCRIPT[in_flight] == kind else [])

    _, _, create = call_for(session, 0)
    assert {k: row[k] for k in ("source", "model", "user_id", "system_prompt")} == create
    assert row["message_count"] == len(messages), f"{session}: message_count"
    assert row["tool_call_count"] == sum(len(m["tool_calls"] or []) for m in messages), (
        f"{session}: tool_call_count")
    acked_tokens, maybe_tokens = ran("tokens")
    base = sum(call_for(session, n)[2]["input_tokens"] for n in acked_tokens)
    allowed = {base} | {base + call_for(session, n)[2]["input_tokens"] for n in maybe_tokens}
    assert row["input_tokens"] in allowed, f"{session}: input_tokens {row['input_tokens']}"
    out_base = sum(call_for(session, n)[2]["output_tokens"] for n in acked_tokens)
    out_allowed = {out_base} | {out_base + call_for(session, n)[2]["output_tokens"]
                                for n in maybe_tokens}
    assert row["output_tokens"] in out_allowed, f"{session}: output_tokens"
    acked_cwd, maybe_cwd = ran("cwd")
    cwd = (row["cwd"], row["git_branch"])
    given_cwd = (f"/srv/{session}", "main")
    if acked_cwd:
        assert cwd == given_cwd, f"{session}: acknowledged cwd lost: {cwd}"
    else:
        assert cwd in ((None, None), *([given_cwd] if maybe_cwd else [])), (
            f"{session}: a cwd never set: {cwd}")
    acked_end, maybe_end = ran("end")
    end = (row["end_reason"], row["ended_at"] is not None)
    if acked_end:
        assert end == ("user_exit", True), f"{session}: acknowledged end lost: {end}"
    else:
        assert end in ((None, False), *([("user_exit", True)] if maybe_end else [])), (
            f"{session}: ended without an end_session: {end}")
    return len(messages), len(extra)


# -- the tests --------------------------------------------------------------------------------


def test_sigkill_during_gateway_writes_keeps_every_acknowledged_message_once_in_order(
        tmp_path: Path) -> None:
    """Invariant, checked on every acknowledged call after each kill: no acknowledged
    message lost (stored under the id ``append_message`` returned, as it was sent), none
    stored twice, and each session's messages in the order their calls were acknowledged
    (ids increasing in that order); of the calls in flight unacknowledged, at most one per
    session is there, once; nothing is stored that was never sent; session counters match
    the stored messages.

    Three kills, the store accumulating: round 0 with commits going on; round 1 with a
    group-commit window the child never reaches (everything it acknowledged is only in the
    outbox); round 2 started straight on round 1's outbox (its start replays it, and its own
    ids must not collide with the replayed ones), killed later in its stream.
    """
    db = tmp_path / "store.db"
    acks: dict[int, list[Ack]] = {}

    acks[0] = run_child_until(db, 0, KILL_AFTER[0], tmp_path / "child0.log")
    first = check_store(db, acks)

    acks[1] = run_child_until(db, 1, KILL_AFTER[1], tmp_path / "child1.log", env=NEVER_COMMIT)
    ro = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        committed = ro.execute(
            "SELECT count(*) FROM messages WHERE session_id LIKE 'r1-%'").fetchone()[0]
    finally:
        ro.close()
    assert committed == 0, "round 1's writer committed: the replay would prove nothing"

    acks[2] = run_child_until(db, 2, KILL_AFTER[2], tmp_path / "child2.log")
    final = check_store(db, acks)

    for round_, got in acks.items():
        appends = sum(1 for a in got if a.op == "append_message")
        print(f"round {round_}: {len(got)} acks, {appends} appends")
    print(f"after round 0: {first}; at the end: {final}")
    assert final["messages"] >= sum(1 for a in acks[0] + acks[1] + acks[2]
                                    if a.op == "append_message")


def test_hermes_own_state_db_is_refused_untouched(tmp_path: Path) -> None:
    """A SessionDB on Hermes Agent's own state.db raises ForeignStoreError saying so, and
    the file is left byte for byte as it was: same bytes, same -wal/-shm siblings (no outbox
    or other file added), journal mode unchanged."""
    hermes_state = pytest.importorskip("hermes_state")
    if Path(hermes_state.__file__).resolve().parent == ROOT / "hermes_async_memory":
        pytest.skip("hermes_state is not Hermes Agent's own module here")
    assert hasattr(hermes_state, "SessionDB") and hermes_state.SessionDB is not SessionDB
    folder = tmp_path / "hermes"
    folder.mkdir()
    path = folder / "state.db"
    theirs = hermes_state.SessionDB(db_path=path)
    try:
        theirs.create_session("h1", "cli", model="their-model")
        theirs.append_message("h1", "user", "hello from Hermes")
    finally:
        theirs.close()

    def snapshot() -> dict[str, str]:
        return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(folder.iterdir())}

    before = snapshot()
    assert "state.db" in before

    with pytest.raises(ForeignStoreError) as raised:
        SessionDB(db_path=path)
    assert type(raised.value) is ForeignStoreError
    text = str(raised.value)
    assert "Hermes Agent's own session store" in text and str(path) in text, text

    after = snapshot()
    assert after["state.db"] == before["state.db"], "Hermes's state.db changed"
    assert after == before, (f"files beside Hermes's state.db changed: before "
                             f"{sorted(before)}, after {sorted(after)}")
    # Read last: a read-only connection to a WAL database may itself add -wal/-shm.
    ro = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        assert ro.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # as Hermes set it
        assert ro.execute("SELECT content FROM messages").fetchall() == [("hello from Hermes",)]
    finally:
        ro.close()
