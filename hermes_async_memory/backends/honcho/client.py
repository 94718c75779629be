"""The Honcho SDK wrapped for the backend: one client, every call through the circuit breaker,
each SDK error sorted into "another attempt may help" or "give up".

The SDK's own retries are off (``max_retries=0``): a blind retry of a ``POST .../messages``
whose response was lost stores the messages twice; the replication decides what to resend.
Retries wait by the project's one policy (``retry.Backoff``, from ``backoff_base_s`` doubling
up to ``backoff_max_s``, with jitter) and honour ``Retry-After`` on a 429. The circuit
breaker opens after ``breaker_failures`` consecutive failed calls; while it is open, calls fail
at once; after ``breaker_cooldown_s`` one call probes and the others wait for its answer.

The SDK (and pydantic, httpx) are imported on first use, not when this module is imported:
the pipeline imports the backends package, and most deployments never use Honcho.
"""

from __future__ import annotations

import functools
import importlib
import json
import random
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypeVar

import anyio
import structlog

from ...errors import BackendError
from ...extras import require
from ...retry import Backoff
from ..base import BackendUnavailableError, BackendWriteError, TurnFailure
from .breaker import CircuitBreaker, CircuitOpen
from .config import HonchoConfig

log = structlog.get_logger(__name__)

T = TypeVar("T")

_MAX_REASON_CHARS = 500
RETRY_AFTER_JITTER = 0.1  # share of a Retry-After added at random
GATEWAY_TIMEOUT = 504


@functools.cache
def sdk() -> Any:
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


class CallRetry(Exception):
    """A call failed in a way another attempt may fix."""

    def __init__(self, reason: str, *, unknown: bool, retry_after: float | None = None,
                 in_flight: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.unknown = unknown  # the request may have been applied
        self.retry_after = retry_after
        # The request may still be running on the server, and commit later: no answer came
        # (a timeout, the connection lost after sending, a gateway's 504). Honcho does not
        # abort a request whose client went away.
        self.in_flight = in_flight


class CallFailed(Exception):
    """A call failed for good (for now)."""

    def __init__(self, reason: str, *, permanent: bool, bisect: bool = False,
                 sent: bool = True):
        super().__init__(reason)
        self.reason = reason
        self.permanent = permanent
        self.bisect = bisect  # the server refused something in the batch: split to find it
        # False: nothing went out (the circuit was open), so the turns behind it were not
        # tried, and their failure uses up none of their attempts.
        self.sent = sent


class HonchoClient:
    """The SDK client of one backend, and the way every call goes: through the breaker,
    sorted, retried with backoff."""

    def __init__(self, config: HonchoConfig, workspace: str, *,
                 clock: Callable[[], float], sleep: Callable[[float], Awaitable[None]],
                 rng: random.Random) -> None:
        self.config = config
        self.workspace = workspace
        self.breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown_s, clock)
        self.backoff = Backoff(base_s=config.backoff_base_s, cap_s=config.backoff_max_s)
        self.calls: Counter[str] = Counter()  # HTTP calls by route
        self.retries = 0
        self._sleep = sleep
        self._rng = rng
        self._honcho: Any = None
        self._http: Any = None
        self._closed = False

    async def aclose(self) -> None:
        """Close the HTTP connections. Idempotent."""
        self._closed = True
        http, self._http, self._honcho = self._http, None, None
        if http is not None:
            with anyio.CancelScope(shield=True):
                await http.aclose()

    def honcho(self) -> Any:
        """The SDK's ``Honcho`` client, built on first use.

        Raises:
            BackendError: the backend is closed, or honcho-ai is not installed.
        """
        if self._closed:
            raise BackendError("the Honcho backend is closed")
        if self._honcho is not None:
            return self._honcho
        honcho_sdk, httpx = sdk(), _httpx()
        c = self.config
        self._http = httpx.AsyncClient(
            base_url=c.base_url.rstrip("/"),
            timeout=httpx.Timeout(c.request_timeout_s),
            limits=httpx.Limits(max_connections=c.write_concurrency + 8,
                                max_keepalive_connections=c.write_concurrency + 8),
        )
        honcho = honcho_sdk.Honcho(api_key=c.api_key, base_url=c.base_url,
                                   workspace_id=self.workspace, timeout=c.request_timeout_s,
                                   max_retries=0)
        # The SDK builds its own async client per event loop and never closes it; the slot
        # below is where its test fixtures inject one (no public parameter). Ours has the
        # pool sized to write_concurrency, max_retries=0, and is closed by aclose().
        honcho._async_http = honcho_sdk.http.AsyncHonchoHTTPClient(
            base_url=c.base_url, api_key=c.api_key, timeout=c.request_timeout_s,
            max_retries=0, http_client=self._http,
        )
        self._honcho = honcho
        return honcho

    async def call(self, route: str, fn: Callable[[], Awaitable[T]]) -> T:
        """An idempotent call (get-or-create), retried with backoff.

        Raises:
            CallFailed: refused, or still failing after max_attempts.
        """
        return await self.retrying(route, functools.partial(self.attempt, route, fn))

    async def retrying(self, route: str, fn: Callable[[], Awaitable[T]]) -> T:
        """``fn`` (made of ``attempt`` calls, so idempotent ones) until it does not raise
        ``CallRetry``, with backoff in between.

        Raises:
            CallFailed: refused, or still failing after max_attempts.
        """
        attempt = 0
        while True:
            attempt += 1
            try:
                return await fn()
            except CallRetry as r:
                await self.pause(route, attempt, r)
            except CallFailed as f:
                f.sent = f.sent or attempt > 1  # an earlier attempt went out and failed
                raise

    async def attempt(self, route: str, fn: Callable[[], Awaitable[T]]) -> T:
        """One HTTP call through the breaker, its failure sorted into retry or give up.

        Raises:
            CallRetry: another attempt may succeed.
            CallFailed: the server refused it, or the circuit is open.
        """
        honcho = sdk()
        try:
            probe = await self.breaker.admit()
        except CircuitOpen as exc:
            # Nothing went out, so the turns of this call were not tried.
            raise CallFailed(str(exc), permanent=False, sent=False) from None
        self.calls[route] += 1
        try:
            result = await fn()
        except honcho.HonchoError as exc:
            verdict, healthy = classify(exc, honcho)
            self.breaker.settle(probe, healthy=healthy)
            raise verdict from exc
        except BaseException:
            self.breaker.abandon(probe)
            raise
        self.breaker.settle(probe, healthy=True)
        return result

    async def pause(self, route: str, attempt: int, r: CallRetry) -> None:
        """Wait before the next attempt.

        Raises:
            CallFailed: out of attempts, or the server asks for a longer pause than we hold on.
        """
        c = self.config
        if attempt >= c.max_attempts:
            raise CallFailed(f"{r.reason} (gave up after {attempt} attempts)", permanent=False)
        if r.retry_after is not None:
            if r.retry_after > c.retry_after_max_s:
                raise CallFailed(f"{r.reason} (Retry-After {r.retry_after:g} s is longer than "
                                 f"{c.retry_after_max_s:g} s)", permanent=False)
            # A little past what the server asked, so that clients told the same do not
            # all come back at once.
            delay = r.retry_after * (1 + self._rng.uniform(0, RETRY_AFTER_JITTER))
        else:
            delay = self.backoff.delay(attempt, rng=self._rng)
        self.retries += 1
        log.debug("honcho_retry", route=route, attempt=attempt, reason=r.reason,
                  delay_s=round(delay, 3))
        await self._sleep(delay)


def classify(exc: Any, honcho_sdk: Any) -> tuple[CallRetry | CallFailed, bool]:
    """What an SDK error means for the call: (retry or give up, was the server healthy)."""
    reason = sdk_reason(exc)
    if isinstance(exc, honcho_sdk.RateLimitError):
        return CallRetry(reason, unknown=False, retry_after=exc.retry_after), True
    if isinstance(exc, honcho_sdk.ConflictError):  # a get-or-create race on the server
        return CallRetry(reason, unknown=False), True
    if isinstance(exc, (honcho_sdk.UnprocessableEntityError, honcho_sdk.BadRequestError)) or (
            isinstance(exc, honcho_sdk.APIError) and exc.status == 413):
        return CallFailed(reason, permanent=True, bisect=True), True
    if isinstance(exc, honcho_sdk.NotFoundError):
        return CallFailed(reason, permanent=True), True
    if isinstance(exc, (honcho_sdk.AuthenticationError, honcho_sdk.PermissionDeniedError)):
        # Not the turns' fault, and no retry fixes it now: fail, and let the breaker open.
        return CallFailed(reason, permanent=False), False
    if isinstance(exc, honcho_sdk.ServerError):
        # A 5xx may come after the server committed. The server is done with the request,
        # except behind a gateway that gave up waiting for it (504).
        return CallRetry(reason, unknown=True,
                         in_flight=exc.status == GATEWAY_TIMEOUT), False
    if isinstance(exc, (honcho_sdk.TimeoutError, honcho_sdk.ConnectionError)):
        sent = not _never_sent(exc)
        return CallRetry(reason, unknown=sent, in_flight=sent), False
    if isinstance(exc, honcho_sdk.APIError) and 400 <= exc.status < 500:
        return CallFailed(reason, permanent=True), True
    return CallRetry(reason, unknown=True, in_flight=True), False


def _never_sent(exc: BaseException) -> bool:
    """The request never left: no connection was made (refused, connect timeout, pool)."""
    httpx = _httpx()
    return isinstance(exc.__cause__, (httpx.ConnectError, httpx.ConnectTimeout,
                                      httpx.PoolTimeout))


def sdk_reason(exc: Any) -> str:
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
    return short(f"{head}: {message}")


def short(text: str) -> str:
    return text if len(text) <= _MAX_REASON_CHARS else text[:_MAX_REASON_CHARS - 1] + "…"


