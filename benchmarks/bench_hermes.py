"""A burst of turns through Hermes Agent's real ``MemoryManager``, then its shutdown: our
provider against one that writes SQLite inside ``sync_turn``.

The manager runs every ``sync_turn`` on one background worker thread, in order, and at
shutdown drains that worker for at most 5 s (``_SYNC_DRAIN_TIMEOUT_S``), then cancels what is
still queued and reports it in ``shutdown_drain_state["abandoned_writes"]``. Each load is
pushed with ``sync_all`` (with the session's message history, as run_agent passes it) as
fast as the caller can, then ``shutdown_all()`` is called at once, as the CLI's exit does.

- **Ours:** ``HermesMemoryProvider`` (sync_turn is an outbox append; shutdown drains the
  pipeline and closes it).
- **Baseline, per-call store:** seed 000's ``LocalBackend`` pattern in a provider: for each
  turn ``sqlite3.connect()``, insert the user and the assistant message, commit (SQLite
  defaults: rollback journal, synchronous=FULL).

Measured per provider: the caller's time in the ``sync_all`` calls, the wall time from the
first call until ``shutdown_all()`` returned (for ours everything is committed then), the
turns found in the file right after, and the turns the manager abandoned. The ratio is of
turns stored per second of that wall time (well defined even when the baseline abandons
turns, where a ratio of wall times would flatter it: its drain is cut at 5 s). Both run in
this process, one after the other.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import sys
import time
from pathlib import Path
from typing import Any

from _common import (
    Corpus,
    Result,
    TurnSpec,
    fmt_rate,
    library_version,
    machine,
    make_turns,
    parser,
    print_table,
    quiet_logs,
    report,
    scratch_dir,
)
from agent.memory_manager import MemoryManager
from agent.memory_provider import MemoryProvider

from hermes_async_memory import HermesMemoryProvider, Settings

# (turns, sessions): the interactive-scale burst, and a gateway-scale one.
LOADS = ((2_000, 50), (10_000, 200))
QUICK_LOADS = ((500, 50), (2_000, 50))

_CREATE = """CREATE TABLE IF NOT EXISTS turns (
    session_id TEXT NOT NULL, role TEXT NOT NULL, content TEXT, created_at REAL NOT NULL)"""
_INSERT = "INSERT INTO turns (session_id, role, content, created_at) VALUES (?, ?, ?, ?)"


class PerCallSqliteProvider(MemoryProvider):  # type: ignore[misc]
    """Seed 000's LocalBackend pattern as a Hermes provider: connect, insert, commit per call."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @property
    def name(self) -> str:
        return "per_call_sqlite"

    def is_available(self) -> bool:
        return True

    def initialize(self, session_id: str, **kwargs: Any) -> None:
        with sqlite3.connect(self.path) as conn:
            conn.execute(_CREATE)
            conn.commit()

    def get_tool_schemas(self) -> list[dict[str, Any]]:
        return []

    def sync_turn(self, user_content: str, assistant_content: str, *, session_id: str = "",
                  messages: list[dict[str, Any]] | None = None) -> None:
        now = time.time()
        with sqlite3.connect(self.path) as conn:
            conn.execute(_INSERT, (session_id, "user", user_content, now))
            conn.execute(_INSERT, (session_id, "assistant", assistant_content, now))
            conn.commit()


def stored_turns(db: Path, sql: str) -> int:
    conn = sqlite3.connect(db)
    try:
        return int(conn.execute(sql).fetchone()[0])
    finally:
        conn.close()


def run(provider: MemoryProvider, turns: list[TurnSpec], home: Path) -> dict[str, Any]:
    mm = MemoryManager()
    mm.add_provider(provider)
    mm.initialize_all(session_id=turns[0][0], hermes_home=str(home), platform="cli",
                      agent_context="primary")
    histories: dict[str, list[dict[str, Any]]] = {}
    t0 = time.perf_counter()
    for sid, _uid, user, assistant in turns:
        history = histories.setdefault(sid, [])
        history.append({"role": "user", "content": user})
        history.append({"role": "assistant", "content": assistant})
        mm.sync_all(user, assistant, session_id=sid, messages=history)
    t1 = time.perf_counter()
    mm.shutdown_all()
    t2 = time.perf_counter()
    return {"push_s": t1 - t0, "wall_s": t2 - t0, "drain": mm.shutdown_drain_state}


def main() -> list[Result]:
    args = parser(__doc__.splitlines()[0]).parse_args()
    quiet_logs()
    logging.getLogger("agent").setLevel(logging.ERROR)  # the drain-timeout warning: we report it
    for key in [k for k in os.environ if k.startswith("HERMES_MEMORY_")]:
        del os.environ[key]
    loads = QUICK_LOADS if args.quick else LOADS
    print(f"bench_hermes: turn bursts through hermes-agent's MemoryManager, then shutdown "
          f"({machine()}; library {library_version()})")
    corpus = Corpus()
    rows, results = [], []
    with scratch_dir("hermes") as d:
        for n, sessions in loads:
            turns = make_turns(corpus, n, sessions, seed=n)
            ours_db = d / f"ours-{n}.db"
            ours = run(HermesMemoryProvider(Settings(db_path=ours_db)), turns, d / f"h-{n}")
            ours_stored = stored_turns(ours_db, "SELECT count(DISTINCT turn_key) FROM messages")
            base_db = d / f"per-call-{n}.db"
            base = run(PerCallSqliteProvider(base_db), turns, d / f"h-{n}")
            base_stored = stored_turns(base_db, "SELECT count(*) / 2 FROM turns")
            for label, r, stored in (("ours", ours, ours_stored),
                                     ("per-call store", base, base_stored)):
                rows.append([
                    f"{n:,} / {sessions}", label, f"{r['push_s'] * 1e3:.0f} ms",
                    f"{r['wall_s']:.2f} s", f"{stored:,}", fmt_rate(stored / r["wall_s"]),
                    f"{r['drain']['abandoned_writes']:,}", r["drain"]["status"],
                ])
            ratio = (ours_stored / ours["wall_s"]) / (base_stored / base["wall_s"])
            results.append(Result(
                f"Hermes MemoryManager, {n:,} turns / {sessions} sessions, then shutdown: "
                "stored / abandoned (wall time)",
                f"{ours_stored:,} / {ours['drain']['abandoned_writes']:,} "
                f"({ours['wall_s']:.2f} s)",
                f"per-call store {base_stored:,} / {base['drain']['abandoned_writes']:,} "
                f"({base['wall_s']:.2f} s)",
                f"{ratio:.1f}x turns stored/s",
                "nothing abandoned",
                ours["drain"]["abandoned_writes"] == 0 and ours_stored == n,
            ))
    print_table(["turns / sessions", "provider", "sync_all calls", "until shutdown returned",
                 "stored", "stored/s", "abandoned", "drain"], rows)
    report(results, args.json)
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
