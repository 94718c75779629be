"""The writer under data that makes SQLite fail: the batch is bisected down to the one record,
which is dead-lettered with its reason, and every other record commits, before and after a
restart. Input that can never be stored is refused before it is acknowledged."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest

from hermes_async_memory import InvalidTurnError, MemoryPipeline, PipelineObserver, Settings
from hermes_async_memory.message_rows import turn_messages
from hermes_async_memory.outbox import Outbox
from hermes_async_memory.turns import encode_payload

from .helpers import count_rows, stored_turns

SESSIONS = 5
TURNS = 200


def _leave_in_outbox(target: Settings | Path, records: list[bytes]) -> None:
    """Append records to an outbox (the settings' own, or a folder) as an earlier run would
    have left them: accepted before this version checked its input, never committed."""
    directory = target.outbox_dir if isinstance(target, Settings) else target
    outbox = Outbox(directory, segment_bytes=16 * 1024 * 1024,
                    max_pending_turns=10**6, max_pending_bytes=2**40, overflow="defer")
    outbox.open()
    try:
        for record in records:
            outbox.append(record, 2)
    finally:
        outbox.close()


def _turn(i: int, metadata: dict[str, object] | None = None) -> bytes:
    rows = turn_messages(f"turn {i}", f"reply {i}", None)
    return encode_payload(f"k-{i}", f"s{i % SESSIONS}", "ada", time.time(), rows,
                          metadata).encode("ascii")


async def test_turns_whose_token_sum_overflows_all_commit_without_a_retry(
    tmp_path: Path,
) -> None:
    """Invariant: every record is stored once, in session order, with no retry.

    Two neighbouring turns of one session carry 2**62 input tokens each (records an earlier
    run accepted): their sum overflows a 64-bit integer. Summed by SQLite ("integer
    overflow", SQLITE_ERROR) and treated as a busy store, that batch was retried for ever and
    every session stalled, restart or not. Now the batch sums its sessions' counters itself
    and SQLite keeps the total as a real; were SQLite to refuse it, the batch would be bisected.
    """
    settings = Settings(db_path=tmp_path / "m.db")
    big = {"input_tokens": 2**62}
    records = [_turn(i, big if i in (100, 105) else None) for i in range(TURNS)]
    _leave_in_outbox(settings, records)
    async with MemoryPipeline(settings) as mem:
        with anyio.fail_after(20):
            await mem.flush()
        stats = mem.stats()
        assert stats.committed_turns == TURNS
        assert stats.dead_letters == 0 and stats.commit_retries == 0
        session = await mem.store.get_session("s0")
        assert session is not None and session["input_tokens"] == 2.0**63
    stored = stored_turns(settings.db_path)
    for s in range(SESSIONS):
        users = [c for _, role, c in stored[f"s{s}"] if role == "user"]
        assert users == [f"turn {i}" for i in range(TURNS) if i % SESSIONS == s]


async def test_a_record_sqlite_refuses_is_dead_lettered_alone_and_the_rest_commit(
    tmp_path: Path,
) -> None:
    """Invariant: every other record is stored once, in session order; the one SQLite
    refuses (NaN in its metadata: Python reads it, SQLite's JSON calls it malformed) is a
    dead letter with the reason, found by bisecting its batch, before and after a restart."""
    settings = Settings(db_path=tmp_path / "m.db")
    bad = _turn(150).decode().replace('"d":null', '"d":{"score":NaN}').encode()
    _leave_in_outbox(settings, [_turn(i) if i != 150 else bad for i in range(TURNS)])
    async with MemoryPipeline(settings) as mem:
        with anyio.fail_after(20):
            await mem.flush()
        stats = mem.stats()
        assert stats.dead_letters == 1 and stats.commit_retries == 0
        dead = await mem.store.dead_letters()
        assert [d.key for d in dead] == ["k-150"]
        assert "malformed JSON" in dead[0].last_error
    stored = stored_turns(settings.db_path)
    for s in range(SESSIONS):
        users = [c for _, role, c in stored[f"s{s}"] if role == "user"]
        assert users == [f"turn {i}" for i in range(TURNS) if i % SESSIONS == s and i != 150]
    # Settled for good: the next start does not try it again.
    async with MemoryPipeline(settings) as again:
        await again.flush()
        assert again.stats().committed_turns == 0 and again.stats().dead_letters == 0


async def test_an_earlier_records_metadata_object_keeps_its_big_integers_exact(
    tmp_path: Path,
) -> None:
    """A record of an earlier version holds its metadata as an object, not as JSON text.
    The fast reader (orjson) would read an integer past 64 bits as a float, which no token
    counter takes: such a record is read the exact way, and its session counts its tokens
    as the integer they are."""
    settings = Settings(db_path=tmp_path / "m.db")
    big = 2**64 + 1
    old = _turn(0).decode().replace('"d":null', f'"d":{{"input_tokens":{big},"n":[{-big}]}}')
    _leave_in_outbox(settings, [old.encode()])
    async with MemoryPipeline(settings) as mem:
        with anyio.fail_after(20):
            await mem.flush()
        assert mem.stats().committed_turns == 1 and mem.stats().dead_letters == 0
        rows = await mem.get_messages("s0")
        assert rows[0]["metadata"] == {"input_tokens": big, "n": [-big]}
        session = await mem.store.get_session("s0")
        assert session is not None and session["input_tokens"] == float(big)  # as SQLite sums


async def test_a_record_nested_too_deep_to_read_is_dead_lettered_at_start(
    tmp_path: Path,
) -> None:
    """Before: json.loads raised RecursionError out of start(). Now the record is a dead
    letter with its reason, its bytes kept, and the records around it commit."""
    settings = Settings(db_path=tmp_path / "m.db")
    deep = _turn(7).decode().replace('"d":null', '"d":' + "[" * 5000 + "]" * 5000)
    records = [_turn(i) if i != 7 else deep.encode() for i in range(20)]
    _leave_in_outbox(settings, records)
    async with MemoryPipeline(settings) as mem:
        with anyio.fail_after(20):
            await mem.flush()
        dead = await mem.store.dead_letters()
        assert [d.key for d in dead] == ["k-7"]
        assert "RecursionError" in dead[0].last_error
    assert count_rows(settings.db_path, "SELECT count(*) FROM messages") == 19 * 2
    payload = count_rows(settings.db_path,
                         "SELECT length(payload) FROM outbox WHERE status = 'dead'")
    assert payload == len(deep)


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(("metadata", "messages", "why"), [
    ({"input_tokens": 2**62}, None, "input_tokens"),
    ({"output_tokens": -1}, None, "output_tokens"),
    ({"input_tokens": "12"}, None, "input_tokens"),
    ({"a": _nested(40)}, None, "deeper"),
    ({"a": _nested(5000)}, None, "deeper"),
    ({"when": {1, 2}}, None, "not JSON-serialisable"),
    ({"x": float("nan")}, None, "not JSON-serialisable"),
    (None, [{"role": "user", "content": "q"},
            {"role": "assistant", "content": "", "tool_calls": [{"a": _nested(40)}]}],
     "deeper"),
])
async def test_input_that_can_never_be_stored_is_refused_before_it_is_acknowledged(
    mem: MemoryPipeline, metadata: dict[str, object] | None,
    messages: list[dict[str, object]] | None, why: str,
) -> None:
    with pytest.raises(InvalidTurnError, match=why):
        mem.sync_turn("q", "a", session_id="s", user_id="u", metadata=metadata,
                      messages=messages)
    assert mem.stats().accepted_turns == 0
    mem.sync_turn("q", "a", session_id="s", user_id="u", metadata={"input_tokens": 12})
    await mem.flush()
    assert [m["content"] for m in await mem.get_messages("s")] == ["q", "a"]


async def test_batches_are_bounded_by_bytes_as_well_as_turns(tmp_path: Path) -> None:
    """One batch never holds more than max_batch_bytes of turns (but at least one turn)."""
    sizes: list[int] = []

    class Sizes(PipelineObserver):
        def batch_committed(self, turns: int, rows: int, seconds: float) -> None:
            sizes.append(turns)

    settings = Settings(db_path=tmp_path / "m.db", max_batch_bytes=64 * 1024, max_wait_ms=50)
    text = "x" * 2000
    async with MemoryPipeline(settings, observer=Sizes()) as mem:
        mem.sync_turn("y" * 200_000, "a turn larger than a batch", session_id="big")
        for i in range(1000):
            mem.sync_turn(f"{i} {text}", "r", session_id=f"s{i % 10}")
        await mem.flush()
    assert sum(sizes) == 1001
    # Each turn's record is over 2,000 bytes: at most 32 fit in 64 KiB.
    assert max(sizes) <= 32 and len(sizes) >= 1001 // 32
