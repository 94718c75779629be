"""A process that accepts turns and prints each receipt, to be SIGKILLed by tests.

    python child_accept.py DB MODE

MODE "accept": accept forever. "tools": accept forever, each turn with two tool calls
(``c<i>a`` fails on odd ``i``, ``c<i>b`` succeeds), in Hermes's message format. "kv":
key-value writes forever, for three users: each step
``i`` stores ``k<i>`` and then ``counter`` = i, and every third step deletes ``k<i-1>``.
"templates": template writes forever: each step ``i`` saves ``t<i>``, starts session
``s<i>`` from it twice (the second start changes nothing), and every third step deletes
``t<i-1>``; one receipt line per step, printed once all of the step's records are accepted.
"in-commit": the first batch's transaction stays open (the
writer is stuck inside it) while accepting goes on. "after-commit": the first batch commits,
then the writer stops before the outbox learns it. Each receipt line is printed only after
sync_turn returned, so a printed key is an acknowledged, durable turn.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.store import Batch, SqliteStore
from hermes_async_memory.templates import Example, Template


class FrozenStore(SqliteStore):
    """Stops forever at a chosen point of the first commit; a kill lands exactly there."""

    def __init__(self, path: Path, mode: str) -> None:
        super().__init__(path)
        self.mode = mode

    async def _commit_transaction(self) -> None:
        # Every statement of the batch has run; the transaction is open, not committed.
        if self.mode == "in-commit":
            print("IN_COMMIT", flush=True)
            await asyncio.Event().wait()
        await super()._commit_transaction()

    async def commit_batch(self, batch: Batch) -> None:
        await super().commit_batch(batch)
        if self.mode == "after-commit":
            print("COMMITTED", len(batch), flush=True)
            await asyncio.Event().wait()


async def main(db: str, mode: str) -> None:
    settings = Settings(db_path=Path(db), max_batch=200, max_queued_turns=2000)
    async with MemoryPipeline(settings, store=FrozenStore(Path(db), mode)) as mem:
        if mode == "kv":
            await key_values(mem)
        if mode == "templates":
            await templates(mem)
        i = 0
        while True:
            session = f"s{i % 7}"
            messages = tool_turn(i) if mode == "tools" else None
            r = mem.sync_turn(f"user {i}", f"assistant {i}", session_id=session, user_id="u",
                              messages=messages)
            sys.stdout.write(f"ACK {r.key} {session} {i}\n")
            sys.stdout.flush()
            i += 1
            if i % 25 == 0:
                await asyncio.sleep(0)


def tool_turn(i: int) -> list[dict[str, object]]:
    failed = '{"error": "FileNotFoundError: no such file", "exit_code": 1}'
    return [
        {"role": "user", "content": f"user {i}"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{i}a", "type": "function",
             "function": {"name": "read_file", "arguments": f'{{"path": "f{i}.py"}}'}},
            {"id": f"c{i}b", "type": "function",
             "function": {"name": "terminal", "arguments": f'{{"command": "ls {i}"}}'}}]},
        {"role": "tool", "tool_call_id": f"c{i}a",
         "content": failed if i % 2 else '{"content": "ok"}'},
        {"role": "tool", "tool_call_id": f"c{i}b", "content": '{"output": "", "exit_code": 0}'},
        {"role": "assistant", "content": f"assistant {i}"},
    ]


async def key_values(mem: MemoryPipeline) -> None:
    i = 0
    while True:
        for user in ("ann", "bob", "cy"):
            r = mem.memory.store_nowait(user, f"k{i}", f"value {i}", {"step": i})
            mem.memory.store_nowait(user, "counter", str(i))
            if i % 3 == 2:
                mem.memory.delete_nowait(user, f"k{i - 1}")
            sys.stdout.write(f"ACK {r.key} {user} {i}\n")
        sys.stdout.flush()
        i += 1
        if i % 10 == 0:
            await asyncio.sleep(0)


def template_of(i: int) -> Template:
    return Template(name=f"t{i}", task_type="code", source_session_id=f"src{i}",
                    examples=(Example("terminal", {"command": f"ls {i}"}, "ok", f"c{i}"),))


async def templates(mem: MemoryPipeline) -> None:
    i = 0
    while True:
        r = mem.templates.save_nowait(template_of(i))
        mem.templates.start_nowait(f"s{i}", f"t{i}", "code")
        mem.templates.start_nowait(f"s{i}", f"t{i}", "code")
        if i % 3 == 2:
            mem.templates.delete_nowait(f"t{i - 1}")
        sys.stdout.write(f"ACK {r.key} t{i} {i}\n")
        sys.stdout.flush()
        i += 1
        if i % 10 == 0:
            await asyncio.sleep(0)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
