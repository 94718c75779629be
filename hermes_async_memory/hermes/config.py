"""Where the Hermes provider keeps its store and its settings, resolved from HERMES_HOME.

    $HERMES_HOME/hermes_async_memory.json       provider config (``hermes memory setup``)
    $HERMES_HOME/memory/hermes_async_memory.db  the store (default ``db_path``)
    $HERMES_HOME/plugins/hermes_async_memory/   the plugin (``hermes-memory hermes install``)

Precedence, lowest first: the defaults, the config file, ``HERMES_MEMORY_<FIELD>`` variables.
The file's ``honcho_<field>`` and ``template_<field>`` keys are the Honcho backend's and the
templates' settings (``HONCHO_<FIELD>`` and ``HERMES_MEMORY_TEMPLATE_<FIELD>`` variables).
This module imports nothing from hermes-agent at import time.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..backends.honcho import ENV_PREFIX as HONCHO_PREFIX
from ..backends.honcho import PRODUCTION_URL, RECALL_MODES, HonchoConfig
from ..env import read_env
from ..errors import ConfigurationError
from ..settings import (
    BACKENDS,
    ENV_PREFIX,
    KV_BACKENDS,
    STRUCTURED_FIELDS,
    Settings,
    auto_backend,
)
from ..templates import TemplateSettings
from ..templates.model import ENV_PREFIX as TEMPLATE_PREFIX

PROVIDER_NAME = "hermes_async_memory"
CONFIG_FILE = f"{PROVIDER_NAME}.json"
DEFAULT_DB = Path("memory") / f"{PROVIDER_NAME}.db"
HOME_VARIABLE = "HERMES_HOME"
_HOME_MARKERS = ("${HERMES_HOME}", "$HERMES_HOME")
# Provider options that are not pipeline settings.
DEFAULT_USER_ID = "default_user_id"
_SETTING_FIELDS = frozenset(f.name for f in dataclasses.fields(Settings)) - set(STRUCTURED_FIELDS)
_PROVIDER_FIELDS = frozenset({DEFAULT_USER_ID})
# The Honcho backend's options, as "honcho_<field>" keys (HONCHO_<FIELD> in the environment).
HONCHO_KEY_PREFIX = "honcho_"
_HONCHO_FIELDS = {HONCHO_KEY_PREFIX + f.name for f in dataclasses.fields(HonchoConfig)}
# Warm starts and templates, as "template_<field>" keys (HERMES_MEMORY_TEMPLATE_<FIELD>).
TEMPLATE_KEY_PREFIX = "template_"
_TEMPLATE_FIELDS = {TEMPLATE_KEY_PREFIX + f.name
                    for f in dataclasses.fields(TemplateSettings)}


@dataclass(frozen=True, slots=True)
class ProviderConfig:
    """The pipeline settings plus the provider's own options."""

    settings: Settings
    # The user recall is scoped to when Hermes names none (None: decided per platform).
    default_user_id: str | None = None


def default_hermes_home(environ: Mapping[str, str] | None = None) -> Path:
    """HERMES_HOME as hermes-agent resolves it: its own resolver when it is importable (it also
    honours a profile override), else ``$HERMES_HOME``, else its platform default."""
    if environ is None:
        try:
            constants = importlib.import_module("hermes_constants")
        except ImportError:
            pass
        else:
            return Path(constants.get_hermes_home())
    env = os.environ if environ is None else environ
    value = env.get(HOME_VARIABLE, "").strip()
    if value:
        return Path(value)
    if sys.platform == "win32":
        local = env.get("LOCALAPPDATA", "").strip()
        return (Path(local) if local else Path.home() / "AppData" / "Local") / "hermes"
    return Path.home() / ".hermes"


def config_path(hermes_home: Path) -> Path:
    return hermes_home / CONFIG_FILE


def read_config_file(hermes_home: Path) -> dict[str, Any]:
    """The saved provider config ({} when there is none).

    Raises:
        ConfigurationError: the file is not a JSON object of known keys.
    """
    path = config_path(hermes_home)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ConfigurationError(f"cannot read {path}: {exc}") from exc
    try:
        values = json.loads(text)
    except ValueError as exc:
        raise ConfigurationError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(values, dict):
        raise ConfigurationError(f"{path} must hold a JSON object")
    _check_keys(values, str(path))
    return values


def load(hermes_home: Path, environ: Mapping[str, str] | None = None) -> ProviderConfig:
    """The provider's config for this HERMES_HOME: defaults, the file, then the environment.

    Raises:
        ConfigurationError: a value in the file or the environment is invalid.
    """
    return resolve(hermes_home, read_config_file(hermes_home),
                   os.environ if environ is None else environ)


def resolve(hermes_home: Path, values: Mapping[str, Any],
            environ: Mapping[str, str]) -> ProviderConfig:
    """Raises ConfigurationError for an unknown key or an invalid value."""
    _check_keys(values, "the provider config")
    # The file's values go through the same parser as the environment's, so a value reads
    # the same whichever of the two it comes from; an error names the key it was given as.
    text = {name: _as_text(name, value) for name, value in values.items()
            if name != DEFAULT_USER_ID and value is not None and value != ""}
    try:
        chosen = read_env(Settings, text, "", skip=STRUCTURED_FIELDS, upper=False)
        honcho = read_env(HonchoConfig, text, HONCHO_KEY_PREFIX, upper=False)
        templates = read_env(TemplateSettings, text, TEMPLATE_KEY_PREFIX, upper=False)
        TemplateSettings(**templates)  # type: ignore[arg-type]  # the file's own errors
    except ConfigurationError as exc:
        raise ConfigurationError(f"the provider config: {exc}") from None
    from_env = read_env(Settings, environ, ENV_PREFIX, skip=STRUCTURED_FIELDS)
    chosen.update(from_env)
    honcho.update(read_env(HonchoConfig, environ, HONCHO_PREFIX))
    templates.update(read_env(TemplateSettings, environ, TEMPLATE_PREFIX))
    db = chosen.get("db_path")
    if db is None:
        chosen["db_path"] = hermes_home / DEFAULT_DB
    else:
        path = Path(os.path.expanduser(_expand_home(str(db), hermes_home)))
        if "db_path" not in from_env and not path.is_absolute():
            path = hermes_home / path  # relative to HERMES_HOME in the file, to the cwd in env
        chosen["db_path"] = path
    chosen.setdefault("backend", auto_backend(chosen, environ))
    if chosen.get("backend") == "honcho":
        chosen["honcho"] = HonchoConfig(**honcho)  # type: ignore[arg-type]
    chosen["templates"] = TemplateSettings(**templates)  # type: ignore[arg-type]
    settings = Settings(**chosen)  # type: ignore[arg-type]
    user = values.get(DEFAULT_USER_ID)
    if user is not None and not isinstance(user, str):
        raise ConfigurationError(f"{DEFAULT_USER_ID} must be a string, got {user!r}")
    return ProviderConfig(settings=settings, default_user_id=user or None)


def save(values: Mapping[str, Any], hermes_home: Path) -> Path:
    """Merge ``values`` into the config file after checking the result; returns its path.

    Raises:
        ConfigurationError: a key is unknown or a value is invalid; nothing was written.
        OSError: the file cannot be written.
    """
    merged = {**read_config_file(hermes_home), **dict(values)}
    merged = {k: v for k, v in merged.items() if v is not None and v != ""}
    # Validate, environment aside but for the API key, which never lives in this file:
    # Hermes keeps it in its .env.
    resolve(hermes_home, merged, {HONCHO_PREFIX + "API_KEY": "kept-in-the-environment"})
    path = config_path(hermes_home)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def config_schema() -> list[dict[str, Any]]:
    """The fields ``hermes memory setup`` asks for (all optional). The Honcho API key is the
    one secret: Hermes keeps it in its .env as HONCHO_API_KEY, never in the config file."""
    return [
        {"key": "db_path",
         "description": "SQLite store file; its outbox folder lives beside it",
         "default": f"${HOME_VARIABLE}/{DEFAULT_DB.as_posix()}"},
        {"key": DEFAULT_USER_ID,
         "description": "User id recall is scoped to when Hermes gives none "
                        "(default: one per profile on the CLI, per session elsewhere)",
         "default": ""},
        {"key": "recall_limit", "description": "Snippets in each recall block",
         "default": _default("recall_limit")},
        {"key": "recent_turns",
         "description": "Latest turns of the session shown before each reply",
         "default": _default("recent_turns")},
        {"key": "shutdown_deadline_s",
         "description": "Seconds shutdown waits for turns to commit (the rest stays durable "
                        "on disk and is committed at the next start)",
         "default": _default("shutdown_deadline_s")},
        {"key": "backend",
         "description": "Replica backend: null (this machine only) or honcho (a Honcho "
                        "server, cloud or self-hosted; the local store stays the record). "
                        "Unset: honcho when HONCHO_API_KEY is set and the honcho extra is "
                        "installed, else null",
         "default": "", "choices": list(BACKENDS)},
        {"key": "kv_backend",
         "description": "Key-value memory (the memory tool): local, honcho (local, mirrored "
                        "to Honcho), null (stores nothing) or auto (as the replica backend)",
         "default": "auto", "choices": list(KV_BACKENDS)},
        {"key": "template_warm_start",
         "description": "Start each new session warm from the best proven template of its "
                        "task type (template_warm_task_type; unset: the one the user's recent "
                        "tool calls make)",
         "default": "false", "choices": ["false", "true"]},
        {"key": "honcho_base_url", "description": "Honcho base URL (self-hosted or cloud)",
         "default": PRODUCTION_URL, "env_var": HONCHO_PREFIX + "BASE_URL"},
        {"key": "honcho_api_key",
         "description": "Honcho API key (not needed for a server on this machine)",
         "secret": True, "env_var": HONCHO_PREFIX + "API_KEY"},
        {"key": "honcho_workspace_id", "description": "Honcho workspace",
         "default": _honcho_default("workspace_id")},
        {"key": "honcho_assistant_peer", "description": "Honcho peer name of the assistant",
         "default": _honcho_default("assistant_peer")},
        {"key": "honcho_user_peer_prefix", "description": "Prefix of each user's Honcho peer",
         "default": _honcho_default("user_peer_prefix")},
        {"key": "honcho_recall_mode", "description": "What a recall asks Honcho for",
         "default": _honcho_default("recall_mode"), "choices": list(RECALL_MODES)},
    ]


def _honcho_default(name: str) -> str:
    (field,) = (f for f in dataclasses.fields(HonchoConfig) if f.name == name)
    return str(field.default)


def _default(name: str) -> str:
    (field,) = (f for f in dataclasses.fields(Settings) if f.name == name)
    return str(field.default)


def _check_keys(values: Mapping[str, Any], where: str) -> None:
    unknown = sorted(set(values) - _SETTING_FIELDS - _PROVIDER_FIELDS - _HONCHO_FIELDS
                     - _TEMPLATE_FIELDS)
    if "honcho_api_key" in values:
        raise ConfigurationError(
            f"{where}: the Honcho API key belongs in the environment (HONCHO_API_KEY, which "
            "Hermes keeps in its .env), not in a config file")
    if unknown:
        raise ConfigurationError(f"unknown key(s) in {where}: {', '.join(unknown)}")


def _as_text(name: str, value: Any) -> str:
    """A JSON value of the file as the text an environment variable would hold."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if not isinstance(value, (str, int, float)):
        raise ConfigurationError(f"{name} must be a string or a number, got {value!r}")
    return str(value)


def _expand_home(value: str, hermes_home: Path) -> str:
    for marker in _HOME_MARKERS:
        value = value.replace(marker, str(hermes_home))
    return value
