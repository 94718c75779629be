"""Key-value memory for synchronous code with no pipeline of its own (seed 000's blocking
``LocalBackend``, ``HonchoBackend`` and ``NullBackend``): ``StandaloneMemory``.

It opens a ``MemoryPipeline`` on ``settings.db_path`` on an event-loop thread of its own, the
way the Hermes provider does (``hermes.runtime``): shared with anything else in this process
on that file, since a store file admits one pipeline, and closed at interpreter exit if
nobody closed it. The operations are ``KeyValueMemory``'s, with its guarantees: a write is
durable when it returns its receipt, and a read sees every write acknowledged before it.
"""

from __future__ import annotations

import contextvars
import os
import threading
from collections.abc import Callable, Coroutine, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from ..env import read_env
from ..errors import ConfigurationError, PipelineClosedError
from ..settings import ENV_PREFIX, STRUCTURED_FIELDS, Settings, auto_backend
from ..turns import Receipt
from .api import READ_TIMEOUT_S, KeyValueMemory
from .backends import HonchoMemory, Memory, NullMemory, _at_once, kv_choice
from .entries import MemoryEntry

if TYPE_CHECKING:
    from ..hermes.runtime import Runtime
    from .evaluation import Evaluation, Scoring

T = TypeVar("T")
Kind = Literal["local", "honcho", "null"]
_IDENTITY: dict[Kind, type[KeyValueMemory] | type[NullMemory]] = {
    "local": KeyValueMemory, "honcho": HonchoMemory, "null": NullMemory}
EVALUATE_TIMEOUT_S = 600.0


class StandaloneMemory:
    """A user-keyed key-value memory for code without an event loop: ``store``, ``retrieve``,
    ``query``, ``list_keys`` and ``delete``, each a plain call from any thread.

    ``StandaloneMemory(settings)`` opens the store at once, unless the settings' key-value
    backend (``Settings.kv_backend``, "auto" as for a pipeline) is "null", which opens
    nothing. ``close()``, or leaving a ``with`` block, drains within
    ``settings.shutdown_deadline_s`` and releases it. ``from_env()`` chooses the backend
    from the environment as seed 000's ``get_memory_backend()`` does, without its
    process-wide singleton.

    Raises (from the constructor):
        StoreError: the store or its outbox cannot be opened.
    """

    def __init__(self, settings: Settings, *, timeout_s: float = READ_TIMEOUT_S) -> None:
        self.settings = settings
        self.kind: Kind = kv_choice(settings.kv_backend, settings.backend)
        self._timeout_s = timeout_s
        self._problem: ConfigurationError | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._runtime: Runtime | None = None
        self._memory: Memory | None = None
        if self.kind == "null":
            self._memory = NullMemory()
        else:
            from ..hermes.runtime import acquire  # (it imports the pipeline, which imports us)

            runtime = acquire(settings, contextvars.copy_context())
            assert runtime.pipeline is not None
            self._runtime, self._memory = runtime, runtime.pipeline.memory

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *,
                 timeout_s: float = READ_TIMEOUT_S, **overrides: object) -> StandaloneMemory:
        """The memory ``Settings.from_env(environ, **overrides)`` configures, chosen in seed
        000's order: ``HERMES_MEMORY_BACKEND`` (``local``, ``honcho``; or
        ``HERMES_MEMORY_KV_BACKEND``, or a ``backend`` / ``kv_backend`` override); else Honcho
        when ``HONCHO_API_KEY`` is set and the honcho extra installed; else none: "null",
        which stores nothing and opens no store file (a pipeline's "auto" would be the local
        store, which it has anyway; here nobody asked for one).

        Honcho that cannot be configured (no ``HONCHO_API_KEY`` for a server that is not on
        this machine, say) does not raise here, as seed 000's ``HonchoBackend()``:
        ``is_available()`` is False, ``problem`` says why, and each operation raises that
        ``ConfigurationError``.

        Raises:
            ConfigurationError: a variable does not parse, or the settings do not hold (but
                for Honcho's, above).
            StoreError: the store cannot be opened.
        """
        env = os.environ if environ is None else environ
        chosen = read_env(Settings, env, ENV_PREFIX, skip=STRUCTURED_FIELDS)
        chosen.update(overrides)
        replica = chosen.get("backend", auto_backend(chosen, env))
        wants_honcho = "honcho" in (chosen.get("kv_backend"), replica)
        try:
            settings = Settings.from_env(env, **overrides)
        except ConfigurationError as exc:
            if not wants_honcho:
                raise
            # Only Honcho's own problem waits for use: the rest must hold (else this raises).
            Settings.from_env(env, **{**overrides, "backend": "null", "kv_backend": "null"})
            return cls._unusable(exc, timeout_s)
        if "backend" not in chosen and "kv_backend" not in chosen and replica != "honcho":
            settings = settings.replace(kv_backend="null")  # nothing chose a store
        return cls(settings, timeout_s=timeout_s)

    @classmethod
    def _unusable(cls, problem: ConfigurationError, timeout_s: float) -> StandaloneMemory:
        memory = cls(Settings(kv_backend="null"), timeout_s=timeout_s)
        memory.kind = "honcho"
        memory._memory = None
        memory._problem = problem
        return memory

    # -- identity (seed 000's), no I/O ---------------------------------------------------

    @property
    def backend_name(self) -> str:
        memory = self._memory
        return memory.backend_name if memory is not None else _IDENTITY[self.kind].backend_name

    @property
    def is_cloud(self) -> bool:
        memory = self._memory
        return memory.is_cloud if memory is not None else _IDENTITY[self.kind].is_cloud

    @property
    def problem(self) -> str | None:
        """Why this memory cannot be used (its configuration does not hold), or None."""
        return None if self._problem is None else str(self._problem)

    def is_available(self) -> bool:
        """Whether operations can be tried now: configured, open, and (Honcho) its circuit
        not open. No I/O."""
        return not self._closed and self._memory is not None and self._memory.is_available()

    @property
    def location(self) -> str:
        """Where the entries live."""
        memory = self._memory
        return memory.location if memory is not None else "nowhere (not configured)"

    # -- writes: durable on return, no I/O --------------------------------------------------

    def store(self, user_id: str, key: str, value: str,
              metadata: Mapping[str, Any] | None = None) -> Receipt:
        """``KeyValueMemory.store_nowait``: set ``key`` of the user's memory to ``value``.

        Raises:
            InvalidEntryError, QueueFullError, DiskFullError, PipelineClosedError;
            ConfigurationError: ``problem``.
        """
        return self._require().store_nowait(user_id, key, value, metadata)

    def delete(self, user_id: str, key: str) -> Receipt:
        """``KeyValueMemory.delete_nowait``: remove ``key`` from the user's memory.

        Raises:
            as ``store``; BackendLimitError (Honcho): deleted here, not in Honcho.
        """
        return self._require().delete_nowait(user_id, key)

    # -- reads ------------------------------------------------------------------------------

    def retrieve(self, user_id: str, key: str) -> MemoryEntry | None:
        """The entry under ``key``, or None.

        Raises:
            InvalidEntryError, PipelineClosedError, TimeoutError (no answer within
            ``timeout_s``), StoreError; ConfigurationError: ``problem``.
        """
        return self._run(lambda m: m.retrieve(user_id, key))

    def query(self, user_id: str, text: str, limit: int = 10) -> list[MemoryEntry]:
        """Entries whose key or value hold words of ``text``, best match first."""
        return self._run(lambda m: m.query(user_id, text, limit))

    def list_keys(self, user_id: str) -> list[str]:
        """The user's keys, most recently updated first."""
        return self._run(lambda m: m.list_keys(user_id))

    def counts(self) -> tuple[int, int]:
        """(entries, users) committed in the store."""
        return self._run(lambda m: m.counts())

    def settled(self, user_id: str, timeout_s: float = READ_TIMEOUT_S) -> None:
        """Return once the user's acknowledged writes are committed (and, for Honcho, sent)."""
        self._run(lambda m: m.settled(user_id, timeout_s), timeout_s + self._timeout_s)

    def evaluate(self, *, operations: int = 200, scoring: Scoring | None = None,
                 timeout_s: float = EVALUATE_TIMEOUT_S) -> Evaluation:
        """``evaluation.evaluate_backend`` on this memory (scratch users, removed after)."""
        from .evaluation import SCORING, evaluate_backend

        chosen = SCORING if scoring is None else scoring
        return self._run(lambda m: evaluate_backend(m, operations=operations, scoring=chosen),
                         timeout_s)

    def _require(self) -> Memory:
        if self._problem is not None:
            raise self._problem
        if self._closed or self._memory is None:
            raise PipelineClosedError("the memory is closed")
        return self._memory

    def _run(self, make: Callable[[Memory], Coroutine[Any, Any, T]],
             timeout_s: float | None = None) -> T:
        memory = self._require()
        runtime = self._runtime
        if runtime is None:  # null: its coroutines never wait
            return _at_once(make(memory))
        return runtime.call(lambda _pipeline: make(memory),
                            self._timeout_s if timeout_s is None else timeout_s)

    # -- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        """Drain within ``settings.shutdown_deadline_s`` and release the store (the last of
        its users in this process closes it; what is not drained stays durable in the
        outbox for the next start). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            runtime, self._runtime = self._runtime, None
        if runtime is not None:
            from ..hermes.runtime import release

            release(runtime, self.settings.shutdown_deadline_s)

    def __enter__(self) -> StandaloneMemory:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else self.problem or self.location
        return f"<StandaloneMemory {self.backend_name}: {state}>"
