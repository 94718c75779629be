"""The prefetch cache: never misses an entry it holds, even while commits reorder it from
other threads' point of view; keyed by (user, session), so two users who send the same
session id never see each other's memory; ids that no store can hold are refused, typed."""

from __future__ import annotations

import sys
import threading

import anyio
import anyio.lowlevel
import pytest

from hermes_async_memory import InvalidTurnError, MemoryPipeline, Settings
from hermes_async_memory.recall.cache import RecallCache
from hermes_async_memory.turns import Turn

READERS = 2
COMMITS = 30_000


async def test_threads_reading_a_cached_session_never_get_an_empty_block(
    settings: Settings,
) -> None:
    """Invariant: every prefetch of a session whose block is cached returns that block.

    Before, each commit's LRU touch popped the entry and put it back, and a reader on
    another thread in between got "": about 7.5 % of calls.
    """
    async with MemoryPipeline(settings.replace(max_wait_ms=0.0)) as mem:
        mem.sync_turn("the hot session", "warm", session_id="hot", user_id="u")
        await mem.flush()
        assert mem.prefetch(session_id="hot", user_id="u")
        stop = threading.Event()
        empties = [0] * READERS
        reads = [0] * READERS

        def read(n: int) -> None:
            while not stop.is_set():
                if not mem.prefetch(session_id="hot", user_id="u"):
                    empties[n] += 1
                reads[n] += 1

        threads = [threading.Thread(target=read, args=(n,)) for n in range(READERS)]
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # hand the GIL over as often as possible: races show
        for t in threads:
            t.start()
        try:
            for i in range(20_000):  # each commit of "hot" moves its entry in the LRU order
                mem.sync_turn(f"turn {i}", "r", session_id="hot", user_id="u")
                mem.sync_turn(f"turn {i}", "r", session_id=f"cold{i % 50}", user_id="u")
                if i % 2000 == 1999:  # a commit's bookkeeping: 2,000 touches in a row
                    await mem.flush()
            await mem.flush()
        finally:
            stop.set()
            for t in threads:
                t.join()
            sys.setswitchinterval(interval)
        assert sum(reads) > 10_000  # before: empty reads in 5 of 6 runs of this test
        assert sum(empties) == 0, f"{sum(empties)} of {sum(reads)} reads came back empty"


async def test_two_users_with_the_same_session_id_never_see_each_others_memory(
    mem: MemoryPipeline,
) -> None:
    mem.sync_turn("my locker code is 4711", "noted", session_id="default", user_id="ann")
    mem.sync_turn("I like jazz", "noted", session_id="default", user_id="bob")
    await mem.flush()
    ann = mem.prefetch(session_id="default", user_id="ann")
    bob = mem.prefetch(session_id="default", user_id="bob")
    assert "4711" in ann and "jazz" not in ann
    assert "jazz" in bob and "4711" not in bob
    mem.queue_prefetch("what is my locker code", session_id="default", user_id="bob")
    await mem.wait_until(
        lambda: mem.prefetch_status("default", user_id="bob").recall_query is not None,
        timeout=10)
    assert "4711" not in mem.prefetch(session_id="default", user_id="bob")
    assert mem.prefetch_status("default", user_id="ann").recall_query is None
    assert mem.prefetch_status("default", user_id="ann").turns_committed == 1


@pytest.mark.parametrize("bad", ["\ud800", "s\udfff", "", "x" * 600, "a\x00b"])
async def test_every_public_call_refuses_an_id_no_store_can_hold(
    mem: MemoryPipeline, bad: str,
) -> None:
    calls = [
        lambda: mem.sync_turn("q", "a", session_id=bad),
        lambda: mem.sync_turn("q", "a", session_id="s", user_id=bad),
        lambda: mem.queue_prefetch("q", session_id=bad),
        lambda: mem.queue_prefetch("q", session_id="s", user_id=bad),
        lambda: mem.warm(bad),
        lambda: mem.prefetch(session_id=bad),
        lambda: mem.prefetch(session_id="s", user_id=bad),
        lambda: mem.prefetch_status(bad),
    ]
    for call in calls:
        with pytest.raises(InvalidTurnError):
            call()
    with pytest.raises(InvalidTurnError):
        await mem.get_messages(bad)
    with pytest.raises(InvalidTurnError):
        await mem.search("q", user_id=bad)
    with pytest.raises(InvalidTurnError):
        await mem.flush(session_id=bad)
    await anyio.lowlevel.checkpoint()
    assert mem.stats().accepted_turns == 0


def test_a_read_from_before_a_delete_does_not_put_the_session_back() -> None:
    """A warm-up or recall that read the store before a session was deleted lands after the
    delete: what it read must not come back (nor a block of the user's other session)."""
    from hermes_async_memory.recall.cache import RecallCache

    cache = RecallCache(max_sessions=10, recent_turns=4, recent_chars=200)
    cache.set_recall("ann", "other", "q", "Related memory:\n- old words")
    cache.set_recall("ann", "s1", "q", "Related memory:\n- s1 words")
    assert "old words" in warm_read(cache, "ann", "other")  # read, so kept rendered
    assert "s1 words" in warm_read(cache, "ann", "s1")
    epoch = cache.epoch()  # a reader starts here
    cache.forget_session("s1", "ann")
    assert warm_read(cache, "ann", "s1") == ""
    assert "old words" not in warm_read(cache, "ann", "other")  # the user's blocks went too
    assert not cache.warm("ann", "s1", [("k1", "deleted words", "ok")], 0.0, epoch=epoch)
    cache.set_recall("ann", "other", "q", "Related memory:\n- deleted words", epoch=epoch)
    assert ("ann", "s1") not in cache
    assert "deleted words" not in warm_read(cache, "ann", "other")
    # A reader that started after the delete is served as usual.
    assert cache.warm("ann", "s1", [("k2", "new words", "ok")], 0.0, epoch=cache.epoch())
    assert "new words" in warm_read(cache, "ann", "s1")
    cache.set_recall("bob", "b1", "q", "Related memory:\n- bob's", epoch=epoch)  # not deleted
    assert "bob's" in warm_read(cache, "bob", "b1")


def test_a_procedural_block_after_hits_all_shown_leaves_no_empty_heading() -> None:
    """The recall block is the hits, then (after a blank line) the procedural block: hits the
    recent turns already show are left out, and their heading with them; the procedural
    block stays whole, even a line of it that looks like a hit."""
    from hermes_async_memory.recall.cache import RECALL_HEADER, RecallCache

    cache = RecallCache(max_sessions=10, recent_turns=4, recent_chars=200)
    cache.warm("ann", "s1", [("k1", "where is the config", "in conf/app.toml")], 0.0)
    procedural = ("<procedural_memory>\n  ✓ #2 [read_file] where is the config\n"
                  "</procedural_memory>")
    cache.set_recall("ann", "s1", "q",
                     f"{RECALL_HEADER}\n- [s1 user] where is the config\n\n{procedural}")
    block = cache.get("ann", "s1")
    assert RECALL_HEADER not in block
    assert block.endswith(procedural)
    cache.set_recall("ann", "s1", "q", f"{RECALL_HEADER}\n- [s9 user] other words\n\n"
                                       f"{procedural}")
    assert f"{RECALL_HEADER}\n- [s9 user] other words\n\n{procedural}" in cache.get("ann", "s1")


def test_a_read_that_starts_after_a_change_shows_it_while_readers_race_the_writer() -> None:
    """Invariant: a prefetch that starts after a commit landed in the cache shows that
    commit (or a later one), on every read: a block rendered before the change and kept by
    a reader on another thread is never served after it. Checked on each read of two reader
    threads, and by the writer after each of its 30,000 commits, the GIL handed over as
    often as it can be; the readers render, and keep, the block after most commits."""
    cache = RecallCache(max_sessions=10, recent_turns=1, recent_chars=200)
    landed = [-1]  # the last commit whose note_commits returned
    stop = threading.Event()
    behind: list[tuple[int, int]] = []
    reads = [0] * READERS

    def read(n: int) -> None:
        while not stop.is_set():
            floor = landed[0]
            text = warm_read(cache, "u", "s")
            reads[n] += 1
            if floor < 0:
                continue
            shown = int(text.split("- user: turn ", 1)[1].split("\n", 1)[0])
            if shown < floor:
                behind.append((shown, floor))

    threads = [threading.Thread(target=read, args=(n,)) for n in range(READERS)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    for t in threads:
        t.start()
    try:
        for i in range(COMMITS):
            cache.note_commits([_turn(i)], 0.0)
            landed[0] = i
            # the writer's own read
            if f"- user: turn {i}\n" not in warm_read(cache, "u", "s") + "\n":
                behind.append((-1, i))
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(interval)
    assert sum(reads) > 10_000
    assert not behind, f"{len(behind)} reads showed an older commit, e.g. {behind[:3]}"
    assert f"turn {COMMITS - 1}" in warm_read(cache, "u", "s")


def warm_read(cache: RecallCache, user: str | None, session: str) -> str:
    """A session's block as ``MemoryPipeline.prefetch`` reads it: the kept block in
    ``fresh``, else ``get`` (which renders and keeps it)."""
    return cache.fresh.get((user, session)) or cache.get(user, session)


def _turn(i: int) -> Turn:
    """Commit ``i`` of session "s" of user "u", as the writer hands it to the cache."""
    return Turn(key=f"k{i}", seq=i, session_id="s", user_id="u", accepted_at=0.0,
                payload="{}", nbytes=2, segment=0, n_messages=2, tool_calls=0,
                user_text=f"turn {i}", assistant_text="ok", source=None, model=None,
                parent_session_id=None, input_tokens=0, output_tokens=0, has_nul=False)


def test_a_block_rendered_while_a_commit_lands_is_not_kept_past_it() -> None:
    """The interleaving the race above hits at random, made to happen: commit 1 lands while
    a reader renders the block of commit 0. That read may show commit 0 (it started
    first), but no later read may."""
    cache = RecallCache(max_sessions=10, recent_turns=1, recent_chars=200)
    cache.note_commits([_turn(0)], 0.0)
    render = cache._render

    def render_while_a_commit_lands(entry: object) -> str:
        text = render(entry)  # type: ignore[arg-type]
        cache.note_commits([_turn(1)], 0.0)
        return text

    cache._render = render_while_a_commit_lands  # type: ignore[method-assign]
    assert "turn 0" in warm_read(cache, "u", "s")
    cache._render = render  # type: ignore[method-assign]
    assert "turn 1" in warm_read(cache, "u", "s")
    assert "turn 1" in warm_read(cache, "u", "s")  # and when read again


def test_a_commit_landing_as_a_reader_keeps_its_block_waits_for_it() -> None:
    """A commit that lands just as a reader on another thread keeps the block it rendered
    (its version checked, the block not yet kept) waits for the reader, then drops that
    block: the next read shows the commit. Without the lock the commit would land in that
    gap and the reader keep a block older than it."""
    cache = RecallCache(max_sessions=10, recent_turns=1, recent_chars=200)
    cache.note_commits([_turn(0)], 0.0)
    landed = threading.Event()
    writer = threading.Thread(target=lambda: (cache.note_commits([_turn(1)], 0.0),
                                              landed.set()))

    class KeepingHook(dict):  # type: ignore[type-arg]
        def __setitem__(self, key: object, value: object) -> None:
            if not writer.is_alive() and not landed.is_set():  # the first keep only
                writer.start()
                # The commit gets the whole window to land; with the lock it cannot, so
                # this wait runs out (it is the observation window, not a hand-over).
                assert not landed.wait(0.2), "the commit landed while the reader kept"
            super().__setitem__(key, value)

    cache.fresh = KeepingHook()
    assert "turn 0" in warm_read(cache, "u", "s")
    writer.join(timeout=10)
    assert landed.is_set()
    assert "turn 1" in warm_read(cache, "u", "s")
