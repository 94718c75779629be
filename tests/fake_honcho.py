"""A Honcho-compatible HTTP server for tests and benchmarks: the v3 routes HonchoBackend uses,
state in memory, and fault injection.

It is a real server on a real port (FastAPI, as the real Honcho, under uvicorn in a thread of
its own), so the client under test runs the real honcho-ai SDK over real HTTP. Requests are
validated the way the real server validates them (``src/schemas/api.py`` in plastic-labs/honcho:
ids match ``^[a-zA-Z0-9_-]+$``, at most 512 characters; 1..100 messages per batch; content at
most 25,000 characters; page size at most 100), so a client that breaks a rule gets the same
422 it would get in production. Responses follow the SDK's response models (``honcho.api_types``);
the tests check that by letting the SDK parse every route.

Like the real server, ``POST .../messages`` and ``PUT .../sessions/{id}`` (its metadata) get or
create the session (and the peers), ``DELETE .../sessions/{id}`` removes it with its messages
(404 for a session it does not have), and the metadata filter of ``POST .../messages/list``
supports ``{"metadata": {field: value}}`` (containment), ``{"metadata": {field: {"in": [...]}}}``
(compared as text), the other comparison operators, and ``AND`` / ``OR`` / ``NOT``.

Fault injection (all thread-safe, set from the test's thread):

- ``fail(route, times, status, retry_after=...)``: the next ``times`` calls to ``route`` get
  ``status`` (e.g. 500; or 429 with a ``Retry-After`` header) before reaching the handler.
- ``latency_s``: added to every call; ``route_delays[route]``: added to one route.
- ``hang_after_commit(times)``: the next add_messages calls store the messages, then hold the
  response until the client has long given up (``hang_s``, or ``release_hangs()``).
- ``fail_after_commit(times)``: store the messages, then answer 500.
- ``hold_writes(times)``: the next add_messages calls wait on the server before they store
  anything, as behind a locked messages table, whether or not their client is still there
  (the real server does not abort a request whose client disconnected); they commit when the
  test releases them (``Hold.release()``, or after ``hold_s``), or are dropped with nothing
  stored (``Hold.lose()``). The returned ``Hold`` tells the test, by thread-safe waits, when
  the requests reached the server and when they committed.
- Like the real server, the writes of one session (add_messages, update_session,
  delete_session) run one after the other, in the order they arrived: a request that comes
  while an earlier one of its session is held waits behind it, and then commits too.
- ``refuse_content(marker)``: a batch holding a message whose content contains ``marker`` is
  refused with a 422 and nothing of it is stored.
- ``down()`` / ``up()``: close the listening socket (connections are refused) and reopen it
  on the same port; the stored state survives.
- ``calls``: a Counter of HTTP requests per route name; ``requests``: (monotonic time, route,
  status) for each.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import math
import re
import secrets
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import uvicorn
from fastapi import Body, FastAPI, Query
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.routing import Match
from starlette.types import Message as AsgiMessage
from starlette.types import Receive, Scope, Send

RESOURCE_NAME_PATTERN = r"^[a-zA-Z0-9_-]+$"
MAX_MESSAGE_SIZE = 25_000
MAX_PAGE_SIZE = 100
COMPARISON_OPERATORS = {"gte", "lte", "gt", "lt", "ne", "in", "contains", "icontains"}
MESSAGE_FILTER_COLUMNS = {"workspace_id", "session_id", "peer_id", "token_count", "created_at",
                          "metadata"}
ReasoningLevel = Literal["minimal", "low", "medium", "high", "max"]

Name = Annotated[str, Field(min_length=1, max_length=512, pattern=RESOURCE_NAME_PATTERN)]


# -- request schemas (the server's, trimmed to what the fake reads) ------------------------


class WorkspaceCreate(BaseModel):
    id: Name
    metadata: dict[str, Any] = {}
    configuration: dict[str, Any] = {}


class PeerCreate(BaseModel):
    id: Name
    metadata: dict[str, Any] | None = None
    configuration: dict[str, Any] | None = None


class SessionPeerConfig(BaseModel):
    observe_others: bool | None = None
    observe_me: bool | None = None


class SessionCreate(BaseModel):
    id: Name
    metadata: dict[str, Any] | None = None
    peers: dict[str, SessionPeerConfig] | None = None
    configuration: dict[str, Any] | None = None
    scopes: list[str] | None = Field(default=None, max_length=100)


class SessionUpdate(BaseModel):
    metadata: dict[str, Any] | None = None
    configuration: dict[str, Any] | None = None


class MessageCreate(BaseModel):
    content: str = Field(min_length=0, max_length=MAX_MESSAGE_SIZE)
    peer_id: str
    metadata: dict[str, Any] | None = None
    configuration: dict[str, Any] | None = None
    created_at: dt.datetime | None = None


class MessageBatchCreate(BaseModel):
    messages: list[MessageCreate] = Field(..., min_length=1, max_length=100)


class FilterBody(BaseModel):
    filters: dict[str, Any] | None = None


class SearchBody(BaseModel):
    query: str
    filters: dict[str, Any] | None = None
    limit: int = Field(default=10, ge=1, le=100)


class RepresentationBody(BaseModel):
    session_id: str | None = None
    filters: dict[str, Any] | None = None
    scope: str | list[str] | None = None
    target: str | None = None
    search_query: str | None = None
    search_top_k: int | None = Field(None, ge=1, le=100)
    search_max_distance: float | None = Field(None, ge=0.0, le=1.0)
    include_most_frequent: bool | None = None
    max_conclusions: int | None = Field(default=25, ge=1, le=100)


class CardBody(BaseModel):
    peer_card: list[str]


class ChatBody(BaseModel):
    session_id: str | None = None
    target: str | None = None
    filters: dict[str, Any] | None = None
    scope: str | list[str] | None = None
    query: str = Field(min_length=1, max_length=10_000)
    stream: bool = False
    reasoning_level: ReasoningLevel = "low"
    response_format: dict[str, Any] | None = None
    include_evidence: bool = False


class FilterError(ValueError):
    """A filter the real server answers with 422."""


# -- fault injection -----------------------------------------------------------------------


@dataclass
class Fault:
    status: int
    retry_after: str | None = None
    detail: str = "injected fault"


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Hold:
    """add_messages requests the server holds before storing them (``FakeHoncho.hold_writes``).

    The server side waits in ``wait()``; the test's side decides (``release()``, ``lose()``)
    and waits, from any thread, for the requests to arrive or commit (``wait_received``,
    ``wait_committed``). Each count is of held requests only.
    """

    def __init__(self, times: int | None, hold_s: float, session: str | None = None) -> None:
        self._left = times  # requests still to take; None: all until decided
        self.hold_s = hold_s
        self.session = session  # only this session's requests (None: any)
        self._cond = threading.Condition()
        self._decided: bool | None = None  # True: commit, False: drop
        self._waiting: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self.received = 0
        self.committed = 0
        self.lost = 0
        self.arrivals: list[float] = []  # time.monotonic() at which each one arrived

    def take(self, session: str) -> bool:
        """Whether the request to ``session`` that just arrived is held (its arrival is
        counted)."""
        with self._cond:
            if self._decided is not None or self._left == 0:
                return False
            if self.session is not None and session != self.session:
                return False
            if self._left is not None:
                self._left -= 1
            self.received += 1
            self.arrivals.append(time.monotonic())
            self._cond.notify_all()
            return True

    def exhausted(self) -> bool:
        with self._cond:
            return self._decided is not None or self._left == 0

    async def wait(self) -> bool:
        """On the server: until the test decides (or ``hold_s`` passes, which commits);
        whether to commit."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._cond:
            if self._decided is None:
                self._waiting.append((loop, fut))
            else:
                fut.set_result(None)
        try:
            await asyncio.wait_for(fut, self.hold_s)
        except asyncio.TimeoutError:
            return True
        with self._cond:
            return self._decided is not False

    def done(self, committed: bool) -> None:
        """On the server: the held request stored its messages, or was dropped."""
        with self._cond:
            if committed:
                self.committed += 1
            else:
                self.lost += 1
            self._cond.notify_all()

    def release(self) -> None:
        """Every held request commits now, and the ones still to come pass through."""
        self._decide(True)

    def lose(self) -> None:
        """Every held request is dropped, nothing of it stored (the server failed it)."""
        self._decide(False)

    def _decide(self, commit: bool) -> None:
        with self._cond:
            if self._decided is None:
                self._decided = commit
            waiting, self._waiting = self._waiting, []
        for loop, fut in waiting:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:  # that server's loop is gone already
                pass

    def wait_received(self, n: int = 1, timeout_s: float = 30.0) -> None:
        """Until ``n`` held requests have reached the server (a thread's wait).

        Raises:
            TimeoutError: not within ``timeout_s``.
        """
        self._wait_for(lambda: self.received >= n, timeout_s, f"{n} held requests")

    def wait_committed(self, n: int = 1, timeout_s: float = 30.0) -> None:
        """Until ``n`` held requests have stored their messages (a thread's wait).

        Raises:
            TimeoutError: not within ``timeout_s``.
        """
        self._wait_for(lambda: self.committed >= n, timeout_s, f"{n} held commits")

    def _wait_for(self, check: Any, timeout_s: float, what: str) -> None:
        with self._cond:
            if not self._cond.wait_for(check, timeout_s):
                raise TimeoutError(f"not within {timeout_s} s: {what}")


def _now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat()


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def _validation_422(loc: list[Any], msg: str, value: Any) -> JSONResponse:
    """A 422 shaped as FastAPI's RequestValidationError (what the real server sends)."""
    return JSONResponse(status_code=422, content={"detail": [
        {"type": "value_error", "loc": loc, "msg": msg, "input": value}]})


class FakeHoncho:
    """An in-memory Honcho on 127.0.0.1. Use as a context manager, or start()/stop()."""

    def __init__(self, *, api_key: str | None = None, latency_s: float = 0.0,
                 hang_s: float = 30.0, hold_s: float = 30.0, port: int = 0) -> None:
        self.api_key = api_key
        self.hang_s = hang_s
        self.hold_s = hold_s
        self.port = port
        self._lock = threading.Lock()
        self._hangs: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._ended = threading.Condition()  # notified as each request ends
        self.in_flight = 0
        self.reset()
        self.latency_s = latency_s
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    # -- life cycle ------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def is_up(self) -> bool:
        return self._server is not None

    def __enter__(self) -> FakeHoncho:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Listen (on ``port``, or a free one the first time) and serve from a thread."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port))
        self.port = sock.getsockname()[1]
        started = threading.Event()
        self._session_locks: dict[tuple[str, str], asyncio.Lock] = {}  # for the new loop
        config = uvicorn.Config(self, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=1, backlog=1024)
        server = _Server(config, started)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                  name=f"fake-honcho-{self.port}", daemon=True)
        thread.start()
        if not started.wait(10):
            raise RuntimeError("the fake Honcho server did not start")
        self._server, self._thread = server, thread

    def stop(self) -> None:
        """Stop serving; the port refuses connections until ``start()``/``up()``."""
        self.release_hangs()
        self.release_holds()
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None and thread is not None:
            server.should_exit = True
            thread.join(10)

    def down(self) -> None:
        """Connections are refused from now on (the state is kept)."""
        self.stop()

    def up(self) -> None:
        """Serve again on the same port."""
        self.start()

    def reset(self) -> None:
        """Forget all state and faults (between tests)."""
        with self._lock:
            self.workspaces: dict[str, dict[str, Any]] = {}
            self.peers: dict[tuple[str, str], dict[str, Any]] = {}
            self.sessions: dict[tuple[str, str], dict[str, Any]] = {}
            self.messages: dict[tuple[str, str], list[dict[str, Any]]] = {}
            self.cards: dict[tuple[str, str, str], list[str]] = {}
            self.calls: Counter[str] = Counter()
            self.max_in_flight = 0
            self.requests: list[tuple[float, str, int]] = []
            self._faults: dict[str, deque[Fault]] = {}
            self._refused: set[str] = set()
            self._hang_next = 0
            self._fail_after_commit = 0
            holds, self._holds = getattr(self, "_holds", deque()), deque()
            self.route_delays: dict[str, float] = {}
            self.latency_s = 0.0
        self.release_hangs()
        for hold in holds:
            hold.release()

    # -- faults --------------------------------------------------------------------------

    def fail(self, route: str, times: int = 1, status: int = 500, *,
             retry_after: str | None = None, detail: str = "injected fault") -> None:
        """The next ``times`` calls to ``route`` ("*" for any) answer ``status``."""
        with self._lock:
            q = self._faults.setdefault(route, deque())
            q.extend(Fault(status, retry_after, detail) for _ in range(times))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def hang_after_commit(self, times: int = 1) -> None:
        with self._lock:
            self._hang_next += times

    def fail_after_commit(self, times: int = 1) -> None:
        with self._lock:
            self._fail_after_commit += times

    def hold_writes(self, times: int | None = 1, *, session: str | None = None,
                    hold_s: float | None = None) -> Hold:
        """The next ``times`` add_messages calls (None: all, until decided), to ``session``
        or to any, are held on the server before they store anything; see ``Hold``. Holds
        made one after the other take the requests in turn."""
        hold = Hold(times, self.hold_s if hold_s is None else hold_s, session)
        with self._lock:
            self._holds.append(hold)
        return hold

    def release_holds(self) -> None:
        """Every held request commits (a test that ended, or the server stopping)."""
        with self._lock:
            holds = list(self._holds)
        for hold in holds:
            hold.release()

    def refuse_content(self, marker: str) -> None:
        with self._lock:
            self._refused.add(marker)

    def hanging(self) -> int:
        """How many responses are held right now."""
        with self._lock:
            return len(self._hangs)

    def release_hangs(self) -> None:
        """Let every held response go (it reaches a client that has given up)."""
        with self._lock:
            hangs, self._hangs = self._hangs, []
        for loop, fut in hangs:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:  # that server's loop is gone already
                pass

    # -- inspection ----------------------------------------------------------------------

    def session_messages(self, session: str, workspace: str | None = None
                         ) -> list[dict[str, Any]]:
        """The stored messages of a session, in order (copies)."""
        with self._lock:
            if workspace is None:
                rows = [m for (_, s), ms in self.messages.items() if s == session for m in ms]
            else:
                rows = list(self.messages.get((workspace, session), []))
            return [dict(m) for m in rows]

    def session(self, session: str, workspace: str) -> dict[str, Any] | None:
        """The stored session (a copy, metadata and all), or None when there is none."""
        with self._lock:
            s = self.sessions.get((workspace, session))
            return None if s is None else json.loads(json.dumps(s))

    def all_messages(self) -> dict[str, list[dict[str, Any]]]:
        with self._lock:
            return {s: [dict(m) for m in ms] for (_, s), ms in self.messages.items()}

    def total_calls(self) -> int:
        with self._lock:
            return sum(self.calls.values())

    def route_sequence(self, *routes: str) -> list[str]:
        """The answered calls to any of ``routes``, in the order they ended."""
        with self._lock:
            return [r for _, r, _ in self.requests if r in routes]

    def route_statuses(self, route: str) -> list[int]:
        """The status of each answered call to ``route``, in the order they ended."""
        with self._lock:
            return [status for _, r, status in self.requests if r == route]

    def wait_until(self, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
        """Until ``check()`` holds, tried now and as each request ends (a thread's wait;
        ``check`` may use the inspection methods).

        Raises:
            TimeoutError: not within ``timeout_s``.
        """
        with self._ended:
            if not self._ended.wait_for(check, timeout_s):
                raise TimeoutError(f"not within {timeout_s} s")

    def route_times(self, route: str) -> list[float]:
        with self._lock:
            return [t for t, r, _ in self.requests if r == route]

    # -- ASGI: counting, latency, faults, auth, then the app -------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = self._route_name(scope)
        with self._lock:
            self.calls[route] += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            delay = self.latency_s + self.route_delays.get(route, 0.0)
            queue = self._faults.get(route) or self._faults.get("*")
            fault = queue.popleft() if queue else None
        if delay:
            await asyncio.sleep(delay)  # the server's own latency, not a test's wait
        status_box = [0]

        async def send_recording(message: AsgiMessage) -> None:
            if message["type"] == "http.response.start":
                status_box[0] = message["status"]
            await send(message)

        try:
            if fault is not None:
                headers = {"Retry-After": fault.retry_after} if fault.retry_after else None
                response: Response = JSONResponse({"detail": fault.detail},
                                                  status_code=fault.status, headers=headers)
                await response(scope, receive, send_recording)
                return
            if self.api_key is not None and not self._authorized(scope):
                response = JSONResponse({"detail": "Invalid or missing API key"},
                                        status_code=401)
                await response(scope, receive, send_recording)
                return
            await self.app(scope, receive, send_recording)
        finally:
            with self._lock:
                self.in_flight -= 1
                self.requests.append((time.monotonic(), route, status_box[0]))
            with self._ended:
                self._ended.notify_all()

    def _authorized(self, scope: Scope) -> bool:
        want = f"Bearer {self.api_key}".encode()
        return any(k == b"authorization" and secrets.compare_digest(v, want)
                   for k, v in scope.get("headers", []))

    def _route_name(self, scope: Scope) -> str:
        for r in self.app.router.routes:
            match, _ = r.matches(scope)
            if match == Match.FULL:
                return str(getattr(r, "name", "unknown"))
        return "unknown"

    async def _hang(self) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._hangs.append((loop, fut))
        try:
            await asyncio.wait_for(fut, self.hang_s)
        except asyncio.TimeoutError:
            pass

    def _writes_of(self, workspace: str, session: str) -> asyncio.Lock:
        """The lock that runs one session's writes one after the other (server loop only;
        asyncio's lock is fair, so they run in the order they arrived)."""
        return self._session_locks.setdefault((workspace, session), asyncio.Lock())

    def _take_hold(self, session: str) -> Hold | None:
        with self._lock:
            for hold in [h for h in self._holds if h.exhausted()]:
                self._holds.remove(hold)  # taken its share, or decided
            return next((h for h in self._holds if h.take(session)), None)

    # -- the state (call with the lock held) ---------------------------------------------

    def _workspace(self, name: str, metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
        ws = self.workspaces.get(name)
        if ws is None:
            ws = {"id": name, "uid": secrets.token_hex(8), "metadata": dict(metadata or {}),
                  "configuration": {}, "created_at": _now_iso()}
            self.workspaces[name] = ws
        return ws

    def _peer(self, workspace: str, name: str, *, metadata: Mapping[str, Any] | None = None,
              configuration: Mapping[str, Any] | None = None) -> dict[str, Any]:
        self._workspace(workspace)
        peer = self.peers.get((workspace, name))
        if peer is None:
            if not re.fullmatch(RESOURCE_NAME_PATTERN, name) or len(name) > 512:
                raise FilterError(f"Peer name {name!r} must match {RESOURCE_NAME_PATTERN}")
            peer = {"id": name, "uid": secrets.token_hex(8), "workspace_id": workspace,
                    "created_at": _now_iso(), "metadata": {}, "configuration": {}}
            self.peers[(workspace, name)] = peer
        if metadata is not None:
            peer["metadata"] = dict(metadata)
        if configuration is not None:
            peer["configuration"] = {**peer["configuration"], **configuration}
        return peer

    def _session(self, workspace: str, name: str,
                 peers: Mapping[str, SessionPeerConfig] | None = None,
                 metadata: Mapping[str, Any] | None = None) -> dict[str, Any]:
        if not re.fullmatch(RESOURCE_NAME_PATTERN, name) or len(name) > 512:
            raise FilterError(f"Session name {name!r} must match {RESOURCE_NAME_PATTERN}")
        self._workspace(workspace)
        session = self.sessions.get((workspace, name))
        if session is None:
            session = {"id": name, "uid": secrets.token_hex(8), "is_active": True,
                       "workspace_id": workspace, "metadata": dict(metadata or {}),
                       "configuration": {}, "created_at": _now_iso(), "peers": {}}
            self.sessions[(workspace, name)] = session
            self.messages[(workspace, name)] = []
        elif metadata is not None:
            session["metadata"] = dict(metadata)
        for peer_name, cfg in (peers or {}).items():
            self._peer(workspace, peer_name)
            session["peers"][peer_name] = cfg.model_dump(exclude_none=True)
        return session

    @staticmethod
    def _session_out(s: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in s.items() if k != "peers"}

    # -- the app -------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="fake honcho")
        ws_prefix = "/v3/workspaces/{workspace_id}"
        fake = self

        def not_found(what: str) -> JSONResponse:
            return JSONResponse({"detail": f"{what} not found"}, status_code=404)

        def unprocessable(exc: Exception) -> JSONResponse:
            return JSONResponse({"detail": str(exc)}, status_code=422)

        @app.post("/v3/workspaces", name="workspace")
        async def workspace(body: WorkspaceCreate) -> dict[str, Any]:
            with fake._lock:
                return dict(fake._workspace(body.id, body.metadata))

        @app.post(ws_prefix + "/peers", name="peer")
        async def peer(workspace_id: str, body: PeerCreate) -> Any:
            with fake._lock:
                try:
                    return dict(fake._peer(workspace_id, body.id, metadata=body.metadata,
                                           configuration=body.configuration))
                except FilterError as exc:
                    return unprocessable(exc)

        @app.post(ws_prefix + "/sessions", name="session")
        async def session(workspace_id: str, body: SessionCreate) -> Any:
            with fake._lock:
                try:
                    s = fake._session(workspace_id, body.id, body.peers, body.metadata)
                except FilterError as exc:
                    return unprocessable(exc)
                return fake._session_out(s)

        @app.put(ws_prefix + "/sessions/{session_id}", name="update_session")
        async def update_session(workspace_id: str, session_id: str,
                                 body: SessionUpdate) -> Any:
            # As the real server (crud.update_session): get-or-create the session, then
            # replace its metadata and merge its configuration, when given.
            async with fake._writes_of(workspace_id, session_id):
                with fake._lock:
                    try:
                        s = fake._session(workspace_id, session_id, metadata=body.metadata)
                    except FilterError as exc:
                        return unprocessable(exc)
                    if body.configuration is not None:
                        s["configuration"] = {**s["configuration"], **body.configuration}
                    return fake._session_out(s)

        @app.delete(ws_prefix + "/sessions/{session_id}", name="delete_session")
        async def delete_session(workspace_id: str, session_id: str) -> Any:
            # As the real server (crud.delete_session): a hard delete of the session with its
            # messages and its peers' membership; 404 for a session it does not have.
            async with fake._writes_of(workspace_id, session_id):
                with fake._lock:
                    if fake.sessions.pop((workspace_id, session_id), None) is None:
                        return not_found("Session")
                    fake.messages.pop((workspace_id, session_id), None)
            return {"message": "Session deleted successfully"}

        @app.post(ws_prefix + "/sessions/{session_id}/peers", name="add_peers")
        async def add_peers(workspace_id: str, session_id: str,
                      peers: dict[str, SessionPeerConfig] = Body(...)) -> Any:  # noqa: B008
            with fake._lock:
                try:
                    s = fake._session(workspace_id, session_id, peers)
                except FilterError as exc:
                    return unprocessable(exc)
                return fake._session_out(s)

        @app.get(ws_prefix + "/sessions/{session_id}/peers", name="session_peers")
        async def session_peers(workspace_id: str, session_id: str) -> Any:
            with fake._lock:
                s = fake.sessions.get((workspace_id, session_id))
                if s is None:
                    return not_found("Session")
                items = [dict(fake.peers[(workspace_id, p)]) for p in s["peers"]]
                return {"items": items, "total": len(items), "page": 1, "size": 50,
                        "pages": 1 if items else 0}

        @app.get(ws_prefix + "/sessions/{session_id}/peers/{peer_id}/config",
                 name="peer_config")
        async def peer_config(workspace_id: str, session_id: str, peer_id: str) -> Any:
            with fake._lock:
                s = fake.sessions.get((workspace_id, session_id))
                if s is None or peer_id not in s["peers"]:
                    return not_found("Session peer")
                cfg = s["peers"][peer_id]
                return {"observe_others": cfg.get("observe_others", False),
                        "observe_me": cfg.get("observe_me", True)}

        @app.put(ws_prefix + "/sessions/{session_id}/peers/{peer_id}/config",
                 name="set_peer_config")
        async def set_peer_config(workspace_id: str, session_id: str, peer_id: str,
                            body: SessionPeerConfig) -> Response:
            with fake._lock:
                s = fake.sessions.get((workspace_id, session_id))
                if s is None or peer_id not in s["peers"]:
                    return not_found("Session peer")
                s["peers"][peer_id].update(body.model_dump(exclude_none=True))
            return Response(status_code=200)

        @app.post(ws_prefix + "/sessions/{session_id}/messages", name="add_messages",
                  status_code=201)
        async def add_messages(workspace_id: str, session_id: str,
                               body: MessageBatchCreate) -> Any:
            with fake._lock:
                for i, m in enumerate(body.messages):
                    if any(marker in m.content for marker in fake._refused):
                        return _validation_422(["body", "messages", i, "content"],
                                               "Value error, content refused by the server",
                                               m.content[:80])
            hold = fake._take_hold(session_id)
            async with fake._writes_of(workspace_id, session_id):
                if hold is not None and not await hold.wait():
                    hold.done(committed=False)
                    return JSONResponse({"detail": "held request dropped"}, status_code=500)
                with fake._lock:
                    peers = {m.peer_id: SessionPeerConfig() for m in body.messages}
                    try:
                        existing = fake.sessions.get((workspace_id, session_id))
                        known = set(existing["peers"]) if existing else set()
                        fake._session(workspace_id, session_id,
                                      {p: c for p, c in peers.items() if p not in known})
                    except FilterError as exc:
                        return unprocessable(exc)
                    stored = fake.messages[(workspace_id, session_id)]
                    out = []
                    for m in body.messages:
                        created = (m.created_at or dt.datetime.now(dt.timezone.utc)).isoformat()
                        row = {"id": secrets.token_urlsafe(15)[:21], "content": m.content,
                               "peer_id": m.peer_id, "session_id": session_id,
                               "metadata": dict(m.metadata or {}), "created_at": created,
                               "workspace_id": workspace_id,
                               "token_count": max(1, len(m.content.split()))}
                        stored.append(row)
                        out.append(dict(row))
                    hang = fake._hang_next > 0
                    fake._hang_next -= hang
                    fail_after = not hang and fake._fail_after_commit > 0
                    fake._fail_after_commit -= fail_after
                if hold is not None:
                    hold.done(committed=True)
            # Committed: the session's next write may run while this answer is held or fails.
            if hang:
                await fake._hang()
            if fail_after:
                return JSONResponse({"detail": "failed after commit"}, status_code=500)
            return out

        @app.post(ws_prefix + "/sessions/{session_id}/messages/list", name="list_messages")
        async def list_messages(workspace_id: str, session_id: str,
                          body: FilterBody | None = None,
                          page: int = Query(1, ge=1),
                          size: int = Query(50, ge=1, le=MAX_PAGE_SIZE),
                          reverse: bool = False) -> Any:
            filters = body.filters if body is not None else None
            with fake._lock:
                rows = list(fake.messages.get((workspace_id, session_id), []))
            try:
                rows = [m for m in rows if _matches(m, filters)]
            except FilterError as exc:
                return unprocessable(exc)
            if reverse:
                rows.reverse()
            return _page(rows, page, size)

        @app.get(ws_prefix + "/sessions/{session_id}/context", name="context")
        async def context(workspace_id: str, session_id: str, tokens: int | None = None,
                    summary: bool = False, peer_target: str | None = None,
                    peer_perspective: str | None = None, search_query: str | None = None,
                    limit_to_session: bool = False, search_top_k: int | None = None,
                    search_max_distance: float | None = None,
                    include_most_frequent: bool | None = None,
                    max_conclusions: int | None = None) -> Any:
            with fake._lock:
                if (workspace_id, session_id) not in fake.sessions:
                    return not_found("Session")
                rows = list(fake.messages[(workspace_id, session_id)])
                card = (fake.cards.get((workspace_id, peer_perspective or peer_target,
                                        peer_target)) if peer_target else None)
                everything = [m for ms in fake.messages.values() for m in ms]
            picked: list[dict[str, Any]] = []
            budget = tokens if tokens is not None else 100_000
            for m in reversed(rows):
                if m["token_count"] > budget:
                    break
                budget -= m["token_count"]
                picked.append(m)
            picked.reverse()
            older = rows[: len(rows) - len(picked)]
            summ = None
            if summary and older:
                text = " / ".join(m["content"][:60] for m in older[-5:])
                summ = {"content": f"Earlier: {text}", "message_id": older[-1]["id"],
                        "summary_type": "short", "created_at": _now_iso(),
                        "token_count": len(text.split())}
            rep = None
            if peer_target:
                rep = _representation(everything, peer_target, search_query,
                                      session_id if limit_to_session else None) or None
            return {"id": session_id, "messages": picked, "summary": summ,
                    "peer_representation": rep, "peer_card": card}

        @app.post(ws_prefix + "/sessions/{session_id}/search", name="session_search")
        async def session_search(workspace_id: str, session_id: str, body: SearchBody) -> Any:
            with fake._lock:
                rows = list(fake.messages.get((workspace_id, session_id), []))
            return _search_rows(rows, body)

        @app.post(ws_prefix + "/search", name="workspace_search")
        async def workspace_search(workspace_id: str, body: SearchBody) -> Any:
            with fake._lock:
                rows = [m for (w, _), ms in fake.messages.items() if w == workspace_id
                        for m in ms]
            return _search_rows(rows, body)

        @app.post(ws_prefix + "/peers/{peer_id}/search", name="peer_search")
        async def peer_search(workspace_id: str, peer_id: str, body: SearchBody) -> Any:
            with fake._lock:
                rows = [m for (w, _), ms in fake.messages.items() if w == workspace_id
                        for m in ms if m["peer_id"] == peer_id]
            return _search_rows(rows, body)

        @app.post(ws_prefix + "/peers/{peer_id}/representation", name="representation")
        async def representation(workspace_id: str, peer_id: str, body: RepresentationBody) -> Any:
            with fake._lock:
                if (workspace_id, peer_id) not in fake.peers:
                    return not_found("Peer")
                rows = [m for (w, _), ms in fake.messages.items() if w == workspace_id
                        for m in ms]
            text = _representation(rows, body.target or peer_id, body.search_query,
                                   body.session_id)
            return {"representation": text}

        @app.get(ws_prefix + "/peers/{peer_id}/card", name="card")
        async def get_card(workspace_id: str, peer_id: str, target: str | None = None) -> Any:
            with fake._lock:
                if (workspace_id, peer_id) not in fake.peers:
                    return not_found("Peer")
                return {"peer_card": fake.cards.get((workspace_id, peer_id, target or peer_id))}

        @app.put(ws_prefix + "/peers/{peer_id}/card", name="set_card")
        async def set_card(workspace_id: str, peer_id: str, body: CardBody,
                     target: str | None = None) -> Any:
            with fake._lock:
                fake._peer(workspace_id, peer_id)
                fake.cards[(workspace_id, peer_id, target or peer_id)] = list(body.peer_card)
                return {"peer_card": list(body.peer_card)}

        @app.post(ws_prefix + "/peers/{peer_id}/chat", name="peer_chat")
        async def chat(workspace_id: str, peer_id: str, body: ChatBody) -> Any:
            with fake._lock:
                if (workspace_id, peer_id) not in fake.peers:
                    return not_found("Peer")
                rows = [m for (w, s), ms in fake.messages.items() if w == workspace_id
                        for m in ms if body.session_id in (None, s)]
            target = body.target or peer_id
            hits = _search_rows([m for m in rows if m["peer_id"] == target],
                                SearchBody(query=body.query, limit=3))
            if not hits:
                return {"content": None}
            said = "; ".join(h["content"][:120] for h in hits)
            return {"content": f"({body.reasoning_level}) {target} has said: {said}"}

        return app


class _Server(uvicorn.Server):
    """uvicorn, telling the starting thread when it listens."""

    def __init__(self, config: uvicorn.Config, started: threading.Event) -> None:
        super().__init__(config)
        self._started_event = started

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self._started_event.set()


# -- queries ----------------------------------------------------------------------------


def _page(rows: list[dict[str, Any]], page: int, size: int) -> dict[str, Any]:
    total = len(rows)
    start = (page - 1) * size
    return {"items": rows[start:start + size], "total": total, "page": page, "size": size,
            "pages": math.ceil(total / size) if total else 0}


def _search_rows(rows: list[dict[str, Any]], body: SearchBody) -> list[dict[str, Any]]:
    terms = _words(body.query)
    if not terms:
        return []
    scored = []
    for seq, m in enumerate(rows):
        if not _matches(m, body.filters):
            continue
        score = len(terms & _words(m["content"]))
        if score:
            scored.append((-score, seq, m))
    scored.sort(key=lambda x: (x[0], x[1]))
    return [dict(m) for _, _, m in scored[: body.limit]]


def _representation(rows: list[dict[str, Any]], target: str, search_query: str | None,
                    session_id: str | None) -> str:
    own = [m for m in rows if m["peer_id"] == target
           and (session_id is None or m["session_id"] == session_id)]
    if search_query:
        own = _search_rows(own, SearchBody(query=search_query, limit=5)) or own[-5:]
    else:
        own = own[-5:]
    return "\n".join(f"{target} said: {m['content'][:120]}" for m in own)


def _matches(row: Mapping[str, Any], filters: Mapping[str, Any] | None) -> bool:
    """The real server's filter language on messages (src/utils/filter.py), as far as the
    backend uses it; an unknown column or operator is a FilterError (422)."""
    if not filters:
        return True
    for key, value in filters.items():
        if key == "AND":
            if not all(_matches(row, f) for f in _list(value, key)):
                return False
        elif key == "OR":
            subs = _list(value, key)
            if subs and not any(_matches(row, f) for f in subs):
                return False
        elif key == "NOT":
            if any(_matches(row, f) for f in _list(value, key)):
                return False
        elif key not in MESSAGE_FILTER_COLUMNS:
            raise FilterError(f"Column '{key}' is not allowed to be filtered on or does not "
                              f"exist on Message")
        elif key == "metadata":
            if not isinstance(value, Mapping):
                raise FilterError("Invalid filter for column 'metadata': a JSONB column takes "
                                  "an object")
            if not _metadata_matches(row.get("metadata") or {}, value):
                return False
        elif not _column_matches(row.get(key), value):
            return False
    return True


def _list(value: Any, op: str) -> list[Mapping[str, Any]]:
    if not isinstance(value, list):
        raise FilterError(f"{op} operator must contain a list, got {type(value).__name__}")
    return value


def _metadata_matches(md: Mapping[str, Any], conditions: Mapping[str, Any]) -> bool:
    for field_name, cond in conditions.items():
        if cond == "*":
            continue
        if isinstance(cond, Mapping) and any(op in COMPARISON_OPERATORS for op in cond):
            present = field_name in md and md[field_name] is not None
            # ->> gives text: a JSON string as itself, anything else as its JSON text
            text = (md[field_name] if isinstance(md.get(field_name), str)
                    else json.dumps(md.get(field_name)))
            for op, operand in cond.items():
                if op not in COMPARISON_OPERATORS:
                    raise FilterError(f"Unsupported comparison operator: {op}")
                if op == "in":
                    if not isinstance(operand, (list, tuple)):
                        raise FilterError(f"Invalid value for 'in' operator: {operand}")
                    if "*" in operand:
                        continue
                    if not present or text not in [str(v) for v in operand]:
                        return False
                elif op in ("contains", "icontains"):
                    if not present or str(operand).lower() not in text.lower():
                        return False
                elif op == "ne":
                    if present and text == str(operand):
                        return False
                else:
                    if not present:
                        return False
                    try:
                        a, b = float(text), float(operand)
                    except (TypeError, ValueError):
                        a, b = text, str(operand)  # type: ignore[assignment]
                    if not {"gt": a > b, "gte": a >= b, "lt": a < b, "lte": a <= b}[op]:
                        return False
        elif not _contains(md.get(field_name), cond):
            return False
    return True


def _contains(have: Any, want: Any) -> bool:
    """JSONB containment (@>)."""
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(
            k in have and _contains(have[k], v) for k, v in want.items())
    if isinstance(want, list):
        return isinstance(have, list) and all(any(_contains(h, w) for h in have) for w in want)
    return bool(have == want and type(have) is type(want))


def _column_matches(have: Any, want: Any) -> bool:
    if want == "*":
        return True
    if isinstance(want, list):
        want = {"in": want}
    if isinstance(want, Mapping):
        for op, operand in want.items():
            if op not in COMPARISON_OPERATORS:
                raise FilterError(f"Unsupported comparison operator: {op}")
            if op == "in" and have not in operand:
                return False
            if op == "ne" and have == operand:
                return False
            if op in ("contains", "icontains") and str(operand).lower() not in str(have).lower():
                return False
            if op in ("gt", "gte", "lt", "lte"):
                cmp = {"gt": have > operand, "gte": have >= operand, "lt": have < operand,
                       "lte": have <= operand}
                if not cmp[op]:
                    return False
        return True
    return bool(have == want)


@contextmanager
def running(**kwargs: Any) -> Iterator[FakeHoncho]:
    """A started fake, stopped on exit."""
    fake = FakeHoncho(**kwargs)
    fake.start()
    try:
        yield fake
    finally:
        fake.stop()
