"""The shim's modules are ``agent.memory*`` while this folder's test modules are imported and
while each of their tests runs, and only then: ``agent`` is Hermes Agent's real package
(installed with hermes-agent), which has no ``memory``, and no other test may see one.

Each test also runs as the seed's ran, in an environment of its own: no ``HERMES_MEMORY_*``
or ``HONCHO_*`` variable of the developer's shell reaches it, and the default store (the
seed's ``~/.hermes/memory.db``) is a file in the test's temporary folder. Whatever the seed's
tests leave open (its fixture never closes its ``LocalBackend``) is closed after each test.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Generator, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from . import shim
from .shim import evaluation, honcho_backend, local_backend

SEED_MODULES: dict[str, ModuleType] = {
    "agent.memory": shim,
    "agent.memory.local_backend": local_backend,
    "agent.memory.honcho_backend": honcho_backend,
    "agent.memory.evaluation": evaluation,
}
_MISSING = object()


class _Registered:
    """What registering replaced, to put back."""

    def __init__(self) -> None:
        self.modules = {name: sys.modules.get(name) for name in SEED_MODULES}
        self.placeholder = False
        try:
            self.parent = importlib.import_module("agent")
        except ImportError:  # hermes-agent not installed: a bare parent for the shim
            self.parent, self.placeholder = ModuleType("agent"), True
            self.parent.__path__ = []
            sys.modules["agent"] = self.parent
        self.attribute = getattr(self.parent, "memory", _MISSING)
        sys.modules.update(SEED_MODULES)
        setattr(self.parent, "memory", shim)  # noqa: B010

    def undo(self) -> None:
        for name, module in self.modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        if self.attribute is _MISSING:
            delattr(self.parent, "memory")
        else:
            setattr(self.parent, "memory", self.attribute)  # noqa: B010
        if self.placeholder:
            sys.modules.pop("agent", None)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, object, object]:
    """Importing a test module of this folder (its top-level ``from agent.memory import``)."""
    if not isinstance(collector, pytest.Module):
        return (yield)
    registered = _Registered()
    try:
        return (yield)
    finally:
        registered.undo()


@pytest.fixture(autouse=True)
def _as_the_seed_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in list(os.environ):
        if name.startswith(("HERMES_MEMORY_", "HONCHO_")):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HERMES_MEMORY_DB_PATH", str(tmp_path / "home" / "memory.db"))
    registered = _Registered()
    try:
        yield
    finally:
        shim.reset_backend()
        for backend in list(shim.OPENED):
            backend.close()
        registered.undo()
