"""flush(): a barrier for everything accepted, or for one session's turns only."""

from __future__ import annotations

from pathlib import Path

import anyio

from hermes_async_memory import MemoryPipeline, Settings


async def test_flush_of_one_session_does_not_wait_for_the_others(tmp_path: Path) -> None:
    """Before, flush(session_id=...) ignored its argument and waited for everything."""
    settings = Settings(db_path=tmp_path / "m.db", max_batch=100)
    async with MemoryPipeline(settings) as mem:
        mem.sync_turn("mine", "r", session_id="a", user_id="u")
        for i in range(20_000):
            mem.sync_turn(f"theirs {i}", "r", session_id=f"b{i % 100}", user_id="v")
        with anyio.fail_after(10):
            await mem.flush(session_id="a")
        assert [m["content"] for m in await mem.get_messages("a")] == ["mine", "r"]
        pending = mem.stats().pending_turns
        assert pending > 10_000, "the other sessions' turns were not waited for"
        with anyio.fail_after(30):
            await mem.flush()
        assert mem.stats().pending_turns == 0


async def test_flush_of_a_session_waits_for_its_own_latest_turn(tmp_path: Path) -> None:
    settings = Settings(db_path=tmp_path / "m.db", max_batch=50)
    async with MemoryPipeline(settings) as mem:
        for i in range(2000):
            mem.sync_turn(f"turn {i}", "r", session_id=f"s{i % 7}")
        with anyio.fail_after(10):
            await mem.flush(session_id="s3")
        got = [m["content"] for m in await mem.get_messages("s3") if m["role"] == "user"]
        assert got == [f"turn {i}" for i in range(2000) if i % 7 == 3]
        # A session this pipeline never saw has nothing to wait for.
        with anyio.fail_after(1):
            await mem.flush(session_id="never")
