"""``StandaloneMemory``: the key-value memory as plain calls, over a real store file that it
opens on a loop thread of its own and closes; its choice from the environment (seed 000's
``get_memory_backend()``, without the singleton); Honcho's, unusable without a key and real
against a Honcho server on 127.0.0.1; and the evaluation, blocking."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from hermes_async_memory import Settings
from hermes_async_memory.backends.honcho import KEY_FIELD
from hermes_async_memory.errors import ConfigurationError, PipelineClosedError
from hermes_async_memory.memory import BackendLimitError, InvalidEntryError
from hermes_async_memory.memory.evaluation import CHECKS, evaluate_scratch_blocking
from hermes_async_memory.memory.standalone import StandaloneMemory

from .fake_honcho import FakeHoncho
from .test_honcho_pipeline import WORKSPACE
from .test_memory_backends import memory_messages


def loop_threads() -> int:
    return sum(t.name == "hermes-memory-loop" for t in threading.enumerate())


def test_plain_calls_over_a_real_file_durable_across_a_close(tmp_path: Path) -> None:
    db = tmp_path / "deep" / "memory.db"
    before = loop_threads()
    with StandaloneMemory(Settings(db_path=db)) as kv:
        assert (kv.kind, kv.backend_name, kv.is_cloud) == ("local", "local (SQLite)", False)
        assert kv.is_available() and kv.location == str(db) and db.exists()
        assert loop_threads() == before + 1
        first = kv.store("ann", "editor", "vim", {"source": "chat"})
        got = kv.retrieve("ann", "editor")  # no flush in between: reads see acknowledged writes
        assert got is not None
        assert (got.value, got.user_id, got.metadata) == ("vim", "ann", {"source": "chat"})
        assert got.created_at == got.updated_at == first.accepted_at
        kv.store("ann", "editor", "helix")
        kv.store("ann", "shell", "fish")
        kv.store("bob", "editor", "emacs")
        updated = kv.retrieve("ann", "editor")
        assert updated is not None and updated.created_at == first.accepted_at
        assert kv.list_keys("ann") == ["shell", "editor"]
        assert [e.key for e in kv.query("ann", "helix editor")] == ["editor"]
        kv.delete("ann", "shell")
        assert kv.retrieve("ann", "shell") is None
        kv.settled("ann")
        assert kv.counts() == (2, 2)
        with pytest.raises(InvalidEntryError, match="key"):
            kv.store("ann", "", "x")
    assert loop_threads() == before  # closed: its loop thread ended
    assert not kv.is_available()
    with pytest.raises(PipelineClosedError):
        kv.retrieve("ann", "editor")
    with pytest.raises(PipelineClosedError):
        kv.store("ann", "k", "v")
    kv.close()  # idempotent
    with StandaloneMemory(Settings(db_path=db)) as again:
        entry = again.retrieve("ann", "editor")
        assert entry is not None and entry.value == "helix"
        assert again.list_keys("bob") == ["editor"]


def test_two_on_one_file_share_its_pipeline(tmp_path: Path) -> None:
    settings = Settings(db_path=tmp_path / "m.db")
    before = loop_threads()
    a, b = StandaloneMemory(settings), StandaloneMemory(settings)
    assert loop_threads() == before + 1  # a store file admits one pipeline
    a.store("ann", "k", "from a")
    a.close()
    got = b.retrieve("ann", "k")
    assert got is not None and got.value == "from a"
    b.close()
    assert loop_threads() == before


def test_the_choice_from_the_environment_is_seed_000s(tmp_path: Path) -> None:
    db = tmp_path / "memory.db"
    env = {"HERMES_MEMORY_DB_PATH": str(db)}
    # Nothing chosen: memory is off, and no store file is made.
    off = StandaloneMemory.from_env(env)
    assert (off.kind, off.backend_name, off.is_available()) == ("null", "null (disabled)", True)
    off.store("ann", "k", "v")
    assert off.retrieve("ann", "k") is None and off.query("ann", "v") == []
    assert not db.exists()
    # HERMES_MEMORY_BACKEND=local (seed 000's), the replica's old "null", the key-value
    # backend's own variable, an override: the local store, at the configured file.
    choices: list[tuple[dict[str, str], dict[str, Any]]] = [
        ({"HERMES_MEMORY_BACKEND": "local"}, {}),
        ({"HERMES_MEMORY_BACKEND": "Local "}, {}),
        ({"HERMES_MEMORY_BACKEND": "null"}, {}),
        ({"HERMES_MEMORY_KV_BACKEND": "local"}, {}),
        ({}, {"kv_backend": "local"})]
    for chosen, overrides in choices:
        with StandaloneMemory.from_env({**env, **chosen}, **overrides) as kv:
            assert kv.kind == "local" and kv.location == str(db), chosen
    # Chosen explicitly, local wins over HONCHO_API_KEY.
    with StandaloneMemory.from_env({**env, "HERMES_MEMORY_BACKEND": "local",
                                    "HONCHO_API_KEY": "hk"}) as kv:
        assert kv.kind == "local" and kv.settings.backend == "null"
    with pytest.raises(ConfigurationError, match="HERMES_MEMORY_BACKEND"):
        StandaloneMemory.from_env({**env, "HERMES_MEMORY_BACKEND": "redis"})


def test_honcho_without_a_key_is_unavailable_and_says_why(tmp_path: Path) -> None:
    env = {"HERMES_MEMORY_DB_PATH": str(tmp_path / "m.db")}
    for kv in (StandaloneMemory.from_env(env, backend="honcho"),
               StandaloneMemory.from_env({**env, "HERMES_MEMORY_BACKEND": "honcho"})):
        assert (kv.kind, kv.backend_name, kv.is_cloud) == ("honcho", "honcho (cloud)", True)
        assert kv.is_available() is False
        assert kv.problem is not None and "HONCHO_API_KEY" in kv.problem
        with pytest.raises(ConfigurationError, match="HONCHO_API_KEY"):
            kv.store("ann", "k", "v")
        with pytest.raises(ConfigurationError, match="HONCHO_API_KEY"):
            kv.retrieve("ann", "k")
        kv.close()
    assert not (tmp_path / "m.db").exists()
    # Any other bad setting still raises at once.
    with pytest.raises(ConfigurationError, match="HERMES_MEMORY_MAX_BATCH"):
        StandaloneMemory.from_env({**env, "HERMES_MEMORY_MAX_BATCH": "lots"}, backend="honcho")
    with pytest.raises(ConfigurationError, match="max_wait_ms"):
        StandaloneMemory.from_env({**env, "HERMES_MEMORY_MAX_WAIT_MS": "-1"}, backend="honcho")


def test_honcho_gets_each_write_from_plain_calls(tmp_path: Path, fake: FakeHoncho) -> None:
    env = {"HERMES_MEMORY_DB_PATH": str(tmp_path / "m.db"), "HERMES_MEMORY_BACKEND": "honcho",
           "HONCHO_BASE_URL": fake.base_url, "HONCHO_WORKSPACE_ID": WORKSPACE}
    with StandaloneMemory.from_env(env) as kv:
        assert (kv.kind, kv.backend_name, kv.is_cloud) == ("honcho", "honcho (cloud)", True)
        assert kv.is_available() and kv.problem is None
        receipts = [kv.store("ann", "editor", "vim"), kv.store("ann", "editor", "helix")]
        kv.settled("ann")  # committed here, and sent to Honcho
        msgs = memory_messages(fake, "ann")
        assert [m["metadata"][KEY_FIELD] for m in msgs] == [r.key for r in receipts]
        got = kv.retrieve("ann", "editor")  # the local store stays the record
        assert got is not None and got.value == "helix"
        with pytest.raises(BackendLimitError) as limit:
            kv.delete("ann", "editor")
        assert limit.value.done == "deleted locally"
        assert kv.retrieve("ann", "editor") is None


def test_evaluation_as_a_plain_call(tmp_path: Path) -> None:
    with StandaloneMemory(Settings(db_path=tmp_path / "m.db")) as kv:
        kv.store("ann", "keep", "this stays")
        ev = kv.evaluate(operations=20)
        assert (ev.backend, ev.available, ev.is_cloud) == ("local (SQLite)", True, False)
        assert all(ev.checks[name]["passed"] for name in CHECKS), ev.checks
        assert ev.cleaned_up and ev.score >= 80
        assert kv.list_keys("ann") == ["keep"]  # scratch users only
    null = StandaloneMemory.from_env({})
    ev = null.evaluate(operations=20)
    assert (ev.backend, ev.available) == ("null (disabled)", True)
    assert not any(check["passed"] for check in ev.checks.values())
    mine = tmp_path / "mine.db"
    report = evaluate_scratch_blocking(Settings(db_path=mine), operations=20)
    assert [e["backend"] for e in report["evaluations"]] == ["null (disabled)", "local (SQLite)"]
    assert report["backends_evaluated"] == 2 and report["your_store"] == str(mine)
    assert report["recommendation"].startswith("Best backend: local (SQLite)")
    assert not mine.exists()  # a scratch store, never yours
