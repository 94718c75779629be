"""The browser harness (tests/browser.py, fixtures in conftest.py) against a real HTTP server on
127.0.0.1 whose page has a Content-Security-Policy: the same-origin script runs, the inline one
is blocked and reported, a screenshot is written, and a context without JavaScript runs none."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import pytest
from playwright.async_api import Page

from .browser import BROWSER_LOOP, log_of, screenshot
from .conftest import NewContext

pytestmark = BROWSER_LOOP

CSP = "default-src 'self'"
INDEX = b"""<!doctype html>
<html><head><meta charset="utf-8"><title>harness</title></head>
<body>
<h1>Browser harness</h1>
<p id="out"></p>
<p id="inline-out"></p>
<script>
  window.inlineRan = true;
  document.getElementById('inline-out').textContent = 'written by the inline script';
</script>
<script src="/app.js"></script>
</body></html>
"""
APP_JS = b"document.getElementById('out').textContent = 'written by app.js';\n"


def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
    routes = {"/": (INDEX, "text/html; charset=utf-8"),
              "/app.js": (APP_JS, "text/javascript; charset=utf-8")}
    path = environ.get("PATH_INFO", "/")
    if path not in routes:
        start_response("404 Not Found", [("Content-Type", "text/plain"),
                                         ("Content-Security-Policy", CSP)])
        return [b"not found"]
    body, kind = routes[path]
    start_response("200 OK", [("Content-Type", kind), ("Content-Length", str(len(body))),
                              ("Content-Security-Policy", CSP)])
    return [body]


class _Server(ThreadingMixIn, WSGIServer):
    # A request per thread: the browser may open a connection it sends nothing on.
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def site() -> Iterator[str]:
    server = make_server("127.0.0.1", 0, app, server_class=_Server,
                         handler_class=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


async def test_csp_blocks_the_inline_script_and_reports_it(page: Page, site: str) -> None:
    await page.goto(site)
    await page.wait_for_function("document.getElementById('out').textContent !== ''")

    assert await page.locator("#out").inner_text() == "written by app.js"
    assert await page.locator("#out").is_visible()
    # The inline script did not run (page.evaluate is not subject to the page's CSP).
    assert await page.locator("#inline-out").inner_text() == ""
    assert await page.evaluate("window.inlineRan") is None

    log = log_of(page)
    await log.wait_for(lambda log: log.csp_violations and log.console_errors)
    [violation] = log.csp_violations
    assert violation["directive"] == "script-src-elem"
    assert violation["blocked"] == "inline"
    assert any("Content Security Policy" in text for text in log.console_errors)
    assert log.page_errors == []
    with pytest.raises(AssertionError, match="CSP violation"):
        log.assert_clean()

    path = await screenshot(page, "harness/csp page")
    assert path.name == "harness_csp_page.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 1000


async def test_a_context_without_javascript_runs_no_script(new_context: NewContext,
                                                           site: str) -> None:
    context = await new_context(javascript=False)
    page = await context.new_page()
    await page.goto(site)

    assert await page.locator("h1").inner_text() == "Browser harness"
    assert await page.locator("#out").inner_text() == ""
    assert await page.locator("#inline-out").inner_text() == ""
