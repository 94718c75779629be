"""PostgreSQL as the shared store (issue 12): turns/s through three gateways against one
client writing the same rows, and recall latency at 1,000,000 messages over 1,000 users.

The server is a real PostgreSQL 15, started for the run the way the tests start theirs
(``tests/pg_server.py``: initdb and pg_ctl under a temporary folder, on 127.0.0.1, as the
``postgres`` account when run as root) and removed at the end. It has the tests'
settings: fsync, synchronous_commit and full_page_writes off, so commits cost CPU, not
the disk; every contender writes to the same server with the same settings. Each
contender gets a database of its own, with the library's schema (``postgres.upgrade``).

1. Sustained turns/s into PostgreSQL through three gateways. A gateway is a
   ``MemoryPipeline`` with ``backend="postgres"`` and its own SQLite file, in its own OS
   process (multiprocessing, spawn). Each accepts N turns with ``sync_turn`` (20-30-word
   messages, 1,000 sessions of its own over 1,000 users shared by all three) as fast as it
   can, after a warm-up of 500 turns that is replicated before the clock starts. Time runs
   from the first gateway's first accept to the last gateway's last turn replicated
   (``stats().replicated_turns``, waited for at each change the pipeline makes), and the
   database's row counts are checked afterwards. Baselines, each in its own database
   holding the same warm-up rows, one asyncpg connection, the same turns in transactions of
   the replicator's largest write (``REPLICA_TURNS``), building the rows inside the timed
   work:
   (a) the transaction the backend runs for plain turns: sessions upsert, ``COPY`` into
       the staging table, ``INSERT … SELECT … ON CONFLICT DO NOTHING RETURNING``,
       counters, ``pg_notify`` (the statements of ``postgres.statements``);
   (b) ``executemany`` of ``INSERT … ON CONFLICT DO NOTHING`` into messages, with the same
       sessions upsert, counters and notify, seq numbered by the client;
   (c) plain ``COPY`` into messages only (no sessions, no idempotency check): a floor.
   (a) and (b) write what the gateways write (checked: messages, sessions, counters); the
   goal (≥ 0.6) is judged against the faster of them. (c) is informative.

2. Recall p50/p99 with 1,000,000 messages over 1,000 users (``--quick``: 100,000). The
   rows are loaded fast: the messages table's secondary indexes and unique constraint are
   dropped, the rows ``COPY``-ed in (text from a Zipf-like vocabulary, _common.Corpus; the
   scope column from ``turns.scope_tokens``; users interleaved through the heap, as turns
   arrive), then the same indexes made again from their saved definitions, then
   ``VACUUM ANALYZE``. Each query is 2-3 words: one of the user's topic words and one or
   two drawn from the Zipf distribution (so most queries hold a common word, "the"...).
   Library: ``postgres.recall.recall_block`` (the backend's recall, scoped by the user's
   token in the tsvector, LIMIT 5, rendered). Baseline: the same terms, unscoped,
   ``WHERE search @@ q ORDER BY ts_rank(search, q) DESC LIMIT 5`` over all messages; it
   ranks every match, so it runs within a time budget and its sample count is printed.

3. Write-to-visible latency across machines: gateway A accepts a turn (``sync_turn``);
   how long until gateway B's ``prefetch`` shows it, with no request of B's in between. Two
   pipelines, each with its own SQLite file and its own connections, in this one process
   (so both share its event loop, as they would not on two machines). Each sample is a new
   user, for whom B has a cached block (its recall asked for the sample's word and found
   nothing); the path: A's local commit, its replicator's write to PostgreSQL, the NOTIFY
   at commit, B's LISTEN, B's refresh recall from PostgreSQL, B's cache. Baseline: the
   database's own floor, an INSERT and NOTIFY committed by one client until a LISTENing
   connection receives it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import random
import resource
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import asyncpg
import structlog
from _common import (
    FLUSH_TIMEOUT_S,
    REALISTIC_WORDS,
    Corpus,
    Result,
    TurnSpec,
    fmt_ns,
    fmt_rate,
    library_version,
    machine,
    make_turns,
    now_ns,
    parser,
    print_table,
    quiet_logs,
    report,
    scratch_dir,
    summary,
)

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.backends.base import RecallRequest
from hermes_async_memory.postgres import open_pool, upgrade
from hermes_async_memory.postgres.backend import PostgresBackend
from hermes_async_memory.postgres.notices import MAX_NOTIFY_BYTES, WRITES_CHANNEL
from hermes_async_memory.postgres.recall import TEXT_CHARS, recall_block
from hermes_async_memory.postgres.statements import (
    ADD_COUNTERS,
    INSERT_MESSAGES,
    STAGE,
    STAGE_COLUMNS,
    UPSERT_SESSIONS,
)
from hermes_async_memory.recall.query import query_terms
from hermes_async_memory.replicator import REPLICA_TURNS
from hermes_async_memory.turns import scope_tokens

# The tests' server (tests/pg_server.py): importable once the repository root is on the path.
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(1, str(REPO_ROOT))
from tests.pg_server import PostgresServer, PostgresUnavailable  # noqa: E402

GOAL_VS_DIRECT = 0.60
GATEWAYS = 3
SESSIONS_PER_GATEWAY = 1_000
WARM_TURNS = 500
WARM_SESSIONS = 100
GATEWAY_SEED = 12_000
# A gateway process that is not ready (pipeline started, warm-up replicated) by then failed.
READY_TIMEOUT_S = 180.0
SOURCE = Settings().source
CORES = os.cpu_count() or 1

RECALL_USERS = 1_000
RECALL_SESSIONS_PER_USER = 5
RECALL_LIMIT = Settings().recall_limit
LOAD_CHUNK_ROWS = 100_000
LOAD_SPAN_S = 100 * 86_400.0  # the loaded messages' timestamps span 100 days
LOAD_COLUMNS = ("session_id", "seq", "turn_key", "ordinal", "role", "content", "timestamp",
                "user_id", "scope")
# Words of rank at most this are "common" in the query mix's description.
COMMON_RANK = 100
# A recall that finds nothing is fast and useless: below this hit rate the run is invalid.
MIN_HIT_RATE = 0.9

INSERT_ROW = """
INSERT INTO messages (session_id, seq, turn_key, ordinal, role, content, timestamp, user_id,
                      scope)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
ON CONFLICT (turn_key, ordinal) DO NOTHING
"""
# The baseline of the recall: the same terms, every user's messages, ranked.
UNSCOPED = """
SELECT id, session_id, role, timestamp, left(content, {chars}) AS content
FROM messages
WHERE search @@ ({terms})
ORDER BY ts_rank(search, {terms}) DESC, id DESC
LIMIT $1
"""
# The messages table's indexes other than its primary key and those of its constraints,
# and its UNIQUE constraints: dropped for the bulk load, then made again as they were.
SECONDARY_INDEXES = """
SELECT c.relname AS name, pg_get_indexdef(c.oid) AS definition
FROM pg_index AS x JOIN pg_class AS c ON c.oid = x.indexrelid
WHERE x.indrelid = 'messages'::regclass AND NOT x.indisprimary
  AND NOT EXISTS (SELECT 1 FROM pg_constraint AS k WHERE k.conindid = x.indexrelid)
"""
UNIQUE_CONSTRAINTS = """
SELECT conname AS name, pg_get_constraintdef(oid) AS definition
FROM pg_constraint WHERE conrelid = 'messages'::regclass AND contype = 'u'
"""
ROW_COUNTS = """
SELECT (SELECT count(*) FROM messages) AS messages,
       (SELECT count(*) FROM sessions) AS sessions,
       (SELECT coalesce(sum(message_count), 0) FROM sessions) AS counted
"""


# -- the server and its databases --------------------------------------------------------


@contextmanager
def postgres_server() -> Iterator[PostgresServer]:
    """A PostgreSQL 15 server for this run, stopped and removed afterwards (its watchdog
    does it too if this process dies first)."""
    try:
        server = PostgresServer.create()
    except PostgresUnavailable as exc:
        raise SystemExit(f"bench_postgres: {exc}") from None
    try:
        server.start()
        yield server
    finally:
        server.cleanup()


async def new_database(server: PostgresServer, prefix: str) -> str:
    """A new database with the library's schema; its DSN (as the application's role)."""
    dsn = await asyncio.to_thread(server.create_database, prefix)
    async with open_pool(Settings(postgres_dsn=dsn, postgres_pool_max_size=1)) as pool:
        await upgrade(pool)
    return dsn


async def drop_database(server: PostgresServer, dsn: str) -> None:
    name = unquote(urlsplit(dsn).path.lstrip("/"))
    await asyncio.to_thread(server.sql, f'DROP DATABASE "{name}" WITH (FORCE)')


async def row_counts(dsn: str) -> tuple[int, int, int]:
    """Messages, sessions, and the sessions' message counters summed."""
    conn = await asyncpg.connect(dsn)
    try:
        r = await conn.fetchrow(ROW_COUNTS)
    finally:
        await conn.close()
    assert r is not None
    return int(r["messages"]), int(r["sessions"]), int(r["counted"])


def jiffies() -> tuple[int, int]:
    """(busy, total) CPU jiffies of the whole machine since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    return (after[0] - before[0]) / max(1, after[1] - before[1])


def process_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


# -- 1. turns/s through three gateways ----------------------------------------------------


def gateway_turns(corpus: Corpus, g: int, n: int) -> tuple[list[TurnSpec], list[TurnSpec]]:
    """Gateway ``g``'s warm-up turns and measured turns: sessions of its own (prefixed),
    users shared with the other gateways. The parent builds the same lists for the
    baselines."""

    def own(turns: list[TurnSpec], tag: str) -> list[TurnSpec]:
        return [(f"gw{g}-{tag}{sid}", uid, user, assistant)
                for sid, uid, user, assistant in turns]

    warm = make_turns(corpus, WARM_TURNS, WARM_SESSIONS, seed=GATEWAY_SEED + 100 + g,
                      words=REALISTIC_WORDS)
    turns = make_turns(corpus, n, SESSIONS_PER_GATEWAY, seed=GATEWAY_SEED + g,
                       words=REALISTIC_WORDS)
    return own(warm, "warm-"), own(turns, "")


def capture_backend_writes() -> list[tuple[int, float]]:
    """Logging for a gateway process: the backend's ``postgres_write`` lines are kept as
    (records, duration in ms) for the report; warnings and errors go to stderr as JSON;
    the rest is dropped."""
    writes: list[tuple[int, float]] = []
    render = structlog.processors.JSONRenderer()

    def keep(logger: Any, method: str, event: Any) -> Any:
        if event.get("event") == "postgres_write":
            writes.append((int(event["records"]), float(event["duration_ms"])))
        elif method in ("warning", "error", "critical", "exception"):
            return render(logger, method, {**event, "level": method, "gateway": os.getpid()})
        raise structlog.DropEvent

    structlog.configure(
        processors=[keep],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    return writes


async def replicated(mem: MemoryPipeline, total: int) -> None:
    """Until the pipeline's replicator has written ``total`` turns to PostgreSQL, checked at
    each change the pipeline makes (a replica write is one)."""
    await mem.wait_until(lambda: mem.stats().replicated_turns >= total,
                         timeout=FLUSH_TIMEOUT_S)


async def run_gateway(g: int, dsn: str, folder: Path, n: int, go: Any, out: Any
                      ) -> dict[str, Any]:
    writes = capture_backend_writes()
    warm, turns = gateway_turns(Corpus(), g, n)
    settings = Settings(db_path=folder / f"gateway{g}.db", backend="postgres",
                        postgres_dsn=dsn)
    async with MemoryPipeline(settings) as mem:
        st = mem.sync_turn
        for sid, uid, user, assistant in warm:
            st(user, assistant, session_id=sid, user_id=uid)
        await mem.flush(timeout=FLUSH_TIMEOUT_S)
        await replicated(mem, len(warm))
        writes.clear()
        out.put(("ready", g, None))
        if not await asyncio.to_thread(go.wait, READY_TIMEOUT_S):
            raise TimeoutError("no start signal")
        cpu0 = process_cpu_s()
        t_first = time.monotonic()
        for i, (sid, uid, user, assistant) in enumerate(turns):
            st(user, assistant, session_id=sid, user_id=uid)
            if i % 1_000 == 999:
                await asyncio.sleep(0)
        t_accepted = time.monotonic()
        await mem.flush(timeout=FLUSH_TIMEOUT_S)
        t_committed = time.monotonic()
        await replicated(mem, len(warm) + n)
        t_replicated = time.monotonic()
        cpu = process_cpu_s() - cpu0
        pending, dead = await mem.store.replica_counts("postgres")
        stats = mem.stats()
    if pending or dead or stats.replica_errors:
        raise RuntimeError(f"gateway {g}: {pending} turns pending, {dead} dead, "
                           f"{stats.replica_errors} replica errors after the drain")
    return {"first": t_first, "accepted": t_accepted, "committed": t_committed,
            "replicated": t_replicated, "cpu": cpu, "writes": list(writes),
            "batches": stats.batches_committed}


def gateway_process(g: int, dsn: str, folder: str, n: int, go: Any, out: Any) -> None:
    """A gateway's process (spawned): its pipeline, its turns, then its report on ``out``."""
    try:
        out.put(("done", g, asyncio.run(run_gateway(g, dsn, Path(folder), n, go, out))))
    except BaseException:
        out.put(("error", g, traceback.format_exc()))


@dataclass
class GatewayRun:
    seconds: float
    busy: float  # share of the machine's CPUs busy meanwhile (PostgreSQL included)
    reports: list[dict[str, Any]]
    counts: tuple[int, int, int]

    @property
    def own_cpu(self) -> float:
        return float(sum(r["cpu"] for r in self.reports))


async def through_gateways(server: PostgresServer, folder: Path, n: int) -> GatewayRun:
    dsn = await new_database(server, "gateways")
    ctx = multiprocessing.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=gateway_process, name=f"gateway{g}",
                         args=(g, dsn, str(folder), n, go, out)) for g in range(GATEWAYS)]
    reports: dict[int, dict[str, Any]] = {}

    async def expect(kind: str) -> None:
        for _ in range(GATEWAYS):
            what, g, data = await asyncio.to_thread(out.get, True, READY_TIMEOUT_S
                                                    if kind == "ready" else FLUSH_TIMEOUT_S)
            if what == "error":
                raise RuntimeError(f"gateway {g} failed:\n{data}")
            if what != kind:
                raise RuntimeError(f"gateway {g} said {what!r}, expected {kind!r}")
            if kind == "done":
                reports[g] = data

    for p in procs:
        p.start()
    try:
        await expect("ready")
        j0 = jiffies()
        go.set()
        await expect("done")
        j1 = jiffies()
    except BaseException:
        for p in procs:
            if p.is_alive():
                p.terminate()  # only the gateway processes started here, by their handle
        raise
    finally:
        for p in procs:
            await asyncio.to_thread(p.join, 60)
    ordered = [reports[g] for g in range(GATEWAYS)]
    seconds = max(r["replicated"] for r in ordered) - min(r["first"] for r in ordered)
    counts = await row_counts(dsn)
    await drop_database(server, dsn)
    return GatewayRun(seconds, busy_share(j0, j1), ordered, counts)


@dataclass
class _Batch:
    """One transaction's rows, as one client builds them from the turns."""

    sessions: dict[str, list[Any]] = field(default_factory=dict)
    keys: list[tuple[str, str]] = field(default_factory=list)  # (turn key, session)


class DirectClient:
    """One asyncpg connection writing turns straight to PostgreSQL (the baselines)."""

    def __init__(self, conn: asyncpg.Connection[Any]) -> None:
        self.conn = conn
        self.prefix = os.urandom(6).hex()
        self.n = 0
        self.seq: Counter[str] = Counter()  # the last seq of each session (plain writers)

    def _key(self) -> str:
        self.n += 1
        return f"{self.prefix}-{self.n:x}"

    def _sessions(self, batch: _Batch, sid: str, uid: str | None, at: float) -> None:
        row = batch.sessions.get(sid)
        if row is None:
            batch.sessions[sid] = [SOURCE, uid, None, None, at, at]
        else:
            row[5] = at

    async def _upsert_sessions(self, batch: _Batch) -> None:
        ids = sorted(batch.sessions)
        await self.conn.execute(UPSERT_SESSIONS, ids, *(
            [batch.sessions[i][k] for i in ids] for k in range(6)))

    async def _counters(self, batch: _Batch, inserted: set[str] | None) -> set[str]:
        """Add two messages a turn inserted (all of them when ``inserted`` is None) to
        its session's counter; the users written."""
        totals: Counter[str] = Counter()
        for key, sid in batch.keys:
            if inserted is None or key in inserted:
                totals[sid] += 2
        ids = list(totals)
        zeros = [0] * len(ids)
        await self.conn.execute(ADD_COUNTERS, ids, [totals[i] for i in ids], zeros, zeros,
                                zeros)
        return {batch.sessions[i][1] for i in ids if batch.sessions[i][1]}

    async def _notify(self, users: set[str]) -> None:
        """The backend's notice of the users written (sent at commit): "all" past the size
        a notification may have."""
        payload = json.dumps({"origin": self.prefix, "users": sorted(users), "sessions": []},
                             separators=(",", ":"))
        if len(payload.encode()) > MAX_NOTIFY_BYTES:
            payload = json.dumps({"origin": self.prefix, "all": True}, separators=(",", ":"))
        await self.conn.execute("SELECT pg_notify($1, $2)", WRITES_CHANNEL, payload)

    async def staged(self, turns: Sequence[TurnSpec]) -> None:
        """(a) The backend's transaction, with its statements."""
        conn = self.conn
        batch = _Batch()
        rows: list[tuple[Any, ...]] = []
        ranks: Counter[str] = Counter()
        at = time.time()
        for sid, uid, user, assistant in turns:
            key = self._key()
            scope = scope_tokens(uid, sid)
            ranks[sid] += 1
            rank = ranks[sid]
            self._sessions(batch, sid, uid, at)
            batch.keys.append((key, sid))
            rows.append((len(rows), sid, rank, key, 0, "user", user, None, None, None, at,
                         uid, scope, None, None))
            rows.append((len(rows), sid, rank, key, 1, "assistant", assistant, None, None,
                         None, at, uid, scope, None, None))
        async with conn.transaction():
            await conn.execute(STAGE)
            await self._upsert_sessions(batch)
            await conn.execute("DELETE FROM hermes_stage")
            await conn.copy_records_to_table("hermes_stage", records=rows,
                                             columns=STAGE_COLUMNS)
            inserted = {r["turn_key"] for r in await conn.fetch(INSERT_MESSAGES)}
            users = await self._counters(batch, inserted)
            await self._notify(users)

    def _message_rows(self, turns: Sequence[TurnSpec], batch: _Batch) -> list[tuple[Any, ...]]:
        rows = []
        at = time.time()
        for sid, uid, user, assistant in turns:
            key = self._key()
            scope = scope_tokens(uid, sid)
            self.seq[sid] += 1
            seq = self.seq[sid]
            self._sessions(batch, sid, uid, at)
            batch.keys.append((key, sid))
            rows.append((sid, seq, key, 0, "user", user, at, uid, scope))
            rows.append((sid, seq, key, 1, "assistant", assistant, at, uid, scope))
        return rows

    async def executemany(self, turns: Sequence[TurnSpec]) -> None:
        """(b) The same rows by ``executemany``, seq numbered here."""
        conn = self.conn
        batch = _Batch()
        rows = self._message_rows(turns, batch)
        async with conn.transaction():
            await self._upsert_sessions(batch)
            await conn.executemany(INSERT_ROW, rows)
            users = await self._counters(batch, None)
            await self._notify(users)

    async def plain_copy(self, turns: Sequence[TurnSpec]) -> None:
        """(c) COPY straight into messages: no sessions, no idempotency check."""
        rows = self._message_rows(turns, _Batch())
        await self.conn.copy_records_to_table("messages", records=rows, columns=LOAD_COLUMNS)


BASELINES: dict[str, Callable[[DirectClient], Callable[[Sequence[TurnSpec]], Any]]] = {
    "staged COPY": lambda c: c.staged,
    "executemany": lambda c: c.executemany,
    "plain COPY": lambda c: c.plain_copy,
}


@dataclass
class DirectRun:
    seconds: float
    busy: float
    counts: tuple[int, int, int]
    own_cpu: float  # the client's process


async def direct(server: PostgresServer, name: str, warm: Sequence[TurnSpec],
                 turns: Sequence[TurnSpec]) -> DirectRun:
    """One client writing ``turns`` (after ``warm``, untimed) in ``REPLICA_TURNS`` chunks."""
    dsn = await new_database(server, "direct")
    conn = await asyncpg.connect(dsn)
    try:
        write = BASELINES[name](DirectClient(conn))
        for start in range(0, len(warm), REPLICA_TURNS):
            await write(warm[start:start + REPLICA_TURNS])
        j0, cpu0 = jiffies(), process_cpu_s()
        t0 = time.monotonic()
        for start in range(0, len(turns), REPLICA_TURNS):
            await write(turns[start:start + REPLICA_TURNS])
        seconds = time.monotonic() - t0
        j1, cpu = jiffies(), process_cpu_s() - cpu0
    finally:
        await conn.close()
    counts = await row_counts(dsn)
    await drop_database(server, dsn)
    return DirectRun(seconds, busy_share(j0, j1), counts, cpu)


def median(xs: Sequence[float]) -> float:
    return sorted(xs)[len(xs) // 2]


async def throughput(server: PostgresServer, quick: bool) -> list[Result]:
    n = 5_000 if quick else 40_000
    reps = 1 if quick else 3
    total = GATEWAYS * n
    corpus = Corpus()
    warm: list[TurnSpec] = []
    turns: list[TurnSpec] = []
    for g in range(GATEWAYS):
        w, t = gateway_turns(corpus, g, n)
        warm += w
        turns += t
    chars = sum(len(u) + len(a) for _, _, u, a in turns) / len(turns)
    print(f"\n1. turns/s into PostgreSQL: {GATEWAYS} gateways x {n:,} turns "
          f"({SESSIONS_PER_GATEWAY:,} sessions each, {chars:.0f} characters of text a turn), "
          f"after {WARM_TURNS} warm-up turns each; one client's transactions of "
          f"{REPLICA_TURNS:,} turns (the replicator's largest write); {reps} round(s)",
          flush=True)
    expected = 2 * (len(warm) + total)
    times: dict[str, list[float]] = {"gateways": [], **{k: [] for k in BASELINES}}
    rows = []
    gateway_rows = []
    with scratch_dir("postgres") as folder:
        for r in range(reps):
            # Alternate the order, so a noisy moment of the machine hits them alike.
            order = ["gateways", *BASELINES] if r % 2 == 0 else [*BASELINES, "gateways"]
            line: dict[str, str] = {}
            for name in order:
                if name == "gateways":
                    run = await through_gateways(server, folder / f"round{r}", n)
                    seconds, busy, counts = run.seconds, run.busy, run.counts
                    own = run.own_cpu
                    for g, rep in enumerate(run.reports):
                        sizes = [k for k, _ in rep["writes"]]
                        in_write = sum(ms for _, ms in rep["writes"]) / 1000
                        window = rep["replicated"] - rep["first"]
                        gateway_rows.append([
                            r + 1, g, f"{rep['accepted'] - rep['first']:.2f} s",
                            f"{rep['committed'] - rep['first']:.2f} s", f"{window:.2f} s",
                            len(sizes), f"{sum(sizes) / max(1, len(sizes)):,.0f}",
                            f"{max(sizes, default=0):,}",
                            f"{in_write:.2f} s ({in_write / window:.0%})",
                            f"{rep['cpu']:.2f} s"])
                    want = (expected, GATEWAYS * (WARM_SESSIONS + SESSIONS_PER_GATEWAY),
                            expected)
                else:
                    d = await direct(server, name, warm, turns)
                    seconds, busy, counts, own = d.seconds, d.busy, d.counts, d.own_cpu
                    want = ((expected, 0, 0) if name == "plain COPY" else
                            (expected, GATEWAYS * (WARM_SESSIONS + SESSIONS_PER_GATEWAY),
                             expected))
                if name == "plain COPY":
                    # Only the messages it copied: its warm-up went in the same way.
                    counts = (counts[0], 0, 0)
                if counts != want:
                    raise SystemExit(f"{name} left messages, sessions, counted "
                                     f"{counts} in the database; expected {want}")
                times[name].append(seconds)
                line[name] = f"{fmt_rate(total / seconds)} (CPU {busy:.0%})"
                rest = busy * CORES * seconds - own
                print(f"  round {r + 1}: {name}: {fmt_rate(total / seconds)} in "
                      f"{seconds:.2f} s; machine {busy:.0%} busy: CPU "
                      f"{1e6 * own / total:.0f} µs a turn in the "
                      f"{'gateways' if name == 'gateways' else 'client'}, "
                      f"{1e6 * rest / total:.0f} µs elsewhere (the server, mostly)",
                      flush=True)
            rows.append([r + 1, line["gateways"], *(line[k] for k in BASELINES)])
    print_table(["round", "3 gateways", *(f"({c}) {k}" for c, k in zip("abc", BASELINES,
                                                                       strict=True))], rows)
    print("per gateway, from its first accept (time in write(): the backend's transactions,"
          " from its postgres_write log lines):")
    print_table(["round", "gateway", "accepted", "committed locally", "replicated",
                 "PG writes", "turns a write", "largest", "time in write()",
                 "process CPU"], gateway_rows)
    rate = {k: total / median(v) for k, v in times.items()}
    best = max(("staged COPY", "executemany"), key=lambda k: rate[k])
    other = "executemany" if best == "staged COPY" else "staged COPY"
    ratio = rate["gateways"] / rate[best]
    print(f"medians: 3 gateways {fmt_rate(rate['gateways'])}, staged COPY "
          f"{fmt_rate(rate['staged COPY'])}, executemany {fmt_rate(rate['executemany'])}, "
          f"plain COPY {fmt_rate(rate['plain COPY'])}; goal against the faster of the two "
          f"that write the same rows ({best}): {ratio:.1%} "
          f"({'PASS' if ratio >= GOAL_VS_DIRECT else 'MISS'})")
    what = f"turns/s into PostgreSQL, {GATEWAYS} gateway processes"
    return [
        Result(f"{what} vs one client's {best} of the same rows", fmt_rate(rate["gateways"]),
               f"{best} {fmt_rate(rate[best])}", f"{ratio:.1%}", "≥ 60 %",
               ratio >= GOAL_VS_DIRECT),
        Result(f"{what} vs one client's {other} of the same rows", fmt_rate(rate["gateways"]),
               f"{other} {fmt_rate(rate[other])}", f"{rate['gateways'] / rate[other]:.1%}",
               "—", None),
        Result(f"{what} vs plain COPY into messages (messages only)",
               fmt_rate(rate["gateways"]), f"plain COPY {fmt_rate(rate['plain COPY'])}",
               f"{rate['gateways'] / rate['plain COPY']:.1%}", "—", None),
    ]


# -- 2. recall at 1,000,000 messages -----------------------------------------------------


def load_rows(corpus: Corpus, rng: random.Random, first_turn: int, turns: int,
              total_turns: int) -> list[tuple[Any, ...]]:
    """The message rows of turns ``first_turn`` .. +``turns``: turn i belongs to session
    i mod (users x sessions a user), so every user's turns are spread over the heap."""
    lanes = RECALL_USERS * RECALL_SESSIONS_PER_USER
    step = LOAD_SPAN_S / total_turns
    base = time.time() - LOAD_SPAN_S
    rows = []
    for i in range(first_turn, first_turn + turns):
        lane = i % lanes
        u = lane % RECALL_USERS
        sid, uid = corpus.session_id(u, lane // RECALL_USERS), corpus.user_id(u)
        scope = scope_tokens(uid, sid)
        seq, key, at = i // lanes + 1, f"load-{i:x}", base + i * step
        user, assistant = corpus.turn(rng, u)
        rows.append((sid, seq, key, 0, "user", user, at, uid, scope))
        rows.append((sid, seq, key, 1, "assistant", assistant, at, uid, scope))
    return rows


async def load(dsn: str, corpus: Corpus, messages: int) -> tuple[float, float]:
    """Fill the messages table; seconds copying, seconds making the indexes and analyzing."""
    conn = await asyncpg.connect(dsn)
    try:
        indexes = await conn.fetch(SECONDARY_INDEXES)
        uniques = await conn.fetch(UNIQUE_CONSTRAINTS)
        for c in uniques:
            await conn.execute(f'ALTER TABLE messages DROP CONSTRAINT "{c["name"]}"')
        for i in indexes:
            await conn.execute(f'DROP INDEX "{i["name"]}"')
        rng = random.Random(corpus.spec.seed + 7)
        total_turns = messages // 2
        chunk = LOAD_CHUNK_ROWS // 2
        t0 = time.monotonic()
        # The next chunk is made (in a thread) while the server takes the last one.
        pending = asyncio.create_task(asyncio.to_thread(
            load_rows, corpus, rng, 0, min(chunk, total_turns), total_turns))
        for first in range(0, total_turns, chunk):
            rows = await pending
            following = first + chunk
            if following < total_turns:
                pending = asyncio.create_task(asyncio.to_thread(
                    load_rows, corpus, rng, following, min(chunk, total_turns - following),
                    total_turns))
            await conn.copy_records_to_table("messages", records=rows, columns=LOAD_COLUMNS)
            print(f"  {first * 2 + len(rows):,} messages copied, "
                  f"{time.monotonic() - t0:.0f} s", flush=True)
        copied = time.monotonic() - t0
        t1 = time.monotonic()
        await conn.execute("SET maintenance_work_mem = '1GB'")
        for c in uniques:
            await conn.execute(
                f'ALTER TABLE messages ADD CONSTRAINT "{c["name"]}" {c["definition"]}')
        for i in indexes:
            await conn.execute(i["definition"])
        await conn.execute("VACUUM ANALYZE messages")
        indexed = time.monotonic() - t1
        count = await conn.fetchval("SELECT count(*) FROM messages")
    finally:
        await conn.close()
    if count != messages:
        raise SystemExit(f"loaded {count:,} messages, expected {messages:,}")
    return copied, indexed


@dataclass(frozen=True)
class Query:
    text: str
    user_id: str
    session_id: str
    common: bool  # holds a word of rank <= COMMON_RANK


def make_queries(corpus: Corpus, rng: random.Random, n: int) -> list[Query]:
    """2-3 words: one of the user's topic words, the rest drawn as the text draws words."""
    rank = {w: i + 1 for i, w in enumerate(corpus.words)}
    out = []
    for _ in range(n):
        u = rng.randrange(RECALL_USERS)
        words = [rng.choice(corpus.topics[u])]
        want = rng.choice((2, 3))
        while len(words) < want:
            w = rng.choices(corpus.words, cum_weights=corpus.cum)[0]
            if w not in words:
                words.append(w)
        rng.shuffle(words)
        out.append(Query(" ".join(words), corpus.user_id(u),
                         corpus.session_id(u, rng.randrange(RECALL_SESSIONS_PER_USER)),
                         any(rank[w] <= COMMON_RANK for w in words)))
    return out


def unscoped_sql(n_terms: int) -> str:
    terms = " || ".join(f"plainto_tsquery('simple', ${i + 2})" for i in range(n_terms))
    return UNSCOPED.format(chars=TEXT_CHARS, terms=f"({terms})")


async def recall(server: PostgresServer, quick: bool) -> list[Result]:
    messages = 100_000 if quick else 1_000_000
    n_queries = 200 if quick else 500
    budget_s = 30.0 if quick else 120.0
    min_baseline = 5
    corpus = Corpus()
    print(f"\n2. recall: {messages:,} messages over {RECALL_USERS:,} users, {n_queries} "
          f"queries of 2-3 words; the unscoped baseline within {budget_s:.0f} s", flush=True)
    dsn = await new_database(server, "recall")
    try:
        copied, indexed = await load(dsn, corpus, messages)
        print(f"loaded in {copied:.0f} s (COPY, the tsvector computed by the server), "
              f"indexes and VACUUM ANALYZE {indexed:.0f} s", flush=True)
        rng = random.Random(4_242)
        warmup = make_queries(corpus, rng, 20)
        queries = make_queries(corpus, rng, n_queries)
        common = sum(q.common for q in queries) / len(queries)
        print(f"{common:.0%} of the queries hold a word of the {COMMON_RANK} most common; "
              "e.g. " + "; ".join(repr(q.text) for q in queries[:4]))
        settings = Settings(postgres_dsn=dsn)
        async with open_pool(settings) as pool:

            async def library(q: Query) -> str:
                return await recall_block(
                    pool, RecallRequest(q.text, q.session_id, q.user_id, RECALL_LIMIT),
                    settings)

            async def unscoped(q: Query) -> int:
                terms = query_terms(q.text, frozenset(), settings.recall_max_terms,
                                    fold=str.lower)
                return len(await pool.fetch(unscoped_sql(len(terms)), RECALL_LIMIT, *terms))

            for q in warmup:
                await library(q)
            for q in warmup[:2]:
                await unscoped(q)
            lib_ns, hits = [], 0
            for q in queries:
                a = now_ns()
                block = await library(q)
                lib_ns.append(now_ns() - a)
                hits += bool(block)
            base_ns: list[int] = []
            found = 0
            deadline = time.monotonic() + budget_s
            for q in queries:
                if len(base_ns) >= min_baseline and time.monotonic() > deadline:
                    break
                a = now_ns()
                found += bool(await unscoped(q))
                base_ns.append(now_ns() - a)
            # The library again on the baseline's queries: the same mix, for comparison.
            lib_same = []
            for q in queries[:len(base_ns)]:
                a = now_ns()
                await library(q)
                lib_same.append(now_ns() - a)
    finally:
        await drop_database(server, dsn)
    hit_rate = hits / len(queries)
    s_lib, s_base = summary(lib_ns), summary(base_ns)
    cols = ("p50", "p90", "p99", "max", "mean")

    def line(label: str, samples: Sequence[int]) -> list[object]:
        s = summary(samples)
        return [label, s["n"], *(fmt_ns(s[k]) for k in cols)]

    print_table(["query", "n", *cols], [
        line("recall_block (scoped to the user)", lib_ns),
        line(f"  of which with a word of the {COMMON_RANK} most common",
             [t for t, q in zip(lib_ns, queries, strict=True) if q.common]),
        line("  of which without", [t for t, q in zip(lib_ns, queries, strict=True)
                                    if not q.common]),
        line("  again, on the baseline's queries", lib_same),
        line("unscoped ts_rank, same terms", base_ns),
    ])
    print(f"recall found something for {hit_rate:.0%} of the queries; the unscoped query "
          f"for {found}/{len(base_ns)}")
    if hit_rate < MIN_HIT_RATE:
        raise SystemExit(f"only {hit_rate:.0%} of recalls found anything: the run is invalid")
    r50 = s_base["p50"] / s_lib["p50"]
    r99 = s_base["p99"] / s_lib["p99"]
    scale = "1M" if messages == 1_000_000 else f"{messages // 1000}k"
    return [Result(
        f"PostgreSQL recall_block, {scale} messages, {RECALL_USERS:,} users, 2-3 words "
        f"(p50 / p99)", f"{fmt_ns(s_lib['p50'])} / {fmt_ns(s_lib['p99'])}",
        f"unscoped ts_rank {fmt_ns(s_base['p50'])} / {fmt_ns(s_base['p99'])} "
        f"(n={s_base['n']})", f"{r50:,.0f}x / {r99:,.0f}x faster", "—", None)]


# -- 3. write-to-visible across machines -----------------------------------------------------


async def notify_floor(dsn: str, n: int) -> list[int]:
    """Nanoseconds from a client's INSERT + NOTIFY (committed) to another connection's
    LISTEN callback, ``n`` times."""
    listener, writer = await asyncpg.connect(dsn), await asyncpg.connect(dsn)
    got: asyncio.Queue[int] = asyncio.Queue()
    try:
        await writer.execute("CREATE TEMP TABLE floor (n int)")
        await listener.add_listener("floor", lambda *_: got.put_nowait(now_ns()))
        out = []
        for i in range(n):
            a = now_ns()
            async with writer.transaction():
                await writer.execute("INSERT INTO floor VALUES ($1)", i)
                await writer.execute("SELECT pg_notify('floor', $1)", str(i))
            out.append(await asyncio.wait_for(got.get(), 10) - a)
    finally:
        await listener.close()
        await writer.close()
    return out


def recalled(mem: MemoryPipeline, user: str, session: str) -> bool:
    return mem.prefetch_status(session_id=session, user_id=user).recall_query is not None


def shows(mem: MemoryPipeline, user: str, session: str, word: str) -> bool:
    return word in mem.prefetch(session_id=session, user_id=user)


async def write_to_visible(server: PostgresServer, quick: bool) -> list[Result]:
    n = 50 if quick else 300
    print(f"\n3. write-to-visible across two gateways: {n} turns, each for a new user",
          flush=True)
    dsn = await new_database(server, "visible")
    try:
        floor = await notify_floor(dsn, n)
        with tempfile.TemporaryDirectory(prefix="bench-visible-") as tmp:
            folder = Path(tmp)
            a = MemoryPipeline(Settings(db_path=folder / "a" / "memory.db",
                                        backend="postgres", postgres_dsn=dsn))
            b = MemoryPipeline(Settings(db_path=folder / "b" / "memory.db",
                                        backend="postgres", postgres_dsn=dsn))
            async with a, b:
                watched = b.backend
                assert isinstance(watched, PostgresBackend)
                await b.wait_until(lambda: watched.listener is not None
                                   and watched.listener.connected, timeout=60)
                samples: list[int] = []
                for i in range(n + 5):  # the first 5 warm up
                    user, session, word = f"vis{i}", f"b{i}", f"beacon{i}x"
                    b.queue_prefetch(f"where is {word}", session_id=session, user_id=user)
                    await b.wait_until(partial(recalled, b, user, session), timeout=60)
                    start = now_ns()
                    a.sync_turn(f"the {word} is on the pier", "ok", session_id=f"a{i}",
                                user_id=user)
                    await b.wait_until(partial(shows, b, user, session, word), timeout=60)
                    if i >= 5:
                        samples.append(now_ns() - start)
    finally:
        await drop_database(server, dsn)
    s_vis, s_floor = summary(samples), summary(floor)
    cols = ("p50", "p90", "p99", "max", "mean")
    print_table(["path", "n", *cols], [
        ["gateway A sync_turn -> gateway B prefetch", s_vis["n"],
         *(fmt_ns(s_vis[k]) for k in cols)],
        ["INSERT + NOTIFY -> LISTEN (one client)", s_floor["n"],
         *(fmt_ns(s_floor[k]) for k in cols)],
    ])
    return [Result(
        "PostgreSQL write-to-visible across two gateways (p50 / p99)",
        f"{fmt_ns(s_vis['p50'])} / {fmt_ns(s_vis['p99'])}",
        f"INSERT+NOTIFY->LISTEN {fmt_ns(s_floor['p50'])} / {fmt_ns(s_floor['p99'])}",
        f"{s_vis['p50'] / s_floor['p50']:,.0f}x / {s_vis['p99'] / s_floor['p99']:,.0f}x",
        "—", None)]


# -- main ----------------------------------------------------------------------------------


async def main() -> list[Result]:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--only", choices=("throughput", "recall", "visible"), action="append",
                   help="run only this part (repeatable)")
    args = p.parse_args()
    quiet_logs()
    parts = args.only or ["throughput", "recall", "visible"]
    print(f"bench_postgres ({machine()}; library {library_version()})", flush=True)
    results: list[Result] = []
    with postgres_server() as server:
        version = await asyncio.to_thread(server.sql, "SHOW server_version")
        print(f"PostgreSQL {version} on 127.0.0.1:{server.port}, fsync off (the tests' "
              "server settings)", flush=True)
        if "throughput" in parts:
            results += await throughput(server, args.quick)
        if "recall" in parts:
            results += await recall(server, args.quick)
        if "visible" in parts:
            results += await write_to_visible(server, args.quick)
    for r in results:
        if r.met is not None:
            print(f"{r.benchmark}: {r.ratio} (goal {r.goal}): {r.verdict}")
    report(results, args.json)
    return results


if __name__ == "__main__":
    asyncio.run(main())
    sys.exit(0)
