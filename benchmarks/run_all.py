"""Run every benchmark, one process each, and print the README's results table (markdown).

    .venv/bin/python benchmarks/run_all.py [--quick] [--only NAME ...] [--update-readme]
                                           [--locomo DIR]

Before each benchmark the machine's CPU use is sampled while nothing of ours runs, waiting
(up to --wait-quiet seconds) for two quiet seconds in a row: latency tails on a 2-core
machine move a lot when something else is busy, so the table also says how quiet it was.
--locomo DIR also runs bench_locomo.py (recall relevance) on that folder of LoCoMo
conversations (shared/data/locomo-dev), the PostgreSQL store's recall included
(``--postgres``); without it, that benchmark is left out.
--update-readme replaces the table between the ``<!-- results:start -->`` and
``<!-- results:end -->`` markers of benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import BENCH_DIR, library_version, machine

BENCHMARKS = (
    "prefetch", "sync_turn", "instructions", "throughput", "loop_lag", "memory", "recall",
    "flush", "hermes", "hermes_state", "honcho", "kv", "sessions", "procedural", "postgres",
    "ui",
)
START, END = "<!-- results:start -->", "<!-- results:end -->"
QUIET_BELOW = 0.15
BENCH_TIMEOUT_S = 1_200.0  # share of all CPUs busy with other work


def cpu_busy(seconds: float = 1.0) -> float:
    """Share of all CPUs busy over ``seconds`` (from /proc/stat), while we only sleep."""

    def snap() -> tuple[int, int]:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + fields[4]
        return sum(fields), idle

    try:
        t0, i0 = snap()
        time.sleep(seconds)
        t1, i1 = snap()
    except OSError:
        return float("nan")
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


def busy_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs since boot."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def wait_quiet(max_wait_s: float, threshold: float = QUIET_BELOW) -> float:
    """Wait (up to ``max_wait_s``) for two quiet seconds in a row; return the last sample."""
    deadline = time.monotonic() + max_wait_s
    quiet = 0
    busy = cpu_busy()
    while time.monotonic() < deadline:
        quiet = quiet + 1 if busy < threshold else 0
        if quiet >= 2:
            break
        if quiet == 0:
            print(f"  machine {busy:.0%} busy: waiting for it to be quiet…", flush=True)
        busy = cpu_busy()
    return busy


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    p.add_argument("--only", action="append", choices=(*BENCHMARKS, "locomo"),
                   help="run only these")
    p.add_argument("--locomo", type=Path, default=None, metavar="DIR",
                   help="also run bench_locomo.py on this folder of LoCoMo conversations")
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="before each benchmark, wait up to this long for the machine to be quiet (0: no)",
    )
    p.add_argument(
        "--update-readme", action="store_true", help="write the table into benchmarks/README.md"
    )
    args = p.parse_args()
    names = args.only or [*BENCHMARKS, *(["locomo"] if args.locomo else [])]
    if "locomo" in names and args.locomo is None:
        p.error("bench_locomo needs its data: --locomo DIR")
    rows: list[dict[str, object]] = []
    notes = []
    failed = []
    began = time.perf_counter()
    versions = []
    for name in names:
        busy = wait_quiet(args.wait_quiet) if args.wait_quiet > 0 else cpu_busy()
        versions.append(library_version())
        script = BENCH_DIR / f"bench_{name}.py"
        print(f"\n=== {script.name} (machine busy before start: {busy:.0%}) ===", flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            out = Path(tmp.name)
        cmd = [sys.executable, str(script), "--json", str(out)] + (
            ["--quick"] if args.quick else []
        ) + ([str(args.locomo), "--postgres"] if name == "locomo" else [])
        t0 = time.perf_counter()
        b0, j0 = busy_jiffies()
        c0 = children_cpu_s()
        try:
            code = subprocess.call(cmd, timeout=BENCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            print(f"--- {script.name}: killed after {BENCH_TIMEOUT_S:.0f} s", flush=True)
            code = -1
        wall = time.perf_counter() - t0
        b1, j1 = busy_jiffies()
        # The CPU others used while it ran: all busy time minus the benchmark's own.
        hz = os.sysconf("SC_CLK_TCK")
        others = ((b1 - b0) / hz - (children_cpu_s() - c0)) / max(1e-9, (j1 - j0) / hz)
        others = max(0.0, others)
        notes.append(f"{name} {busy:.0%} before / {others:.0%} during")
        print(
            f"--- {script.name}: {wall:.0f} s, exit {code}; others used {others:.0%} of the "
            f"machine meanwhile",
            flush=True,
        )
        if code != 0 or not out.stat().st_size:
            failed.append(name)
        else:
            written = json.loads(out.read_text())
            # A list of rows; bench_locomo writes an object: its rows and every question.
            rows.extend(written["rows"] if isinstance(written, dict) else written)
        out.unlink(missing_ok=True)

    def verdict(met: object) -> str:
        return "—" if met is None else ("yes" if met else "**no**")

    def table(rows: list[dict[str, object]]) -> list[str]:
        return [
            "| benchmark | result | baseline | ratio | goal | met |",
            "|---|---|---|---|---|---|",
            *(
                f"| {r['benchmark']} | {r['result']} | {r['baseline']} | {r['ratio']} | "
                f"{r['goal']} | {verdict(r['met'])} |"
                for r in rows
            ),
        ]

    # First the figures issue 9 asks for (throughput against the matched baseline, sync_turn
    # and prefetch p99, the longest loop stall, RSS per pending turn), then every row.
    headline = [r for r in rows if r.get("headline")]
    lines = (["**Headline**", "", *table(headline), "", "**All results**", ""]
             if headline else []) + table(rows)
    version = (
        versions[0]
        if len(set(versions)) == 1
        else ", ".join(f"{n} {v}" for n, v in zip(names, versions, strict=True))
    )
    stamp = (
        f"Measured {time.strftime('%Y-%m-%d')} on {machine()}; library at "
        f"{version}{'; --quick run' if args.quick else ''}. CPU used by other processes "
        f"(share of the 2 CPUs) before and during each benchmark: {', '.join(notes)}."
    )
    table = "\n".join(lines) + "\n\n" + stamp + "\n"
    print(f"\n=== all done in {time.perf_counter() - began:.0f} s ===\n")
    print(table)
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    if args.update_readme:
        readme = BENCH_DIR / "README.md"
        text = readme.read_text()
        if START in text and END in text:
            head, rest = text.split(START, 1)
            _, tail = rest.split(END, 1)
            readme.write_text(f"{head}{START}\n{table}{END}{tail}")
            print(f"updated {readme}")
        else:
            print(f"{readme} has no {START} … {END} markers; not updated")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
