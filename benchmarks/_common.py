"""Shared helpers for the benchmarks: timing, percentiles, a Zipf-like corpus, the raw
``sqlite3`` group-commit baseline, and the result table.

Not a benchmark itself (run the ``bench_*.py`` scripts, or ``run_all.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import platform
import random
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog

from hermes_async_memory.store import SqliteStore
from hermes_async_memory.store.batch import SESSION_COLUMNS, SESSION_CONFLICT
from hermes_async_memory.turns import scope_tokens

BENCH_DIR = Path(__file__).resolve().parent
DATA_DIR = BENCH_DIR / ".data"

now_ns = time.perf_counter_ns
# No flush or wait in a benchmark may hang a run: past this, the library is broken.
FLUSH_TIMEOUT_S = 300.0


# -- set-up ------------------------------------------------------------------------------


def quiet_logs(*, json_lines: bool = False) -> None:
    """The library logs one line per batch; a benchmark is the edge, so it silences them.

    ``json_lines``: warnings and errors as JSON lines on stderr, as the worker writes them
    when not on a TTY. The default console renderer pretty-prints tracebacks (with rich when
    it is installed: ~100 ms a traceback), which a benchmark timing the event loop must not
    mistake for the library's own work."""
    if not json_lines:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
        return
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="a smaller, faster run")
    p.add_argument("--json", type=Path, default=None, help="also write the result rows here")
    return p


def seal_cached_store(tmp: Path, path: Path) -> None:
    """Put a store built at ``tmp`` in place as the cache ``path``: its done keys pruned (the
    pipeline's maintainer prunes keys of outbox segments that are gone in the background;
    done now, so that no measuring run does it while it measures), its WAL checkpointed,
    its outbox removed."""
    conn = sqlite3.connect(tmp)
    conn.execute("DELETE FROM outbox WHERE status = 'done'")
    conn.commit()
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    shutil.rmtree(tmp.with_name(tmp.name + ".outbox"), ignore_errors=True)
    tmp.rename(path)
    for suffix in ("-wal", "-shm"):
        tmp.with_name(tmp.name + suffix).unlink(missing_ok=True)


@contextlib.contextmanager
def scratch_dir(name: str) -> Iterator[Path]:
    """A fresh directory on the project's disk (not tmpfs), removed afterwards."""
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=DATA_DIR))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def machine() -> str:
    return (
        f"{os.cpu_count()} cores, Python {platform.python_version()}, "
        f"SQLite {sqlite3.sqlite_version}"
    )


def library_version() -> str:
    """The commit the library was measured at, with "+dirty" when it has uncommitted edits."""
    root = BENCH_DIR.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "hermes_async_memory"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


# -- statistics --------------------------------------------------------------------------


def pct(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1) of unsorted samples."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    k = max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))
    return ordered[k]


def summary(samples_ns: Sequence[float]) -> dict[str, float]:
    ordered = sorted(samples_ns)
    n = len(ordered)

    def at(q: float) -> float:
        return ordered[max(0, min(n - 1, math.ceil(q * n) - 1))]

    return {
        "n": n,
        "p50": at(0.50),
        "p90": at(0.90),
        "p99": at(0.99),
        "p999": at(0.999),
        "max": ordered[-1],
        "mean": sum(ordered) / n,
    }


def fmt_ns(ns: float) -> str:
    if math.isnan(ns):
        return "n/a"
    if ns < 1_000:
        return f"{ns:.0f} ns"
    if ns < 1_000_000:
        return f"{ns / 1e3:.2f} µs"
    if ns < 1_000_000_000:
        return f"{ns / 1e6:.2f} ms"
    return f"{ns / 1e9:.2f} s"


def fmt_rate(per_s: float) -> str:
    return f"{per_s:,.0f}/s"


def timer_floor_ns(n: int = 200_000) -> float:
    """Median of two back-to-back perf_counter_ns() reads: what every per-call sample includes."""
    t = now_ns
    samples = [0] * n
    for i in range(n):
        a = t()
        b = t()
        samples[i] = b - a
    return pct(samples, 0.5)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[str(c) for c in headers], *[[str(c) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for j, r in enumerate(cells):
        print(
            "  ".join(
                c.rjust(w) if i else c.ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
        if j == 0:
            print("  ".join("-" * w for w in widths))


# -- results -----------------------------------------------------------------------------


@dataclass
class Result:
    """One line of the README table."""

    benchmark: str
    result: str
    baseline: str
    ratio: str
    goal: str
    met: bool | None  # None: informative, no goal
    # One of the figures issue 9 asks the README to show first (run_all.py's headline table).
    headline: bool = False

    @property
    def verdict(self) -> str:
        return "—" if self.met is None else ("PASS" if self.met else "MISS")


def report(results: Sequence[Result], json_path: Path | None) -> None:
    print()
    print_table(
        ["benchmark", "result", "baseline", "ratio", "goal", "met"],
        [[r.benchmark, r.result, r.baseline, r.ratio, r.goal, r.verdict] for r in results],
    )
    if json_path is not None:
        json_path.write_text(json.dumps([asdict(r) for r in results], ensure_ascii=False))


# -- a corpus with a Zipf-like vocabulary ---------------------------------------------------

# The most common words first: every message holds several of them, so a recall that ranks
# on them scores nearly every row.
STOPWORDS = (
    "the to and a of i you it in is that for this on with be can have my what are not do we "
    "but me so if as at or how your will was just an about from there like they get all would "
    "one use did say know need want make here which when then some more also could been has "
    "any them out up our its into than other only over new time now way these should think "
    "see look work good first well back after where thing again still remind why who again "
    "yes no please thanks sure right let file code run"
).split()
_ONSETS = "b c d f g h j k l m n p r s t v w z br cr dr fl gr kl pl pr st tr sk sp".split()
_VOWELS = "a e i o u ai ea io ou".split()
_CODAS = ["", "", "", "n", "r", "s", "l", "x", "m", "nd", "st"]


@dataclass(frozen=True)
class CorpusSpec:
    vocab: int = 30_000
    zipf_s: float = 1.0
    users: int = 1_000
    sessions_per_user: int = 5
    topics_per_user: int = 12
    seed: int = 20_251_122


class Corpus:
    """Deterministic synthetic chat text: Zipf-distributed words plus per-user topic words.

    Word of rank r (1-based) has weight 1/r**s, so "the" is in most messages and the
    synthetic tail words are in a handful. Each user also has a few topic words (ranks past
    2,000) that show up in most of their own messages: what a recall should find.
    """

    def __init__(self, spec: CorpusSpec = CorpusSpec()) -> None:
        self.spec = spec
        rng = random.Random(spec.seed)
        words: list[str] = list(dict.fromkeys(STOPWORDS))
        seen = set(words)
        while len(words) < spec.vocab:
            w = "".join(
                rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.randint(2, 3))
            ) + rng.choice(_CODAS)
            if w not in seen:
                seen.add(w)
                words.append(w)
        self.words = words
        self.cum = list(
            itertools.accumulate(1.0 / (r**spec.zipf_s) for r in range(1, len(words) + 1))
        )
        self.total = self.cum[-1]
        self.topics = [
            [words[rng.randrange(2_000, len(words))] for _ in range(spec.topics_per_user)]
            for _ in range(spec.users)
        ]

    def user_id(self, u: int) -> str:
        return f"user-{u:05d}"

    def session_id(self, u: int, k: int) -> str:
        return f"sess-{u:05d}-{k:02d}"

    def rank_of(self, word: str) -> int:
        return self.words.index(word) + 1

    def _words(self, rng: random.Random, k: int) -> list[str]:
        return rng.choices(self.words, cum_weights=self.cum, k=k)

    def message(self, rng: random.Random, u: int, lo: int, hi: int) -> str:
        words = self._words(rng, rng.randint(lo, hi))
        if rng.random() < 0.7:
            topics = self.topics[u]
            for _ in range(rng.randint(1, 2)):
                words.insert(rng.randrange(len(words) + 1), rng.choice(topics))
        return " ".join(words)

    def turn(self, rng: random.Random, u: int) -> tuple[str, str]:
        return self.message(rng, u, 6, 20), self.message(rng, u, 12, 40)

    def turn_of(self, rng: random.Random, u: int, words: tuple[int, int]) -> tuple[str, str]:
        """A user and an assistant message of ``words[0]``..``words[1]`` words each (the
        topic words a message may gain are counted in)."""
        lo, hi = words
        return (self.message(rng, u, lo, max(lo, hi - 2)),
                self.message(rng, u, lo, max(lo, hi - 2)))

    def band_word(self, rng: random.Random, lo_rank: int, hi_rank: int) -> str:
        return self.words[rng.randrange(lo_rank - 1, hi_rank)]

    def query(self, rng: random.Random, u: int) -> str:
        """Common words around one of the user's topics, a mid-frequency word, a rare one."""
        t = rng.choice(self.topics[u])
        m = self.band_word(rng, 300, 3_000)
        r = self.band_word(rng, 5_000, self.spec.vocab)
        template = rng.choice(
            (
                "what did we say about the {t} and {m}?",
                "how do i {m} the {t} with {r}",
                "remind me about {t} {m} again, the {r} one",
                "the {t} thing: is it {m} or {r}?",
            )
        )
        return template.format(t=t, m=m, r=r)


# -- the raw sqlite3 group-commit baseline --------------------------------------------------

# What one pipeline commit writes (store/batch.py), as plain statements run per batch with
# executemany: the session rows with every column the commit's upsert sets, the messages,
# their word index, their tool index (none here: no tool calls), the message-id high mark,
# and the outbox keys marked done.
RAW_SESSION = f"""
INSERT INTO {SESSION_COLUMNS}
VALUES (?, 'api', ?, NULL, NULL, ?, ?, ?, 0, 0, 0){SESSION_CONFLICT}
"""
RAW_MESSAGE = """
INSERT INTO messages (session_id, turn_key, ordinal, role, content, timestamp, user_id, scope)
VALUES (?, ?, ?, ?, ?, ?, ?, ?)
"""
RAW_INDEX = """
INSERT INTO messages_fts (rowid, content, scope)
SELECT id, content, scope FROM messages WHERE id > ?
"""
RAW_TOOL_INDEX = """
INSERT INTO messages_tools (rowid, tool_text, scope)
SELECT id, tool_text, scope FROM messages WHERE id > ? AND tool_text IS NOT NULL
"""
RAW_ID_HIGH = "UPDATE message_id_high SET high = max(high, ?)"
RAW_DONE = """
INSERT INTO outbox (key, session_id, segment, status, attempts, accepted_at, updated_at)
VALUES (?, ?, 1, 'done', 1, ?, ?)
"""

_RAW_PREFIX = os.urandom(6).hex()
_RAW_KEYS = itertools.count(1)

TurnSpec = tuple[str, str | None, str, str]  # session_id, user_id, user text, assistant text


def open_raw(path: Path) -> sqlite3.Connection:
    """One plain connection to a store the library made (its schema as its start leaves it:
    every table, index, FTS5 table and migration), with the pragmas of the pipeline's writer:
    WAL, synchronous=NORMAL, temp_store=MEMORY."""
    if not path.exists():
        made = threading.Thread(target=asyncio.run, args=(_make_store(path),))
        made.start()
        made.join()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA temp_store = MEMORY")
    return conn


async def _make_store(path: Path) -> None:
    store = SqliteStore(path)
    await store.open()
    await store.aclose()


def raw_group_commit(
    conn: sqlite3.Connection, turns: Sequence[TurnSpec], per_txn: int = 1000
) -> None:
    """The same rows a pipeline commit writes (``RAW_*``), ``per_txn`` turns per transaction,
    executemany per table, no asyncio.

    Building the row tuples from the turn texts is inside the timed work, as it would be in
    any program that stores turns.
    """
    key_n = _RAW_KEYS
    for start in range(0, len(turns), per_txn):
        chunk = turns[start : start + per_txn]
        now = time.time()
        sessions: dict[str, list[object]] = {}
        messages = []
        done = []
        for sid, uid, user, assistant in chunk:
            key = f"{_RAW_PREFIX}-{next(key_n):x}"
            scope = scope_tokens(uid, sid)
            messages.append((sid, key, 0, "user", user, now, uid, scope))
            messages.append((sid, key, 1, "assistant", assistant, now, uid, scope))
            done.append((key, sid, now, now))
            row = sessions.get(sid)
            if row is None:
                sessions[sid] = [sid, uid, now, now, 2]
            else:
                row[4] += 2  # type: ignore[operator]
        conn.execute("BEGIN IMMEDIATE")
        first = conn.execute("SELECT coalesce(max(id), 0) FROM messages").fetchone()[0]
        conn.executemany(RAW_SESSION, [tuple(r) for r in sessions.values()])
        conn.executemany(RAW_MESSAGE, messages)
        conn.execute(RAW_INDEX, (first,))
        conn.execute(RAW_TOOL_INDEX, (first,))
        conn.execute(RAW_ID_HIGH, (first + len(messages),))
        conn.executemany(RAW_DONE, done)
        conn.execute("COMMIT")


# Realistic chat messages for throughput: 20-30 words each, user and assistant alike.
REALISTIC_WORDS = (20, 30)


def make_turns(
    corpus: Corpus, n: int, sessions: int, seed: int, words: tuple[int, int] | None = None
) -> list[TurnSpec]:
    """``n`` turns spread round-robin over ``sessions`` sessions (interleaved ids).

    ``words``: both messages of every turn have that many words (lo, hi); by default the
    corpus's short user and longer assistant messages."""
    rng = random.Random(seed)
    users = corpus.spec.users
    out: list[TurnSpec] = []
    for i in range(n):
        s = i % sessions
        u = s % users
        if words is None:
            user, assistant = corpus.turn(rng, u)
        else:
            user, assistant = corpus.turn_of(rng, u, words)
        out.append((corpus.session_id(u, s // users), corpus.user_id(u), user, assistant))
    return out
