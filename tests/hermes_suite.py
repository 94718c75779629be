"""Hermes Agent 0.19's own session-store tests, run against a module of ours.

``tests/test_hermes_state.py`` of the ``hermes-agent==0.19.0`` sdist tests Hermes's
``hermes_state`` module (``SessionDB``: sessions, messages, FTS5 search, pruning, export).
This runs that file, unchanged, with ``hermes_state`` mapped to another module
(``hermes_async_memory.hermes.state``), so our store is held to Hermes's own contract.

    fetch_sdist_tests()   the test file, from a cache; fetched with pip (the sdist) when missing
    run_suite(module)     pytest in a subprocess on a temporary copy of it; per-test outcomes
    load_expectations()   tests/hermes_state_expectations.json: ids known to fail against ours
    compare(...)          those expectations against a run: new failures, stale entries

``python -m tests.hermes_suite [--module M] [--classes six|all] [--write-report PATH]`` runs
it by hand and prints a table per class. docs/hermes-state-suite.md has the whole story.

The run is hermetic: its own ``pytest.ini`` (none of this project's pytest settings), no
third-party pytest plugins (``PYTEST_DISABLE_PLUGIN_AUTOLOAD``: the file needs only pytest's
``tmp_path`` and ``monkeypatch``), and a ``HERMES_HOME`` of its own, so nothing touches
``~/.hermes``. A ``conftest.py`` written next to the copy maps ``hermes_state`` before the file
is collected, and records each test's outcome as a JSON line as it happens: a run that times
out still says which tests finished and which one was running.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import platformdirs

from .processes import ROOT, child_env

HERMES_VERSION = "0.19.0"
REQUIREMENT = f"hermes-agent=={HERMES_VERSION}"
SDIST_MEMBER = f"hermes_agent-{HERMES_VERSION}/tests/test_hermes_state.py"
TEST_FILE = "test_hermes_state.py"
# sha256 of SDIST_MEMBER in the 0.19.0 sdist (sdist: ac986bed...e21c0). Checked after each
# download and on each cache hit: a cached file that differs is fetched again.
TEST_FILE_SHA256 = "f85f81c5c787b27443d3991984cab1798b4e3bbac97d2680eade7604f8f96ca6"
# The file imports nothing from the sdist's tests/ folder (which has no conftest.py or
# __init__.py): this one file is all that is extracted.

HERMES_MODULE = "hermes_state"  # Hermes's own, installed from the hermes-agent wheel
OUR_MODULE = "hermes_async_memory.hermes.state"

SIX_CLASSES: tuple[str, ...] = (
    "TestSessionLifecycle",
    "TestMessageStorage",
    "TestFTS5Search",
    "TestCounts",
    "TestDeleteAndExport",
    "TestPruneSessions",
)
# Test ids of the pinned file (TEST_FILE_SHA256), as collected by pytest 8.
SIX_CLASSES_COUNT = 135
WHOLE_FILE_COUNT = 384

EXPECTATIONS_FILE = Path(__file__).resolve().with_name("hermes_state_expectations.json")

FETCH_TIMEOUT_S = 300.0
FAILING = ("failed", "error")


class SuiteError(RuntimeError):
    """The suite could not be run (or did not finish): one line saying why."""


class SuiteUnavailable(SuiteError):
    """The test file could not be fetched."""


# -- the test file --------------------------------------------------------------------------


def cache_dir() -> Path:
    """``$HERMES_TEST_CACHE/hermes-agent-0.19.0``, else the same folder under the user cache
    dir (``~/.cache/hermes-async-memory`` on Linux)."""
    configured = os.environ.get("HERMES_TEST_CACHE", "").strip()
    base = Path(configured) if configured else Path(
        platformdirs.user_cache_dir("hermes-async-memory"))
    return base / f"hermes-agent-{HERMES_VERSION}"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _download_command(dest: Path, *, quiet: bool = True) -> list[str]:
    quiet_flags = ["--disable-pip-version-check", "--no-input", "-q"] if quiet else []
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
            *quiet_flags, REQUIREMENT, "-d", str(dest)]


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _error_line(output: str) -> str:
    """pytest's own ``ERROR: ...`` line, else the output's last line."""
    errors = [line.strip() for line in output.splitlines() if line.startswith("ERROR")]
    return errors[0] if errors else _last_line(output)


def _write_atomically(path: Path, data: bytes) -> None:
    """Write to a temporary file in ``path``'s folder, then rename it over ``path``: a reader
    sees the old file or the whole new one, never part of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would keep a shared cache from other users
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def fetch_sdist_tests() -> Path:
    """The path of Hermes 0.19.0's ``tests/test_hermes_state.py``, from the cache; when the
    cache lacks it (or holds another file), the sdist is downloaded with pip and the one file
    extracted into the cache, atomically. Raises ``SuiteUnavailable`` (one line, with the
    command to run) when that fails."""
    target = cache_dir() / TEST_FILE
    with contextlib.suppress(OSError):
        if _sha256(target.read_bytes()) == TEST_FILE_SHA256:
            return target
    with tempfile.TemporaryDirectory(prefix="hermes-sdist-") as tmp:
        command = _download_command(Path(tmp))
        by_hand = " ".join(_download_command(Path("DIR"), quiet=False))
        manual = (f"run `{by_hand}` to see why, or put {TEST_FILE}"
                  f" (the sdist's {SDIST_MEMBER}) in {target.parent}"
                  " ($HERMES_TEST_CACHE/hermes-agent-0.19.0 if set)")
        try:
            proc = subprocess.run(command, capture_output=True, text=True,
                                  timeout=FETCH_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise SuiteUnavailable(
                f"downloading the {REQUIREMENT} sdist took over {FETCH_TIMEOUT_S:.0f} s;"
                f" {manual}") from None
        if proc.returncode != 0:
            why = _last_line(proc.stderr) or _last_line(proc.stdout) or f"exit {proc.returncode}"
            raise SuiteUnavailable(
                f"could not download the {REQUIREMENT} sdist (pip: {why}); {manual}")
        archives = sorted(Path(tmp).glob("*.tar.gz"))
        if len(archives) != 1:
            raise SuiteUnavailable(
                f"pip download of {REQUIREMENT} left {[a.name for a in Path(tmp).iterdir()]},"
                f" not one .tar.gz sdist; {manual}")
        try:
            with tarfile.open(archives[0], "r:gz") as sdist:
                member = sdist.extractfile(SDIST_MEMBER)
                if member is None:
                    raise KeyError(SDIST_MEMBER)
                data = member.read()
        except (KeyError, tarfile.TarError, OSError) as exc:
            raise SuiteUnavailable(
                f"{archives[0].name} has no readable {SDIST_MEMBER} ({exc!r}); {manual}"
            ) from None
    if _sha256(data) != TEST_FILE_SHA256:
        raise SuiteUnavailable(
            f"{SDIST_MEMBER} of the downloaded sdist has sha256 {_sha256(data)}, not the pinned"
            f" {TEST_FILE_SHA256}: not the file this harness was written for")
    _write_atomically(target, data)
    return target


# -- a run ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class TestOutcome:
    outcome: str  # passed | failed | error | skipped
    message: str = ""  # the failure's (or skip's) first line

    __test__ = False  # not a pytest test class, whatever imports it


@dataclass
class SuiteResult:
    module: str
    outcomes: dict[str, TestOutcome]  # node id (test_hermes_state.py::Class::test) -> outcome
    duration_s: float
    select: list[str] | None = None
    pytest_exit: int = 0
    output_tail: str = field(default="", repr=False)

    @property
    def counts(self) -> dict[str, int]:
        found = Counter(o.outcome for o in self.outcomes.values())
        return {name: found.get(name, 0) for name in ("passed", "failed", "error", "skipped")}

    @property
    def total(self) -> int:
        return len(self.outcomes)

    @property
    def failing(self) -> dict[str, str]:
        """Failed or errored ids, with their first error line."""
        return {i: o.message for i, o in self.outcomes.items() if o.outcome in FAILING}

    def by_class(self) -> dict[str, dict[str, int]]:
        """Outcome counts per test class (``(module)`` for the file's plain functions), in
        the file's order."""
        table: dict[str, dict[str, int]] = {}
        for node_id, outcome in self.outcomes.items():
            row = table.setdefault(class_of(node_id), dict.fromkeys(
                ("passed", "failed", "error", "skipped"), 0))
            row[outcome.outcome] += 1
        return table


def class_of(node_id: str) -> str:
    parts = node_id.split("::")
    return parts[1] if len(parts) > 2 else "(module)"


_CONFTEST = '''\
"""Written by tests/hermes_suite.py (hermes-async-memory): maps ``hermes_state`` to the
module under test before the test file is collected, and records each test's outcome."""
import importlib
import json
import sys

MODULE = {module!r}
RESULTS = {results!r}

_out = open(RESULTS, "a", encoding="utf-8")


def _emit(**record):
    _out.write(json.dumps(record) + "\\n")
    _out.flush()


if MODULE != "hermes_state":
    try:
        sys.modules["hermes_state"] = importlib.import_module(MODULE)
    except BaseException as exc:
        _emit(kind="import_error", message=f"{{type(exc).__name__}}: {{exc}}")
        raise


def _first_line(report, last_e_line=False):
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, lineno, reason)
        return str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else report.longreprtext
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    if last_e_line:
        e_lines = [line[1:].strip() for line in lines if line.startswith("E ")]
        if e_lines:
            return e_lines[-1]
    return lines[0] if lines else ""


def pytest_collectreport(report):
    if report.failed:
        _emit(kind="collect_error", nodeid=report.nodeid,
              message=_first_line(report, last_e_line=True))


def pytest_runtest_logstart(nodeid, location):
    _emit(kind="start", nodeid=nodeid)


def pytest_runtest_logreport(report):
    _emit(kind="report", nodeid=report.nodeid, when=report.when, outcome=report.outcome,
          xfail=hasattr(report, "wasxfail"),
          message="" if report.passed else _first_line(report))
'''


def _node_ids(select: Sequence[str] | None) -> list[str]:
    """``TestCounts``, ``TestCounts::test_x`` or a full id: as arguments for pytest."""
    if not select:
        return [TEST_FILE]
    prefix = TEST_FILE + "::"
    return [s if s.startswith(prefix) else prefix + s for s in select]


def _child_environment(home: Path) -> dict[str, str]:
    env = {k: v for k, v in child_env().items()
           if not k.startswith(("HERMES_", "PYTEST_"))}  # the developer's shell stays out
    env["HERMES_HOME"] = str(home)
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def _kill(proc: subprocess.Popen[str]) -> None:
    """Kill the pytest process we started and anything it started (its own session)."""
    with contextlib.suppress(ProcessLookupError):
        if hasattr(os, "killpg"):
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    proc.communicate()


def _read_records(path: Path) -> list[dict[str, Any]]:
    records = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):  # a line cut short by a kill
                records.append(json.loads(line))
    return records


def _outcomes(records: Iterable[Mapping[str, Any]]) -> dict[str, TestOutcome]:
    """One outcome per test id from its setup/call/teardown reports, as pytest counts them:
    a failed setup or teardown is an error, a failed call a failure."""
    outcomes: dict[str, TestOutcome] = {}
    for rec in records:
        if rec.get("kind") != "report":
            continue
        node_id, when, outcome = rec["nodeid"], rec["when"], rec["outcome"]
        message = rec.get("message", "")
        if outcome == "skipped":
            current = TestOutcome("skipped", ("xfail: " if rec.get("xfail") else "") + message)
        elif outcome == "failed":
            current = TestOutcome("failed" if when == "call" else "error", message)
        else:
            current = TestOutcome("passed")
        previous = outcomes.get(node_id)
        # The first phase that did not pass decides (a failed call, then a failed teardown:
        # the call's failure), except that a phase failing after a skip makes an error.
        if previous is None or previous.outcome == "passed" or (
                previous.outcome == "skipped" and current.outcome in FAILING):
            outcomes[node_id] = current
    return outcomes


def run_suite(module: str, *, select: list[str] | None = None,
              timeout_s: float) -> SuiteResult:
    """Run Hermes's ``test_hermes_state.py`` (or the ``select``ed classes / tests of it) with
    ``hermes_state`` mapped to ``module`` (``"hermes_state"``: Hermes's own, no mapping), in a
    pytest subprocess, killed after ``timeout_s``. Raises ``SuiteError`` (one line) when the
    module cannot be imported, the file cannot be collected, or the run does not finish."""
    source = fetch_sdist_tests()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hermes-state-suite-") as tmp_name:
        tmp = Path(tmp_name)
        results = tmp / "results.jsonl"
        shutil.copyfile(source, tmp / TEST_FILE)
        (tmp / "conftest.py").write_text(
            _CONFTEST.format(module=module, results=str(results)), encoding="utf-8")
        (tmp / "pytest.ini").write_text(
            "[pytest]\n# written by tests/hermes_suite.py: none of the project's settings\n",
            encoding="utf-8")
        home = tmp / "hermes_home"
        home.mkdir()
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                   "-c", str(tmp / "pytest.ini"), "--rootdir", str(tmp), *_node_ids(select)]
        proc = subprocess.Popen(command, cwd=tmp, env=_child_environment(home), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill(proc)
            records = _read_records(results)
            done = {r["nodeid"] for r in records if r.get("when") == "teardown"}
            running = [r["nodeid"] for r in records if r.get("kind") == "start"
                       and r["nodeid"] not in done]
            raise SuiteError(
                f"the {module} run did not finish within {timeout_s:.0f} s ({len(done)} tests"
                f" done; running: {running[-1] if running else 'none'})") from None
        except BaseException:
            _kill(proc)
            raise
        records = _read_records(results)
    duration = time.monotonic() - started
    tail = "\n".join(output.splitlines()[-15:])
    for rec in records:
        if rec.get("kind") == "import_error":
            raise SuiteError(f"{module} cannot be imported: {rec['message']}")
    collect_errors = [r for r in records if r.get("kind") == "collect_error"]
    if collect_errors:
        first = collect_errors[0]
        raise SuiteError(f"collecting {first['nodeid'] or TEST_FILE} against {module} failed:"
                         f" {first['message']}")
    outcomes = _outcomes(records)
    if proc.returncode not in (0, 1) or not outcomes:
        raise SuiteError(f"pytest on {TEST_FILE} against {module} exited {proc.returncode}"
                         f" with {len(outcomes)} tests run: {_error_line(output)}")
    return SuiteResult(module=module, outcomes=outcomes, duration_s=duration,
                       select=list(select) if select else None,
                       pytest_exit=proc.returncode, output_tail=tail)


# -- expectations ---------------------------------------------------------------------------


def load_expectations(path: Path = EXPECTATIONS_FILE) -> dict[str, str]:
    """``{node id: reason}``: the tests known to fail against our module, one reason each."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not all(
            isinstance(k, str) and k.startswith(TEST_FILE + "::") and isinstance(v, str)
            and v.strip() for k, v in data.items()):
        raise ValueError(f"{path}: expected {{\"{TEST_FILE}::Class::test\": \"reason\"}},"
                         " one non-empty reason per test id")
    return data


def in_scope(node_id: str, classes: Sequence[str] | None) -> bool:
    """Whether ``node_id`` belongs to ``classes`` (``None``: the whole file)."""
    return classes is None or class_of(node_id) in classes


@dataclass
class Verdict:
    unexpected: dict[str, str]  # failing, not listed: id -> first error line
    stale: dict[str, str]  # listed, not failing: id -> what happened instead

    @property
    def ok(self) -> bool:
        return not self.unexpected and not self.stale

    def explain(self) -> str:
        lines = [f"{len(self.unexpected)} unexpected failures, {len(self.stale)} stale"
                 f" entries in {EXPECTATIONS_FILE.name}"]
        lines += [f"  NEW FAILURE {i}: {m}" for i, m in self.unexpected.items()]
        lines += [f"  STALE {i}: {m}" for i, m in self.stale.items()]
        return "\n".join(lines)


def compare(result: SuiteResult, expectations: Mapping[str, str],
            classes: Sequence[str] | None) -> Verdict:
    """The run's failures in scope (``classes``; ``None``: whole file) against the listed
    ones: each must be listed, and each listed one must still fail."""
    listed = {i: r for i, r in expectations.items() if in_scope(i, classes)}
    failing = {i: m for i, m in result.failing.items() if in_scope(i, classes)}
    unexpected = {i: m for i, m in failing.items() if i not in listed}
    stale: dict[str, str] = {}
    for node_id in listed:
        if node_id in failing:
            continue
        outcome = result.outcomes.get(node_id)
        if outcome is None:
            stale[node_id] = "listed but not run (renamed or removed?): remove it from the list"
        elif outcome.outcome == "passed":
            stale[node_id] = "now passes: remove it from the list"
        else:
            stale[node_id] = f"now {outcome.outcome} ({outcome.message}): remove it from the list"
    return Verdict(unexpected=unexpected, stale=stale)


# -- reports --------------------------------------------------------------------------------


def artifacts_dir() -> Path:
    """``$HERMES_TEST_ARTIFACTS/hermes_state``, else ``<repo>/.artifacts/hermes_state`` (ignored
    by git). Created on first use."""
    configured = os.environ.get("HERMES_TEST_ARTIFACTS")
    folder = (Path(configured) if configured else ROOT / ".artifacts") / "hermes_state"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def report_data(result: SuiteResult, verdict: Verdict | None = None) -> dict[str, Any]:
    data: dict[str, Any] = {
        "module": result.module,
        "hermes_agent": HERMES_VERSION,
        "test_file_sha256": TEST_FILE_SHA256,
        "select": result.select,
        "duration_s": round(result.duration_s, 3),
        "total": result.total,
        "counts": result.counts,
        "by_class": result.by_class(),
        "outcomes": {i: {"outcome": o.outcome, "message": o.message}
                     for i, o in result.outcomes.items()},
    }
    if verdict is not None:
        data["unexpected_failures"] = verdict.unexpected
        data["stale_expectations"] = verdict.stale
    return data


def write_report(path: Path, result: SuiteResult, verdict: Verdict | None = None) -> Path:
    _write_atomically(path, (json.dumps(report_data(result, verdict), indent=2) + "\n").encode())
    return path


def summary(result: SuiteResult, expectations: Mapping[str, str] | None = None) -> str:
    """A table per class, a total, and each failing id with its first error line (and the
    listed reason when it is an expected failure)."""
    rows = result.by_class()
    width = max([len("class"), *map(len, rows)])
    cols = ("passed", "failed", "error", "skipped")
    lines = [f"{result.module}: {result.total} tests in {result.duration_s:.1f} s",
             f"{'class':<{width}}  " + "  ".join(f"{c:>7}" for c in cols)]
    for name, row in rows.items():
        lines.append(f"{name:<{width}}  " + "  ".join(f"{row[c]:>7}" for c in cols))
    counts = result.counts
    lines.append(f"{'total':<{width}}  " + "  ".join(f"{counts[c]:>7}" for c in cols))
    if result.failing:
        lines.append("")
        lines.append("failing:")
        for node_id, message in result.failing.items():
            reason = (expectations or {}).get(node_id)
            note = f"  [expected: {reason}]" if reason else ""
            lines.append(f"  {node_id}: {message}{note}")
    return "\n".join(lines)


DOC_FILE = Path(__file__).resolve().parents[1] / "docs" / "hermes-state-suite.md"
DOC_MARK = "## Tests that still fail, and why"


def failing_tests_doc(expectations: dict[str, str]) -> str:
    """The doc's last section: every listed test, by class, with its reason."""
    by_class: dict[str, list[tuple[str, str]]] = {}
    for node, reason in sorted(expectations.items()):
        parts = node.split("::")
        by_class.setdefault(parts[1] if len(parts) > 2 else "(module)", []).append(
            (parts[-1], reason))
    lines = [DOC_MARK, "",
             f"{len(expectations)} of the file's tests fail against ours; each, and why "
             "(generated from `tests/hermes_state_expectations.json`: `python -m "
             "tests.hermes_suite --write-doc`).", ""]
    for cls, tests in by_class.items():
        lines += [f"### {cls}", ""]
        lines += [f"- `{name}`: {reason}" for name, reason in tests]
        lines.append("")
    return "\n".join(lines)


def write_doc(path: Path = DOC_FILE) -> None:
    text = path.read_text(encoding="utf-8")
    head = text.split(DOC_MARK)[0].rstrip("\n")
    path.write_text(head + "\n\n" + failing_tests_doc(load_expectations()), encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.hermes_suite",
        description="Run Hermes 0.19's tests/test_hermes_state.py against a module mapped in"
                    " as hermes_state.")
    parser.add_argument("--module", default=OUR_MODULE,
                        help=f"the module to test (default {OUR_MODULE};"
                             f" {HERMES_MODULE}: Hermes's own)")
    parser.add_argument("--classes", choices=("six", "all"), default="all",
                        help="the six core classes, or the whole file (default)")
    parser.add_argument("--write-report", type=Path, metavar="PATH",
                        help="write every test id's outcome to PATH as JSON")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds (default 600)")
    parser.add_argument("--write-doc", action="store_true",
                        help="rewrite docs/hermes-state-suite.md's list of failing tests from "
                             "the expectations file, and stop")
    args = parser.parse_args(argv)
    if args.write_doc:
        write_doc()
        return 0

    classes = list(SIX_CLASSES) if args.classes == "six" else None
    try:
        result = run_suite(args.module, select=classes, timeout_s=args.timeout)
    except SuiteError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # The expectations are about our module; any other module is expected to pass it all.
    expectations = load_expectations() if args.module == OUR_MODULE else {}
    verdict = compare(result, expectations, classes)
    print(summary(result, expectations))
    if args.write_report:
        print(f"\nreport: {write_report(args.write_report, result, verdict)}")
    if not verdict.ok:
        print("\n" + verdict.explain())
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
