"""``HermesMemoryProvider``: Hermes Agent's ``MemoryProvider`` contract over the pipeline.

How hermes-agent 0.19's ``MemoryManager`` calls it, and what each call costs here:

    initialize(session_id, hermes_home=…, platform=…)  opens (or joins) the pipeline on its
                                                       own event-loop thread (runtime.py)
    prefetch(query, session_id="")   a fresh thread each turn, joined ≤ 8 s: a dict lookup in
                                     the pipeline's cache, never a hop to the loop
    sync_turn / queue_prefetch       the manager's single worker thread: an mmap append
                                     (durable on return) / a queued recall; neither waits
    handle_tool_call                 the agent's thread: one search on the loop, time-boxed
    on_session_end, shutdown         flush / drain, within the deadline

The base class is hermes-agent's ``MemoryProvider`` when it is importable, else ``abc.ABC``,
so this module imports without hermes-agent. Hermes's plugin loader only needs an instance
from ``register(ctx)`` (see plugin.py); its fallback looks for a ``MemoryProvider`` subclass,
which this is whenever hermes-agent is there to load it.
"""

from __future__ import annotations

import abc
import contextvars
import json
import threading
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from ..errors import (
    FlushTimeoutError,
    HermesMemoryError,
    InvalidTurnError,
    PipelineClosedError,
    describe,
)
from ..memory import MEMORY_SCHEMA, MEMORY_TOOL, call_memory_tool
from ..memory.mirror import mirror_builtin_write, record_delegation
from ..procedural.tool import PROCEDURAL_SCHEMA, PROCEDURAL_TOOL, call_procedural_tool
from ..settings import Settings
from . import config as _config
from .runtime import Runtime, acquire, release
from .search_tool import SEARCH_SCHEMA, SEARCH_TOOL, SYSTEM_PROMPT, search_arguments
from .turn_messages import Span, TurnCursors, token_counts
from .warm import WarmStarts, tools_summary

if TYPE_CHECKING:
    from ..pipeline import MemoryPipeline

    _ProviderBase = abc.ABC
else:
    try:
        from agent.memory_provider import MemoryProvider as _ProviderBase
    except ImportError:  # hermes-agent is not installed: the contract is duck-typed
        _ProviderBase = abc.ABC

log = structlog.get_logger(__name__)

PROVIDER_NAME = _config.PROVIDER_NAME
# Agent contexts that must not write (hermes-agent: cron prompts, subagents and the memory
# flush agent would pollute the user's memory).
READ_ONLY_CONTEXTS = frozenset({"cron", "subagent", "flush"})
# Platforms where one person uses the agent: recall spans their sessions (one scope per
# profile, shared by these platforms).
LOCAL_PLATFORMS = frozenset({"cli", "tui"})
MEMORY_ACTIONS = frozenset({"add", "replace", "remove"})
TOOL_TIMEOUT_S = 5.0
# The tools that run on the pipeline's loop: (pipeline, user id, arguments) -> JSON text.
_PIPELINE_TOOLS: dict[str, Callable[[MemoryPipeline, str | None, Any],
                                    Coroutine[Any, Any, str]]] = {
    MEMORY_TOOL: lambda p, user, args: call_memory_tool(p.memory, user, args,
                                                        fence=p.fence),
    PROCEDURAL_TOOL: lambda p, user, args: call_procedural_tool(p.procedural, user, args),
}
# on_pre_compress: the last few user messages of the span make the recall query; the search
# is time-boxed because compression waits on it.
PRE_COMPRESS_USER_MESSAGES = 4
PRE_COMPRESS_QUERY_CHARS = 2000
PRE_COMPRESS_TIMEOUT_S = 2.0
# Sessions whose lineage (parent session) is remembered for their turns' metadata; also the
# bound on the sessions whose place in Hermes's conversation list is remembered (sync_turn).
MAX_LINEAGE = 256

class HermesMemoryProvider(_ProviderBase):
    """A Hermes Agent memory provider: turns durable without waiting, recall prefetched.

    Each turn is stored as its own span of the conversation Hermes hands ``sync_turn``, every
    message as Hermes holds it; on a session's first turn in this provider, earlier history
    is not sent again (a restarted process would store it twice): it can be imported with
    ``hermes-memory sessions import``.

    ``settings`` overrides what ``initialize`` would read from HERMES_HOME (for tests and
    embedding); without it, see ``hermes_async_memory.hermes.config``.
    """

    def __init__(self, settings: Settings | None = None, *,
                 default_user_id: str | None = None) -> None:
        self._settings = settings
        self._default_user_id = default_user_id
        self._runtime: Runtime | None = None
        self._lock = threading.Lock()  # initialize / shutdown transitions
        self._warm_starts = WarmStarts()  # new sessions' warm text, until delivered
        self._session_id = ""
        self._user_id: str | None = None
        self._writes = True
        self._base_metadata: dict[str, Any] = {}
        self._parents: dict[str, str] = {}
        self._model: str | None = None
        self._turn_number = 0
        self._remaining_tokens: int | None = None
        # Sessions whose row was marked as holding estimated token counts (bounded).
        self._estimated: dict[str, None] = {}
        # Per session, how much of Hermes's conversation list was handed to the store.
        self._cursors = TurnCursors(MAX_LINEAGE)
        self._turn_lock = threading.Lock()
        self._refused = 0  # turns the store refused (refused_turns)
        self._refused_lock = threading.Lock()

    # -- identity ----------------------------------------------------------------------

    @property
    def name(self) -> str:
        return PROVIDER_NAME

    def is_available(self) -> bool:
        """True: the store is a local file and this package imported. No I/O."""
        return True

    @property
    def session_id(self) -> str:
        """The session this provider is bound to (initialize or the last switch)."""
        return self._session_id

    @property
    def user_id(self) -> str | None:
        """The user recall is scoped to; None means per session."""
        return self._user_id

    @property
    def settings(self) -> Settings | None:
        """The pipeline's settings once initialized."""
        runtime = self._runtime
        return runtime.settings if runtime is not None else self._settings

    # -- life cycle --------------------------------------------------------------------

    def initialize(self, session_id: str, **kwargs: Any) -> None:
        """Bind to ``session_id`` and open the pipeline (shared with the process's other
        providers on the same store). kwargs as hermes-agent documents them: hermes_home,
        platform, agent_context, agent_identity, agent_workspace, parent_session_id, user_id.

        Raises:
            ConfigurationError: the provider config or the environment holds an invalid value.
            StoreError: the store or its outbox cannot be opened (e.g. another process has it).
        """
        home_arg = kwargs.get("hermes_home")
        hermes_home = Path(home_arg) if home_arg else _config.default_hermes_home()
        settings, default_user = self._settings, self._default_user_id
        if settings is None:
            loaded = _config.load(hermes_home)
            settings, default_user = loaded.settings, default_user or loaded.default_user_id
        platform = _text(kwargs.get("platform"))
        identity = _text(kwargs.get("agent_identity"))
        user_id = _text(kwargs.get("user_id")) or default_user
        if not user_id and platform in LOCAL_PLATFORMS:
            user_id = f"local:{identity or 'default'}"  # the CLI and the TUI: one person
        metadata = {
            "source": platform or None,
            "agent_identity": identity or None,
            "agent_workspace": _text(kwargs.get("agent_workspace")) or None,
        }
        with self._lock:
            self._session_id = session_id
            self._user_id = user_id or None
            self._writes = _text(kwargs.get("agent_context")) not in READ_ONLY_CONTEXTS
            self._base_metadata = {k: v for k, v in metadata.items() if v}
            parent = _text(kwargs.get("parent_session_id"))
            if parent and session_id:
                self._remember_parent(session_id, parent)
            if self._runtime is None:
                self._runtime = acquire(settings, contextvars.copy_context())
        self._warm(session_id)
        if self._writes:
            self._warm_starts.begin(self._require_runtime(), session_id, self._user_id)
        model = _text(kwargs.get("model"))
        if model:
            self._model = model
        config, prompt = kwargs.get("model_config"), kwargs.get("system_prompt")
        self._describe(session_id, "initialize", source=platform or None,
                       parent_session_id=_text(kwargs.get("parent_session_id")) or None,
                       model=model or None,
                       model_config=dict(config) if isinstance(config, Mapping) else None,
                       system_prompt=prompt if isinstance(prompt, str) and prompt else None)
        log.info("hermes_provider_initialized", session_id=session_id, platform=platform,
                 db=str(settings.db_path), writes=self._writes)

    def shutdown(self) -> None:
        """Drain and let go of the pipeline within its deadline; the last provider on the
        store closes it and joins its loop thread. Idempotent."""
        with self._lock:
            runtime, self._runtime = self._runtime, None
        if runtime is not None:
            release(runtime, runtime.settings.shutdown_deadline_s)

    # -- the turn path -----------------------------------------------------------------

    def system_prompt_block(self) -> str:
        """The tools' instructions; a new session's warm start; with ``procedural_summary``
        on, the user's tools' record (compact), when it can be read within a second."""
        warm = self._warm_starts.system_block(self._session_id)
        head = f"{SYSTEM_PROMPT}\n\n{warm}" if warm else SYSTEM_PROMPT
        summary = tools_summary(self._runtime, self._user_id)
        return f"{head}\n\n{summary}" if summary else head

    def prefetch(self, query: str, *, session_id: str = "") -> str:
        """The session's cached block: recent turns plus the last recall ("" when none).

        A dict lookup on the calling thread; never waits on the loop.
        """
        runtime = self._runtime
        pipeline = runtime.pipeline if runtime is not None else None
        session = session_id or self._session_id
        if pipeline is None or not session:
            return ""
        block = pipeline.prefetch(query, session_id=session, user_id=self._user_id)
        warm = self._warm_starts.take(session)  # a new session's first prefetch only
        return f"{warm}\n\n{block}" if warm and block else warm or block

    def queue_prefetch(self, query: str, *, session_id: str = "") -> None:
        """Recall for the session's next turn, in the background. Never waits.

        Raises:
            PipelineClosedError: the provider is not initialized (or was shut down).
        """
        session = session_id or self._session_id
        if not session or not isinstance(query, str) or not query.strip():
            return
        runtime = self._require_runtime()
        pipeline = runtime.pipeline
        if pipeline is None or runtime.closed_at_exit:
            return  # the process is exiting: a recall for a next turn is moot
        pipeline.queue_prefetch(query, session_id=session, user_id=self._user_id)

    def sync_turn(self, user_content: str, assistant_content: str, *, session_id: str = "",
                  messages: list[dict[str, Any]] | None = None) -> None:
        """Store a finished turn: durable when this returns, without waiting on the store.

        ``messages`` is Hermes's whole conversation (its live list). What is stored is this
        turn's span of it, every message exactly as Hermes holds it (copies, every key,
        nothing rewritten): from where the session's last call ended (so a turn synced in
        two calls, or an interrupted turn Hermes did not sync, is stored once, with the
        next turn) to this turn's final reply (the last assistant message without tool calls
        whose text matches ``assistant_content``, equal, stripped or one a prefix of the
        other, else the last one without tool calls); a next turn already in the list is
        left for its own call. On the first call for a session in this provider, or when
        the list was rewritten (``/undo``, ``/retry``, a compression), the span starts at
        this turn's start: back from its final reply to its user message and the user,
        system and developer messages right before it. Earlier history is not re-sent then
        (a restarted process would store it twice); ``hermes-memory sessions import`` brings
        it in. ``user_content`` (Hermes's text, cleaned of skill scaffolding) is not stored
        over the user message: Hermes's ``queue_prefetch`` call recalls with it, and the
        prefetch cache shows the stored messages. Without ``messages``, the turn is the
        two texts. Skipped for cron, subagent and flush agents.

        A turn the store refuses (``InvalidTurnError``: a message JSON cannot hold as
        given, the size limit) is not stored in part: the error propagates (Hermes logs
        it), ``hermes_turn_refused`` is logged and ``refused_turns`` counts it, and the next
        call starts after it. Any other error (a full disk, a full backlog) leaves the span
        for the next call to store.

        Raises:
            InvalidTurnError: the store refused the turn; nothing of it was stored.
            PipelineClosedError: the provider is not initialized (or was shut down).
            StoreError: the outbox cannot grow (disk full).
            QueueFullError: the backlog is full and its overflow policy is "reject".
        """
        if not self._writes:
            return
        session = session_id or self._session_id
        runtime = self._require_runtime()
        if not messages:
            self._store_turn(runtime, session, user_content, assistant_content, None)
            return
        with self._turn_lock:  # one span at a time: the cursor moves only once it is stored
            try:
                span = self._cursors.span(session, messages, assistant_content, user_content)
            except InvalidTurnError as exc:  # not a list
                self._refusal(session, exc, None)
                raise
            if span.rewritten:
                log.info("hermes_turn_list_rewritten", session_id=session,
                         handed=len(messages), start=span.start)
            if not span.rows:
                log.info("hermes_turn_already_stored", session_id=session,
                         handed=len(messages))
                return
            try:
                self._store_turn(runtime, session, user_content, assistant_content, span)
            except InvalidTurnError:
                # Refused for good (logged and counted): the session's next turns go on
                # after it rather than be refused with it.
                self._cursors.advance(session, span)
                raise
            except BaseException:
                self._cursors.hold(session, span)  # not stored: the next call includes it
                raise
            self._cursors.advance(session, span)

    @property
    def refused_turns(self) -> int:
        """How many turns the store refused (``InvalidTurnError``) since this provider
        was made; each one was also logged as ``hermes_turn_refused``."""
        return self._refused

    def _refusal(self, session: str, exc: InvalidTurnError, span: Span | None) -> None:
        """Count and log a refused turn (the caller raises): Hermes logs what ``sync_turn``
        raises and goes on, so the provider says it too, at error level."""
        with self._refused_lock:
            self._refused += 1
            refused = self._refused
        log.error("hermes_turn_refused", session_id=session, error=str(exc),
                  messages=len(span.rows) if span is not None else None,
                  span=(span.start, span.end) if span is not None else None,
                  refused_turns=refused)

    def _store_turn(self, runtime: Runtime, session: str, user_content: str,
                    assistant_content: str, span: Span | None) -> None:
        """Hand a turn (the span's messages, or without one the two texts) to the store."""
        rows = span.rows if span is not None else None
        metadata = self._turn_metadata(session)
        tokens_in, tokens_out, estimated = token_counts(rows, user_content, assistant_content)
        metadata["input_tokens"], metadata["output_tokens"] = tokens_in, tokens_out
        if estimated:
            metadata["tokens_estimated"] = True
        try:
            runtime.sync_turn(user_content, assistant_content, session_id=session,
                              user_id=self._user_id, messages=rows, metadata=metadata)
        except InvalidTurnError as exc:
            self._refusal(session, exc, span)
            raise
        if estimated and session not in self._estimated:
            self._estimated[session] = None
            while len(self._estimated) > MAX_LINEAGE:
                self._estimated.pop(next(iter(self._estimated)))
            self._describe(session, "sync_turn", tokens_estimated=True)

    # -- tools -------------------------------------------------------------------------

    def get_tool_schemas(self) -> list[dict[str, Any]]:
        runtime = self._runtime
        logged = runtime is None or runtime.settings is None or runtime.settings.tool_log
        return [SEARCH_SCHEMA, MEMORY_SCHEMA, *([PROCEDURAL_SCHEMA] if logged else [])]

    def handle_tool_call(self, tool_name: str, args: dict[str, Any], **kwargs: Any) -> str:
        """Run a tool; the result (or the error) is a JSON string. Never raises."""
        run = _PIPELINE_TOOLS.get(tool_name)
        if run is not None:
            user = self._user_id
            try:
                return self._require_runtime().call(lambda p: run(p, user, args),
                                                    TOOL_TIMEOUT_S)
            except (HermesMemoryError, TimeoutError) as exc:
                return _json_error(f"{tool_name} failed: {type(exc).__name__}: {exc}")
        if tool_name != SEARCH_TOOL:
            return _json_error(f"{PROVIDER_NAME} has no tool named {tool_name!r}")
        try:
            query, scope, limit = search_arguments(args)
        except ValueError as exc:
            return _json_error(str(exc))
        try:
            block = self.search(query, scope=scope, limit=limit, timeout_s=TOOL_TIMEOUT_S)
        except (HermesMemoryError, TimeoutError) as exc:
            return _json_error(f"{SEARCH_TOOL} failed: {exc}")
        return json.dumps({"query": query, "scope": scope, "found": bool(block),
                           "results": block}, ensure_ascii=False)

    def search(self, query: str, *, scope: str = "user", limit: int | None = None,
               timeout_s: float = TOOL_TIMEOUT_S) -> str:
        """A recall now, over the user's sessions (``scope="user"``) or this session's.

        Raises:
            PipelineClosedError: the provider is not initialized (or was shut down).
            TimeoutError: no answer within ``timeout_s``.
        """
        runtime = self._require_runtime()
        user = self._user_id if scope == "user" else None
        session = self._session_id or None
        if user is None and session is None:
            return ""
        return runtime.call(
            lambda p: p.search(query, user_id=user, session_id=session, limit=limit), timeout_s,
        )

    # -- hooks -------------------------------------------------------------------------

    def on_turn_start(self, turn_number: int, message: str, **kwargs: Any) -> None:
        """Keep the turn number, the model and the tokens left for the turns' metadata; a
        new model is also recorded on the session."""
        self._turn_number = turn_number if isinstance(turn_number, int) else 0
        remaining = kwargs.get("remaining_tokens")
        self._remaining_tokens = (remaining if isinstance(remaining, int)
                                  and not isinstance(remaining, bool) and remaining >= 0
                                  else None)
        model = kwargs.get("model")
        if isinstance(model, str) and model and model != self._model:
            self._model = model
            self._describe(self._session_id, "on_turn_start", model=model)

    def on_session_end(self, messages: list[dict[str, Any]]) -> None:
        """End the session on record (reason ``session_end``) and commit everything accepted
        so far (bounded; the rest stays durable)."""
        self._end(self._session_id, "session_end")
        self._flush_quietly("session_end")

    def on_session_switch(self, new_session_id: str, *, parent_session_id: str = "",
                          reset: bool = False, rewound: bool = False, **kwargs: Any) -> None:
        """Rebind to ``new_session_id``. A reset (``/new``) first commits the old session's
        turns; a compression or a branch records the old session as the new one's parent.
        A rewind (``/undo``) keeps what is stored (stored turns are history); the session's
        next turn is found from its own start in the shortened list."""
        reason = kwargs.get("reason")
        old = self._session_id
        if rewound and new_session_id:
            self._cursors.forget(new_session_id)
        if old and new_session_id and old != new_session_id and (reset or reason):
            # The old session ends here: a reset (/new) or a compression split.
            self._end(old, "new_session" if reset else str(reason)[:64])
        if reset:
            self._flush_quietly("session_reset")
        lineage = reason in ("compression", "branch") or (reason is None and not reset)
        if lineage and parent_session_id and parent_session_id != new_session_id:
            self._remember_parent(new_session_id, parent_session_id)
            self._describe(new_session_id, "on_session_switch",
                           parent_session_id=parent_session_id)
        if new_session_id:
            self._session_id = new_session_id
            self._warm(new_session_id)
            if self._writes and new_session_id != old and self._runtime is not None:
                self._warm_starts.begin(self._runtime, new_session_id, self._user_id)

    def on_pre_compress(self, messages: list[dict[str, Any]]) -> str:
        """What to keep through a context compression: the memory recalled for the user
        messages being compressed (their turns stay stored and searchable). Time-boxed;
        "" when nothing is found or the pipeline is not there."""
        texts = [m.get("content") for m in messages or []
                 if isinstance(m, Mapping) and m.get("role") == "user"]
        query = " ".join(t for t in texts[-PRE_COMPRESS_USER_MESSAGES:] if isinstance(t, str))
        query = query[-PRE_COMPRESS_QUERY_CHARS:]
        if not query.strip() or self._runtime is None:
            return ""
        try:
            block = self.search(query, timeout_s=PRE_COMPRESS_TIMEOUT_S)
        except (HermesMemoryError, TimeoutError) as exc:
            # A timeout is expected under load; anything else is a fault worth its traceback.
            log.warning("hermes_pre_compress_recall_failed", error=describe(exc),
                        exc_info=None if isinstance(exc, TimeoutError) else exc)
            return ""
        if not block:
            return ""
        return ("Long-term memory about the turns being compressed (they stay stored and "
                f"searchable with {SEARCH_TOOL}):\n{block}")

    def on_delegation(self, task: str, result: str, *, child_session_id: str = "",
                      **kwargs: Any) -> None:
        """Store a subagent's task and result as a turn of this session.

        Raises:
            PipelineClosedError: the provider is not initialized (or was shut down).
        """
        if not self._writes or not self._session_id:
            return
        extra = {"kind": "delegation", "child_session_id": child_session_id or None}
        self._store_note(self._session_id, f"[delegated to a subagent] {task}", result, extra)
        session, user = self._session_id, self._user_id
        if user:
            self._memory_call("delegation", lambda p: record_delegation(
                p.memory, user, _text(task), _text(result), session_id=session,
                child_session_id=child_session_id or None))

    def on_memory_write(self, action: str, target: str, content: str,
                        metadata: dict[str, Any] | None = None) -> None:
        """Keep a write of Hermes's built-in memory tool as the user's key-value memory
        (see ``memory.mirror``: add, replace, remove), and as a turn marked in its metadata
        (``kind: memory_write``), so recall and search find it.

        Raises:
            PipelineClosedError: the provider is not initialized (or was shut down).
        """
        if not self._writes or action not in MEMORY_ACTIONS:
            return
        provenance = dict(metadata or {})
        session = _text(provenance.get("session_id")) or self._session_id
        if not session:
            return
        text = f"(removed) {content}" if action == "remove" else content
        extra = {"kind": "memory_write", "action": action, "target": target,
                 "provenance": {k: v for k, v in provenance.items() if _is_plain(v)} or None}
        self._store_note(session, f"[memory {action}: {target}]", text, extra)
        user = self._user_id
        if user:
            old = _text(provenance.get("old_text")) or None
            self._memory_call(f"memory {action}", lambda p: mirror_builtin_write(
                p.memory, user, action, _text(target), _text(content), old_text=old,
                provenance={k: v for k, v in provenance.items()
                            if _is_plain(v) and k != "old_text"}))

    def _describe(self, session_id: str, what: str, **fields: Any) -> None:
        """Record what is known of a session on its row (``SessionWrites.describe_nowait``)."""
        given = {k: v for k, v in fields.items() if v is not None}
        if not self._writes or not session_id or not given:
            return
        # A row this creates gets the platform for source, as the session's turns would.
        given.setdefault("source", self._base_metadata.get("source"))
        if given["source"] is None:
            del given["source"]
        user = self._user_id
        self._session_write(what, lambda p: p.sessions.describe_nowait(
            session_id, user_id=user, **given))

    def _end(self, session_id: str, reason: str) -> None:
        if not self._writes or not session_id:
            return
        user = self._user_id
        self._session_write("end", lambda p: p.sessions.end_nowait(session_id, reason,
                                                                   user_id=user))
        runtime = self._runtime
        if runtime is not None:  # the outcome of a warm or cold start
            self._warm_starts.end(runtime, session_id, reason)

    def _session_write(self, what: str, write: Callable[[MemoryPipeline], object]) -> None:
        """A lifecycle write for a hook, on the caller's thread as ``sync_turn`` is (durable
        when this returns, no wait on the loop); a failure is logged: Hermes ignores what a
        hook raises, and the session's turns are stored regardless."""
        runtime = self._runtime
        pipeline = runtime.pipeline if runtime is not None and runtime.is_open else None
        if pipeline is None:
            return
        try:
            write(pipeline)
        except HermesMemoryError as exc:
            log.warning("hermes_session_hook_failed", hook=what, error=describe(exc))

    def _memory_call(self, what: str,
                     make: Callable[[MemoryPipeline], Coroutine[Any, Any, object]]) -> None:
        """A key-value write for a hook: durable when this returns; a failure is logged
        (Hermes ignores what a hook raises) and the turn note above still holds it."""
        try:
            self._require_runtime().call(make, TOOL_TIMEOUT_S)
        except (HermesMemoryError, TimeoutError) as exc:
            log.warning("hermes_memory_hook_failed", hook=what, error=describe(exc))

    # -- configuration -----------------------------------------------------------------

    def get_config_schema(self) -> list[dict[str, Any]]:
        return _config.config_schema()

    def save_config(self, values: dict[str, Any], hermes_home: str) -> None:
        """Merge ``values`` into ``$HERMES_HOME/hermes_async_memory.json``.

        Raises:
            ConfigurationError: a key is unknown or a value is invalid; nothing was written.
            OSError: the file cannot be written.
        """
        _config.save(values, Path(hermes_home))

    def backup_paths(self) -> list[str]:
        """The store file, its WAL and its outbox folders, when they live outside HERMES_HOME
        (``hermes backup`` already archives everything inside it). Config and environment
        only: no initialize, no I/O beyond a directory listing."""
        hermes_home = _config.default_hermes_home()
        if self._settings is not None:
            db = self._settings.db_path
        else:
            try:
                db = _config.load(hermes_home).settings.db_path
            except HermesMemoryError as exc:
                log.warning("hermes_backup_paths_unresolved", error=str(exc))
                return []
        db = db.expanduser().absolute()
        if _is_within(db, hermes_home.expanduser().absolute()):
            return []
        paths = [db, db.with_name(db.name + "-wal")]
        if db.parent.is_dir():
            paths += sorted(p for p in db.parent.glob(db.name + ".outbox*") if p.is_dir())
        return [str(p) for p in paths]

    # -- extras (not in the contract) --------------------------------------------------

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every turn accepted so far is committed and recallable.

        Raises:
            FlushTimeoutError: the deadline passed first; the turns stay durable.
            PipelineClosedError: the provider is not initialized (or was shut down).
        """
        runtime = self._require_runtime()
        runtime.flush(runtime.settings.shutdown_deadline_s if timeout_s is None else timeout_s)

    def get_messages(self, session_id: str, timeout_s: float = TOOL_TIMEOUT_S) -> list[
            dict[str, Any]]:
        """The session's stored messages, in order.

        Raises:
            PipelineClosedError: the provider is not initialized (or was shut down).
            TimeoutError: no answer within ``timeout_s``.
        """
        return self._require_runtime().call(lambda p: p.get_messages(session_id), timeout_s)

    # -- internals ---------------------------------------------------------------------

    def _warm(self, session_id: str) -> None:
        """A resumed session's stored recent turns into the cache, in the background, so
        its first prefetch already has them."""
        runtime = self._runtime
        pipeline = runtime.pipeline if runtime is not None else None
        if pipeline is None or not session_id:
            return
        try:
            pipeline.warm(session_id, user_id=self._user_id)
        except HermesMemoryError as exc:  # a cold cache is not worth failing a turn for
            log.debug("hermes_warm_skipped", session_id=session_id, error=str(exc))

    def _require_runtime(self) -> Runtime:
        runtime = self._runtime
        if runtime is None:
            raise PipelineClosedError(f"the {PROVIDER_NAME} memory provider is not initialized")
        return runtime

    def _turn_metadata(self, session_id: str) -> dict[str, Any]:
        md = dict(self._base_metadata)
        parent = self._parents.get(session_id)
        if parent:
            md["parent_session_id"] = parent
        if self._model:
            md["model"] = self._model
        if self._turn_number:
            md["turn_number"] = self._turn_number
        if self._remaining_tokens is not None:
            md["remaining_tokens"] = self._remaining_tokens
        return md

    def _remember_parent(self, session_id: str, parent: str) -> None:
        parents = self._parents
        parents.pop(session_id, None)
        parents[session_id] = parent
        while len(parents) > MAX_LINEAGE:
            parents.pop(next(iter(parents)))

    def _store_note(self, session_id: str, header: str, text: str,
                    extra: Mapping[str, Any]) -> None:
        metadata = {**self._turn_metadata(session_id),
                    **{k: v for k, v in extra.items() if v is not None}}
        self._require_runtime().sync_turn(
            header, text, session_id=session_id, user_id=self._user_id, messages=None,
            metadata=metadata,
        )

    def _flush_quietly(self, why: str) -> None:
        """A bounded flush at a boundary: a timeout is logged, not raised (the turns are
        durable already and the next start commits them)."""
        runtime = self._runtime
        if runtime is None or not runtime.is_open:
            return
        try:
            runtime.flush(runtime.settings.shutdown_deadline_s)
        except (FlushTimeoutError, TimeoutError, PipelineClosedError) as exc:
            log.warning("hermes_flush_incomplete", at=why, error=str(exc))


def _text(value: object) -> str:
    return value.strip() if isinstance(value, str) else ""


def _is_plain(value: object) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _is_within(path: Path, root: Path) -> bool:
    try:
        path.relative_to(root)
    except ValueError:
        return False
    return True


def _json_error(message: str) -> str:
    return json.dumps({"error": message}, ensure_ascii=False)
