"""The provider across process boundaries: a SIGKILL after acknowledgements, an interpreter
exit without shutdown(), and Hermes's own atexit clean-up running after ours."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections import defaultdict
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from hermes_async_memory import HermesMemoryProvider
from hermes_async_memory.hermes import config as hconfig
from hermes_async_memory.hermes import runtime

from .helpers import count_rows, stored_turns
from .processes import child_env

pytest.importorskip("agent.memory_manager")

ROOT = Path(__file__).resolve().parents[1]
CHILD_TIMEOUT_S = 60.0
WAIT_S = 10.0
# A group-commit window this long keeps the crashing child's writer from committing
# anything, so what the next start finds, the outbox replay put there.
NEVER_MS = "600000"
SESSIONS = 7


pytestmark = pytest.mark.usefixtures("clean_env")


def write_child(tmp_path: Path, body: str) -> Path:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(body), encoding="utf-8")
    return script


def users_by_session(db: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for session, rows in stored_turns(db).items():
        out[session] = [content for _, role, content in rows if role == "user"]
    return out


def assert_clean_exit(result: subprocess.CompletedProcess[str]) -> None:
    assert result.returncode == 0, result.stderr
    assert "Fatal Python error" not in result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_sigkill_after_acks_then_a_new_provider_recovers_every_acked_turn(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    script = write_child(tmp_path, f"""
        import sys
        from hermes_async_memory import HermesMemoryProvider
        p = HermesMemoryProvider()
        p.initialize("s0", hermes_home=sys.argv[1], platform="cli")
        i = 0
        while True:
            session = f"s{{i % {SESSIONS}}}"
            p.sync_turn(f"turn {{i}}", f"answer {{i}}", session_id=session)
            # Printed only once sync_turn returned: a printed turn is acknowledged.
            sys.stdout.write(f"ACK {{session}} {{i}}\\n")
            sys.stdout.flush()
            i += 1
    """)
    child = subprocess.Popen(
        [sys.executable, str(script), str(home)], stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL, text=True,
        env=child_env(HERMES_MEMORY_MAX_WAIT_MS=NEVER_MS, HERMES_MEMORY_MAX_BATCH="100000"),
    )
    acked: dict[str, list[int]] = defaultdict(list)
    try:
        assert child.stdout is not None
        n = 0
        for line in child.stdout:
            if line.startswith("ACK "):
                _, session, i = line.split()
                acked[session].append(int(i))
                n += 1
                if n == 700:
                    break
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(CHILD_TIMEOUT_S)
    assert child.returncode == -signal.SIGKILL
    db = home / hconfig.DEFAULT_DB
    assert count_rows(db) == 0, "the writer never committed: recovery must do it all"

    p = HermesMemoryProvider()
    p.initialize("s0", hermes_home=str(home), platform="cli")
    try:
        p.flush(WAIT_S)
        for session, numbers in acked.items():
            users = [r["content"] for r in p.get_messages(session) if r["role"] == "user"]
            recovered = [int(u.split()[1]) for u in users]
            # Every acked turn, once, in order; after them at most turns acked but unread.
            assert recovered[: len(numbers)] == numbers, session
            assert recovered == sorted(set(recovered)), session
    finally:
        p.shutdown()


def test_exit_without_shutdown_commits_every_turn_and_exits_cleanly(tmp_path: Path) -> None:
    """Nobody calls shutdown(): the atexit hook drains within the deadline (without it the
    daemon loop thread is frozen first: nothing committed, the outbox segment left). It runs
    after the interpreter joined non-daemon threads, so a thread still writing after the
    main thread finished gets every turn in."""
    home = tmp_path / "home"
    script = write_child(tmp_path, f"""
        import sys, threading
        from hermes_async_memory import HermesMemoryProvider
        p = HermesMemoryProvider()
        p.initialize("s0", hermes_home=sys.argv[1], platform="cli")
        for i in range(300):
            p.sync_turn(f"main {{i}}", "ok", session_id=f"s{{i % {SESSIONS}}}")
        main_done = threading.Event()

        def late_writer():
            main_done.wait()
            for i in range(100):
                p.sync_turn(f"worker {{i}}", "ok", session_id="worker")

        threading.Thread(target=late_writer).start()  # non-daemon
        print("MAIN_DONE", flush=True)
        main_done.set()
    """)
    result = subprocess.run(
        [sys.executable, str(script), str(home)], capture_output=True, text=True,
        env=child_env(), timeout=CHILD_TIMEOUT_S, check=False,
    )
    assert_clean_exit(result)
    assert "MAIN_DONE" in result.stdout
    db = home / hconfig.DEFAULT_DB
    users = users_by_session(db)  # read from the file: no pipeline that could replay
    for s in range(SESSIONS):
        assert users[f"s{s}"] == [f"main {i}" for i in range(s, 300, SESSIONS)]
    assert users["worker"] == [f"worker {i}" for i in range(100)]
    outbox = db.with_name(db.name + ".outbox")
    assert sorted(p.name for p in outbox.iterdir()) == ["LOCK"], "nothing left to replay"


def test_hermes_atexit_cleanup_after_ours_still_stores_its_turns(tmp_path: Path) -> None:
    """Hermes's CLI registers its clean-up (flush_pending, on_session_end, shutdown_all)
    with atexit before the provider exists, so ours runs first; the turns its manager still
    had queued arrive after our close and take the late path."""
    home = tmp_path / "home"
    script = write_child(tmp_path, """
        import atexit, sys, threading
        from agent.memory_manager import MemoryManager
        from hermes_async_memory import HermesMemoryProvider

        mm = MemoryManager()
        gate = threading.Event()

        def hermes_cleanup():  # what cli._run_cleanup does with the memory manager
            gate.set()
            assert mm.flush_pending(timeout=10)
            mm.on_session_end([])
            mm.shutdown_all()
            print("DRAIN", mm.shutdown_drain_state, flush=True)

        atexit.register(hermes_cleanup)
        p = HermesMemoryProvider()
        mm.add_provider(p)
        mm.initialize_all(session_id="s1", hermes_home=sys.argv[1], platform="cli")
        mm.sync_all("before exit", "ok", session_id="s1")
        assert mm.flush_pending(timeout=10)  # accepted before the exit, not racing it
        # Hold the manager's single worker until the clean-up runs, so these three are
        # still queued when our atexit hook closes the pipeline.
        mm._submit_background(gate.wait)
        for i in range(3):
            mm.sync_all(f"queued {i}", "ok", session_id="s1")
    """)
    result = subprocess.run(
        [sys.executable, str(script), str(home)], capture_output=True, text=True,
        env=child_env(), timeout=CHILD_TIMEOUT_S, check=False,
    )
    assert_clean_exit(result)
    assert "'abandoned_writes': 0" in result.stdout
    assert result.stdout.count("memory_late_turn_stored") == 3, result.stdout
    users = users_by_session(home / hconfig.DEFAULT_DB)
    assert users["s1"] == ["before exit", "queued 0", "queued 1", "queued 2"]


def test_a_turn_after_the_exit_close_takes_the_late_path(tmp_path: Path) -> None:
    home = tmp_path / "home"
    p = HermesMemoryProvider()
    p.initialize("s1", hermes_home=str(home), platform="cli")
    p.sync_turn("first", "ok")
    runtime.close_all_at_exit()  # what the interpreter's atexit would run
    with capture_logs() as logs:
        p.sync_turn("after the close", "still stored")
    assert [e["event"] for e in logs if e["event"] == "memory_late_turn_stored"]
    p.on_session_end([])
    p.queue_prefetch("anything")  # a no-op now, not an error
    p.shutdown()
    assert users_by_session(home / hconfig.DEFAULT_DB)["s1"] == ["first", "after the close"]
