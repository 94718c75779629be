"""Memory per pending turn: 100,000 turns accepted and not yet committed, with 300-byte and
with 2 KB texts, against the encoded size of the same turns.

Pending = accepted and durable, not committed. To keep them pending, another connection
holds the store's write lock (``BEGIN IMMEDIATE``) while the turns are accepted: the writer's
commit finds the store busy, a transient fault, and retries with backoff, holding the batch it
took (and the one it read ahead) as it would during any busy spell. A pending turn then holds
what it holds in normal work: its record in the outbox's memory-mapped segment, and its
session's entry in the commit barrier. (A long ``max_wait_ms`` instead would not keep 100,000
turns pending: a batch closes at ``max_batch`` turns whatever the window.)

Measured from /proc/self/status after a full garbage collection: VmRSS, and its parts RssAnon
(the Python heap) and RssFile (file pages mapped in: the outbox's segments are a shared file
mapping, so its records count here, not in the heap). Three points: after a warm-up of five
turns a session (see WARM_UP_TURNS) and a ``malloc_trim``; with all turns pending; and after
the lock is let go, everything is committed, and the maintainer has deleted the settled
segments, dropped the settled pages of the one left and given the heap's free memory back
(``stats().heap_trims``).

Text size is the user and the assistant text together (half each, ASCII words cut to size);
1,000 distinct texts are cycled, so the harness itself holds little. Each size runs in a
process of its own, so one run's heap does not hide the next one's.

Goals (issue 9): RSS per pending turn ≤ 1.3 x the text size + 400 bytes; the memory is given
back after the drain, taken here as: VmRSS after the drain within 10 % of the growth (and at
least 4 MiB) of what it was before the turns came.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import json
import random
import sqlite3
import subprocess
import sys
import time
import tracemalloc

from _common import (
    FLUSH_TIMEOUT_S,
    Corpus,
    Result,
    library_version,
    machine,
    parser,
    print_table,
    quiet_logs,
    report,
    scratch_dir,
)

from hermes_async_memory import MemoryPipeline, Settings

SIZES = (300, 2_048)
TURNS = 100_000
SESSIONS = 1_000
DISTINCT_TEXTS = 1_000
# Five turns a session before the first point: the bounded structures a process serving these
# sessions holds anyway (each session's recent turns in the prefetch cache, SQLite's page
# caches) are full, so what the drain leaves is what the backlog itself cost.
WARM_UP_TURNS = 5 * SESSIONS
GIVEN_BACK_SHARE = 0.10
GIVEN_BACK_MIN = 4 * 1024 * 1024
STATUS_KEYS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def goal_bytes(text_bytes: int) -> float:
    return 1.3 * text_bytes + 400


def status() -> dict[str, int]:
    """VmRSS and its parts, in bytes, after a full collection."""
    gc.collect()
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in STATUS_KEYS:
                out[key] = int(value.split()[0]) * 1024
    return out


def _malloc_trim() -> bool:
    """Ask glibc to give free heap memory back to the system (a diagnostic, not a fix)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    libc.malloc_trim(0)
    return True


def texts(size: int, n: int, seed: int) -> list[tuple[str, str]]:
    """``n`` (user, assistant) pairs of ``size`` bytes together: Zipf words, cut to size."""
    corpus = Corpus()
    rng = random.Random(seed)
    half = size // 2
    out = []
    for i in range(n):
        parts = []
        for want in (half, size - half):
            words: list[str] = []
            length = 0
            while length < want:
                w = corpus.message(rng, i % corpus.spec.users, 20, 30)
                words.append(w)
                length += len(w) + 1
            parts.append(" ".join(words)[:want])
        out.append((parts[0], parts[1]))
    return out


async def one(size: int, n: int, trace: bool) -> dict[str, object]:
    """Run one text size in this process; returns its figures."""
    pool = texts(size, DISTINCT_TEXTS, seed=size)
    sids = [f"mem-session-{s:04d}" for s in range(SESSIONS)]
    with scratch_dir(f"memory-{size}") as d:
        settings = Settings(db_path=d / "m.db")
        async with MemoryPipeline(settings) as mem:
            for i in range(WARM_UP_TURNS):
                user, assistant = pool[i % DISTINCT_TEXTS]
                mem.sync_turn(user, assistant, session_id=sids[i % SESSIONS], user_id="u")
            await mem.flush(timeout=FLUSH_TIMEOUT_S)
            await mem.wait_until(lambda: mem.stats().outbox_segments <= 1,
                                 timeout=FLUSH_TIMEOUT_S)
            # The warm-up's own free heap goes back first (as the maintainer would give it after
            # a larger backlog): the drain's point is then compared with a trimmed heap.
            _malloc_trim()
            before = status()
            committed0 = mem.stats().committed_turns
            if trace:
                tracemalloc.start(8)
                snap0 = tracemalloc.take_snapshot()
            lock = sqlite3.connect(settings.db_path, isolation_level=None)
            lock.execute("BEGIN IMMEDIATE")  # the writer's commits now find the store busy
            try:
                t0 = time.perf_counter()
                for i in range(n):
                    user, assistant = pool[i % DISTINCT_TEXTS]
                    mem.sync_turn(user, assistant, session_id=sids[i % SESSIONS], user_id="u")
                    if i % 1_000 == 999:
                        await asyncio.sleep(0)  # the writer runs: it takes a batch and retries
                accept_s = time.perf_counter() - t0
                await asyncio.sleep(0.3)  # a few of the writer's retries
                stats = mem.stats()
                pending_turns = stats.pending_turns
                encoded = stats.queued_bytes
                pending = status()
                top: list[str] = []
                if trace:
                    snap = tracemalloc.take_snapshot()
                    for stat in snap.compare_to(snap0, "lineno")[:8]:
                        top.append(str(stat))
            finally:
                lock.rollback()
                lock.close()
            t1 = time.perf_counter()
            trims = mem.stats().heap_trims
            await mem.flush(timeout=FLUSH_TIMEOUT_S)
            drain_s = time.perf_counter() - t1
            # The maintainer's next rounds: settled segments deleted, settled pages dropped,
            # the heap given back once the outbox is empty.
            await mem.wait_until(lambda: mem.stats().outbox_segments <= 1
                                 and mem.stats().heap_trims > trims, timeout=FLUSH_TIMEOUT_S)
            committed = mem.stats().committed_turns - committed0
            if trace:
                snap1 = tracemalloc.take_snapshot()
            after = status()
            # How much of what is kept is free memory the C allocator still holds on to.
            trimmed = status() if _malloc_trim() else after
            if trace:
                top_after = [str(x) for x in snap1.compare_to(snap0, "lineno")[:8]]
                tracemalloc.stop()
            else:
                top_after = []
    return {
        "size": size, "n": n, "pending_turns": pending_turns, "committed": committed,
        "encoded_bytes": encoded, "before": before, "pending": pending, "after": after,
        "trimmed": trimmed, "accept_s": accept_s, "drain_s": drain_s, "top": top,
        "top_after": top_after,
    }


def run_child(size: int, n: int, trace: bool) -> dict[str, object]:
    cmd = [sys.executable, __file__, "--size", str(size), "--turns", str(n)]
    if trace:
        cmd.append("--tracemalloc")
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def mib(x: float) -> str:
    return f"{x / 1024 / 1024:,.1f} MiB"


def main() -> list[Result]:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=None, help=argparse.SUPPRESS)  # a child's
    p.add_argument("--turns", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--tracemalloc", action="store_true",
                   help="also show what the heap grew by (slower, and it costs memory)")
    args = p.parse_args()
    quiet_logs(json_lines=True)  # warnings (the writer's busy retries) to stderr
    if args.size is not None:  # a child: one size, its figures as a JSON line
        fig = asyncio.run(one(args.size, args.turns or TURNS, args.tracemalloc))
        print(json.dumps(fig))
        return []
    # Not smaller with --quick: the writer's in-flight batches are a fixed cost, which fewer
    # pending turns would spread thinner (and the full run takes ~30 s).
    n = TURNS
    print(f"bench_memory: {n:,} pending turns over {SESSIONS:,} sessions, texts of "
          f"{' and '.join(f'{s:,} bytes' for s in SIZES)} ({machine()}; library "
          f"{library_version()})")
    figs = [run_child(size, n, args.tracemalloc) for size in SIZES]
    rows = []
    results = []
    for f in figs:
        size, got = int(f["size"]), int(f["pending_turns"])  # type: ignore[call-overload]
        before, pending, after = f["before"], f["pending"], f["after"]
        assert isinstance(before, dict) and isinstance(pending, dict) and isinstance(after, dict)
        per = {k: (pending[k] - before[k]) / got for k in STATUS_KEYS}
        encoded = int(f["encoded_bytes"]) / got  # type: ignore[call-overload]
        grown = pending["VmRSS"] - before["VmRSS"]
        kept = after["VmRSS"] - before["VmRSS"]
        given_back = kept <= max(GIVEN_BACK_MIN, GIVEN_BACK_SHARE * grown)
        for point, st in (("before", before), ("all pending", pending), ("after the drain", after)):
            rows.append([f"{size:,} B texts, {point}",
                         *(mib(st[k]) for k in STATUS_KEYS)])
        rows.append([f"{size:,} B texts, per pending turn",
                     *(f"{per[k]:,.0f} B" for k in STATUS_KEYS)])
        print(f"{size:,} B texts: {got:,} pending (committed after the drain: "
              f"{f['committed']:,}); encoded {encoded:,.0f} B a turn; accepted in "
              f"{f['accept_s']:.2f} s, drained in {f['drain_s']:.2f} s")
        if f["top"]:
            print("  the heap's growth with all pending (tracemalloc, top lines):")
            for line in f["top"]:  # type: ignore[union-attr]
                print(f"    {line}")
            print("  the heap's growth after the drain, from before (tracemalloc):")
            for line in f["top_after"]:  # type: ignore[union-attr]
                print(f"    {line}")
        trimmed = f["trimmed"]
        assert isinstance(trimmed, dict)
        print(f"  after the drain: VmRSS {mib(after['VmRSS'])}; after malloc_trim(0) "
              f"{mib(trimmed['VmRSS'])} (RssAnon {mib(trimmed['RssAnon'])}): the rest of the "
              "heap's growth is free memory the C allocator kept")
        met = per["VmRSS"] <= goal_bytes(size)
        results.append(Result(
            f"RSS per pending turn, {size:,}-byte texts (VmRSS; heap / file pages)",
            f"{per['VmRSS']:,.0f} B ({per['RssAnon']:,.0f} / {per['RssFile']:,.0f})",
            f"encoded turn {encoded:,.0f} B",
            f"{per['VmRSS'] / encoded:.2f}x",
            f"≤ {goal_bytes(size):,.0f} B",
            met,
            headline=True,
        ))
        results.append(Result(
            f"memory given back after the drain, {size:,}-byte texts (VmRSS kept / grown)",
            f"{mib(kept)} / {mib(grown)}",
            "—",
            f"{kept / max(grown, 1):.0%}",
            f"≤ {GIVEN_BACK_SHARE:.0%} (or 4 MiB)",
            given_back,
        ))
    print_table(["memory", *STATUS_KEYS], rows)
    report(results, args.json)
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
