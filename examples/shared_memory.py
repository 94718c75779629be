"""Two gateway processes and one worker process on one memory file.

    python examples/shared_memory.py [--db PATH] [--users 100] [--turns 5]

What it runs:

    python -m workers --db PATH                        the worker: commits, recalls
    python examples/async_gateway.py --role producer   gateway "gw1"
    python examples/async_gateway.py --role producer   gateway "gw2"

The gateways only make each turn durable (in their own outbox slot beside the file) and hand
turns to the file's inbox; the worker claims them under a lease, commits them, and answers
the gateways' recall requests, whose blocks the gateways' prefetch() reads. When both
gateways are done, the worker gets SIGTERM, drains and exits 0; the script then reads the
file and prints what is in it.
"""

from __future__ import annotations

import argparse
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def wait_for_line(proc: subprocess.Popen[str], text: str, timeout_s: float = 60.0) -> None:
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout_s
    for line in proc.stderr:
        if text in line:
            return
        if time.monotonic() > deadline:
            break
    raise SystemExit(f"the worker did not report {text!r}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", type=Path)
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--turns", type=int, default=5)
    args = parser.parse_args()
    db = args.db or Path(tempfile.mkdtemp(prefix="shared-memory-")) / "memory.db"

    worker = subprocess.Popen(
        [sys.executable, "-m", "workers", "--db", str(db), "--log-format", "json"],
        stderr=subprocess.PIPE, text=True,
    )
    try:
        wait_for_line(worker, '"worker_ready"')
        print(f"worker {worker.pid} is up on {db}")
        gateways = [
            subprocess.Popen([sys.executable, str(HERE / "async_gateway.py"), "--role",
                              "producer", "--db", str(db), "--name", name,
                              "--users", str(args.users), "--turns", str(args.turns)])
            for name in ("gw1", "gw2")
        ]
        codes = [g.wait() for g in gateways]
        if any(codes):
            print(f"a gateway failed: exit codes {codes}", file=sys.stderr)
            return 1
        worker.send_signal(signal.SIGTERM)  # drains what is left, then exits 0
        code = worker.wait(timeout=120)
    finally:
        if worker.poll() is None:
            worker.kill()
    conn = sqlite3.connect(db)
    try:
        turns = conn.execute(
            "SELECT count(*) FROM messages WHERE role = 'user'").fetchone()[0]
        sessions = conn.execute("SELECT count(*) FROM sessions").fetchone()[0]
        waiting = conn.execute("SELECT count(*) FROM inbox").fetchone()[0]
    finally:
        conn.close()
    print(f"worker exited {code}; the file holds {turns} turns in {sessions} sessions; "
          f"{waiting} still waiting in the inbox")
    expected = 2 * args.users * args.turns
    return 0 if code == 0 and turns == expected and waiting == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
