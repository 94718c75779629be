"""Memory inspector: every page's p99 under 200 ms with 1,000,000 stored messages, against
the same reads made directly through the library, in the same run.

The store is built once through the pipeline by bench_sessions' ``build`` (``sync_turn``
with OpenAI messages and metadata, ``max_batch=5000``) and cached under benchmarks/.data/
keyed by its parameters and the store schema; later runs reuse it. 1,000 users
(``--quick``: 100 users, 100,000 messages; each user holds ~1,000 messages either way),
10 sessions each, every session from one source; a fifth of the turns carry a tool call
whose answer is JSON, a fifth of those a failure (so the tool-call log has successes,
failures and error types); then, through the public API: parent links between consecutive
sessions of a user here and there (``sessions.describe_nowait(parent_session_id=…)``),
2-30 key-value entries per user (``KeyValueMemory.store_nowait``), templates extracted
from sessions (``templates.extract``) and warm and cold session outcomes
(``templates.start_nowait`` / ``templates.end``). Text from ``_common.Corpus``.

Served by ``serve_inspector(settings, "127.0.0.1", 0, Access(None, loopback=True))`` in
this process; 4 client threads (http.client, a new connection per request) request each
view with parameters drawn per request from the data: a random page of users, a random
user's sessions, a random session, a search for 1-3 words of a random message of a random
user (scoped to that user, and again for all users), a common word (in 16-26 % of the
messages) for all users (40 requests: the heaviest search there is), a prefetch preview
of a random session with a recall-style query, a random user's key-value entries and
tools, the templates. Latency is timed at the client from connect to the last byte; 200
requests a view after 20 warm-up (``--quick``: 60).

Baseline, per view, with the same parameters and the same 4-way concurrency (4 tasks on
one event loop, over a read-only store with 4 readers, as the inspector opens it): the
library calls the view makes, awaited one after the other, without HTTP or rendering
(``FileSessionReads.search``, ``store.list_users`` + ``store.count_users``, ...;
``preview_prefetch`` is given the frequent terms, read once beforehand, as the inspector
reads them in the background). Views and baselines alternate in chunks. Afterwards each
view is requested by one client alone and each of its reads timed alone, to say where a
slow page spends its time.
"""

from __future__ import annotations

import asyncio
import hashlib
import http.client
import itertools
import json
import random
import sqlite3
import sys
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio.to_thread
import bench_sessions
from _common import (
    DATA_DIR,
    FLUSH_TIMEOUT_S,
    STOPWORDS,
    Corpus,
    CorpusSpec,
    Result,
    fmt_ns,
    library_version,
    machine,
    now_ns,
    parser,
    print_table,
    quiet_logs,
    report,
    summary,
)
from anyio.from_thread import BlockingPortal, start_blocking_portal

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.memory.api import KeyValueMemory
from hermes_async_memory.procedural.api import ProceduralMemory
from hermes_async_memory.recall.preview import preview_prefetch
from hermes_async_memory.recall.query import all_frequent
from hermes_async_memory.sessions.reads import FileSessionReads
from hermes_async_memory.store import SCHEMA, SCHEMA_VERSION, SqliteStore
from hermes_async_memory.store.inspect import StoreReader
from hermes_async_memory.templates.model import Template
from hermes_async_memory.templates.store import TemplateReads
from hermes_async_memory.ui.access import Access
from hermes_async_memory.ui.reads import DEAD_SHOWN, MEMORY_USERS, PAGE
from hermes_async_memory.ui.server import serve_inspector

BUILD_VERSION = 1  # bump when build() or add_the_rest() change what they write
MESSAGES_PER_USER = 1_000
SESSIONS_PER_USER = 10
TOOL_FAILURE_SHARE = 0.2  # of the tool calls: a JSON answer with an error
TOOL_ERRORS = (
    ("FileNotFoundError", "No such file or directory: '{w}.py'"),
    ("PermissionError", "Permission denied: '/srv/{w}'"),
    ("TimeoutError", "the request to {w} timed out after 30 s"),
    ("ValueError", "invalid literal for int() with base 10: '{w}'"),
)
PARENT_SHARE = 0.15  # of a user's sessions after the first: continues the one before
KV_PER_USER = (2, 30)
KV_KINDS = ("pref", "fact", "project", "contact", "note")
TEMPLATES = 40
TEMPLATE_TAGS = ("python", "deploy", "search", "calendar", "shell", "docs", "billing")
TEMPLATE_OUTCOMES = 300  # sessions started from a template (warm) and ended
COLD_OUTCOMES = 100  # sessions ended with no template
CLIENTS = 4
CHUNKS = 4  # page and baseline requests alternate in this many chunks per view
GOAL_P99_NS = 200_000_000
SEARCH_WORDS = ((1, 2, 3), (50, 35, 15))  # 1-3 words a search, with these weights


# -- the store ---------------------------------------------------------------------------


def spec_for(messages: int) -> CorpusSpec:
    return CorpusSpec(users=max(1, messages // MESSAGES_PER_USER),
                      sessions_per_user=SESSIONS_PER_USER)


def db_path_for(messages: int, spec: CorpusSpec) -> Path:
    s = bench_sessions
    key = json.dumps(
        {
            "messages": messages,
            "corpus": asdict(spec),
            "sessions_build": [s.BUILD_VERSION, s.SOURCES, s.SOURCE_WEIGHTS, s.MODELS, s.TOOLS,
                               s.TOOL_TURN_SHARE, s.ENDED_SHARE],
            "build": [BUILD_VERSION, TOOL_FAILURE_SHARE, TOOL_ERRORS, PARENT_SHARE, KV_PER_USER,
                      KV_KINDS, TEMPLATES, TEMPLATE_TAGS, TEMPLATE_OUTCOMES, COLD_OUTCOMES],
            "schema_version": SCHEMA_VERSION,
            "schema": SCHEMA,
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return DATA_DIR / f"ui-{messages}-{digest}.db"


def tool_turn(rng: random.Random, corpus: Corpus, u: int, n: int, user: str,
              assistant: str) -> list[dict[str, Any]]:
    """bench_sessions' tool turn with a JSON answer, as terminal-style tools give: output,
    exit code and duration, or (``TOOL_FAILURE_SHARE``) an error of one of a few types."""
    msgs = bench_sessions.tool_turn(rng, corpus, u, n, user, assistant)
    answer = msgs[2]
    duration = rng.randint(20, 3_000)
    if rng.random() < TOOL_FAILURE_SHARE:
        kind, text = rng.choice(TOOL_ERRORS)
        word = corpus.band_word(rng, 300, 5_000)
        answer["content"] = json.dumps({"error": f"{kind}: {text.format(w=word)}",
                                        "exit_code": 1, "duration_ms": duration})
    else:
        answer["content"] = json.dumps({"output": answer["content"], "exit_code": 0,
                                        "duration_ms": duration})
    return msgs


def add_the_rest(corpus: Corpus) -> bench_sessions.AfterTurns:
    """What the store holds besides turns, all through the public API: parent links, key-
    value entries, templates and session outcomes."""

    async def after(mem: MemoryPipeline, plan: dict[str, tuple[int, str, str]],
                    rng: random.Random) -> None:
        by_user: dict[int, list[str]] = {}
        for sid, (u, _, _) in plan.items():
            by_user.setdefault(u, []).append(sid)
        links = 0
        for u, sids in by_user.items():
            for parent, sid in itertools.pairwise(sids):
                if rng.random() < PARENT_SHARE:
                    mem.sessions.describe_nowait(sid, user_id=corpus.user_id(u),
                                                 parent_session_id=parent)
                    links += 1
        kv = KeyValueMemory(mem)
        entries = 0
        for u in by_user:
            for _ in range(rng.randint(*KV_PER_USER)):
                key = f"{rng.choice(KV_KINDS)}.{corpus.band_word(rng, 300, 5_000)}"
                kv.store_nowait(corpus.user_id(u), key, corpus.message(rng, u, 4, 30))
                entries += 1
        await mem.flush(timeout=FLUSH_TIMEOUT_S)
        sids = list(plan)
        templates: list[Template] = []
        for i, sid in enumerate(rng.sample(sids, TEMPLATES)):
            word = corpus.band_word(rng, 300, 5_000)
            templates.append(await mem.templates.extract(
                sid, f"{word}-{i:02d}", description=corpus.message(rng, plan[sid][0], 4, 12),
                tags=rng.sample(TEMPLATE_TAGS, rng.randint(0, 3))))
        ended = rng.sample(sids, TEMPLATE_OUTCOMES + COLD_OUTCOMES)
        for sid in ended[:TEMPLATE_OUTCOMES]:
            mem.templates.start_nowait(sid, rng.choice(templates))
        for start in range(0, len(ended), 50):
            await asyncio.gather(*(mem.templates.end(sid) for sid in ended[start:start + 50]))
        print(f"  + {links:,} parent links, {entries:,} key-value entries, {TEMPLATES} "
              f"templates, {len(ended)} session outcomes", flush=True)

    return after


# -- the requests ------------------------------------------------------------------------


@dataclass
class Lib:
    """The library's handles on the store, opened as the inspector opens its own."""

    store: SqliteStore
    settings: Settings
    sessions: FileSessionReads
    procedural: ProceduralMemory
    templates: TemplateReads


@asynccontextmanager
async def open_lib(settings: Settings) -> AsyncIterator[Lib]:
    store = SqliteStore(settings.db_path, readers=4, busy_timeout_ms=settings.busy_timeout_ms)
    await store.open_readonly()
    try:
        # As the inspector does in the background (and a pipeline at start): the terms too
        # frequent to search for, which preview_prefetch is given.
        await store.refresh_frequent_terms(settings.frequent_term_rows,
                                           settings.frequent_term_ratio)
        yield Lib(store, settings, FileSessionReads(store), ProceduralMemory(store),
                  TemplateReads(store, settings.templates))
    finally:
        await store.aclose()


Step = tuple[str, Callable[[], Awaitable[Any]]]
Params = dict[str, str]


def _dead_letters(lib: Lib) -> Any:
    with StoreReader(lib.settings.db_path,
                     busy_timeout_ms=lib.settings.busy_timeout_ms) as reader:
        return reader.dead_letters(DEAD_SHOWN), [
            reader.replica_dead_letters(b, DEAD_SHOWN) for b, _ in reader.replica_dead_counts()]


def _page_of(p: Params) -> int:
    return int(p.get("page", "0"))


def steps_pipeline(lib: Lib, p: Params) -> list[Step]:
    return [("FileSessionReads.counts()", lambda: lib.sessions.counts()),
            ("store.memory_counts()", lambda: lib.store.memory_counts()),
            ("StoreReader dead letters (thread)",
             lambda: anyio.to_thread.run_sync(_dead_letters, lib))]


def steps_users(lib: Lib, p: Params) -> list[Step]:
    return [("store.list_users()", lambda: lib.store.list_users(
                limit=PAGE, offset=_page_of(p) * PAGE)),
            ("store.count_users()", lambda: lib.store.count_users())]


def steps_sessions(lib: Lib, p: Params) -> list[Step]:
    return [("FileSessionReads.list_sessions()", lambda: lib.sessions.list_sessions(
                user_id=p["user"], limit=PAGE)),
            ("store.count_sessions()", lambda: lib.store.count_sessions(user_id=p["user"]))]


def steps_session(lib: Lib, p: Params) -> list[Step]:
    return [("FileSessionReads.get_session()", lambda: lib.sessions.get_session(p["id"])),
            ("FileSessionReads.chain()", lambda: lib.sessions.chain(p["id"])),
            ("FileSessionReads.conversation()", lambda: lib.sessions.conversation(p["id"]))]


def steps_search(lib: Lib, p: Params) -> list[Step]:
    user = p.get("user") or None
    # As the page picks: over everyone, words that are all frequent are shown newest first.
    newest = user is None and all_frequent(p["q"], lib.store.frequent_terms,
                                           stems=lib.store.word_index_stems)
    return [("FileSessionReads.search()", lambda: lib.sessions.search(
        p["q"], user_id=user, all_users=user is None, limit=PAGE,
        order="newest" if newest else "rank"))]


def steps_preview(lib: Lib, p: Params) -> list[Step]:
    return [("preview_prefetch()", lambda: preview_prefetch(
        lib.store, lib.settings, user_id=p["user"], session_id=p["session"], query=p["q"],
        frequent_terms=lib.store.frequent_terms))]


def steps_memory(lib: Lib, p: Params) -> list[Step]:
    return [("store.memory_users()", lambda: lib.store.memory_users(MEMORY_USERS)),
            ("store.memory_entries()", lambda: lib.store.memory_entries(p["user"], PAGE, 0))]


def steps_procedural(lib: Lib, p: Params) -> list[Step]:
    return [("ProceduralMemory.stats()", lambda: lib.procedural.stats(p["user"]))]


def steps_templates(lib: Lib, p: Params) -> list[Step]:
    return [("TemplateReads.list()", lambda: lib.templates.list()),
            ("TemplateReads.stats()", lambda: lib.templates.stats())]


@dataclass(frozen=True)
class View:
    label: str  # the page as a row names it
    path: str
    steps: Callable[[Lib, Params], list[Step]]
    params: list[Params]  # the first ``warm`` are the warm-up
    warm: int


class Draws:
    """Request parameters drawn from the data the build wrote."""

    def __init__(self, conn: sqlite3.Connection, corpus: Corpus,
                 plan: dict[str, tuple[int, str, str]], seed: int) -> None:
        self.conn = conn
        self.corpus = corpus
        self.rng = random.Random(seed)
        self.sessions: dict[int, list[str]] = {}
        for sid, (u, _, _) in plan.items():
            self.sessions.setdefault(u, []).append(sid)
        self.stop = set(STOPWORDS)

    def user(self) -> tuple[int, str]:
        u = self.rng.randrange(self.corpus.spec.users)
        return u, self.corpus.user_id(u)

    def session(self) -> tuple[int, str, str]:
        u, uid = self.user()
        return u, uid, self.rng.choice(self.sessions[u])

    def words(self) -> tuple[str, str]:
        """(user id, 1-3 words of one of their user or assistant messages, no stopword)."""
        while True:
            _, uid, sid = self.session()
            texts = [t for (t,) in self.conn.execute(
                "SELECT content FROM messages WHERE session_id = ? AND role IN "
                "('user', 'assistant') AND content != ''", (sid,))]
            if not texts:
                continue
            words = list(dict.fromkeys(
                w for w in self.rng.choice(texts).split() if w not in self.stop))
            k = self.rng.choices(*SEARCH_WORDS)[0]
            if len(words) >= k:
                return uid, " ".join(self.rng.sample(words, k))

    def common_words(self, band: tuple[float, float]) -> list[str]:
        total = self.conn.execute("SELECT count(*) FROM messages").fetchone()[0]
        lo, hi = (int(x * total) for x in band)
        return [t for (t,) in self.conn.execute(
            "SELECT term FROM messages_vocab WHERE col = 'content' AND doc BETWEEN ? AND ? "
            "ORDER BY doc DESC", (lo, hi))]


def views(draws: Draws, warm: int, timed: int, capped: int
          ) -> tuple[list[View], list[str]]:
    """Every view with its parameters; the slowest (a common word for all users: ~0.1 s a
    request alone, 2.4 s before e6ed9ea) gets ``capped`` timed requests after 4 warm-up."""
    d = draws
    pages = max(1, -(-d.corpus.spec.users // PAGE))
    common = d.common_words(bench_sessions.COMMON_BAND)

    def search_user() -> Params:
        uid, q = d.words()
        return {"q": q, "user": uid}

    def search_all() -> Params:
        return {"q": d.words()[1]}

    def preview() -> Params:
        u, uid, sid = d.session()
        return {"user": uid, "session": sid, "q": d.corpus.query(d.rng, u)}

    def many(f: Callable[[], Params]) -> list[Params]:
        return [f() for _ in range(warm + timed)]

    return [
        View("/ui (pipeline: counts, dead letters)", "/ui", steps_pipeline, many(dict), warm),
        View(f"/ui/users?page=P (P of {pages})", "/ui/users", steps_users,
             many(lambda: {"page": str(d.rng.randrange(pages))}), warm),
        View("/ui/sessions?user=U", "/ui/sessions", steps_sessions,
             many(lambda: {"user": d.user()[1]}), warm),
        View("/ui/session?id=S", "/ui/session", steps_session,
             many(lambda: {"id": d.session()[2]}), warm),
        View("/ui/search?q=1-3 words&user=U", "/ui/search", steps_search, many(search_user),
             warm),
        View("/ui/search?q=1-3 words (all users)", "/ui/search", steps_search,
             many(search_all), warm),
        View(f"/ui/search?q=a common word (all users; n={capped})", "/ui/search",
             steps_search, [{"q": d.rng.choice(common)} for _ in range(4 + capped)], 4),
        View("/ui/preview?user=U&session=S&q=recall query", "/ui/preview", steps_preview,
             many(preview), warm),
        View("/ui/memory?user=U", "/ui/memory", steps_memory,
             many(lambda: {"user": d.user()[1]}), warm),
        View("/ui/procedural?user=U", "/ui/procedural", steps_procedural,
             many(lambda: {"user": d.user()[1]}), warm),
        View("/ui/templates", "/ui/templates", steps_templates, many(dict), warm),
    ], common


def url_of(view: View, p: Params) -> str:
    return view.path + ("?" + urllib.parse.urlencode(p) if p else "")


# -- timing ------------------------------------------------------------------------------


def get_pages(host: str, port: int, paths: Sequence[str], clients: int
              ) -> tuple[list[int], list[int]]:
    """GET each path once, ``clients`` threads at a time, a new connection per request;
    (latency of each, body bytes of each). A status other than 200 stops the run."""
    lat, size = [0] * len(paths), [0] * len(paths)
    lock = threading.Lock()
    todo = iter(range(len(paths)))
    errors: list[str] = []

    def client() -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None or errors:
                return
            a = now_ns()
            conn = http.client.HTTPConnection(host, port, timeout=60)
            try:
                conn.request("GET", paths[i])
                resp = conn.getresponse()
                body = resp.read()
            finally:
                conn.close()
            lat[i] = now_ns() - a
            size[i] = len(body)
            if resp.status != 200:
                errors.append(f"GET {paths[i]}: {resp.status} {body[:300]!r}")

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(errors[0])
    return lat, size


async def call_reads(lib: Lib, view: View, params: Sequence[Params], clients: int
                     ) -> tuple[list[int], dict[str, list[int]]]:
    """Each request's reads awaited one after the other, ``clients`` requests at a time;
    (latency of each request, latency of each read by name)."""
    lat = [0] * len(params)
    by_step: dict[str, list[int]] = {}
    todo = iter(range(len(params)))

    async def client() -> None:
        for i in todo:  # shared by the clients: each request is taken once
            a = now_ns()
            for name, step in view.steps(lib, params[i]):
                s = now_ns()
                await step()
                by_step.setdefault(name, []).append(now_ns() - s)
            lat[i] = now_ns() - a

    await asyncio.gather(*(client() for _ in range(clients)))
    return lat, by_step


@dataclass
class Measured:
    page: list[int]
    base: list[int]
    sizes: list[int]
    alone_page: list[int]
    alone_steps: dict[str, list[int]]


def measure(view: View, host: str, port: int, portal: BlockingPortal, lib: Lib,
            alone: int) -> Measured:
    params, warm = view.params, view.warm
    urls = [url_of(view, p) for p in params]
    get_pages(host, port, urls[:warm], CLIENTS)
    portal.call(call_reads, lib, view, params[:warm], CLIENTS)
    page: list[int] = []
    base: list[int] = []
    sizes: list[int] = []
    timed = list(range(warm, len(params)))
    step = -(-len(timed) // CHUNKS)
    for c in range(0, len(timed), step):
        chunk = timed[c:c + step]
        b, _ = portal.call(call_reads, lib, view, [params[i] for i in chunk], CLIENTS)
        base += b
        p, s = get_pages(host, port, [urls[i] for i in chunk], CLIENTS)
        page += p
        sizes += s
    # One client alone, and each read alone: where the time goes.
    pick = timed[:min(alone, len(timed) // 4)]
    alone_page, _ = get_pages(host, port, [urls[i] for i in pick], 1)
    _, alone_steps = portal.call(call_reads, lib, view, [params[i] for i in pick], 1)
    return Measured(page, base, sizes, alone_page, alone_steps)


async def frequent_terms_scan(lib: Lib, n: int) -> list[int]:
    out = []
    for _ in range(n):
        a = now_ns()
        await lib.store.read_frequent_terms(lib.settings.frequent_term_rows,
                                            lib.settings.frequent_term_ratio)
        out.append(now_ns() - a)
    return out


# -- main --------------------------------------------------------------------------------


def main() -> list[Result]:
    args = parser(__doc__.splitlines()[0]).parse_args()
    quiet_logs()
    quick = args.quick
    messages = 100_000 if quick else 1_000_000
    n_timed = 60 if quick else 200
    n_warm = 20
    n_alone = 20 if quick else 40
    n_capped = 20 if quick else 40
    spec = spec_for(messages)
    corpus = Corpus(spec)
    path = db_path_for(messages, spec)
    label = bench_sessions.label_of(messages)
    plan = bench_sessions.session_plan(corpus, SESSIONS_PER_USER)
    print(f"bench_ui: {messages:,} messages over {spec.users:,} users, {len(plan):,} "
          f"sessions; {n_timed} requests per view from {CLIENTS} client threads after "
          f"{n_warm} warm-up ({machine()}; library {library_version()})")
    if not path.exists():
        t0 = time.perf_counter()
        asyncio.run(bench_sessions.build(path, messages, corpus, plan=plan,
                                         make_tool_turn=tool_turn,
                                         after=add_the_rest(corpus)))
        print(f"store build (one time, cached): {time.perf_counter() - t0:.0f} s")
    else:
        print(f"reusing {path.relative_to(DATA_DIR.parent.parent)} (built once; delete it to "
              "rebuild and time the build)")

    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    counts = {t: conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
              for t in ("messages", "sessions", "tool_calls", "memories", "templates")}
    chained = conn.execute(
        "SELECT count(*) FROM sessions WHERE parent_session_id IS NOT NULL").fetchone()[0]
    failed = conn.execute("SELECT count(*) FROM tool_calls WHERE ok = 0").fetchone()[0]
    print(f"{counts['messages']:,} messages, {counts['sessions']:,} sessions ({chained:,} "
          f"with a parent), {counts['tool_calls']:,} logged tool calls ({failed:,} failed), "
          f"{counts['memories']:,} key-value entries, {counts['templates']} templates; "
          f"{path.stat().st_size / 1e6:,.0f} MB")
    draws = Draws(conn, corpus, plan, seed=9_090)
    view_list, common = views(draws, n_warm, n_timed, n_capped)
    conn.close()
    print(f"common words (all-users search): {', '.join(common)}")

    settings = Settings(db_path=path)
    results: list[Result] = []
    rows = []
    alone_rows = []
    began = time.perf_counter()
    server = serve_inspector(settings, "127.0.0.1", 0, Access(None, loopback=True))
    try:
        with start_blocking_portal() as portal, \
                portal.wrap_async_context_manager(open_lib(settings)) as lib:
            host, port = server.host, server.port
            t0 = time.perf_counter()
            get_pages(host, port, ["/ui"], 1)
            print(f"serving at {server.url}/ui; first page {time.perf_counter() - t0:.2f} s")
            for view in view_list:
                t0 = time.perf_counter()
                m = measure(view, host, port, portal, lib, n_alone)
                s, b = summary(m.page), summary(m.base)
                r50, r99 = s["p50"] / b["p50"], s["p99"] / b["p99"]
                met = s["p99"] < GOAL_P99_NS
                names = " + ".join(name for name, _ in view.steps(lib, view.params[0]))
                rows.append([view.label, fmt_ns(s["p50"]), fmt_ns(s["p90"]), fmt_ns(s["p99"]),
                             fmt_ns(s["max"]), fmt_ns(b["p50"]), fmt_ns(b["p99"]),
                             f"{r50:.1f}x", f"{r99:.1f}x",
                             f"{sum(m.sizes) / len(m.sizes) / 1024:.0f} KiB",
                             "PASS" if met else "MISS"])
                alone = summary(m.alone_page)
                alone_rows.append([view.label, fmt_ns(alone["p50"]), fmt_ns(alone["p99"]),
                                   "; ".join(f"{k} {fmt_ns(summary(v)['p50'])} / "
                                             f"{fmt_ns(summary(v)['p99'])}"
                                             for k, v in m.alone_steps.items())])
                results.append(Result(
                    f"inspector page {view.label}, {label} messages, {CLIENTS} clients "
                    "(p50 / p99)",
                    f"{fmt_ns(s['p50'])} / {fmt_ns(s['p99'])}",
                    f"{names} {fmt_ns(b['p50'])} / {fmt_ns(b['p99'])}",
                    f"{r50:.2f}x / {r99:.2f}x",
                    f"p99 < {GOAL_P99_NS / 1e6:g} ms",
                    met,
                ))
                print(f"  {view.label}: page {fmt_ns(s['p50'])} / {fmt_ns(s['p99'])}, "
                      f"library {fmt_ns(b['p50'])} / {fmt_ns(b['p99'])} "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
            scans = portal.call(frequent_terms_scan, lib, 10)
    finally:
        server.close()
    took = time.perf_counter() - began

    print()
    print_table(["page", "p50", "p90", "p99", "max", "library p50", "library p99",
                 "x p50", "x p99", "body", "goal"], rows)
    print(f"\n({CLIENTS} clients at once; 'library' is the view's reads awaited in turn, "
          f"{CLIENTS} requests at once, no HTTP or rendering.) One client alone, and each "
          "read alone (p50 / p99):")
    print_table(["page", "alone p50", "alone p99", "its reads alone"], alone_rows)
    sc = summary(scans)
    print(f"\nthe inspector's background read of the frequent terms (store."
          f"read_frequent_terms, every frequent_terms_refresh_s; a preview would cost this "
          f"more if it read them itself): {fmt_ns(sc['p50'])} / {fmt_ns(sc['p99'])}")
    print(f"measuring took {took:.0f} s")
    results.append(Result(
        f"inspector's frequent-term read, in the background, not per preview, {label} "
        "messages (p50 / p99)",
        f"{fmt_ns(sc['p50'])} / {fmt_ns(sc['p99'])}", "—", "—", "—", None))
    report(results, args.json)
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
