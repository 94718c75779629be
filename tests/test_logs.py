"""Logging set-up: JSON or console lines on stderr, ISO timestamps, secrets redacted."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import structlog
from structlog.testing import capture_logs

from hermes_async_memory import ConfigurationError
from hermes_async_memory.logs import (
    REDACTED,
    StandardLogging,
    configure_logging,
    is_secret_key,
    redact_secrets,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def restore_structlog() -> Iterator[None]:
    """Each test may configure structlog; the next test gets the configuration back."""
    saved = structlog.get_config()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    structlog.configure(**saved)
    structlog.contextvars.clear_contextvars()
    for handler in root.handlers[:]:  # configure_logging's, not pytest's own
        if isinstance(handler, StandardLogging) and handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)
    logging.captureWarnings(False)


def json_lines(err: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in err.splitlines() if line.strip()]


@pytest.mark.parametrize(
    ("key", "secret"),
    [
        ("api_key", True), ("HONCHO_API_KEY", True), ("x-api-key", True), ("apikey", True),
        ("token", True), ("access_token", True), ("authToken", True), ("client_secret", True),
        ("password", True), ("db_password", True), ("Authorization", True),
        ("input_tokens", False), ("recall_snippet_tokens", False), ("session_id", False),
        ("turns", False), ("db", False),
    ],
)
def test_which_keys_count_as_secrets(key: str, secret: bool) -> None:
    assert is_secret_key(key) is secret


def test_json_line_on_stderr_with_secrets_redacted(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json=True)
    log = structlog.get_logger("hermes_async_memory.backends")
    structlog.contextvars.bind_contextvars(session_id="s-1", auth_token="bound-secret-7")

    log.info(
        "backend_call", api_key="sk-live-123", input_tokens=42,
        headers={"Authorization": "Bearer abc.def", "Accept": "application/json"},
        attempts=[{"password": "hunter2"}],
    )

    captured = capsys.readouterr()
    assert captured.out == ""
    for secret in ("sk-live-123", "Bearer abc.def", "hunter2", "bound-secret-7"):
        assert secret not in captured.err
    (line,) = json_lines(captured.err)
    assert line["event"] == "backend_call"
    assert line["level"] == "info"
    assert line["api_key"] == REDACTED
    assert line["auth_token"] == REDACTED
    assert line["headers"] == {"Authorization": REDACTED, "Accept": "application/json"}
    assert line["attempts"] == [{"password": REDACTED}]
    assert line["input_tokens"] == 42
    assert line["session_id"] == "s-1"  # bound through contextvars
    assert datetime.fromisoformat(line["timestamp"]).utcoffset() is not None


def test_stderr_that_is_not_a_terminal_gets_json(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging()  # pytest's captured stderr is not a TTY
    structlog.get_logger().warning("disk_slow", write_ms=12.5)
    (line,) = json_lines(capsys.readouterr().err)
    assert line["event"] == "disk_slow" and line["write_ms"] == 12.5


def test_console_format_is_readable_and_redacted(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json=False)
    structlog.get_logger().info("worker_ready", db="/tmp/m.db", password="hunter2")
    err = capsys.readouterr().err
    assert "worker_ready" in err and "db=/tmp/m.db" in err
    assert "hunter2" not in err and f"password={REDACTED}" in err
    with pytest.raises(ValueError):
        json.loads(err)


def test_lines_below_the_level_are_dropped(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging(json=True, level="warning")
    log = structlog.get_logger()
    log.info("batch_committed", turns=10)
    log.warning("batch_retry", attempt=1)
    assert [line["event"] for line in json_lines(capsys.readouterr().err)] == ["batch_retry"]


def test_standard_logging_of_dependencies_is_one_json_object_per_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A dependency's records through the standard ``logging`` (asyncpg's pool logs its
    reconnect failures with a traceback) and ``warnings`` come out as JSON lines like ours:
    the traceback inside the object, a DSN's password redacted, the level applied."""
    configure_logging(json=True, level="info")
    try:
        raise ConnectionResetError(104, "Connection reset by peer")
    except ConnectionResetError:
        logging.getLogger("asyncpg.pool").warning(
            "Failed to restore the pool connection floor (postgresql://me:pw-77@db/mem)",
            exc_info=True)
    logging.getLogger("asyncpg.pool").debug("below the level")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("a deprecated call", DeprecationWarning, stacklevel=1)
    err = capsys.readouterr().err
    lines = json_lines(err)  # each line parses, or this raises
    assert len(lines) == len(err.splitlines()) == 2
    pool, warned = lines
    assert pool["logger"] == "asyncpg.pool" and pool["level"] == "warning"
    assert pool["event"].startswith("Failed to restore the pool connection floor")
    assert "pw-77" not in err
    assert pool["exception"][0]["exc_type"] == "ConnectionResetError"
    assert warned["logger"] == "py.warnings" and "a deprecated call" in warned["event"]


def test_an_unknown_level_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="log level"):
        configure_logging(level="chatty")


def test_the_redaction_processor_in_a_captured_chain() -> None:
    with capture_logs(processors=[structlog.contextvars.merge_contextvars, redact_secrets]) as logs:
        structlog.contextvars.bind_contextvars(secret_value="s3")
        structlog.get_logger().info("honcho_connect", api_key="k", workspace="w")
    assert logs == [{
        "event": "honcho_connect", "log_level": "info", "api_key": REDACTED,
        "workspace": "w", "secret_value": REDACTED,
    }]


def test_importing_and_running_the_library_configures_no_logging(tmp_path: Path) -> None:
    code = (
        "import asyncio, structlog\n"
        "from hermes_async_memory import MemoryPipeline, Settings\n"
        "import hermes_async_memory.cli, hermes_async_memory.worker.main\n"
        "async def go():\n"
        f"    async with MemoryPipeline(Settings(db_path={str(tmp_path / 'm.db')!r})) as mem:\n"
        "        mem.sync_turn('hi', 'hello', session_id='s')\n"
        "        await mem.flush()\n"
        "asyncio.run(go())\n"
        "print(structlog.is_configured())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_MEMORY_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "False"
