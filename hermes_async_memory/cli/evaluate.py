"""``hermes-memory eval [--operations N] [--json] [--save FILE] [--compare FILE]``: the key-value
backends evaluated side by side (``memory.evaluation``).

It runs on a scratch store in a temporary folder, never on your memory: the local backend's
figures are this machine's SQLite, and Honcho's (when ``HERMES_MEMORY_BACKEND=honcho`` or
``HONCHO_API_KEY`` selects it) go to the configured server, on scratch users removed after.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .common import EXIT_OK, db_option, guarded, json_option, positive_int, print_json, table

DEFAULT_OPERATIONS = 200


def register(commands: Any) -> None:
    """Add ``eval`` to ``commands`` (argparse sub-parsers)."""
    ev = commands.add_parser(
        "eval", parents=[db_option(), json_option()],
        help="evaluate the key-value memory backends (latency, function, recall, privacy)",
        description="Run the same workload against every backend there is (null as the "
                    "baseline, the local SQLite store, and Honcho when configured), on a "
                    "scratch store and scratch users, and score them.",
    )
    ev.add_argument("--operations", type=positive_int, default=DEFAULT_OPERATIONS,
                    metavar="N", help=f"operations per measure (default {DEFAULT_OPERATIONS})")
    ev.add_argument("--save", type=Path, metavar="FILE", help="write the report as JSON")
    ev.add_argument("--compare", type=Path, metavar="FILE",
                    help="compare with a report saved earlier with --save")
    ev.set_defaults(handler=guarded(_eval))


def _eval(args: argparse.Namespace) -> int:
    import anyio

    from ..logs import configure_logging
    from .common import settings_of

    configure_logging(level="warning")  # stdout is the report's; warnings go to stderr
    earlier = _load(args.compare) if args.compare is not None else None
    settings = settings_of(args)
    report = anyio.run(_run, settings, args.operations)
    if args.save is not None:
        args.save.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", "utf-8")
    if args.json:
        if earlier is not None:
            from ..memory.evaluation import compare

            report = {**report, "compared_with": str(args.compare),
                      "comparison": compare(report, earlier)}
        print_json(report)
        return EXIT_OK
    _print(report)
    if earlier is not None:
        _print_comparison(report, earlier, args.compare)
    return EXIT_OK


async def _run(settings: Any, operations: int) -> dict[str, Any]:
    from ..memory.evaluation import evaluate_scratch

    return await evaluate_scratch(settings, operations=operations)


def _load(path: Path) -> dict[str, Any]:
    from ..errors import ConfigurationError

    try:
        data = json.loads(path.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"--compare {path}: not a saved report ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("evaluations"), list):
        raise ConfigurationError(f"--compare {path}: not a report saved by eval --save")
    return data


def _ms(v: dict[str, float] | None, which: str = "p99") -> str:
    return f"{v[which]:.2f}" if v else "-"


def _print(report: dict[str, Any]) -> None:
    rows = []
    for e in report["evaluations"]:
        lat = e["latency_ms"]
        passed = sum(1 for c in e["checks"].values() if c["passed"])
        rows.append([
            e["backend"], "yes" if e["available"] else "no", f"{passed}/{len(e['checks'])}",
            f"{_ms(lat.get('store'), 'p50')} / {_ms(lat.get('store'))}",
            _ms(lat.get("store_visible")), _ms(lat.get("retrieve")), _ms(lat.get("query")),
            _ms(lat.get("recall")),
            f"{e['recall'].get('hit@1', 0):.2f} / {e['recall'].get('hit@3', 0):.2f} / "
            f"{e['recall'].get('mrr', 0):.2f}",
            "cloud" if e["is_cloud"] else "local",
            f"{e['score']} {e['label']}",
        ])
    print(f"key-value backends, {report['operations']} operations per measure "
          "(latency in ms; writes to the receipt and to visibility)")
    table(["BACKEND", "AVAILABLE", "FUNCTION", "STORE p50/p99", "VISIBLE p99",
           "RETRIEVE p99", "QUERY p99", "RECALL p99", "HIT@1/HIT@3/MRR", "DATA", "SCORE"],
          rows)
    print()
    for e in report["evaluations"]:
        failed = {n: c["reason"] for n, c in e["checks"].items() if not c["passed"]}
        parts = ", ".join(f"{k} {v}" for k, v in e["parts"].items())
        print(f"{e['backend']}: {parts}; data in {e['location']}"
              + ("; a key is required" if e["key_required"] else ""))
        for name, reason in failed.items():
            print(f"  FAIL {name}: {reason}")
        for note in e["notes"]:
            print(f"  note: {note}")
        if not e["cleaned_up"]:
            print("  WARNING: the scratch users' entries were not all removed")
    if "your_store" in report:
        print(f"(run on a scratch store, since removed; your memory is at "
              f"{report['your_store']} and was not touched)")
    print()
    print(report["scoring"]["explained"])
    print(report["recommendation"])


def _print_comparison(report: dict[str, Any], earlier: dict[str, Any], path: Path) -> None:
    from ..memory.evaluation import compare

    print()
    print(f"compared with {path}:")
    rows = []
    for c in compare(report, earlier):
        then, now = c["score"]
        ops = ", ".join(f"{op} {a if a is not None else '-'} -> {b if b is not None else '-'}"
                        for op, (a, b) in c["p99_ms"].items())
        rows.append([c["backend"], f"{then} -> {now} ({now - then:+d})",
                     f"{c['label'][0]} -> {c['label'][1]}", ops])
    table(["BACKEND", "SCORE", "LABEL", "P99 MS THEN -> NOW"], rows)
