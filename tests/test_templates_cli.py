"""``hermes-memory templates ...`` on real store files: sessions are stored through the real
pipeline; commands run in-process through ``cli.main`` (on a worker thread) and, once, as a
subprocess."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

from hermes_async_memory import MemoryPipeline, Settings, cli
from hermes_async_memory.templates import Template, validate_chat

from .fixtures_conversations import CODE_SESSION, FILE_SESSION
from .test_cli import hermes_memory
from .test_templates_store import calls_session, write


@dataclass
class Run:
    code: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)

    def error(self) -> str:
        """The one error line, checked to be one."""
        assert "Traceback" not in self.err
        lines = self.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("hermes-memory: error: "), self.err
        return lines[0]


@pytest.fixture(autouse=True)
def _quiet_logs() -> Iterator[None]:
    # The pipeline's log lines would otherwise land on the stdout the commands print to.
    with capture_logs():
        yield


@pytest.fixture
def run_cli(capsys: pytest.CaptureFixture[str]) -> Any:
    async def run(*argv: str) -> Run:
        capsys.readouterr()
        code = await anyio.to_thread.run_sync(cli.main, list(argv))
        out, err = capsys.readouterr()
        return Run(code, out, err)

    return run


@pytest.fixture
async def stored(tmp_path: Path) -> AsyncIterator[Path]:
    """A closed store holding a code session (c1) and a file session (f1)."""
    db = tmp_path / "memory.db"
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        write(mem, "c1", CODE_SESSION)
        write(mem, "f1", FILE_SESSION)
        await mem.flush()
    yield db


async def test_extract_list_show_test_and_delete(stored: Path, run_cli: Any) -> None:
    db = str(stored)
    made = await run_cli("templates", "extract", "c1", "--name", "parser-fix", "--tags",
                         "Python,tests", "--description", "Fix a parser test", "--db", db)
    assert made.code == 0, made.err
    assert made.out.strip() == "extracted parser-fix (code, 6 examples) from c1"
    rename = (await run_cli("templates", "extract", "f1", "--name", "rename", "--db", db,
                            "--json")).json()
    assert rename["task_type"] == "file" and rename["source_session_id"] == "f1"
    taken = await run_cli("templates", "extract", "f1", "--name", "rename", "--db", db)
    assert taken.code == 2 and "stored already" in taken.error()

    listed = await run_cli("templates", "list", "--db", db)
    assert listed.code == 0
    header, *rows = listed.out.splitlines()
    assert header.split()[:3] == ["NAME", "TYPE", "TAGS"]
    assert [r.split()[:3] for r in rows] == [["parser-fix", "code", "python,tests"],
                                             ["rename", "file", "-"]]
    code = (await run_cli("templates", "list", "--type", "code", "--db", db, "--json")).json()
    assert [t["name"] for t in code] == ["parser-fix"] and code[0]["examples"] == 6
    tagged = (await run_cli("templates", "list", "--tag", "TESTS", "--db", db, "--json")).json()
    assert [t["name"] for t in tagged] == ["parser-fix"]

    shown = (await run_cli("templates", "show", "parser-fix", "--db", db, "--json")).json()
    template = Template.from_dict(shown)
    assert template.description == "Fix a parser test" and template.tags == ("python", "tests")
    text = (await run_cli("templates", "show", "parser-fix", "--db", db)).out
    assert "src/parser.py" in text and "execute_code" in text

    first = "The date parser rejects 2024-05. Can you look?"
    sent = await run_cli("templates", "test", "parser-fix", "--message", first,
                         "--system", "You are Hermes Agent.", "--db", db)
    assert sent.code == 0, sent.err
    messages = sent.json()
    validate_chat(messages)
    assert messages[0] == {"role": "system", "content": "You are Hermes Agent."}
    assert messages[-1] == {"role": "user", "content": first}
    made_ids = [c["id"] for m in messages for c in m.get("tool_calls") or ()]
    assert len(made_ids) == 6
    assert sorted(made_ids) == sorted(m["tool_call_id"] for m in messages if m["role"] == "tool")
    block = await run_cli("templates", "test", "parser-fix", "--message", first, "--text",
                          "--max-chars", "500", "--db", db)
    head, _, tail = block.out.partition("</warm_start>")
    assert head.startswith('<warm_start template="parser-fix" task_type="code">')
    assert len(head) + len("</warm_start>") <= 500 and tail.strip() == first

    missing = await run_cli("templates", "show", "nope", "--db", db)
    assert missing.code == 1 and "no template 'nope'" in missing.error()
    deleted = await run_cli("templates", "delete", "parser-fix", "--db", db)
    assert (deleted.code, deleted.out.strip()) == (0, "deleted parser-fix")
    left = (await run_cli("templates", "list", "--db", db, "--json")).json()
    assert [t["name"] for t in left] == ["rename"]
    again = await run_cli("templates", "delete", "parser-fix", "--db", db)
    assert again.code == 1 and "no template 'parser-fix'" in again.error()


async def test_stats_shows_warm_against_cold_per_task_type(tmp_path: Path, run_cli: Any
                                                           ) -> None:
    db = tmp_path / "memory.db"
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        write(mem, "c1", CODE_SESSION)
        await mem.templates.extract("c1", "T")
        for sid, start, turns in (("w1", "T", [[True], [True], [True]]),
                                  ("w2", "T", [[False, True]]),
                                  ("k1", None, [[False], [False, True]])):
            await mem.templates.start(sid, start, "code")
            write(mem, sid, calls_session(turns))
            await mem.templates.end(sid)
        expected = [s.as_dict() for s in await mem.templates.stats()]
    async with MemoryPipeline(Settings(db_path=tmp_path / "empty.db")):
        pass
    empty = await run_cli("templates", "stats", "--db", str(tmp_path / "empty.db"))
    assert (empty.code, empty.out.strip()) == (0, "no sessions started warm or cold yet")
    got = (await run_cli("templates", "stats", "--db", str(db), "--json")).json()
    assert got == {"first_turns": 3, "task_types": expected}
    warm = got["task_types"][0]["warm"]
    assert (warm["sessions"], warm["avg_error_rate"]) == (2, 0.25)  # (0 + 1/2) / 2
    assert got["task_types"][0]["cold"]["avg_error_rate"] == pytest.approx(2 / 3)
    text = (await run_cli("templates", "stats", "--db", str(db))).out.splitlines()
    assert text[0].split() == ["TYPE", "START", "SESSIONS", "ENDED", "OK", "ERRORS", "(FIRST",
                               "3", "TURNS)", "MEASURED"]
    # w2's one failure in two calls is not above one half: a success; k1's two in three are.
    assert text[1].split()[:6] == ["code", "warm", "2", "2", "100%", "25%"]
    assert text[2].split()[:6] == ["code", "cold", "1", "1", "0%", "67%"]


async def test_export_and_import_move_templates_between_installations(
    stored: Path, tmp_path: Path, run_cli: Any
) -> None:
    db = str(stored)
    for session, name in (("c1", "parser-fix"), ("f1", "rename")):
        assert (await run_cli("templates", "extract", session, "--name", name,
                              "--db", db)).code == 0
    out = tmp_path / "templates.json"
    exported = await run_cli("templates", "export", "--out", str(out), "--db", db)
    assert exported.out.strip() == f"exported 2 templates to {out}"
    on_stdout = (await run_cli("templates", "export", "--db", db)).out
    assert on_stdout == out.read_text(encoding="utf-8")
    assert [d["name"] for d in json.loads(on_stdout)] == ["parser-fix", "rename"]

    other = str(tmp_path / "other.db")
    first = await run_cli("templates", "import", str(out), "--db", other)
    assert first.out.strip() == "imported 2 templates; 0 already there, skipped"
    again = (await run_cli("templates", "import", str(out), "--db", other, "--json")).json()
    assert again == {"imported": 0, "skipped": 2}
    assert (await run_cli("templates", "export", "--db", other)).out == on_stdout

    bad = tmp_path / "bad.json"
    bad.write_text('[{"schema": 1}]', encoding="utf-8")
    refused = await run_cli("templates", "import", str(bad), "--db", other)
    assert refused.code == 2 and "template [0]" in refused.error()
    absent = await run_cli("templates", "import", str(tmp_path / "none.json"), "--db", other)
    assert absent.code == 1 and "no file" in absent.error()


def test_templates_is_a_command_of_the_installed_cli(tmp_path: Path) -> None:
    result = hermes_memory("templates", "--help")
    assert result.returncode == 0, result.stderr
    for action in ("list", "extract", "show", "test", "delete", "stats", "export", "import"):
        assert action in result.stdout
    missing = hermes_memory("templates", "list", "--db", str(tmp_path / "none.db"))
    assert missing.returncode == 1 and "no memory store" in missing.stderr
