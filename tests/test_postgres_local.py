"""``hermes-memory db local``: the one command a user runs to try the shared store on this
machine, against the real PostgreSQL binaries (run as the postgres account when the tests
run as root, as a user's would be)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hermes_async_memory import cli

from .pg_server import free_port


@pytest.fixture
def folder() -> Iterator[Path]:
    # Not under pytest's tmp_path: its root-only parent would keep the postgres account out.
    path = Path(tempfile.mkdtemp(prefix="hm-local-pg-"))
    yield path
    cli.main(["db", "local", "stop", "--dir", str(path)])
    shutil.rmtree(path, ignore_errors=True)


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = cli.main(["db", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_start_prints_a_working_database_url_then_stop(
        folder: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_port()
    code, out, _ = run(capsys, "local", "start", "--dir", str(folder), "--port", str(port))
    assert code == 0
    [export] = [line for line in out.splitlines() if line.startswith("export DATABASE_URL=")]
    url = export.split("=", 1)[1].strip("'")
    assert url.startswith("postgresql://hermes:") and f"@127.0.0.1:{port}/hermes_memory" in url
    assert stat.S_IMODE(os.stat(folder / "password").st_mode) == 0o600

    monkeypatch.delenv("HERMES_MEMORY_POSTGRES_DSN", raising=False)
    monkeypatch.setenv("DATABASE_URL", url)
    code, out, _ = run(capsys, "status")
    assert code == 0 and "up to date" in out
    assert url.split(":")[2].split("@")[0] not in out  # the password is never printed

    # Again: the same cluster, port and password, already running.
    code, again, _ = run(capsys, "local", "start", "--dir", str(folder))
    assert code == 0 and export in again.splitlines()

    assert run(capsys, "local", "stop", "--dir", str(folder))[1].startswith("stopped")
    assert run(capsys, "local", "stop", "--dir", str(folder))[1].startswith("no server")
    code, _, err = run(capsys, "status")
    assert code == 1 and "hermes-memory: error:" in err

    # Started again after a stop: the data and the schema are still there.
    code, out, _ = run(capsys, "local", "start", "--dir", str(folder))
    assert code == 0 and export in out.splitlines()
    assert "up to date" in run(capsys, "status")[1]
