"""A replica backend on Honcho (plastic-labs), through honcho-ai's async SDK (``honcho.aio``).

The local SQLite store stays the system of record; this backend copies committed turns
into Honcho and may answer recalls from it.

Mapping. One Honcho workspace; one peer for the assistant and one per user (a turn without a
user gets a peer of its own session, so strangers are never merged); one Honcho session per
``session_id``. Every id is made to fit the server's ``^[a-zA-Z0-9_-]+$`` (at most 512
characters): an id that fits is kept as is, one that does not is rewritten and gets a hash of
the original appended, so two different ids never meet.

Writing. ``write(turns)`` groups the turns by session and keeps their order. A session's turns
go out in ``add_messages`` calls of at most 100 messages (the server's limit; it answers 422
above it). Sessions run in parallel under a capacity limit. Calls to one session never overlap,
also across concurrent ``write`` calls, which run in the order they were made.

Exactly once. The SDK's own retries are off (``max_retries=0``): a blind retry of a
``POST .../messages`` whose response was lost stores the messages twice. Each message carries
its turn's idempotency key and its index within the turn in ``metadata``. Before a batch whose
outcome is unknown (a timeout, a connection dropped after sending, a 5xx) is sent again, the
session's messages are listed with a metadata filter on those keys and only the missing ones
are sent. (The server has no idempotency keys of its own, so a request still running on the
server when the check runs can still land twice; the backoff before the check makes that
window small, not empty.)

Failures. Retries use exponential backoff with jitter and honour ``Retry-After`` on a 429. A
circuit breaker opens after ``breaker_failures`` consecutive failed calls; while it is open,
``write`` fails at once with ``CircuitOpenError``; after ``breaker_cooldown_s`` one call probes
and the others wait for its answer. A batch the server refuses (422, 400, 413) is split in
halves until the refused turn is alone; the other turns are written, in order, and the turn
fails with the server's reason. When a batch cannot be written after ``max_attempts``, it and
the rest of its session's turns in that call fail (so nothing is written out of order). Either
way ``write`` raises ``HonchoWriteError`` naming each failed turn, why, and whether retrying the
same turn can help.

Recall. ``recall_mode`` picks one source: the session context (``tokens=``), the user peer's
representation or card, a message search over the user's messages, or the dialectic
``peer.chat`` at a reasoning level. Each runs under ``recall_deadline_s``; on an error, a timeout
or an empty answer the backend returns None and the local store answers.
``last_recall_source`` (and ``recall_with_source``) says which source answered.

The SDK (and pydantic, httpx) are imported when the backend starts, not when this module is
imported: the pipeline imports the backends package, and most deployments never use Honcho.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import hashlib
import importlib
import ipaddress
import json
import os
import random
import re
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypeVar
from urllib.parse import urlsplit

import anyio
import structlog

from ..errors import BackendError, ConfigurationError
from ..extras import require
from ..turns import Turn
from .base import (
    Backend,
    BackendUnavailableError,
    BackendWriteError,
    RecallRequest,
    TurnFailure,
)

log = structlog.get_logger(__name__)

T = TypeVar("T")

# The server's rules (honcho src/schemas/api.py): RESOURCE_NAME_PATTERN for workspace, peer
# and session ids, max_length=512; MessageBatchCreate takes 1..100 messages; MessageCreate's
# content is at most settings.MAX_MESSAGE_SIZE (25,000) characters; fastapi-pagination pages
# hold at most 100 items.
ID_PATTERN = re.compile(r"[A-Za-z0-9_-]+")
_REWRITTEN = re.compile(r".*-h[0-9a-f]{16}")  # what honcho_id appends to an id it rewrote
MAX_ID_CHARS = 512
MAX_MESSAGES_PER_CALL = 100
MAX_MESSAGE_CHARS = 25_000
LIST_PAGE_SIZE = 100
_ID_HASH_CHARS = 16  # 64 bits of blake2b: what keeps rewritten ids apart
_KEYS_PER_LISTING = 50  # turn keys per metadata filter when checking what the server holds

# Message metadata fields this backend writes.
KEY_FIELD = "turn_key"  # the turn's idempotency key
INDEX_FIELD = "turn_msg"  # the message's index within its turn (0, 1, ...)
USER_FIELD = "user_peer"  # the user peer of the turn: what a "search" recall filters on

RecallMode = Literal["context", "representation", "card", "search", "chat", "off"]
RECALL_MODES: tuple[RecallMode, ...] = (
    "context", "representation", "card", "search", "chat", "off",
)
ReasoningLevel = Literal["minimal", "low", "medium", "high", "max"]
REASONING_LEVELS: tuple[ReasoningLevel, ...] = ("minimal", "low", "medium", "high", "max")
ENV_PREFIX = "HONCHO_"
PRODUCTION_URL = "https://api.honcho.dev"
_LOOPBACK_NAMES = ("localhost", "localhost.localdomain")
_RECALL_TEXT_CHARS = 400  # characters kept per message in a recall block
_COUNTERS = ("turns_written", "turns_failed", "retries", "dedupe_checks", "resend_skipped",
             "bisections")
# recall_with_source's sources that mean Honcho did not answer (recall() raises for them).
_RECALL_FAILED = frozenset({"local:circuit_open", "local:timeout", "local:error"})
_MAX_REASON_CHARS = 500


# -- configuration -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HonchoConfig:
    """Where the Honcho replica is and how to talk to it. Build it once and pass it in."""

    base_url: str = PRODUCTION_URL
    # Not needed for a server on this machine (a loopback base URL); required otherwise.
    api_key: str | None = field(default=None, repr=False)
    workspace_id: str = "hermes"
    assistant_peer: str = "hermes"
    user_peer_prefix: str = "user-"
    # Session-level observation (SessionPeerConfig), set once when a session is first seen.
    # The default: Honcho reasons about the user, the assistant keeps a theory of mind of the
    # user, and nobody models the assistant. configure_sessions=False skips that call (one
    # fewer per new session); the server then creates the session with its own defaults when
    # the first messages arrive.
    configure_sessions: bool = True
    user_observe_me: bool = True
    user_observe_others: bool = False
    assistant_observe_me: bool = False
    assistant_observe_others: bool = True
    # Writing.
    write_concurrency: int = 16  # sessions written at once (and HTTP connections kept)
    request_timeout_s: float = 10.0
    max_attempts: int = 5  # per call, before its turns fail
    backoff_base_s: float = 0.25
    backoff_max_s: float = 8.0
    retry_after_max_s: float = 60.0  # a longer Retry-After fails the batch instead of waiting
    breaker_failures: int = 5  # consecutive failed calls that open the circuit
    breaker_cooldown_s: float = 30.0
    max_message_chars: int = MAX_MESSAGE_CHARS  # longer contents are split across messages
    known_sessions: int = 100_000  # sessions remembered as configured (LRU)
    # Recall.
    recall_mode: RecallMode = "context"
    recall_deadline_s: float = 2.0
    context_tokens: int = 2_000
    reasoning_level: ReasoningLevel = "low"

    def __post_init__(self) -> None:
        positive_ints = ("write_concurrency", "max_attempts", "breaker_failures",
                         "max_message_chars", "known_sessions", "context_tokens")
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigurationError(f"{name} must be a positive integer, got {value!r}")
        positive = ("request_timeout_s", "recall_deadline_s")
        non_negative = ("backoff_base_s", "backoff_max_s", "retry_after_max_s",
                        "breaker_cooldown_s")
        for name in positive + non_negative:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (
                    value == 0 and name in positive):
                raise ConfigurationError(f"{name} must be a positive number, got {value!r}")
        if self.max_message_chars > MAX_MESSAGE_CHARS:
            raise ConfigurationError(
                f"max_message_chars must be at most {MAX_MESSAGE_CHARS} (the server's limit)")
        if self.recall_mode not in RECALL_MODES:
            raise ConfigurationError(
                f"recall_mode must be one of {', '.join(RECALL_MODES)}, got {self.recall_mode!r}")
        if self.reasoning_level not in REASONING_LEVELS:
            raise ConfigurationError(
                f"reasoning_level must be one of {', '.join(REASONING_LEVELS)}, "
                f"got {self.reasoning_level!r}")
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigurationError(f"base_url must be an http(s) URL, got {self.base_url!r}")
        if not self.api_key and not is_loopback_url(self.base_url):
            raise ConfigurationError(
                "api_key is required for a Honcho server that is not on this machine "
                f"({parts.hostname}); set HONCHO_API_KEY")
        for name in ("workspace_id", "assistant_peer", "user_peer_prefix"):
            if not getattr(self, name):
                raise ConfigurationError(f"{name} must not be empty")
        if self.assistant_peer.startswith(self.user_peer_prefix):
            # Then some user's peer could be the assistant's.
            raise ConfigurationError(
                f"assistant_peer {self.assistant_peer!r} must not start with user_peer_prefix "
                f"{self.user_peer_prefix!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object
                 ) -> HonchoConfig:
        """Read ``HONCHO_<FIELD>`` variables: ``HONCHO_API_KEY``, ``HONCHO_BASE_URL``,
        ``HONCHO_WORKSPACE_ID``, ``HONCHO_ASSISTANT_PEER``, ``HONCHO_USER_PEER_PREFIX``,
        ``HONCHO_RECALL_MODE``, ...

        Raises:
            ConfigurationError: a variable does not parse as its field's type, or the values
                are invalid together (say, a remote base URL without an API key).
        """
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if raw is None:
                continue
            values[f.name] = _parse_env(f.name, str(f.type), raw)
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]

    def replace(self, **changes: object) -> HonchoConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def _parse_env(name: str, kind: str, raw: str) -> object:
    var = ENV_PREFIX + name.upper()
    try:
        if kind == "int":
            return int(raw.replace("_", ""))
        if kind == "float":
            return float(raw)
    except ValueError as exc:
        raise ConfigurationError(f"{var} is not a {kind}: {raw!r}") from exc
    if kind == "bool":
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigurationError(f"{var} is not a boolean: {raw!r}")
    if kind == "str | None":
        return raw or None
    return raw


def is_loopback_url(url: str) -> bool:
    """Whether ``url`` names this machine (localhost, 127.0.0.0/8, ::1)."""
    host = (urlsplit(url).hostname or "").lower()
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def honcho_id(raw: str) -> str:
    """``raw`` as a Honcho id: unchanged when it already fits ``^[a-zA-Z0-9_-]{1,512}$``,
    otherwise with the other characters replaced by ``_`` and a hash of ``raw`` appended.

    Deterministic, and collision-safe: two different ids give two different results (up to a
    64-bit hash), and a rewritten id cannot equal an id that was kept.
    """
    # An id that already ends like a rewritten one is rewritten too, so a kept id can never
    # equal a rewritten one.
    if (len(raw) <= MAX_ID_CHARS and ID_PATTERN.fullmatch(raw)
            and not _REWRITTEN.fullmatch(raw)):
        return raw
    digest = hashlib.blake2b(raw.encode("utf-8", "surrogatepass"),
                             digest_size=_ID_HASH_CHARS // 2).hexdigest()
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", raw)[: MAX_ID_CHARS - _ID_HASH_CHARS - 2]
    return f"{stem}-h{digest}"


# -- errors ------------------------------------------------------------------------------


# TurnFailure.permanent: True when the server refused the turn (422, 400, 413, 404): sending
# it again fails again, so it belongs in the dead letters. False when the server was
# unreachable, overloaded or refused our credentials: the same turn may go through later.


class HonchoWriteError(BackendWriteError):
    """Some turns of a ``write`` were not written. The others were, in order.

    ``failures`` names each failed turn with its reason; ``failed_keys`` is the set of their
    keys.
    """

    def __init__(self, failures: Sequence[TurnFailure], *, written: int) -> None:
        reasons = Counter(f.reason for f in failures)
        top = "; ".join(f"{r} ({n} turns)" for r, n in reasons.most_common(3))
        super().__init__(failures, written=written, message=(
            f"Honcho: {len(failures)} turns not written, {written} written: {top}"))


class CircuitOpenError(HonchoWriteError, BackendUnavailableError):
    """The circuit breaker is open: nothing was sent."""


class _Retry(Exception):
    """A call failed in a way another attempt may fix."""

    def __init__(self, reason: str, *, unknown: bool, retry_after: float | None = None):
        super().__init__(reason)
        self.reason = reason
        self.unknown = unknown  # the request may have been applied
        self.retry_after = retry_after


class _Failed(Exception):
    """A call failed for good (for now)."""

    def __init__(self, reason: str, *, permanent: bool, bisect: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.permanent = permanent
        self.bisect = bisect  # the server refused something in the batch: split to find it


# -- the circuit breaker -------------------------------------------------------------------

CircuitState = Literal["closed", "open", "half_open"]
CIRCUIT_OPEN = "circuit open: Honcho failed repeatedly, not trying until the cool-down ends"


class CircuitBreaker:
    """Opens after ``threshold`` consecutive failed calls; after ``cooldown_s`` one call
    probes while the others wait for its outcome."""

    def __init__(self, threshold: int, cooldown_s: float, clock: Callable[[], float]) -> None:
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self.state: CircuitState = "closed"
        self.consecutive_failures = 0
        self.opened = 0  # times it opened
        self._opened_at = 0.0
        self._probe_done: anyio.Event | None = None

    def is_open(self) -> bool:
        """Open and still cooling down: a call now would fail fast."""
        return self.state == "open" and self._clock() - self._opened_at < self.cooldown_s

    async def admit(self) -> bool:
        """Wait until a call may go; True when this call is the half-open probe.

        Raises:
            _Failed: the circuit is open.
        """
        while True:
            if self.state == "closed":
                return False
            if self._probe_done is not None:  # a probe is out: its outcome decides
                await self._probe_done.wait()
                continue
            if self.is_open():
                raise _Failed(CIRCUIT_OPEN, permanent=False)
            self.state = "half_open"
            self._probe_done = anyio.Event()
            return True

    def settle(self, probe: bool, *, healthy: bool) -> None:
        if healthy:
            self.consecutive_failures = 0
            if self.state != "closed":
                log.info("honcho_circuit_closed")
                self.state = "closed"
        else:
            self.consecutive_failures += 1
            if probe or (self.state == "closed"
                         and self.consecutive_failures >= self.threshold):
                self.state = "open"
                self.opened += 1
                self._opened_at = self._clock()
                log.warning("honcho_circuit_open", consecutive_failures=self.consecutive_failures,
                            cooldown_s=self.cooldown_s)
        if probe:
            self._end_probe()

    def abandon(self, probe: bool) -> None:
        """The call ended with no verdict (cancelled, or a bug): let another call probe."""
        if probe:
            if self.state == "half_open":
                self.state = "open"  # cooled down already: the next call probes at once
            self._end_probe()

    def _end_probe(self) -> None:
        if self._probe_done is not None:
            self._probe_done.set()
            self._probe_done = None


# -- the backend ---------------------------------------------------------------------------


class _Msg(NamedTuple):
    key: str
    pos: int  # the index within its turn
    params: Any  # honcho MessageCreateParams


class _Unit(NamedTuple):
    """One turn as the messages it becomes."""

    turn: Turn
    msgs: list[_Msg]


@dataclass(slots=True)
class _Lane:
    session_id: str
    turns: list[Turn]
    after: anyio.Event | None  # the previous write of this session is done
    done: anyio.Event


@dataclass(slots=True)
class _Outcome:
    failures: list[TurnFailure] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)
    written: int = 0

    def fail(self, turns: Iterable[Turn], reason: str, *, permanent: bool) -> None:
        for t in turns:
            if t.key not in self.failed:
                self.failed.add(t.key)
                self.failures.append(TurnFailure(t.key, t.session_id, reason, permanent))


class _LRU:
    """A bounded map from a session id to the peers configured in it."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._data: OrderedDict[str, set[str]] = OrderedDict()

    def get(self, key: str) -> set[str] | None:
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key: str, value: set[str]) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self._size:
            self._data.popitem(last=False)


@functools.cache
def _sdk() -> Any:
    """The honcho package, imported on first use (it brings pydantic and ~0.4 s of imports).

    Raises:
        ConfigurationError: honcho-ai (the honcho extra) is not installed.
    """
    module = require("honcho", "honcho", "the Honcho backend")
    importlib.import_module("honcho.api_types")
    importlib.import_module("honcho.http")
    return module


def _httpx() -> Any:
    return importlib.import_module("httpx")


class HonchoBackend(Backend):
    """Replicates committed turns to Honcho and answers recalls from it (see the module doc).

    ``clock``, ``sleep`` and ``rng`` are the breaker's clock, the backoff's sleep and its
    jitter source; tests pass their own.
    """

    name = "honcho"

    def __init__(
        self,
        config: HonchoConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = anyio.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.recalls = config.recall_mode != "off"
        self._sleep = sleep
        self._rng = rng or random.Random()
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s, clock)
        self.workspace = honcho_id(config.workspace_id)
        self.assistant = honcho_id(config.assistant_peer)
        self.last_recall_source: str | None = None
        self._honcho: Any = None
        self._http: Any = None
        self._closed = False
        self._ready = False
        self._ready_lock = anyio.Lock()
        self._limiter = anyio.CapacityLimiter(config.write_concurrency)
        self._lanes: dict[str, anyio.Event] = {}  # session -> the last write queued on it
        self._sessions = _LRU(config.known_sessions)
        self._calls: Counter[str] = Counter()
        self._counts: Counter[str] = Counter()
        self._recall_sources: Counter[str] = Counter()

    def __repr__(self) -> str:
        c = self.config
        return (f"HonchoBackend(base_url={c.base_url!r}, workspace={self.workspace!r}, "
                f"recall_mode={c.recall_mode!r})")

    # -- ids -------------------------------------------------------------------------

    def session_name(self, session_id: str) -> str:
        """The Honcho session id of a local session."""
        return honcho_id(session_id)

    def user_peer_name(self, user_id: str | None, session_id: str) -> str:
        """The Honcho peer of a user (or, with no user, of the session alone)."""
        if user_id:
            return honcho_id(self.config.user_peer_prefix + user_id)
        return honcho_id(f"{self.config.user_peer_prefix}session-{session_id}")

    # -- life cycle ----------------------------------------------------------------------

    def available(self) -> bool:
        return not self.breaker.is_open()

    async def startup(self) -> None:
        """Build the SDK client. No network call: Honcho being down must not stop the
        pipeline from starting (the first write sets up the workspace).

        Raises:
            BackendError: honcho-ai is not installed.
        """
        self._client()

    async def aclose(self) -> None:
        """Close the HTTP connections. Idempotent."""
        self._closed = True
        http, self._http, self._honcho = self._http, None, None
        if http is not None:
            with anyio.CancelScope(shield=True):
                await http.aclose()

    def _client(self) -> Any:
        if self._closed:
            raise BackendError("the Honcho backend is closed")
        if self._honcho is not None:
            return self._honcho
        sdk, httpx = _sdk(), _httpx()
        c = self.config
        self._http = httpx.AsyncClient(
            base_url=c.base_url.rstrip("/"),
            timeout=httpx.Timeout(c.request_timeout_s),
            limits=httpx.Limits(max_connections=c.write_concurrency + 8,
                                max_keepalive_connections=c.write_concurrency + 8),
        )
        honcho = sdk.Honcho(api_key=c.api_key, base_url=c.base_url, workspace_id=self.workspace,
                            timeout=c.request_timeout_s, max_retries=0)
        # The SDK builds its own async client per event loop and never closes it; the slot
        # below is where its test fixtures inject one (no public parameter). Ours has the
        # pool sized to write_concurrency, max_retries=0, and is closed by aclose().
        honcho._async_http = sdk.http.AsyncHonchoHTTPClient(
            base_url=c.base_url, api_key=c.api_key, timeout=c.request_timeout_s,
            max_retries=0, http_client=self._http,
        )
        self._honcho = honcho
        return honcho

    # -- stats ---------------------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        """Counters for a dashboard: calls by route, retries, dedupe checks, failures."""
        return {
            "http_calls": sum(self._calls.values()),
            "calls_by_route": dict(self._calls),
            **{name: self._counts[name] for name in _COUNTERS},
            "circuit": self.breaker.state,
            "circuit_opened": self.breaker.opened,
            "recall_sources": dict(self._recall_sources),
        }

    # -- writing -------------------------------------------------------------------------

    async def write(self, turns: Sequence[Turn], *, maybe_sent: bool = False) -> None:
        """Replicate committed turns, in order per session, each exactly once.

        ``maybe_sent=True`` says some of these turns may have reached Honcho before (a replay
        after a crash, or of dead letters): the session's messages are then listed first and
        only what is missing is sent.

        Raises:
            CircuitOpenError: the circuit is open; nothing was sent.
            HonchoWriteError: some turns were not written (``failures`` says which and why).
            BackendError: the backend is closed, or honcho-ai is missing.
        """
        if not turns:
            return
        self._client()
        started = time.perf_counter()
        calls_before = sum(self._calls.values())
        if self.breaker.is_open():
            self._counts["turns_failed"] += len(turns)
            raise CircuitOpenError(
                [TurnFailure(t.key, t.session_id, CIRCUIT_OPEN, False) for t in turns], written=0)
        groups: dict[str, list[Turn]] = {}
        for t in turns:
            groups.setdefault(t.session_id, []).append(t)
        # Queue on each session's lane now, before any await: that fixes the order of
        # concurrent writes of one session to the order of the calls.
        lanes = []
        for session_id, group in groups.items():
            done = anyio.Event()
            lanes.append(_Lane(session_id, group, self._lanes.get(session_id), done))
            self._lanes[session_id] = done
        outcome = _Outcome()
        try:
            async with anyio.create_task_group() as tg:
                for lane in lanes:
                    tg.start_soon(self._run_lane, lane, outcome, maybe_sent)
        finally:
            for lane in lanes:
                lane.done.set()
                if self._lanes.get(lane.session_id) is lane.done:
                    del self._lanes[lane.session_id]
        self._counts["turns_written"] += outcome.written
        self._counts["turns_failed"] += len(outcome.failures)
        fields = dict(turns=len(turns), sessions=len(groups),
                      http_calls=sum(self._calls.values()) - calls_before,
                      failed=len(outcome.failures),
                      duration_ms=round((time.perf_counter() - started) * 1000, 1))
        if outcome.failures:
            log.warning("honcho_write", **fields)
            raise HonchoWriteError(outcome.failures, written=outcome.written)
        log.info("honcho_write", **fields)

    async def _run_lane(self, lane: _Lane, outcome: _Outcome, maybe_sent: bool) -> None:
        try:
            if lane.after is not None:
                await lane.after.wait()
            async with self._limiter:
                await self._write_session(lane.session_id, lane.turns, outcome, maybe_sent)
        except Exception as exc:  # the per-job boundary: one session's bug fails its turns only
            log.exception("honcho_write_bug", session=self.session_name(lane.session_id))
            outcome.fail(lane.turns, f"unexpected error: {type(exc).__name__}: {exc}",
                         permanent=False)
        finally:
            lane.done.set()

    async def _write_session(self, session_id: str, turns: list[Turn], outcome: _Outcome,
                             maybe_sent: bool) -> None:
        sdk = _sdk()
        name = self.session_name(session_id)
        session = sdk.Session(name, self._client())
        units = [self._unit(t) for t in turns]
        try:
            await self._ensure_ready()
            await self._ensure_session(session, {m.params.peer_id for u in units
                                                 for m in u.msgs} - {self.assistant})
            if maybe_sent:
                units = await self._without_present(session, units)
        except _Failed as f:
            self._note_failure(name, turns, f)
            outcome.fail(turns, f.reason, permanent=f.permanent)
            return
        outcome.written += sum(1 for u in units if not u.msgs)  # all on the server already
        queue = deque(self._groups(units))
        while queue:
            group = queue.popleft()
            try:
                await self._send_group(session, group)
            except _Failed as f:
                if f.bisect and len(group) > 1:
                    self._counts["bisections"] += 1
                    mid = len(group) // 2
                    queue.extendleft([group[mid:], group[:mid]])  # the first half goes first
                    continue
                refused = [u.turn for u in group]
                self._note_failure(name, refused, f)
                outcome.fail(refused, f.reason, permanent=f.permanent)
                if f.bisect:
                    continue  # the server refused this turn alone; the next ones still go
                rest = [u.turn for g in queue for u in g]
                # Unreachable: the session's later turns wait for the next write, in order.
                outcome.fail(rest, f"not attempted after an earlier batch of this session "
                             f"failed: {f.reason}", permanent=False)
                return
            outcome.written += len(group)

    def _note_failure(self, session: str, turns: Sequence[Turn], f: _Failed) -> None:
        log.warning("honcho_batch_failed", session=session, turns=len(turns), reason=f.reason,
                    permanent=f.permanent)

    def _unit(self, turn: Turn) -> _Unit:
        """The Honcho messages of one turn, each tagged with the turn's key and its index."""
        sdk = _sdk()
        user_peer = self.user_peer_name(turn.user_id, turn.session_id)
        created = dt.datetime.fromtimestamp(turn.accepted_at, tz=dt.timezone.utc)
        step = self.config.max_message_chars
        msgs: list[_Msg] = []
        for ordinal, (role, content, calls_json, call_id, tool_name) in enumerate(turn.messages):
            parts = [content[i:i + step] for i in range(0, len(content), step)] or [""]
            for p, part in enumerate(parts):
                index = len(msgs)
                md: dict[str, object] = {KEY_FIELD: turn.key, INDEX_FIELD: index, "role": role,
                                         "ordinal": ordinal, USER_FIELD: user_peer}
                if len(parts) > 1:
                    md["part"], md["parts"] = p, len(parts)
                if calls_json and p == 0:
                    md["tool_calls"] = calls_json
                if call_id:
                    md["tool_call_id"] = call_id
                if tool_name:
                    md["tool_name"] = tool_name
                params = sdk.MessageCreateParams(
                    content=part, peer_id=user_peer if role == "user" else self.assistant,
                    metadata=md, created_at=created)
                msgs.append(_Msg(turn.key, index, params))
        return _Unit(turn, msgs)

    @staticmethod
    def _groups(units: list[_Unit]) -> list[list[_Unit]]:
        """Whole turns packed into calls of at most 100 messages (a longer turn alone)."""
        groups: list[list[_Unit]] = []
        size = MAX_MESSAGES_PER_CALL + 1
        for u in units:
            n = len(u.msgs)
            if not n:
                continue
            if size + n > MAX_MESSAGES_PER_CALL:
                groups.append([])
                size = 0
            groups[-1].append(u)
            size += n
        return groups

    async def _send_group(self, session: Any, group: list[_Unit]) -> None:
        msgs = [m for u in group for m in u.msgs]
        for i in range(0, len(msgs), MAX_MESSAGES_PER_CALL):
            await self._send(session, msgs[i:i + MAX_MESSAGES_PER_CALL])

    async def _send(self, session: Any, msgs: list[_Msg]) -> None:
        """One ``add_messages`` call, retried; a retry after an unknown outcome first asks
        the server which of these messages it already holds.

        Raises:
            _Failed: the batch was refused, or not written after max_attempts.
        """
        pending = msgs
        unknown = False
        attempt = 0
        while True:
            attempt += 1
            try:
                if unknown:
                    self._counts["dedupe_checks"] += 1
                    present = await self._present(session, sorted({m.key for m in pending}))
                    unknown = False
                    before = len(pending)
                    pending = [m for m in pending if (m.key, m.pos) not in present]
                    self._counts["resend_skipped"] += before - len(pending)
                    if not pending:
                        return
                batch = [m.params for m in pending]
                await self._attempt("add_messages",
                                    functools.partial(session.aio.add_messages, batch))
                return
            except _Retry as r:
                unknown = unknown or r.unknown
                await self._pause("add_messages", attempt, r)

    async def _present(self, session: Any, keys: Sequence[str]) -> set[tuple[str, int]]:
        """(turn key, index) of the session's messages that carry one of ``keys``.

        Raises:
            _Retry, _Failed: as ``_attempt``.
        """
        found: set[tuple[str, int]] = set()
        for i in range(0, len(keys), _KEYS_PER_LISTING):
            chunk = list(keys[i:i + _KEYS_PER_LISTING])
            filters = {"metadata": {KEY_FIELD: {"in": chunk}}}
            page = await self._attempt("list_messages", functools.partial(
                session.aio.messages, filters=filters, size=LIST_PAGE_SIZE))
            while page is not None:
                for m in page.items:
                    md = m.metadata or {}
                    index = md.get(INDEX_FIELD)
                    if isinstance(index, int):
                        found.add((str(md.get(KEY_FIELD)), index))
                if not page.has_next_page():
                    break
                page = await self._attempt("list_messages", page.get_next_page)
        return found

    async def _without_present(self, session: Any, units: list[_Unit]) -> list[_Unit]:
        """The units with the messages the server already holds taken out (retried)."""
        keys = sorted({u.turn.key for u in units})
        present = await self._retrying("list_messages",
                                       functools.partial(self._present, session, keys))
        if not present:
            return units
        kept = []
        for u in units:
            msgs = [m for m in u.msgs if (m.key, m.pos) not in present]
            self._counts["resend_skipped"] += len(u.msgs) - len(msgs)
            kept.append(_Unit(u.turn, msgs))
        return kept

    async def _ensure_ready(self) -> None:
        """The workspace and the assistant peer exist (get-or-create, once per process)."""
        if self._ready:
            return
        async with self._ready_lock:
            if self._ready:
                return
            honcho = self._client()
            # aio.peer() first gets-or-creates the workspace (once per client), then the peer.
            await self._call("peer", lambda: honcho.aio.peer(self.assistant))
            self._ready = True

    async def _ensure_session(self, session: Any, users: set[str]) -> None:
        """The session exists with its peers' observation settings (once per session)."""
        if not self.config.configure_sessions:
            return
        known = self._sessions.get(session.id)
        sdk = _sdk()
        c = self.config
        user_config = sdk.api_types.SessionPeerConfig(observe_me=c.user_observe_me,
                                                      observe_others=c.user_observe_others)
        new = sorted(users - known) if known is not None else sorted(users)
        if known is None:
            peers = [(u, user_config) for u in new]
            peers.append((self.assistant, sdk.api_types.SessionPeerConfig(
                observe_me=c.assistant_observe_me, observe_others=c.assistant_observe_others)))
            honcho = self._client()
            await self._call("session", lambda: honcho.aio.session(session.id, peers=peers))
            self._sessions.put(session.id, {*new, self.assistant})
        elif new:
            added = [(u, user_config) for u in new]
            await self._call("add_peers", lambda: session.aio.add_peers(added))
            known.update(new)

    # -- calls, retries, the breaker -----------------------------------------------------

    async def _call(self, route: str, fn: Callable[[], Awaitable[T]]) -> T:
        """An idempotent call (get-or-create), retried with backoff.

        Raises:
            _Failed: refused, or still failing after max_attempts.
        """
        return await self._retrying(route, functools.partial(self._attempt, route, fn))

    async def _retrying(self, route: str, fn: Callable[[], Awaitable[T]]) -> T:
        """``fn`` (made of ``_attempt`` calls, so idempotent ones) until it does not raise
        ``_Retry``, with backoff in between.

        Raises:
            _Failed: refused, or still failing after max_attempts.
        """
        attempt = 0
        while True:
            attempt += 1
            try:
                return await fn()
            except _Retry as r:
                await self._pause(route, attempt, r)

    async def _attempt(self, route: str, fn: Callable[[], Awaitable[T]]) -> T:
        """One HTTP call through the breaker, its failure sorted into retry or give up.

        Raises:
            _Retry: another attempt may succeed.
            _Failed: the server refused it, or the circuit is open.
        """
        sdk = _sdk()
        probe = await self.breaker.admit()
        self._calls[route] += 1
        try:
            result = await fn()
        except sdk.HonchoError as exc:
            verdict, healthy = _classify(exc, sdk)
            self.breaker.settle(probe, healthy=healthy)
            raise verdict from exc
        except BaseException:
            self.breaker.abandon(probe)
            raise
        self.breaker.settle(probe, healthy=True)
        return result

    async def _pause(self, route: str, attempt: int, r: _Retry) -> None:
        """Wait before the next attempt.

        Raises:
            _Failed: out of attempts, or the server asks for a longer pause than we hold on.
        """
        c = self.config
        if attempt >= c.max_attempts:
            raise _Failed(f"{r.reason} (gave up after {attempt} attempts)", permanent=False)
        if r.retry_after is not None:
            if r.retry_after > c.retry_after_max_s:
                raise _Failed(f"{r.reason} (Retry-After {r.retry_after:g} s is longer than "
                              f"{c.retry_after_max_s:g} s)", permanent=False)
            delay = r.retry_after * (1 + self._rng.uniform(0, 0.1))
        else:
            cap = min(c.backoff_max_s, c.backoff_base_s * 2 ** (attempt - 1))
            delay = cap / 2 + self._rng.uniform(0, cap / 2)  # "equal jitter"
        self._counts["retries"] += 1
        log.debug("honcho_retry", route=route, attempt=attempt, reason=r.reason,
                  delay_s=round(delay, 3))
        await self._sleep(delay)

    # -- recall --------------------------------------------------------------------------

    async def recall(self, request: RecallRequest) -> str | None:
        """A block from the configured source, or None when Honcho has nothing for it (or
        recall is off), so the local store answers.

        Raises:
            BackendError: Honcho did not answer (an error, the deadline, an open circuit);
                the pipeline answers from the local store and marks a kept block stale.
        """
        block, source = await self.recall_with_source(request)
        if source in _RECALL_FAILED:
            raise BackendError(f"Honcho recall failed ({source.partition(':')[2]})")
        return block

    async def recall_with_source(self, request: RecallRequest) -> tuple[str | None, str]:
        """The block (or None) and which source answered: ``honcho:<mode>``, or
        ``local:<why>`` (off, circuit_open, timeout, error, empty)."""
        mode = self.config.recall_mode
        block: str | None = None
        if mode == "off":
            source = "local:off"
        elif self.breaker.is_open():
            source = "local:circuit_open"
        else:
            try:
                with anyio.fail_after(self.config.recall_deadline_s):
                    block = await self._recall_from(mode, request)
            except TimeoutError:
                source = "local:timeout"
            except Exception as exc:  # the per-job boundary: the local store answers instead
                sdk = _sdk()
                if isinstance(exc, sdk.NotFoundError):
                    source = "local:empty"  # Honcho has nothing on this session or user yet
                else:
                    source = "local:error"
                    log.warning("honcho_recall_failed", mode=mode, error=_reason(exc),
                                bug=not isinstance(exc, (sdk.HonchoError, BackendError)))
            else:
                source = f"honcho:{mode}" if block else "local:empty"
                block = block or None
        self.last_recall_source = source
        self._recall_sources[source] += 1
        return block, source

    async def _recall_from(self, mode: RecallMode, request: RecallRequest) -> str:
        sdk = _sdk()
        honcho = self._client()
        user = self.user_peer_name(request.user_id, request.session_id)
        session_name = self.session_name(request.session_id)
        limit = max(1, min(request.limit, 100))
        query = request.query.strip()
        self._calls[f"recall_{mode}"] += 1
        if mode == "context":
            ctx = await sdk.Session(session_name, honcho).aio.context(
                summary=True, tokens=self.config.context_tokens, peer_target=user,
                search_query=query or None)
            return _render_context(ctx, limit)
        if mode == "representation":
            text = await sdk.Peer(user, honcho).aio.representation(
                search_query=query or None, search_top_k=limit if query else None)
            return _section("What Honcho knows about the user", [str(text or "")])
        if mode == "card":
            card = await sdk.Peer(user, honcho).aio.get_card()
            return _section("User profile", [str(line) for line in card or []])
        if mode == "search":
            if not query:
                return ""
            found = await honcho.aio.search(query, filters={"metadata": {USER_FIELD: user}},
                                            limit=limit)
            return _render_messages("Related memory (Honcho)", found, limit)
        answer = await sdk.Peer(user, honcho).aio.chat(
            query or "What matters about this user right now?", session=session_name,
            reasoning_level=self.config.reasoning_level,
            timeout=self.config.recall_deadline_s)
        return _section("Honcho on the user", [str(answer or "")])


def _classify(exc: Any, sdk: Any) -> tuple[_Retry | _Failed, bool]:
    """What an SDK error means for the call: (retry or give up, was the server healthy)."""
    reason = _reason(exc)
    if isinstance(exc, sdk.RateLimitError):
        return _Retry(reason, unknown=False, retry_after=exc.retry_after), True
    if isinstance(exc, sdk.ConflictError):  # a get-or-create race on the server
        return _Retry(reason, unknown=False), True
    if isinstance(exc, (sdk.UnprocessableEntityError, sdk.BadRequestError)) or (
            isinstance(exc, sdk.APIError) and exc.status == 413):
        return _Failed(reason, permanent=True, bisect=True), True
    if isinstance(exc, sdk.NotFoundError):
        return _Failed(reason, permanent=True), True
    if isinstance(exc, (sdk.AuthenticationError, sdk.PermissionDeniedError)):
        # Not the turns' fault, and no retry fixes it now: fail, and let the breaker open.
        return _Failed(reason, permanent=False), False
    if isinstance(exc, sdk.ServerError):  # a 5xx may come after the server committed
        return _Retry(reason, unknown=True), False
    if isinstance(exc, (sdk.TimeoutError, sdk.ConnectionError)):
        return _Retry(reason, unknown=not _never_sent(exc)), False
    if isinstance(exc, sdk.APIError) and 400 <= exc.status < 500:
        return _Failed(reason, permanent=True), True
    return _Retry(reason, unknown=True), False


def _never_sent(exc: BaseException) -> bool:
    """The request never left: no connection was made (refused, connect timeout, pool)."""
    httpx = _httpx()
    return isinstance(exc.__cause__, (httpx.ConnectError, httpx.ConnectTimeout,
                                      httpx.PoolTimeout))


def _reason(exc: Any) -> str:
    """A short, readable reason from an SDK error (FastAPI's 422 detail is a list)."""
    message = getattr(exc, "message", None) or str(exc)
    if isinstance(message, list):
        parts = []
        for item in message:
            if isinstance(item, Mapping):
                loc = ".".join(str(x) for x in item.get("loc", ()))
                parts.append(f"{loc}: {item.get('msg', '')}".strip(": "))
            else:
                parts.append(str(item))
        message = "; ".join(parts)
    elif not isinstance(message, str):
        message = json.dumps(message, default=str)
    status = getattr(exc, "status", 0)
    head = f"{type(exc).__name__} {status}" if status else type(exc).__name__
    return _short(f"{head}: {message}")


def _short(text: str) -> str:
    return text if len(text) <= _MAX_REASON_CHARS else text[:_MAX_REASON_CHARS - 1] + "…"


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _RECALL_TEXT_CHARS else text[:_RECALL_TEXT_CHARS - 1] + "…"


def _section(title: str, lines: Sequence[str]) -> str:
    body = [_clip(line) for line in lines if line and line.strip()]
    if not body:
        return ""
    if len(body) == 1:
        return f"{title}:\n{body[0]}"
    return f"{title}:\n" + "\n".join(f"- {line}" for line in body)


def _render_messages(title: str, messages: Iterable[Any], limit: int) -> str:
    lines = []
    seen = set()
    for m in messages:
        text = _clip(str(m.content or ""))
        if not text or text in seen:
            continue
        seen.add(text)
        role = (m.metadata or {}).get("role") or m.peer_id
        day = m.created_at.strftime("%Y-%m-%d") if m.created_at else "?"
        lines.append(f"- [{day} {role}] {text}")
        if len(lines) >= limit:
            break
    return f"{title}:\n" + "\n".join(lines) if lines else ""


def _render_context(ctx: Any, limit: int) -> str:
    """Session context as a block: summary, what Honcho concluded, the card, the last words."""
    blocks = []
    if ctx.summary is not None and ctx.summary.content:
        blocks.append(_section("Conversation so far", [ctx.summary.content]))
    if ctx.peer_representation:
        blocks.append(_section("What Honcho knows about the user", [ctx.peer_representation]))
    if ctx.peer_card:
        blocks.append(_section("User profile", [str(x) for x in ctx.peer_card]))
    recent = list(ctx.messages or [])[-limit:]
    if recent:
        blocks.append(_render_messages("Recent messages", recent, limit))
    return "\n\n".join(b for b in blocks if b)
