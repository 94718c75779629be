from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from hermes_async_memory import MemoryPipeline, Settings


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(db_path=tmp_path / "memory.db")


@pytest.fixture
async def mem(settings: Settings) -> AsyncIterator[MemoryPipeline]:
    async with MemoryPipeline(settings) as pipeline:
        yield pipeline
