"""The memory inspector's pages: a WSGI application under ``/ui``.

    request thread (the HTTP server's) ──► access check ──► portal.call(read) ──► the
    inspector's own event loop (read-only store) ──► Jinja2 template (autoescaped) ──► HTML

Every page is rendered on the server and works with JavaScript off; only the charts need
it, and their script is a file of this package (``static/``: uPlot, vendored, and
``charts.js``), never inline. Each answer carries a Content-Security-Policy that allows
scripts, styles and requests from this origin only. Stored text is hostile input: Jinja2
escapes every value, and nothing is marked safe.

The pipeline's own figures (health, queues, the charts) come from ``live``, a callable
that reads ``health()`` and ``stats()`` on the pipeline's loop as /healthz does; without
one (``hermes-memory ui`` on a file) the page says no pipeline runs in this process.
"""

from __future__ import annotations

import json
import mimetypes
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import jinja2
import structlog

from ..errors import InvalidTurnError, StoreError, describe
from ..fence import Fence
from ..stats import PipelineStats
from ..supervisor import Health
from .access import Access
from .reads import PAGE, InspectorReads
from .series import Series

if TYPE_CHECKING:
    from _typeshed.wsgi import StartResponse, WSGIEnvironment
    from anyio.from_thread import BlockingPortal

log = structlog.get_logger(__name__)

T = TypeVar("T")
PREFIX = "/ui"
READ_TIMEOUT_S = 10.0  # a page gives up on a read after this long
MAX_FORM_BYTES = 1 << 20
MAX_QUERY_CHARS = 1000
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
_SECURITY = [
    ("Content-Security-Policy", CSP),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
    ("X-Frame-Options", "DENY"),
]
_STATIC = {"uPlot.iife.min.js", "uPlot.min.css", "charts.js", "inspector.css"}
# (path, title) of the pages in the navigation bar, in order.
NAV = (("", "Pipeline"), ("/users", "Users"), ("/sessions", "Sessions"),
       ("/search", "Search"), ("/preview", "Prefetch preview"), ("/memory", "Key-value"),
       ("/procedural", "Tools"), ("/templates", "Templates"))

Live = Callable[[], tuple[Health, PipelineStats]]
# PostgreSQL's shared job queue: (kind, status, jobs, age of the oldest in seconds) rows.
JobsQueue = Callable[[], Sequence[tuple[str, str, int, float]]]


@dataclass(frozen=True)
class _Answer:
    status: str
    body: bytes
    content_type: str = "text/html; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


class _NotFoundError(Exception):
    pass


def _when(ts: float | None) -> str:
    if ts is None:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("hermes_async_memory.ui", "templates"),
        autoescape=True, undefined=jinja2.ChainableUndefined, trim_blocks=True,
        lstrip_blocks=True)
    env.filters["when"] = _when
    env.filters["thousands"] = lambda n: f"{n:,}"
    env.filters["json"] = lambda v: json.dumps(v, ensure_ascii=False, indent=1,
                                               sort_keys=True, default=str)
    env.globals.update(prefix=PREFIX, nav=NAV, page_size=PAGE)
    return env


class InspectorApp:
    """The WSGI application for ``/ui`` and below. ``reads`` lives on ``portal``'s loop."""

    def __init__(self, reads: InspectorReads, portal: BlockingPortal, access: Access, *,
                 live: Live | None = None, series: Series | None = None,
                 jobs_queue: JobsQueue | None = None) -> None:
        self._reads = reads
        self._jobs_queue = jobs_queue  # PostgreSQL's shared job queue, as the worker read it
        self._portal = portal
        self._access = access
        self._live = live
        self._series = series
        self._env = _environment()
        # How many fence tags a stored text holds: shown inert in every block (fence.py).
        self._env.filters["fenced"] = Fence(reads.settings.fence_tags).count

    def handles(self, path: str) -> bool:
        return path == PREFIX or path.startswith(PREFIX + "/")

    def __call__(self, environ: WSGIEnvironment, start_response: StartResponse
                 ) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        started = time.perf_counter()
        try:
            answer = self._answer(environ, path[len(PREFIX):] or "/")
        except _NotFoundError as exc:
            answer = self._error("404 Not Found", str(exc) or f"no such page: {path}")
        except (InvalidTurnError, ValueError) as exc:  # a bad filter or query: say which
            answer = self._error("400 Bad Request", describe(exc))
        except StoreError as exc:
            answer = self._error("503 Service Unavailable", f"the store cannot be read: {exc}")
        except TimeoutError:
            answer = self._error("503 Service Unavailable",
                                 f"the store did not answer within {READ_TIMEOUT_S:.0f} s")
        except Exception:  # the per-request boundary: log it, answer 500, keep serving
            log.exception("ui_request_failed", path=path)
            answer = self._error("500 Internal Server Error", "internal error (see the log)")
        headers = [("Content-Type", answer.content_type),
                   ("Content-Length", str(len(answer.body))), *_SECURITY, *answer.headers]
        if not any(k == "Cache-Control" for k, _ in answer.headers):
            headers.append(("Cache-Control", "no-store"))
        start_response(answer.status, headers)
        log.debug("ui_request", path=path, status=answer.status[:3],
                  duration_ms=round((time.perf_counter() - started) * 1000, 2))
        return [answer.body]

    # -- routing --------------------------------------------------------------------------

    def _answer(self, environ: WSGIEnvironment, path: str) -> _Answer:
        if path.startswith("/static/"):
            return self._static(path[len("/static/"):])
        if not self._access.may_read(environ.get("HTTP_AUTHORIZATION")):
            return _Answer("401 Unauthorized", b"the memory inspector needs its token\n",
                           "text/plain; charset=utf-8",
                           (("WWW-Authenticate", 'Basic realm="hermes-memory"'),))
        method = environ.get("REQUEST_METHOD", "GET")
        if path == "/dead-letters/replay":
            if method != "POST":
                return self._error("405 Method Not Allowed", "replay is a POST",
                                   (("Allow", "POST"),))
            return self._replay(environ)
        if method not in ("GET", "HEAD"):
            return self._error("405 Method Not Allowed", "the inspector only reads",
                               (("Allow", "GET"),))
        q = _query(environ)
        views: dict[str, Callable[[dict[str, str]], _Answer]] = {
            "/": self._pipeline, "/series.json": self._series_json, "/users": self._users,
            "/sessions": self._sessions, "/session": self._session, "/search": self._search,
            "/preview": self._preview, "/memory": self._memory,
            "/procedural": self._procedural, "/templates": self._templates,
        }
        view = views.get(path.rstrip("/") or "/")
        if view is None:
            raise _NotFoundError(f"no such page: {PREFIX}{path}")
        return view(q)

    def _read(self, fn: Callable[..., Awaitable[T]], *args: Any, **kwargs: Any) -> T:
        async def timed() -> T:
            with anyio.fail_after(READ_TIMEOUT_S):
                return await fn(*args, **kwargs)

        return self._portal.call(timed)

    def _page(self, template: str, **values: Any) -> _Answer:
        body = self._env.get_template(template).render(
            replay_enabled=self._access.replay_enabled, store_path=str(self._reads.path),
            **values)
        return _Answer("200 OK", body.encode())

    def _error(self, status: str, message: str,
               headers: tuple[tuple[str, str], ...] = ()) -> _Answer:
        body = self._env.get_template("error.html").render(
            status=status, message=message, replay_enabled=self._access.replay_enabled,
            store_path=str(self._reads.path))
        return _Answer(status, body.encode(), headers=headers)

    def _static(self, name: str) -> _Answer:
        if name not in _STATIC:
            raise _NotFoundError(f"no such file: {name}")
        data = resources.files("hermes_async_memory.ui").joinpath("static", name).read_bytes()
        kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
        if kind.startswith("text/") or kind.endswith("javascript"):
            kind += "; charset=utf-8"
        return _Answer("200 OK", data, kind, (("Cache-Control", "max-age=3600"),))

    # -- views ----------------------------------------------------------------------------

    def _pipeline(self, q: dict[str, str]) -> _Answer:
        health: Health | None = None
        stats: PipelineStats | None = None
        live_error = None
        if self._live is not None:
            try:
                health, stats = self._live()
            except Exception as exc:  # a stalled or closed loop: say so on the page
                live_error = describe(exc)
        counts = self._read(self._reads.counts)
        reindex = self._read(self._reads.reindex)
        dead = self._read(self._reads.dead_letters)
        jobs = None if self._jobs_queue is None else self._jobs_queue()
        return self._page("pipeline.html", title="Pipeline", live=self._live is not None,
                          health=health, stats=stats, live_error=live_error, counts=counts,
                          reindex=reindex, dead=dead, charts=self._series is not None,
                          notice=q.get("notice"), jobs_queue=jobs)

    def _series_json(self, q: dict[str, str]) -> _Answer:
        data = {} if self._series is None else self._series.as_json()
        return _Answer("200 OK", json.dumps(data).encode(), "application/json")

    def _users(self, q: dict[str, str]) -> _Answer:
        page = _page_number(q)
        total, users = self._read(self._reads.users, page)
        return self._page("users.html", title="Users", users=users, total=total, page=page)

    def _sessions(self, q: dict[str, str]) -> _Answer:
        page = _page_number(q)
        user, source = q.get("user") or None, q.get("source") or None
        total, sessions = self._read(self._reads.session_list, user_id=user, source=source,
                                     page=page)
        return self._page("sessions.html", title="Sessions", sessions=sessions, total=total,
                          page=page, user=user or "", source=source or "")

    def _session(self, q: dict[str, str]) -> _Answer:
        session_id = q.get("id", "")
        view = self._read(self._reads.session, session_id)
        if view is None:
            raise _NotFoundError(f"no session {session_id!r} is stored")
        return self._page("session.html", title=f"Session {session_id}", view=view)

    def _search(self, q: dict[str, str]) -> _Answer:
        text = q.get("q", "")[:MAX_QUERY_CHARS]
        form = {k: q.get(k, "") for k in ("q", "user", "session", "source", "exclude", "role",
                                          "syntax", "order")}
        form["q"] = text
        hits = None
        order = form["order"] or "rank"
        page = _page_number(q)
        if text.strip():
            order, hits = self._read(
                self._reads.search, text, user_id=form["user"] or None,
                session_id=form["session"] or None, sources=_list(form["source"]),
                exclude_sources=_list(form["exclude"]), roles=_list(form["role"]),
                syntax=form["syntax"] or "plain", order=order, page=page)
        return self._page("search.html", title="Search", form=form, hits=hits, page=page,
                          order=order)

    def _preview(self, q: dict[str, str]) -> _Answer:
        form = {k: q.get(k, "") for k in ("user", "session", "q")}
        form["q"] = form["q"][:MAX_QUERY_CHARS]
        preview = None
        if form["session"] or form["user"]:
            preview = self._read(self._reads.preview, user_id=form["user"] or None,
                                 session_id=form["session"], query=form["q"])
        return self._page("preview.html", title="Prefetch preview", form=form,
                          preview=preview)

    def _memory(self, q: dict[str, str]) -> _Answer:
        user = q.get("user", "")
        page = _page_number(q)
        users = self._read(self._reads.memory_users)
        entries = self._read(self._reads.memory, user, page) if user else None
        return self._page("memory.html", title="Key-value memory", users=users, user=user,
                          entries=entries, page=page)

    def _procedural(self, q: dict[str, str]) -> _Answer:
        user = q.get("user", "")
        tools = self._read(self._reads.tools, user or None)
        return self._page("procedural.html", title="Tools", user=user, tools=tools)

    def _templates(self, q: dict[str, str]) -> _Answer:
        templates, stats = self._read(self._reads.template_list)
        return self._page("templates.html", title="Templates", templates=templates,
                          stats=stats)

    # -- the one write --------------------------------------------------------------------

    def _replay(self, environ: WSGIEnvironment) -> _Answer:
        form = _form(environ)
        if not self._access.replay_enabled:
            return self._error("403 Forbidden", "replay is off: the server has no token "
                               "(set HERMES_MEMORY_UI_TOKEN and restart it)")
        token = (form.get("token") or [""])[0]
        if not self._access.matches(token):
            log.warning("ui_replay_refused", reason="wrong or missing token")
            return self._error("403 Forbidden", "replay refused: wrong or missing token")
        keys = [k for k in form.get("key", []) if k]
        if not keys:
            return self._error("400 Bad Request", "no dead letter was chosen")
        backend = (form.get("backend") or [""])[0] or None
        result = self._read(self._reads.replay, keys, backend)
        log.info("ui_replay", backend=backend, replayed=len(result.replayed),
                 failed=len(result.failed))
        notice = f"{len(result.replayed)} replayed, {len(result.failed)} failed"
        if result.failed:
            notice += ": " + "; ".join(f"{k} {e}" for k, e in list(result.failed.items())[:5])
        location = f"{PREFIX}?" + urllib.parse.urlencode({"notice": notice})
        return _Answer("303 See Other", b"", "text/plain; charset=utf-8",
                       (("Location", location),))


def _query(environ: WSGIEnvironment) -> dict[str, str]:
    parsed = urllib.parse.parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
    return {k: v[0] for k, v in parsed.items()}


def _form(environ: WSGIEnvironment) -> dict[str, list[str]]:
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    if length > MAX_FORM_BYTES:
        raise ValueError(f"the form is over {MAX_FORM_BYTES} bytes")
    body = environ["wsgi.input"].read(length) if length > 0 else b""
    return urllib.parse.parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)


def _page_number(q: dict[str, str]) -> int:
    text = q.get("page", "0") or "0"
    if not text.isdigit() or int(text) > 20_000:
        raise ValueError(f"page must be a number from 0 to 20000, got {text!r}")
    return int(text)


def _list(text: str) -> list[str] | None:
    items = [t.strip() for t in text.split(",") if t.strip()]
    return items or None
