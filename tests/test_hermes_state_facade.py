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


def test_every_message_column_reads_back_whatever_its_fields_hold(db: SessionDB) -> None:
    """Hermes's per-message columns are read from the message's fields: a lone surrogate in
    one Hermes does not scrub (finish_reason) reads back as given, where SQLite's JSON
    would decode it into bytes no read can take; the scrubbed ones hold U+FFFD."""
    db.create_session("s", "cli")
    db.append_message("s", role="assistant", content="ok", finish_reason="stop\ud835",
                      reasoning="why \ud835", codex_reasoning_items=[{"t": "x\ud835"}])
    row = db.get_messages("s")[0]
    assert (row["finish_reason"], row["reasoning"]) == ("stop\ud835", "why \ufffd")
    assert row["codex_reasoning_items"] == '[{"t":"x\ud835"}]'
    conversation = db.get_messages_as_conversation("s")
    assert conversation[0]["finish_reason"] == "stop\ud835"


def test_a_tool_name_or_argument_finds_its_message(db: SessionDB) -> None:
    db.create_session("s", "cli")
    call = {"id": "c", "type": "function",
            "function": {"name": "web_search", "arguments": '{"q": "okapi habitats"}'}}
    asked = db.append_message("s", role="assistant", content="Let me look.", tool_calls=[call])
    answered = db.append_message("s", role="tool", content="forests", tool_call_id="c",
                                 tool_name="web_search")
    assert sorted(h["id"] for h in db.search_messages("web_search")) == [asked, answered]
    assert [h["id"] for h in db.search_messages("habitats")] == [asked]
    assert [h["id"] for h in db.search_messages("look")] == [asked]  # the text, once
    assert [h["id"] for h in db.search_messages("web_search", sort="newest", limit=1)] == [
        answered]


def test_subagent_runs_go_with_their_parent_and_other_children_stay(db: SessionDB) -> None:
    db.create_session("parent", "cli")
    db.create_session("run", "cli", parent_session_id="parent",
                      model_config={"_delegate_from": "parent"})
    db.create_session("run_of_run", "cli", parent_session_id="run",
                      model_config={"_delegate_from": "run"})
    db.create_session("branch", "cli", parent_session_id="parent",
                      model_config={"_branched_from": "parent"})
    assert db.delete_sessions(["parent", "parent", "ghost"]) == 1
    assert [db.get_session(s) is None for s in ("parent", "run", "run_of_run")] == [True] * 3
    assert db.get_session("branch")["parent_session_id"] is None  # type: ignore[index]


def test_compaction_keeps_what_it_set_aside_findable(db: SessionDB) -> None:
    db.create_session("s", "cli")
    db.append_message("s", role="user", content="the zebra question")
    db.append_message("s", role="assistant", content="the zebra answer")
    assert not db.has_archived_messages("s")
    assert db.archive_and_compact("s", [{"role": "user", "content": "summary so far"}]) == 1
    assert [m["content"] for m in db.get_messages("s")] == ["summary so far"]
    assert len(db.get_messages("s", include_inactive=True)) == 3
    assert db.has_archived_messages("s")
    assert len(db.search_messages("zebra")) == 2  # compacted: still found
    assert db.get_session("s")["message_count"] == 1  # type: ignore[index]
    assert db.set_latest_user_api_content("s", "summary so far", "summary + context") == 1
    assert db.set_latest_user_api_content("s", "something else", "no") == 0
    assert db.get_messages("s")[0]["api_content"] == "summary + context"


def test_compression_lock_and_state_meta_through_the_facade(db: SessionDB) -> None:
    db.create_session("s", "cli")
    assert db.try_acquire_compression_lock("s", "a", ttl_seconds=60)
    assert not db.try_acquire_compression_lock("s", "b", ttl_seconds=60)
    assert db.get_compression_lock_holder("s") == "a"
    db.release_compression_lock("s", "a")
    assert db.get_compression_lock_holder("s") is None
    assert db.try_acquire_compression_lock("s", "b", ttl_seconds=60)
    db.set_meta("k", "v")
    assert db.get_meta("k") == "v"
    result = db.maybe_auto_prune_and_vacuum(retention_days=90)
    assert (result["skipped"], result["pruned"], result.get("error")) == (False, 0, None)
    assert db.maybe_auto_prune_and_vacuum(retention_days=90)["skipped"] is True


def test_rewind_sets_messages_aside_and_restore_takes_them_back(db: SessionDB) -> None:
    db.create_session("s", "cli")
    ids = [db.append_message("s", role=role, content=text) for role, text in (
        ("user", "first ask"), ("assistant", "first answer"), ("user", "second ask"),
        ("assistant", "second answer"))]
    assert [m["preview"] for m in db.list_recent_user_messages("s")] == [
        "second ask", "first ask"]
    result = db.rewind_to_message("s", ids[2])
    assert (result["rewound_count"], result["new_head_id"]) == (2, ids[1])
    assert result["target_message"]["content"] == "second ask"
    assert [m["id"] for m in db.get_messages("s")] == ids[:2]
    assert db.get_session("s")["rewind_count"] == 1  # type: ignore[index]
    with pytest.raises(ValueError, match="must be a 'user' message"):
        db.rewind_to_message("s", ids[1])
    with pytest.raises(ValueError, match="not found"):
        db.rewind_to_message("s", ids[3] + 100)
    assert db.restore_rewound("s", ids[2]) == 2
    assert [m["id"] for m in db.get_messages("s")] == ids
