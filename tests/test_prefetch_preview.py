"""preview_prefetch on a real store file: the block is exactly what a pipeline's prefetch
returns once the same query's recall is answered (by the pipeline that wrote the turns, and
by one started afterwards on the same file), each line names the stored message, session or
tool it shows, no other user's message ever appears, and the preview writes nothing."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from hermes_async_memory import InvalidTurnError, MemoryPipeline, Settings
from hermes_async_memory.recall import PrefetchPreview, preview_prefetch
from hermes_async_memory.store import SqliteStore

SCRIPT = "<script>alert(1)</script>"
WAIT_S = 10


def call(cid: str, name: str, **args: Any) -> dict[str, Any]:
    return {"id": cid, "type": "function",
            "function": {"name": name, "arguments": json.dumps(args)}}


def tool_turn(goal: str, calls: list[dict[str, Any]], answers: dict[str, Any], reply: str
              ) -> list[dict[str, Any]]:
    """A turn with tool calls: the goal, the assistant's calls, the answers, the reply."""
    msgs: list[dict[str, Any]] = [{"role": "user", "content": goal},
                                  {"role": "assistant", "content": "", "tool_calls": calls}]
    msgs += [{"role": "tool", "tool_call_id": cid, "content": json.dumps(content)}
             for cid, content in answers.items()]
    msgs.append({"role": "assistant", "content": reply})
    return msgs


# (user, session, user text, assistant text, messages or None), in the order they are sent.
TURNS: list[tuple[str | None, str, str, str, list[dict[str, Any]] | None]] = [
    ("ann", "a1", "where do locals eat in lisbon", "two streets north of the station", None),
    ("ann", "a1", "is the lisbon food market open on sunday", "yes, until two", None),
    ("ann", "a1", "", "", tool_turn(
        "read my lisbon food notes", [call("r1", "read_file", path="notes/lisbn.md")],
        {"r1": {"error": "FileNotFoundError: no such file: 'notes/lisbn.md'"}},
        "that file does not exist")),
    ("ann", "a1", "", "", tool_turn(
        "read my lisbon food notes", [call("r2", "read_file", path="notes/lisbon.md")],
        {"r2": {"content": "pastel de nata at the corner bakery"}}, "found your notes")),
    ("ann", "a1", "", "", tool_turn(
        "search lisbon trams", [call("w1", "web_search", query="lisbon tram 28")],
        {"w1": {"results": ["tram 28 runs every 12 minutes"]}}, "tram 28 is the scenic one")),
    ("ann", "a1", "", "", tool_turn(
        "read the lisbon itinerary", [call("r3", "read_file", path="trip/itinerary.md")],
        {"r3": {"error": "FileNotFoundError: no such file: 'trip/itinerary.md'"}},
        "no itinerary file yet")),
    ("ann", "a2", f"my notes say {SCRIPT} about lisbon pastries", "keep them safe", None),
    ("ann", "a2", "the best pastries in lisbon are by the river", "noted", None),
    ("ann", "a3", "packing list for porto", "shoes, umbrella", None),
    ("ann", "a3", "train from porto to lisbon", "three hours", None),
    ("bob", "b1", "my lisbon hotel code is bobsecret42", "stored", None),
    ("bob", "b1", "lisbon pastries are overrated", "bold claim", None),
    ("ann", "default", "ann asks about lisbon fado", "alfama at night", None),
    ("bob", "default", "bob asks about lisbon fado bobsecret42", "also alfama", None),
    ("ann", "default", "ann again on lisbon fado", "book ahead", None),
    (None, "anon", "an anonymous lisbon question", "anonymous answer", None),
]

# (user, session, query): searches over several sessions, hits the recent turns already
# show, a shared session id, no user, no searchable word, a blank query (nothing queued),
# a session with no stored turns, and one that finds nothing at all.
CASES: list[tuple[str | None, str, str]] = [
    ("ann", "a1", "lisbon food"),
    ("ann", "a2", "lisbon pastries script alert"),
    ("bob", "b1", "lisbon pastries bobsecret42"),
    ("ann", "default", "lisbon fado"),
    ("bob", "default", "fado"),
    (None, "anon", "lisbon question"),
    ("ann", "a1", "?!"),
    ("ann", "a3", ""),
    ("ann", "nosuch", "lisbon pastries"),
    ("carol", "empty", "lisbon"),
]


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(db_path=tmp_path / "memory.db", max_wait_ms=0.0)


async def write_turns(mem: MemoryPipeline) -> None:
    for user, session, user_text, assistant_text, messages in TURNS:
        if messages is not None:
            user_text, assistant_text = messages[0]["content"], messages[-1]["content"]
        mem.sync_turn(user_text, assistant_text, session_id=session, user_id=user,
                      messages=messages)
    await mem.flush()


async def live_block(mem: MemoryPipeline, user: str | None, session: str, query: str) -> str:
    """What the pipeline's prefetch returns once its recall of ``query`` is answered; a
    blank query queues nothing, and the session's stored turns are cached (a warm-up)."""
    if query.strip():
        mem.queue_prefetch(query, session_id=session, user_id=user)
        await mem.wait_until(
            lambda: mem.prefetch_status(session, user_id=user).recall_query == query,
            timeout=WAIT_S)
    else:
        mem.warm(session, user_id=user)
        await mem.wait_until(lambda: mem.prefetch_status(session, user_id=user).cached,
                             timeout=WAIT_S)
    return mem.prefetch(session_id=session, user_id=user)


async def previews(path: Path, settings: Settings) -> dict[tuple[str | None, str, str],
                                                           PrefetchPreview]:
    store = SqliteStore(path, readers=1)
    await store.open_readonly()
    try:
        return {case: await preview_prefetch(store, settings, user_id=case[0],
                                             session_id=case[1], query=case[2])
                for case in CASES}
    finally:
        await store.aclose()


def stored_messages(path: Path) -> dict[int, tuple[str, str | None, str, str]]:
    """message id -> (session, user, role, content), straight from the file."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        rows = conn.execute(
            "SELECT id, session_id, user_id, role, coalesce(content, '') FROM messages"
        ).fetchall()
    finally:
        conn.close()
    return {r[0]: (r[1], r[2], r[3], r[4]) for r in rows}


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        digest.update(p.read_bytes() if p.exists() else b"-")
    return digest.hexdigest()


def check_sources(preview: PrefetchPreview, case: tuple[str | None, str, str],
                  messages: dict[int, tuple[str, str | None, str, str]]) -> None:
    """Every line names where it came from, and only the case's user's messages appear."""
    user, session, query = case
    lines = preview.lines
    assert "\n".join(line.text for line in lines) == preview.block
    for line in lines:
        assert line.origin in ("heading", "recent", "search", "procedural", "blank")
        assert (line.text == "") == (line.origin == "blank"), line
        if line.message_id is not None:
            m_session, m_user, m_role, content = messages[line.message_id]
            assert m_user == user, (line, m_user)  # never another user's message
            assert (m_session, m_role) == (line.session_id, line.role), line
            assert line.timestamp is not None
        if line.origin == "recent":
            assert line.session_id == session and line.turn_key
            assert line.message_id is not None  # every turn here has both texts
            _, _, _, content = messages[line.message_id]
            assert line.text == f"- {line.role}: {content}"
        elif line.origin == "search":
            assert line.message_id is not None and line.rank is not None
            # The hit's message, whole (these are short), and beside it only messages of
            # the same session of the same user, each as "role: text".
            _, _, text = line.text.partition("] ")
            flat = " ".join(messages[line.message_id][3].split())
            assert flat and flat in text, (text, flat)
            m_session, m_user, _, _ = messages[line.message_id]
            theirs = {f"{role}: {' '.join(c.split())}" for s, u, role, c in messages.values()
                      if (s, u) == (m_session, m_user)}
            parts = text.split(" | ")
            if len(parts) > 1:
                assert all(part in theirs for part in parts), (parts, theirs)
        elif line.origin == "procedural":
            assert line.tool in (None, "read_file", "web_search")
    ranks = [line.rank for line in lines if line.origin == "search"]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)
    if not query.strip():
        assert {line.origin for line in lines} <= {"heading", "recent"}


async def test_the_preview_is_what_prefetch_returns_with_each_lines_source(
    settings: Settings,
) -> None:
    path = settings.db_path
    async with MemoryPipeline(settings) as mem:
        await write_turns(mem)
        # Beside the running pipeline: its own cache filled by its commits.
        beside = await previews(path, settings)
        for case, preview in beside.items():
            assert preview.block == await live_block(mem, *case), case
    messages = stored_messages(path)

    # Read-only, with no pipeline: the same blocks, and the file is left as it was.
    before = file_digest(path)
    alone = await previews(path, settings)
    assert file_digest(path) == before
    assert alone == beside

    # A pipeline started on the file: its cache filled by warm-ups.
    async with MemoryPipeline(settings) as mem:
        for case, preview in alone.items():
            assert preview.block == await live_block(mem, *case), case
            check_sources(preview, case, messages)

    a1 = alone["ann", "a1", "lisbon food"]
    origins = [line.origin for line in a1.lines]
    assert origins[:2] == ["heading", "recent"] and "search" in origins
    assert "procedural" in origins and a1.terms == ("lisbon", "food")
    # The last turn's failed read_file leads the procedural block with guidance for it.
    guidance = next(line for line in a1.lines if line.text.startswith("<procedural_guidance"))
    assert guidance.tool == "read_file"
    section = next(line for line in a1.lines if line.text == '<tool name="web_search">')
    assert section.tool == "web_search"
    # Each hit shows with the messages beside it in its session; the second best says the
    # same words as the best (the same request, made twice): one line shows them.
    hits = [line for line in a1.lines if line.origin == "search"]
    assert [hit.rank for hit in hits] == [1, 3]
    assert hits[0].text.endswith("assistant: yes, until two | user: read my lisbon food notes")
    assert "user: is the lisbon food market open on sunday" in hits[1].text

    # The script tag is text: shown as stored, by lines that name its message.
    [recent] = [line for line in alone["ann", "a2", "lisbon pastries script alert"].lines
                if SCRIPT in line.text]
    assert (recent.origin, recent.role, recent.session_id) == ("recent", "user", "a2")
    fresh = alone["ann", "nosuch", "lisbon pastries"]
    [found] = [line for line in fresh.lines if SCRIPT in line.text]
    assert found.origin == "search" and found.message_id == recent.message_id

    # Users sharing a session id, and sessions without a user, see only their own.
    for case, preview in alone.items():
        if case[0] != "bob":
            assert "bobsecret42" not in preview.block
    assert "bobsecret42" in alone["bob", "default", "fado"].block
    assert "ann asks" not in alone["bob", "default", "fado"].block
    assert "anonymous" not in alone["ann", "default", "lisbon fado"].block

    # No searchable word: the recall is the procedural block alone, after the recent turns.
    nothing = alone["ann", "a1", "?!"]
    assert nothing.terms == () and "search" not in {line.origin for line in nothing.lines}
    assert "procedural" in {line.origin for line in nothing.lines}

    # A blank query: the recent turns alone.
    blank = alone["ann", "a3", ""]
    assert blank.block.startswith("Recent turns in this session:\n- user: packing list")
    assert [line.origin for line in blank.lines].count("recent") == 4

    # No stored turns: hits from the user's other sessions only; nothing at all: "".
    assert fresh.lines[0].text == "Related memory:" and fresh.lines[0].origin == "heading"
    assert "recent" not in {line.origin for line in fresh.lines}
    assert {line.session_id for line in fresh.lines if line.origin == "search"} == {"a1", "a2"}
    assert alone["carol", "empty", "lisbon"] == PrefetchPreview("", (), ("lisbon",))


async def test_the_recent_turns_are_the_last_few_clipped_as_the_cache_keeps_them(
    settings: Settings,
) -> None:
    settings = settings.replace(recent_turns=2, recent_chars=20)
    async with MemoryPipeline(settings) as mem:
        for i in range(5):
            mem.sync_turn(f"question {i} " + "about the long tail " * 3, f"answer {i}",
                          session_id="s", user_id="u")
        await mem.flush()
        store = SqliteStore(settings.db_path, readers=1)
        await store.open_readonly()
        try:
            preview = await preview_prefetch(store, settings, user_id="u", session_id="s",
                                             query="tail")
        finally:
            await store.aclose()
        assert preview.block == await live_block(mem, "u", "s", "tail")
    recent = [line.text for line in preview.lines if line.origin == "recent"]
    assert recent == ["- user: question 3 about th…", "- assistant: answer 3",
                      "- user: question 4 about th…", "- assistant: answer 4"]


async def test_ids_the_pipeline_refuses_are_refused(settings: Settings) -> None:
    async with MemoryPipeline(settings):
        pass
    store = SqliteStore(settings.db_path, readers=1)
    await store.open_readonly()
    try:
        for user, session in (("u", ""), ("", "s"), ("u", "a\x00b")):
            with pytest.raises(InvalidTurnError):
                await preview_prefetch(store, settings, user_id=user, session_id=session,
                                       query="q")
    finally:
        await store.aclose()


def test_lines_that_do_not_make_up_the_block_are_refused() -> None:
    from hermes_async_memory.recall import PreviewLine

    with pytest.raises(ValueError, match="do not make up"):
        PrefetchPreview("a\nb", (PreviewLine("a", "heading"),))
