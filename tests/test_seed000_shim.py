"""The seed 000 shim (tests/seed000) is ``agent.memory`` for the seed's tests only: here, as
for every other test, ``agent`` is Hermes Agent's own package, which has no ``memory``."""

from __future__ import annotations

import importlib
import sys

import pytest

from .seed000.conftest import SEED_MODULES, _Registered


def test_no_other_test_sees_the_shim() -> None:
    agent = importlib.import_module("agent")
    assert not hasattr(agent, "memory")
    assert not any(name in sys.modules for name in SEED_MODULES)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("agent.memory")


def test_registering_maps_the_seeds_names_and_undoing_removes_them() -> None:
    registered = _Registered()
    try:
        from .seed000.shim.local_backend import LocalBackend

        seed = importlib.import_module("agent.memory.local_backend")
        assert seed.LocalBackend is LocalBackend
        assert importlib.import_module("agent").memory.local_backend is seed
    finally:
        registered.undo()
    assert not any(name in sys.modules for name in SEED_MODULES)
    assert not hasattr(sys.modules["agent"], "memory")
