"""``hermes-memory status`` on a store whose word index is being rebuilt after an upgrade
(made before the index stemmed): the progress shows as a line and in ``--json``, read from
the file as it is; a store with no rebuild under way says nothing of it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio.to_thread
import pytest
from structlog.testing import capture_logs

from hermes_async_memory import MemoryPipeline, Settings, cli

from .ui_fixtures import store_mid_reindex


@pytest.fixture(autouse=True)
def _quiet_logs() -> Iterator[None]:
    # The pipeline's log lines would otherwise land on the stdout the command prints to.
    with capture_logs():
        yield


async def status(db: Path, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    capsys.readouterr()
    code = await anyio.to_thread.run_sync(cli.main, ["status", "--db", str(db), *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def row(out: str, name: str) -> str | None:
    """The value of the status line named ``name``, or None when there is no such line."""
    for line in out.splitlines():
        if line.startswith(name + "  "):
            return line[len(name):].strip()
    return None


async def test_status_shows_the_word_index_rebuild_while_it_is_under_way(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings = await store_mid_reindex(tmp_path)
    text = await status(settings.db_path, capsys)
    assert row(text, "word index") == ("rebuilding, 125 of 1,200 messages (10%); searches "
                                       "read the old index until it ends")
    assert row(text, "messages") == "1200"
    report: dict[str, Any] = json.loads(await status(settings.db_path, capsys, "--json"))
    assert (report["reindex_done"], report["reindex_total"]) == (125, 1200)


async def test_status_says_nothing_of_a_rebuild_when_none_is_under_way(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings = Settings(db_path=tmp_path / "memory.db")
    async with MemoryPipeline(settings) as mem:
        mem.sync_turn("hello", "hi", session_id="s", user_id="u")
    text = await status(settings.db_path, capsys)
    assert row(text, "messages") == "2"
    assert row(text, "word index") is None
    report = json.loads(await status(settings.db_path, capsys, "--json"))
    assert (report["reindex_done"], report["reindex_total"]) == (0, 0)
