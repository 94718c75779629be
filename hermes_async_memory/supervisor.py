"""The supervisor: every background part of the pipeline runs under it.

    part raises ─┬─ transient (busy store, I/O, full disk) ──► restarted with backoff;
                 │                                              health shows it meanwhile
                 └─ anything else ──► the pipeline's failed state, naming the part and cause:
                                     flush() and every waiter raise PipelineFailedError,
                                     health is 503, the worker process exits with its code
    part returns ──► done (only at shutdown)

Parts run in one anyio task group, so closing the pipeline cancels them all at once.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
import structlog
from anyio.abc import TaskStatus

from .errors import PipelineFailedError, describe
from .faults import Fault, classify, unwrap
from .retry import Backoff

log = structlog.get_logger(__name__)

# The two full-disk conditions: the outbox cannot make a turn durable (sync_turn refuses it),
# or the store cannot commit (turns wait, durable, in the outbox).
DISK_FULL = "disk_full"
DISK_FULL_STORE = "disk_full_store"
# The replica backend cannot be reached: the pipeline accepts and commits locally, and the
# backlog waits (health stays ok; stats show the lag).
REPLICA_UNAVAILABLE = "replica_unavailable"
# The SQLite the store runs on has no FTS5 module: writes go on, searches raise
# FullTextUnavailableError and recalls find nothing (health stays ok; it lasts the run).
FULL_TEXT_UNAVAILABLE = "full_text_unavailable"

# A part that ran this long since its last restart starts its backoff afresh, and no longer
# shows as restarting in health.
_HEALTHY_AFTER_S = 30.0


@dataclass(frozen=True, slots=True)
class Health:
    """What ``/healthz`` says: whether the pipeline works, and what troubles it meanwhile."""

    state: str  # "new", "open", "failed", "closing" or "closed"
    ok: bool
    reason: str | None = None  # why not ok
    # Passing troubles, by name: "disk_full", "disk_full_store", "store_retrying",
    # "<part>_restarting", ...
    conditions: dict[str, str] = field(default_factory=dict)


class Conditions:
    """Named troubles that last a while and clear by themselves (a full disk, a busy store).

    A condition set with ``ttl_s`` clears itself that long after it was last set: a part
    restarted after a failure counts as troubled until it has run that long without one.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._active: dict[str, tuple[str, float | None]] = {}
        self._clock = clock
        self._on_clear: dict[str, list[Callable[[], None]]] = {}

    def set(self, name: str, detail: str, *, ttl_s: float | None = None) -> None:
        if name not in self:
            log.warning("condition_raised", condition=name, detail=detail)
        self._active[name] = (detail, None if ttl_s is None else self._clock() + ttl_s)

    def clear(self, name: str) -> None:
        if self._active.pop(name, None) is not None:
            log.info("condition_cleared", condition=name)
            for callback in self._on_clear.get(name, ()):
                callback()

    def on_clear(self, name: str, callback: Callable[[], None]) -> None:
        """Call ``callback()`` each time the condition ``name`` clears."""
        self._on_clear.setdefault(name, []).append(callback)

    def disk_full(self) -> str | None:
        """What a full disk stops, if the disk is full."""
        snapshot = self.snapshot()
        return snapshot.get(DISK_FULL) or snapshot.get(DISK_FULL_STORE)

    def __contains__(self, name: object) -> bool:
        item = self._active.get(name)  # type: ignore[call-overload]
        return item is not None and (item[1] is None or item[1] > self._clock())

    def snapshot(self) -> dict[str, str]:
        now = self._clock()
        return {name: detail for name, (detail, until) in list(self._active.items())
                if until is None or until > now}


Part = Callable[[], Awaitable[None]]


class Supervisor:
    """Starts named parts, restarts the transient failures, reports the rest."""

    def __init__(self, *, backoff: Backoff, conditions: Conditions,
                 on_failure: Callable[[PipelineFailedError], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._parts: list[tuple[str, Part]] = []
        self._backoff = backoff
        self._conditions = conditions
        self._on_failure = on_failure
        self._clock = clock
        self.restarts: dict[str, int] = {}

    def add(self, name: str, part: Part) -> None:
        self._parts.append((name, part))
        self.restarts[name] = 0

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Run every part until all return or the caller cancels."""
        async with anyio.create_task_group() as tg:
            for name, part in self._parts:
                tg.start_soon(self._keep, name, part, name=f"hermes-memory-{name}")
            task_status.started()

    async def _keep(self, name: str, part: Part) -> None:
        failures = 0
        while True:
            started = self._clock()
            try:
                await part()
                return
            except Exception as raised:  # the per-part boundary: restart, or fail the pipeline
                # A part with a task group of its own raises a group: name what is inside.
                exc = unwrap(raised)
                if classify(exc) is not Fault.TRANSIENT:
                    log.critical("pipeline_part_failed", part=name, error=describe(exc),
                                 exc_info=exc)
                    self._on_failure(PipelineFailedError(name, exc))
                    return
                failures = 1 if self._clock() - started > _HEALTHY_AFTER_S else failures + 1
                self.restarts[name] += 1
                delay = self._backoff.delay(failures)
                self._conditions.set(f"{name}_restarting", describe(exc),
                                     ttl_s=delay + _HEALTHY_AFTER_S)
                log.warning("pipeline_part_restarting", part=name, attempt=failures,
                            retry_in_s=round(delay, 3), error=describe(exc), exc_info=exc)
            await anyio.sleep(delay)
