"""Acknowledged records an outbox segment lost (cut short, emptied): counted at start, kept
in ``DESTROYED.json`` beside the segments until an operator clears it, and shown as the
health condition ``outbox_records_destroyed`` meanwhile.

The loss itself cannot be undone (the bytes are gone); what this prevents is its silence.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import structlog

from ..errors import StoreAccessError

if TYPE_CHECKING:
    from ..store import SqliteStore
    from ..supervisor import Conditions
    from .log import Outbox

log = structlog.get_logger(__name__)

DESTROYED_FILE = "DESTROYED.json"
OUTBOX_DESTROYED = "outbox_records_destroyed"


def read_destroyed(directory: Path) -> dict[str, Any] | None:
    """What ``DESTROYED.json`` in the outbox folder holds, or None when there is none.

    Raises:
        StoreAccessError: it is there but cannot be read.
    """
    path = directory / DESTROYED_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise StoreAccessError(f"cannot read {path}: {exc}") from exc
    return doc if isinstance(doc, dict) else {"turns": 0, "events": []}


def clear_destroyed(directory: Path) -> dict[str, Any] | None:
    """Remove ``DESTROYED.json``: the operator has seen the loss. Returns what it held.

    Raises:
        StoreAccessError: it cannot be read or removed.
    """
    doc = read_destroyed(directory)
    if doc is not None:
        try:
            (directory / DESTROYED_FILE).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreAccessError(f"cannot remove {directory / DESTROYED_FILE}: {exc}"
                                   ) from exc
    return doc


def _add(directory: Path, turns: int, segments: tuple[int, ...]) -> dict[str, Any]:
    doc = read_destroyed(directory) or {"turns": 0, "events": []}
    doc["turns"] = int(doc.get("turns", 0)) + turns
    doc.setdefault("events", []).append(
        {"found_at": time.time(), "turns": turns, "segments": list(segments)})
    path = directory / DESTROYED_FILE
    tmp = path.with_suffix(".tmp")
    try:
        with open(tmp, "w") as f:
            os.fchmod(f.fileno(), 0o600)
            json.dump(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        # Said at error level all the same (the caller's line); only its keeping failed.
        log.error("outbox_destroyed_record_not_kept", path=str(path), error=str(exc))
    return doc


def describe_destroyed(doc: dict[str, Any]) -> str:
    segments = sorted({n for e in doc.get("events", []) for n in e.get("segments", [])})
    return (f"{doc.get('turns', 0)} acknowledged records were destroyed in the outbox "
            f"(segments {', '.join(map(str, segments)) or 'unknown'} cut short); "
            "clear with: hermes-memory outbox clear-destroyed")


async def report_destroyed(outbox: Outbox, store: SqliteStore, conditions: Conditions) -> None:
    """At start, after the outbox opened: count what its segments cut short lost, keep it,
    say it at error level, and raise the condition (also for a loss found by an earlier
    start and not cleared since)."""
    cut = outbox.cut_short()
    doc: dict[str, Any] | None
    if cut:
        stored = await store.keys_by_segment(cut[0] - 1)
        found = outbox.count_destroyed(stored)
        doc = await anyio.to_thread.run_sync(_add, outbox.directory, found.turns,
                                             found.segments)
        log.error("outbox_records_destroyed", turns=found.turns, segments=list(found.segments),
                  outbox=str(outbox.directory),
                  detail="acknowledged turns are lost; the count is a lower bound when "
                         "nothing written after the cut tells the number")
    else:
        doc = await anyio.to_thread.run_sync(read_destroyed, outbox.directory)
    if doc is not None:
        outbox.destroyed_turns = int(doc.get("turns", 0))
        conditions.set(OUTBOX_DESTROYED, describe_destroyed(doc))
