"""A backend that replicates nowhere: local store only."""

from __future__ import annotations

from collections.abc import Sequence

from ..turns import Turn
from .base import Backend


class NullBackend(Backend):
    name = "null"

    async def write(self, turns: Sequence[Turn], *, maybe_sent: bool = False) -> None:
        return None
