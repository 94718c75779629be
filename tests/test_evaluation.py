"""The backend evaluation end to end: null and SQLite (real files), Honcho against the test
server; scores and labels that follow the declared weights; the CLI's table, JSON, save and
compare; the memory tool's evaluate action."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.cli import main as cli_main
from hermes_async_memory.memory import call_memory_tool
from hermes_async_memory.memory.evaluation import (
    CHECKS,
    CLOUD_WARNING,
    SCORING,
    Scoring,
    evaluate_backends,
    recall_set,
)

from .fake_honcho import FakeHoncho
from .test_honcho_pipeline import honcho_config

OPS = 30


def by_backend(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["backend"]: e for e in report["evaluations"]}


def assert_scored_by(e: dict[str, Any], scoring: Scoring) -> None:
    """The score is the sum of its parts, each part as the scoring declares it."""
    passed = [n for n, c in e["checks"].items() if c["passed"]]
    assert e["parts"]["availability"] == (scoring.availability if e["available"] else 0)
    assert e["parts"]["function"] == sum(scoring.function[n] for n in passed)
    assert e["parts"]["privacy"] == (scoring.privacy_cloud if e["is_cloud"]
                                     else scoring.privacy_local)
    worst = max(v["p99"] for op, v in e["latency_ms"].items()
                if v and op not in ("store", "delete"))
    expected = next((p for ms, p in scoring.latency if worst < ms), scoring.latency_floor)
    assert e["parts"]["latency"] == expected
    assert e["score"] == sum(e["parts"].values())
    assert e["label"] == scoring.label(e["score"])


async def test_sqlite_and_null_are_evaluated_end_to_end(mem: MemoryPipeline) -> None:
    report = await evaluate_backends(mem, operations=OPS)
    found = by_backend(report)
    assert set(found) == {"null (disabled)", "local (SQLite)"}
    local, null = found["local (SQLite)"], found["null (disabled)"]
    # Function: every check passes on SQLite, with its reason; none that needs a stored
    # entry passes on null.
    assert set(local["checks"]) == set(CHECKS)
    assert all(c["passed"] for c in local["checks"].values()), local["checks"]
    assert not any(c["passed"] for c in null["checks"].values()), null["checks"]
    assert all(c["reason"] for c in null["checks"].values())
    # Latency over many operations, to the receipt and to visibility.
    for op in ("store", "store_visible", "retrieve", "query", "delete", "delete_visible"):
        assert local["latency_ms"][op]["n"] >= OPS, op
        assert 0 < local["latency_ms"][op]["p50"] <= local["latency_ms"][op]["p99"]
    assert local["latency_ms"]["recall"]["n"] == len(recall_set()["questions"])
    # Recall quality on the shipped set: a lexical store answers most, null none.
    assert local["recall"]["hit@3"] >= 0.6 and 0 < local["recall"]["mrr"] <= 1
    assert null["recall"] == {"questions": 16, "hit@1": 0.0, "hit@3": 0.0, "mrr": 0.0}
    # Privacy, scoring, labels.
    assert local["location"] == str(mem.settings.db_path) and not local["is_cloud"]
    for e in (local, null):
        assert_scored_by(e, SCORING)
        assert e["cleaned_up"], e["notes"]
    assert local["score"] > null["score"]
    assert report["recommendation"].startswith("Best backend: local (SQLite)")
    assert "availability 20" in report["scoring"]["explained"]
    # The scratch users are gone: nothing is left in the store.
    await mem.flush()
    assert await mem.store.memory_counts() == (0, 0)


async def test_labels_follow_the_declared_weights(mem: MemoryPipeline) -> None:
    strict = Scoring(latency=((1e-6, 20),), latency_floor=0,
                     labels=((95, "RECOMMENDED"), (70, "ACCEPTABLE")))
    report = await evaluate_backends(mem, operations=10, scoring=strict)
    local = by_backend(report)["local (SQLite)"]
    assert local["parts"] == {"availability": 20, "function": 40, "latency": 0, "privacy": 20}
    assert (local["score"], local["label"]) == (80, "ACCEPTABLE")
    assert_scored_by(local, strict)
    assert report["scoring"]["labels"] == [[95, "RECOMMENDED"], [70, "ACCEPTABLE"]]


async def test_honcho_is_evaluated_beside_local_with_the_cloud_warning(
    tmp_path: Path, fake: FakeHoncho
) -> None:
    settings = Settings(db_path=tmp_path / "m.db", backend="honcho", honcho=honcho_config(fake))
    async with MemoryPipeline(settings) as mem:
        report = await evaluate_backends(mem, operations=10)
    honcho = by_backend(report)["honcho (cloud)"]
    assert honcho["is_cloud"] and fake.base_url in honcho["location"]
    assert all(c["passed"] for c in honcho["checks"].values()), honcho["checks"]
    assert honcho["parts"]["privacy"] == SCORING.privacy_cloud
    assert any("Honcho cannot delete one message" in n for n in honcho["notes"])
    assert honcho["cleaned_up"]
    assert_scored_by(honcho, SCORING)
    local = by_backend(report)["local (SQLite)"]
    if local["score"] >= honcho["score"]:
        assert "stay local for sovereignty" in report["recommendation"]
    else:
        assert CLOUD_WARNING in report["recommendation"]


def test_the_cli_prints_a_table_saves_json_and_compares(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HONCHO_API_KEY", raising=False)
    db = tmp_path / "mine.db"
    saved = tmp_path / "run1.json"
    assert cli_main(["eval", "--db", str(db), "--operations", "10", "--json",
                     "--save", str(saved)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads(saved.read_text()) == printed
    assert {e["backend"] for e in printed["evaluations"]} == {"null (disabled)",
                                                             "local (SQLite)"}
    assert printed["your_store"] == str(db) and not db.exists()  # never your memory
    assert cli_main(["eval", "--db", str(db), "--operations", "10", "--compare",
                     str(saved)]) == 0
    out = capsys.readouterr().out
    assert "BACKEND" in out and "local (SQLite)" in out and "RECOMMENDED" in out
    assert "compared with" in out and "score =" in out
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    assert cli_main(["eval", "--db", str(db), "--compare", str(bad)]) == 2
    assert "not a report saved by eval --save" in capsys.readouterr().err


async def test_the_tool_evaluates_and_condenses_for_a_model(mem: MemoryPipeline) -> None:
    result = json.loads(await call_memory_tool(mem.memory, "ann", {"action": "evaluate"}))
    assert result["ok"] is True
    names = {b["backend"]: b for b in result["backends"]}
    assert set(names) == {"null (disabled)", "local (SQLite)"}
    assert names["local (SQLite)"]["functions_failed"] == {}
    assert set(names["null (disabled)"]["functions_failed"]) == set(CHECKS)
    assert result["recommendation"].startswith("Best backend: local (SQLite)")
    bad = json.loads(await call_memory_tool(mem.memory, "ann",
                                            {"action": "evaluate", "limit": 3}))
    assert bad == {"ok": False, "error": "action 'evaluate' takes no argument limit "
                                         "(it takes: none)"}
