"""The worker process, run for real: a subprocess over a SQLite file, stopped by signals."""

from __future__ import annotations

import signal
import textwrap
import time
from pathlib import Path

import pytest

from hermes_async_memory import MemoryPipeline, Settings

from .processes import EXIT_TIMEOUT_S, Spawn, Worker
from .test_supervisor import corrupt_store

# A second signal must end the process promptly, far below the drain it interrupts.
PROMPT_EXIT_S = 10.0
DRAIN_DEADLINE_S = 120.0

# A child that runs the worker's run() with a ready hook that accepts turns the way a gateway
# would, writes their keys to a file, and reports on stdout. With "lock", another connection
# holds the store's write lock first, so no batch can commit and the drain cannot finish.
CHILD = textwrap.dedent(
    """
    import asyncio, json, sqlite3, sys
    from pathlib import Path

    from hermes_async_memory import Settings
    from hermes_async_memory.logs import configure_logging
    from hermes_async_memory.worker.main import run

    db, turns, mode, keys_file = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    deadline_s = float(sys.argv[5])
    held = []

    def ready(mem):
        if mode == "lock":
            conn = sqlite3.connect(db, isolation_level=None)
            conn.execute("BEGIN IMMEDIATE")
            held.append(conn)
        keys = []
        for i in range(turns):
            receipt = mem.sync_turn(
                f"question {i} about invoices", f"answer {i}",
                session_id=f"s{i % 10}", user_id=f"u{i % 3}",
            )
            keys.append(receipt.key)
        Path(keys_file).write_text("\\n".join(keys))
        print(json.dumps({"accepted": len(keys)}), flush=True)

    configure_logging(json=True)
    asyncio.run(run(Settings(db_path=db, shutdown_deadline_s=deadline_s), ready=ready))
    """
)


async def start_child(spawn: Spawn, tmp_path: Path, db: Path, *, turns: int,
                      mode: str, deadline_s: float) -> tuple[Worker, list[str]]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    keys_file = tmp_path / "keys.txt"
    worker = await spawn(str(script), str(db), str(turns), mode, str(keys_file),
                                 str(deadline_s))
    await worker.log_line("worker_ready")
    report = await worker.stdout_json()
    keys = keys_file.read_text().split("\n")
    assert report == {"accepted": turns} and len(keys) == turns
    return worker, keys


async def stored_turns(db: Path) -> tuple[dict[str, list[str]], int]:
    """Open a new pipeline on ``db``, commit what it recovers; return each session's turn keys
    in stored order (each key once per message) and how many turns the start recovered."""
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        recovered = mem.stats().accepted_turns
        await mem.flush(timeout=EXIT_TIMEOUT_S)
        sessions = {}
        for i in range(10):
            rows = await mem.get_messages(f"s{i}")
            sessions[f"s{i}"] = [str(r["turn_key"]) for r in rows]
    return sessions, recovered


def assert_each_turn_once_in_order(sessions: dict[str, list[str]], keys: list[str]) -> None:
    """Every accepted turn stored exactly once (a user and an assistant row), in per-session
    accept order, and nothing else."""
    for i in range(10):
        expected = [k for n, k in enumerate(keys) if n % 10 == i]
        rows = sessions[f"s{i}"]
        assert rows[0::2] == expected, f"session s{i}: turns lost, duplicated or reordered"
        assert rows[1::2] == expected


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_worker_runs_until_a_signal_then_closes_and_exits_0(
    spawn: Spawn, tmp_path: Path, signum: int
) -> None:
    db = tmp_path / "memory.db"
    worker = await spawn("-m", "workers", "--db", str(db), "--log-format", "json")
    ready = await worker.log_line("worker_ready")
    assert ready["db"] == str(db)
    assert db.exists()

    worker.signal(signum)

    assert await worker.finish() == 0
    events = worker.events()
    assert events.index("worker_stopping") < events.index("pipeline_closed")
    stopped = worker.logs[events.index("worker_stopped")]
    assert stopped["left_in_outbox"] == 0
    assert worker.logs[events.index("worker_stopping")]["signal"] == signal.Signals(signum).name
    # Every line on stderr is a JSON log line with an ISO timestamp.
    assert all(rec["event"] is not None and "T" in rec["timestamp"] for rec in worker.logs)


async def test_sigterm_drains_every_pending_turn_before_exit(
    spawn: Spawn, tmp_path: Path
) -> None:
    db = tmp_path / "memory.db"
    turns = 5000
    worker, keys = await start_child(spawn, tmp_path, db, turns=turns, mode="free",
                                     deadline_s=DRAIN_DEADLINE_S)

    worker.signal(signal.SIGTERM)

    assert await worker.finish() == 0
    stopped = worker.logs[worker.events().index("worker_stopped")]
    assert stopped["committed_turns"] == turns
    assert stopped["left_in_outbox"] == 0
    sessions, recovered = await stored_turns(db)
    assert recovered == 0  # nothing was left for the next start
    assert_each_turn_once_in_order(sessions, keys)


@pytest.mark.parametrize("second", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
async def test_second_signal_exits_at_once_and_the_next_start_recovers_every_turn(
    spawn: Spawn, tmp_path: Path, second: int
) -> None:
    db = tmp_path / "memory.db"
    turns = 2000
    # The store's write lock is held, so the drain can never finish on its own.
    worker, keys = await start_child(spawn, tmp_path, db, turns=turns, mode="lock",
                                     deadline_s=DRAIN_DEADLINE_S)

    worker.signal(signal.SIGTERM)
    draining = await worker.log_line("worker_draining")
    assert draining["pending_turns"] == turns
    signalled = time.monotonic()
    worker.signal(second)

    assert await worker.finish(timeout_s=PROMPT_EXIT_S) == 128 + second
    assert time.monotonic() - signalled < PROMPT_EXIT_S
    assert "worker_exit_now" in worker.events()
    assert "worker_stopped" not in worker.events()
    sessions, recovered = await stored_turns(db)
    assert recovered == turns
    assert_each_turn_once_in_order(sessions, keys)


async def test_demo_prints_each_step_exits_0_and_leaves_its_turns_stored(
    spawn: Spawn, tmp_path: Path
) -> None:
    db = tmp_path / "memory.db"
    worker = await spawn("-m", "workers", "--db", str(db), "--demo")

    assert await worker.finish() == 0
    out = worker.stdout
    lines = out.splitlines()
    for section in (
        "accepted 1000 turns with sync_turn: p50",
        "flushed 950 turns in",
        "queued a prefetch for 10 sessions",
        "prefetch(session_id=",
        "Recent turns in this session:",
        "prefetch_status: turns_committed=20",
        "search(",
        "Related memory:",
        "stats: 1000 accepted, 1000 committed",
    ):
        assert section in out, f"missing {section!r} in:\n{out}"
    assert lines[-1] == "flushed; 1000 turns committed, 0 left in outbox"
    # The report alone on stdout; the log lines on stderr, whatever stdout is (a pipe here).
    assert not [line for line in lines if line.lstrip().startswith("{")]
    assert "worker_ready" in worker.events() and "batch_committed" in worker.events()
    # The recalled block leaves out what its recent turns already show.
    block = out.split("prefetch(session_id=", 1)[1].split("prefetch_status:", 1)[0]
    recent, related = block.split("Related memory:", 1)
    shown = {line.split(": ", 1)[1] for line in recent.splitlines() if "- user: " in line}
    assert shown and not [line for line in related.splitlines()
                          if line.strip().startswith("- [") and line.split("] ", 1)[1] in shown]
    run_id = lines[0].split("(run ", 1)[1].split(")", 1)[0]

    async with MemoryPipeline(Settings(db_path=db)) as mem:
        assert mem.stats().accepted_turns == 0  # nothing left in the outbox
        for i in range(50):
            messages = await mem.get_messages(f"demo-{run_id}-{i:02d}")
            assert [m["role"] for m in messages] == ["user", "assistant"] * 20
            assert len({m["turn_key"] for m in messages}) == 20
            assert all(m["content"] for m in messages)


async def test_a_worker_whose_store_goes_bad_exits_3_with_one_line_naming_the_cause(
    spawn: Spawn, tmp_path: Path
) -> None:
    """The store file is damaged under a running worker: its parts cannot go on. It must not
    linger half-alive nor die with a traceback: one line, and an exit code of its own that a
    service manager restarts on."""
    db = tmp_path / "memory.db"
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        for i in range(200):
            mem.sync_turn(f"question {i}", f"answer {i}", session_id=f"s{i % 10}")
    worker = await spawn("-m", "workers", "--db", str(db), "--log-format", "json",
                         "--deadline", "1")
    await worker.log_line("worker_ready")
    corrupt_store(db)

    assert await worker.finish() == 3
    failed = await worker.log_line("pipeline_failed")
    assert "malformed" in failed["error"]
    plain = [rec["raw"] for rec in worker.logs if rec["event"] is None]
    assert len(plain) == 1, plain
    assert plain[0].startswith("python -m workers: error: the pipeline's ")
    assert "malformed" in plain[0]
    assert "Traceback" not in "".join(plain)
