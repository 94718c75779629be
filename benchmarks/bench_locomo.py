"""Recall relevance on LoCoMo through the public path, against BM25 rankings of single
messages over the same messages, plain and with stemming and stopwords (issue 26).

    .venv/bin/python benchmarks/bench_locomo.py DIR [--k 5,10] [--conversations 26,30]
                     [--json PATH] [--quiet] [--quick] [--check N] [--postgres]

DIR holds LoCoMo conversations, one JSON file each (shared/data/locomo-dev: five of them).
They are loaded as shared/data/README.md says, so that these figures and the issue's agree:
each conversation is one user (``locomo:<file stem>``), each session a session
(``locomo-<stem>-s<N>``); consecutive utterances form one turn, the first the user message,
the second the assistant message (an odd last utterance gets the assistant text "(no
reply)"); a message's text is ``"<speaker>: <text>"`` plus ``" [image: <blip_caption>]"``
when there is a caption. A map message text -> dia_id(s) is kept per user.

Dates: ``sync_turn(..., messages=[...])`` stores each message's ``"timestamp"`` (epoch
seconds), so each turn is given as its two messages (the same texts as ``user_content`` and
``assistant_content``), both stamped with the session's ``session_N_date_time`` ("1:56 pm on
8 May, 2023", read as UTC): the store holds the conversation's dates and a recall line shows
the session's day (``[2023-05-08 user]``), not the day of the run. The ranking does not use
dates today, and the day is as long either way: the figures are those of plain
``sync_turn(user, assistant)``.

Ours, for each k of ``--k`` (the ``recall_limit`` setting; 5 and 10 by default), twice:
1. the issue's way: a fresh store in a scratch directory; one pipeline takes every turn
   through ``sync_turn``, ``flush()``es, then asks every question. Its frequent-term set is
   the one its start read from the empty store, so no query term is dropped: the issue's
   run asked within the default 30 s refresh period, and its figures (block 521 characters
   at k=5) are reproduced only so. ``frequent_terms_refresh_s`` is set beyond any run's
   length so that a slow machine measures the same thing.
2. the same store reopened by a new pipeline: its start reads the frequent-term set of the
   full store (as a pipeline has it after its periodic refresh), and terms in more than
   max(``frequent_term_rows``, ``frequent_term_ratio`` x messages) messages are dropped from
   the queries. Rows "ours, N frequent terms out".
Each question of categories 1-4 (5, adversarial, has no answer in the conversation and is
left out): ``queue_prefetch(question)`` in a fresh session of the conversation's user, then
``wait_until`` the session's ``prefetch_status`` shows that recall's query (it has landed in
the cache; the pipeline wakes the waiter at each change: no sleep, no polling), then
``prefetch()``. One question at a time.

Which utterances a block shows. Only the recall part counts: the block's paragraph that
starts with ``RECALL_HEADER`` (a fresh session has no recent-turns part; a procedural block
after a blank line is not recall). Its entries, in rank order, are its lines
``- [YYYY-MM-DD role] <text>``, each with any following lines that do not start with "- "
(an indented continuation); the prefix is not text. Texts are compared
whitespace-normalized. An entry shows an utterance (message text M) when
  (a) the entry's text, or one of its pieces split at a newline, " / " or " | " (with or
      without a leading role label, "user: "), is an excerpt of M: split at "…" into
      fragments, every fragment is in M; a piece that does not start with "…" starts M
      (only non-word characters before it in M), and one that does not end with "…" ends
      M (only non-word characters after it); or
  (b) M, whole and at least 40 characters long, is in the entry's text at word boundaries
      (a line holding whole messages joined by a separator (a) does not split at).
(a) is what a line is today: a 16-token FTS5 snippet of one message, "…" where it was cut;
the anchoring keeps "Caroline: Hey Mel!" from showing every message that starts so. (b)
adds nothing today (``--check`` counts it); it is there for lines that join messages. On
today's lines, dropping the anchoring or reading (b) as "M's first 40 characters" moves no
hit. ``--check N`` prints N blocks with what each entry shows, to read by hand.

Evidence ids are read as released, with the released typos repaired: "D8:6; D9:17" is two
ids, "D:11:26" is D11:26, and an id naming no utterance of the conversation ("D", "D10:19"
in 42) is dropped. A question left with no evidence (two in 26) is left out: 760 questions
of categories 1-4 remain in locomo-dev, as its README counts.

Metrics, per category (1 multi-hop, 2 temporal, 3 open-domain, 4 single-hop) and overall,
at each k: hit@k (some evidence utterance shown), recall@k (the share of the question's
evidence shown, averaged over questions), MRR (1 / the rank of the first entry showing
evidence, 0 when none does), and the block's mean size in characters (the whole prefetch
block, and its recall part).

``--postgres``: the PostgreSQL store's recall too, for each k (rows "PostgreSQL k=N"): a
PostgreSQL 15 server of the tests' (``tests/pg_server.py``: initdb and pg_ctl, on
127.0.0.1), a new database upgraded (its stemmed index built), a pipeline with backend
"postgres" that takes every turn through ``sync_turn`` and replicates it there, then each
question through ``postgres.recall.recall_block`` for the conversation's user, the block
read as ours.

Baselines, in the same run, over the same messages (every stored message of that user,
"(no reply)" included), each message a document, the k best as k entries (an entry shows
the utterances with its text; its block is the k texts joined by newlines): plain BM25
(lower-cased ``\\w+`` tokens, k1=1.2, b=0.75, Lucene's idf; ``bm25s``), and the same with
NLTK's English stopword list (as ``bm25s`` ships it) taken out and Snowball English stems
(``snowballstemmer``). Ties go to the earlier message; a message scoring 0 is not ranked.
The ``bench`` extra installs both packages.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import sys
import time
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from _common import (
    FLUSH_TIMEOUT_S,
    Result,
    library_version,
    machine,
    print_table,
    quiet_logs,
    report,
    scratch_dir,
)

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.recall.cache import RECALL_HEADER

CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop"}
GROUPS: tuple[int | str, ...] = (*CATEGORIES, "all")
NO_REPLY = "(no reply)"
DATE_FORMAT = "%I:%M %p on %d %B, %Y"  # "1:56 pm on 8 May, 2023"
BM25_K1, BM25_B = 1.2, 0.75
ELLIPSIS = "…"
# Rule (b) only for a message this long: a shorter one ("Jon: Thanks!") is too often the
# start of another message that a line shows.
WHOLE_MIN_CHARS = 40
PIECE_SEPARATORS = re.compile(r"\n| / | \| ")
ENTRY_PREFIX = re.compile(r"^- (?:\[[^\]]*\] )?")
ROLE_LABEL = re.compile(r"^(?:user|assistant|system|tool): ")
TOKEN = re.compile(r"\w+")
WORD_CHAR = re.compile(r"\w")
RECALL_TIMEOUT_S = 60.0  # a recall not landed by then: the library is broken
# The run asked within the first 30 s (the default refresh period) of the pipeline
# that wrote the store: its frequent-term set was the one read at start, from the empty
# store. A period longer than any run keeps it so however slow the machine.
FROZEN_REFRESH_S = 24 * 3600.0
QUICK_CONVERSATIONS = 2


# -- the data ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Question:
    index: int  # in the conversation's qa list
    question: str
    answer: str
    category: int
    evidence: tuple[str, ...]


@dataclass
class Conversation:
    stem: str
    user: str
    # (session number, its time as epoch seconds, its turns: (user text, assistant text))
    sessions: list[tuple[int, float, list[tuple[str, str]]]]
    texts: list[str]  # every stored message, in order ("(no reply)" included)
    by_text: dict[str, list[str]]  # an utterance's message text -> its dia_id(s)
    questions: list[Question]
    dropped: int = 0  # questions of categories 1-4 left with no evidence
    index: MessageIndex = field(init=False)

    def __post_init__(self) -> None:
        self.index = MessageIndex(self.by_text)


def message_text(u: dict[str, Any]) -> str:
    text = f"{u['speaker']}: {u['text']}"
    caption = u.get("blip_caption")
    return f"{text} [image: {caption}]" if caption else text


def session_time(value: str) -> float:
    return datetime.strptime(value, DATE_FORMAT).replace(tzinfo=timezone.utc).timestamp()


def evidence_ids(raw: Iterable[str], known: set[str]) -> tuple[str, ...]:
    """A question's evidence ids as released, repaired (see the docstring), known ids only."""
    out: dict[str, None] = {}
    for item in raw:
        for part in re.split(r"[;,\s]+", item):
            part = re.sub(r"^D:(\d+:\d+)$", r"D\1", part.strip())
            if part in known:
                out[part] = None
    return tuple(out)


def load(path: Path) -> Conversation:
    data = json.loads(path.read_text())
    stem = path.stem
    numbers = sorted(int(k.split("_")[1]) for k in data if re.fullmatch(r"session_\d+", k))
    sessions = []
    texts: list[str] = []
    by_text: dict[str, list[str]] = {}
    for n in numbers:
        utterances = data[f"session_{n}"]
        turns = []
        for i in range(0, len(utterances), 2):
            pair = [message_text(u) for u in utterances[i : i + 2]]
            for u, text in zip(utterances[i : i + 2], pair, strict=True):
                by_text.setdefault(text, []).append(u["dia_id"])
            user_text, assistant_text = pair[0], pair[1] if len(pair) > 1 else NO_REPLY
            turns.append((user_text, assistant_text))
            texts += [user_text, assistant_text]
        sessions.append((n, session_time(data[f"session_{n}_date_time"]), turns))
    known = {d for ids in by_text.values() for d in ids}
    questions, dropped = [], 0
    for i, qa in enumerate(data["qa"]):
        if qa["category"] not in CATEGORIES:
            continue
        evidence = evidence_ids(qa.get("evidence", ()), known)
        if not evidence:
            dropped += 1
            continue
        questions.append(
            Question(i, qa["question"], str(qa.get("answer", "")), qa["category"], evidence)
        )
    return Conversation(stem, f"locomo:{stem}", sessions, texts, by_text, questions, dropped)


# -- which utterances an entry shows --------------------------------------------------------


def norm(text: str) -> str:
    return " ".join(text.split())


class MessageIndex:
    """A user's utterances, normalized, in one string, to find which hold a fragment."""

    def __init__(self, by_text: dict[str, list[str]]) -> None:
        self.texts = [norm(t) for t in by_text]
        self.ids = [tuple(ids) for ids in by_text.values()]
        self.starts: list[int] = []
        pos = 0
        for t in self.texts:
            self.starts.append(pos)
            pos += len(t) + 1
        self.joined = "\x00".join(self.texts)
        self.by_whole = 0

    def holding(self, fragment: str) -> set[int]:
        """The messages whose text holds ``fragment``."""
        found: set[int] = set()
        joined, starts = self.joined, self.starts
        at = joined.find(fragment)
        while at >= 0:
            found.add(bisect_right(starts, at) - 1)
            at = joined.find(fragment, at + 1)
        return found

    def excerpt_of(self, piece: str) -> set[int]:
        """Rule (a): the messages ``piece`` is an excerpt of."""
        piece = piece.strip()
        frags = [f.strip() for f in piece.split(ELLIPSIS)]
        frags = [f for f in frags if f]
        if not frags:
            return set()
        found = self.holding(max(frags, key=len))
        if not found:
            return found
        open_start, open_end = piece.startswith(ELLIPSIS), piece.endswith(ELLIPSIS)
        out = set()
        for i in found:
            text = self.texts[i]
            if not all(f in text for f in frags):
                continue
            if not open_start and WORD_CHAR.search(text[: text.find(frags[0])]):
                continue
            if not open_end:
                last = frags[-1]
                if WORD_CHAR.search(text[text.rfind(last) + len(last) :]):
                    continue
            out.add(i)
        return out

    def shown(self, entry: str) -> list[str]:
        """The dia_ids an entry's text shows (rules (a) and (b)), in message order."""
        pieces = [entry, *(PIECE_SEPARATORS.split(entry) if PIECE_SEPARATORS.search(entry)
                           else ())]
        found: set[int] = set()
        for piece in pieces:
            piece = norm(piece)
            found |= self.excerpt_of(piece)
            if ROLE_LABEL.match(piece):  # "user: <message>": the label is not its text
                found |= self.excerpt_of(ROLE_LABEL.sub("", piece, count=1))
        flat = norm(entry)
        extra = {i for i, text in enumerate(self.texts)
                 if i not in found and len(text) >= WHOLE_MIN_CHARS and _within(flat, text)}
        if extra:
            self.by_whole += 1  # entries that rule (b) added to: --check reports them
            found |= extra
        return [d for i in sorted(found) for d in self.ids[i]]


def _within(flat: str, text: str) -> bool:
    """Rule (b): ``text`` is in ``flat`` whole, at word boundaries."""
    at = flat.find(text)
    while at >= 0:
        end = at + len(text)
        if ((at == 0 or not WORD_CHAR.match(flat[at - 1]))
                and (end == len(flat) or not WORD_CHAR.match(flat[end]))):
            return True
        at = flat.find(text, at + 1)
    return False


def recall_part(block: str) -> str:
    """The block's recall hits: its paragraph headed ``RECALL_HEADER``, or ""."""
    for part in block.split("\n\n"):
        if part.startswith(RECALL_HEADER):
            return part
    return ""


def entries(part: str) -> list[str]:
    """The recall part's entries, in rank order: each "- " line with its continuation lines,
    without the "- [day role] " prefix."""
    out: list[list[str]] = []
    for line in part.split("\n")[1:]:
        if line.startswith("- "):
            out.append([ENTRY_PREFIX.sub("", line, count=1)])
        elif line.strip() and out:
            out[-1].append(ENTRY_PREFIX.sub("", line.strip(), count=1))
    return ["\n".join(e) for e in out]


# -- scoring -------------------------------------------------------------------------------


@dataclass
class Shown:
    """One system's answer to one question at one k."""

    entries: list[tuple[str, list[str]]]  # (entry text, dia_ids it shows), rank order
    block_chars: int
    recall_chars: int

    def score(self, evidence: Sequence[str], k: int) -> tuple[bool, float, float, int | None]:
        """(hit, recall, reciprocal rank, first rank) within the first k entries."""
        want = set(evidence)
        seen: set[str] = set()
        first = None
        for rank, (_, ids) in enumerate(self.entries[:k], 1):
            got = want.intersection(ids)
            if got and first is None:
                first = rank
            seen |= got
        return bool(seen), len(seen) / len(want), 1 / first if first else 0.0, first


@dataclass
class Tally:
    n: int = 0
    hits: float = 0.0
    recall: float = 0.0
    rr: float = 0.0
    block: float = 0.0
    recall_block: float = 0.0

    def add(self, hit: bool, recall: float, rr: float, shown: Shown) -> None:
        self.n += 1
        self.hits += hit
        self.recall += recall
        self.rr += rr
        self.block += shown.block_chars
        self.recall_block += shown.recall_chars

    def mean(self, attr: str) -> float:
        return getattr(self, attr) / self.n if self.n else math.nan


# -- the library ---------------------------------------------------------------------------


def write_turns(mem: MemoryPipeline, conversations: Sequence[Conversation]) -> int:
    """Every turn through ``sync_turn``, its two messages stamped with the session's date."""
    turns = 0
    for conv in conversations:
        for n, at, pairs in conv.sessions:
            sid = f"locomo-{conv.stem}-s{n}"
            for user_text, assistant_text in pairs:
                mem.sync_turn(
                    user_text, assistant_text, session_id=sid, user_id=conv.user,
                    messages=[
                        {"role": "user", "content": user_text, "timestamp": at},
                        {"role": "assistant", "content": assistant_text, "timestamp": at},
                    ],
                )
                turns += 1
    return turns


async def ask(mem: MemoryPipeline, k: int, tag: str, conversations: Sequence[Conversation]
              ) -> dict[tuple[str, int], Shown]:
    """Each question's block, through queue_prefetch and prefetch, in a fresh session."""
    out: dict[tuple[str, int], Shown] = {}
    for conv in conversations:
        user = conv.user
        for q in conv.questions:
            sid = f"locomo-{conv.stem}-q{q.index}-k{k}-{tag}"  # fresh: no recent turns
            mem.queue_prefetch(q.question, session_id=sid, user_id=user)

            def landed(sid: str = sid, user: str = user) -> bool:
                return mem.prefetch_status(sid, user_id=user).recall_query is not None

            try:
                await mem.wait_until(landed, timeout=RECALL_TIMEOUT_S)
            except TimeoutError:
                raise RuntimeError(
                    f"no recall landed within {RECALL_TIMEOUT_S:.0f} s for {conv.stem} "
                    f"question {q.index} (recall errors: {mem.stats().recall_errors})"
                ) from None
            block = mem.prefetch(q.question, session_id=sid, user_id=user)
            part = recall_part(block)
            out[(conv.stem, q.index)] = Shown(
                [(e, conv.index.shown(e)) for e in entries(part)], len(block), len(part)
            )
    return out


@dataclass
class Run:
    """One k through the library: the issue's way, then the store reopened."""

    k: int
    turns: int = 0
    write_s: float = 0.0
    ask_s: float = 0.0
    reopen_ask_s: float = 0.0
    frequent: int = 0  # terms the reopened pipeline drops
    fresh: dict[tuple[str, int], Shown] = field(default_factory=dict)
    reopened: dict[tuple[str, int], Shown] = field(default_factory=dict)


async def run_k(db: Path, k: int, conversations: Sequence[Conversation]) -> Run:
    """A fresh store at ``db``: written, flushed and asked in one pipeline (its frequent-term
    set as computed at its start, on the empty store: none), then opened again and asked
    (the set read from the full store at start)."""
    run = Run(k)
    settings = Settings(db_path=db, recall_limit=k, max_queued_turns=100_000,
                        frequent_terms_refresh_s=FROZEN_REFRESH_S)
    async with MemoryPipeline(settings) as mem:
        t0 = time.perf_counter()
        run.turns = write_turns(mem, conversations)
        await mem.flush(timeout=FLUSH_TIMEOUT_S)
        t1 = time.perf_counter()
        if mem.store.frequent_terms:
            raise RuntimeError("the frequent-term set was refreshed during the run")
        run.fresh = await ask(mem, k, "fresh", conversations)
        run.write_s, run.ask_s = t1 - t0, time.perf_counter() - t1
    async with MemoryPipeline(Settings(db_path=db, recall_limit=k)) as mem:
        run.frequent = len(mem.store.frequent_terms)
        t0 = time.perf_counter()
        run.reopened = await ask(mem, k, "reopened", conversations)
        run.reopen_ask_s = time.perf_counter() - t0
    return run


async def run_postgres(dsn: str, folder: Path, k: int, conversations: Sequence[Conversation]
                       ) -> dict[tuple[str, int], Shown]:
    """Every turn replicated to the database at ``dsn``, then each question's block from
    the PostgreSQL store's recall."""
    from hermes_async_memory.backends.base import RecallRequest
    from hermes_async_memory.postgres import open_pool
    from hermes_async_memory.postgres.recall import recall_block

    settings = Settings(db_path=folder / "locomo.db", backend="postgres", postgres_dsn=dsn,
                        recall_limit=k, max_queued_turns=100_000)
    async with MemoryPipeline(settings) as mem:
        write_turns(mem, conversations)
        await mem.flush(timeout=FLUSH_TIMEOUT_S)
        deadline = time.monotonic() + FLUSH_TIMEOUT_S
        while True:
            mark = mem.change_mark()
            if await mem.store.replica_counts("postgres") == (0, 0):
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the turns did not reach PostgreSQL")
            await mem.next_change(timeout=FLUSH_TIMEOUT_S, since=mark)
    out: dict[tuple[str, int], Shown] = {}
    async with open_pool(settings) as pool:
        for conv in conversations:
            for q in conv.questions:
                block = await recall_block(
                    pool, RecallRequest(q.question, f"locomo-{conv.stem}-q{q.index}-pg",
                                        conv.user, k), settings)
                part = recall_part(block)
                out[(conv.stem, q.index)] = Shown(
                    [(e, conv.index.shown(e)) for e in entries(part)], len(block), len(part))
    return out


def postgres_runs(ks: Sequence[int], conversations: Sequence[Conversation]
                  ) -> dict[int, dict[tuple[str, int], Shown]]:
    """``run_postgres`` for each k, each on a new database of one server for the run."""
    repo = Path(__file__).resolve().parent.parent
    if str(repo) not in sys.path:
        sys.path.insert(1, str(repo))
    from hermes_async_memory.postgres import open_pool, upgrade
    from tests.pg_server import PostgresServer, PostgresUnavailable

    async def upgraded(dsn: str) -> None:
        async with open_pool(Settings(postgres_dsn=dsn, postgres_pool_max_size=1)) as pool:
            await upgrade(pool)

    try:
        server = PostgresServer.create()
    except PostgresUnavailable as exc:
        raise SystemExit(f"bench_locomo --postgres: {exc}") from None
    out = {}
    try:
        server.start()
        for k in ks:
            dsn = server.create_database("locomo")
            asyncio.run(upgraded(dsn))
            with scratch_dir("locomo-pg") as tmp:
                out[k] = asyncio.run(run_postgres(dsn, tmp, k, conversations))
    finally:
        server.cleanup()
    return out


# -- the baselines -------------------------------------------------------------------------


def plain_tokens(text: str) -> list[str]:
    return TOKEN.findall(text.lower())


def stemmed_tokenizer() -> Callable[[str], list[str]]:
    import snowballstemmer
    from bm25s.stopwords import STOPWORDS_EN_PLUS  # NLTK's English list (179 words)

    stop = frozenset(STOPWORDS_EN_PLUS)
    stem = snowballstemmer.stemmer("english").stemWords

    def tokens(text: str) -> list[str]:
        return list(stem([t for t in TOKEN.findall(text.lower()) if t not in stop]))

    return tokens


class Ranker:
    """BM25 over one user's messages, each message one document."""

    def __init__(self, texts: Sequence[str], tokenize: Callable[[str], list[str]]) -> None:
        import bm25s

        self.tokenize = tokenize
        self.texts = list(texts)
        self.model = bm25s.BM25(k1=BM25_K1, b=BM25_B, method="lucene")
        self.model.index([tokenize(t) for t in self.texts], show_progress=False)

    def top(self, query: str, k: int) -> list[int]:
        import numpy as np

        ids = self.model.get_tokens_ids(self.tokenize(query))
        if not ids:
            return []
        scores = self.model.get_scores_from_ids(ids)
        order = np.argsort(-scores, kind="stable")[:k]
        return [int(i) for i in order if scores[i] > 0]


def baseline(conv: Conversation, ranker: Ranker, k: int) -> dict[tuple[str, int], Shown]:
    out = {}
    for q in conv.questions:
        texts = [ranker.texts[i] for i in ranker.top(q.question, k)]
        block = "\n".join(texts)
        out[(conv.stem, q.index)] = Shown(
            [(t, list(conv.by_text.get(t, ()))) for t in texts], len(block), len(block)
        )
    return out


# -- the run -------------------------------------------------------------------------------


def fmt3(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:.2f}"


def main() -> list[Result]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir", type=Path, help="a folder of LoCoMo conversations (<stem>.json)")
    p.add_argument("--k", default="5,10", help="recall_limit values, comma-separated")
    p.add_argument("--conversations", default=None,
                   help="file stems to run, comma-separated (default: all in DIR)")
    p.add_argument("--json", type=Path, default=None,
                   help="write the result rows and every question's entries here")
    p.add_argument("--quiet", action="store_true", help="only the table and the result rows")
    p.add_argument("--quick", action="store_true",
                   help=f"only the first {QUICK_CONVERSATIONS} conversations")
    p.add_argument("--check", type=int, default=0, metavar="N",
                   help="print N blocks (ours, the first k) with what the matcher found")
    p.add_argument("--postgres", action="store_true",
                   help="the PostgreSQL store's recall too (a server of the tests' own)")
    args = p.parse_args()
    quiet_logs()
    ks = sorted({int(x) for x in args.k.split(",") if x.strip()})
    if not ks or min(ks) < 1:
        p.error("--k needs positive integers")
    paths = sorted(args.dir.glob("*.json"), key=lambda q: (len(q.stem), q.stem))
    if args.conversations:
        wanted = [s.strip() for s in args.conversations.split(",") if s.strip()]
        missing = [s for s in wanted if not (args.dir / f"{s}.json").exists()]
        if missing:
            p.error(f"no {', '.join(missing)} in {args.dir}")
        paths = [args.dir / f"{s}.json" for s in wanted]
    if args.quick:
        paths = paths[:QUICK_CONVERSATIONS]
    if not paths:
        p.error(f"no conversations (*.json) in {args.dir}")

    def say(line: str) -> None:
        if not args.quiet:
            print(line, flush=True)

    began = time.perf_counter()
    convs = [load(path) for path in paths]
    n_q = sum(len(c.questions) for c in convs)
    n_turns = sum(len(s[2]) for c in convs for s in c.sessions)
    print(
        f"bench_locomo: {len(convs)} conversations ({', '.join(c.stem for c in convs)}), "
        f"{n_turns:,} turns, {sum(len(c.texts) for c in convs):,} messages, {n_q} questions "
        f"of categories 1-4 ({sum(c.dropped for c in convs)} left out: no evidence); "
        f"k = {', '.join(map(str, ks))} ({machine()}; library {library_version()})",
        flush=True,
    )

    runs: dict[int, Run] = {}
    for k in ks:
        with scratch_dir("locomo") as tmp:
            run = runs[k] = asyncio.run(run_k(tmp / "locomo.db", k, convs))
        say(f"k={k}: {run.turns:,} turns through sync_turn + flush in {run.write_s:.2f} s; "
            f"{n_q} recalls {run.ask_s:.2f} s ({run.ask_s / n_q * 1e3:.2f} ms each); "
            f"reopened ({run.frequent} frequent terms dropped): {run.reopen_ask_s:.2f} s")

    pg: dict[int, dict[tuple[str, int], Shown]] = {}
    if args.postgres:
        t0 = time.perf_counter()
        pg = postgres_runs(ks, convs)
        say(f"PostgreSQL: {len(ks)} runs in {time.perf_counter() - t0:.2f} s")

    t0 = time.perf_counter()
    stemmed = stemmed_tokenizer()
    kmax = max(ks)
    bases: dict[str, dict[tuple[str, int], Shown]] = {"plain BM25": {}, "stemmed BM25": {}}
    for conv in convs:
        bases["plain BM25"].update(baseline(conv, Ranker(conv.texts, plain_tokens), kmax))
        bases["stemmed BM25"].update(baseline(conv, Ranker(conv.texts, stemmed), kmax))
    say(f"baselines in {time.perf_counter() - t0:.2f} s")

    frequent = runs[ks[0]].frequent
    refreshed = f"ours, {frequent} frequent terms out,"
    # (label, k, per-question answers); a baseline's entries are its kmax best
    systems: list[tuple[str, int, dict[tuple[str, int], Shown]]] = [
        *((f"ours k={k}", k, runs[k].fresh) for k in ks),
        *((f"{refreshed} k={k}", k, runs[k].reopened) for k in ks),
        *((f"PostgreSQL k={k}", k, pg[k]) for k in ks if k in pg),
        *((f"{name} k={k}", k, shown) for name, shown in bases.items() for k in ks),
    ]
    tallies: dict[str, dict[int | str, Tally]] = {}
    per_question: dict[tuple[str, int], dict[str, Any]] = {}
    for label, k, answers in systems:
        t = tallies[label] = {c: Tally() for c in GROUPS}
        for conv in convs:
            for q in conv.questions:
                shown = answers[(conv.stem, q.index)]
                if len(shown.entries) > k:  # a baseline's: the block is of k
                    chars = len("\n".join(e for e, _ in shown.entries[:k]))
                    shown = Shown(shown.entries[:k], chars, chars)
                hit, rec, rr, first = shown.score(q.evidence, k)
                t[q.category].add(hit, rec, rr, shown)
                t["all"].add(hit, rec, rr, shown)
                row = per_question.setdefault((conv.stem, q.index), {
                    "conversation": conv.stem, "qa_index": q.index, "question": q.question,
                    "answer": q.answer, "category": q.category, "evidence": list(q.evidence),
                    "systems": {},
                })
                row["systems"][label] = {
                    "hit": hit, "recall": round(rec, 4), "first_rank": first,
                    "block_chars": shown.block_chars,
                    "entries": [{"rank": r, "shows": ids, "text": text}
                                for r, (text, ids) in enumerate(shown.entries, 1)],
                }

    if args.check:
        check(convs, runs[ks[0]].fresh, args.check)

    print()
    print("hit@k recall@k MRR, per category ("
          + ", ".join(f"{CATEGORIES[c]} {tallies[systems[0][0]][c].n}" for c in CATEGORIES)
          + f" questions) and all {n_q}; block: mean characters, whole / recall part")
    print_table(
        ["system", *CATEGORIES.values(), "all", "block"],
        [
            [label,
             *(f"{fmt3(t.mean('hits'))} {fmt3(t.mean('recall'))} {fmt3(t.mean('rr'))}"
               for t in (tallies[label][c] for c in GROUPS)),
             f"{tallies[label]['all'].mean('block'):.0f} / "
             f"{tallies[label]['all'].mean('recall_block'):.0f}"]
            for label, _, _ in systems
        ],
    )

    def hits(name: str) -> list[float]:
        return [tallies[f"{name} k={k}"]["all"].mean("hits") for k in ks]

    def block_at(name: str) -> str:
        return f"{tallies[f'{name} k={ks[0]}']['all'].mean('block'):,.0f} chars"

    def slash(values: Iterable[float]) -> str:
        return " / ".join(fmt3(v) for v in values)

    def ratio(a: Sequence[float], b: Sequence[float]) -> str:
        return " / ".join(f"{x / y:.2f}x" if y else "n/a" for x, y in zip(a, b, strict=True))

    at = " / ".join(f"hit@{k}" for k in ks)
    head = f"LoCoMo recall, {len(convs)} conversations, {n_q} questions (cat. 1-4)"
    stem_what = ("BM25, Snowball stems, stopwords out, single messages "
                 f"{slash(hits('stemmed BM25'))}")
    results = [
        Result(f"{head}: {at} (mean block at k={ks[0]})",
               f"{slash(hits('ours'))} ({block_at('ours')})", stem_what,
               ratio(hits("ours"), hits("stemmed BM25")), "—", None),
        Result(f"{head}: {at}, vs plain BM25",
               slash(hits("ours")), f"plain BM25, single messages {slash(hits('plain BM25'))}",
               ratio(hits("ours"), hits("plain BM25")), "—", None),
        Result(f"{head}: {at}, store reopened ({frequent} frequent terms dropped; mean block "
               f"at k={ks[0]})",
               f"{slash(hits(refreshed))} ({block_at(refreshed)})", stem_what,
               ratio(hits(refreshed), hits("stemmed BM25")), "—", None),
    ]
    if pg:
        results.append(Result(
            f"{head}: {at}, PostgreSQL store (mean block at k={ks[0]})",
            f"{slash(hits('PostgreSQL'))} ({block_at('PostgreSQL')})", stem_what,
            ratio(hits("PostgreSQL"), hits("stemmed BM25")), "—", None))
    report(results, None)
    print()
    for r in results:
        print(f"| {r.benchmark} | {r.result} | {r.baseline} | {r.ratio} | {r.goal} | — |")
    print(f"\nwhole run {time.perf_counter() - began:.1f} s")

    if args.json is not None:
        write_json(args.json, results, per_question, {
            "conversations": [c.stem for c in convs], "k": ks, "questions": n_q,
            "frequent_terms_reopened": frequent, "library": library_version(),
            "machine": machine(),
        })
    return results


def write_json(path: Path, results: Sequence[Result], per_question: dict[tuple[str, int],
               dict[str, Any]], run: dict[str, Any]) -> None:
    """The rows (what run_all.py reads) and every question, one a line, to diff two runs."""
    from dataclasses import asdict

    questions = ",\n".join(json.dumps(per_question[key], ensure_ascii=False)
                           for key in sorted(per_question, key=lambda k: (len(k[0]), k)))
    path.write_text(
        "{" + f'"run": {json.dumps(run)},\n"rows": '
        + json.dumps([asdict(r) for r in results], ensure_ascii=False)
        + f',\n"questions": [\n{questions}\n]}}\n'
    )


def check(convs: Sequence[Conversation], answers: dict[tuple[str, int], Shown], n: int) -> None:
    """Print n blocks spread over the run, each entry with the utterances it shows."""
    keys = [(c, q) for c in convs for q in c.questions]
    shows = [len(ids) for a in answers.values() for _, ids in a.entries]
    print(f"\nmatcher: {sum(c.index.by_whole for c in convs)} entries of all our runs gained "
          f"an utterance by rule (b); of the {len(shows)} entries printed from: "
          f"{shows.count(0)} show no utterance, {sum(n > 1 for n in shows)} more than one")
    step = max(1, len(keys) // max(1, n))
    for conv, q in keys[::step][:n]:
        shown = answers[(conv.stem, q.index)]
        print(f"\n[{conv.stem} q{q.index} cat {q.category}] {q.question}  "
              f"evidence {list(q.evidence)}")
        for rank, (text, ids) in enumerate(shown.entries, 1):
            mark = "*" if set(ids) & set(q.evidence) else " "
            print(f" {mark}{rank:>2}. {text}\n      shows {ids}")


if __name__ == "__main__":
    main()
    sys.exit(0)
