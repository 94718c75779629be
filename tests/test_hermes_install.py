"""``hermes-memory hermes install``: the plugin folder, as Hermes Agent's loaders read it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hermes_async_memory import cli
from hermes_async_memory.hermes import config as hconfig

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
NAME = hconfig.PROVIDER_NAME


def plugin_dir(home: Path) -> Path:
    return home / "plugins" / NAME


def test_install_writes_a_folder_hermes_recognises(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "home"
    assert cli.main(["hermes", "install", "--hermes-home", str(home)]) == 0
    out = capsys.readouterr().out
    assert f"memory.provider: {NAME}" in out
    init = (plugin_dir(home) / "__init__.py").read_text(encoding="utf-8")
    # plugins/memory/__init__.py: the text check over the first 8 KB, then register(ctx).
    assert "MemoryProvider" in init[:8192]
    assert "def register" in init or "import HermesMemoryProvider, register" in init
    manifest = yaml.safe_load((plugin_dir(home) / "plugin.yaml").read_text(encoding="utf-8"))
    assert manifest["name"] == NAME
    assert manifest["kind"] == "exclusive"  # the general plugin manager leaves it alone
    assert "hermes-async-memory" in manifest["description"]


def test_reinstall_replaces_our_own_files(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert cli.main(["hermes", "install", "--hermes-home", str(home)]) == 0
    (plugin_dir(home) / "__init__.py").write_text(
        (plugin_dir(home) / "__init__.py").read_text() + "# edited\n")
    assert cli.main(["hermes", "install", "--hermes-home", str(home)]) == 0
    assert "# edited" not in (plugin_dir(home) / "__init__.py").read_text()


def test_a_foreign_folder_is_kept_unless_forced(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "home"
    plugin_dir(home).mkdir(parents=True)
    (plugin_dir(home) / "__init__.py").write_text("# someone else's plugin\n")
    assert cli.main(["hermes", "install", "--hermes-home", str(home)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hermes-memory: error: ") and "--force" in err[0]
    assert (plugin_dir(home) / "__init__.py").read_text() == "# someone else's plugin\n"
    assert cli.main(["hermes", "install", "--hermes-home", str(home), "--force"]) == 0
    assert "MemoryProvider" in (plugin_dir(home) / "__init__.py").read_text()


def test_a_hermes_home_that_is_a_file_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    home = tmp_path / "file"
    home.write_text("")
    assert cli.main(["hermes", "install", "--hermes-home", str(home)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a directory" in err[0]


def test_hermes_home_defaults_as_hermes_agent_resolves_it(tmp_path: Path) -> None:
    home = tmp_path / "from-env"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HERMES_MEMORY_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["HERMES_HOME"] = str(home)
    result = subprocess.run(
        [sys.executable, "-m", "hermes_async_memory.cli", "hermes", "install"],
        capture_output=True, text=True, env=env, timeout=60, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert (plugin_dir(home) / "plugin.yaml").is_file()


def test_without_hermes_home_the_default_is_dot_hermes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("HERMES_HOME", raising=False)
    assert hconfig.default_hermes_home() == tmp_path / ".hermes"  # hermes-agent's resolver
    assert hconfig.default_hermes_home({}) == tmp_path / ".hermes"  # the fallback


def test_hermes_plugin_manager_routes_the_folder_to_memory_discovery(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    plugins = pytest.importorskip("hermes_cli.plugins")
    home = tmp_path / "home"
    assert cli.main(["hermes", "install", "--hermes-home", str(home)]) == 0
    monkeypatch.setenv("HERMES_HOME", str(home))
    manager = plugins.PluginManager()
    manifest = manager._parse_manifest(plugin_dir(home) / "plugin.yaml", plugin_dir(home),
                                       "user", "")
    assert manifest is not None and manifest.kind == "exclusive" and manifest.name == NAME


def test_the_config_schema_and_file_carry_the_honcho_backend(tmp_path: Path) -> None:
    from hermes_async_memory.backends import HonchoConfig
    from hermes_async_memory.errors import ConfigurationError
    config = hconfig

    keys = {field["key"]: field for field in config.config_schema()}
    assert keys["honcho_api_key"]["secret"] is True
    assert keys["honcho_api_key"]["env_var"] == "HONCHO_API_KEY"
    assert {"backend", "honcho_base_url", "honcho_workspace_id", "honcho_assistant_peer",
            "honcho_user_peer_prefix"} <= set(keys)

    config.save({"backend": "honcho", "honcho_base_url": "https://honcho.example.org",
                 "honcho_workspace_id": "team", "honcho_assistant_peer": "atlas"}, tmp_path)
    env = {"HONCHO_API_KEY": "hk-from-the-env"}
    settings = config.load(tmp_path, env).settings
    assert settings.backend == "honcho"
    assert settings.honcho == HonchoConfig(
        base_url="https://honcho.example.org", api_key="hk-from-the-env",
        workspace_id="team", assistant_peer="atlas")
    assert "hk-from-the-env" not in repr(settings)
    with pytest.raises(ConfigurationError, match="API key belongs in the environment"):
        config.save({"honcho_api_key": "hk-in-a-file"}, tmp_path)
    with pytest.raises(ConfigurationError, match="HONCHO_API_KEY"):  # remote URL, no key
        config.load(tmp_path, {})


def test_session_store_switch_hands_import_hermes_state_to_ours_and_back(
        tmp_path: Path) -> None:
    """The one documented change: after ``--session-store`` a Python that reads the site
    directory imports our SessionDB as ``hermes_state``; ``--no-session-store`` gives Hermes
    its own back. (A scratch site directory stands for the environment's site-packages.)"""
    home, site = tmp_path / "home", tmp_path / "site"
    site.mkdir()
    probe = ("import site, sys; site.addsitedir(sys.argv[1]); import hermes_state; "
             "print(hermes_state.__name__, hermes_state.DEFAULT_DB_PATH)")
    env = {**os.environ, "HERMES_HOME": str(home)}

    def imported() -> str:
        return subprocess.run([sys.executable, "-c", probe, str(site)], env=env, check=True,
                              capture_output=True, text=True, timeout=60).stdout.strip()

    assert imported().startswith("hermes_state ")  # Hermes's own
    args = ["hermes", "install", "--hermes-home", str(home), "--site-packages", str(site)]
    assert cli.main([*args, "--session-store"]) == 0
    name, path = imported().split(" ", 1)
    assert name == "hermes_async_memory.hermes.state"
    assert Path(path) == home / hconfig.DEFAULT_DB  # the provider's store: one file
    assert cli.main([*args, "--no-session-store"]) == 0
    assert imported().startswith("hermes_state ")
