from __future__ import annotations

from pathlib import Path

import pytest

from hermes_async_memory import ConfigurationError, Settings


def test_from_env_reads_prefixed_variables() -> None:
    s = Settings.from_env({
        "HERMES_MEMORY_DB_PATH": "/tmp/x/memory.db",
        "HERMES_MEMORY_MAX_BATCH": "250",
        "HERMES_MEMORY_MAX_WAIT_MS": "1.5",
        "HERMES_MEMORY_OVERFLOW": "reject",
        "UNRELATED": "1",
    })
    assert s.db_path == Path("/tmp/x/memory.db")
    assert s.max_batch == 250 and s.max_wait_ms == 1.5 and s.overflow == "reject"
    assert s.outbox_dir == Path("/tmp/x/memory.db.outbox")


def test_defaults_live_in_the_user_data_dir() -> None:
    assert Settings.from_env({}).db_path.name == "memory.db"


@pytest.mark.parametrize("env", [
    {"HERMES_MEMORY_MAX_BATCH": "lots"},
    {"HERMES_MEMORY_MAX_BATCH": "0"},
    {"HERMES_MEMORY_OVERFLOW": "drop"},
    {"HERMES_MEMORY_MAX_WAIT_MS": "-1"},
])
def test_bad_values_are_configuration_errors(env: dict[str, str]) -> None:
    with pytest.raises(ConfigurationError):
        Settings.from_env(env)


def test_settings_are_frozen() -> None:
    s = Settings()
    with pytest.raises(AttributeError):
        s.max_batch = 3  # type: ignore[misc]
    assert s.replace(max_batch=3).max_batch == 3
