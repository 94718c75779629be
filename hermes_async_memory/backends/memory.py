"""An in-memory backend for tests and examples: keeps what it was sent, in order."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from ..turns import Turn
from .base import Backend


class InMemoryBackend(Backend):
    name = "memory"

    def __init__(self) -> None:
        self.turns: dict[str, list[Turn]] = defaultdict(list)
        self.started = False
        self.closed = False

    async def startup(self) -> None:
        self.started = True

    async def aclose(self) -> None:
        self.closed = True

    async def write(self, turns: Sequence[Turn], *, maybe_sent: bool = False) -> None:
        for t in turns:
            held = self.turns[t.session_id]
            if maybe_sent and any(h.key == t.key for h in held):
                continue
            held.append(t)
