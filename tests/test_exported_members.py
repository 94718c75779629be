from __future__ import annotations

import hermes_async_memory


def test_all_is_sorted_and_complete() -> None:
    exported = hermes_async_memory.__all__
    assert exported == sorted(exported)
    for name in exported:  # lazy exports (the Hermes provider) appear once reached
        getattr(hermes_async_memory, name)
    public = {
        name for name, value in vars(hermes_async_memory).items()
        if not name.startswith("_")
        and getattr(value, "__module__", "").startswith("hermes_async_memory")
    }
    assert public == set(exported)
