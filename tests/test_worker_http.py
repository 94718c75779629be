"""The worker's HTTP endpoints: /healthz and /metrics, in-process and in a real worker process."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import textwrap
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path

import anyio.to_thread
import pytest
import structlog
from prometheus_client.parser import text_string_to_metric_families

from hermes_async_memory import ConfigurationError, MemoryPipeline, Settings
from hermes_async_memory.metrics import PipelineObserver
from hermes_async_memory.store import text_index
from hermes_async_memory.worker.http import HttpServer, PrometheusObserver, start_http_server
from hermes_async_memory.worker.main import build_parser, http_from_args

from .processes import Spawn
from .test_supervisor import corrupt_store
from .ui_fixtures import store_mid_reindex

HTTP_TIMEOUT_S = 10.0
# Short, for the test that holds the loop on purpose: the server must give up on it.
STALLED_LOOP_TIMEOUT_S = 0.2

Response = tuple[int, str, bytes]


def fetch(url: str) -> Response:
    """GET ``url`` (no proxy): status, Content-Type, body; error statuses are returned too."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=HTTP_TIMEOUT_S) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read()
    except urllib.error.HTTPError as err:
        with err:
            return err.code, err.headers["Content-Type"], err.read()


async def get(url: str) -> Response:
    """``fetch`` from a thread, so the event loop stays free to answer the server."""
    return await anyio.to_thread.run_sync(fetch, url)


async def health(base: str) -> tuple[int, dict[str, object]]:
    status, ctype, body = await get(base + "/healthz")
    assert ctype == "application/json"
    return status, json.loads(body)


def metric_values(text: str) -> dict[str, float]:
    """Every sample of a Prometheus text page: 'name' or 'name{k="v",...}' -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


async def metrics(base: str) -> dict[str, float]:
    status, ctype, body = await get(base + "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    return metric_values(body.decode())


@pytest.fixture
async def served(mem: MemoryPipeline) -> AsyncIterator[HttpServer]:
    server = start_http_server(mem, asyncio.get_running_loop(), port=0)
    try:
        yield server
    finally:
        await server.aclose()


def accept(mem: MemoryPipeline, turns: int) -> None:
    for i in range(turns):
        mem.sync_turn(f"question {i} about invoices", f"answer {i}",
                      session_id=f"s{i % 5}", user_id="ada")


# -- in-process --------------------------------------------------------------------------


async def test_healthz_is_ok_with_the_queue_figures(
    mem: MemoryPipeline, served: HttpServer
) -> None:
    accept(mem, 10)
    await mem.flush()

    status, body = await health(served.url)

    assert status == 200
    assert body["status"] == "ok"
    assert isinstance(body["uptime_s"], float) and body["uptime_s"] >= 0
    assert body["queued_turns"] == 0
    assert body["deferred_turns"] == 0
    assert body["oldest_pending_age_s"] == 0
    assert body["dead_letters"] == 0
    assert body["reindex_done"] == body["reindex_total"] == 0  # no rebuild under way


async def test_healthz_shows_the_word_index_rebuild_while_it_is_under_way(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store upgraded from before the index stemmed, its rebuild at 125 of its 1,200
    messages and held there (each slice the writer runs does nothing): /healthz says how
    far it is."""
    settings = await store_mid_reindex(tmp_path)

    async def held(db, slice_rows=None):  # type: ignore[no-untyped-def]
        return await text_index.word_reindex_state(db)

    monkeypatch.setattr("hermes_async_memory.store.messages.word_reindex_step", held)
    async with MemoryPipeline(settings) as mem:
        server = start_http_server(mem, asyncio.get_running_loop(), port=0)
        try:
            status, body = await health(server.url)
        finally:
            await server.aclose()
    assert status == 200
    assert (body["reindex_done"], body["reindex_total"]) == (125, 1200)


async def test_metrics_count_what_was_committed(mem: MemoryPipeline, served: HttpServer) -> None:
    accept(mem, 50)
    await mem.flush()
    assert mem.prefetch("invoices", session_id="never-seen") == ""  # one recall miss

    values = await metrics(served.url)

    stats = mem.stats()
    assert values["hermes_memory_up"] == 1
    assert values["hermes_memory_accepted_turns_total"] == 50
    assert values["hermes_memory_committed_turns_total"] == 50
    assert values["hermes_memory_rows_committed_total"] == 100  # a user and an assistant row
    assert values["hermes_memory_batches_committed_total"] == stats.batches_committed >= 1
    assert values["hermes_memory_queued_turns"] == 0
    assert values["hermes_memory_queued_bytes"] == 0
    assert values["hermes_memory_deferred_turns"] == 0
    assert values["hermes_memory_oldest_pending_age_seconds"] == 0
    assert values["hermes_memory_dead_letters_total"] == 0
    assert values["hermes_memory_commit_retries_total"] == 0
    assert values["hermes_memory_recall_misses_total"] == stats.recall_misses >= 1
    assert values["hermes_memory_outbox_segments"] == stats.outbox_segments
    p50 = values['hermes_memory_write_to_recallable_seconds{quantile="0.5"}']
    p99 = values['hermes_memory_write_to_recallable_seconds{quantile="0.99"}']
    assert 0 < p50 <= p99 == pytest.approx(stats.write_to_recallable_p99_ms / 1000)


async def test_metrics_histograms_record_what_the_observer_is_told(served: HttpServer) -> None:
    observer = served.observer
    observer.batch_committed(50, 100, 0.004)
    observer.batch_committed(2000, 4000, 0.3)
    observer.recall_done(0.0008, True)
    observer.recall_done(0.02, False)
    observer.commit_retried()  # exported from stats(), not from the observer

    values = await metrics(served.url)

    assert values["hermes_memory_batch_turns_count"] == 2
    assert values["hermes_memory_batch_turns_sum"] == 2050
    assert values['hermes_memory_batch_turns_bucket{le="20.0"}'] == 0
    assert values['hermes_memory_batch_turns_bucket{le="50.0"}'] == 1
    assert values['hermes_memory_batch_turns_bucket{le="2000.0"}'] == 2
    assert values["hermes_memory_commit_seconds_count"] == 2
    assert values["hermes_memory_commit_seconds_sum"] == pytest.approx(0.304)
    assert values['hermes_memory_commit_seconds_bucket{le="0.005"}'] == 1
    assert values['hermes_memory_recall_seconds_count{outcome="ok"}'] == 1
    assert values['hermes_memory_recall_seconds_count{outcome="error"}'] == 1
    assert values['hermes_memory_recall_seconds_bucket{le="0.001",outcome="ok"}'] == 1
    assert values["hermes_memory_commit_retries_total"] == 0


async def test_a_pipeline_feeds_the_histograms_of_its_observer(tmp_path: Path) -> None:
    observer = PrometheusObserver()
    settings = Settings(db_path=tmp_path / "observed.db")
    async with MemoryPipeline(settings, observer=observer) as observed:
        server = start_http_server(observed, asyncio.get_running_loop(), port=0,
                                   observer=observer)
        try:
            accept(observed, 30)
            await observed.flush()
            observed.queue_prefetch("invoices", session_id="s0", user_id="ada")
            await observed.wait_until(lambda: observed.stats().recalls_run > 0, timeout=30)
            values = await metrics(server.url)
        finally:
            await server.aclose()
    batches = observed.stats().batches_committed
    assert values["hermes_memory_batch_turns_count"] == batches >= 1
    assert values["hermes_memory_batch_turns_sum"] == 30
    assert values['hermes_memory_recall_seconds_count{outcome="ok"}'] == 1
    assert values['hermes_memory_recall_seconds_count{outcome="error"}'] == 0


def test_the_base_observer_accepts_every_event_and_does_nothing() -> None:
    observer = PipelineObserver()
    observer.batch_committed(1, 2, 0.001)
    observer.recall_done(0.001, True)
    observer.commit_retried()


async def test_healthz_is_503_once_the_pipeline_is_closed(
    mem: MemoryPipeline, served: HttpServer
) -> None:
    accept(mem, 5)
    await mem.aclose()

    status, body = await health(served.url)
    values = await metrics(served.url)

    assert status == 503
    assert body["status"] == "unavailable"
    assert body["reason"] == "pipeline closed"
    assert values["hermes_memory_up"] == 0
    assert values["hermes_memory_committed_turns_total"] == 5  # the last figures still answer


async def test_healthz_is_503_naming_the_part_when_the_writer_died(
    mem: MemoryPipeline, served: HttpServer, settings: Settings
) -> None:
    """The writer is killed for real: the store file is damaged under it."""
    accept(mem, 5)
    await mem.flush()
    corrupt_store(settings.db_path)
    accept(mem, 5)
    with anyio.fail_after(10):
        await mem.wait_failed()

    status, body = await health(served.url)
    values = await metrics(served.url)

    assert status == 503
    assert body["state"] == "failed"
    reason = str(body["reason"])
    assert reason.startswith("the pipeline's writer failed: DatabaseError")
    assert "malformed" in reason
    assert values["hermes_memory_up"] == 0
    assert values["hermes_memory_failed"] == 1


async def test_healthz_is_503_while_the_disk_is_full(
    mem: MemoryPipeline, served: HttpServer
) -> None:
    mem.conditions.set("disk_full", "OSError: [Errno 28] No space left on device")
    status, body = await health(served.url)
    assert status == 503
    assert str(body["reason"]).startswith("disk full: ")
    assert "disk_full" in body["conditions"]  # type: ignore[operator]
    mem.conditions.clear("disk_full")
    status, body = await health(served.url)
    assert status == 200 and body["conditions"] == {}


async def test_healthz_is_503_when_the_event_loop_does_not_answer(
    mem: MemoryPipeline,
) -> None:
    server = start_http_server(mem, asyncio.get_running_loop(),
                               stats_timeout_s=STALLED_LOOP_TIMEOUT_S)
    try:
        # Requested from the loop's own thread: the loop is blocked until the request ends,
        # so it cannot read stats() for the server.
        status, _, body = fetch(server.url + "/healthz")
        m_status, _, m_body = fetch(server.url + "/metrics")
    finally:
        await server.aclose()

    assert status == 503
    assert json.loads(body)["reason"] == "event loop unresponsive"
    assert m_status == 200
    values = metric_values(m_body.decode())
    assert values["hermes_memory_up"] == 0
    assert "hermes_memory_committed_turns_total" not in values  # no stale figures


async def test_other_paths_are_404_and_healthz_is_get_only(served: HttpServer) -> None:
    for path in ("/", "/health", "/healthz/x", "/metricsx"):
        status, ctype, _ = await get(served.url + path)
        assert (status, ctype) == (404, "application/json"), path

    def post() -> int:
        request = urllib.request.Request(served.url + "/healthz", data=b"", method="POST")
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        try:
            with opener.open(request, timeout=HTTP_TIMEOUT_S) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as err:
            with err:
                return err.code

    assert await anyio.to_thread.run_sync(post) == 405


async def test_requests_are_logged_at_debug_and_never_written_to_stderr(
    served: HttpServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # wsgiref logs a request after its response has gone out, so the client can have its
    # answer before the line exists (and one request's line can come after the next's):
    # wait until both lines are there, not for time.
    logged: list[str] = []
    both_logged = threading.Event()

    def watch(_: object, __: str, event: structlog.typing.EventDict) -> structlog.typing.EventDict:
        if event.get("event") == "http_request":
            logged.append(event["path"])
            if len(logged) == 2:
                both_logged.set()
        return event

    with structlog.testing.capture_logs(processors=[watch]) as logs:
        await get(served.url + "/healthz")
        await get(served.url + "/nope")
        assert await anyio.to_thread.run_sync(both_logged.wait, HTTP_TIMEOUT_S)

    assert capsys.readouterr().err == ""
    requests = [(e["path"], e["status"], e["log_level"]) for e in logs
                if e["event"] == "http_request"]
    assert sorted(requests) == [("/healthz", "200", "debug"), ("/nope", "404", "debug")]


async def test_close_releases_the_port_and_is_idempotent(mem: MemoryPipeline) -> None:
    server = start_http_server(mem, asyncio.get_running_loop())
    await server.aclose()
    await server.aclose()
    server.close()

    with pytest.raises(urllib.error.URLError):
        fetch(server.url + "/healthz")


def test_http_address_comes_from_the_option_else_the_environment() -> None:
    parser = build_parser()
    env = {"HERMES_MEMORY_HTTP": "127.0.0.1:9464"}

    assert http_from_args(parser.parse_args([]), {}) is None
    assert http_from_args(parser.parse_args([]), env) == ("127.0.0.1", 9464)
    assert http_from_args(parser.parse_args(["--http", "0.0.0.0:0"]), env) == ("0.0.0.0", 0)
    assert http_from_args(parser.parse_args(["--http", "[::1]:80"]), {}) == ("::1", 80)
    with pytest.raises(ConfigurationError, match="HERMES_MEMORY_HTTP"):
        http_from_args(parser.parse_args([]), {"HERMES_MEMORY_HTTP": "9464"})
    for bad in ("9464", "localhost", ":9464", "host:http", "host:70000"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--http", bad])


# -- the worker process ------------------------------------------------------------------


# Runs the worker with a ready hook that accepts one turn while another connection holds the
# store's write lock, so the drain cannot finish: the endpoints are observed mid-drain.
LOCKED_CHILD = textwrap.dedent(
    """
    import asyncio, json, sqlite3, sys
    from pathlib import Path

    from hermes_async_memory import Settings
    from hermes_async_memory.logs import configure_logging
    from hermes_async_memory.worker.main import run

    db = Path(sys.argv[1])
    held = []

    def ready(mem):
        conn = sqlite3.connect(db, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        held.append(conn)
        mem.sync_turn("a question", "an answer", session_id="s1", user_id="ada")
        print(json.dumps({"accepted": 1}), flush=True)

    configure_logging(json=True)
    settings = Settings(db_path=db, shutdown_deadline_s=120.0)
    asyncio.run(run(settings, ready=ready, http=("127.0.0.1", 0)))
    """
)


async def test_worker_serves_http_until_sigterm_then_drains_and_exits_0(
    spawn: Spawn, tmp_path: Path
) -> None:
    db = tmp_path / "memory.db"
    worker = await spawn("-m", "workers", "--db", str(db), "--http", "127.0.0.1:0",
                         "--log-format", "json")
    listening = await worker.log_line("http_listening")
    await worker.log_line("worker_ready")
    base = str(listening["url"])
    assert listening["host"] == "127.0.0.1" and base.endswith(f":{listening['port']}")

    status, body = await health(base)
    values = await metrics(base)
    worker.signal(signal.SIGTERM)

    assert (status, body["status"]) == (200, "ok")
    assert values["hermes_memory_up"] == 1
    assert values["hermes_memory_committed_turns_total"] == 0
    assert await worker.finish() == 0
    events = worker.events()
    assert events.index("pipeline_closed") < events.index("http_closed")
    assert worker.logs[events.index("worker_stopped")]["left_in_outbox"] == 0
    # wsgiref's request lines stay off stderr: every line is a JSON log line.
    assert all(rec["event"] is not None for rec in worker.logs), worker.logs


async def test_healthz_is_503_while_the_worker_drains(
    spawn: Spawn, tmp_path: Path
) -> None:
    db = tmp_path / "memory.db"
    script = tmp_path / "child.py"
    script.write_text(LOCKED_CHILD)
    worker = await spawn(str(script), str(db))
    base = str((await worker.log_line("http_listening"))["url"])
    assert await worker.stdout_json() == {"accepted": 1}

    before, _ = await health(base)
    worker.signal(signal.SIGTERM)
    await worker.log_line("worker_draining")
    during, body = await health(base)
    worker.signal(signal.SIGTERM)  # the lock never goes: leave at once

    assert before == 200
    assert (during, body["reason"]) == (503, "pipeline closing")
    assert await worker.finish() == 128 + signal.SIGTERM


async def test_worker_exits_1_when_the_http_port_is_taken(
    spawn: Spawn, tmp_path: Path
) -> None:
    db = tmp_path / "memory.db"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = await spawn("-m", "workers", "--db", str(db), "--http", f"127.0.0.1:{port}",
                             "--log-format", "json")
        code = await worker.finish()

    assert code == 1
    errors = [rec["raw"] for rec in worker.logs if rec["event"] is None]
    assert len(errors) == 1 and errors[0].startswith("python -m workers: error: ")
    assert "pipeline_closed" in worker.events()  # the pipeline was still drained and closed
