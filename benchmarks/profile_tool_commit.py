"""Where a tool turn's commit spends the store thread's time: one 1,000-turn batch of
bench_procedural's tool turns (8 messages, 5 calls each), its statements replayed one by
one, each timed, on a copy of the store it was committed into.

A pipeline with ``tool_log=True`` commits 3,000 warm-up turns, then the next batch of 1,000
is caught as the writer builds it: the statements its transaction would run (the same
text, with the outcomes the loop judged) and the store file just before. Each round opens
a transaction, runs every statement with the clock around it, and rolls back, so every
round starts from the same store. Printed: each statement's median over the rounds, per
turn, and their sum. Informative, no goal: it says which statement to look at, the way a
sampling profiler cannot (inside SQLite's thread, all of a statement is one C call).
``--judge-in-commit`` replays the batch as the commit judged its answers before issue 28:
the outcome function called inside the transaction for all of them.
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
import statistics
import time
from pathlib import Path
from typing import Any

from _common import (
    FLUSH_TIMEOUT_S,
    Corpus,
    library_version,
    machine,
    parser,
    quiet_logs,
    scratch_dir,
)
from bench_procedural import make_tool_turns

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.procedural.extract import OutcomeRules
from hermes_async_memory.store import messages as store_messages
from hermes_async_memory.store.sql import single_statements
from hermes_async_memory.store.tool_log import (
    AWAITING_FUNCTION,
    JUDGE,
    OUTCOME_FUNCTION,
    TEMP_TABLES,
    outcome_function,
)

BATCH = 1_000
WARM = 3_000


async def capture(d: Path) -> list[str]:
    """The statements of one ``BATCH``-turn commit; the store before it in d/before.db."""
    caught: list[list[str]] = []
    commit_batch = store_messages.Messages.commit_batch

    async def catching(self: Any, batch: Any) -> None:
        if not caught and len(batch) >= BATCH * 9 // 10 and self.tool_log is not None:
            script = batch.statements(replica=self.replica, replica_kv=self.replica_kv,
                                      replica_templates=self.replica_templates,
                                      now=self.now(), tool_log=self.tool_log)
            head, tail = store_messages.INSERT_MESSAGES.split("{turns}")
            first = "".join([head, *batch.literal_parts(), tail])
            caught.append([first] + [s for text in script for s in single_statements(text)])
            await self.writer.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            shutil.copy(self.path, d / "before.db")
        await commit_batch(self, batch)

    corpus = Corpus()
    warm = make_tool_turns(corpus, WARM, 1_000, seed=4)
    turns = make_tool_turns(corpus, BATCH, 1_000, seed=3)
    store_messages.Messages.commit_batch = catching  # type: ignore[method-assign]
    try:
        # The whole batch in one commit, whatever the default batch size in bytes.
        settings = Settings(db_path=d / "m.db", tool_log=True, max_batch=BATCH,
                            max_batch_bytes=16 * 1024 * 1024)
        async with MemoryPipeline(settings) as mem:
            for sid, uid, user, answer, messages in warm:
                mem.sync_turn(user, answer, session_id=sid, user_id=uid, messages=messages)
            await mem.flush(timeout=FLUSH_TIMEOUT_S)
            for sid, uid, user, answer, messages in turns:
                mem.sync_turn(user, answer, session_id=sid, user_id=uid, messages=messages)
            await mem.flush(timeout=FLUSH_TIMEOUT_S)
    finally:
        store_messages.Messages.commit_batch = commit_batch  # type: ignore[method-assign]
    if not caught:
        raise SystemExit(f"no batch of {BATCH:,} turns was committed")
    return caught[0]


def judged_in_commit(statements: list[str]) -> list[str]:
    """The statements with the batch's answers judged by the function in the transaction."""
    out = []
    for s in statements:
        if "INSERT INTO temp.tool_answer_outcomes (id, o)\nSELECT e.value ->> 0" in s:
            continue  # the loop's outcomes: not there
        out.append(s.replace(", 0 FROM messages AS t", ", 1 FROM messages AS t"))
    if not any(OUTCOME_FUNCTION in s for s in out):
        at = next(i for i, s in enumerate(out) if "INSERT INTO tool_calls (" in s)
        out.insert(at, JUDGE)
    return out


def label(statement: str) -> str:
    return " ".join(statement.split())[:72]


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--judge-in-commit", action="store_true")
    args = ap.parse_args()
    quiet_logs()
    rounds = 3 if args.quick else 9
    print(f"profile_tool_commit: one {BATCH:,}-turn batch of tool turns, {rounds} replays "
          f"({machine()}; library {library_version()})")
    with scratch_dir("profile-tool-commit") as d:
        statements = asyncio.run(capture(d))
        if args.judge_in_commit:
            statements = judged_in_commit(statements)
        shutil.copy(d / "before.db", d / "replay.db")
        conn = sqlite3.connect(d / "replay.db", isolation_level=None)
        for pragma in ("journal_mode = WAL", "synchronous = NORMAL", "temp_store = MEMORY"):
            conn.execute(f"PRAGMA {pragma}")
        conn.create_function(OUTCOME_FUNCTION, 1, outcome_function(OutcomeRules()))
        conn.create_function(AWAITING_FUNCTION, 1, lambda value: None)
        conn.executescript(TEMP_TABLES)
        times: dict[int, list[float]] = {i: [] for i in range(len(statements))}
        for _ in range(rounds):
            conn.execute("BEGIN IMMEDIATE")
            for i, s in enumerate(statements):
                a = time.perf_counter()
                conn.execute(s).fetchall()
                times[i].append(time.perf_counter() - a)
            conn.execute("ROLLBACK")
        conn.close()
    medians = {i: statistics.median(v) for i, v in times.items()}
    total = sum(medians.values())
    print(f"{'µs a turn':>10}  {'share':>6}  statement")
    for i, m in sorted(medians.items(), key=lambda kv: -kv[1])[:12]:
        name = "INSERT INTO messages (the batch's turns)" if i == 0 else label(statements[i])
        print(f"{m * 1e6 / BATCH:10.1f}  {m / total:6.1%}  {name}")
    print(f"{total * 1e6 / BATCH:10.1f}  100.0%  all {len(statements)} statements "
          "(the sum of their medians)")


if __name__ == "__main__":
    main()
