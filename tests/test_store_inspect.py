"""The read-only readers of a store file the admin CLI uses: they never change the file, and
a snapshot holds however long a read takes."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from hermes_async_memory.errors import PipelineClosedError, StoreError
from hermes_async_memory.sessions.reads import open_session_reads
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
        async with open_session_reads(store.path) as reads:
            lines = reads.export()
            first = json.loads(await anext(lines))
            # A worker commits meanwhile: a new session, and one more turn in s2.
            await store.commit([_turn("late-1", "s-late"), _turn("late-2", "s2")])
            rest = [json.loads(line) async for line in lines]
            exported = [first, *rest]
            assert [s["id"] for s in exported] == ["s0", "s1", "s2"]
            assert [m["turn_key"] for m in rest[-1]["messages"]] == ["k2", "k2"]  # not late-2
            assert [m["content"] for m in first["messages"]] == ["hello from k0", "hi"]
            # A new read sees the commit.
            assert (await reads.counts()).sessions == 4
            assert [m["turn_key"] for m in await reads.messages("s2")] == (
                ["k2"] * 2 + ["late-2"] * 2)
    finally:
        await store.aclose()


async def test_the_file_reads_never_write_and_refuse_what_they_cannot_read(
        tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    with pytest.raises(StoreError, match="no memory store"):
        async with open_session_reads(missing):
            pass
    assert not missing.exists()
    other = tmp_path / "other.db"
    sqlite3.connect(other).execute("CREATE TABLE t (x)").connection.close()
    before = other.read_bytes()
    with pytest.raises(StoreError, match="is not a hermes-memory store"):
        async with open_session_reads(other):
            pass
    assert other.read_bytes() == before
    # An older store is read only once the pipeline has brought it up to date.
    store = SqliteStore(tmp_path / "old.db")
    await store.open()
    await store.aclose()
    conn = sqlite3.connect(store.path)
    conn.execute("UPDATE schema_version SET version = 3")
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match=r"schema version 3.*bring it up to date"):
        async with open_session_reads(store.path):
            pass
    # Reads of a closed file say so.
    store = SqliteStore(tmp_path / "m.db")
    await store.open()
    await store.aclose()
    async with open_session_reads(store.path) as reads:
        assert await reads.list_sessions() == []
    with pytest.raises(PipelineClosedError):
        await reads.list_sessions()


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
