from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any, Protocol

import pytest
import pytest_asyncio
import structlog
from playwright.async_api import Browser, BrowserContext, Page

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.logs import StandardLogging

from .browser import (
    BrowserUnavailable,
    browser_in_this_loop,
    chromium_path,
    open_context,
    require_browser_loop,
)
from .fake_honcho import FakeHoncho
from .pg_server import PostgresServer, PostgresUnavailable
from .processes import ROOT, Spawn, Worker, child_env


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """A command run in-process configures logging for its process (level, stream); the
    next test gets the configuration back as it was."""
    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    structlog.configure(**saved)
    for handler in root.handlers[:]:  # configure_logging's, not pytest's own
        if isinstance(handler, StandardLogging) and handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No HERMES_MEMORY_* variable of the developer's shell reaches the code under test."""
    for key in list(os.environ):
        if key.startswith("HERMES_MEMORY_"):
            monkeypatch.delenv(key)


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(db_path=tmp_path / "memory.db")


@pytest.fixture
async def mem(settings: Settings) -> AsyncIterator[MemoryPipeline]:
    async with MemoryPipeline(settings) as pipeline:
        yield pipeline


@pytest.fixture
async def spawn() -> AsyncIterator[Spawn]:
    """Start worker subprocesses; any still running at the end of the test is killed."""
    started: list[asyncio.subprocess.Process] = []

    async def start(*args: str, env: dict[str, str] | None = None,
                    stdin: bool = False) -> Worker:
        """``python *args``, with ``env`` added to its environment; ``stdin``: a pipe the
        test writes to (``Worker.send_line``)."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, *args, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=child_env(**(env or {})), cwd=ROOT,
            stdin=asyncio.subprocess.PIPE if stdin else None,
        )
        started.append(proc)
        return Worker(proc)

    yield start
    for proc in started:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeHoncho]:
    """A Honcho-compatible server on 127.0.0.1 (tests/fake_honcho.py), one per test module."""
    fake = FakeHoncho()
    fake.start()
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture
def fake(fake_server: FakeHoncho) -> Iterator[FakeHoncho]:
    """The module's Honcho server, reset, up, and with no API key required."""
    fake_server.api_key = None
    fake_server.reset()
    if not fake_server.is_up:
        fake_server.up()
    yield fake_server
    fake_server.release_hangs()


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    """A PostgreSQL 15 server for the whole run (tests/pg_server.py), on 127.0.0.1, run as an
    unprivileged account when the tests run as root; stopped and removed at the end, however
    the run ends. No binaries: every test that needs it fails with one line saying so."""
    failure: str | None = None
    server: PostgresServer | None = None
    try:
        server = PostgresServer.create()
        server.start()
    except PostgresUnavailable as exc:
        failure = str(exc)  # failed below, outside this block: one line, no chained error
    try:
        if failure is not None or server is None:
            pytest.fail(failure or "no PostgreSQL server", pytrace=False)
        yield server
    finally:
        if server is not None:
            server.cleanup()


@pytest.fixture
def pg_dsn(pg_server: PostgresServer) -> str:
    """A new, empty database of this test's own (as the application's role, with its
    password): tests do not see each other's rows."""
    if not pg_server.running:  # a test that stopped it failed before starting it again
        pg_server.start()
    return pg_server.create_database()


# A real headless browser: Debian's chromium driven by Playwright's async API. Why async,
# and why a test using these runs in the session's loop (pytestmark = BROWSER_LOOP): see
# tests/browser.py.


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def browser() -> AsyncIterator[Browser]:
    """Headless chromium for the whole run, launched on first use. Not installed: every test
    that needs it fails with one line saying how to install it (never skipped)."""
    failure: str | None = None
    try:
        chromium_path()
    except BrowserUnavailable as exc:
        failure = str(exc)  # failed below, outside this block: one line, no chained error
    if failure is not None:
        pytest.fail(failure, pytrace=False)
    async with browser_in_this_loop() as launched:
        yield launched


class NewContext(Protocol):
    def __call__(self, *, javascript: bool = True, **options: Any) -> Awaitable[BrowserContext]:
        ...


@pytest_asyncio.fixture(loop_scope="session")
async def new_context(request: pytest.FixtureRequest,
                      browser: Browser) -> AsyncIterator[NewContext]:
    """``await new_context(javascript=False, **options)``: a new context of the session's
    browser whose pages record their problems (``log_of``); closed at the end of the test."""
    require_browser_loop(request)
    contexts: list[BrowserContext] = []

    async def make(*, javascript: bool = True, **options: Any) -> BrowserContext:
        context = await open_context(browser, javascript=javascript, **options)
        contexts.append(context)
        return context

    yield make
    for context in contexts:
        await context.close()


@pytest_asyncio.fixture(loop_scope="session")
async def page(new_context: NewContext) -> Page:
    """A page in a context of its own, JavaScript on; ``log_of(page)`` has what it reported."""
    context = await new_context()
    return await context.new_page()


# The Hermes provider's tests (test_hermes_provider, test_hermes_turn_span).

@pytest.fixture
def restore_structlog() -> Iterator[None]:
    """The plugin's register() routes structlog to logging when nobody configured it: put
    back what the test found."""
    configured, saved = structlog.is_configured(), structlog.get_config()
    yield
    if configured:
        structlog.configure(**saved)
    else:
        structlog.reset_defaults()


@pytest.fixture
def home(tmp_path: Path) -> Path:
    return tmp_path / "hermes-home"
