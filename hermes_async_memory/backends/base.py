"""The contract a replica backend implements.

The local SQLite store is the system of record; a backend receives committed turns after
the store has them and may answer recalls. Backends are async and own their connections.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass

from ..turns import Turn


@dataclass(frozen=True, slots=True)
class RecallRequest:
    query: str
    session_id: str
    user_id: str | None
    limit: int


class Backend(abc.ABC):
    """A place committed turns are replicated to, and recalls may be answered from."""

    name: str = "backend"

    async def startup(self) -> None:  # noqa: B027 - optional hook
        """Open connections; called once before any other method."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release everything; called once, last."""

    @abc.abstractmethod
    async def write(self, turns: Sequence[Turn]) -> None:
        """Replicate committed turns, in order per session.

        Raises:
            BackendError: the batch was not (or not certainly) written.
        """

    async def recall(self, request: RecallRequest) -> str | None:
        """A recall block, or None to let the local store answer."""
        return None
