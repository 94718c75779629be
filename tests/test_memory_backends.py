"""The key-value memory's backends: their identity, the choice of one (no process-wide
default), the null backend, Honcho (a real SDK over HTTP to a server on 127.0.0.1) with the
local store as the system of record, and Hermes's memory hooks kept as key-value entries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.backends.honcho import KEY_FIELD, honcho_id
from hermes_async_memory.backends.honcho.mapping import MEMORY_FIELD
from hermes_async_memory.errors import ConfigurationError
from hermes_async_memory.memory import (
    BackendLimitError,
    HonchoMemory,
    InvalidEntryError,
    KeyValueMemory,
    NullMemory,
)
from hermes_async_memory.memory.mirror import (
    builtin_key,
    mirror_builtin_write,
    record_delegation,
)
from hermes_async_memory.ops import lane_of

from .fake_honcho import FakeHoncho
from .test_honcho_pipeline import WORKSPACE, eventually, honcho_config


def test_each_backend_has_the_seeds_identity_without_io(tmp_path: Path) -> None:
    null = NullMemory()
    assert (null.backend_name, null.is_cloud, null.is_available()) == (
        "null (disabled)", False, True)
    mem = MemoryPipeline(Settings(db_path=tmp_path / "m.db"))
    assert isinstance(mem.memory, KeyValueMemory)
    assert (mem.memory.backend_name, mem.memory.is_cloud) == ("local (SQLite)", False)
    assert mem.memory.is_available() is False  # not started: writes are not accepted yet
    assert mem.memory.location == str(tmp_path / "m.db")


def test_the_choice_follows_the_settings_then_honcho_key_then_local(tmp_path: Path) -> None:
    db = str(tmp_path / "m.db")
    env = {"HERMES_MEMORY_DB_PATH": db}
    # Nothing set: the local store.
    assert Settings.from_env(env).backend == "null"
    assert isinstance(MemoryPipeline(Settings.from_env(env)).memory, KeyValueMemory)
    # HONCHO_API_KEY set and honcho-ai installed (it is, in the test extra): Honcho.
    keyed = Settings.from_env({**env, "HONCHO_API_KEY": "hk-test"})
    assert keyed.backend == "honcho" and keyed.honcho is not None
    assert keyed.honcho.api_key == "hk-test"
    assert isinstance(MemoryPipeline(keyed).memory, HonchoMemory)
    # Explicit settings win over the key.
    for explicit, kind in (("local", KeyValueMemory), ("null", NullMemory)):
        chosen = Settings.from_env({**env, "HONCHO_API_KEY": "hk-test",
                                    "HERMES_MEMORY_KV_BACKEND": explicit})
        memory = MemoryPipeline(chosen).memory
        assert type(memory) is kind, explicit
    off = Settings.from_env({**env, "HONCHO_API_KEY": "hk", "HERMES_MEMORY_BACKEND": "null"})
    assert off.backend == "null"
    # No singleton: two pipelines in one process, each with its own choice.
    a = MemoryPipeline(Settings(db_path=tmp_path / "a.db"))
    b = MemoryPipeline(Settings(db_path=tmp_path / "b.db", kv_backend="null"))
    assert isinstance(a.memory, KeyValueMemory) and isinstance(b.memory, NullMemory)
    with pytest.raises(ConfigurationError, match="needs backend 'honcho'"):
        Settings(db_path=tmp_path / "c.db", kv_backend="honcho")
    with pytest.raises(ConfigurationError, match="kv_backend must be one of"):
        Settings(db_path=tmp_path / "c.db", kv_backend="redis")  # type: ignore[arg-type]


async def test_the_null_backend_stores_nothing_and_answers_empty(tmp_path: Path) -> None:
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db", kv_backend="null")) as mem:
        kv = mem.memory
        assert isinstance(kv, NullMemory)
        receipt = await kv.store("ann", "editor", "vim", {"n": 1})
        assert receipt.session_id == lane_of("ann")
        assert await kv.retrieve("ann", "editor") is None
        assert await kv.list_keys("ann") == []
        assert await kv.query("ann", "vim") == []
        await kv.delete("ann", "editor")
        assert await kv.counts() == (0, 0)
        # Bad input is refused as it is by the other backends.
        with pytest.raises(InvalidEntryError, match="key"):
            await kv.store("ann", "", "x")
        with pytest.raises(InvalidEntryError, match="value"):
            await kv.store("ann", "k", 5)  # type: ignore[arg-type]
        blocking = kv.blocking()
        assert blocking.retrieve("ann", "editor") is None and blocking.list_keys("ann") == []
        with pytest.raises(InvalidEntryError, match="query must be a string"):
            blocking.query("ann", 5)  # type: ignore[arg-type]
        await mem.flush()
        assert await mem.store.memory_counts() == (0, 0)  # nothing reached the store


def memory_messages(fake: FakeHoncho, user: str) -> list[dict[str, Any]]:
    return fake.session_messages(honcho_id(lane_of(user)), WORKSPACE)


async def test_honcho_gets_each_write_as_a_typed_message_and_local_stays_the_record(
    tmp_path: Path, fake: FakeHoncho
) -> None:
    settings = Settings(db_path=tmp_path / "m.db", backend="honcho",
                        honcho=honcho_config(fake))
    async with MemoryPipeline(settings) as mem:
        kv = mem.memory
        assert isinstance(kv, HonchoMemory)
        assert (kv.backend_name, kv.is_cloud, kv.is_available()) == ("honcho (cloud)", True, True)
        assert fake.base_url in kv.location
        puts = [await kv.store("ann", "editor", "vim", {"source": "chat"}),
                await kv.store("ann", "editor", "helix"),
                await kv.store("ann", "shell", "fish")]
        await kv.store("bob", "editor", "emacs")
        await kv.settled("ann")
        await kv.settled("bob")
        msgs = memory_messages(fake, "ann")
        # Each write once, in order, typed.
        assert [m["metadata"][KEY_FIELD] for m in msgs] == [r.key for r in puts]
        assert [m["content"] for m in msgs] == ["vim", "helix", "fish"]
        assert [m["metadata"][MEMORY_FIELD]["op"] for m in msgs] == ["put"] * 3
        assert msgs[0]["metadata"][MEMORY_FIELD]["key"] == "editor"
        assert msgs[0]["metadata"][MEMORY_FIELD]["metadata"] == {"source": "chat"}
        assert [m["content"] for m in memory_messages(fake, "bob")] == ["emacs"]
        # Reads answer from the local store, even with Honcho down.
        fake.down()
        got = await kv.retrieve("ann", "editor")
        assert got is not None and got.value == "helix"
        assert await kv.list_keys("ann") == ["shell", "editor"]
        fake.up()
        # Honcho cannot delete one message: the error says so, and the local delete holds.
        with pytest.raises(BackendLimitError, match="Honcho cannot delete") as caught:
            await kv.delete("ann", "shell")
        assert caught.value.done == "deleted locally" and caught.value.receipt is not None
        assert await kv.retrieve("ann", "shell") is None
        await kv.settled("ann")
        last = memory_messages(fake, "ann")[-1]
        assert last["metadata"][MEMORY_FIELD] == {
            "op": "delete", "key": "shell", "metadata": {}, "at": caught.value.receipt.accepted_at}
        await eventually(mem, lambda: len(memory_messages(fake, "ann")) == 4, "4 messages")
    # The turns' sessions never hold a memory message, nor the reverse.
    assert all(MEMORY_FIELD in m["metadata"] for m in memory_messages(fake, "ann"))


async def test_hermes_memory_writes_become_entries_add_replace_remove(mem: MemoryPipeline
                                                                     ) -> None:
    kv = mem.memory
    assert isinstance(kv, KeyValueMemory)
    key = await mirror_builtin_write(kv, "ann", "add", "user", "Prefers dark mode in editors")
    assert key == builtin_key("user", "Prefers dark mode in editors")
    other = await mirror_builtin_write(kv, "ann", "add", "memory", "Project uses Python 3.11")
    # replace finds the entry by the text it holds (as Hermes does) and keeps its key.
    replaced = await mirror_builtin_write(kv, "ann", "replace", "user",
                                          "Prefers light mode in editors",
                                          old_text="dark mode")
    assert replaced == key
    got = await kv.retrieve("ann", key)
    assert got is not None and got.value == "Prefers light mode in editors"
    assert got.metadata["action"] == "replace" and got.metadata["target"] == "user"
    # The search is per target: "Python" is in target memory, not user.
    assert await mirror_builtin_write(kv, "ann", "remove", "user", "",
                                      old_text="Python") is None
    assert await mirror_builtin_write(kv, "ann", "remove", "memory", "",
                                      old_text="Python 3.11") == other
    assert await kv.list_keys("ann") == [key]
    with pytest.raises(InvalidEntryError, match="action"):
        await mirror_builtin_write(kv, "ann", "append", "user", "x")
    obs = await record_delegation(kv, "ann", "Summarise the logs", "3 errors, all timeouts",
                                  session_id="s1", child_session_id="child-7")
    entry = await kv.retrieve("ann", obs)
    assert entry is not None and entry.value == ("Task: Summarise the logs\n"
                                                 "Result: 3 errors, all timeouts")
    assert entry.metadata == {"kind": "observation", "source": "hermes-delegation",
                              "session_id": "s1", "child_session_id": "child-7"}
