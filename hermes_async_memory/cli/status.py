"""``hermes-memory status [--json]``: the store's counts, the outbox depth, the lag, the
dead letters, and the word index's rebuild while one is under way (after an upgrade from a
store made before the index stemmed: a worker or pipeline on the file rebuilds it in slices,
and searches read the old index until it ends)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .common import (
    EXIT_OK,
    age,
    db_option,
    guarded,
    json_option,
    open_reader,
    print_json,
    settings_of,
)

if TYPE_CHECKING:
    from ..outbox import RecordSummary
    from ..settings import Settings


def register(commands: Any) -> None:
    """Add ``status`` to ``commands`` (argparse sub-parsers)."""
    status = commands.add_parser(
        "status", parents=[db_option(), json_option()],
        help="counts, outbox depth, lag, dead letters, word index rebuild",
        description="Show the store's counts, the turns accepted but not committed yet (the "
                    "outbox depth), the age of the oldest of them, the dead letters, and "
                    "the word index's rebuild after an upgrade while one is under way. "
                    "Reads only; works while a worker runs on the file.",
    )
    status.set_defaults(handler=guarded(_status))


def outbox_dirs(settings: Settings) -> list[Path]:
    """The outbox folders beside the store: the pipeline's, and any producer slots'."""
    main = settings.outbox_dir
    found = [main] if main.is_dir() else []
    found += sorted(p for p in main.parent.glob(main.name + "-p*")
                    if p.is_dir() and p.name[len(main.name) + 2:].isdigit())
    return found


def _scan_outbox(settings: Settings) -> tuple[list[Path], list[RecordSummary]]:
    """The segment files and every intact record in the outbox folders, read-only and
    without their locks.

    Raises:
        OSError: a folder or segment cannot be read (permissions).
    """
    from ..outbox import inspect

    segments: list[Path] = []
    records: list[RecordSummary] = []
    for directory in outbox_dirs(settings):
        found_segments, found_records = inspect(directory)
        segments += found_segments
        records += found_records
    return segments, records


def _destroyed(settings: Settings) -> int:
    """Acknowledged turns recorded destroyed in the outbox folders and not cleared since."""
    from ..outbox.destroyed import read_destroyed

    docs = [read_destroyed(d) for d in outbox_dirs(settings)]
    return sum(int(doc.get("turns", 0)) for doc in docs if doc is not None)


def _status(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    report: dict[str, Any] = {"db": str(settings.db_path)}
    with open_reader(settings) as reader:
        # The segments first, the store second: a turn committed in between then counts as
        # committed, never as both or neither.
        scan: tuple[list[Path], list[RecordSummary]] | None
        try:
            scan = _scan_outbox(settings)
            outbox_error = None
        except OSError as exc:
            scan, outbox_error = None, f"cannot read the outbox: {exc}"
        keys = [r.key for r in scan[1] if r.key is not None] if scan else []
        counts = reader.status(keys)
    now = time.time()
    pending: list[RecordSummary] = []
    if scan is not None:
        # A segment file is deleted only once all its turns are settled; one gone since the
        # scan may have had its done keys pruned meanwhile, so it counts as settled.
        live = {p for p in scan[0] if p.exists()}
        pending = [r for r in scan[1]
                   if r.segment in live and (r.key is None or r.key not in counts.settled_keys)]
    accepted = [r.accepted_at for r in pending if r.accepted_at is not None]
    if counts.inbox_oldest is not None:
        accepted.append(counts.inbox_oldest)
    report.update(
        messages=counts.messages,
        sessions=counts.sessions,
        outbox_pending_turns=None if scan is None else len(pending) + counts.inbox_turns,
        outbox_segment_files=None if scan is None else len(scan[0]),
        inbox_turns=counts.inbox_turns,
        outbox_unreadable_records=sum(r.key is None for r in pending),
        outbox_error=outbox_error,
        outbox_destroyed_turns=_destroyed(settings),
        lag_s=round(max(0.0, now - min(accepted)), 3) if accepted else None,
        dead_letters=counts.outbox_table.get("dead", 0),
        outbox_table=counts.outbox_table,
        replicas=counts.replicas,
        # Both 0 when no rebuild is under way, as in the pipeline's stats().
        reindex_done=0 if counts.reindex is None else counts.reindex.indexed,
        reindex_total=0 if counts.reindex is None else counts.reindex.total,
        # Since when the full-text indexes are not kept (no FTS5 where the store was
        # committed), or None.
        full_text_off_since=counts.full_text_off_since,
    )
    if args.json:
        print_json(report)
        return EXIT_OK
    _print_status(report)
    return EXIT_OK


def _print_status(r: dict[str, Any]) -> None:
    rows = [("store", r["db"]), ("messages", str(r["messages"])),
            ("sessions", str(r["sessions"]))]
    table = ", ".join(f"{k} {v}" for k, v in sorted(r["outbox_table"].items())) or "empty"
    if r["outbox_pending_turns"] is None:
        rows.append(("outbox", f"unknown ({r['outbox_error']}); the outbox table holds "
                               f"{table}"))
    else:
        files = r["outbox_segment_files"]
        line = (f"{r['outbox_pending_turns']} turns accepted, not committed yet "
                f"({files} segment file{'' if files == 1 else 's'})")
        if r["inbox_turns"]:
            line += f"; {r['inbox_turns']} of them handed in to the shared inbox"
        if r["outbox_unreadable_records"]:
            line += f"; {r['outbox_unreadable_records']} records do not decode"
        rows.append(("outbox", line))
    if r["outbox_destroyed_turns"]:
        rows.append(("destroyed", f"{r['outbox_destroyed_turns']} acknowledged turns were "
                                  "destroyed in the outbox (a segment cut short); clear "
                                  "with: hermes-memory outbox clear-destroyed"))
    rows.append(("lag", "-" if r["lag_s"] is None
                 else f"{age(r['lag_s'])} (the oldest turn not committed yet)"))
    rows.append(("dead letters", str(r["dead_letters"])))
    if r["reindex_total"]:
        rows.append(("word index", reindex_line(r["reindex_done"], r["reindex_total"])))
    if r.get("full_text_off_since") is not None:
        rows.append(("full text", "not kept (the process that commits the store has no "
                                  "FTS5): searches fail, recalls find nothing; the next one "
                                  "with FTS5 rebuilds the indexes"))
    rows.append(("outbox table", table))
    for backend, counts in r["replicas"].items():
        rows.append((f"replica {backend}", f"{counts['pending']} turns to send, "
                                           f"{counts['dead']} dead letters"))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name.ljust(width)}  {value}")


def reindex_line(done: int, total: int) -> str:
    """The word index's rebuild as a person reads it: "rebuilding, 125 of 1,200 messages
    (10%); ..." (the share rounded down: 100% only once every message is indexed)."""
    share = min(100, done * 100 // total) if total else 100
    return (f"rebuilding, {done:,} of {total:,} messages ({share}%); searches read the old "
            "index until it ends")
