"""Worker subprocesses for tests: started with this tree importable, their JSON log lines
read as they arrive, killed at the end of the test if still running (the ``spawn`` fixture
in conftest.py)."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
# Generous: CI has two cores and may be busy. Nothing waits this long when things work.
START_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 60.0


def child_env(**extra: str) -> dict[str, str]:
    """The test's environment without HERMES_MEMORY_* settings, importing this tree, plus
    ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_MEMORY_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


class Worker:
    """A worker subprocess. Its JSON log lines on stderr are read as they arrive, all the
    time: a child whose stderr pipe nobody reads would block in its next log line once the
    pipe's buffer is full."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.logs: list[dict[str, Any]] = []
        self.stdout = ""
        self._line = asyncio.Event()  # set, and replaced, on each line
        self._eof = False
        self._reader = asyncio.ensure_future(self._read_stderr())

    def events(self) -> list[str]:
        return [str(rec.get("event")) for rec in self.logs]

    async def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        async for line in self.proc.stderr:
            text = line.decode()
            try:
                rec = json.loads(text)
            except ValueError:
                rec = {"event": None, "raw": text}
            self.logs.append(rec)
            self._line, line_seen = asyncio.Event(), self._line
            line_seen.set()
        self._eof = True
        self._line.set()

    async def until(self, check: Callable[[], bool], timeout_s: float) -> None:
        """Wait until ``check()`` holds: checked now and after each of the worker's log lines
        (a commit logs one once it is done), never on a timer."""
        with anyio.fail_after(timeout_s):
            while not check():
                if self._eof:
                    raise AssertionError(f"the worker exited first: {self.logs[-5:]}")
                await self._line.wait()

    async def log_line(self, event: str, timeout_s: float = START_TIMEOUT_S) -> dict[str, Any]:
        """Wait for the log line of ``event``."""
        seen = 0
        with anyio.fail_after(timeout_s):
            while True:
                for rec in self.logs[seen:]:
                    if rec.get("event") == event:
                        return rec
                seen = len(self.logs)
                if self._eof:
                    raise AssertionError(f"the worker exited before {event!r}: {self.logs}")
                await self._line.wait()

    async def stdout_json(self, timeout_s: float = START_TIMEOUT_S) -> dict[str, Any]:
        """Wait for the next line on stdout, as JSON."""
        assert self.proc.stdout is not None
        with anyio.fail_after(timeout_s):
            line = await self.proc.stdout.readline()
        assert line, f"the worker exited before reporting: {self.logs}"
        return json.loads(line)  # type: ignore[no-any-return]

    async def send_line(self, text: str) -> None:
        assert self.proc.stdin is not None, "started without stdin=True"
        self.proc.stdin.write(text.encode() + b"\n")
        await self.proc.stdin.drain()

    def signal(self, signum: int) -> None:
        self.proc.send_signal(signum)

    async def finish(self, timeout_s: float = EXIT_TIMEOUT_S) -> int:
        """Wait for the exit; collect the rest of stdout and the logs. Returns the exit code."""
        with anyio.fail_after(timeout_s):
            if self.proc.stdout is not None:
                self.stdout += (await self.proc.stdout.read()).decode()
            await self._reader
            await self.proc.wait()
        assert self.proc.returncode is not None
        return self.proc.returncode


Spawn = Callable[..., Awaitable[Worker]]
