"""Hermes Agent 0.19's own session-store tests (``tests/test_hermes_state.py`` of its sdist),
run against our ``hermes_async_memory.hermes.state`` mapped in as ``hermes_state``
(tests/hermes_suite.py; docs/hermes-state-suite.md).

One pytest subprocess per test here. The first run fetches the sdist with pip into a cache;
later runs read the cached file. The harness is proven on Hermes's own ``hermes_state``,
which must pass; against ours, the failures must be exactly those listed in
tests/hermes_state_expectations.json, and every test id's outcome goes to a JSON report
under ``$HERMES_TEST_ARTIFACTS/hermes_state`` (else ``.artifacts/hermes_state``).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from . import hermes_suite as hs

# One subprocess each: the whole file takes ~7 s here; generous for a busy two-core CI.
TIMEOUT_S = 300.0


def _run(module: str, classes: Sequence[str] | None) -> hs.SuiteResult:
    failure: str | None = None
    try:
        return hs.run_suite(module, select=list(classes) if classes else None,
                            timeout_s=TIMEOUT_S)
    except hs.SuiteError as exc:
        failure = str(exc)  # failed below, outside this block: one line, no chained error
    pytest.fail(failure, pytrace=False)


def _counts_line(result: hs.SuiteResult) -> str:
    counts = ", ".join(f"{n} {name}" for name, n in result.counts.items())
    return f"{result.module}: {result.total} tests, {counts} in {result.duration_s:.1f} s"


def _check_ours(classes: Sequence[str] | None, report_name: str) -> None:
    result = _run(hs.OUR_MODULE, classes)
    verdict = hs.compare(result, hs.load_expectations(), classes)
    report = hs.write_report(hs.artifacts_dir() / report_name, result, verdict)
    print(_counts_line(result))
    print(f"report: {report}")
    assert verdict.ok, f"{_counts_line(result)}\n{verdict.explain()}\nreport: {report}"


def test_harness_runs_hermes_own_store() -> None:
    """The six core classes against Hermes's real hermes_state (from the hermes-agent wheel):
    all pass, and all 135 ran, so a failure against ours is ours, not the harness's."""
    result = _run(hs.HERMES_MODULE, hs.SIX_CLASSES)
    print(_counts_line(result))
    assert result.failing == {}, f"{_counts_line(result)}\n" + "\n".join(
        f"  {i}: {m}" for i, m in result.failing.items())
    assert result.counts["passed"] == result.total == hs.SIX_CLASSES_COUNT, _counts_line(result)
    assert {hs.class_of(i) for i in result.outcomes} == set(hs.SIX_CLASSES)


def test_six_classes_against_ours() -> None:
    _check_ours(hs.SIX_CLASSES, "six_classes.json")


@pytest.mark.slow
def test_whole_file_against_ours() -> None:
    _check_ours(None, "whole_file.json")


def test_the_doc_lists_every_failing_test_with_its_reason() -> None:
    """docs/hermes-state-suite.md says which of Hermes's tests fail against ours and why: the
    list is the expectations file's, regenerated with ``--write-doc`` when that changes."""
    doc = hs.DOC_FILE.read_text(encoding="utf-8")
    section = doc[doc.index(hs.DOC_MARK):]
    assert section.rstrip("\n") == hs.failing_tests_doc(
        hs.load_expectations()).rstrip("\n"), (
        "run python -m tests.hermes_suite --write-doc")
