"""The pipeline's figures over the last hour, for the inspector's charts.

A ``Sampler`` thread reads a stats snapshot every ``interval_s`` (the same read /healthz
makes: one call onto the pipeline's loop, answered in microseconds) and keeps an hour of
``Sample``s. Rates come from the difference between neighbouring samples: commits per
second, and the share of prefetch calls the cache answered.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog

from ..stats import PipelineStats

log = structlog.get_logger(__name__)

WINDOW_S = 3600.0
DEFAULT_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # wall-clock seconds
    queued_turns: int
    pending_turns: int
    oldest_pending_age_s: float
    committed_turns: int
    recall_hits: int
    recall_misses: int
    write_to_visible_p50_ms: float
    write_to_visible_p99_ms: float
    replica_pending: int

    @classmethod
    def of(cls, stats: PipelineStats, at: float) -> Sample:
        return cls(at, stats.queued_turns, stats.pending_turns, stats.oldest_pending_age_s,
                   stats.committed_turns, stats.recall_hits, stats.recall_misses,
                   stats.write_to_recallable_p50_ms, stats.write_to_recallable_p99_ms,
                   stats.replica_pending)


class Series:
    """The last hour of samples (thread-safe: the sampler adds, requests read)."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._samples: deque[Sample] = deque(maxlen=int(WINDOW_S / interval_s) + 1)
        self._lock = threading.Lock()

    def add(self, stats: PipelineStats, at: float | None = None) -> None:
        with self._lock:
            self._samples.append(Sample.of(stats, time.time() if at is None else at))

    def __len__(self) -> int:
        with self._lock:
            return len(self._samples)

    def as_json(self) -> dict[str, Any]:
        """Columns for the charts: ``t`` (seconds) and one list per figure, aligned; a rate
        is None at the first sample, and the hit rate where no prefetch was made."""
        with self._lock:
            samples = list(self._samples)
        out: dict[str, list[Any]] = {k: [] for k in (
            "t", "queued_turns", "pending_turns", "oldest_pending_age_s", "commits_per_s",
            "write_to_visible_p50_ms", "write_to_visible_p99_ms", "recall_hit_rate",
            "replica_pending")}
        prev: Sample | None = None
        for s in samples:
            out["t"].append(round(s.at, 3))
            out["queued_turns"].append(s.queued_turns)
            out["pending_turns"].append(s.pending_turns)
            out["oldest_pending_age_s"].append(round(s.oldest_pending_age_s, 3))
            out["write_to_visible_p50_ms"].append(round(s.write_to_visible_p50_ms, 3))
            out["write_to_visible_p99_ms"].append(round(s.write_to_visible_p99_ms, 3))
            out["replica_pending"].append(s.replica_pending)
            rate: float | None = None
            hit_rate: float | None = None
            if prev is not None and s.at > prev.at:
                # A restart of the pipeline sets its counters back: no negative rates.
                rate = max(0, s.committed_turns - prev.committed_turns) / (s.at - prev.at)
                hits = max(0, s.recall_hits - prev.recall_hits)
                asked = hits + max(0, s.recall_misses - prev.recall_misses)
                hit_rate = hits / asked if asked else None
            out["commits_per_s"].append(None if rate is None else round(rate, 3))
            out["recall_hit_rate"].append(None if hit_rate is None else round(hit_rate, 4))
            prev = s
        return out


class Sampler:
    """Adds a sample to ``series`` every ``series.interval_s`` from ``read`` (which may
    raise: that round is skipped), in a daemon thread, until ``close()``."""

    def __init__(self, series: Series, read: Callable[[], PipelineStats]) -> None:
        self._series = series
        self._read = read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hermes-memory-ui-sampler",
                                        daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def _run(self) -> None:
        while True:
            try:
                self._series.add(self._read())
            except Exception as exc:  # the loop did not answer: a gap in the charts
                log.debug("ui_sample_skipped", error=str(exc))
            if self._stop.wait(self._series.interval_s):
                return

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
