"""Many gateways, one memory: three gateway processes (tests/pg_gateway.py), each with its
own SQLite file, and two worker processes share one PostgreSQL database.

The gateways' recalls are shared jobs (``postgres_recall_jobs``) that the two workers
claim and answer.

Invariants, checked on every turn and every key-value write: each is stored in PostgreSQL
exactly once; each session's turns are in the order its gateway accepted them; each user's
recall, through any gateway, sees what every gateway wrote for that user and nothing of
another user's. The password of the DSN shows in no process's log line."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import asyncpg

from .pg_gateway import marker
from .pg_server import PostgresServer
from .processes import Spawn
from .test_postgres_backend import upgraded

GATEWAYS = ["ga", "gb", "gc"]
USERS = ["u0", "u1", "u2", "u3"]
SESSIONS = 3
TURNS = 30
TIMEOUT_S = 120.0
TURN_TEXT = re.compile(r"^mk\w+ (\w+) (\w+) s(\d+) turn (\d+)$")


async def test_three_gateways_and_two_workers_share_one_database(
        tmp_path: Path, pg_server: PostgresServer, pg_dsn: str, spawn: Spawn) -> None:
    await upgraded(pg_dsn)
    env = {"DATABASE_URL": pg_dsn, "HERMES_MEMORY_BACKEND": "postgres"}
    workers = [await spawn("-m", "workers", "--db", str(tmp_path / f"w{i}" / "memory.db"),
                           "--log-format", "json", env=env)
               for i in range(2)]
    gateways = [await spawn("-m", "tests.pg_gateway", g, str(tmp_path / g / "memory.db"),
                            ",".join(USERS), str(SESSIONS), str(TURNS),
                            env={**env, "HERMES_MEMORY_POSTGRES_RECALL_JOBS": "1"},
                            stdin=True)
                for g in GATEWAYS]
    for gw in gateways:
        assert (await gw.stdout_json(TIMEOUT_S))["event"] == "replicated"
    # Every gateway's writes are in the database: now each recalls every gateway's.
    for gw in gateways:
        await gw.send_line(" ".join(GATEWAYS))
    recalled = [await gw.stdout_json(TIMEOUT_S) for gw in gateways]
    for gw in gateways:
        assert await gw.finish(TIMEOUT_S) == 0
    for w in workers:
        w.signal(signal.SIGTERM)
        assert await w.finish(TIMEOUT_S) == 0
    # The gateways' recalls were shared jobs: the two workers answered all of them (each
    # gateway asks one per user and gateway), and each a job once.
    done = [(await w.log_line("worker_stopped"))["jobs"] for w in workers]
    asked = len(GATEWAYS) * len(USERS) * len(GATEWAYS)
    assert sum(d["completed"] for d in done) >= asked
    assert all(d["leases_lost"] == 0 and d["dead"] == 0 for d in done)

    conn = await asyncpg.connect(pg_dsn)
    try:
        rows = await conn.fetch(
            "SELECT session_id, user_id, seq, content FROM messages WHERE role = 'user' "
            "ORDER BY session_id, seq, ordinal")
        dupes = await conn.fetchval(
            "SELECT count(*) FROM (SELECT turn_key, ordinal FROM messages "
            "GROUP BY 1, 2 HAVING count(*) > 1) AS d")
        kv = await conn.fetch("SELECT user_id, key, value FROM memories ORDER BY 1, 2")
    finally:
        await conn.close()

    assert dupes == 0
    by_session: dict[str, list[int]] = {}
    for r in rows:
        m = TURN_TEXT.match(r["content"])
        assert m is not None, r["content"]
        gateway, user, s, turn = m.group(1), m.group(2), m.group(3), int(m.group(4))
        assert r["session_id"] == f"{gateway}-{user}-s{s}" and r["user_id"] == user
        by_session.setdefault(r["session_id"], []).append(turn)
    expected = {f"{g}-{u}-s{s}" for g in GATEWAYS for u in USERS for s in range(SESSIONS)}
    assert set(by_session) == expected
    for session, turns in by_session.items():
        assert turns == list(range(TURNS)), session  # every turn once, in accept order
    assert [(r["user_id"], r["key"], r["value"]) for r in kv] == [
        (u, f"{g}-fact", f"{marker(g, u)} likes tea") for u in USERS for g in GATEWAYS]

    for result in recalled:
        blocks = result["blocks"]
        assert set(blocks) == {f"{u}/{g}" for u in USERS for g in GATEWAYS}
        for key, block in blocks.items():
            user, gateway = key.split("/")
            assert marker(gateway, user) in block  # written through another gateway too
            others = [marker(g, u) for g in GATEWAYS for u in USERS if u != user]
            assert not any(word in block for word in others), (key, block)

    for proc in (*gateways, *workers):
        for text in (json.dumps(proc.logs), proc.stdout):
            pg_server.assert_no_password(text)
