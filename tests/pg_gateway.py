"""A gateway process for the many-gateways test: its own SQLite file, one shared PostgreSQL.

``python -m tests.pg_gateway NAME DB_PATH USERS SESSIONS TURNS``, with ``DATABASE_URL``
(the DSN, password and all: never on the command line) in the environment.

1. Writes, for each user, SESSIONS sessions of TURNS turns each (``{NAME}-{user}-s{i}``),
   whose texts carry the marker word ``mk{name}{user}``, and one key-value memory
   ``{NAME}-fact`` per user; waits until PostgreSQL holds all of it (the replica outbox is
   empty); prints ``{"event": "replicated", ...}`` on stdout.
2. Waits for a line on stdin naming the gateways (space separated), then, for each user and
   each gateway, asks its prefetch for that gateway's marker and waits until the block
   holds it; prints ``{"event": "recalled", "blocks": {...}}`` and exits 0.

Logs go to stderr as JSON lines. Other settings come from the environment too (say,
``HERMES_MEMORY_POSTGRES_RECALL_JOBS=1``: its recalls become shared jobs that worker
processes answer).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import anyio

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.logs import configure_logging
from hermes_async_memory.memory import KeyValueMemory

WAIT_S = 60.0


def marker(gateway: str, user: str) -> str:
    return f"mk{gateway}{user}".lower()


async def main(name: str, db_path: str, users: list[str], sessions: int, turns: int) -> None:
    settings = Settings.from_env(db_path=Path(db_path), backend="postgres")
    async with MemoryPipeline(settings) as mem:
        kv = KeyValueMemory(mem)
        for i in range(turns):
            for user in users:
                for s in range(sessions):
                    mem.sync_turn(f"{marker(name, user)} {name} {user} s{s} turn {i}",
                                  f"noted {i}", session_id=f"{name}-{user}-s{s}",
                                  user_id=user)
        for user in users:
            kv.store_nowait(user, f"{name}-fact", f"{marker(name, user)} likes tea")
        await mem.flush(timeout=WAIT_S)
        with anyio.fail_after(WAIT_S):
            while True:
                mark = mem.change_mark()
                if (await mem.store.replica_counts("postgres")) == (0, 0):
                    break
                await mem.next_change(since=mark)
        print(json.dumps({"event": "replicated", "gateway": name}), flush=True)

        line = await anyio.to_thread.run_sync(sys.stdin.readline)
        gateways = line.split()
        blocks: dict[str, str] = {}
        for user in users:
            for g in gateways:
                session = f"recall-{name}-{user}-{g}"
                word = marker(g, user)
                mem.queue_prefetch(f"which turn says {word}", session_id=session,
                                   user_id=user)
                await mem.wait_until(
                    lambda s=session, u=user, w=word: w in mem.prefetch(session_id=s,
                                                                         user_id=u),
                    timeout=WAIT_S)
                blocks[f"{user}/{g}"] = mem.prefetch(session_id=session, user_id=user)
        print(json.dumps({"event": "recalled", "gateway": name, "blocks": blocks}), flush=True)


if __name__ == "__main__":
    configure_logging(json=True, level="warning")
    gateway, path, users_arg, n_sessions, n_turns = sys.argv[1:6]
    asyncio.run(main(gateway, path, users_arg.split(","), int(n_sessions), int(n_turns)))
