"""Acknowledged outbox records destroyed by a segment cut short (truncated mid-record, or to
zero bytes) are counted at the next start: in stats(), an error-level log line, a /metrics
gauge, and a health condition that `hermes-memory status` shows and that stays, across
starts, until `hermes-memory outbox clear-destroyed` clears it. The loss cannot be undone;
its silence can.

Invariant checked on every acknowledged turn: it is either stored once, or it was in the
destroyed part of the segment; the count reported equals the destroyed part exactly."""

from __future__ import annotations

import asyncio
import json
import mmap
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.outbox import records
from hermes_async_memory.worker.http import start_http_server

from .helpers import stored_turns
from .processes import EXIT_TIMEOUT_S, ROOT, child_env
from .test_worker_http import metrics

SEGMENT_BYTES = 64 * 1024  # the smallest allowed: a few hundred turns per segment
ACKS = 1500

# Accepts turns for ever and prints each receipt once sync_turn returned (an acknowledged,
# durable turn); its store never commits (the first batch's transaction stays open), so
# every acknowledged turn is still in the outbox when the test SIGKILLs it.
CHILD = textwrap.dedent("""
    import asyncio, sys
    from pathlib import Path
    from hermes_async_memory import MemoryPipeline, Settings
    from hermes_async_memory.store import SqliteStore

    class NeverCommits(SqliteStore):
        async def _commit_transaction(self):
            await asyncio.Event().wait()

    async def main(db):
        settings = Settings(db_path=db, outbox_segment_bytes=SEGMENT_BYTES,
                            max_queued_turns=100_000)
        async with MemoryPipeline(settings, store=NeverCommits(db)) as mem:
            i = 0
            while True:
                r = mem.sync_turn(f"question {i}", f"answer {i}", session_id=f"s{i % 7}",
                                  user_id="u")
                sys.stdout.write(f"ACK {r.key}\\n")
                sys.stdout.flush()
                i += 1
                if i % 50 == 0:
                    await asyncio.sleep(0)

    asyncio.run(main(Path(sys.argv[1])))
""").replace("SEGMENT_BYTES,", str(SEGMENT_BYTES) + ",")


def acknowledge_then_kill(db: Path) -> list[str]:
    """The child's acknowledged keys, in order, once it was SIGKILLed after ``ACKS``."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(db)], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True, env=child_env(), cwd=ROOT)
    assert proc.stdout is not None
    acked: list[str] = []
    try:
        for line in proc.stdout:
            if line.startswith("ACK "):
                acked.append(line.split()[1])
                if len(acked) == ACKS:
                    proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=EXIT_TIMEOUT_S)
    assert proc.returncode == -signal.SIGKILL
    assert len(acked) >= ACKS
    return acked


def in_flight(acked: list[str]) -> str:
    """The key of the turn after the last acknowledged one: the kill can land after its record
    was written and before its receipt was printed (accepted, durable, not acknowledged)."""
    prefix, counter = acked[-1].rsplit("-", 1)
    return f"{prefix}-{int(counter, 16) + 1:x}"


def segment_records(path: Path) -> list[tuple[int, int, str]]:
    """(offset, length, key) of every record of a segment, in order."""
    out = []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        off, end = 0, len(mm)
        while (size := records.valid_at(mm, off, end)) >= 0:
            payload = mm[off + records.HEADER_BYTES : off + records.HEADER_BYTES + size]
            out.append((off, size, json.loads(payload)["k"]))
            off += records.HEADER_BYTES + size
    return out


def cli(db: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hermes_async_memory.cli", *args, "--db",
                           str(db)], capture_output=True, text=True, env=child_env(),
                          cwd=ROOT, timeout=EXIT_TIMEOUT_S)


def status_destroyed(db: Path) -> int:
    done = cli(db, "status", "--json")
    assert done.returncode == 0, done.stderr
    return int(json.loads(done.stdout)["outbox_destroyed_turns"])


@pytest.mark.parametrize("cut", ["mid-record", "zero bytes"])
async def test_a_segment_cut_short_reports_exactly_the_acknowledged_turns_it_destroyed(
    tmp_path: Path, cut: str
) -> None:
    db = tmp_path / "m.db"
    acked = acknowledge_then_kill(db)
    settings = Settings(db_path=db, outbox_segment_bytes=SEGMENT_BYTES)
    segments = sorted(settings.outbox_dir.glob("*.seg"))
    assert len(segments) >= 4, segments
    victim = segments[1]
    held = segment_records(victim)
    # A segment in the middle: every record in it was acknowledged, and so were records
    # written after it (what tells how many it held).
    assert {k for _, _, k in held} <= set(acked)
    assert any(k in set(acked) for _, _, k in segment_records(segments[2]))
    if cut == "mid-record":
        first_lost = len(held) // 2
        off, _, _ = held[first_lost]
        os.truncate(victim, off + records.HEADER_BYTES + 5)  # inside the record's payload
    else:
        first_lost = 0
        os.truncate(victim, 0)
    destroyed = {k for _, _, k in held[first_lost:]}
    assert len(destroyed) > 50

    with capture_logs() as logs:
        async with MemoryPipeline(settings) as mem:
            await mem.flush()
            reported = mem.stats().destroyed_turns
            health = mem.health()
            assert "outbox_records_destroyed" in health.conditions
            assert str(reported) in health.conditions["outbox_records_destroyed"]
            server = start_http_server(mem, asyncio.get_running_loop(), port=0)
            try:
                values = await metrics(server.url)
            finally:
                await server.aclose()
            assert values["hermes_memory_outbox_destroyed_turns"] == reported
    errors = [e for e in logs if e["event"] == "outbox_records_destroyed"]
    assert len(errors) == 1 and errors[0]["log_level"] == "error"
    assert errors[0]["turns"] == reported

    # Every acknowledged turn is stored once, but for those the cut destroyed, and the count
    # reported is exactly what was lost. Nothing else is stored but the one turn the kill
    # may have caught between its record and its receipt (accepted, never acknowledged).
    stored = [key for turns in stored_turns(db).values() for key, role, _ in turns
              if role == "user"]
    assert len(stored) == len(set(stored))
    assert set(acked) - destroyed <= set(stored)
    assert set(stored) - set(acked) <= {in_flight(acked)}
    lost = set(acked) - set(stored)
    assert lost == destroyed
    assert reported == len(lost)

    # The condition stays across starts (the cut segment itself is gone by now) ...
    assert status_destroyed(db) == reported
    plain = cli(db, "status")
    assert f"{reported} acknowledged turns were destroyed" in plain.stdout
    async with MemoryPipeline(settings) as mem:
        assert mem.stats().destroyed_turns == reported
        assert "outbox_records_destroyed" in mem.health().conditions
        # ... until an operator clears it: at once, in a pipeline running on the store too.
        cleared = cli(db, "outbox", "clear-destroyed", "--json")
        assert cleared.returncode == 0, cleared.stderr
        assert json.loads(cleared.stdout)["destroyed_turns"] == reported
        assert "outbox_records_destroyed" not in mem.health().conditions
        assert mem.stats().destroyed_turns == 0
    assert status_destroyed(db) == 0
    assert "destroyed" not in cli(db, "status").stdout
    async with MemoryPipeline(settings) as mem:
        assert mem.stats().destroyed_turns == 0
        assert "outbox_records_destroyed" not in mem.health().conditions


async def test_an_intact_outbox_after_sigkill_reports_nothing_destroyed(tmp_path: Path) -> None:
    """The count has no false alarm: a kill alone destroys nothing."""
    db = tmp_path / "m.db"
    acked = acknowledge_then_kill(db)
    settings = Settings(db_path=db, outbox_segment_bytes=SEGMENT_BYTES)
    with capture_logs() as logs:
        async with MemoryPipeline(settings) as mem:
            await mem.flush()
            assert mem.stats().destroyed_turns == 0
            assert "outbox_records_destroyed" not in mem.health().conditions
    assert not [e for e in logs if e["event"] == "outbox_records_destroyed"]
    stored = {key for turns in stored_turns(db).values() for key, role, _ in turns
              if role == "user"}
    assert set(acked) <= stored
    assert status_destroyed(db) == 0


async def test_a_segment_made_for_one_record_larger_than_a_segment_is_not_a_cut(
    tmp_path: Path
) -> None:
    """A record larger than a segment gets a segment of its own size (not whole pages): it
    must not read as one cut short. The store is held locked so the turn is still in the
    outbox at the next start."""
    db = tmp_path / "m.db"
    settings = Settings(db_path=db, outbox_segment_bytes=SEGMENT_BYTES, shutdown_deadline_s=0.2)
    async with MemoryPipeline(settings) as mem:
        await mem.flush()
        holder = sqlite3.connect(db, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        try:
            big = mem.sync_turn("x" * (SEGMENT_BYTES + 5000), "ok", session_id="s", user_id="u")
        finally:
            await mem.aclose()
            holder.execute("ROLLBACK")
            holder.close()
    sizes = [p.stat().st_size for p in settings.outbox_dir.glob("*.seg")]
    assert any(size % mmap.PAGESIZE for size in sizes), sizes  # the one-record segment
    async with MemoryPipeline(settings) as mem:
        await mem.flush()
        assert mem.stats().destroyed_turns == 0
        assert "outbox_records_destroyed" not in mem.health().conditions
    assert big.key in {key for turns in stored_turns(db).values() for key, _, _ in turns}
