"""Sustained turns/s into SQLite + FTS5 through the pipeline, against (a) a raw sqlite3 group
commit of the same rows into the same structures and (b) a store that opens a connection and
commits per call.

Turns: realistic chat messages, user and assistant 20-30 words each (~330 characters of text
a turn; ``_common.REALISTIC_WORDS``), over 1,000 interleaved sessions of 1,000 users.

Pipeline: N turns are accepted with sync_turn inside the running loop (yielding every 1,000
turns, so the writer commits while turns arrive), then flush() waits until all are committed
and recallable. Rate = N / (first accept → flush returns). Each accept also makes the turn
durable (an append to the memory-mapped outbox); the baseline has no such step.

What both sides write, per turn, into a store the library made (its schema as a start
leaves it: the same tables, indexes, FTS5 tables and migrations on both sides), exactly
what a pipeline commit writes (``store/batch.py``; ``_common.RAW_*``):
  - 2 rows into ``messages`` (session_id, turn_key, ordinal, role, content, timestamp,
    user_id, scope; tool columns, fields and metadata NULL), which keeps the index
    ``idx_messages_session(session_id, id)``;
  - the word index ``messages_fts(content, scope)`` (porter stems) filled once per
    transaction with ``INSERT … SELECT`` over the batch's new messages, and the tool index
    ``messages_tools`` the same way (empty here: no tool calls);
  - the message-id high mark (``message_id_high``), once per transaction;
  - 1 idempotency key into ``outbox`` (key, session_id, segment, status 'done', attempts,
    accepted_at, updated_at; a WITHOUT ROWID table keyed by the turn key);
  - its session's row in ``sessions``, with every column the commit's upsert sets:
    inserted on first sight, else updated_at and the counters bumped.
  The pipeline commits max_batch (2,000) turns per transaction while a backlog waits; (a)
  commits the same 2,000 per transaction. After each round the row counts of both stores are
  compared (messages, FTS documents, sessions and their message counts) and the script fails
  if they differ. Done keys are not compared: the pipeline's maintenance deletes those of
  outbox segments it has deleted (~30,000 turns a 16 MiB segment here), work the baseline
  does not do.

(a) Raw group commit: one sqlite3 connection, no asyncio, the pipeline writer's pragmas
    (WAL, synchronous=NORMAL, temp_store=MEMORY), executemany for sessions, messages and
    keys, one transaction per batch; building the row tuples from the
    texts is inside the timed work.
(b) Per-call store, like seed 000's LocalBackend: for every turn, sqlite3.connect(), upsert
    the session, insert the two messages (an AFTER INSERT trigger keeps the FTS index),
    commit, close. Run on fewer turns (it is slow) and compared by rate. Two variants:
    as the seed wrote it (SQLite defaults: rollback journal, synchronous=FULL, so an fsync
    per commit), and with WAL + synchronous=NORMAL (the durability the pipeline's own
    commits have), which is the kinder comparison.

Also printed: CPU per turn, the pipeline's split into its event-loop thread (accepting,
reading back, decoding, cache and bookkeeping: the Python work) and its other threads
(SQLite's, mostly), against the raw loop's one thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import sqlite3
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from _common import (
    FLUSH_TIMEOUT_S,
    REALISTIC_WORDS,
    Corpus,
    Result,
    TurnSpec,
    fmt_rate,
    library_version,
    machine,
    make_turns,
    open_raw,
    parser,
    print_table,
    quiet_logs,
    raw_group_commit,
    report,
    scratch_dir,
)

from hermes_async_memory import FlushTimeoutError, MemoryPipeline, Settings
from hermes_async_memory.store import SCHEMA
from hermes_async_memory.store.text_index import WORD_TABLE
from hermes_async_memory.turns import scope_tokens

GOAL_VS_RAW = 0.60
GOAL_VS_PER_CALL = 20.0
BUSY_TIMEOUT_S = 60.0
SESSIONS = 1_000
# Turns per transaction of the raw group commit: the pipeline's own batch size.
PER_TXN = Settings().max_batch
ROW_COUNTS = (
    ("messages", "SELECT count(*) FROM messages"),
    ("FTS documents", "SELECT count(*) FROM messages_fts_docsize"),
    ("sessions", "SELECT count(*) FROM sessions"),
    ("session message counts", "SELECT sum(message_count) FROM sessions"),
)

PER_CALL_TRIGGER = """
CREATE TRIGGER IF NOT EXISTS messages_fts_insert AFTER INSERT ON messages BEGIN
    INSERT INTO messages_fts (rowid, content, scope) VALUES (new.id, new.content, new.scope);
END;
"""
PER_CALL_SESSION = """
INSERT INTO sessions (id, source, user_id, started_at, updated_at, message_count)
VALUES (?, 'api', ?, ?, ?, 2)
ON CONFLICT (id) DO UPDATE SET updated_at = excluded.updated_at,
    message_count = sessions.message_count + 2
"""
PER_CALL_MESSAGE = """
INSERT INTO messages (session_id, turn_key, ordinal, role, content, timestamp, user_id, scope)
VALUES (?, ?, ?, ?, ?, ?, ?, ?)
"""


def process_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def row_counts(path: Path) -> tuple[int, ...]:
    conn = sqlite3.connect(path)
    try:
        return tuple(int(conn.execute(q).fetchone()[0] or 0) for _, q in ROW_COUNTS)
    finally:
        conn.close()


async def through_pipeline(
    path: Path, turns: list[TurnSpec]
) -> tuple[float, float, int, float, float]:
    """Seconds from the first accept to flush's return; seconds spent accepting; batches;
    CPU seconds of the loop thread and of the whole process meanwhile."""
    settings = Settings(db_path=path)
    async with MemoryPipeline(settings) as mem:
        # Warm-up: statements prepared, tables created, the first segment mapped.
        for sid, uid, user, assistant in turns[:1_000]:
            mem.sync_turn(user, assistant, session_id=sid, user_id=uid)
        await mem.flush(timeout=FLUSH_TIMEOUT_S)
        batches0 = mem.stats().batches_committed
        st = mem.sync_turn
        cpu0, loop0 = process_cpu_s(), time.thread_time()
        t0 = time.perf_counter()
        for i, (sid, uid, user, assistant) in enumerate(turns):
            st(user, assistant, session_id=sid, user_id=uid)
            if i % 1_000 == 999:
                await asyncio.sleep(0)
        t_accepted = time.perf_counter()
        await mem.flush(timeout=FLUSH_TIMEOUT_S)
        t1 = time.perf_counter()
        loop_cpu, cpu = time.thread_time() - loop0, process_cpu_s() - cpu0
        batches = mem.stats().batches_committed - batches0
    return t1 - t0, t_accepted - t0, batches, loop_cpu, cpu


@contextlib.contextmanager
def cpu_bound_thread() -> Iterator[None]:
    """Another Python thread in the process that never blocks (a busy host application)."""
    stop = threading.Event()

    def burn() -> None:
        while not stop.is_set():
            sum(range(2_000))

    th = threading.Thread(target=burn, name="cpu-bound", daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join()


async def pipeline_beside_busy_thread(
    path: Path, warm: list[TurnSpec], turns: list[TurnSpec]
) -> float:
    """Turns/s committed when the process also runs one CPU-bound Python thread."""
    async with MemoryPipeline(Settings(db_path=path)) as mem:
        for sid, uid, user, assistant in warm:
            mem.sync_turn(user, assistant, session_id=sid, user_id=uid)
        await mem.flush(timeout=FLUSH_TIMEOUT_S)
        before = mem.stats().committed_turns
        with cpu_bound_thread():
            t0 = time.perf_counter()
            for sid, uid, user, assistant in turns:
                mem.sync_turn(user, assistant, session_id=sid, user_id=uid)
            with contextlib.suppress(FlushTimeoutError):
                await mem.flush(timeout=BUSY_TIMEOUT_S)
            dt = time.perf_counter() - t0
            done = mem.stats().committed_turns - before
    return done / dt


def raw_beside_busy_thread(path: Path, warm: list[TurnSpec], turns: list[TurnSpec]) -> float:
    conn = open_raw(path)
    raw_group_commit(conn, warm, PER_TXN)
    with cpu_bound_thread():
        t0 = time.perf_counter()
        raw_group_commit(conn, turns, PER_TXN)
        dt = time.perf_counter() - t0
    conn.close()
    return len(turns) / dt


def raw(path: Path, turns: list[TurnSpec]) -> tuple[float, float]:
    """Seconds, and CPU seconds of its one thread."""
    conn = open_raw(path)
    raw_group_commit(conn, turns[:1_000], PER_TXN)  # the same warm-up as the pipeline gets
    cpu0 = time.thread_time()
    t0 = time.perf_counter()
    raw_group_commit(conn, turns, PER_TXN)
    dt = time.perf_counter() - t0
    cpu = time.thread_time() - cpu0
    conn.close()
    return dt, cpu


def per_call(path: Path, turns: list[TurnSpec], *, wal: bool) -> float:
    conn = sqlite3.connect(path)
    if wal:
        conn.execute("PRAGMA journal_mode = WAL")  # persistent in the file
    # The word index is made apart from SCHEMA (a SQLite without FTS5 runs without it).
    conn.executescript(SCHEMA + WORD_TABLE + PER_CALL_TRIGGER)
    conn.commit()
    conn.close()

    def store_turn(n: int, sid: str, uid: str | None, user: str, assistant: str) -> None:
        now = time.time()
        key = f"pc-{n:x}"
        scope = scope_tokens(uid, sid)
        conn = sqlite3.connect(path)
        try:
            if wal:
                conn.execute("PRAGMA synchronous = NORMAL")
            with conn:  # commits (or rolls back) the transaction, as in the seed
                conn.execute(PER_CALL_SESSION, (sid, uid, now, now))
                conn.execute(PER_CALL_MESSAGE, (sid, key, 0, "user", user, now, uid, scope))
                conn.execute(
                    PER_CALL_MESSAGE, (sid, key, 1, "assistant", assistant, now, uid, scope)
                )
        finally:
            conn.close()  # the seed leaves this to reference counting; same effect

    for i, (sid, uid, user, assistant) in enumerate(turns[:100]):
        store_turn(i, sid, uid, user, assistant)
    t0 = time.perf_counter()
    for i, (sid, uid, user, assistant) in enumerate(turns):
        store_turn(1_000 + i, sid, uid, user, assistant)
    return time.perf_counter() - t0


async def main() -> list[Result]:
    args = parser(__doc__.splitlines()[0]).parse_args()
    quiet_logs()
    n = 20_000 if args.quick else 100_000
    n_per_call = 500 if args.quick else 2_000
    n_busy = 500 if args.quick else 1_000
    print(
        f"bench_throughput: {n:,} turns over {SESSIONS:,} sessions; per-call store on "
        f"{n_per_call:,} turns ({machine()}; library {library_version()})"
    )
    corpus = Corpus()
    turns = make_turns(corpus, n, SESSIONS, seed=3, words=REALISTIC_WORDS)
    chars = sum(len(u) + len(a) for _, _, u, a in turns) / n
    print(f"realistic turns: {REALISTIC_WORDS[0]}-{REALISTIC_WORDS[1]} words a message, "
          f"{chars:.0f} characters of text a turn; raw group commit {PER_TXN:,} turns a "
          "transaction")

    reps = 1 if args.quick else 3
    pipe_s, raw_s, seed_s, wal_s, rounds = [], [], [], [], []
    cpu_rows = []
    with scratch_dir("throughput") as d:
        # Alternate the contenders, so a noisy moment of the machine hits them alike.
        for r in range(reps):
            t_pipe, t_accept, batches, loop_cpu, pipe_cpu = await through_pipeline(
                d / f"pipe{r}.db", turns)
            t_raw, raw_cpu = raw(d / f"raw{r}.db", turns)
            counts_pipe, counts_raw = row_counts(d / f"pipe{r}.db"), row_counts(d / f"raw{r}.db")
            if counts_pipe != counts_raw:
                raise SystemExit(
                    "the baseline does not write what the pipeline writes: "
                    + ", ".join(f"{name} {a:,} vs {b:,}" for (name, _), a, b
                                in zip(ROW_COUNTS, counts_pipe, counts_raw, strict=True)))
            t_seed = per_call(d / f"seed{r}.db", turns[:n_per_call], wal=False)
            t_wal = per_call(d / f"wal{r}.db", turns[:n_per_call], wal=True)
            pipe_s.append(t_pipe)
            raw_s.append(t_raw)
            seed_s.append(t_seed)
            wal_s.append(t_wal)
            rounds.append(
                [
                    r + 1,
                    fmt_rate(n / t_pipe),
                    f"{t_accept:.2f} s",
                    f"{batches:,}",
                    fmt_rate(n / t_raw),
                    f"{t_raw / t_pipe:.1%}",
                    fmt_rate(n_per_call / t_seed),
                    fmt_rate(n_per_call / t_wal),
                ]
            )
            cpu_rows.append(
                [
                    r + 1,
                    f"{1e6 * t_pipe / n:.1f}",
                    f"{1e6 * loop_cpu / n:.1f}",
                    f"{1e6 * (pipe_cpu - loop_cpu) / n:.1f}",
                    f"{1e6 * t_raw / n:.1f}",
                    f"{1e6 * raw_cpu / n:.1f}",
                ]
            )
    print_table(
        [
            "round",
            "pipeline",
            "of which accepting",
            "batches",
            "(a) raw group commit",
            "ratio",
            "(b) per-call, seed",
            "(b) per-call, WAL",
        ],
        rounds,
    )
    print("rows written, each round, by both sides: "
          + ", ".join(f"{name} {v:,}" for (name, _), v in zip(ROW_COUNTS, counts_raw,
                                                              strict=True)))
    print("µs per turn:")
    print_table(
        ["round", "pipeline wall", "loop thread CPU", "other threads CPU", "raw wall",
         "raw CPU"],
        cpu_rows,
    )

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    r_pipe, r_raw = n / median(pipe_s), n / median(raw_s)
    r_seed, r_wal = n_per_call / median(seed_s), n_per_call / median(wal_s)
    # Informative: the same, with one CPU-bound Python thread in the process.
    with scratch_dir("throughput-busy") as d:
        busy_turns = turns[1_000 : 1_000 + n_busy]
        busy_pipe = await pipeline_beside_busy_thread(d / "pipe.db", turns[:1_000], busy_turns)
        busy_raw = raw_beside_busy_thread(d / "raw.db", turns[:1_000], busy_turns)
    print(
        f"with one CPU-bound Python thread in the process ({n_busy:,} turns): pipeline "
        f"{fmt_rate(busy_pipe)}, raw group commit {fmt_rate(busy_raw)}"
    )
    print(
        f"medians of {reps} round(s), turns/s (rows/s = 2x): pipeline {fmt_rate(r_pipe)}, raw "
        f"{fmt_rate(r_raw)}, per-call seed {fmt_rate(r_seed)}, per-call WAL {fmt_rate(r_wal)}"
    )
    vs_raw, vs_seed, vs_wal = r_pipe / r_raw, r_pipe / r_seed, r_pipe / r_wal
    results = [
        Result(
            f"turns/s beside one CPU-bound Python thread ({n_busy:,} turns)",
            fmt_rate(busy_pipe),
            f"raw group commit {fmt_rate(busy_raw)}",
            f"{busy_pipe / busy_raw:.2f}x",
            "—",
            None,
        ),
        Result(
            "turns/s, pipeline vs raw sqlite3 group commit",
            fmt_rate(r_pipe),
            fmt_rate(r_raw),
            f"{vs_raw:.1%}",
            "≥ 60 %",
            vs_raw >= GOAL_VS_RAW,
            headline=True,
        ),
        Result(
            "turns/s, pipeline vs per-call store (seed 000 as written)",
            fmt_rate(r_pipe),
            fmt_rate(r_seed),
            f"{vs_seed:.1f}x",
            "≥ 20x",
            vs_seed >= GOAL_VS_PER_CALL,
        ),
        Result(
            "turns/s, pipeline vs per-call store (WAL + NORMAL)",
            fmt_rate(r_pipe),
            fmt_rate(r_wal),
            f"{vs_wal:.1f}x",
            "≥ 20x",
            vs_wal >= GOAL_VS_PER_CALL,
        ),
    ]
    for r in results:
        print(f"{r.benchmark}: {r.ratio} (goal {r.goal}): {r.verdict}")
    report(results, args.json)
    return results


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
