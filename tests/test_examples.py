"""The examples run as docs/layout.md and docs/multi-process.md say, and do what they print."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from .processes import ROOT, child_env

RUN_TIMEOUT_S = 180.0


def run_example(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=child_env(), cwd=ROOT,
        timeout=RUN_TIMEOUT_S, check=False,
    )


def test_async_gateway_serves_every_user_and_commits_every_turn(tmp_path: Path) -> None:
    db = tmp_path / "gateway.db"
    result = run_example("examples/async_gateway.py", "--users", "40", "--turns", "3",
                         "--db", str(db))
    assert result.returncode == 0, result.stderr
    assert "served 120 turns for 40 users" in result.stdout
    assert "committed 120, queue 0, dead letters 0" in result.stdout
    # Turns after a user's first one carry the memory of the turns before it (all 80 when a
    # commit lands within the simulated model and typing time, ~5 ms against 100+ ms; a
    # loaded machine may miss a few, never most).
    carried = re.search(r"(\d+) prompts carried a memory block", result.stdout)
    assert carried is not None and 40 <= int(carried.group(1)) <= 80


def test_two_gateways_and_one_worker_share_one_file(tmp_path: Path) -> None:
    db = tmp_path / "shared.db"
    result = run_example("examples/shared_memory.py", "--users", "20", "--turns", "3",
                         "--db", str(db))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "worker exited 0; the file holds 120 turns in 40 sessions; 0 still waiting" in \
        result.stdout


def test_the_hermes_plugin_example_runs_through_hermes_own_loader(tmp_path: Path) -> None:
    home = tmp_path / "hermes-home"
    env = child_env(HERMES_HOME=str(home))
    subprocess.run([sys.executable, "-m", "hermes_async_memory.cli", "hermes", "install"],
                   env=env, cwd=ROOT, check=True, capture_output=True, timeout=RUN_TIMEOUT_S)
    (home / "config.yaml").write_text("memory:\n  provider: hermes_async_memory\n")
    result = subprocess.run(
        [sys.executable, "examples/hermes_plugin/smoke.py"], env=env, cwd=ROOT,
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "provider: hermes_async_memory" in result.stdout
    memory = result.stdout.split("<memory-context>", 1)
    assert len(memory) == 2 and "Rossio station" in memory[1], \
        "before its second reply the agent saw its memory of the first turn"
    assert "'abandoned_writes': 0" in result.stdout
