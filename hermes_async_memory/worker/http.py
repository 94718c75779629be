"""The worker's HTTP endpoints: ``GET /healthz`` and ``GET /metrics`` (Prometheus text).

    HTTP thread (wsgiref, one thread per request)
      /healthz ─┐
      /metrics ─┴─► snapshot: call_soon_threadsafe onto the pipeline's loop ──► stats()
                    (no answer within stats_timeout_s: "event loop unresponsive")
    pipeline's loop ──► PrometheusObserver (histograms: batch size, commit and recall time)

``stats()`` is read on the loop's thread because the loop mutates the deques it reads. The
metrics live in a private ``CollectorRegistry``, never the process-global one, so two servers
(or a test and a server) never share a series.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final
from wsgiref.simple_server import WSGIServer

import structlog
from prometheus_client import CollectorRegistry, Histogram, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..metrics import PipelineObserver
from ..pipeline import MemoryPipeline
from ..stats import PipelineStats
from ..supervisor import Health
from ..ui.access import Access
from .wsgi import WsgiServer, serve_wsgi

if TYPE_CHECKING:
    import asyncio

    from _typeshed.wsgi import StartResponse, WSGIApplication, WSGIEnvironment

    from ..ui.app import InspectorApp

log = structlog.get_logger(__name__)

DEFAULT_HOST = "127.0.0.1"
# How long a request waits for the pipeline's loop to read stats(). A healthy loop answers in
# microseconds; one that stays silent this long is stalled, and /healthz says so.
STATS_TIMEOUT_S = 1.0
PREFIX: Final = "hermes_memory_"
# Turns per batch: up to the default max_batch (2000).
BATCH_TURNS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
COMMIT_SECONDS_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
# A recall answers in about a millisecond; a slow one waits out its write barrier (1 s).
RECALL_SECONDS_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
)
_JSON = [("Content-Type", "application/json"), ("Cache-Control", "no-store")]

_Field = Callable[[PipelineStats], float]
# (name without prefix, help, value): queue depths and other values that go up and down.
_GAUGES: tuple[tuple[str, str, _Field], ...] = (
    ("queued_turns", "Turns accepted and not yet read by the writer.",
     lambda s: s.queued_turns),
    ("pending_turns", "Turns accepted and not yet settled (committed or dead-lettered).",
     lambda s: s.pending_turns),
    ("queued_bytes", "Bytes of the turns accepted and not yet settled.",
     lambda s: s.queued_bytes),
    ("deferred_turns", "Pending turns past max_queued_turns: the writer is behind.",
     lambda s: s.deferred_turns),
    ("oldest_pending_age_seconds", "Age of the oldest accepted turn not yet settled.",
     lambda s: s.oldest_pending_age_s),
    ("outbox_segments", "Outbox segment files on disk.", lambda s: s.outbox_segments),
    ("outbox_destroyed_turns", "Acknowledged turns found destroyed in cut-short outbox "
     "segments, until `hermes-memory outbox clear-destroyed`.", lambda s: s.destroyed_turns),
    ("inbox_turns", "Turns producers handed to the shared inbox, not yet committed (worker).",
     lambda s: s.inbox_turns),
    ("inbox_oldest_age_seconds", "Age of the oldest turn waiting in the shared inbox (worker).",
     lambda s: s.inbox_oldest_age_s),
    ("cache_entries", "(user, session) entries in the prefetch cache.",
     lambda s: s.cache_entries),
    ("pending_recalls", "Queued recalls not started yet.", lambda s: s.pending_recalls),
    ("recalls_in_flight", "Recalls running now.", lambda s: s.recalls_in_flight),
    ("warm_backlog", "Cache warm-ups queued or running.", lambda s: s.warm_backlog),
    ("flush_waiters", "flush() calls waiting.", lambda s: s.flush_waiters),
    ("replica_pending", "Records committed here and not yet in the replica backend.",
     lambda s: s.replica_pending),
    ("replica_dead", "Records the replica backend refused for good (its dead letters).",
     lambda s: s.replica_dead),
    ("replica_lag_seconds", "Age of the oldest record not yet in the replica backend.",
     lambda s: s.replica_lag_s),
    ("replica_available", "1 while the replica backend can be reached; else 0.",
     lambda s: 1 if s.replica_available else 0),
    ("stale_blocks", "Cached recall blocks served stale: the backend could not be asked.",
     lambda s: s.stale_blocks),
    ("failed", "1 once a part of the pipeline failed for good; see /healthz for the cause.",
     lambda s: 1 if s.failure else 0),
    ("conditions", "Passing troubles health reports now (a full disk, a store retried).",
     lambda s: len(s.conditions)),
)
# (name without prefix and "_total", help, value): counts since the pipeline started.
_COUNTERS: tuple[tuple[str, str, _Field], ...] = (
    ("accepted_turns", "Turns accepted, including those an earlier run left in the outbox.",
     lambda s: s.accepted_turns),
    ("committed_turns", "Turns committed to the store.", lambda s: s.committed_turns),
    ("batches_committed", "Batches committed, one transaction each.",
     lambda s: s.batches_committed),
    ("rows_committed", "Messages committed.", lambda s: s.rows_committed),
    ("heap_trims", "Times the heap's free memory went back to the system after a backlog.",
     lambda s: s.heap_trims),
    ("commit_retries", "Writes retried because the store was busy, locked or failing.",
     lambda s: s.commit_retries),
    ("dead_letters", "Turns the store rejected, moved to the dead letters.",
     lambda s: s.dead_letters),
    ("sanitized_turns",
     "Turns with text (NUL, lone surrogates) indexed as a U+FFFD copy; kept exactly.",
     lambda s: s.sanitized_turns),
    ("recall_hits", "prefetch() calls answered from the cache.", lambda s: s.recall_hits),
    ("recall_misses", "prefetch() calls with nothing cached.", lambda s: s.recall_misses),
    ("recalls_run", "Recalls run against the store.", lambda s: s.recalls_run),
    ("recalls_shared", "Recalls answered by an identical one already running.",
     lambda s: s.recalls_shared),
    ("recall_errors", "Recalls that failed.", lambda s: s.recall_errors),
    ("recalls_shed", "Queued recalls dropped past max_pending_recalls.",
     lambda s: s.recalls_shed),
    ("warms_shed", "Cache warm-ups dropped past max_pending_warms.", lambda s: s.warms_shed),
    ("part_restarts", "Background parts restarted after a transient failure.",
     lambda s: s.part_restarts),
    ("quarantined_bytes", "Damaged outbox bytes set aside at start.",
     lambda s: s.quarantined_bytes),
    ("replicated_turns", "Records the replica backend took.", lambda s: s.replicated_turns),
    ("replica_errors", "Records whose replica write failed and will be tried again.",
     lambda s: s.replica_errors),
    ("refreshes_queued", "Recalls queued because another machine wrote the user's memory.",
     lambda s: s.refreshes_queued),
    ("tool_judge_errors", "Tool answers a tool-log rule raised on, logged as successes.",
     lambda s: s.tool_judge_errors),
    ("inbox_committed_turns", "Turns from the shared inbox committed by this worker.",
     lambda s: s.inbox_committed_turns),
)
# The shared-job runner's counters (backend "postgres"), as hermes_memory_jobs_<name>_total.
_JOB_COUNTERS: tuple[tuple[str, str], ...] = (
    ("claims", "Claim queries made for shared jobs."),
    ("claimed", "Shared jobs claimed under a lease."),
    ("completed", "Shared jobs completed."),
    ("failed", "Shared job runs that failed and go back for a retry."),
    ("leases_lost", "Shared jobs whose lease was lost (another worker may take them)."),
    ("dead", "Shared jobs given up after their last attempt."),
    ("given_back", "Unfinished shared jobs handed back at stop."),
)
_UP_HELP = "1 while the pipeline is open, its workers are healthy and its loop answers; else 0."
_LATENCY_HELP = "Write-to-recallable latency of recent turns (accept to commit), by quantile."


@dataclass(frozen=True, slots=True)
class _Snapshot:
    health: Health
    stats: PipelineStats
    jobs: Mapping[str, int] | None = None  # the shared-job runner's counters, if one runs
    # The shared job queue as the runner last read it: (kind, status, jobs, oldest age).
    queue: Sequence[tuple[str, str, int, float]] = ()

    def problem(self) -> str | None:
        """Why the pipeline is unhealthy, or None."""
        return None if self.health.ok else self.health.reason


class _LoopUnavailableError(Exception):
    """The pipeline's event loop did not answer (stalled, or closed)."""


class _Probe:
    """Reads a pipeline's state on its own event loop, from another thread."""

    def __init__(self, pipeline: MemoryPipeline, loop: asyncio.AbstractEventLoop,
                 timeout_s: float, jobs: Callable[[], Mapping[str, int]] | None = None,
                 queue: Callable[[], Sequence[tuple[str, str, int, float]]] | None = None
                 ) -> None:
        self._jobs = jobs
        self._queue = queue
        self._pipeline = pipeline
        self._loop = loop
        self._timeout_s = timeout_s

    def snapshot(self) -> _Snapshot:
        """Raises: _LoopUnavailableError: the loop is closed or did not answer in time."""
        fut: concurrent.futures.Future[_Snapshot] = concurrent.futures.Future()

        def read() -> None:
            if not fut.set_running_or_notify_cancel():
                return  # the request gave up waiting
            try:
                fut.set_result(self._read())
            except Exception as exc:  # handed to the waiting request thread
                fut.set_exception(exc)

        try:
            self._loop.call_soon_threadsafe(read)
        except RuntimeError:  # the loop is closed: the worker is exiting
            raise _LoopUnavailableError("event loop closed") from None
        try:
            return fut.result(self._timeout_s)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise _LoopUnavailableError("event loop unresponsive") from None

    def _read(self) -> _Snapshot:
        p = self._pipeline
        return _Snapshot(health=p.health(), stats=p.stats(),
                         jobs=None if self._jobs is None else self._jobs(),
                         queue=() if self._queue is None else self._queue())


class PrometheusObserver(PipelineObserver):
    """Records the pipeline's batches and recalls into Prometheus histograms.

    Commit retries are not counted here: ``stats().commit_retries`` is already exported as
    ``hermes_memory_commit_retries_total``, and one series must not be exported twice.
    """

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = CollectorRegistry() if registry is None else registry
        self._batch_turns = Histogram(
            PREFIX + "batch_turns", "Turns per committed batch.",
            buckets=BATCH_TURNS_BUCKETS, registry=self.registry,
        )
        self._commit_seconds = Histogram(
            PREFIX + "commit_seconds", "Time to commit one batch, retries included.",
            buckets=COMMIT_SECONDS_BUCKETS, registry=self.registry,
        )
        recall = Histogram(
            PREFIX + "recall_seconds", "Time of one recall against the store, by outcome.",
            labelnames=("outcome",), buckets=RECALL_SECONDS_BUCKETS, registry=self.registry,
        )
        # Both series exist from the start, so a dashboard's rate() has a zero to start from.
        self._recall_ok = recall.labels(outcome="ok")
        self._recall_error = recall.labels(outcome="error")

    def batch_committed(self, turns: int, rows: int, seconds: float) -> None:
        self._batch_turns.observe(turns)
        self._commit_seconds.observe(seconds)

    def recall_done(self, seconds: float, ok: bool) -> None:
        (self._recall_ok if ok else self._recall_error).observe(seconds)


class _PipelineCollector:
    """A Prometheus collector over one ``stats()`` snapshot per scrape."""

    def __init__(self, probe: _Probe) -> None:
        self._probe = probe

    def describe(self) -> Iterable[Metric]:
        return list(self._families(None))

    def collect(self) -> Iterable[Metric]:
        try:
            snap = self._probe.snapshot()
        except _LoopUnavailableError as exc:
            log.warning("metrics_unavailable", reason=str(exc))
            up = GaugeMetricFamily(PREFIX + "up", _UP_HELP)
            up.add_metric([], 0)
            return [up]
        return list(self._families(snap))

    def _families(self, snap: _Snapshot | None) -> Iterator[Metric]:
        up = GaugeMetricFamily(PREFIX + "up", _UP_HELP)
        latency = GaugeMetricFamily(PREFIX + "write_to_recallable_seconds", _LATENCY_HELP,
                                    labels=["quantile"])
        stats = None if snap is None else snap.stats
        if snap is not None:
            up.add_metric([], 0 if snap.problem() else 1)
            latency.add_metric(["0.5"], snap.stats.write_to_recallable_p50_ms / 1000)
            latency.add_metric(["0.99"], snap.stats.write_to_recallable_p99_ms / 1000)
        yield up
        yield latency
        for name, help_, field in _GAUGES:
            gauge = GaugeMetricFamily(PREFIX + name, help_)
            if stats is not None:
                gauge.add_metric([], field(stats))
            yield gauge
        for name, help_, field in _COUNTERS:
            counter = CounterMetricFamily(PREFIX + name, help_)
            if stats is not None:
                counter.add_metric([], field(stats))
            yield counter
        jobs = None if snap is None else snap.jobs
        if jobs is not None:
            for name, help_ in _JOB_COUNTERS:
                counter = CounterMetricFamily(f"{PREFIX}jobs_{name}", help_)
                counter.add_metric([], jobs.get(name, 0))
                yield counter
            running = GaugeMetricFamily(PREFIX + "jobs_running", "Shared jobs running now.")
            running.add_metric([], jobs.get("running", 0))
            yield running
            queued = GaugeMetricFamily(
                PREFIX + "jobs_queue", "Shared jobs in the queue (every worker's), by kind "
                "and status (queued, running, dead), as last read.", labels=["kind", "status"])
            oldest = GaugeMetricFamily(
                PREFIX + "jobs_queue_oldest_age_seconds", "How long ago the oldest shared "
                "job of each kind and status was queued, as last read.",
                labels=["kind", "status"])
            for kind, status, n, age_s in snap.queue if snap is not None else ():
                queued.add_metric([kind, status], n)
                oldest.add_metric([kind, status], age_s)
            yield queued
            yield oldest


class _App:
    """Routes /healthz and /metrics, and /ui to the inspector when there is one; anything
    else is a 404."""

    def __init__(self, probe: _Probe, registry: CollectorRegistry,
                 inspector: InspectorApp | None = None) -> None:
        self._probe = probe
        self._metrics: WSGIApplication = make_wsgi_app(registry)
        self._inspector = inspector
        self._started = time.monotonic()

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse
                 ) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if self._inspector is not None and self._inspector.handles(path):
            return self._inspector(environ, start_response)
        try:
            if path == "/metrics":
                return list(self._metrics(environ, start_response))
            if path == "/healthz":
                if environ.get("REQUEST_METHOD") != "GET":
                    return _json(start_response, "405 Method Not Allowed",
                                 {"error": "use GET"}, [("Allow", "GET")])
                return self._health(start_response)
            return _json(start_response, "404 Not Found", {"error": f"no such path: {path}"})
        except Exception:  # the per-request boundary: log it, answer 500, keep serving
            log.exception("http_request_failed", path=path)
            return _json(start_response, "500 Internal Server Error", {"error": "internal"})

    def _health(self, start_response: StartResponse) -> list[bytes]:
        uptime_s = round(time.monotonic() - self._started, 3)
        try:
            snap = self._probe.snapshot()
        except _LoopUnavailableError as exc:
            return _json(start_response, "503 Service Unavailable",
                         {"status": "unavailable", "reason": str(exc), "uptime_s": uptime_s})
        s = snap.stats
        body: dict[str, object] = {
            "status": "ok",
            "state": snap.health.state,
            "uptime_s": uptime_s,
            "pending_turns": s.pending_turns,
            "queued_turns": s.queued_turns,
            "deferred_turns": s.deferred_turns,
            "oldest_pending_age_s": round(s.oldest_pending_age_s, 6),
            "dead_letters": s.dead_letters,
            "replica_pending": s.replica_pending,
            "replica_lag_s": round(s.replica_lag_s, 3),
            "stale_blocks": s.stale_blocks,
            # The word index's rebuild after an upgrade: messages indexed of those at its
            # start; both 0 when none is under way.
            "reindex_done": s.reindex_done,
            "reindex_total": s.reindex_total,
            "conditions": snap.health.conditions,
        }
        problem = snap.problem()
        if problem is None:
            return _json(start_response, "200 OK", body)
        body.update(status="unavailable", reason=problem)
        return _json(start_response, "503 Service Unavailable", body)


def _json(start_response: StartResponse, status: str, body: dict[str, object],
          headers: list[tuple[str, str]] | None = None) -> list[bytes]:
    data = json.dumps(body).encode()
    start_response(status, [*_JSON, ("Content-Length", str(len(data))), *(headers or [])])
    return [data]


class HttpServer(WsgiServer):
    """A running server; ``close()`` (or ``await aclose()``) stops it. Both are idempotent."""

    def __init__(self, server: WSGIServer, thread: threading.Thread,
                 observer: PrometheusObserver, on_close: Callable[[], None] | None = None
                 ) -> None:
        super().__init__(server, thread, on_close)
        self.observer = observer


def start_http_server(
    pipeline: MemoryPipeline,
    loop: asyncio.AbstractEventLoop,
    host: str = DEFAULT_HOST,
    port: int = 0,
    *,
    observer: PrometheusObserver | None = None,
    stats_timeout_s: float = STATS_TIMEOUT_S,
    inspector: Access | None = None,
    jobs: Callable[[], Mapping[str, int]] | None = None,
    jobs_queue: Callable[[], Sequence[tuple[str, str, int, float]]] | None = None,
) -> HttpServer:
    """Serve /healthz and /metrics for ``pipeline`` (running on ``loop``) from a daemon thread,
    and with ``inspector`` (its access rules) the memory inspector at /ui. ``jobs``: the
    shared-job runner's counters, read on the loop with the stats, for /metrics;
    ``jobs_queue``: the job queue as last read, (kind, status, jobs, oldest age) rows.

    ``port=0`` picks a free port; read it from ``HttpServer.port``. Pass the ``observer`` the
    pipeline was built with, so /metrics has its histograms; without one they stay empty.

    Raises:
        OSError: the address cannot be bound (in use, not local, unknown host).
        StoreError: the inspector cannot read the pipeline's store file.
    """
    observer = PrometheusObserver() if observer is None else observer
    probe = _Probe(pipeline, loop, stats_timeout_s, jobs, jobs_queue)
    ui = None
    if inspector is not None:
        from ..ui.server import Inspector

        def live() -> tuple[Health, PipelineStats]:
            snap = probe.snapshot()
            return snap.health, snap.stats

        ui = Inspector(pipeline.settings, inspector, live=live, jobs_queue=jobs_queue)
    try:
        app = _App(probe, observer.registry, None if ui is None else ui.app)
        server, thread = serve_wsgi(app, host, port, name="hermes-memory-http")
    except BaseException:
        if ui is not None:
            ui.close()
        raise
    observer.registry.register(_PipelineCollector(probe))
    return HttpServer(server, thread, observer, None if ui is None else ui.close)
