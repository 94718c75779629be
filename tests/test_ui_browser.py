"""The memory inspector in a real headless Chromium (Debian's), against a store filled by the
library's own API (tests/ui_fixtures.py): every view shows what a person needs, stored markup
stays text, a search marks its matches, the pages work with JavaScript off, the charts draw
from the vendored script under the page's Content-Security-Policy, replay without the token
is refused, and the pipeline page shows the word index's rebuild after an upgrade. Each view
leaves a screenshot in the artifacts folder (tests/browser.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from playwright.async_api import Page, expect

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.ui.access import Access
from hermes_async_memory.ui.server import serve_inspector

from .browser import BROWSER_LOOP, log_of, screenshot
from .conftest import NewContext
from .ui_fixtures import HOSTILE, POISON, Fixture, fill_store, http_worker, store_mid_reindex

pytestmark = BROWSER_LOOP

TOKEN = "a-long-enough-test-token-0123456789"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def filled(tmp_path_factory: pytest.TempPathFactory) -> Fixture:
    return await fill_store(tmp_path_factory.mktemp("ui"))


@pytest.fixture(scope="module")
def site(filled: Fixture) -> Iterator[str]:
    """The inspector of the fixture store on 127.0.0.1, alone (``hermes-memory ui``'s server),
    with a token set: replay is on, and needs it."""
    server = serve_inspector(filled.settings, "127.0.0.1", 0, Access(TOKEN, loopback=True))
    try:
        yield server.url + "/ui"
    finally:
        server.close()


# (screenshot name, path, texts a person must see there)
VIEWS = [
    ("pipeline", "", ["No pipeline runs in this process", "Dead letters",
                      "value rejected by the store", "3 sessions"]),
    ("users", "/users", ["ada", "bob"]),
    ("sessions", "/sessions?user=ada", ["ada-1", "ada-2", "cli", "gpt-test", "compressed"]),
    ("session-tools", "/session?id=ada-2", ["Parent chain", "ada-1", "terminal",
                                             "python -m pytest -q", "12 passed",
                                             "All 12 tests pass."]),
    ("session-hostile", "/session?id=ada-1", [HOSTILE, "Continued in", "ada-2"]),
    ("search", "/search?q=deploy+billing&user=ada", ["deploy", "billing", "ada-1"]),
    ("search-source", "/search?q=capital&source=telegram", ["bob-1", "telegram"]),
    ("preview", "/preview?user=ada&session=ada-2&q=deploy+billing",
     ["The block prefetch would return", "Where each line came from", "deploy the billing"]),
    ("memory", "/memory?user=ada", ["editor", "vim, with 4-space indents", HOSTILE]),
    ("procedural", "/procedural?user=ada", ["terminal", "success rate", "50%", "read_file"]),
    ("templates", "/templates", ["test-runner", "code"]),
]


@pytest.mark.parametrize(("name", "path", "texts"), VIEWS, ids=[v[0] for v in VIEWS])
async def test_each_view_shows_its_content_with_no_script_or_policy_error(
        page: Page, site: str, name: str, path: str, texts: list[str]) -> None:
    response = await page.goto(site + path)
    assert response is not None and response.status == 200
    assert "script-src 'self'" in (await response.all_headers())["content-security-policy"]
    main = page.locator("main")
    for text in texts:
        await expect(main).to_contain_text(text)
    await screenshot(page, f"ui-{name}")
    log_of(page).assert_clean()


async def test_stored_markup_stays_text_everywhere_it_is_shown(page: Page, site: str) -> None:
    for path in ("/session?id=ada-1", "/memory?user=ada", "/search?q=remember&user=ada",
                 "/preview?user=ada&session=ada-1&q=remember+this"):
        await page.goto(site + path)
        await expect(page.locator("main")).to_contain_text("<script>document.title")
        assert await page.title() != "owned", path
        assert await page.locator("main script").count() == 0, path
        assert await page.locator("img[src='x']").count() == 0, path
    log_of(page).assert_clean()


# A message holding the session search's own marks, the page's mark element and a script.
MARKUP = "walrus notes: >>>x<<< and <mark>y</mark> and <script>document.title='owned'</script>"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def marks_site(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    """The inspector of a store of its own: two messages with the word walrus, one of them
    MARKUP, and one in Chinese (searched as substrings, its snippet cut by the library)."""
    settings = Settings(db_path=tmp_path_factory.mktemp("marks") / "memory.db")
    async with MemoryPipeline(settings) as mem:
        mem.sync_turn("the walrus sleeps on the ice", "It does.", session_id="s1",
                      user_id="ada")
        mem.sync_turn(MARKUP, "Stored as text.", session_id="s1", user_id="ada")
        mem.sync_turn("我们把大别山项目计划书发给了老师", "好的。", session_id="s2",
                      user_id="ada")
        await mem.flush()
    server = serve_inspector(settings, "127.0.0.1", 0, Access(None, loopback=True))
    try:
        yield server.url + "/ui"
    finally:
        server.close()


async def test_a_search_shows_each_match_in_a_mark(page: Page, marks_site: str) -> None:
    await page.goto(marks_site + "/search?q=walrus&user=ada")
    snippets = page.locator("#hits .snippet")
    await expect(snippets).to_have_count(2)
    for i in range(2):
        await expect(snippets.nth(i).locator("mark")).to_have_text(["walrus"])
    await page.goto(marks_site + "/search?q=大别山&user=ada")
    await expect(page.locator("#hits .snippet mark")).to_have_text(["大别山"])
    await expect(page.locator("#hits .snippet")).to_have_text("我们把大别山项目计划书发给了老师")
    await screenshot(page, "ui-search-marks")
    log_of(page).assert_clean()


async def test_stored_marks_and_markup_in_a_hit_show_as_text(page: Page, marks_site: str
                                                            ) -> None:
    """The session search's own >>> <<<, a <mark> and a <script> in a stored message are
    its text: only the matched word is marked, and nothing runs."""
    await page.goto(marks_site + "/search?q=walrus+script&user=ada")
    snippet = page.locator("#hits .snippet")
    await expect(snippet).to_have_count(1)
    await expect(snippet).to_have_text(MARKUP)
    await expect(snippet.locator("mark")).to_have_text(["walrus", "script", "script"])
    assert await page.locator("main script").count() == 0
    assert await page.title() != "owned"
    # And a search for a word between the stored marks marks that word, inside them.
    await page.goto(marks_site + "/search?q=x&user=ada")
    await expect(snippet).to_have_text(MARKUP)
    await expect(snippet.locator("mark")).to_have_text(["x"])
    await screenshot(page, "ui-search-stored-markup")
    log_of(page).assert_clean()


async def test_the_preview_names_the_stored_message_of_each_line(page: Page, site: str
                                                                 ) -> None:
    await page.goto(site + "/preview?user=ada&session=ada-2&q=deploy+billing")
    rows = page.locator("#provenance tr.search")
    assert await rows.count() >= 1
    link = rows.first.locator("a")
    await expect(link).to_have_text("ada-1")
    await link.click()
    await expect(page.locator("h1")).to_have_text("Session ada-1")
    await expect(page.locator("main")).to_contain_text("how do I deploy the billing service")


async def test_every_view_works_with_javascript_off(new_context: NewContext, site: str
                                                    ) -> None:
    context = await new_context(javascript=False)
    page = await context.new_page()
    for _, path, texts in VIEWS:
        await page.goto(site + path)
        for text in texts:
            await expect(page.locator("main")).to_contain_text(text)
    await page.goto(site)
    await expect(page.locator("form.dead button")).to_be_enabled()
    await screenshot(page, "ui-pipeline-no-javascript")


@pytest_asyncio.fixture(loop_scope="session")
async def own_site(tmp_path: Path) -> AsyncIterator[tuple[str, Fixture]]:
    """A store of the test's own (replay changes it), served with the token set."""
    filled = await fill_store(tmp_path)
    server = serve_inspector(filled.settings, "127.0.0.1", 0, Access(TOKEN, loopback=True))
    try:
        yield server.url + "/ui", filled
    finally:
        server.close()


async def test_replay_without_the_token_is_refused_and_with_it_stores_the_turn(
        page: Page, own_site: tuple[str, Fixture]) -> None:
    site, filled = own_site
    await page.goto(site)
    form = page.locator("form.dead")
    await expect(form).to_contain_text(filled.dead_key)
    for token in ("", "wrong-token-of-enough-length-000"):
        await form.locator("input[name=token]").fill(token)
        await form.locator("button").click()
        await expect(page.locator("#error")).to_have_text(
            "replay refused: wrong or missing token")
        await page.goto(site)
        await expect(page.locator("form.dead")).to_contain_text(filled.dead_key)
    await screenshot(page, "ui-replay-refused")

    await form.locator("input[name=token]").fill(TOKEN)
    await form.locator("button").click()
    await expect(page.locator("#notice")).to_have_text("1 replayed, 0 failed")
    await expect(page.locator("#dead-letters")).to_contain_text("None: every accepted turn")
    await page.goto(site + "/session?id=bob-1")
    await expect(page.locator("main")).to_contain_text(POISON)
    await screenshot(page, "ui-replayed")


async def test_replay_is_off_without_a_token(page: Page, tmp_path: Path) -> None:
    filled = await fill_store(tmp_path)
    server = serve_inspector(filled.settings, "127.0.0.1", 0, Access(None, loopback=True))
    try:
        await page.goto(server.url + "/ui")
        await expect(page.locator("form.dead button")).to_be_disabled()
        await expect(page.locator("form.dead")).to_contain_text("Replay needs "
                                                               "HERMES_MEMORY_UI_TOKEN")
        # A request made without the page (a script, another site's form) is refused too.
        answer = await page.request.post(server.url + "/ui/dead-letters/replay",
                                         form={"key": filled.dead_key, "token": ""})
        assert answer.status == 403
    finally:
        server.close()


@pytest.fixture
def worker(tmp_path: Path) -> Iterator[str]:
    """``hermes-memory worker --http 127.0.0.1:0`` on a store of its own; yields /ui's URL."""
    with http_worker(tmp_path / "memory.db") as listening:
        yield str(listening["ui"])


async def test_the_worker_serves_live_health_and_draws_the_charts(page: Page, worker: str
                                                                  ) -> None:
    await page.goto(worker)
    await expect(page.locator("#health")).to_contain_text("State: open")
    figures = page.locator("figure[data-chart]")
    await expect(figures).to_have_count(5)
    for i in range(5):
        # Drawn by the vendored uPlot from series.json: a canvas, and at least one sample.
        await expect(figures.nth(i).locator("canvas")).to_have_count(1)
        assert int(await figures.nth(i).get_attribute("data-drawn") or 0) >= 1
    await expect(page.locator("#charts")).to_contain_text("Recall hit rate")
    await screenshot(page, "ui-worker-live")
    log_of(page).assert_clean()


async def test_the_pipeline_page_shows_the_word_index_rebuild_while_it_is_under_way(
        page: Page, site: str, tmp_path: Path) -> None:
    """A store upgraded from before the index stemmed, whose rebuild a stopped worker left
    at 125 of its 1,200 messages: the page says how far it is; a store with none says
    nothing of it."""
    settings = await store_mid_reindex(tmp_path)
    server = serve_inspector(settings, "127.0.0.1", 0, Access(None, loopback=True))
    try:
        await page.goto(server.url + "/ui")
        await expect(page.locator("#store #reindex")).to_contain_text(
            "Word index: rebuilding after an upgrade, 125 of 1,200 messages (10%)")
        await screenshot(page, "ui-pipeline-reindex")
    finally:
        server.close()
    await page.goto(site)
    await expect(page.locator("#store")).to_contain_text("3 sessions")
    await expect(page.locator("#reindex")).to_have_count(0)
    log_of(page).assert_clean()
