"""A real headless browser for tests: Debian's chromium (apt package ``chromium``), driven by
Playwright for Python, which is used only as the driver. Playwright's own browser builds are
never downloaded (``playwright install`` is not run, and could not fetch anything here); the
browser is launched by path, ``shutil.which("chromium")``. ``.ci/run`` installs it when it is
missing; without it every browser test fails with one line saying how to install it.

Which Playwright API: the async one. The suite runs pytest-asyncio in auto mode, and the sync
API does not fit it:

- Inside an ``async def`` test the sync API cannot run at all (it runs its own event loop,
  and one is already running).
- Worse, a sync Playwright kept open across tests (a session-scoped browser) leaves its event
  loop marked as running in the main thread between calls, so every ``async def`` test after
  it in the run fails with "Runner.run() cannot be called from a running event loop", browser
  or not. Checked with pytest-asyncio 1.5 and Playwright 1.65.

The async API works in any ``async def`` test. A test that drives a page is therefore written
``async def`` (auto mode runs it; no marker for that); a plain ``def`` test cannot use these
fixtures, and the fixtures say so.

Playwright's async objects belong to the event loop that created them. The session's browser
is launched once, in pytest-asyncio's session-scoped loop, so a test that uses ``browser``,
``page`` or ``new_context`` runs in that loop: mark its module ``pytestmark = BROWSER_LOOP``
(or the test ``@BROWSER_LOOP``); the fixtures fail with that advice otherwise. The test's own
async fixtures must then be in that loop too (``@pytest_asyncio.fixture(loop_scope="session")``):
a fixture of the default, per-test loop (``mem``, ``spawn``) would run its tasks in a loop
that is not running during the test. A test that needs such fixtures launches a browser of
its own in its own loop instead: ``async with browser_in_this_loop() as browser:`` (about
0.6 s more).

What a page did wrong is recorded, for a test to assert nothing happened: ``log_of(page)``
gives its console errors, uncaught exceptions and Content-Security-Policy violations
(``PageLog.assert_clean()``). ``await screenshot(page, name)`` saves a full-page PNG under
``artifacts_dir()``: ``$HERMES_TEST_ARTIFACTS``, else ``<repo>/.artifacts/browser/``.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import shutil
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from playwright.async_api import (
    Browser,
    BrowserContext,
    ConsoleMessage,
    Error,
    Page,
    Playwright,
    async_playwright,
)

from .processes import ROOT

# Marks a test (or a module, as ``pytestmark``) to run in the loop of the session's browser.
BROWSER_LOOP = pytest.mark.asyncio(loop_scope="session")

# Tests run as root in a container: Chromium's sandbox needs user namespaces it does not get
# there (--no-sandbox); /dev/shm may be small (--disable-dev-shm-usage); there is no GPU.
LAUNCH_ARGS = [
    "--no-sandbox",
    "--disable-dev-shm-usage",
    "--disable-gpu",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
]
# A page action that waits longer than this has failed (Playwright's default is 30 s).
DEFAULT_TIMEOUT_MS = 10_000

INSTALL_HINT = (
    "chromium is not installed, and the browser tests need it (Debian's package, driven by "
    "Playwright): apt-get update && apt-get install -y --no-install-recommends chromium "
    "fonts-dejavu-core (.ci/run does this when it is missing)"
)

# Reports each 'securitypolicyviolation' event to the binding below. Playwright adds both
# through the DevTools protocol, so the page's own CSP does not block them.
_CSP_BINDING = "__hermesTestCspViolation"
_CSP_REPORTER = """
document.addEventListener('securitypolicyviolation', (e) => {
  const report = window.BINDING;
  if (report) report({
    directive: e.effectiveDirective, violated: e.violatedDirective,
    blocked: e.blockedURI, source: e.sourceFile, line: e.lineNumber, sample: e.sample,
  });
}, true);
""".replace("BINDING", _CSP_BINDING)


class BrowserUnavailable(Exception):
    """chromium is not installed."""


def chromium_path() -> str:
    path = shutil.which("chromium")
    if path is None:
        raise BrowserUnavailable(INSTALL_HINT)
    return path


async def launch(playwright: Playwright) -> Browser:
    """Debian's chromium, headless."""
    return await playwright.chromium.launch(
        executable_path=chromium_path(), headless=True, args=LAUNCH_ARGS)


@asynccontextmanager
async def browser_in_this_loop() -> AsyncIterator[Browser]:
    """A browser of this test's own, in its own event loop (for a test that cannot run in
    the session's loop, see the module's doc); closed on exit."""
    async with async_playwright() as playwright:
        browser = await launch(playwright)
        try:
            yield browser
        finally:
            await browser.close()


@dataclass
class PageLog:
    """What went wrong in one page: console messages of type error, uncaught exceptions
    (``pageerror``) and Content-Security-Policy violations (each a dict: directive, violated,
    blocked, source, line, sample). A CSP violation also logs a console error in Chromium."""

    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    csp_violations: list[dict[str, Any]] = field(default_factory=list)
    # Set at each event recorded (``noted``): what ``wait_for`` waits on.
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def noted(self) -> None:
        self.changed.set()

    def problems(self) -> list[str]:
        return ([f"console error: {text}" for text in self.console_errors]
                + [f"uncaught exception: {text}" for text in self.page_errors]
                + [f"CSP violation: {v}" for v in self.csp_violations])

    def assert_clean(self) -> None:
        problems = self.problems()
        assert not problems, "the page reported:\n" + "\n".join(problems)

    async def wait_for(self, condition: Callable[[PageLog], object],
                       timeout_s: float = 5.0) -> None:
        """Wait until ``condition(self)`` is true: the events arrive asynchronously, possibly
        after ``goto`` has returned."""
        try:
            with anyio.fail_after(timeout_s):
                while not condition(self):
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            raise AssertionError(f"not reported within {timeout_s} s; so far: "
                                 f"{self.problems() or 'nothing'}") from None


_LOG_ATTR = "_hermes_test_log"


def log_of(page: Page) -> PageLog:
    """The PageLog of a page of a context made by ``open_context``."""
    log = getattr(page, _LOG_ATTR, None)
    if not isinstance(log, PageLog):
        raise TypeError("this page's events are not recorded: open it in a context made by "
                        "tests.browser.open_context (or use the page or new_context fixture)")
    return log


def _watch(page: Page) -> None:
    log = PageLog()
    setattr(page, _LOG_ATTR, log)

    def on_console(message: ConsoleMessage) -> None:
        if message.type == "error":
            log.console_errors.append(message.text)
            log.noted()

    def on_pageerror(error: Error) -> None:
        log.page_errors.append(f"{error.name}: {error.message}")
        log.noted()

    page.on("console", on_console)
    page.on("pageerror", on_pageerror)


def _csp_report(source: dict[str, Any], violation: dict[str, Any]) -> None:
    page = source.get("page")
    if page is not None:
        log = log_of(page)
        log.csp_violations.append(violation)
        log.noted()


async def open_context(browser: Browser, *, javascript: bool = True,
                      **options: Any) -> BrowserContext:
    """A new context (its own cookies, storage and cache) whose pages record their problems
    (``log_of``). ``javascript=False``: the pages run no script (``java_script_enabled``);
    their CSP violations are then only seen as console errors. ``options``: any other of
    ``Browser.new_context``'s."""
    context = await browser.new_context(java_script_enabled=javascript, **options)
    context.set_default_timeout(DEFAULT_TIMEOUT_MS)
    context.on("page", _watch)
    if javascript:
        await context.expose_binding(_CSP_BINDING, _csp_report)
        await context.add_init_script(_CSP_REPORTER)
    return context


def artifacts_dir() -> Path:
    """Where screenshots go: ``$HERMES_TEST_ARTIFACTS``, else ``<repo>/.artifacts/browser``
    (ignored by git). Created on first use."""
    configured = os.environ.get("HERMES_TEST_ARTIFACTS")
    folder = Path(configured) if configured else ROOT / ".artifacts" / "browser"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


async def screenshot(page: Page, name: str) -> Path:
    """Save a full-page PNG of ``page`` as ``<artifacts_dir()>/<name>.png`` (characters
    other than letters, digits, ``.``, ``_`` and ``-`` become ``_``; an earlier file of that
    name is replaced) and return its path."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "page"
    path = artifacts_dir() / f"{safe}.png"
    await page.screenshot(path=str(path), full_page=True)
    return path


def require_browser_loop(request: pytest.FixtureRequest) -> None:
    """Fail, with the way out, a test that cannot use the session's browser: a plain ``def``
    test, or an async one not running in the session's loop."""
    item = request.node
    if not inspect.iscoroutinefunction(getattr(item, "obj", None)):
        pytest.fail(f"{item.nodeid}: the browser fixtures use Playwright's async API "
                    "(tests/browser.py says why): write the test as 'async def'",
                    pytrace=False)
    marker = item.get_closest_marker("asyncio")
    scope = marker.kwargs.get("loop_scope") if marker is not None else None
    scope = scope or request.config.getini("asyncio_default_test_loop_scope")
    if scope != "session":
        pytest.fail(f"{item.nodeid}: the session's browser lives in the session's event loop: "
                    "mark the module 'pytestmark = BROWSER_LOOP' (tests/browser.py), or use "
                    "'async with browser_in_this_loop() as browser:' in the test", pytrace=False)
