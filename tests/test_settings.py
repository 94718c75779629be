from __future__ import annotations

from pathlib import Path

import pytest

from hermes_async_memory import ConfigurationError, MemoryPipeline, Settings
from hermes_async_memory.hermes import config as provider_config
from hermes_async_memory.memory import HonchoMemory, KeyValueMemory


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


@pytest.mark.parametrize("value", ["local", "LOCAL", " local\n", "null"])
def test_seed_000s_local_backend_is_the_local_store_alone(value: str, tmp_path: Path) -> None:
    env = {"HERMES_MEMORY_DB_PATH": str(tmp_path / "m.db"), "HERMES_MEMORY_BACKEND": value}
    s = Settings.from_env(env)
    assert (s.backend, s.kv_backend, s.honcho) == ("null", "auto", None)  # nothing replicated
    assert type(MemoryPipeline(s).memory) is KeyValueMemory  # the local SQLite store
    # Set explicitly, it wins over a Honcho key (unset, the key would pick Honcho).
    keyed = Settings.from_env({**env, "HONCHO_API_KEY": "hk"})
    assert keyed.backend == "null" and type(MemoryPipeline(keyed).memory) is KeyValueMemory
    # The Hermes provider reads the variable, and its config file's "backend", the same way.
    assert provider_config.resolve(tmp_path, {}, env).settings.backend == "null"
    assert provider_config.resolve(tmp_path, {"backend": value}, {}).settings.backend == "null"


def test_the_replicas_are_still_chosen_by_the_variable(tmp_path: Path) -> None:
    env = {"HERMES_MEMORY_DB_PATH": str(tmp_path / "m.db")}
    honcho = Settings.from_env({**env, "HERMES_MEMORY_BACKEND": "honcho",
                                "HONCHO_BASE_URL": "http://127.0.0.1:8000"})
    assert honcho.backend == "honcho" and honcho.honcho is not None
    assert honcho.honcho.base_url == "http://127.0.0.1:8000"
    assert type(MemoryPipeline(honcho).memory) is HonchoMemory
    dsn = "postgresql://app:secret@db.example:5432/memory"
    postgres = Settings.from_env({**env, "HERMES_MEMORY_BACKEND": "Postgres",
                                  "DATABASE_URL": dsn})
    assert (postgres.backend, postgres.postgres_dsn) == ("postgres", dsn)
    # Beside the replica, the key-value memory's own variable still applies.
    local_kv = Settings.from_env({**env, "HERMES_MEMORY_BACKEND": "honcho",
                                  "HONCHO_BASE_URL": "http://127.0.0.1:8000",
                                  "HERMES_MEMORY_KV_BACKEND": "local"})
    assert (local_kv.backend, local_kv.kv_backend) == ("honcho", "local")
    # Settings in code keep the field's own names: "local" is a value of the variable.
    with pytest.raises(ConfigurationError, match="backend must be one of null, honcho"):
        Settings(backend="local")  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["redis", "", "none"])
def test_other_backend_values_are_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(ConfigurationError,
                       match="HERMES_MEMORY_BACKEND: must be one of local, honcho, postgres"):
        Settings.from_env({"HERMES_MEMORY_BACKEND": value})
