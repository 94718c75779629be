"""The circuit breaker in front of every Honcho call: after ``threshold`` consecutive failed
calls it opens and calls fail at once; after ``cooldown_s`` one call probes while the others
wait for its outcome, which closes the circuit or opens it again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import anyio
import structlog

log = structlog.get_logger(__name__)

CircuitState = Literal["closed", "open", "half_open"]
CIRCUIT_OPEN = "circuit open: Honcho failed repeatedly, not trying until the cool-down ends"


class CircuitOpen(Exception):
    """The circuit is open: the call was not made."""


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
            CircuitOpen: the circuit is open.
        """
        while True:
            if self.state == "closed":
                return False
            if self._probe_done is not None:  # a probe is out: its outcome decides
                await self._probe_done.wait()
                continue
            if self.is_open():
                raise CircuitOpen(CIRCUIT_OPEN)
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
