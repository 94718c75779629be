"""The outbox: the durable accept log, and the writer's queue.

    records.py   the record format, and reading records back without the lock
    segments.py  segment files: created, mapped, scanned, quarantined, prefaulted
    log.py       the Outbox: append (any thread), read and settle (the writer), upkeep
"""

from __future__ import annotations

from .log import (
    KIND,
    N_MESSAGES,
    OFFSET,
    PAYLOAD,
    SEGMENT,
    SEQ,
    Outbox,
    OutboxBusyError,
    OutboxCounts,
    Record,
    Recovery,
)
from .records import HEADER_BYTES, KIND_TURN, RecordSummary, inspect
from .segments import QUARANTINE_DIR, os_error

__all__ = [
    "HEADER_BYTES",
    "KIND",
    "KIND_TURN",
    "N_MESSAGES",
    "OFFSET",
    "PAYLOAD",
    "QUARANTINE_DIR",
    "SEGMENT",
    "SEQ",
    "Outbox",
    "OutboxBusyError",
    "OutboxCounts",
    "Record",
    "RecordSummary",
    "Recovery",
    "inspect",
    "os_error",
]
