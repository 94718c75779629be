"""Warm-start templates kept in the store (``pipeline.templates``) on real store files:
extraction from a stored session, outcomes by the stated rules, automatic creation, the
choice, warm vs cold numbers, export and import, and durability across a SIGKILL."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hermes_async_memory import ConfigurationError, MemoryPipeline, Settings
from hermes_async_memory.store import SCHEMA_VERSION
from hermes_async_memory.templates import (
    Example,
    InvalidTemplateError,
    Template,
    TemplateExistsError,
    TemplateSettings,
    UnknownTemplateError,
    validate_chat,
    warm_messages,
)

from .fixtures_conversations import (
    CODE_SESSION,
    FILE_SESSION,
    Message,
    answer,
    assistant,
    call,
    user,
)
from .test_outbox import run_child_until


def turns_of(messages: list[Message]) -> Iterator[list[Message]]:
    """Each turn's own messages of a recorded session (``sync_turn`` stores what it is
    handed: a turn's messages, from its user message to the next)."""
    starts = [i for i, m in enumerate(messages) if m["role"] == "user"]
    for k in range(len(starts)):
        yield messages[starts[k]: starts[k + 1] if k + 1 < len(starts) else len(messages)]


def write(mem: MemoryPipeline, session: str, messages: list[Message], user_id: str = "ada"
          ) -> None:
    for history in turns_of(messages):
        mem.sync_turn("", "", session_id=session, user_id=user_id, messages=history)


def calls_session(turns: list[list[bool]], *, tool: str = "terminal", tag: str = "") -> list[
        Message]:
    """A session of ``turns``, each a user message then one call per entry (True: it
    succeeds, False: it exits 1); every call has its own arguments (``tag`` varies them
    across sessions)."""
    messages: list[Message] = []
    n = 0
    for t, outcomes in enumerate(turns):
        messages.append(user(f"step {t}"))
        for ok in outcomes:
            cid = f"call{n}"
            messages.append(assistant(call(cid, tool, command=f"make step{n}{tag}")))
            messages.append(answer(cid, {"output": "done" if ok else "boom",
                                         "exit_code": 0 if ok else 1}))
            n += 1
        messages.append(assistant(content=f"turn {t} done"))
    return messages


def db_rows(db: Path, sql: str, *params: object) -> list[tuple[Any, ...]]:
    with sqlite3.connect(db) as conn:
        return conn.execute(sql, params).fetchall()


def settings_with(tmp_path: Path, name: str = "memory.db", **templates: Any) -> Settings:
    return Settings(db_path=tmp_path / name, templates=TemplateSettings(**templates))


async def test_a_template_from_a_stored_session_warms_a_chat_that_validates(
    mem: MemoryPipeline,
) -> None:
    write(mem, "c1", CODE_SESSION)
    t = await mem.templates.extract("c1", "parser-fix", tags=["Python", " Tests"],
                                    description="Fixing a failing parser test")
    assert (t.task_type, t.source_session_id, t.tags) == ("code", "c1", ("python", "tests"))
    # The successful calls, each (tool, arguments) once: the failures (call_c1, c2, c5) and
    # the repeated `git status` (call_c10) are not examples.
    assert [e.call_id for e in t.examples] == ["call_c3", "call_c4", "call_c6", "call_c7",
                                                "call_c8", "call_c9"]
    assert "src/parser.py" in t.context_markers
    assert await mem.templates.get("parser-fix") == t
    assert [x.name for x in await mem.templates.list()] == ["parser-fix"]

    first = [{"role": "system", "content": "You are Hermes Agent."},
             user("The CSV export test fails, please have a look.")]
    warm = warm_messages(t, first)
    validate_chat(warm)
    made = [c["id"] for m in warm for c in m.get("tool_calls") or ()]
    answered = [m["tool_call_id"] for m in warm if m["role"] == "tool"]
    assert len(made) == len(t.examples) and sorted(made) == sorted(answered)
    assert warm[0] == first[0] and warm[-1] == first[1]

    with pytest.raises(TemplateExistsError):
        await mem.templates.extract("c1", "parser-fix")
    again = await mem.templates.extract("c1", "parser-fix", description="new words",
                                        overwrite=True)
    assert again.description == "new words" and again.created_at == t.created_at


async def test_outcomes_follow_the_stated_rules_and_move_the_success_rate(
    mem: MemoryPipeline,
) -> None:
    write(mem, "c1", CODE_SESSION)
    await mem.templates.extract("c1", "T")
    good, half, bad = [[True, True], [True]], [[True, False]], [[False, False], [True]]
    cases = [  # session, its calls, end(...) arguments, ok, the rule that decided
        ("w1", good, {"reason": "user_exit"}, True, "default"),
        ("w2", good, {"feedback": False}, False, "feedback"),
        ("w3", good, {"reason": " Crash "}, False, "reason"),
        ("w4", bad, {}, False, "tool_errors"),  # 2 of 3 failed: above one half
        ("w5", half, {}, True, "default"),  # 1 of 2: not above one half
        ("w6", bad, {"reason": "error", "feedback": True}, True, "feedback"),
    ]
    for sid, turns, kw, ok, rule in cases:
        await mem.templates.start(sid, "T")
        write(mem, sid, calls_session(turns))
        outcome = await mem.templates.end(sid, **kw)
        assert (outcome.template, outcome.task_type, outcome.ok, outcome.rule) == (
            "T", "code", ok, rule), sid
    t = await mem.templates.get("T")
    assert t is not None and (t.usage_count, t.successes, t.failures) == (6, 3, 3)
    assert t.success_rate == 0.5

    # Ending a session again replaces its outcome: it still counts once.
    assert (await mem.templates.end("w2", feedback=True)).ok
    # A session starts once: a second start is no second use.
    await mem.templates.start("w1", "T")
    t = await mem.templates.get("T")
    assert t is not None and (t.usage_count, t.successes, t.failures) == (6, 4, 2)
    # Automatic creation is off by default: those successes made no template.
    assert [x.name for x in await mem.templates.list()] == ["T"]


async def test_sessions_become_templates_only_above_the_bar_and_once(tmp_path: Path) -> None:
    settings = settings_with(tmp_path, auto_create=True, auto_min_calls=3)
    async with MemoryPipeline(settings) as mem:
        write(mem, "s1", calls_session([[True], [True]]))  # 2 successful calls: below
        assert (await mem.templates.end("s1")).created is None
        write(mem, "s2", calls_session([[True, True], [True, False]]))  # 3 of 4: above
        created = (await mem.templates.end("s2", reason="user_exit")).created
        assert created == "auto-code-s2"
        t = await mem.templates.get(created)
        assert t is not None and t.source_session_id == "s2" and len(t.examples) == 3
        assert (t.usage_count, t.successes, t.failures) == (0, 1, 0)  # its source counts
        # Deduplicated: the same source session again, the same calls in another session.
        assert (await mem.templates.end("s2")).created is None
        write(mem, "s3", calls_session([[True, True, True, False]]))
        assert (await mem.templates.end("s3")).created is None
        # A failure never becomes a template, however many calls succeeded.
        write(mem, "s4", calls_session([[True] * 5], tag="-b"))
        assert (await mem.templates.end("s4", feedback=False)).created is None
        write(mem, "s5", calls_session([[True] * 3], tag="-c"))
        assert (await mem.templates.end("s5")).created == "auto-code-s5"
        assert [x.name for x in await mem.templates.list()] == ["auto-code-s2",
                                                                "auto-code-s5"]


def scored(name: str, ok: int, failed: int, used: int, *, task_type: str = "code",
           tags: tuple[str, ...] = ()) -> Template:
    return Template(name=name, task_type=task_type, source_session_id=f"src-{name}",
                    tags=tags, usage_count=used, successes=ok, failures=failed,
                    examples=(Example("terminal", {"command": name}, "ok", f"c-{name}"),))


async def test_choose_prefers_the_best_rate_then_the_least_used_above_the_evidence_floor(
    mem: MemoryPipeline,
) -> None:
    templates = [
        scored("proven-busy", 9, 1, 12), scored("proven-quiet", 9, 1, 10, tags=("python",)),
        scored("lucky", 2, 0, 2),  # the best rate, under the floor of 3 ended sessions
        scored("middling", 5, 5, 1, tags=("python", "web")),
        scored("poor", 1, 9, 0, tags=("web",)),  # under the 0.5 rate floor
        scored("fresh-file", 0, 0, 0, task_type="file"),
        scored("lucky-file", 2, 0, 2, task_type="file"),
    ]
    count = await mem.templates.import_(json.dumps([t.to_dict() for t in templates]))
    assert count == len(templates)
    best = await mem.templates.choose("code")
    assert best is not None and best.name == "proven-quiet"
    assert best.created_at > 0  # made by hand without one: created when stored
    assert best == dataclasses.replace(templates[1], created_at=best.created_at)
    assert (await mem.templates.choose("code", ["Web"]) or templates[0]).name == "middling"
    assert await mem.templates.choose("code", ["go"]) is None
    assert await mem.templates.choose("file") is None  # none has the evidence
    assert await mem.templates.choose("research") is None
    with pytest.raises(InvalidTemplateError):
        await mem.templates.choose("")


async def test_choose_stays_fast_at_ten_thousand_templates(mem: MemoryPipeline) -> None:
    templates = [scored(f"t{i:05d}", 3 + i % 7, i % 5, i % 11, tags=(f"tag{i % 50}",))
                 for i in range(10_000)]
    assert await mem.templates.import_(json.dumps([t.to_dict() for t in templates]),
                                       timeout_s=120) == 10_000
    expected = min((t for t in templates if t.successes / t.ended >= 0.5),
                   key=lambda t: (-t.successes / t.ended, t.usage_count, -t.ended, t.name))
    started = time.perf_counter()
    for _ in range(20):
        best = await mem.templates.choose("code")
        tagged = await mem.templates.choose("code", ["tag7"])
    per_choice_s = (time.perf_counter() - started) / 40
    assert best is not None and best.name == expected.name
    assert tagged is not None and "tag7" in tagged.tags
    assert per_choice_s < 0.05, f"{per_choice_s * 1000:.1f} ms per choice"


async def test_warm_and_cold_first_turn_error_rates_per_task_type(tmp_path: Path) -> None:
    async with MemoryPipeline(settings_with(tmp_path, first_turns=2)) as mem:
        write(mem, "c0", CODE_SESSION)
        await mem.templates.extract("c0", "T")
        sessions = [  # session, start (template, None: cold, "-": none), turns
            ("w1", "T", [[True, False], [False], [False, False]]),  # first two: 2 of 3 failed
            ("w2", "T", [[True], [True], [False]]),  # 0 of 2
            ("k1", None, [[False], [True]]),  # 1 of 2
            ("k2", "-", [[True, True]]),  # 0 of 2; never started: a cold start at its end
        ]
        for sid, start, turns in sessions:
            if start != "-":
                await mem.templates.start(sid, start, "code")
            write(mem, sid, calls_session(turns))
            await mem.templates.end(sid)
        await mem.templates.start("w3", "T")  # started, not ended: not measured
        # A file session whose first two turns call no tool: ended, not measured.
        await mem.templates.start("f1", None, "file")
        write(mem, "f1", [user("hi"), assistant(content="hello"), user("and?"),
                          assistant(content="well"), *calls_session([[False]], tool="patch")])
        assert not (await mem.templates.end("f1")).ok

        stats = {s.task_type: s for s in await mem.templates.stats()}
    assert sorted(stats) == ["code", "file"]
    warm, cold = stats["code"].warm, stats["code"].cold
    assert (warm.sessions, warm.ended, warm.successes, warm.measured) == (3, 2, 1, 2)
    assert (warm.first_calls, warm.first_errors) == (5, 2)
    assert warm.avg_error_rate == pytest.approx((2 / 3 + 0) / 2)
    assert warm.pooled_error_rate == pytest.approx(2 / 5)
    assert (cold.sessions, cold.ended, cold.successes, cold.measured) == (2, 2, 2, 2)
    assert cold.avg_error_rate == pytest.approx(0.25)
    assert cold.pooled_error_rate == pytest.approx(0.25)
    file_cold = stats["file"].cold
    assert (file_cold.sessions, file_cold.ended, file_cold.measured) == (1, 1, 0)
    assert file_cold.avg_error_rate is None and stats["file"].warm.sessions == 0
    assert stats["code"].as_dict()["warm"]["success_rate"] == 0.5


async def test_export_then_import_moves_templates_between_installations(
    tmp_path: Path,
) -> None:
    async with MemoryPipeline(settings_with(tmp_path, "a.db")) as a:
        write(a, "c1", CODE_SESSION)
        write(a, "f1", FILE_SESSION)
        await a.templates.extract("c1", "code-fix", tags=["python"])
        await a.templates.extract("f1", "rename", description="Rename a setting")
        await a.templates.start("w1", "rename")
        await a.templates.end("w1", feedback=False)
        exported = await a.templates.export()
    docs = json.loads(exported)
    assert [d["name"] for d in docs] == ["code-fix", "rename"]
    assert docs[1]["usage_count"] == 1 and docs[1]["failures"] == 1

    async with MemoryPipeline(settings_with(tmp_path, "b.db")) as b:
        assert await b.templates.import_(exported) == 2
        assert await b.templates.export() == exported
        assert await b.templates.import_(exported.encode()) == 0  # idempotent by name
        # A template there already is left as it is.
        await b.templates.start("x1", "code-fix")
        assert await b.templates.import_(exported) == 0
        kept = await b.templates.get("code-fix")
        assert kept is not None and kept.usage_count == 1
        # One bad document refuses the whole text before anything is accepted.
        accepted = b.stats().accepted_turns
        bad = [dict(docs[0], name="other"), dict(docs[1], schema=99)]
        with pytest.raises(InvalidTemplateError, match=r"template \[1\]"):
            await b.templates.import_(json.dumps(bad))
        with pytest.raises(InvalidTemplateError):
            await b.templates.import_("[{}")
        with pytest.raises(InvalidTemplateError, match="twice"):
            await b.templates.import_(json.dumps([docs[0], docs[0]]))
        assert b.stats().accepted_turns == accepted
        assert await b.templates.get("other") is None


async def test_delete_removes_a_template_and_keeps_its_sessions_numbers(
    mem: MemoryPipeline,
) -> None:
    write(mem, "c1", CODE_SESSION)
    await mem.templates.extract("c1", "T")
    await mem.templates.start("w1", "T")
    await mem.templates.delete("T")
    assert await mem.templates.get("T") is None and await mem.templates.list() == []
    assert await mem.templates.choose("code") is None
    with pytest.raises(UnknownTemplateError):
        await mem.templates.delete("T")
    [stats] = await mem.templates.stats()
    assert stats.warm.sessions == 1
    # The ended session's outcome goes nowhere, and is still recorded.
    assert (await mem.templates.end("w1")).template == "T"
    # A template saved again under the name starts from no evidence: the old session's
    # ends do not move its counts (they took an outcome back that it never had).
    await mem.templates.extract("c1", "T")
    await mem.templates.end("w1", feedback=False)
    await mem.templates.end("w1", feedback=True)
    t = await mem.templates.get("T")
    assert t is not None and (t.usage_count, t.successes, t.failures) == (0, 0, 0)
    [stats] = await mem.templates.stats()
    assert (stats.warm.sessions, stats.warm.ended) == (1, 1)


async def test_deleting_a_session_removes_its_warm_start_row(mem: MemoryPipeline) -> None:
    write(mem, "c1", CODE_SESSION)
    await mem.templates.extract("c1", "T")
    for sid in ("w1", "w2"):
        await mem.templates.start(sid, "T")
        write(mem, sid, calls_session([[True]]))
        await mem.templates.end(sid)
    await mem.sessions.delete("w1")
    await mem.flush()
    [stats] = await mem.templates.stats()
    assert (stats.warm.sessions, stats.warm.ended) == (1, 1)
    # The template's counts are evidence without content: they keep the deleted session.
    t = await mem.templates.get("T")
    assert t is not None and (t.usage_count, t.successes) == (2, 2)


async def test_bad_input_is_refused_before_anything_is_accepted(mem: MemoryPipeline) -> None:
    write(mem, "c1", CODE_SESSION)
    await mem.flush()
    accepted = mem.stats().accepted_turns
    t = Template(name="ok", task_type="code", source_session_id="c1")
    bad_calls: list[Any] = [
        lambda: mem.templates.save_nowait("not a template"),  # type: ignore[arg-type]
        lambda: mem.templates.save_nowait(dataclasses.replace(t, name="two\nlines")),
        lambda: mem.templates.save_nowait(dataclasses.replace(t, name=" padded")),
        lambda: mem.templates.save_nowait(dataclasses.replace(t, description="nul\x00")),
        lambda: mem.templates.save_nowait(dataclasses.replace(t, description="\ud800")),
        lambda: mem.templates.save_nowait(dataclasses.replace(t, tags=("a,b",))),
        lambda: mem.templates.start_nowait("s1", None),  # a cold start needs its task type
        lambda: mem.templates.start_nowait("", None, "code"),
        lambda: mem.templates.delete_nowait(""),
    ]
    for bad in bad_calls:
        with pytest.raises(InvalidTemplateError):
            bad()
    with pytest.raises(UnknownTemplateError):
        await mem.templates.start("s1", "no-such-template")
    with pytest.raises(InvalidTemplateError):
        await mem.templates.end("c1", feedback="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidTemplateError):
        await mem.templates.end("c1", reason="x" * 201)
    with pytest.raises(InvalidTemplateError, match="neither started"):
        await mem.templates.end("never-seen")
    with pytest.raises(InvalidTemplateError, match="no stored messages"):
        await mem.templates.extract("never-seen", "x")
    assert mem.stats().accepted_turns == accepted


async def test_sigkill_keeps_every_acknowledged_template_write_exactly_once(
    tmp_path: Path,
) -> None:
    db = tmp_path / "m.db"
    receipts = run_child_until(db, "templates", acks=1500)
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        await mem.flush()
    n = len(receipts)  # steps 0 .. n-1 were acknowledged whole; step n may be in part
    names = {name: used for name, used in db_rows(db, "SELECT name, usage_count FROM templates")}
    starts = dict(db_rows(db, "SELECT session_id, template FROM template_sessions"))
    assert set(names) <= {f"t{i}" for i in range(n + 1)}
    assert set(starts) <= {f"s{i}" for i in range(n + 1)}
    for i in range(n):
        assert starts[f"s{i}"] == f"t{i}"
        deleted_by_next = (i + 1) % 3 == 2
        if i < n - 1 or not deleted_by_next:
            # A put never comes back after its delete, and a delete never comes early.
            assert (f"t{i}" in names) != deleted_by_next, i
        if f"t{i}" in names:
            assert names[f"t{i}"] == 1, i  # two starts, in order after its put: one use


def test_template_settings_come_from_the_environment_with_the_rest() -> None:
    settings = Settings.from_env({"HERMES_MEMORY_TEMPLATE_AUTO_CREATE": "on",
                                  "HERMES_MEMORY_TEMPLATE_FAILURE_REASONS": "Error, timeout",
                                  "HERMES_MEMORY_TEMPLATE_MAX_ERROR_RATE": "0.25",
                                  "HERMES_MEMORY_TEMPLATE_FIRST_TURNS": "5"})
    t = settings.templates
    assert (t.auto_create, t.failure_reasons, t.max_error_rate, t.first_turns) == (
        True, ("error", "timeout"), 0.25, 5)
    assert Settings.from_env({}).templates == TemplateSettings()
    for bad in ({"HERMES_MEMORY_TEMPLATE_MAX_ERROR_RATE": "2"},
                {"HERMES_MEMORY_TEMPLATE_FIRST_TURNS": "0"},
                {"HERMES_MEMORY_TEMPLATE_AUTO_CREATE": "maybe"}):
        with pytest.raises(ConfigurationError):
            Settings.from_env(bad)


async def test_a_version_5_store_gets_the_template_tables_at_open(tmp_path: Path) -> None:
    db = tmp_path / "m.db"
    async with MemoryPipeline(Settings(db_path=db)):
        pass
    with sqlite3.connect(db) as conn:
        conn.executescript("DROP TABLE templates; DROP TABLE template_sessions; "
                           "UPDATE schema_version SET version = 5;")
    async with MemoryPipeline(Settings(db_path=db)) as mem:
        await mem.templates.save(scored("t", 3, 0, 3))
        assert await mem.templates.choose("code") is not None
    assert db_rows(db, "SELECT version FROM schema_version") == [(SCHEMA_VERSION,)]
