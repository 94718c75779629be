"""Time to flush 10,000 pending turns, against a raw sqlite3 group commit of the same turns.

Each round opens a pipeline on a fresh store, commits a 1,000-turn warm-up, accepts 10,000
turns over 1,000 sessions without yielding to the loop (so all 10,000 are pending), and
times ``await mem.flush()`` alone. The baseline is bench_throughput's raw group commit
(same schema and statements, 1,000 turns per transaction, one connection, no asyncio) of
the same 10,000 turns into a fresh file after the same warm-up, in the same run. The goal is
judged on the slowest round.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from _common import (
    FLUSH_TIMEOUT_S,
    Corpus,
    Result,
    TurnSpec,
    fmt_ns,
    library_version,
    machine,
    make_turns,
    open_raw,
    parser,
    print_table,
    quiet_logs,
    raw_group_commit,
    report,
    scratch_dir,
)

from hermes_async_memory import MemoryPipeline, Settings

GOAL_S = 1.5
PENDING = 10_000
SESSIONS = 1_000


async def pipeline_round(
    path: Path, warm: list[TurnSpec], turns: list[TurnSpec]
) -> tuple[float, float]:
    async with MemoryPipeline(Settings(db_path=path)) as mem:
        for sid, uid, user, assistant in warm:
            mem.sync_turn(user, assistant, session_id=sid, user_id=uid)
        await mem.flush(timeout=FLUSH_TIMEOUT_S)
        st = mem.sync_turn
        t0 = time.perf_counter()
        for sid, uid, user, assistant in turns:
            st(user, assistant, session_id=sid, user_id=uid)
        t1 = time.perf_counter()
        assert mem.stats().queued_turns >= len(turns) - 1, "the turns should all be pending"
        await mem.flush(timeout=FLUSH_TIMEOUT_S)
        t2 = time.perf_counter()
        assert mem.stats().committed_turns == len(warm) + len(turns)
    return t1 - t0, t2 - t1


def raw_round(path: Path, warm: list[TurnSpec], turns: list[TurnSpec]) -> float:
    conn = open_raw(path)
    raw_group_commit(conn, warm)
    t0 = time.perf_counter()
    raw_group_commit(conn, turns)
    dt = time.perf_counter() - t0
    conn.close()
    return dt


async def main() -> list[Result]:
    args = parser(__doc__.splitlines()[0]).parse_args()
    quiet_logs()
    rounds = 1 if args.quick else 5
    print(
        f"bench_flush: {PENDING:,} pending turns over {SESSIONS:,} sessions, {rounds} round(s) "
        f"({machine()}; library {library_version()})"
    )
    corpus = Corpus()
    all_turns = make_turns(corpus, 1_000 + PENDING * rounds, SESSIONS, seed=5)
    warm = all_turns[:1_000]
    rows = []
    flush_s, raw_s = [], []
    with scratch_dir("flush") as d:
        for r in range(rounds):
            turns = all_turns[1_000 + r * PENDING : 1_000 + (r + 1) * PENDING]
            accept, flush = await pipeline_round(d / f"pipe{r}.db", warm, turns)
            base = raw_round(d / f"raw{r}.db", warm, turns)
            flush_s.append(flush)
            raw_s.append(base)
            rows.append(
                [
                    r + 1,
                    fmt_ns(accept * 1e9),
                    fmt_ns(flush * 1e9),
                    fmt_ns(base * 1e9),
                    f"{flush / base:.2f}x",
                ]
            )
    print_table(["round", "accept 10k", "flush 10k", "raw group commit 10k", "ratio"], rows)
    worst, median = max(flush_s), sorted(flush_s)[len(flush_s) // 2]
    raw_median = sorted(raw_s)[len(raw_s) // 2]
    met = worst <= GOAL_S
    print(
        f"flush: median {median:.3f} s, worst {worst:.3f} s; raw median {raw_median:.3f} s; "
        f"goal <= {GOAL_S} s: {'PASS' if met else 'MISS'}"
    )
    results = [
        Result(
            "flush() of 10,000 pending turns (median / worst)",
            f"{median:.2f} s / {worst:.2f} s",
            f"raw group commit {raw_median:.2f} s",
            f"{median / raw_median:.2f}x",
            "≤ 1.5 s",
            met,
        )
    ]
    report(results, args.json)
    return results


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
