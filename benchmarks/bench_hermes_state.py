"""Hermes Agent's session store (``hermes_state.SessionDB``, hermes-agent as installed) against
ours (``hermes_async_memory.hermes.state.SessionDB``), the same data through each one's public
API, in the same run, on the same machine.

Both stores live in a scratch folder of their own under benchmarks/.data/. The data:
sessions of 50 messages each (``--quick``: fewer sessions), sources cli / telegram / discord,
a fifth of the turns with a tool call (user, assistant calling a tool with empty content,
the tool's result, the assistant's answer), text from ``_common.Corpus`` at its realistic
size (20-30 words a user or assistant message, 10-40 a tool result). Each store's sessions
are created first (``create_session``, untimed), then the messages appended turn by turn,
round-robin over the sessions, as a gateway serving them all would.

1. **Appends** (single thread, back to back): every ``append_message`` call timed with
   ``perf_counter_ns`` on the caller's thread, to its acknowledgement (Hermes: committed;
   ours: durable in the outbox, its id given; the background writer group-commits while the
   next calls are made). Full mode: 3 rounds of 200 sessions x 50 messages (10,000 calls a
   store a round), the two stores' order alternating; each figure is the median of the
   rounds'. Baseline: Hermes's own append. Goal (the issue): ours p99 <= 25 µs. Also shown:
   how long ours takes, after its last ack, until a read returns (everything committed).
2. **Reads** on the settled stores (ours: a read first, which waits for every write to
   commit; no write is pending during the timed reads, checked before and after):
   ``get_session``, ``get_messages`` of a 50-message session, ``search_messages`` of a
   mid-frequency word (in 0.3-3 % of messages, so a full page of 20 hits), and a session
   listing, ``list_sessions_rich`` (a read is timed only when both stores have it). Beside
   it, three more reads that list or summarise sessions, from before ours had the listing:
   ``session_count(source=...)``, ``export_session`` (a session with its messages) and
   ``export_all(source=...)`` (every session of a source with its messages).
   Same arguments, same order for both; the stores alternate in 8 chunks per read. p50 and
   p99 each; goal: ours within 1.5x Hermes's at both.
3. **Appends paced** (single thread, a 1 ms sleep before each call, 2,000 calls): a
   gateway that does other things between appends, so ours's writer is idle when each comes
   in. Informative, beside a control: a pure-Python function doing an append's worth of
   work (build and JSON-encode the message), timed the same way, since on this machine
   anything run right after a sleep is slower.
4. **Many writer threads**, as a gateway has: N threads (1, 2, 4, 8), each appending to
   sessions of its own (50 messages each, round-robin over them: 40 sessions a thread back
   to back, 12 with the wait), a fixed number of messages per thread, all released
   together on a barrier. Aggregate acks/s (messages / from the first start to the last ack)
   and per-call p50 / p99 for both, then for ours the time from the last ack until a read
   returns (the backlog committed). Two shapes:
   - back to back, as fast as they can (2,000 appends each). Informative: Python threads
     calling a Python API share one GIL, so whatever the store does, a 2-core machine runs
     one such call at a time; aggregate acks/s stay flat for both, Hermes's bounded by its
     lock held across each SQLite transaction (``_execute_write``, with its fsync), ours by
     its CPU cost per ack.
   - a 1 ms GIL-free wait (``time.sleep``) before each append (500 each), as a gateway
     thread awaiting the network or a model: here the threads overlap unless the store
     serializes them. Goal (the issue: "Hermes serializes them on one lock; ours must not"):
     ours at 8 threads reaches at least 0.8 x 8 = 6.4x its own 1-thread aggregate. Hermes's
     is capped near 1 / (its time holding the lock).
   Full mode: 3 rounds, the stores' order alternating; each figure the median of the rounds'.

Durability as each store has it: Hermes opens its file in WAL mode with SQLite's default
``synchronous`` (FULL on Linux: an fsync per commit); ours commits with ``synchronous=NORMAL``
behind an outbox that is durable against a process kill when the call returns.
"""

from __future__ import annotations

import gc
import json
import random
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import hermes_state  # type: ignore[import-untyped]  # Hermes Agent's own (hermes-agent)
from _common import (
    REALISTIC_WORDS,
    STOPWORDS,
    Corpus,
    Result,
    fmt_ns,
    library_version,
    machine,
    now_ns,
    parser,
    print_table,
    quiet_logs,
    report,
    scratch_dir,
    summary,
)

from hermes_async_memory.hermes import state as ours_state

GOAL_APPEND_P99_NS = 25_000
GOAL_READ_RATIO = 1.5
# Writer threads that wait THINK_S (GIL-free) before each append: ours at 8 threads must
# reach this share of 8x its own 1-thread aggregate (linear scaling within 20 %).
GOAL_THREAD_SCALING = 0.8
THINK_S = 0.001
PACE_S = 0.001  # the single-thread paced shape: a sleep of this before each append
MESSAGES_PER_SESSION = 50
SOURCES = ("cli", "telegram", "discord")
SOURCE_WEIGHTS = (5, 3, 2)
MODELS = ("gpt-4o", "claude-sonnet-4", "llama-3.1-70b")
TOOLS = ("web_search", "read_file", "run_shell", "calendar_lookup")
TOOL_TURN_SHARE = 0.2
MID_BAND = (0.003, 0.03)  # a mid-frequency word is in this share of messages
THREAD_COUNTS = (1, 2, 4, 8)
SESSION_GROUP = 4  # a writer thread's sessions: this many, or a multiple of it
# The two stores' reads alternate in this many chunks per read, with enough calls that each
# store's reads span ~0.4 s or more: now and then ours's loop thread (its upkeep runs once
# a second) holds the GIL a read needs, and a short sample catches that or not by luck.
CHUNKS = 8
WARM_APPENDS = 1_000

Call = tuple[str, str, Any, dict[str, Any]]  # session_id, role, content, keyword arguments
ReadCall = tuple[str, tuple[Any, ...], dict[str, Any]]  # method name, arguments


@dataclass(frozen=True)
class Plan:
    sessions: dict[str, tuple[str, str, str]]  # id -> (source, model, user_id)
    calls: list[Call]  # the appends, in order


@dataclass(frozen=True)
class Sizes:
    rounds: int
    sessions: int
    paced: int  # single-thread appends PACE_S apart
    per_thread: dict[str, int]  # per thread shape
    thread_rounds: int
    reads: dict[str, int]


@dataclass(frozen=True)
class ThreadShape:
    key: str
    label: str
    think_s: float
    judged: bool


THREAD_SHAPES = (
    ThreadShape("burst", "back to back", 0.0, False),
    ThreadShape("think", f"{THINK_S * 1e3:.0f} ms of GIL-free wait before each append", THINK_S,
                True),
)
FULL = Sizes(rounds=3, sessions=200, paced=2_000,
             per_thread={"burst": 2_000, "think": 500}, thread_rounds=3,
             reads={"get_session": 20_000, "get_messages": 2_000, "search_messages": 1_000,
                    "list_sessions_rich": 1_000, "session_count": 10_000,
                    "export_session": 2_000, "export_all": 40})
QUICK = Sizes(rounds=1, sessions=40, paced=200,
              per_thread={"burst": 150, "think": 60}, thread_rounds=1,
              reads={"get_session": 200, "get_messages": 100, "search_messages": 60,
                     "list_sessions_rich": 60, "session_count": 100,
                     "export_session": 60, "export_all": 8})


# -- the data ------------------------------------------------------------------------------


def make_plan(corpus: Corpus, prefix: str, sessions: int, seed: int) -> Plan:
    """``sessions`` sessions of MESSAGES_PER_SESSION messages; the appends round-robin by
    turn over the sessions (a gateway serving them all)."""
    rng = random.Random(seed)
    plan: dict[str, tuple[str, str, str]] = {}
    turns: list[list[list[Call]]] = []
    n_call = 0
    for k in range(sessions):
        u = k % corpus.spec.users
        sid = f"{prefix}-{k:04d}"
        plan[sid] = (rng.choices(SOURCES, SOURCE_WEIGHTS)[0], rng.choice(MODELS),
                     corpus.user_id(u))
        left = MESSAGES_PER_SESSION
        session_turns: list[list[Call]] = []
        while left > 0:
            user, assistant = corpus.turn_of(rng, u, REALISTIC_WORDS)
            if left >= 4 and rng.random() < TOOL_TURN_SHARE:
                n_call += 1
                tool = rng.choice(TOOLS)
                call_id = f"call_{seed:x}_{n_call:x}"
                words = user.split()
                args = json.dumps({"query": " ".join(rng.sample(words, min(3, len(words))))})
                session_turns.append([
                    (sid, "user", user, {}),
                    (sid, "assistant", "", {"tool_calls": [
                        {"id": call_id, "type": "function",
                         "function": {"name": tool, "arguments": args}}],
                        "finish_reason": "tool_calls"}),
                    (sid, "tool", corpus.message(rng, u, 10, 40),
                     {"tool_name": tool, "tool_call_id": call_id}),
                    (sid, "assistant", assistant,
                     {"token_count": len(assistant.split()) * 4 // 3, "finish_reason": "stop"}),
                ])
                left -= 4
            else:
                session_turns.append([
                    (sid, "user", user, {}),
                    (sid, "assistant", assistant,
                     {"token_count": len(assistant.split()) * 4 // 3, "finish_reason": "stop"}),
                ])
                left -= 2
        turns.append(session_turns)
    calls: list[Call] = []
    for t in range(max(len(s) for s in turns)):
        for session_turns in turns:
            if t < len(session_turns):
                calls.extend(session_turns[t])
    return Plan(plan, calls)


def create_sessions(db: Any, plan: Plan) -> None:
    for sid, (source, model, user) in plan.sessions.items():
        db.create_session(sid, source, model=model, user_id=user)


def settle(db: Any, session_id: str) -> None:
    """Return once everything written through ``db`` is committed: a read (ours waits for
    every accepted write to commit before it reads; Hermes's writes are committed)."""
    db.get_session(session_id)


def pending(db: Any) -> bool:
    """Whether ours holds writes not yet committed (False for Hermes's)."""
    runtime = getattr(db, "_runtime", None)
    pipeline = getattr(runtime, "pipeline", None)
    return bool(pipeline is not None and pipeline.pending())


# -- appends -------------------------------------------------------------------------------


def timed_appends(db: Any, calls: Sequence[Call]) -> list[int]:
    t = now_ns
    out = [0] * len(calls)
    append = db.append_message
    for i, (sid, role, content, kw) in enumerate(calls):
        a = t()
        append(sid, role, content, **kw)
        out[i] = t() - a
    return out


def commit_lag_s(db: Any, session_id: str, last_ack: float) -> float:
    """From ``last_ack`` (perf_counter) until a read returns."""
    settle(db, session_id)
    return time.perf_counter() - last_ack


# -- reads ---------------------------------------------------------------------------------


def mid_words(plan_calls: Sequence[Call], corpus: Corpus, rng: random.Random) -> list[str]:
    """Words in MID_BAND of the messages (document frequency), stopwords and topic words
    aside, at most 40 of them."""
    df: dict[str, int] = {}
    n = 0
    for _, _, content, _ in plan_calls:
        if not content:
            continue
        n += 1
        for w in set(content.split()):
            df[w] = df.get(w, 0) + 1
    topics = {w for ws in corpus.topics for w in ws}
    stop = set(STOPWORDS)
    lo, hi = MID_BAND[0] * n, MID_BAND[1] * n
    words = sorted(w for w, c in df.items()
                   if lo <= c <= hi and c >= 20 and w not in stop and w not in topics)
    rng.shuffle(words)
    if not words:
        raise RuntimeError("no mid-frequency word in the data")
    return words[:40]


def read_calls(name: str, dbs: dict[str, Any], sids: Sequence[str], words: Sequence[str],
               rng: random.Random, n: int) -> list[ReadCall] | None:
    """``n`` argument sets for one read, the same for both stores (the method looked up on
    each store at call time), or None when a store lacks it."""
    if not all(hasattr(db, name) for db in dbs.values()):
        return None
    out: list[ReadCall] = []
    for _ in range(n):
        if name in ("get_session", "get_messages", "export_session"):
            args: tuple[Any, ...] = (rng.choice(sids),)
            kw: dict[str, Any] = {}
        elif name == "search_messages":
            args, kw = (rng.choice(words),), {}
        elif name == "session_count":
            args, kw = (), {"source": rng.choice(SOURCES)}
        elif name == "export_all":
            args, kw = (), {"source": rng.choice(SOURCES)}
        elif name == "list_sessions_rich":
            args, kw = (), {"limit": 20, "offset": rng.choice((0, 0, 20, 40))}
        else:
            raise ValueError(name)
        out.append((name, args, kw))
    return out


def time_reads(db: Any, calls: Sequence[ReadCall]) -> tuple[list[int], int]:
    t = now_ns
    out = [0] * len(calls)
    size = 0
    for i, (name, args, kw) in enumerate(calls):
        fn = getattr(db, name)
        a = t()
        got = fn(*args, **kw)
        out[i] = t() - a
        size += len(got) if isinstance(got, (list, dict)) else 1
    return out, size


# -- many writer threads -------------------------------------------------------------------


def thread_run(db: Any, calls_per_thread: Sequence[Sequence[Call]], think_s: float = 0.0
               ) -> tuple[list[int], float, float]:
    """Each thread appends its calls, back to back or ``think_s`` apart (a sleep, which lets
    go of the GIL, as a gateway thread awaiting the network does), all released together.
    Returns every call's time, the first start and the last ack (perf_counter)."""
    n = len(calls_per_thread)
    barrier = threading.Barrier(n)
    samples: list[list[int]] = [[] for _ in range(n)]
    starts = [0.0] * n
    ends = [0.0] * n
    errors: list[BaseException] = []

    def work(k: int) -> None:
        try:
            calls = calls_per_thread[k]
            out = [0] * len(calls)
            append = db.append_message
            t = now_ns
            barrier.wait()
            starts[k] = time.perf_counter()
            sleep = time.sleep
            for i, (sid, role, content, kw) in enumerate(calls):
                if think_s:
                    sleep(think_s)
                a = t()
                append(sid, role, content, **kw)
                out[i] = t() - a
            ends[k] = time.perf_counter()
            samples[k] = out
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(k,), name=f"writer-{k}") for k in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return [x for s in samples for x in s], min(starts), max(ends)


def thread_calls(corpus: Corpus, tag: str, n_threads: int, per_thread: int, seed: int
                 ) -> tuple[Plan, list[list[Call]]]:
    """Each thread's own sessions of MESSAGES_PER_SESSION messages, SESSION_GROUP of them
    or the smallest multiple of that enough for its ``per_thread`` appends (40 sessions for
    2,000, 12 for 500), its appends round-robin over them, each session's messages in
    order."""
    per_group = -(-per_thread // SESSION_GROUP)  # appends per session of a group
    per_sessions = SESSION_GROUP * -(-per_group // MESSAGES_PER_SESSION)
    plan = make_plan(corpus, tag, n_threads * per_sessions, seed)
    by_session: dict[str, list[Call]] = {}
    for c in plan.calls:
        by_session.setdefault(c[0], []).append(c)
    sids = list(plan.sessions)
    per: list[list[Call]] = []
    for k in range(n_threads):
        mine = sids[k::n_threads]
        calls = [c for i in range(MESSAGES_PER_SESSION) for sid in mine
                 for c in by_session[sid][i:i + 1]]
        per.append(calls[:per_thread])
    return plan, per


def control_work(session_id: str, role: str, content: Any, **kw: Any) -> bytes:
    """A pure-Python function of an append's size and cost (builds and JSON-encodes the
    message), touching no store: the control for the paced shape, where the machine itself
    inflates the latency of anything run right after a sleep."""
    message = {"session_id": session_id, "role": role, "content": content, **kw,
               "timestamp": time.time()}
    return json.dumps(message, ensure_ascii=False).encode() + json.dumps(
        [message, message], separators=(",", ":")).encode()


def paced_appends(append: Any, calls: Sequence[Call], pace_s: float) -> list[int]:
    t = now_ns
    sleep = time.sleep
    out = [0] * len(calls)
    for i, (sid, role, content, kw) in enumerate(calls):
        sleep(pace_s)
        a = t()
        append(sid, role, content, **kw)
        out[i] = t() - a
    return out


def threads_shape(dbs: dict[str, Any], corpus: Corpus, size: Sizes, shape: ThreadShape
                  ) -> list[Result]:
    names = tuple(dbs)
    per_thread = size.per_thread[shape.key]
    rounds: dict[tuple[str, int], list[dict[str, float]]] = {}
    print()
    for r in range(size.thread_rounds):
        for i, n_threads in enumerate(THREAD_COUNTS):
            plan, per = thread_calls(corpus, f"{shape.key}{r}-{n_threads}", n_threads,
                                     per_thread, seed=1_000 + 10 * r + n_threads)
            order = names if (r + i) % 2 == 0 else names[::-1]
            for name in order:
                db = dbs[name]
                create_sessions(db, plan)
                settle(db, next(iter(plan.sessions)))
                gc.collect()
                got, t0, t1 = thread_run(db, per, shape.think_s)
                lag = commit_lag_s(db, next(iter(plan.sessions)), t1)
                s = summary(got)
                s["rate"] = len(got) / (t1 - t0)
                s["lag"] = lag
                rounds.setdefault((name, n_threads), []).append(s)
                print(f"  {shape.key} round {r + 1}, {n_threads} thread(s), {name}: "
                      f"{s['rate']:,.0f} acks/s, p50 {fmt_ns(s['p50'])} p99 "
                      f"{fmt_ns(s['p99'])}; last ack -> read returned {lag * 1e3:.1f} ms",
                      flush=True)
    th = {k: med_summary(v) for k, v in rounds.items()}
    top = THREAD_COUNTS[-1]

    def scaling(name: str, n_threads: int) -> float:
        """Aggregate at ``n_threads`` over the same round's 1-thread aggregate, median of
        the rounds (Hermes's fsync latency drifts with the disk's other work, so rates are
        compared within a round)."""
        return med([a["rate"] / b["rate"]
                    for a, b in zip(rounds[(name, n_threads)], rounds[(name, 1)], strict=True)])

    rows = []
    for n_threads in THREAD_COUNTS:
        h, o = th[("hermes", n_threads)], th[("ours", n_threads)]
        rows.append([str(n_threads), f"{h['rate']:,.0f}/s", f"x{scaling('hermes', n_threads):.2f}",
                     fmt_ns(h["p50"]), fmt_ns(h["p99"]), f"{o['rate']:,.0f}/s",
                     f"x{scaling('ours', n_threads):.2f}", fmt_ns(o["p50"]), fmt_ns(o["p99"]),
                     f"{o['lag'] * 1e3:.1f} ms", f"{o['rate'] / h['rate']:.1f}x"])
    print(f"\nwriter threads, {shape.label}, {per_thread:,} appends each (medians of "
          f"{size.thread_rounds} round(s); vs 1: over the same round's 1 thread)")
    print_table(["threads", "hermes acks/s", "vs 1", "hermes p50", "hermes p99",
                 "ours acks/s", "vs 1", "ours p50", "ours p99", "ours: last ack -> read",
                 "ours/hermes acks/s"], rows)
    results = []
    for n_threads in THREAD_COUNTS:
        h, o = th[("hermes", n_threads)], th[("ours", n_threads)]
        met: bool | None = None
        goal = "—"
        scale_o, scale_h = scaling("ours", n_threads), scaling("hermes", n_threads)
        if shape.judged and n_threads == top:
            met = scale_o >= GOAL_THREAD_SCALING * top
            goal = f"ours scales: {top} threads ≥ {GOAL_THREAD_SCALING * top:.1f}x its 1 thread"
        results.append(Result(
            f"Hermes SessionDB: {n_threads} writer thread{'s' if n_threads > 1 else ''}, "
            f"{shape.label}, {per_thread:,} appends each (acks/s, x 1 thread; p50 / p99)",
            f"{o['rate']:,.0f}/s, x{scale_o:.2f} ({fmt_ns(o['p50'])} / {fmt_ns(o['p99'])})",
            f"Hermes's own {h['rate']:,.0f}/s, x{scale_h:.2f} ({fmt_ns(h['p50'])} / "
            f"{fmt_ns(h['p99'])})",
            f"{o['rate'] / h['rate']:.1f}x",
            goal, met))
    o8, h8 = th[("ours", top)], th[("hermes", top)]
    results.append(Result(
        f"Hermes SessionDB: ours, {top} writer threads ({shape.label}): last ack -> a read "
        f"returns ({top * per_thread:,} appends committed)",
        f"{o8['lag'] * 1e3:.1f} ms",
        f"Hermes's appends took {top * per_thread / h8['rate']:.2f} s", "—", "—", None))
    return results


# -- the run -------------------------------------------------------------------------------


def med(values: Sequence[float]) -> float:
    return statistics.median(values)


def med_summary(rounds: Sequence[dict[str, float]]) -> dict[str, float]:
    return {k: med([r[k] for r in rounds]) for k in rounds[0]}


def main() -> list[Result]:
    p = parser(__doc__.splitlines()[0])
    args = p.parse_args()
    quiet_logs()
    size = QUICK if args.quick else FULL
    corpus = Corpus()
    hermes_version = getattr(hermes_state, "__version__", None) or _dist_version("hermes-agent")
    print(
        f"bench_hermes_state: {size.rounds} round(s) of {size.sessions} sessions x "
        f"{MESSAGES_PER_SESSION} messages appended single-threaded, reads on the settled "
        f"stores, {size.paced:,} appends paced {PACE_S * 1e3:.0f} ms apart, then "
        f"{', '.join(map(str, THREAD_COUNTS))} writer threads "
        f"({', '.join(f'{sh.label}: {size.per_thread[sh.key]:,}' for sh in THREAD_SHAPES)} "
        f"appends each; {size.thread_rounds} round(s)) "
        f"({machine()}; library {library_version()}; hermes-agent {hermes_version})",
        flush=True,
    )
    results: list[Result] = []
    with scratch_dir("hermes_state") as d:
        dbs: dict[str, Any] = {
            "hermes": hermes_state.SessionDB(d / "hermes.db"),
            "ours": ours_state.SessionDB(d / "ours.db"),
        }
        try:
            results = run(dbs, corpus, size)
        finally:
            for db in dbs.values():
                db.close()
    report(results, args.json)
    return results


def _dist_version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return "unknown"


def run(dbs: dict[str, Any], corpus: Corpus, size: Sizes) -> list[Result]:
    results: list[Result] = []
    names = ("hermes", "ours")

    # -- warm-up: both stores' first calls (imports, statements, the pipeline's loop) ------
    warm = make_plan(corpus, "warm", 20, seed=1)
    for name in names:
        create_sessions(dbs[name], warm)
        timed_appends(dbs[name], warm.calls[:WARM_APPENDS])
        settle(dbs[name], next(iter(warm.sessions)))

    # -- 1. appends, single thread ---------------------------------------------------------
    per_round: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    lags: list[float] = []
    walls: list[float] = []
    all_calls: list[Call] = []
    all_sids: list[str] = []
    for r in range(size.rounds):
        plan = make_plan(corpus, f"r{r}-sess", size.sessions, seed=100 + r)
        all_calls.extend(plan.calls)
        all_sids.extend(plan.sessions)
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            db = dbs[name]
            create_sessions(db, plan)
            settle(db, next(iter(plan.sessions)))
            gc.collect()
            t0 = time.perf_counter()
            got = timed_appends(db, plan.calls)
            t1 = time.perf_counter()
            lag = commit_lag_s(db, next(iter(plan.sessions)), t1)
            s = summary(got)
            per_round[name].append(s)
            if name == "ours":
                lags.append(lag)
            else:
                walls.append(t1 - t0)
            print(f"  round {r + 1} {name}: {len(got):,} appends in {t1 - t0:.2f} s "
                  f"({len(got) / (t1 - t0):,.0f}/s), p50 {fmt_ns(s['p50'])} p99 "
                  f"{fmt_ns(s['p99'])} max {fmt_ns(s['max'])}; last ack -> read returned "
                  f"{lag * 1e3:.1f} ms", flush=True)
    a_h, a_o = med_summary(per_round["hermes"]), med_summary(per_round["ours"])
    cols = ("p50", "p90", "p99", "p999", "max", "mean")
    print(f"\nappend_message() to its ack, single thread, back to back (medians of "
          f"{size.rounds} round(s); p99 per round: "
          + "; ".join(f"{n} " + ", ".join(fmt_ns(x["p99"]) for x in per_round[n])
                      for n in names) + ")")
    print_table(["store", *cols],
                [[n, *(fmt_ns(s[c]) for c in cols)] for n, s in (("hermes", a_h),
                                                                  ("ours", a_o))])
    met = a_o["p99"] <= GOAL_APPEND_P99_NS
    results.append(Result(
        f"Hermes SessionDB: append_message() to its ack, single thread, back to back, "
        f"{size.sessions} sessions x {MESSAGES_PER_SESSION} (p50 / p99 / max)",
        f"{fmt_ns(a_o['p50'])} / {fmt_ns(a_o['p99'])} / {fmt_ns(a_o['max'])}",
        f"Hermes's own {fmt_ns(a_h['p50'])} / {fmt_ns(a_h['p99'])} / {fmt_ns(a_h['max'])}",
        f"{a_o['p50'] / a_h['p50']:.2f}x / {a_o['p99'] / a_h['p99']:.2f}x / "
        f"{a_o['max'] / a_h['max']:.2f}x",
        f"p99 ≤ {GOAL_APPEND_P99_NS / 1000:.0f} µs", met))
    n_calls = len(all_calls) // size.rounds
    lag = med(lags)
    print(f"ours: last ack -> a read returns (the {n_calls:,} appends committed): "
          f"{lag * 1e3:.1f} ms (median; per round "
          + ", ".join(f"{x * 1e3:.1f}" for x in lags) + " ms)")
    results.append(Result(
        f"Hermes SessionDB: ours, last ack of {n_calls:,} appends -> a read returns "
        f"(all committed)", f"{lag * 1e3:.1f} ms",
        f"Hermes's appends took {med(walls):.2f} s", "—", "—", None))

    # -- 2. reads on the settled stores ----------------------------------------------------
    results.extend(reads_on(dbs, corpus, size, all_calls, all_sids,
                            len(all_calls) + len(warm.calls[:WARM_APPENDS])))

    # -- 3. appends paced, single thread ---------------------------------------------------
    plan = make_plan(corpus, "paced", max(1, size.paced // MESSAGES_PER_SESSION), seed=500)
    paced: dict[str, dict[str, float]] = {}
    for name in (*names, "control"):
        if name == "control":
            append = control_work
        else:
            create_sessions(dbs[name], plan)
            settle(dbs[name], next(iter(plan.sessions)))
            append = dbs[name].append_message
        gc.collect()
        paced[name] = summary(paced_appends(append, plan.calls, PACE_S))
        if name != "control":
            settle(dbs[name], next(iter(plan.sessions)))
    print(f"\nappend_message() to its ack, single thread, a {PACE_S * 1e3:.0f} ms sleep before "
          f"each ({len(plan.calls):,} calls; the control: a pure-Python function of similar "
          f"work, no store, timed the same way)")
    print_table(["store", *cols], [[n, *(fmt_ns(s[c]) for c in cols)] for n, s in paced.items()])
    p_h, p_o, p_c = paced["hermes"], paced["ours"], paced["control"]
    results.append(Result(
        f"Hermes SessionDB: append_message() to its ack, single thread, paced "
        f"{PACE_S * 1e3:.0f} ms apart (p50 / p99)",
        f"{fmt_ns(p_o['p50'])} / {fmt_ns(p_o['p99'])}",
        f"Hermes's own {fmt_ns(p_h['p50'])} / {fmt_ns(p_h['p99'])}",
        f"{p_o['p50'] / p_h['p50']:.2f}x / {p_o['p99'] / p_h['p99']:.2f}x",
        f"— (control {fmt_ns(p_c['p50'])} / {fmt_ns(p_c['p99'])})", None))

    # -- 4. many writer threads ------------------------------------------------------------
    for shape in THREAD_SHAPES:
        results.extend(threads_shape(dbs, corpus, size, shape))
    return results


def reads_on(dbs: dict[str, Any], corpus: Corpus, size: Sizes, all_calls: Sequence[Call],
             all_sids: Sequence[str], total_msgs: int) -> list[Result]:
    """The reads on the settled stores, the two alternating in chunks."""
    names = tuple(dbs)
    results: list[Result] = []
    rng = random.Random(7)
    words = mid_words(all_calls, corpus, rng)
    for name in names:
        settle(dbs[name], all_sids[0])
    time.sleep(0.5)  # let ours's background work after the commits (checkpoints) pass
    if any(pending(db) for db in dbs.values()):
        raise RuntimeError("writes pending before the timed reads")
    read_names = ["get_session", "get_messages", "search_messages"]
    if all(hasattr(db, "list_sessions_rich") for db in dbs.values()):
        read_names.append("list_sessions_rich")
    else:
        missing = [n for n in names if not hasattr(dbs[n], "list_sessions_rich")]
        print(f"\nlist_sessions_rich: not on {', '.join(missing)}'s SessionDB; the listing "
              f"rows are session_count(source=), export_session(id) and export_all(source=)")
    read_names += ["session_count", "export_session", "export_all"]
    per_source = [dbs["hermes"].session_count(source=src) for src in SOURCES]
    labels = {
        "get_session": "get_session(id)",
        "get_messages": f"get_messages(id), {MESSAGES_PER_SESSION} messages",
        "search_messages": f"search_messages(a word in {MID_BAND[0]:.1%}-{MID_BAND[1]:.0%} "
                           f"of messages), 20 hits",
        "list_sessions_rich": "list_sessions_rich(limit=20)",
        "session_count": "session_count(source=…) (listing stand-in)",
        "export_session": "export_session(id) (listing stand-in: a session + its messages)",
        "export_all": f"export_all(source=…) (listing stand-in: a source's "
                      f"{min(per_source)}-{max(per_source)} sessions + messages)",
    }
    read_rows = []
    for rname in read_names:
        n = size.reads[rname]
        calls = read_calls(rname, dbs, all_sids, words, rng, n)
        if calls is None:
            continue
        warm_n = max(2, n // 20)
        for name in names:
            time_reads(dbs[name], calls[:warm_n])
        samples: dict[str, list[int]] = {nm: [] for nm in names}
        sizes: dict[str, int] = dict.fromkeys(names, 0)
        step = -(-n // CHUNKS)
        for c in range(0, n, step):
            chunk = calls[c:c + step]
            for name in (names if (c // step) % 2 == 0 else names[::-1]):
                got, sz = time_reads(dbs[name], chunk)
                samples[name].extend(got)
                sizes[name] += sz
        if sizes["hermes"] != sizes["ours"]:
            print(f"  note: {rname} answered {sizes['hermes']} items (hermes) and "
                  f"{sizes['ours']} (ours)")
        h, o = summary(samples["hermes"]), summary(samples["ours"])
        r50, r99 = o["p50"] / h["p50"], o["p99"] / h["p99"]
        read_rows.append([labels[rname], f"{n:,}", fmt_ns(h["p50"]), fmt_ns(h["p99"]),
                          fmt_ns(o["p50"]), fmt_ns(o["p99"]), f"{r50:.2f}x / {r99:.2f}x"])
        results.append(Result(
            f"Hermes SessionDB: {labels[rname]}, {total_msgs:,} messages (p50 / p99)",
            f"{fmt_ns(o['p50'])} / {fmt_ns(o['p99'])}",
            f"Hermes's own {fmt_ns(h['p50'])} / {fmt_ns(h['p99'])}",
            f"{r50:.2f}x / {r99:.2f}x",
            f"≤ {GOAL_READ_RATIO}x at p50 and p99",
            r50 <= GOAL_READ_RATIO and r99 <= GOAL_READ_RATIO))
    if any(pending(db) for db in dbs.values()):
        raise RuntimeError("writes pending after the timed reads")
    print(f"\nreads on the settled stores ({total_msgs:,} messages, {len(all_sids):,} "
          f"sessions; {len(words)} search words; stores alternating in {CHUNKS} chunks)")
    print_table(["read", "n", "hermes p50", "hermes p99", "ours p50", "ours p99",
                 "ours/hermes p50 / p99"], read_rows)

    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
