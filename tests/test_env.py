"""The one parser of settings from the environment: every field type, and errors that name the
variable (and never show a secret)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from hermes_async_memory import ConfigurationError, Settings
from hermes_async_memory.backends import HonchoConfig
from hermes_async_memory.env import PARSE, read_env
from hermes_async_memory.hermes import config as hconfig
from hermes_async_memory.worker.main import WorkerEnv


def _pair(text: str) -> tuple[int, int]:
    a, _, b = text.partition("x")
    return int(a), int(b)


@dataclass(frozen=True, slots=True)
class Sample:
    count: int = 1
    ratio: float = 0.5
    flag: bool = False
    name: str = "x"
    path: Path = Path("a")
    label: str | None = "set"
    mode: Literal["fast", "safe"] = "safe"
    size: tuple[int, int] | None = field(default=None, metadata={PARSE: _pair})
    token: str | None = field(default=None, repr=False)


def test_each_type_is_read_from_its_prefixed_variable() -> None:
    env = {"APP_COUNT": "1_000", "APP_RATIO": "0.25", "APP_FLAG": "Yes", "APP_NAME": " n ",
           "APP_PATH": "/srv/memory.db", "APP_LABEL": "", "APP_MODE": "fast",
           "APP_SIZE": "3x4", "APP_TOKEN": "t", "OTHER_COUNT": "5"}
    assert Sample(**read_env(Sample, env, "APP_")) == Sample(  # type: ignore[arg-type]
        count=1000, ratio=0.25, flag=True, name=" n ", path=Path("/srv/memory.db"),
        label=None, mode="fast", size=(3, 4), token="t")
    assert read_env(Sample, {}, "APP_") == {}, "unset variables leave the defaults"
    assert read_env(Sample, env, "APP_", skip=("count", "ratio")).keys() == {
        "flag", "name", "path", "label", "mode", "size", "token"}
    assert read_env(Sample, {"app_count": "2"}, "app_", upper=False) == {"count": 2}
    for word, value in (("1", True), ("on", True), ("FALSE", False), ("no", False)):
        assert read_env(Sample, {"APP_FLAG": word}, "APP_") == {"flag": value}


@pytest.mark.parametrize(("var", "raw", "says"), [
    ("APP_COUNT", "many", "is not an integer"),
    ("APP_COUNT", "1.5", "is not an integer"),
    ("APP_RATIO", "half", "is not a finite number"),
    ("APP_RATIO", "nan", "is not a finite number"),
    ("APP_FLAG", "maybe", "is not a boolean"),
    ("APP_PATH", "", "is empty"),
    ("APP_MODE", "reckless", "must be one of fast, safe"),
    ("APP_SIZE", "3by4", "APP_SIZE: "),
])
def test_a_bad_value_is_a_configuration_error_naming_the_variable(
        var: str, raw: str, says: str) -> None:
    with pytest.raises(ConfigurationError, match=var) as info:
        read_env(Sample, {var: raw}, "APP_")
    assert says in str(info.value)


def test_a_secret_is_never_shown_in_an_error() -> None:
    @dataclass(frozen=True)
    class Secretive:
        pin: int = field(default=0, repr=False)

    with pytest.raises(ConfigurationError, match="APP_PIN") as info:
        read_env(Secretive, {"APP_PIN": "hunter2"}, "APP_")
    assert "hunter2" not in str(info.value)


def test_a_field_type_without_a_parser_is_a_bug_not_a_bad_value() -> None:
    @dataclass(frozen=True)
    class Odd:
        items: list[str] = field(default_factory=list)

    with pytest.raises(TypeError, match="APP_ITEMS"):
        read_env(Odd, {"APP_ITEMS": "a,b"}, "APP_")


def test_settings_honcho_and_the_worker_read_through_it() -> None:
    env = {"HERMES_MEMORY_BACKEND": "honcho", "HERMES_MEMORY_RECALL_LIMIT": "9",
           "HONCHO_BASE_URL": "http://127.0.0.1:8000", "HONCHO_CONFIGURE_SESSIONS": "off",
           "HERMES_MEMORY_HTTP": "[::1]:9464"}
    settings = Settings.from_env(env)
    assert settings.recall_limit == 9 and settings.honcho is not None
    assert settings.honcho.configure_sessions is False
    assert WorkerEnv.from_env(env).http == ("::1", 9464)
    with pytest.raises(ConfigurationError, match="HERMES_MEMORY_ROLE must be one of"):
        Settings.from_env({"HERMES_MEMORY_ROLE": "boss"})
    with pytest.raises(ConfigurationError, match="HONCHO_RECALL_MODE must be one of"):
        HonchoConfig.from_env({"HONCHO_BASE_URL": "http://localhost:1",
                               "HONCHO_RECALL_MODE": "psychic"})


def test_the_hermes_config_file_reads_like_the_environment(tmp_path: Path) -> None:
    in_file = hconfig.resolve(tmp_path, {"recall_limit": 9, "backend": "honcho",
                                         "honcho_base_url": "http://127.0.0.1:8000",
                                         "honcho_configure_sessions": False}, {})
    in_env = hconfig.resolve(tmp_path, {}, {
        "HERMES_MEMORY_RECALL_LIMIT": "9", "HERMES_MEMORY_BACKEND": "honcho",
        "HONCHO_BASE_URL": "http://127.0.0.1:8000", "HONCHO_CONFIGURE_SESSIONS": "false"})
    assert in_file.settings == in_env.settings
    assert in_file.settings.honcho is not None
    assert in_file.settings.honcho.configure_sessions is False
    # An error names the key as the file has it, not an environment variable never set.
    with pytest.raises(ConfigurationError, match="the provider config: recall_limit="):
        hconfig.resolve(tmp_path, {"recall_limit": "many"}, {})
    with pytest.raises(ConfigurationError, match="HERMES_MEMORY_RECALL_LIMIT="):
        hconfig.resolve(tmp_path, {}, {"HERMES_MEMORY_RECALL_LIMIT": "many"})
