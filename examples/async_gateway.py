"""A small async chat gateway that embeds the memory pipeline and serves many users at once.

Each simulated user holds a conversation. Every turn follows the order an agent uses:

    prefetch(query)            the memory block for the model prompt (a dict lookup)
    ... the model call ...     simulated here with a short sleep (so is the user's typing)
    sync_turn(user, reply)     the finished turn, durable when this returns
    queue_prefetch(query)      recall ahead for the next turn, in the background

Run it (from the project root, after `pip install -e .`):

    python examples/async_gateway.py                         # embedded: one process
    python examples/async_gateway.py --users 500 --turns 10
    python examples/async_gateway.py --role producer --db /tmp/shared.db --name gw1
                                                             # a gateway of several on one
                                                             # file; see shared_memory.py

It prints what it did and the pipeline's stats, and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.logs import configure_logging

TOPICS = [
    ("invoice", "The invoice for order {n} was sent to billing on Monday."),
    ("deploy", "Deploys to staging need the release tag v{n} and a green CI run."),
    ("travel", "Your flight to Lisbon leaves at {n}:15 from terminal 2."),
    ("recipe", "The bread needs {n}00 g of flour and an overnight rise."),
    ("garden", "Water the tomatoes every {n} days while it stays dry."),
]


async def model_call(prompt: str, memory: str) -> str:
    """Stands in for the LLM (real ones take seconds): answers from the memory it was given."""
    await asyncio.sleep(random.uniform(0.05, 0.2))
    if memory:
        return f"(remembering: {memory.splitlines()[-1][:80]}) Sure, about {prompt[:40]}."
    return f"Noted: {prompt[:60]}."


async def user_session(mem: MemoryPipeline, name: str, user: int, turns: int,
                       seen: list[int]) -> None:
    user_id = f"{name}-user-{user}"
    session_id = f"{name}-session-{user}"
    for t in range(turns):
        topic, fact = TOPICS[(user + t) % len(TOPICS)]
        question = f"Tell me about the {topic}: {fact.format(n=user % 9 + 1)}"
        memory = mem.prefetch(question, session_id=session_id, user_id=user_id)  # never waits
        if memory:
            seen[0] += 1
        reply = await model_call(question, memory)
        mem.sync_turn(question, reply, session_id=session_id, user_id=user_id,
                      metadata={"source": "gateway", "model": "simulated"})
        next_topic = TOPICS[(user + t + 1) % len(TOPICS)][0]
        mem.queue_prefetch(f"what did we say about the {next_topic}", session_id=session_id,
                           user_id=user_id)
        await asyncio.sleep(random.uniform(0.05, 0.2))  # the user reads and types the next one


async def main(args: argparse.Namespace) -> None:
    db = args.db or Path(tempfile.mkdtemp(prefix="gateway-")) / "memory.db"
    settings = Settings.from_env(db_path=db, role=args.role)
    started = time.perf_counter()
    async with MemoryPipeline(settings) as mem:
        seen = [0]
        await asyncio.gather(*(user_session(mem, args.name, u, args.turns, seen)
                               for u in range(args.users)))
        served = time.perf_counter() - started
        await mem.flush(timeout=60)
        stats = mem.stats()
        if args.role != "producer":
            sample = await mem.search("invoice billing", user_id=f"{args.name}-user-0")
        else:
            sample = mem.prefetch("", session_id=f"{args.name}-session-0",
                                  user_id=f"{args.name}-user-0")
    total = args.users * args.turns
    print(f"{args.name}: served {total} turns for {args.users} users in {served:.2f} s "
          f"({total / served:,.0f} turns/s); {seen[0]} prompts carried a memory block")
    done = "handed to the worker" if args.role == "producer" else "committed"
    print(f"{args.name}: stored in {db} (role {args.role}); {done} {stats.committed_turns}, "
          f"queue {stats.queued_turns}, dead letters {stats.dead_letters}, "
          f"write-to-recallable p50 {stats.write_to_recallable_p50_ms:.1f} ms")
    if sample:
        print(f"{args.name}: a recall for user 0:\n{sample}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--db", type=Path, help="store file (default: a new temporary one)")
    parser.add_argument("--role", choices=("embedded", "producer"), default="embedded")
    parser.add_argument("--name", default="gw", help="prefix of this gateway's users")
    return parser.parse_args()


if __name__ == "__main__":
    configure_logging(json=False, level="warning")
    asyncio.run(main(parse_args()))
