"""Counters the pipeline keeps, and the snapshot stats() returns."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

_RATE_WINDOW_S = 10.0
_LATENCY_SAMPLES = 4096


@dataclass(frozen=True, slots=True)
class PipelineStats:
    """A snapshot of the pipeline's state, queues, bounded structures and throughput."""

    accepted_turns: int
    committed_turns: int
    queued_turns: int  # accepted, not yet read by the writer
    queued_bytes: int  # the bytes of every turn accepted and not yet settled
    deferred_turns: int  # pending turns past max_queued_turns (the writer is behind)
    oldest_pending_age_s: float
    batches_committed: int
    rows_committed: int
    batches_per_s: float
    rows_per_s: float
    recall_hits: int
    recall_misses: int
    recalls_run: int
    recalls_shared: int
    recalls_shed: int
    recall_errors: int
    write_to_recallable_p50_ms: float
    write_to_recallable_p99_ms: float
    commit_retries: int
    dead_letters: int
    sanitized_turns: int
    outbox_segments: int
    # The state, and what is wrong (see health()).
    state: str = "open"
    failure: str | None = None
    conditions: tuple[str, ...] = ()
    part_restarts: int = 0
    # The size of every bounded structure.
    pending_turns: int = 0  # accepted, not settled
    recovered_turns: int = 0  # left by an earlier run, found at start
    cache_entries: int = 0
    pending_recalls: int = 0
    recalls_in_flight: int = 0
    warm_backlog: int = 0
    warms_shed: int = 0
    sessions_warmed: int = 0
    flush_waiters: int = 0
    # Damaged outbox bytes set aside at start (see the outbox's quarantine folder).
    quarantined_regions: int = 0
    quarantined_bytes: int = 0
    # Acknowledged outbox records found destroyed (a segment cut short), until an operator
    # clears it: ``hermes-memory outbox clear-destroyed``.
    destroyed_turns: int = 0
    # Times the heap's free memory was given back to the system after a backlog drained.
    heap_trims: int = 0
    # Several processes, one memory (a worker's view; zero elsewhere).
    role: str = "embedded"
    inbox_turns: int = 0
    inbox_oldest_age_s: float = 0.0
    inbox_committed_turns: int = 0
    leases_lost: int = 0
    recalls_served: int = 0
    # The replica backend (zero without one): turns it has, waiting, failed for now, dead.
    replicated_turns: int = 0
    replica_pending: int = 0
    replica_errors: int = 0
    replica_dead: int = 0
    # How long the oldest record still waiting for the replica has waited since its accept;
    # whether the backend can be reached now; cached blocks served stale because the
    # backend could not be asked (its last good block is kept); recalls queued because
    # another machine wrote the user's memory (a shared store's notices).
    replica_lag_s: float = 0.0
    replica_available: bool = True
    stale_blocks: int = 0
    refreshes_queued: int = 0
    # Tool answers a rule of the tool log raised on (a bug): logged as successes, each error
    # logged as tool_outcome_failed.
    tool_judge_errors: int = 0
    # The word index's rebuild after an upgrade (a store made before it stemmed): messages
    # indexed of those there at its start; both 0 when none is under way. Until it ends,
    # recall and search read the old index.
    reindex_done: int = 0
    reindex_total: int = 0


def percentile(samples: list[float], q: float) -> float:
    if not samples:
        return 0.0
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


class Meter:
    """Batches and rows over a sliding window, and recent write-to-recallable latencies."""

    def __init__(self) -> None:
        self.batches = 0
        self.rows = 0
        self.turns = 0
        self._window: deque[tuple[float, int]] = deque(maxlen=4096)
        self.latencies_s: deque[float] = deque(maxlen=_LATENCY_SAMPLES)

    def record_batch(self, now: float, turns: int, rows: int) -> None:
        self.batches += 1
        self.rows += rows
        self.turns += turns
        self._window.append((now, rows))

    def rates(self, now: float) -> tuple[float, float]:
        recent = [(t, r) for t, r in self._window if now - t <= _RATE_WINDOW_S]
        if not recent:
            return 0.0, 0.0
        span = max(now - recent[0][0], 1e-3)
        return len(recent) / span, sum(r for _, r in recent) / span
