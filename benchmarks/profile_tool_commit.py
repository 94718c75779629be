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


async def capture(d: Path) -> tuple[list[str], list[str]]:
    """The statements of one ``BATCH``-turn commit, as the writer runs them and as it would
    run them logging its calls the SQL way (``tool_log.INSERT_CALLS``, not the rows worked
    out on the loop); the store before it in d/before.db."""
    caught: list[list[str]] = []
    commit_batch = store_messages.Messages.commit_batch

    async def catching(self: Any, batch: Any) -> None:
        if not caught and len(batch) >= BATCH * 9 // 10 and self.tool_log is not None:
            head, tail = store_messages.INSERT_MESSAGES.split("{turns}")
            first = "".join([head, *batch.literal_parts(), tail])
            for sql_way in (False, True):
                log_sql, batch._log_sql = batch._log_sql, sql_way or batch._log_sql
                script = batch.statements(replica=self.replica, replica_kv=self.replica_kv,
                                          replica_templates=self.replica_templates,
                                          now=self.now(), tool_log=self.tool_log)
                batch._log_sql = log_sql
                caught.append([first] + [s for text in script
                                         for s in single_statements(text)])
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
    return caught[0], caught[1]


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


def is_log(statement: str) -> bool:
    """Whether a statement is the tool log's (its tables, temporary ones, its function)."""
    return any(name in statement for name in (
        "tool_calls (", "tool_calls SET", "temp.tool_", "tool_log_counts", AWAITING_FUNCTION))


def replay(path: Path, statements: list[str]) -> list[float]:
    """Seconds each statement took, the batch's transaction run once and rolled back."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        for pragma in ("journal_mode = WAL", "synchronous = NORMAL", "temp_store = MEMORY"):
            conn.execute(f"PRAGMA {pragma}")
        conn.create_function(OUTCOME_FUNCTION, 1, outcome_function(OutcomeRules()))
        conn.create_function(AWAITING_FUNCTION, 1, lambda value: None)
        conn.executescript(TEMP_TABLES)
        conn.execute("BEGIN IMMEDIATE")
        out = []
        for s in statements:
            a = time.perf_counter()
            conn.execute(s).fetchall()
            out.append(time.perf_counter() - a)
        conn.execute("ROLLBACK")
        return out
    finally:
        conn.close()


def main() -> None:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--judge-in-commit", action="store_true")
    args = ap.parse_args()
    quiet_logs()
    rounds = 3 if args.quick else 9
    print(f"profile_tool_commit: one {BATCH:,}-turn batch of tool turns, {rounds} replays "
          f"of each way, alternating ({machine()}; library {library_version()})")
    with scratch_dir("profile-tool-commit") as d:
        loop_way, sql_way = asyncio.run(capture(d))
        if args.judge_in_commit:
            loop_way = sql_way = judged_in_commit(sql_way)
        ways = {"loop": loop_way, "sql": sql_way}
        times: dict[str, list[list[float]]] = {"loop": [], "sql": []}
        for r in range(rounds):
            for way in (("loop", "sql") if r % 2 == 0 else ("sql", "loop")):
                shutil.copy(d / "before.db", d / "replay.db")
                for suffix in ("-wal", "-shm"):
                    (d / f"replay.db{suffix}").unlink(missing_ok=True)
                times[way].append(replay(d / "replay.db", ways[way]))
    statements = ways["loop"]
    medians = [statistics.median(r[i] for r in times["loop"]) for i in range(len(statements))]
    total = sum(medians)
    print(f"{'µs a turn':>10}  {'share':>6}  statement")
    for i, m in sorted(enumerate(medians), key=lambda kv: -kv[1])[:12]:
        name = "INSERT INTO messages (the batch's turns)" if i == 0 else label(statements[i])
        print(f"{m * 1e6 / BATCH:10.1f}  {m / total:6.1%}  {name}")
    print(f"{total * 1e6 / BATCH:10.1f}  100.0%  all {len(statements)} statements "
          "(the sum of their medians)")
    # The store's thread is what a tool turn's commit waits on: its time without the log's
    # statements over its time with them is the committed rate the log leaves.
    print("the log's statements, a turn (medians of the rounds' sums):")
    for way, label_ in (("loop", "rows worked out on the loop"),
                        ("sql", "calls read out of the JSON in SQL")):
        log_s = statistics.median(sum(t for s, t in zip(ways[way], r, strict=True)
                                      if is_log(s)) for r in times[way])
        rest = statistics.median(sum(t for s, t in zip(ways[way], r, strict=True)
                                     if not is_log(s)) for r in times[way])
        print(f"  {label_}: {log_s * 1e6 / BATCH:.1f} µs of {(log_s + rest) * 1e6 / BATCH:.1f}"
              f" µs; without them / with them: {rest / (rest + log_s):.1%}")


if __name__ == "__main__":
    main()
