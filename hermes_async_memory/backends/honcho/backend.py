"""``HonchoBackend``: the replica backend on Honcho, composed of the client, the mapping, the
replication and the recall (see the package doc)."""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable, Sequence

import anyio

from ...errors import BackendError
from ...turns import Turn
from ..base import Backend, RecallRequest
from .breaker import CircuitBreaker
from .client import HonchoClient
from .config import HonchoConfig
from .mapping import Mapper
from .recall import RECALL_FAILED, Recaller
from .replication import COUNTERS, SessionWriter


class HonchoBackend(Backend):
    """Replicates committed turns to Honcho and answers recalls from it (see the package doc).

    ``clock``, ``sleep`` and ``rng`` are the breaker's and the in-flight wait's clock, the
    backoff's and that wait's sleep, and the backoff's jitter source; tests pass their own.
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
        self.mapper = Mapper(config)
        self.client = HonchoClient(config, self.mapper.workspace, clock=clock, sleep=sleep,
                                   rng=rng or random.Random())
        self._writer = SessionWriter(config, self.client, self.mapper, clock=clock,
                                     sleep=sleep)
        self._recaller = Recaller(config, self.client, self.mapper)

    def __repr__(self) -> str:
        c = self.config
        return (f"HonchoBackend(base_url={c.base_url!r}, workspace={self.workspace!r}, "
                f"recall_mode={c.recall_mode!r})")

    # -- ids -------------------------------------------------------------------------

    @property
    def workspace(self) -> str:
        return self.mapper.workspace

    @property
    def assistant(self) -> str:
        return self.mapper.assistant

    @property
    def breaker(self) -> CircuitBreaker:
        return self.client.breaker

    @property
    def last_recall_source(self) -> str | None:
        """Which source answered the last recall (see ``recall_with_source``)."""
        return self._recaller.last_source

    def session_name(self, session_id: str) -> str:
        """The Honcho session id of a local session."""
        return self.mapper.session_name(session_id)

    def user_peer_name(self, user_id: str | None, session_id: str) -> str:
        """The Honcho peer of a user (or, with no user, of the session alone)."""
        return self.mapper.user_peer_name(user_id, session_id)

    # -- life cycle ----------------------------------------------------------------------

    def available(self) -> bool:
        return not self.breaker.is_open()

    async def startup(self) -> None:
        """Build the SDK client. No network call: Honcho being down must not stop the
        pipeline from starting (the first write sets up the workspace).

        Raises:
            BackendError: honcho-ai is not installed.
        """
        self.client.honcho()

    async def aclose(self) -> None:
        """Close the HTTP connections. Idempotent."""
        await self.client.aclose()

    # -- stats ---------------------------------------------------------------------------

    def stats(self) -> dict[str, object]:
        """Counters for a dashboard: calls by route, retries, dedupe checks, failures (each
        failing record once: see ``replication.COUNTERS``)."""
        calls = self.client.calls
        return {
            "http_calls": sum(calls.values()),
            "calls_by_route": dict(calls),
            **{name: self._writer.counts[name] for name in COUNTERS},
            "retries": self.client.retries,
            "circuit": self.breaker.state,
            "circuit_opened": self.breaker.opened,
            "recall_sources": dict(self._recaller.sources),
        }

    # -- writing and recall -------------------------------------------------------------

    async def write(self, turns: Sequence[Turn], *, maybe_sent: bool = False) -> None:
        """Replicate committed turns, in order per session, each exactly once.

        Session lifecycle records set the Honcho session's metadata to the local row
        (describe, end), delete the Honcho session (delete), or add the imported messages
        (import), in the session's order (see ``replication``).

        ``maybe_sent=True`` says some of these turns may have reached Honcho before (a replay
        after a crash, or of dead letters): the session's messages are then listed first and
        only what is missing is sent.

        Raises:
            CircuitOpenError: the circuit is open; nothing was sent.
            HonchoWriteError: some turns were not written (``failures`` says which and why).
            BackendError: the backend is closed, or honcho-ai is missing.
        """
        await self._writer.write(turns, maybe_sent=maybe_sent)

    async def recall(self, request: RecallRequest) -> str | None:
        """A block from the configured source, or None when Honcho has nothing for it (or
        recall is off), so the local store answers.

        Raises:
            BackendError: Honcho did not answer (an error, the deadline, an open circuit);
                the pipeline answers from the local store and marks a kept block stale.
        """
        block, source = await self._recaller.recall_with_source(request)
        if source in RECALL_FAILED:
            raise BackendError(f"Honcho recall failed ({source.partition(':')[2]})")
        return block

    async def recall_with_source(self, request: RecallRequest) -> tuple[str | None, str]:
        """The block (or None) and which source answered: ``honcho:<mode>``, or
        ``local:<why>`` (off, circuit_open, timeout, error, empty)."""
        return await self._recaller.recall_with_source(request)
