"""Backend evaluation (seed 000's, done honestly): the same workload against every key-value
backend there is, measured through the real accept path.

For each backend, on scratch users that are removed afterwards:
- latency: p50 and p99 over many operations of ``store`` and ``delete`` (to the receipt, and
  to visibility: committed here, and for Honcho also sent there), ``retrieve``, ``query``
  and ``recall`` (the labelled questions, asked through ``query``);
- function: store, retrieve, query, list, delete, and isolation between two users, each
  pass or fail with the reason;
- recall quality: hit@1, hit@3 and MRR on the labelled set shipped in the package
  (``data/recall_set.json``);
- privacy: where the data lives, whether it leaves the machine, whether a key is needed.

The score keeps the seed's structure and labels; its weights and thresholds are ``SCORING``,
which the report prints with the scores.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import HermesMemoryError, describe
from .api import KeyValueMemory
from .backends import BackendLimitError, HonchoMemory, Memory, NullMemory

if TYPE_CHECKING:
    from ..pipeline import MemoryPipeline
    from ..settings import Settings

CHECKS = ("store", "retrieve", "query", "list", "delete", "isolation")
LATENCY_OPS = ("store", "store_visible", "retrieve", "query", "recall", "delete",
               "delete_visible")


@dataclass(frozen=True)
class Scoring:
    """How a backend's score (0-100) is made: the seed's four parts and its labels."""

    availability: int = 20  # is_available() is true
    # 40 for function, shared by the checks; a failed check earns none of its share.
    function: Mapping[str, int] = field(default_factory=lambda: {
        "store": 8, "retrieve": 8, "query": 8, "list": 5, "delete": 5, "isolation": 6})
    # Latency, on the worst p99 of the operations (writes to visibility): the points of the
    # first threshold it is under, else ``latency_floor``.
    latency: tuple[tuple[float, int], ...] = ((10.0, 20), (50.0, 15), (200.0, 10))
    latency_floor: int = 5
    privacy_local: int = 20  # the data stays on this machine
    privacy_cloud: int = 5  # the data leaves it
    labels: tuple[tuple[int, str], ...] = (
        (80, "RECOMMENDED"), (60, "ACCEPTABLE"), (40, "MARGINAL"))
    lowest_label: str = "NOT RECOMMENDED"
    hit_k: int = 3  # hit@k reports k = 1 and this

    def explain(self) -> str:
        fn = ", ".join(f"{k} {v}" for k, v in self.function.items())
        lat = ", ".join(f"< {ms:g} ms: {pts}" for ms, pts in self.latency)
        lab = ", ".join(f">= {s}: {n}" for s, n in self.labels)
        return (f"score = availability {self.availability} + function "
                f"{sum(self.function.values())} ({fn}) + latency up to "
                f"{max(p for _, p in self.latency)} (worst p99 {lat}, else "
                f"{self.latency_floor}) + privacy {self.privacy_local} local / "
                f"{self.privacy_cloud} cloud; labels {lab}, else {self.lowest_label}")

    def label(self, score: int) -> str:
        return next((name for least, name in self.labels if score >= least), self.lowest_label)


SCORING = Scoring()
CLOUD_WARNING = ("WARNING: Cloud backend has privacy trade-offs. Data leaves your machine. "
                 "Consider the local backend for sovereignty.")


@dataclass
class Evaluation:
    backend: str
    is_cloud: bool
    available: bool
    location: str
    key_required: bool
    operations: int
    latency_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # op -> p50, p99
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> passed, reason
    recall: dict[str, float] = field(default_factory=dict)  # hit@1, hit@k, mrr
    notes: list[str] = field(default_factory=list)
    cleaned_up: bool = False
    score: int = 0
    parts: dict[str, int] = field(default_factory=dict)
    label: str = ""


def recall_set() -> dict[str, Any]:
    """The labelled conversations and questions shipped with the package."""
    text = resources.files(__package__).joinpath("data/recall_set.json").read_text("utf-8")
    data: dict[str, Any] = json.loads(text)
    return data


def percentiles(samples: Sequence[float]) -> dict[str, float]:
    """p50 and p99 (nearest rank) of ``samples``, in ms."""
    if not samples:
        return {}
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]

    return {"p50": round(pick(0.50) * 1e3, 4), "p99": round(pick(0.99) * 1e3, 4),
            "n": len(ordered)}


async def evaluate_backend(memory: Memory, *, operations: int = 200,
                           scoring: Scoring = SCORING) -> Evaluation:
    """Run the workload against one backend, on scratch users removed afterwards."""
    ev = Evaluation(memory.backend_name, memory.is_cloud, memory.is_available(),
                    str(memory.location), bool(memory.key_required), operations)
    tag = os.urandom(4).hex()
    user, other = f"eval-{tag}-a", f"eval-{tag}-b"
    written: dict[str, set[str]] = {user: set(), other: set()}
    try:
        await _workload(memory, ev, user, other, written, operations, scoring)
    except (HermesMemoryError, TimeoutError, OSError) as exc:
        ev.notes.append(f"the workload stopped: {describe(exc)}")
    finally:
        ev.cleaned_up = await _clean_up(memory, ev, written)
    _score(memory, ev, scoring)
    return ev


async def _workload(memory: Memory, ev: Evaluation, user: str, other: str,
                    written: dict[str, set[str]], n: int, scoring: Scoring) -> None:
    clock = time.perf_counter
    ack: list[float] = []
    visible: list[float] = []
    for i in range(n):
        key = f"k{i:05d}"
        t0 = clock()
        await memory.store(user, key, f"value {i} word{i % 10} eval", {"i": i})
        t1 = clock()
        await memory.settled(user)
        ack.append(t1 - t0)
        visible.append(clock() - t0)
        written[user].add(key)
    ev.latency_ms["store"], ev.latency_ms["store_visible"] = percentiles(ack), percentiles(visible)
    ev.latency_ms["retrieve"] = percentiles(
        await _timed(n, lambda i: memory.retrieve(user, f"k{i % n:05d}")))
    ev.latency_ms["query"] = percentiles(
        await _timed(n, lambda i: memory.query(user, f"word{i % 10}", 5)))

    checks = ev.checks
    # store and retrieve: a value read back whole; an update keeps created_at.
    await memory.store(user, "probe", "first value", {"kind": "probe"})
    written[user].add("probe")
    await memory.settled(user)
    first = await memory.retrieve(user, "probe")
    await memory.store(user, "probe", "second value", {"kind": "probe", "v": 2})
    await memory.settled(user)
    second = await memory.retrieve(user, "probe")
    checks["store"] = _check(
        second is not None and second.value == "second value"
        and second.metadata == {"kind": "probe", "v": 2}
        and first is not None and second.created_at == first.created_at,
        "a stored entry is read back, and an update keeps created_at",
        "a stored entry was not read back" if first is None else
        "an update lost the value, the metadata or created_at")
    missing = await memory.retrieve(user, "no-such-key")
    checks["retrieve"] = _check(
        missing is None and first is not None and first.value == "first value",
        "an entry is retrieved by key; an absent key gives none",
        "retrieve did not give back what was stored" if first is None or missing is None
        else "an absent key gave an entry")
    await memory.store(user, "hobby", "plays the bassoon in a quartet")
    written[user].add("hobby")
    await memory.settled(user)
    found = await memory.query(user, "bassoon", 3)
    checks["query"] = _check(bool(found) and found[0].key == "hobby",
                             "a word of a value finds its entry first",
                             f"query for 'bassoon' gave {[e.key for e in found][:3]}")
    keys = set(await memory.list_keys(user))
    checks["list"] = _check(keys == written[user], "list_keys names every key stored",
                            f"list_keys gave {len(keys)} keys for {len(written[user])} stored")
    # Isolation: the other user sees none of these, and keeps their own.
    await memory.store(other, "hobby", "collects stamps")
    written[other].add("hobby")
    await memory.settled(other)
    theirs = await memory.retrieve(other, "hobby")
    leaked = (await memory.query(other, "bassoon", 3) or
              set(await memory.list_keys(other)) - written[other])
    mine = await memory.retrieve(user, "hobby")
    checks["isolation"] = _check(
        not leaked and theirs is not None and theirs.value == "collects stamps"
        and mine is not None and mine.value.startswith("plays"),
        "two users' entries never mix",
        "one user saw another's entries" if leaked else
        "a user's own entry was not there to keep apart")

    data = recall_set()
    for conv in data["conversations"]:
        await memory.store(user, f"conv:{conv['id']}", conv["text"])
        written[user].add(f"conv:{conv['id']}")
    await memory.settled(user)
    ranks: list[int | None] = []
    times: list[float] = []
    for q in data["questions"]:
        t0 = clock()
        hits = await memory.query(user, q["q"], 5)
        times.append(clock() - t0)
        order = [e.key for e in hits]
        want = f"conv:{q['answer']}"
        ranks.append(order.index(want) + 1 if want in order else None)
    ev.latency_ms["recall"] = percentiles(times)
    k = scoring.hit_k
    ev.recall = {"questions": len(ranks),
                 "hit@1": round(sum(r == 1 for r in ranks) / len(ranks), 3),
                 f"hit@{k}": round(sum(r is not None and r <= k for r in ranks) / len(ranks), 3),
                 "mrr": round(sum(1 / r for r in ranks if r) / len(ranks), 3)}

    # delete: gone from retrieve and list (timed in the clean-up, over every key).
    await _delete(memory, ev, user, "probe")
    written[user].discard("probe")
    await memory.settled(user)
    gone = await memory.retrieve(user, "probe") is None
    listed = "probe" in await memory.list_keys(user)
    ok = gone and not listed and first is not None
    checks["delete"] = _check(ok, "a deleted entry is gone from retrieve and list",
                              "nothing was stored to delete" if first is None else
                              "a deleted entry was still there")


async def _timed(n: int, op: Callable[[int], Awaitable[object]]) -> list[float]:
    samples = []
    for i in range(n):
        t0 = time.perf_counter()
        await op(i)
        samples.append(time.perf_counter() - t0)
    return samples


async def _delete(memory: Memory, ev: Evaluation, user: str, key: str) -> None:
    try:
        await memory.delete(user, key)
    except BackendLimitError as exc:
        note = f"delete: {exc}"
        if note not in ev.notes:
            ev.notes.append(note)


async def _clean_up(memory: Memory, ev: Evaluation, written: dict[str, set[str]]) -> bool:
    """Delete every scratch entry (timing each delete); whether none is left."""
    ack: list[float] = []
    visible: list[float] = []
    try:
        for user, keys in written.items():
            for key in sorted(keys):
                t0 = time.perf_counter()
                await _delete(memory, ev, user, key)
                ack.append(time.perf_counter() - t0)
                await memory.settled(user)
                visible.append(time.perf_counter() - t0)
        if ack:
            ev.latency_ms["delete"] = percentiles(ack)
            ev.latency_ms["delete_visible"] = percentiles(visible)
        left = [user for user in written if await memory.list_keys(user)]
        if left:
            ev.notes.append(f"clean-up left entries of {len(left)} scratch users")
        return not left
    except (HermesMemoryError, TimeoutError, OSError) as exc:
        ev.notes.append(f"clean-up failed: {describe(exc)}")
        return False


def _check(passed: bool, what: str, why_not: str) -> dict[str, Any]:
    return {"passed": bool(passed), "reason": what if passed else why_not}


def _score(memory: Memory, ev: Evaluation, scoring: Scoring) -> None:
    parts = {"availability": scoring.availability if ev.available else 0,
             "function": sum(w for name, w in scoring.function.items()
                             if ev.checks.get(name, {}).get("passed"))}
    worst = max((v["p99"] for op, v in ev.latency_ms.items()
                 if v and op not in ("store", "delete")), default=None)
    if worst is None:
        parts["latency"] = 0
    else:
        parts["latency"] = next((pts for ms, pts in scoring.latency if worst < ms),
                                scoring.latency_floor)
    parts["privacy"] = scoring.privacy_cloud if memory.is_cloud else scoring.privacy_local
    ev.parts = parts
    ev.score = sum(parts.values())
    ev.label = scoring.label(ev.score)


def recommendation(evaluations: Sequence[Evaluation]) -> str:
    """The seed's summary: the best backend that stores, the cloud warning, local vs cloud."""
    viable = [e for e in evaluations if e.available and e.backend != NullMemory.backend_name]
    if not viable:
        return "No viable backends found: memory stays off (null)."
    best = max(viable, key=lambda e: (e.score, not e.is_cloud))
    parts = [f"Best backend: {best.backend} (score {best.score}, {best.label})."]
    if best.is_cloud:
        parts.append(CLOUD_WARNING)
    local = [e.score for e in viable if not e.is_cloud]
    cloud = [e.score for e in viable if e.is_cloud]
    if local and cloud:
        if max(local) >= max(cloud):
            parts.append(f"Local (score {max(local)}) matches or beats cloud (score "
                         f"{max(cloud)}): stay local for sovereignty.")
        else:
            parts.append(f"Cloud (score {max(cloud)}) outperforms local (score {max(local)}) "
                         "but adds a cloud dependency.")
    return " ".join(parts)


def candidates(pipeline: MemoryPipeline) -> list[Memory]:
    """Every backend this pipeline can offer: null (the baseline), the local store, and
    Honcho when the pipeline replicates to it."""
    found: list[Memory] = [NullMemory(), KeyValueMemory(pipeline)]
    if pipeline.backend.name == "honcho" and pipeline.store.replica is not None:
        found.append(HonchoMemory(pipeline))
    return found


async def evaluate_backends(pipeline: MemoryPipeline, *, operations: int = 200,
                            scoring: Scoring = SCORING) -> dict[str, Any]:
    """Evaluate every backend ``pipeline`` offers (``candidates``); the report as a dict
    (JSON-ready): each evaluation, the recommendation, and the scoring explained."""
    evaluations = [await evaluate_backend(m, operations=operations, scoring=scoring)
                   for m in candidates(pipeline)]
    return {
        "version": 1,
        "at": time.time(),
        "operations": operations,
        # As JSON has it (tuples as lists), so a saved report reads back equal.
        "scoring": {**json.loads(json.dumps(asdict(scoring))), "explained": scoring.explain()},
        "backends_evaluated": len(evaluations),
        "evaluations": [asdict(e) for e in evaluations],
        "recommendation": recommendation(evaluations),
    }


async def evaluate_scratch(settings: Settings, *, operations: int = 200,
                           scoring: Scoring = SCORING) -> dict[str, Any]:
    """``evaluate_backends`` on a scratch store in a temporary folder, removed after: never on
    your memory (the store at ``settings.db_path``), which the report names (``your_store``).
    The backends are those ``settings`` offer; Honcho's figures, when it is configured, come
    from the configured server, on scratch users removed after."""
    from ..pipeline import MemoryPipeline

    with tempfile.TemporaryDirectory(prefix="hermes-memory-eval-") as scratch:
        local = settings.replace(db_path=Path(scratch) / "eval.db", role="embedded")
        async with MemoryPipeline(local) as pipeline:
            report = await evaluate_backends(pipeline, operations=operations, scoring=scoring)
    report["scratch_store"] = "a temporary folder, removed after the run"
    report["your_store"] = str(settings.db_path)
    return report


def evaluate_scratch_blocking(settings: Settings, *, operations: int = 200,
                              scoring: Scoring = SCORING) -> dict[str, Any]:
    """``evaluate_scratch`` for synchronous code (seed 000's ``evaluate_backends()``): it runs
    on an event loop of its own.

    Raises:
        RuntimeError: called from a thread that runs an event loop (await
            ``evaluate_scratch`` there).
    """
    return asyncio.run(evaluate_scratch(settings, operations=operations, scoring=scoring))


def compare(now: Mapping[str, Any], before: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per backend in both reports: score and label then and now, and each operation's
    p99 then and now."""
    earlier = {e["backend"]: e for e in before.get("evaluations", [])}
    rows = []
    for e in now.get("evaluations", []):
        was = earlier.get(e["backend"])
        if was is None:
            continue
        ops = {op: (was["latency_ms"].get(op, {}).get("p99"), v.get("p99"))
               for op, v in e["latency_ms"].items()}
        rows.append({"backend": e["backend"], "score": (was["score"], e["score"]),
                     "label": (was["label"], e["label"]), "p99_ms": ops,
                     "mrr": (was["recall"].get("mrr"), e["recall"].get("mrr"))})
    return rows
