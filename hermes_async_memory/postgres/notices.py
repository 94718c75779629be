"""What a write tells the other machines: ``NOTIFY`` on ``WRITES_CHANNEL`` at its commit,
naming its origin and the users (and user-less sessions) it wrote; read back into a
``WriteNotice`` by every gateway's watch (``backend.PostgresBackend.watch``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import structlog

from ..backends.base import WriteNotice

log = structlog.get_logger(__name__)

WRITES_CHANNEL = "hermes_writes"
# NOTIFY refuses a payload of 8,000 bytes or more; past this the payload says "everyone".
MAX_NOTIFY_BYTES = 7900


def notify_payload(origin: str, users: Iterable[str], sessions: Iterable[str]) -> str:
    """JSON naming the writer's ``origin``, the users and the (user-less) sessions written;
    ``"all"`` rather than names when they would not fit a notification."""
    payload = json.dumps({"origin": origin, "users": sorted(users),
                          "sessions": sorted(sessions)}, separators=(",", ":"))
    if len(payload.encode()) <= MAX_NOTIFY_BYTES:
        return payload
    return json.dumps({"origin": origin, "all": True}, separators=(",", ":"))


def parse_notice(payload: str, own_origin: str) -> WriteNotice | None:
    """The notice a ``notify_payload`` carries; None for ``own_origin``'s. A payload that is
    not ours to read (another program on the channel) counts as everyone's writes."""
    try:
        data = json.loads(payload)
        if data.get("origin") == own_origin:
            return None
        if data.get("all"):
            return WriteNotice(everyone=True)
        return WriteNotice(frozenset(map(str, data["users"])),
                           frozenset(map(str, data["sessions"])))
    except (ValueError, TypeError, KeyError, AttributeError):
        log.warning("postgres_notice_unreadable", size=len(payload))
        return WriteNotice(everyone=True)
