"""Instructions per call of sync_turn() and prefetch(), counted by valgrind's callgrind,
against the same count for their floors: the outbox's mmap append of the same record, and
dict.get.

A count is the same however busy the machine is, where a wall-clock p99 here moves 2x from
one hour to the next: a change of a few per cent in the accept path's work shows here when
bench_sync_turn cannot resolve it. It is not time (a cache miss or a page fault counts as one
instruction), so the latency rows stay in bench_sync_turn and bench_prefetch.

Each measure runs in a process of its own under callgrind, which counts only inside one
``sys.call_tracing`` call (nothing else in the process calls it): a loop over arguments
prepared beforehand, with the measured call in its body. The same loop with an empty body is
counted too and subtracted: what is left is the call's own. The pipeline is open and warm
(the sessions' first turns accepted, the interpreter's specialisations made) and the writer
does not run inside the count (the loop never yields), so a sync_turn is the accept alone:
the encoding, the outbox append and its bookkeeping. PYTHONHASHSEED is fixed: the same
count run after run.

    .venv/bin/python benchmarks/bench_instructions.py [--quick] [--json F]

Needs valgrind (Debian's package ``valgrind``); without it nothing is counted.
"""

from __future__ import annotations

import argparse
import asyncio
import mmap
import os
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import (
    FLUSH_TIMEOUT_S,
    Corpus,
    Result,
    library_version,
    machine,
    parser,
    quiet_logs,
    report,
    scratch_dir,
)

# Each measure, and the empty loop of the same shape subtracted from it.
MEASURES = {
    "sync_turn": "loop4",  # a user text and a reply
    "sync_turn_tools": "loop5",  # the same with five tool calls answered (bench_procedural)
    "mmap_append": "loop1",  # the floor of a durable accept (bench_sync_turn's baseline)
    "control": "loop1",  # one json.dumps and a hash (bench_sync_turn's control)
    "prefetch": "loop1",  # a warm cache
    "dict_get": "loop1",  # prefetch's floor
}
SESSIONS = 1_000
_COLLECTED = re.compile(r"Collected : (\d+)")


# -- the child: one measure, counted ------------------------------------------------------


def mmap_append(records: list[bytes]) -> Callable[[], None]:
    """bench_sync_turn's floor, untimed: each record appended as the outbox appends it (the
    bytes, the CRC of its info word and bytes, then the commit mark), pages faulted ahead."""
    pair = struct.Struct("<II")
    size = sum(len(p) + 16 for p in records)
    size += -size % mmap.PAGESIZE
    fd, name = tempfile.mkstemp(suffix=".seg")
    try:
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        os.unlink(name)
    for page in range(0, size, mmap.PAGESIZE):
        mm[page] = 0
    info = 2
    info_crc = zlib.crc32(info.to_bytes(4, "little"))
    pack = pair.pack_into

    def run() -> None:
        off = 0
        for p in records:
            n = len(p)
            start = off + 16
            mm[start : start + n] = p
            pack(mm, off + 8, zlib.crc32(p, info_crc), info)
            pack(mm, off, 0x8BF1A7D3, n)
            off = start + n

    return run


async def child(measure: str, n: int) -> None:
    from bench_procedural import make_tool_turns
    from bench_sync_turn import control_work

    from hermes_async_memory import MemoryPipeline, Settings
    from hermes_async_memory.turns import encode_turn

    quiet_logs()
    corpus = Corpus()
    rng = random.Random(11)
    sids = [corpus.session_id(s, 0) for s in range(SESSIONS)]
    uids = [corpus.user_id(s) for s in range(SESSIONS)]
    texts = [corpus.turn(rng, i % corpus.spec.users) for i in range(4_000)]
    plain = [(*texts[i % len(texts)], sids[i % SESSIONS], uids[i % SESSIONS])
             for i in range(n)]
    ints = list(range(n))
    keys = [(sid, uid) for _u, _a, sid, uid in plain]
    tools: list[tuple[str, str, str, str, Any]] = []
    if measure in ("sync_turn_tools", "loop5"):
        tools = [(u, a, sid, uid, m)
                 for sid, uid, u, a, m in make_tool_turns(corpus, n, SESSIONS, 5)]

    def loop1() -> None:
        for _ in ints:
            pass

    def loop4() -> None:
        for _u, _a, _sid, _uid in plain:
            pass

    def loop5() -> None:
        for _u, _a, _sid, _uid, _m in tools:
            pass

    def control() -> None:
        for i in ints:
            control_work(i, texts)

    runs: dict[str, Callable[[], None]] = {
        "loop1": loop1, "loop4": loop4, "loop5": loop5, "control": control}
    if measure == "mmap_append":
        runs[measure] = mmap_append(
            [encode_turn(f"bench-{i:x}", s, u, time.time(), a, b, None, None, 1 << 24)[0]
             for i, (a, b, s, u) in enumerate(plain)])
    if measure in runs:
        runs[measure]()  # once uncounted: what a first call does is not its cost
        sys.call_tracing(runs[measure], ())  # counted: callgrind collects inside it only
        return
    with scratch_dir("instructions") as d:
        async with MemoryPipeline(Settings(db_path=d / "m.db")) as mem:
            st, pf = mem.sync_turn, mem.prefetch

            def sync_turn() -> None:
                for u, a, sid, uid in plain:
                    st(u, a, session_id=sid, user_id=uid)

            def sync_turn_tools() -> None:
                for u, a, sid, uid, m in tools:
                    st(u, a, session_id=sid, user_id=uid, messages=m)

            def prefetch() -> None:
                for k in keys:
                    pf("", session_id=k[0], user_id=k[1])

            # Once uncounted, committed: every session's first turn (its ids checked, its
            # part of the record made), the interpreter's specialisations, and for prefetch
            # a turn in each session to make its cached block of.
            (sync_turn_tools if measure == "sync_turn_tools" else sync_turn)()
            await mem.flush(timeout=FLUSH_TIMEOUT_S)
            blocks = {k: pf("", session_id=k[0], user_id=k[1]) for k in keys}
            if not all(blocks.values()):
                raise RuntimeError("every session should have a cached block")
            get = blocks.get

            def dict_get() -> None:
                for k in keys:
                    get(k)

            run = {"sync_turn": sync_turn, "sync_turn_tools": sync_turn_tools,
                   "prefetch": prefetch, "dict_get": dict_get}[measure]
            if measure in ("prefetch", "dict_get"):
                run()
            sys.call_tracing(run, ())  # counted: callgrind collects inside this call only
            await mem.flush(timeout=FLUSH_TIMEOUT_S)


# -- the parent: every measure under callgrind --------------------------------------------


def count(measure: str, n: int, out_dir: Path) -> int:
    """Instructions callgrind counted inside the measure's ``sys.call_tracing``."""
    out = out_dir / f"{measure}.cg"
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        ["valgrind", "--tool=callgrind", "--collect-atstart=no",
         "--toggle-collect=sys_call_tracing", f"--callgrind-out-file={out}",
         sys.executable, __file__, "--child", measure, "--n", str(n)],
        capture_output=True, text=True, env=env, timeout=3_600)
    if proc.returncode != 0:
        raise RuntimeError(f"{measure} failed under callgrind:\n{proc.stderr[-3000:]}")
    found = _COLLECTED.findall(proc.stderr)
    if not found:
        raise RuntimeError(f"callgrind printed no count for {measure}:\n{proc.stderr[-2000:]}")
    return int(found[-1])


def main() -> list[Result]:
    p: argparse.ArgumentParser = parser(__doc__.splitlines()[0])
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        asyncio.run(child(args.child, args.n))
        return []
    n = 1_000 if args.quick else 3_000
    print(f"bench_instructions: {n:,} calls a measure, counted by callgrind ({machine()}; "
          f"library {library_version()})", flush=True)
    if shutil.which("valgrind") is None:
        print("valgrind is not installed: nothing counted (apt-get install valgrind)")
        report([], args.json)
        return []
    names = [*MEASURES, *sorted(set(MEASURES.values()))]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(os.cpu_count() or 2) as pool:
        counted = dict(zip(names, pool.map(lambda m: count(m, n, Path(tmp)), names),
                           strict=True))
    per_call = {m: (counted[m] - counted[loop]) / n for m, loop in MEASURES.items()}
    for m, loop in MEASURES.items():
        print(f"  {m}: {per_call[m]:,.0f} instructions a call ({counted[m]:,} counted, "
              f"{counted[loop]:,} for the empty loop)")

    def row(label: str, measure: str, base: str, base_label: str) -> Result:
        a, b = per_call[measure], per_call[base]
        return Result(label, f"{a:,.0f}", f"{base_label} {b:,.0f}", f"{a / b:.2f}x", "—", None)

    results = [
        row("sync_turn(), instructions a call (callgrind)", "sync_turn", "mmap_append",
            "mmap append"),
        row("sync_turn() with 5 tool calls, instructions a call (callgrind)", "sync_turn_tools",
            "sync_turn", "plain sync_turn"),
        row("pure-Python control (json.dumps + a hash), instructions a call (callgrind)",
            "control", "sync_turn", "plain sync_turn"),
        row("prefetch() warm, instructions a call (callgrind)", "prefetch", "dict_get",
            "dict.get"),
    ]
    report(results, args.json)
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
