"""``hermes_async_memory.hermes.state.SessionDB`` as Hermes's code uses it, beyond Hermes's
own tests (tests/test_hermes_state_suite.py runs those): ids known at acknowledgement, reads
that see every write acknowledged before them from any thread, many writer threads at once,
and ``_conn`` for the code that reads Hermes's tables directly."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from hermes_async_memory.hermes.state import SessionDB

THREADS = 8
PER_THREAD = 150


@pytest.fixture
def db(tmp_path: Path) -> Iterator[SessionDB]:
    store = SessionDB(db_path=tmp_path / "store.db")
    yield store
    store.close()


def test_an_appended_message_has_its_id_and_is_read_back_at_once(db: SessionDB) -> None:
    db.create_session("s1", "cli", user_id="ann")
    ids = [db.append_message("s1", role="user", content="hello"),
           db.append_message("s1", role="assistant", content=None,
                             tool_calls=[{"id": "c", "type": "function",
                                          "function": {"name": "f", "arguments": "{}"}}],
                             reasoning="check first"),
           db.append_message("s1", role="tool", content="done", tool_call_id="c",
                             tool_name="f", timestamp=1_700_000_000)]
    assert ids == [ids[0], ids[0] + 1, ids[0] + 2]  # given when each call returned
    rows = db.get_messages("s1")  # read right away: sees every acknowledged write
    assert [(r["id"], r["role"]) for r in rows] == list(zip(ids, ["user", "assistant", "tool"],
                                                            strict=True))
    assert rows[1]["reasoning"] == "check first" and rows[1]["content"] is None
    assert rows[2]["timestamp"] == 1_700_000_000.0
    assert db.get_session("s1")["message_count"] == 3  # type: ignore[index]
    assert db._conn.execute("SELECT count(*) FROM messages WHERE session_id = 's1'"
                            ).fetchone()[0] == 3


def test_many_writer_threads_lose_nothing_and_keep_each_sessions_order(db: SessionDB) -> None:
    """Invariant: every acknowledged append is stored once, under its acknowledged id, and
    each session's messages come back in the order its thread appended them."""
    acked: dict[str, list[tuple[int, str]]] = {}
    start = threading.Barrier(THREADS)
    errors: list[BaseException] = []

    def writer(n: int) -> None:
        sid = f"s{n}"
        mine: list[tuple[int, str]] = []
        try:
            db.create_session(sid, "telegram", user_id=f"u{n % 3}")
            start.wait(timeout=30)
            for i in range(PER_THREAD):
                text = f"thread {n} message {i}"
                mine.append((db.append_message(sid, role="user" if i % 2 else "assistant",
                                               content=text), text))
        except BaseException as exc:  # reported below, with the thread's name
            errors.append(exc)
        acked[sid] = mine

    threads = [threading.Thread(target=writer, args=(n,), name=f"w{n}") for n in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    all_ids = [i for mine in acked.values() for i, _ in mine]
    assert len(set(all_ids)) == THREADS * PER_THREAD  # no id given twice
    for sid, mine in acked.items():
        rows = db.get_messages(sid)
        assert [(r["id"], r["content"]) for r in rows] == mine, sid  # once each, in order
        assert db.get_session(sid)["message_count"] == PER_THREAD  # type: ignore[index]
    assert db.message_count() == THREADS * PER_THREAD


def test_raw_connection_sees_acknowledged_writes_and_its_writes_are_read(
        db: SessionDB) -> None:
    """Hermes's own code (insights, the dashboard) runs SQL on ``_conn``; Hermes's tests
    change rows through it. It reads after every acknowledged write committed."""
    db.create_session("old", "cli")
    db.end_session("old", "done")
    db._conn.execute("UPDATE sessions SET started_at = started_at - 200 * 86400 "
                     "WHERE id = 'old'")
    db.create_session("new", "cli")
    db.end_session("new", "done")
    assert db.prune_sessions(older_than_days=90) == 1
    assert db.get_session("old") is None and db.get_session("new") is not None


def test_library_and_facade_end_rules(db: SessionDB) -> None:
    """Hermes's rule through the facade: the first end wins until the session is reopened."""
    db.create_session("s", "cli")
    db.end_session("s", "compression")
    db.end_session("s", "user_exit")
    assert db.get_session("s")["end_reason"] == "compression"  # type: ignore[index]
    db.reopen_session("s")
    assert db.get_session("s")["ended_at"] is None  # type: ignore[index]
    db.end_session("s", "user_exit")
    assert db.get_session("s")["end_reason"] == "user_exit"  # type: ignore[index]
