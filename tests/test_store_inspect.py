"""The read-only store reader the admin CLI uses: it never changes the file, and a snapshot
holds however long a read takes."""

from __future__ import annotations

from pathlib import Path

import pytest

from hermes_async_memory.errors import StoreError
from hermes_async_memory.store import SqliteStore
from hermes_async_memory.store.inspect import StoreReader
from hermes_async_memory.turns import Turn


def _turn(key: str, session: str) -> Turn:
    return Turn.build(key=key, session_id=session, user_id="u", accepted_at=1_700_000_000.0,
                      messages=[("user", f"hello from {key}", None, None, None),
                                ("assistant", "hi", None, None, None)], metadata=None)


async def test_an_export_snapshot_does_not_see_a_commit_made_while_it_reads(
        tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "m.db")
    await store.open()
    try:
        await store.commit([_turn(f"k{i}", f"s{i}") for i in range(3)])
        with StoreReader(store.path) as reader, reader.snapshot():
            total = reader.count_sessions()
            sessions = reader.iter_sessions()
            first, messages = next(sessions)
            # A worker commits meanwhile: a new session, and one more turn in s2.
            await store.commit([_turn("late-1", "s-late"), _turn("late-2", "s2")])
            rest = list(sessions)
        exported = [first, *(s for s, _ in rest)]
        assert total == 3
        assert [s["id"] for s in exported] == ["s0", "s1", "s2"]
        assert [m["turn_key"] for m in rest[-1][1]] == ["k2", "k2"]  # not late-2
        assert [m["content"] for m in messages] == ["hello from k0", "hi"]
        with StoreReader(store.path) as reader:  # a new read sees the commit
            assert reader.count_sessions() == 4
            assert [m["turn_key"] for m in reader.messages("s2")] == ["k2"] * 2 + ["late-2"] * 2
    finally:
        await store.aclose()


def test_a_file_that_is_not_a_store_is_refused_and_left_as_it_was(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    with pytest.raises(StoreError, match="no memory store"):
        StoreReader(missing)
    assert not missing.exists()
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    with pytest.raises(StoreError, match="is not a hermes-memory store"):
        StoreReader(empty)
    assert empty.read_bytes() == b""
