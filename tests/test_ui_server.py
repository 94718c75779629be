"""Who may reach the memory inspector, over real HTTP on this machine: an address other
machines can reach is refused without a token (one line, before anything is served); with
one, every page asks for it; the worker mounts the pages beside /healthz and /metrics."""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hermes_async_memory.ui.access import (
    TOKEN_ENV,
    Access,
    UiAccessError,
    check_bind,
    is_loopback,
    token_from_env,
)
from hermes_async_memory.ui.server import serve_inspector

from .ui_fixtures import Fixture, fill_store, http_worker

TOKEN = "another-long-test-token-abcdefghij"
EXE = shutil.which("hermes-memory", path=str(Path(sys.executable).parent))


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    assert EXE is not None
    return subprocess.run([EXE, *args], env={**os.environ, **(env or {})}, text=True,
                          capture_output=True, timeout=60, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Fixture:
    import asyncio

    return asyncio.run(fill_store(tmp_path_factory.mktemp("ui")))


@pytest.mark.parametrize("command", [
    ("ui", "--host", "0.0.0.0", "--port", "0"),
    ("worker", "--http", "0.0.0.0:0"),
])
def test_an_open_address_without_a_token_refuses_to_start_with_one_line(
        filled: Fixture, command: tuple[str, ...]) -> None:
    env = {TOKEN_ENV: "", "HERMES_MEMORY_DB_PATH": str(filled.db)}
    result = run(*command, env=env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert TOKEN_ENV in lines[0] and "0.0.0.0" in lines[0] and "127.0.0.1" in lines[0]
    assert result.stdout == ""


def test_a_weak_token_is_refused() -> None:
    with pytest.raises(UiAccessError, match="at least 16"):
        token_from_env({TOKEN_ENV: "short"})
    assert token_from_env({TOKEN_ENV: "  "}) is None
    assert token_from_env({TOKEN_ENV: TOKEN}) == TOKEN


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.8.9.1", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("0.0.0.0", False), ("::", False), ("10.0.0.5", False),
    ("example.internal", False),
])
def test_only_loopback_addresses_go_without_a_token(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
    if loopback:
        check_bind(host, None)
    else:
        with pytest.raises(UiAccessError):
            check_bind(host, None)
        check_bind(host, TOKEN)


def test_on_an_open_address_every_page_needs_the_token(filled: Fixture) -> None:
    server = serve_inspector(filled.settings, "0.0.0.0", 0, Access.for_bind("0.0.0.0", TOKEN))
    base = f"http://127.0.0.1:{server.port}/ui"
    try:
        for path in ("", "/users", "/session?id=ada-1", "/series.json"):
            status, headers, body = get(base + path)
            assert status == 401, path
            assert headers["WWW-Authenticate"].startswith("Basic")
            assert b"ada" not in body
        wrong = base64.b64encode(b"me:" + b"x" * len(TOKEN)).decode()
        assert get(base, {"Authorization": f"Basic {wrong}"})[0] == 401
        right = base64.b64encode(f"me:{TOKEN}".encode()).decode()
        status, _, body = get(base + "/users", {"Authorization": f"Basic {right}"})
        assert status == 200 and b"ada" in body
        status, _, body = get(base + "/users", {"Authorization": f"Bearer {TOKEN}"})
        assert status == 200 and b"bob" in body
        # The page's own files carry no memory: they load before the password prompt.
        assert get(base + "/static/charts.js")[0] == 200
    finally:
        server.close()


def test_answers_carry_the_security_headers_and_bad_requests_say_why(filled: Fixture) -> None:
    server = serve_inspector(filled.settings, "127.0.0.1", 0, Access(None, loopback=True))
    base = server.url + "/ui"
    try:
        status, headers, _ = get(base)
        assert status == 200
        csp = headers["Content-Security-Policy"]
        assert "default-src 'none'" in csp and "script-src 'self'" in csp
        assert "unsafe-inline" not in csp
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert headers["Cache-Control"] == "no-store"
        status, _, body = get(base + "/users?page=minus-one")
        assert status == 400 and b"page must be a number" in body
        status, _, body = get(base + "/session?id=nobody")
        assert status == 404 and b"no session" in body
        status, _, body = get(base + "/search?q=%22unclosed&user=ada&syntax=fts5")
        assert status == 400, body
        assert get(base + "/static/../app.py")[0] == 404
        assert get(base + "/nothing-here")[0] == 404
        status, _, _ = get(server.url + "/")
        assert status == 200  # / leads to /ui
    finally:
        server.close()


def test_the_inspector_refuses_a_file_that_is_not_a_store(tmp_path: Path) -> None:
    bogus = tmp_path / "notes.db"
    bogus.write_text("not a database")
    result = run("ui", "--db", str(bogus), "--port", "0")
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert str(bogus) in result.stderr


@pytest.fixture
def worker_without_ui(tmp_path: Path) -> Iterator[dict[str, Any]]:
    with http_worker(tmp_path / "memory.db", "--no-ui", host="0.0.0.0",
                     env={TOKEN_ENV: ""}) as listening:
        yield listening


def test_no_ui_serves_health_and_metrics_on_an_open_address(
        worker_without_ui: dict[str, Any]) -> None:
    assert worker_without_ui["ui"] is None
    port = worker_without_ui["port"]
    assert get(f"http://127.0.0.1:{port}/healthz")[0] == 200
    assert get(f"http://127.0.0.1:{port}/ui")[0] == 404


async def test_the_chart_series_turn_counters_into_rates(tmp_path: Path) -> None:
    """Commits per second and the recall hit rate, from two real stats snapshots: the
    turns committed between them over the time between them, and the share of prefetch
    calls the cache answered."""
    from hermes_async_memory import MemoryPipeline, Settings
    from hermes_async_memory.ui.series import Series

    series = Series(interval_s=10.0)
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db")) as mem:
        series.add(mem.stats(), at=1000.0)
        for i in range(40):
            mem.sync_turn(f"question {i}", f"answer {i}", session_id=f"s{i % 4}", user_id="u")
        await mem.flush()
        for i in range(4):
            mem.prefetch("question", session_id=f"s{i}", user_id="u")
        before = mem.stats()
        series.add(before, at=1010.0)
    data = series.as_json()
    assert data["t"] == [1000.0, 1010.0]
    assert data["commits_per_s"] == [None, 4.0]
    asked = before.recall_hits + before.recall_misses
    assert asked == 4
    assert data["recall_hit_rate"] == [None, round(before.recall_hits / asked, 4)]
    assert data["queued_turns"][1] == 0


async def test_an_hour_of_samples_is_kept_and_no_more(tmp_path: Path) -> None:
    from hermes_async_memory import MemoryPipeline, Settings
    from hermes_async_memory.ui.series import Series

    series = Series(interval_s=10.0)
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db")) as mem:
        stats = mem.stats()
    for i in range(500):
        series.add(stats, at=float(i * 10))
    t = series.as_json()["t"]
    assert len(t) == 361 and t[-1] - t[0] == 3600.0


async def test_a_search_of_only_common_words_over_everyone_shows_the_newest_first(
        tmp_path: Path) -> None:
    """Ranking every message that holds a common word is too slow for a page: over everyone's
    messages, when each word is frequent, the newest matches come first and the page says
    so; a user's own search, or one with a rarer word, stays ranked."""
    import re

    import anyio.to_thread

    from hermes_async_memory import MemoryPipeline, Settings

    settings = Settings(db_path=tmp_path / "m.db", frequent_term_rows=50)
    async with MemoryPipeline(settings) as mem:
        for i in range(120):  # "weather" is in 120 messages: frequent (over 50)
            mem.sync_turn(f"weather report {i}" + (" zanzibar" if i == 7 else ""), "noted",
                          session_id=f"s{i % 6}", user_id=f"u{i % 3}")
    server = serve_inspector(settings, "127.0.0.1", 0, Access(None, loopback=True))
    try:
        base = server.url + "/ui/search?q="

        def page(query: str) -> str:
            status, _, body = get(base + query)
            assert status == 200, body
            return body.decode()

        everyone = await anyio.to_thread.run_sync(page, "weather")
        assert 'id="order-notice"' in everyone
        shown = [int(n) for n in re.findall(r"· message (\d+)</div>", everyone)]
        assert len(shown) == 50 and shown == sorted(shown, reverse=True)
        assert "report 119" in everyone  # the newest turn's message
        for ranked in ("weather&user=u1", "weather+zanzibar"):
            body = await anyio.to_thread.run_sync(page, ranked)
            assert 'id="order-notice"' not in body, ranked
        assert "report 7 " in await anyio.to_thread.run_sync(page, "weather+zanzibar")
    finally:
        server.close()


async def test_the_pipeline_page_names_a_failed_part_and_the_passing_troubles(
        tmp_path: Path) -> None:
    """The health the worker reports is what the page shows: the failed state with its cause,
    and each condition (a full disk) with its detail. The health is given as /healthz would
    read it from a pipeline in that state; the figures are a real pipeline's."""
    import anyio.to_thread

    from hermes_async_memory import MemoryPipeline, Settings
    from hermes_async_memory.supervisor import Health
    from hermes_async_memory.ui.server import Inspector
    from hermes_async_memory.worker.wsgi import WsgiServer, serve_wsgi

    settings = Settings(db_path=tmp_path / "m.db")
    async with MemoryPipeline(settings) as mem:
        mem.sync_turn("hello", "hi", session_id="s", user_id="u")
        await mem.flush()
        stats = mem.stats()
    health = Health("failed", False, "writer: the store file is damaged (database disk image "
                    "is malformed)", {"disk_full": "no space left on /var/lib/memory"})
    inspector = Inspector(settings, Access(None, loopback=True), live=lambda: (health, stats))
    server = WsgiServer(*serve_wsgi(inspector.app, "127.0.0.1", 0, name="test"),
                        inspector.close)
    try:
        status, _, body = await anyio.to_thread.run_sync(get, server.url + "/ui")
        text = body.decode()
        assert status == 200
        assert "State: <strong>failed</strong>" in text
        assert "writer: the store file is damaged" in text
        assert "<strong>disk_full</strong>: no space left on /var/lib/memory" in text
        assert "Committed turns</th><td>1</td>" in text
    finally:
        await server.aclose()


async def test_the_pipeline_page_shows_the_shared_job_queue(tmp_path: Path) -> None:
    """A worker on PostgreSQL: the page lists the shared jobs by kind and status with the
    oldest one's age, as the worker last read them; none says so; a worker without the
    shared store shows no such section."""
    import anyio.to_thread

    from hermes_async_memory import MemoryPipeline, Settings
    from hermes_async_memory.ui.server import Inspector
    from hermes_async_memory.worker.wsgi import WsgiServer, serve_wsgi

    settings = Settings(db_path=tmp_path / "m.db")
    async with MemoryPipeline(settings) as mem:
        health, stats = mem.health(), mem.stats()
    queue: list[tuple[str, str, int, float]] = [
        ("procedural", "dead", 1, 3600.0), ("recall", "queued", 12, 4.25)]
    pages: dict[str, str] = {}
    for name, rows in (("jobs", lambda: queue), ("empty", list), ("none", None)):
        inspector = Inspector(settings, Access(None, loopback=True),
                              live=lambda: (health, stats), jobs_queue=rows)
        server = WsgiServer(*serve_wsgi(inspector.app, "127.0.0.1", 0, name="test"),
                            inspector.close)
        try:
            status, _, body = await anyio.to_thread.run_sync(get, server.url + "/ui")
            assert status == 200
            pages[name] = body.decode()
        finally:
            await server.aclose()
    assert "<tr><td>recall</td><td>queued</td><td>12</td><td>4.2 s ago</td></tr>" in \
        pages["jobs"]
    assert "<tr><td>procedural</td><td>dead</td><td>1</td><td>3600.0 s ago</td></tr>" in \
        pages["jobs"]
    assert "None queued, running or dead." in pages["empty"]
    assert 'id="jobs"' not in pages["none"]
