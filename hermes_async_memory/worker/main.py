"""The worker process: open the pipeline, run until a signal, drain within the deadline.

    start ──► pipeline open (an earlier run's outbox is replayed) ──► "worker_ready"
    first SIGTERM / SIGINT ──► stop; aclose(deadline_s) drains ──► exit 0
    second signal while draining ──► exit at once with 128 + signum
    the pipeline fails (a part that cannot go on) ──► drain what can be, one error line
                                                       naming the cause ──► exit 3

With backend "postgres" the process also runs the shared jobs (``postgres.worker``): a
runner beside the pipeline, under a supervisor of its own, that claims jobs queued by any
machine (recalls, derived work) and gives back the unfinished ones when it stops. Its
counters are in the "worker_stopped" line and on /metrics; its failure ends the process as
the pipeline's.

Exiting at once loses nothing: every accepted turn is already durable in the outbox, and the
next start commits it exactly once.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import importlib.util
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import anyio
import structlog

from ..cli import exit_code, fail
from ..env import PARSE, read_env
from ..errors import ConfigurationError, HermesMemoryError, PipelineFailedError
from ..extras import require
from ..logs import LEVELS, configure_logging
from ..pipeline import MemoryPipeline
from ..retry import Backoff
from ..settings import ENV_PREFIX, Settings
from ..stats import PipelineStats
from ..supervisor import Supervisor
from ..ui.access import TOKEN_ENV, Access, token_from_env
from .demo import print_closed, run_demo

if TYPE_CHECKING:
    from ..postgres.worker import JobWorker
    from .http import HttpServer

log = structlog.get_logger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
# The pipeline failed for a cause it cannot outlive (a damaged store, say): distinct, so a
# supervisor (systemd, Kubernetes) sees a crash to restart, and an operator the cause.
EXIT_PIPELINE_FAILED = 3
# What a shell reports for a process ended by SIGINT: 128 + 2.
EXIT_INTERRUPTED = 128 + signal.SIGINT
DEFAULT_PROG = "python -m workers"

ReadyHook = Callable[[MemoryPipeline], object]
HttpAddress = tuple[str, int]
HTTP_ENV = ENV_PREFIX + "HTTP"  # WorkerEnv.http


def build_parser(prog: str = DEFAULT_PROG) -> argparse.ArgumentParser:
    """The worker's command line; ``hermes-memory worker`` forwards its arguments here."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run the memory pipeline as a long-lived process until SIGTERM or SIGINT.",
    )
    parser.add_argument(
        "--db", type=Path, metavar="PATH",
        help="the SQLite store file (default: $HERMES_MEMORY_DB_PATH, else memory.db in the "
             "user's data directory)",
    )
    parser.add_argument(
        "--deadline", type=_seconds, metavar="SECONDS",
        help="how long shutdown may drain before it leaves the rest in the outbox for the next "
             "start (default: $HERMES_MEMORY_SHUTDOWN_DEADLINE_S, else 10)",
    )
    parser.add_argument(
        "--demo", action="store_true",
        help="run a short scripted load, print what the pipeline does, then exit",
    )
    parser.add_argument(
        "--log-format", choices=("json", "console"),
        help="log lines on stderr (default: console on a terminal, else json)",
    )
    parser.add_argument("--log-level", choices=tuple(LEVELS), default="info")
    parser.add_argument(
        "--http", type=_http_address, metavar="HOST:PORT",
        help="serve GET /healthz and GET /metrics (Prometheus) on this address, and the memory "
             f"inspector at /ui; port 0 picks a free one (default: ${HTTP_ENV}, else off). An "
             f"address other machines can reach needs ${TOKEN_ENV} for the inspector",
    )
    parser.add_argument(
        "--no-ui", action="store_true",
        help="serve only /healthz and /metrics on --http, not the memory inspector",
    )
    return parser


def parse_http_address(text: str) -> HttpAddress:
    """``HOST:PORT`` (``[::1]:9464`` for an IPv6 host) as (host, port).

    Raises:
        ValueError: it is not HOST:PORT.
    """
    host, sep, port = text.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # [::1]:9464
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"expected HOST:PORT (e.g. 127.0.0.1:9464), got {text!r}")
    return host, int(port)


def _http_address(text: str) -> HttpAddress:
    try:
        return parse_http_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True, slots=True)
class WorkerEnv:
    """The worker's own options from the environment (``HERMES_MEMORY_<FIELD>``), read by the
    same parser as ``Settings``: they are not pipeline settings."""

    # Where /healthz and /metrics are served (None: not at all).
    http: HttpAddress | None = field(default=None, metadata={PARSE: parse_http_address})

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> WorkerEnv:
        """Raises ConfigurationError: a variable does not parse."""
        return cls(**read_env(cls, environ, ENV_PREFIX))  # type: ignore[arg-type]


def http_from_args(args: argparse.Namespace, environ: Mapping[str, str]) -> HttpAddress | None:
    """``--http``, else ``$HERMES_MEMORY_HTTP``; None (no HTTP endpoints) when neither is set.

    Raises:
        ConfigurationError: the environment variable is not HOST:PORT.
    """
    address: HttpAddress | None = args.http
    if address is not None:
        return address
    return WorkerEnv.from_env(environ).http


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def settings_from_args(args: argparse.Namespace) -> Settings:
    """``Settings.from_env()`` with the command-line options on top.

    Raises:
        ConfigurationError: an environment variable or an option is invalid.
    """
    # The worker process also drains the shared inbox and serves producers' recalls.
    overrides: dict[str, object] = {"role": "worker"}
    if args.db is not None:
        overrides["db_path"] = args.db
    if args.deadline is not None:
        overrides["shutdown_deadline_s"] = args.deadline
    return Settings.from_env(None, **overrides)


def main(argv: Sequence[str] | None = None, *, prog: str = DEFAULT_PROG) -> int:
    """Run the worker process; returns the exit code.

    Errors are one line on stderr: 2 for a usage or configuration error, 1 for a store or
    file-system error.
    """
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse has already printed
        return exit_code(exc)
    try:
        json = None if args.log_format is None else args.log_format == "json"
        configure_logging(json=json, level=args.log_level)
        settings = settings_from_args(args)
        http = http_from_args(args, os.environ)
        ui = None
        if http is not None:
            require("prometheus_client", "metrics", "--http")
            if not args.no_ui:
                ui = inspector_access(http[0], os.environ)
        asyncio.run(run(settings, demo=args.demo, http=http, ui=ui))
    except ConfigurationError as exc:
        return fail(prog, exc, EXIT_USAGE)
    except PipelineFailedError as exc:
        return fail(prog, exc, EXIT_PIPELINE_FAILED)
    except (HermesMemoryError, OSError) as exc:
        return fail(prog, exc, EXIT_FAILURE)
    except KeyboardInterrupt:  # before the signal handlers were installed
        return EXIT_INTERRUPTED
    return EXIT_OK


def inspector_access(host: str, environ: Mapping[str, str]) -> Access | None:
    """The inspector's access rules on ``host``, or None (with a warning) when the ``ui``
    extra is not installed: /healthz and /metrics are served all the same.

    Raises:
        UiAccessError: ``host`` is not loopback and no token is set, or the token is weak.
    """
    access = Access.for_bind(host, token_from_env(environ))
    if importlib.util.find_spec("jinja2") is None:
        log.warning("ui_unavailable", reason="the inspector at /ui needs the ui extra: "
                    "pip install 'hermes-async-memory[ui]'")
        return None
    return access


async def run(
    settings: Settings,
    *,
    demo: bool = False,
    ready: ReadyHook | None = None,
    out: TextIO | None = None,
    http: HttpAddress | None = None,
    ui: Access | None = None,
) -> None:
    """Run the pipeline until SIGTERM or SIGINT (with ``demo``: until the demo ends), then drain.

    ``ready`` is called with the open pipeline right after the "worker_ready" line; ``out`` is
    where the demo prints (stdout by default); ``http`` is where /healthz and /metrics are
    served, from the "http_listening" line until the pipeline is closed. Call it from the main
    thread: it installs the signal handlers.

    Raises:
        StoreError: the store or its outbox cannot be opened.
        OSError: the ``http`` address cannot be bound.
    """
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    on_signal = _signal_handler(stop)
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await _serve(settings, stop, demo=demo, ready=ready, out=out or sys.stdout, http=http,
                     ui=ui)
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


def _signal_handler(stop: asyncio.Event) -> Callable[[int], None]:
    received: list[int] = []

    def on_signal(signum: int) -> None:
        received.append(signum)
        name = signal.Signals(signum).name
        if len(received) == 1:
            log.info("worker_stopping", signal=name)
            stop.set()
            return
        # The caller wants out now. Nothing is lost: accepted turns are in the outbox, and a
        # batch cut short is rolled back by SQLite and replayed by the next start.
        code = 128 + signum
        log.warning("worker_exit_now", signal=name, exit_code=code,
                    detail="pending turns stay durable in the outbox")
        with contextlib.suppress(OSError, ValueError):  # stdout may be a closed pipe
            sys.stdout.flush()
        os._exit(code)

    return on_signal


async def _serve(
    settings: Settings, stop: asyncio.Event, *, demo: bool, ready: ReadyHook | None,
    out: TextIO, http: HttpAddress | None = None, ui: Access | None = None,
) -> None:
    observer = None
    if http is not None:
        from .http import PrometheusObserver, start_http_server  # the metrics extra

        observer = PrometheusObserver()
    mem = MemoryPipeline(settings, observer=observer)
    await mem.start()
    jobs = _Jobs(settings, mem) if settings.backend == "postgres" else None
    # A long-lived process: keep the start-up heap out of every later full collection, which
    # would otherwise stall the event loop ~0.4 ms per thousand objects it scans.
    gc.collect()
    gc.freeze()
    server: HttpServer | None = None
    try:
        if http is not None:
            # Off the loop: resolving and binding the address may wait on a name lookup.
            server = await anyio.to_thread.run_sync(
                functools.partial(start_http_server, mem, asyncio.get_running_loop(), *http,
                                  observer=observer, inspector=ui,
                                  jobs=None if jobs is None else jobs.worker.stats,
                                  jobs_queue=None if jobs is None else jobs.worker.queue_rows))
            log.info("http_listening", host=server.host, port=server.port, url=server.url,
                     ui=None if ui is None else server.url + "/ui")
        log.info("worker_ready", db=str(settings.db_path), pid=os.getpid(),
                 deadline_s=settings.shutdown_deadline_s, demo=demo,
                 jobs_owner=None if jobs is None else jobs.worker.owner)
        if ready is not None:
            ready(mem)
        failed = None if jobs is None else jobs.failed.wait
        if demo:
            await _until(stop, mem, lambda: run_demo(mem, out), failed)
        else:
            await _until(stop, mem, stop.wait, failed)
    finally:
        try:
            if jobs is not None:
                # First: its unfinished jobs go back for other workers while this one drains.
                await jobs.stop(settings.shutdown_deadline_s)
            closed = await _drain(mem, settings.shutdown_deadline_s,
                                  jobs=None if jobs is None else jobs.worker.stats())
        finally:
            if server is not None:
                # Closed after the drain, so /healthz answers 503 "pipeline closing" meanwhile.
                await server.aclose()
    if mem.failure is not None:
        raise mem.failure  # one line and its own exit code (main)
    if jobs is not None and jobs.failure is not None:
        raise jobs.failure
    if demo:
        print_closed(closed, out)


async def _until(stop: asyncio.Event, mem: MemoryPipeline,
                 work: Callable[[], Awaitable[object]],
                 failed: Callable[[], Awaitable[object]] | None = None) -> None:
    """Run ``work`` until it ends, a stop signal comes, the pipeline fails, or ``failed``
    returns (the shared jobs failed). Errors from ``work`` propagate unwrapped."""
    with anyio.CancelScope() as scope:

        async def cancel_on(event: Callable[[], Awaitable[object]]) -> None:
            await event()
            scope.cancel()

        watchers = [asyncio.create_task(cancel_on(stop.wait), name="worker-stop-watcher"),
                    asyncio.create_task(cancel_on(mem.wait_failed), name="worker-fail-watcher")]
        if failed is not None:
            watchers.append(asyncio.create_task(cancel_on(failed),
                                                name="worker-jobs-fail-watcher"))
        try:
            await work()
        finally:
            for watcher in watchers:
                watcher.cancel()
            await asyncio.wait(watchers)


async def _drain(mem: MemoryPipeline, deadline_s: float, *,
                 jobs: dict[str, int] | None = None) -> PipelineStats:
    log.info("worker_draining", pending_turns=mem.stats().pending_turns, deadline_s=deadline_s)
    started = time.perf_counter()
    await mem.aclose(deadline_s=deadline_s)
    after = mem.stats()
    log.info(
        "worker_stopped", committed_turns=after.committed_turns,
        left_in_outbox=after.pending_turns,
        duration_ms=round((time.perf_counter() - started) * 1000, 2),
        **({} if jobs is None else {"jobs": jobs}),
    )
    return after


class _Jobs:
    """The shared jobs beside the pipeline (backend "postgres"): a ``JobWorker`` running
    every kind ``default_handlers`` knows, restarted after a passing failure by a
    supervisor of its own; a lasting one (the database refuses us) is ``failure``."""

    def __init__(self, settings: Settings, mem: MemoryPipeline) -> None:
        from ..postgres.worker import JobWorker, default_handlers  # the postgres extra

        self.worker: JobWorker = JobWorker(settings, default_handlers(settings),
                                           conditions=mem.conditions)
        self.failure: PipelineFailedError | None = None
        self.failed = asyncio.Event()
        supervisor = Supervisor(backoff=Backoff(base_s=settings.commit_retry_base_s),
                                conditions=mem.conditions, on_failure=self._on_failure,
                                clock=mem.clock)
        supervisor.add("jobs", self.worker.run)
        self._task = asyncio.create_task(supervisor.run(), name="hermes-memory-jobs")

    def _on_failure(self, error: PipelineFailedError) -> None:
        if self.failure is None:
            self.failure = error
            self.failed.set()

    async def stop(self, timeout_s: float) -> None:
        """Stop taking jobs; those running are cancelled and given back."""
        self._task.cancel()
        await asyncio.wait({self._task}, timeout=max(1.0, timeout_s))
