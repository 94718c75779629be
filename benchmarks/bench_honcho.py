"""HonchoBackend against a Honcho server that adds 50 ms to every call: HTTP calls per 1,000
turns, and the time to drain a backlog of 1,000 sessions x 20 turns, against a single worker
that makes one call per turn, measured in the same run.

The server is tests/fake_honcho.py (FastAPI under uvicorn, in a thread of this process, on
127.0.0.1): the real honcho-ai SDK talks to it over real HTTP, and every call waits 50 ms on
the server before it is handled, which stands in for the network and Honcho's own work.

Shapes, each on a fresh workspace:
- backlog: every turn handed to one ``write()`` (what a replicator draining its queue should
  do). Cold: the sessions are new, so each also costs one get-or-create call.
- steady: the same sessions, 20 more turns each, one ``write()``: sessions already known.
- pipeline: the same backlog accepted by a real MemoryPipeline (a SQLite file, Honcho as its
  replica backend), timed from the first sync_turn until Honcho holds every turn: the
  replicator reads its outbox table and hands over whole session backlogs per write.
- long sessions: 100 sessions x 100 turns, one ``write()``.
Baseline: one worker, one ``add_messages`` call per turn (its 2 messages), turn after turn, in
accept order. It is run on a sample of turns (at 50 ms a call, 20,000 turns would take 17
minutes) and its drain time is that per-turn time times the number of turns.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from _common import (
    Corpus,
    Result,
    TurnSpec,
    library_version,
    machine,
    make_turns,
    parser,
    print_table,
    quiet_logs,
    report,
)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hermes_async_memory.backends import HonchoBackend, HonchoConfig
from hermes_async_memory.turns import Turn
from tests.fake_honcho import FakeHoncho

LATENCY_S = 0.050
GOAL_CALLS_PER_1K = 30
GOAL_SPEEDUP = 50.0
TURNS_PER_SESSION = 20


def build_turns(specs: list[TurnSpec], tag: str, key_tag: str | None = None) -> list[Turn]:
    now = time.time()
    return [
        Turn.build(key=f"{key_tag or tag}-{i}", session_id=f"{tag}-{sid}", user_id=uid,
                   accepted_at=now,
                   messages=[("user", user, None, None, None),
                             ("assistant", assistant, None, None, None)], metadata=None)
        for i, (sid, uid, user, assistant) in enumerate(specs)
    ]


def config(fake: FakeHoncho, workspace: str) -> HonchoConfig:
    return HonchoConfig(base_url=fake.base_url, workspace_id=workspace)


async def timed_write(fake: FakeHoncho, workspace: str, batches: list[list[Turn]],
                      backend: HonchoBackend | None = None) -> tuple[float, int, HonchoBackend]:
    """Seconds and server-side HTTP calls to write ``batches``, one write() after another."""
    backend = backend or HonchoBackend(config(fake, workspace))
    await backend.startup()
    calls0 = fake.total_calls()
    t0 = time.perf_counter()
    for batch in batches:
        await backend.write(batch)
    elapsed = time.perf_counter() - t0
    return elapsed, fake.total_calls() - calls0, backend


async def pipeline_drain(fake: FakeHoncho, workspace: str, turns: list[Turn]
                         ) -> tuple[float, int]:
    """Seconds from the first accept until Honcho holds every turn, and the HTTP calls."""
    import tempfile

    from hermes_async_memory import MemoryPipeline, Settings

    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings(db_path=Path(tmp) / "memory.db")
        backend = HonchoBackend(config(fake, workspace))
        async with MemoryPipeline(settings, backend) as mem:
            calls0 = fake.total_calls()
            t0 = time.perf_counter()
            for i, t in enumerate(turns):
                mem.sync_turn(t.user_text, t.assistant_text, session_id=t.session_id,
                              user_id=t.user_id)
                if i % 100 == 99:
                    await asyncio.sleep(0)
            await mem.flush()
            while mem.stats().replicated_turns < len(turns):  # noqa: ASYNC110 - a count
                await asyncio.sleep(0.01)
            elapsed = time.perf_counter() - t0
            calls = fake.total_calls() - calls0
    return elapsed, calls


async def baseline(fake: FakeHoncho, turns: list[Turn]) -> tuple[float, int]:
    """One worker, one add_messages call per turn: seconds per turn, calls made."""
    from honcho import Honcho, MessageCreateParams, Session

    honcho = Honcho(base_url=fake.base_url, workspace_id="baseline", max_retries=0,
                    timeout=30.0)
    await honcho.aio.peer("hermes")  # the workspace and the assistant exist already
    sessions: dict[str, Any] = {}
    calls0 = fake.total_calls()
    t0 = time.perf_counter()
    for t in turns:
        session = sessions.get(t.session_id)
        if session is None:
            session = sessions[t.session_id] = Session(t.session_id, honcho)
        user = f"user-{t.user_id}"
        await session.aio.add_messages([
            MessageCreateParams(content=t.user_text, peer_id=user,
                                metadata={"turn_key": t.key, "turn_msg": 0}),
            MessageCreateParams(content=t.assistant_text, peer_id="hermes",
                                metadata={"turn_key": t.key, "turn_msg": 1})])
    elapsed = time.perf_counter() - t0
    return elapsed / len(turns), fake.total_calls() - calls0


def per_1k(calls: int, turns: int) -> float:
    return calls * 1000 / turns


async def main() -> list[Result]:
    args = parser(__doc__.splitlines()[0]).parse_args()
    quiet_logs()
    sessions = 250 if args.quick else 1_000
    sample = 100 if args.quick else 300
    long_sessions = 20 if args.quick else 100
    n = sessions * TURNS_PER_SESSION
    print(f"bench_honcho: {sessions:,} sessions x {TURNS_PER_SESSION} turns, server latency "
          f"{LATENCY_S * 1000:.0f} ms a call ({machine()}; library {library_version()})")
    corpus = Corpus()
    specs = make_turns(corpus, 2 * n + sample, sessions, seed=11)
    backlog = build_turns(specs[:n], "b")
    more = build_turns(specs[n:2 * n], "b", key_tag="m")  # the same sessions, new turns
    pipe = build_turns(specs[:n], "p")
    base_turns = build_turns(specs[2 * n:], "x")
    long_specs = make_turns(corpus, 2 * long_sessions * 100, long_sessions, seed=12)
    long_turns = build_turns(long_specs[:long_sessions * 100], "l")
    long_more = build_turns(long_specs[long_sessions * 100:], "l", key_tag="lm")

    fake = FakeHoncho(latency_s=LATENCY_S)
    fake.start()
    try:
        per_turn_s, base_calls = await baseline(fake, base_turns)
        base_drain = per_turn_s * n

        cold_s, cold_calls, backend = await timed_write(fake, "backlog", [backlog])
        steady_s, steady_calls, _ = await timed_write(fake, "backlog", [more], backend)
        stats = backend.stats()
        await backend.aclose()
        peak = fake.max_in_flight

        pipe_s, pipe_calls = await pipeline_drain(fake, "pipeline", pipe)
        long_s, long_calls, b3 = await timed_write(fake, "long", [long_turns])
        long_more_s, long_more_calls, _ = await timed_write(fake, "long", [long_more], b3)
        await b3.aclose()
    finally:
        fake.stop()

    rows = [
        ["baseline: 1 worker, 1 call a turn", f"{len(base_turns)} (sample)", base_calls,
         f"{per_1k(base_calls, len(base_turns)):.0f}", f"{base_drain:.1f} s (extrapolated)"],
        ["backlog, one write (cold)", n, cold_calls, f"{per_1k(cold_calls, n):.0f}",
         f"{cold_s:.2f} s"],
        ["steady, one write (sessions known)", n, steady_calls,
         f"{per_1k(steady_calls, n):.0f}", f"{steady_s:.2f} s"],
        ["pipeline: accept, commit, replicate", n, pipe_calls,
         f"{per_1k(pipe_calls, n):.0f}", f"{pipe_s:.2f} s"],
        [f"long sessions, {long_sessions} x 100 turns (cold)", len(long_turns), long_calls,
         f"{per_1k(long_calls, len(long_turns)):.1f}", f"{long_s:.2f} s"],
        ["long sessions, 100 more turns each (steady)", len(long_more), long_more_calls,
         f"{per_1k(long_more_calls, len(long_more)):.1f}", f"{long_more_s:.2f} s"],
    ]
    print_table(["shape", "turns", "HTTP calls", "calls / 1k turns", "drain"], rows)
    print(f"backend stats (backlog + steady): retries {stats.get('retries', 0)}, calls by route "
          f"{stats['calls_by_route']}; peak concurrent requests at the server {peak}")
    floor = 1000 / TURNS_PER_SESSION
    print(f"floor: Honcho's messages route is per session, so {TURNS_PER_SESSION} turns a "
          f"session cost at least {floor:.0f} calls per 1,000 turns")

    speedup = base_drain / cold_s
    calls_cold = per_1k(cold_calls, n)
    calls_steady = per_1k(steady_calls, n)
    results = [
        Result(
            f"Honcho drain through the pipeline, {sessions:,} sessions x {TURNS_PER_SESSION} "
            "turns, 50 ms/call (accept to replicated)",
            f"{pipe_s:.2f} s, {per_1k(pipe_calls, n):.0f} calls / 1k turns",
            f"1 call a turn, 1 worker {base_drain:.0f} s (from {len(base_turns)} turns)",
            f"{base_drain / pipe_s:.0f}x faster",
            f"≥ {GOAL_SPEEDUP:.0f}x",
            base_drain / pipe_s >= GOAL_SPEEDUP,
        ),
        Result(
            "HonchoBackend alone, the same backlog in one write() (cold)",
            f"{cold_s:.2f} s",
            f"1 call a turn, 1 worker {base_drain:.0f} s",
            f"{speedup:.0f}x faster",
            "—",
            None,
        ),
        Result(
            f"Honcho HTTP calls per 1,000 turns, {TURNS_PER_SESSION}-turn sessions "
            "(cold / steady; floor 50: one call per session)",
            f"{calls_cold:.0f} / {calls_steady:.0f}",
            f"1 call a turn: {per_1k(base_calls, len(base_turns)):.0f}",
            f"{per_1k(base_calls, len(base_turns)) / calls_steady:.0f}x fewer",
            f"≤ {GOAL_CALLS_PER_1K} (steady)",
            calls_steady <= GOAL_CALLS_PER_1K,
        ),
        Result(
            f"Honcho HTTP calls per 1,000 turns, {long_sessions} sessions x 100 turns "
            "(cold / steady)",
            f"{per_1k(long_calls, len(long_turns)):.1f} / "
            f"{per_1k(long_more_calls, len(long_more)):.1f}",
            "1 call a turn: 1000", "—", f"≤ {GOAL_CALLS_PER_1K} (steady)",
            per_1k(long_more_calls, len(long_more)) <= GOAL_CALLS_PER_1K,
        ),
    ]
    report(results, args.json)
    return results


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
