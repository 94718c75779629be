"""The ``hermes-memory`` command: subcommands, and errors as one line instead of a traceback."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from hermes_async_memory import cli

from .processes import child_env

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 60.0
# The console script pip installs next to the interpreter (pyproject's [project.scripts]).
CONSOLE_SCRIPT = Path(sys.executable).with_name("hermes-memory")


def hermes_memory(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hermes_async_memory.cli", *args], capture_output=True,
        text=True, env=child_env(**env), timeout=RUN_TIMEOUT_S, check=False,
    )


def assert_one_error_line(result: subprocess.CompletedProcess[str], code: int) -> str:
    assert result.returncode == code, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("hermes-memory worker: error: ")
    return lines[0]


def test_help_lists_the_worker_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    assert "worker" in capsys.readouterr().out


def test_no_command_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


def test_worker_help_shows_the_worker_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["worker", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: hermes-memory worker")
    for option in ("--db", "--deadline", "--demo", "--log-format"):
        assert option in out


def _helps(parser: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, str]]:
    yield name, parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from _helps(subparser, f"{name} {sub}")


def test_no_help_text_shows_a_placeholder_unfilled() -> None:
    """Every command's help names the environment variables by their names: none prints
    ``${HTTP_ENV}`` or ``{NAME}`` as written in the source."""
    from hermes_async_memory.worker.main import HTTP_ENV, build_parser

    helps = dict(_helps(cli.build_parser(), "hermes-memory"))
    helps["hermes-memory worker"] = build_parser("hermes-memory worker").format_help()
    assert len(helps) > 10
    for name, text in helps.items():
        assert not re.search(r"\{[A-Za-z_]+\}", text), f"{name}: {text}"
    assert f"${HTTP_ENV}" in " ".join(helps["hermes-memory worker"].split())


def test_a_db_path_under_a_file_is_one_line_and_exit_1(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "plain-file"
    not_a_dir.write_text("")
    db = not_a_dir / "memory.db"

    line = assert_one_error_line(hermes_memory("worker", "--db", str(db)), 1)

    assert f"cannot use the store {db}: {not_a_dir} is not a directory" in line


def test_a_db_path_that_is_a_directory_is_one_line_and_exit_1(tmp_path: Path) -> None:
    line = assert_one_error_line(hermes_memory("worker", "--db", str(tmp_path)), 1)
    assert f"cannot use the store {tmp_path}: it is a directory" in line


def test_a_file_that_is_not_a_store_is_one_line_and_exit_1(tmp_path: Path) -> None:
    db = tmp_path / "memory.db"
    db.write_bytes(b"this is not an SQLite file, it only has its name" * 100)

    result = subprocess.run(
        [sys.executable, "-m", "hermes_async_memory.cli", "worker", "--db", str(db)],
        capture_output=True, text=True, env=child_env(), timeout=30, check=False,
    )

    line = assert_one_error_line(result, 1)
    assert f"the store {db} is damaged or not a memory store" in line
    assert "not a SQLite database" in line


def test_a_negative_deadline_is_a_usage_error(tmp_path: Path) -> None:
    result = hermes_memory("worker", "--db", str(tmp_path / "m.db"), "--deadline", "-1")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "--deadline" in result.stderr


def test_an_invalid_environment_setting_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = hermes_memory("worker", "--db", str(tmp_path / "m.db"),
                           HERMES_MEMORY_MAX_BATCH="many")
    assert "HERMES_MEMORY_MAX_BATCH" in assert_one_error_line(result, 2)


def test_the_installed_console_script_runs_the_demo(tmp_path: Path) -> None:
    assert CONSOLE_SCRIPT.exists(), "install the project first: pip install -e '.[test]'"
    db = tmp_path / "memory.db"

    result = subprocess.run(
        [str(CONSOLE_SCRIPT), "worker", "--demo", "--db", str(db)], capture_output=True,
        text=True, env=child_env(), timeout=RUN_TIMEOUT_S, check=False,
    )

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "flushed; 1000 turns committed, 0 left in outbox"
