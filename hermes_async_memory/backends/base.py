"""The contract a replica backend implements.

The local SQLite store is the system of record; a backend receives committed turns after
the store has them and may answer recalls. Backends are async and own their connections.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import BackendError
from ..turns import Turn


class TurnFailure(NamedTuple):
    """One turn a backend could not write, and why."""

    key: str
    session_id: str
    reason: str
    # True: the backend refused this turn; sending it again fails again (a dead letter).
    # False: the backend was unreachable or overloaded; the turn may go through later.
    permanent: bool
    # False: the turn was never sent (held back behind an earlier failed batch of its
    # session, or by an open circuit); its failure uses up none of its attempts.
    attempted: bool = True


class BackendWriteError(BackendError):
    """Some turns of a ``write`` were not written; the others were, in order."""

    def __init__(self, failures: Sequence[TurnFailure], *, written: int, message: str = ""
                 ) -> None:
        self.failures = tuple(failures)
        self.failed_keys = frozenset(f.key for f in self.failures)
        self.written = written
        super().__init__(message or f"{len(self.failures)} turns not written, {written} written")


class BackendUnavailableError(BackendWriteError):
    """The backend cannot be reached for now (say, its circuit breaker is open): nothing was
    sent. The pipeline keeps the turns and tries again later, without counting an attempt."""

    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class RecallRequest:
    query: str
    session_id: str
    user_id: str | None
    limit: int


@dataclass(frozen=True, slots=True)
class WriteNotice:
    """Writes committed to a shared backend by another process: for these users, and these
    sessions of no user; for everyone when ``everyone`` (a notice too big to name them, or
    the watch reconnected and may have missed some)."""

    users: frozenset[str] = frozenset()
    sessions: frozenset[str] = frozenset()
    everyone: bool = False


class Backend(abc.ABC):
    """A place committed turns are replicated to, and recalls may be answered from."""

    name: str = "backend"
    # Whether recall() can answer; when it can and fails, prefetch status says so.
    recalls: bool = False
    # Whether it keeps key-value memory too: every key-value write is then sent to it.
    mirrors_kv: bool = False
    # Whether it keeps warm-start templates too: every template record is then sent to it.
    mirrors_templates: bool = False
    # Whether watch() reports other processes' writes (a store shared by several machines).
    watches: bool = False

    async def startup(self) -> None:  # noqa: B027 - optional hook
        """Open connections; called once before any other method."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release everything; called once, last."""

    @abc.abstractmethod
    async def write(self, turns: Sequence[Turn], *, maybe_sent: bool = False) -> None:
        """Replicate committed turns, in order per session, each exactly once.

        Records of other kinds come the same way (``Turn.kind``): a session's lifecycle
        events (``ops.OP_SESSION``: describe, end, delete, import) whenever the store has a
        replica, in the session's order; key-value writes when the backend mirrors
        key-value memory; template records (``ops.OP_TEMPLATE``) when it mirrors
        templates. A backend that keeps no such thing takes them as written.

        ``maybe_sent``: some of these turns may have reached the backend before (a retry
        whose outcome was unknown, a restart, a dead-letter replay); send only what it lacks.

        Raises:
            BackendUnavailableError: nothing was sent; try again later.
            BackendWriteError: these turns (``failures``) were not written; the rest were.
            BackendError: the batch was not (or not certainly) written.
        """

    def available(self) -> bool:
        """Whether the backend can be tried now (False while, say, its circuit is open):
        writes that fail while it is not are an outage, and use up no attempts."""
        return True

    async def recall(self, request: RecallRequest) -> str | None:
        """A recall block, or None to let the local store answer."""
        return None

    async def watch(self, on_write: Callable[[WriteNotice], None]) -> None:
        """Call ``on_write`` (on the event loop) for each write other processes commit,
        until cancelled; a supervised part, run only when ``watches``."""
        raise NotImplementedError(f"{self.name} does not watch for writes")
