"""Key-value memory: ``store`` to its receipt against ``sync_turn`` in the same run, and
``retrieve`` against a dict.

- store vs sync_turn: the two calls alternate, one each per step, over 1,000 users and
  1,000 sessions, while the writer commits both kinds of record: each call is timed with
  perf_counter_ns (one timer read is in every sample). Goal: a key-value write costs the
  caller what a turn does (p99 within 1.5x of sync_turn's, and at most 20 µs).
- retrieve vs dict: after the writes commit, awaited ``retrieve`` calls of random entries
  (each waits for the user's lane, nothing pending here, then reads one row on a reader
  thread) against dict.get of the same keys. No goal: it says what a read costs.
"""

from __future__ import annotations

import asyncio
import random
import sys

from _common import (
    FLUSH_TIMEOUT_S,
    Result,
    fmt_ns,
    library_version,
    machine,
    now_ns,
    parser,
    quiet_logs,
    report,
    scratch_dir,
    summary,
)

from hermes_async_memory import MemoryPipeline, Settings

USERS = 1_000
GOAL_P99_NS = 20_000
GOAL_RATIO = 1.5


async def main() -> list[Result]:
    args = parser(__doc__ or "").parse_args()
    quiet_logs()
    writes = 10_000 if args.quick else 50_000
    reads = 5_000 if args.quick else 20_000
    print(f"bench_kv: {writes:,} stores and {writes:,} turns, then {reads:,} retrieves, "
          f"{USERS:,} users ({machine()}; library {library_version()})")
    rng = random.Random(7)
    words = "editor shell theme font language timezone pet city team project".split()
    with scratch_dir("bench-kv") as d:
        async with MemoryPipeline(Settings(db_path=d / "memory.db")) as mem:
            kv, t = mem.memory, now_ns
            store_ns = [0] * writes
            turn_ns = [0] * writes
            plain: dict[tuple[str, str], str] = {}
            for i in range(writes):
                user, key = f"u{i % USERS}", f"{rng.choice(words)}-{i % 97}"
                value = f"value {i} " + " ".join(rng.choices(words, k=12))
                a = t()
                kv.store_nowait(user, key, value, {"n": i})
                b = t()
                mem.sync_turn(f"question {i} " + value, "answer " + value,
                              session_id=f"s{i % USERS}", user_id=user)
                c = t()
                store_ns[i], turn_ns[i] = b - a, c - b
                plain[(user, key)] = value
                if i % 64 == 63:
                    await asyncio.sleep(0)  # the writer runs meanwhile, as in a host
            await mem.flush(timeout=FLUSH_TIMEOUT_S)
            keys = rng.choices(list(plain), k=reads)
            read_ns = [0] * reads
            for n, (user, key) in enumerate(keys):
                a = t()
                entry = await kv.retrieve(user, key)
                read_ns[n] = t() - a
                assert entry is not None and entry.value == plain[(user, key)]
            dict_ns = [0] * reads
            get = plain.get
            for n, k in enumerate(keys):
                a = t()
                get(k)
                dict_ns[n] = t() - a
    s_kv, s_turn = summary(store_ns), summary(turn_ns)
    s_read, s_dict = summary(read_ns), summary(dict_ns)
    ratio = s_kv["p99"] / s_turn["p99"]
    met = s_kv["p99"] <= GOAL_P99_NS and ratio <= GOAL_RATIO
    print(f"store p50/p99 {fmt_ns(s_kv['p50'])} / {fmt_ns(s_kv['p99'])}; sync_turn "
          f"{fmt_ns(s_turn['p50'])} / {fmt_ns(s_turn['p99'])}; retrieve "
          f"{fmt_ns(s_read['p50'])} / {fmt_ns(s_read['p99'])}")
    results = [
        Result(
            "key-value store() to its receipt, writer committing (p50 / p99)",
            f"{fmt_ns(s_kv['p50'])} / {fmt_ns(s_kv['p99'])}",
            f"sync_turn {fmt_ns(s_turn['p50'])} / {fmt_ns(s_turn['p99'])}",
            f"{s_kv['p50'] / s_turn['p50']:.2f}x / {ratio:.2f}x",
            f"p99 ≤ 20 µs and ≤ {GOAL_RATIO}x sync_turn's",
            met,
        ),
        Result(
            "key-value retrieve(), committed entry, awaited (p50 / p99)",
            f"{fmt_ns(s_read['p50'])} / {fmt_ns(s_read['p99'])}",
            f"dict.get {fmt_ns(s_dict['p50'])} / {fmt_ns(s_dict['p99'])}",
            f"{s_read['p50'] / s_dict['p50']:.0f}x / {s_read['p99'] / s_dict['p99']:.0f}x",
            "—",
            None,
        ),
    ]
    report(results, args.json)
    return results


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
