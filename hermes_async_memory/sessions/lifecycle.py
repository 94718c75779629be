"""The session store's writes: describe, end, delete and prune, each a record in the
session's lane of the outbox (``ops.OP_SESSION``), durable when its call returns and
committed after every turn of the session accepted before it.

So a delete never races a pending turn: the turn commits first and goes with the session. A
turn accepted after the delete starts the session anew, as a new turn would. Prune picks
the ended sessions idle past its cut-off from the store, then appends a conditional delete
for each, which checks again when it commits: a session that a turn made recent meanwhile,
or that another process has a turn of waiting in the shared inbox, stays.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import InvalidTurnError
from ..message_rows import MAX_TOKENS, check_id, check_metadata, check_nesting, message_row
from ..ops import (
    LOCK_MODES,
    MAX_META_KEY_CHARS,
    MESSAGE_FIELD_COLUMNS,
    MESSAGE_FIELD_KEY,
    UPDATE_FIELDS,
    encode_session_change,
    encode_session_op,
    lane_of_meta,
)
from ..store.session_filters import SessionFilter
from ..turns import Receipt, encode_rows

if TYPE_CHECKING:
    from ..pipeline import MemoryPipeline

MAX_REASON_CHARS = 200
MAX_TOTAL = 2**53  # a session total or counter set outright (absolute usage, a field)
MAX_NAME_CHARS = 512
DAY_S = 86_400.0
PRUNE_TIMEOUT_S = 60.0  # prune waits this long for its deletes to commit
LOCK_TIMEOUT_S = 30.0  # a compression lock's call waits this long for its record to commit
MAX_META_VALUE_CHARS = 1 << 20


class InvalidSessionError(InvalidTurnError):
    """A session write was refused before it was accepted: the message says which argument
    and what was expected. Nothing was stored."""


@dataclass(frozen=True, slots=True)
class PruneResult:
    """What a prune did: the sessions it asked to delete, and those that went (a session
    with a turn committed meanwhile is kept)."""

    cutoff: float | None
    candidates: tuple[str, ...]
    deleted: tuple[str, ...]

    def as_dict(self) -> dict[str, Any]:
        return {"cutoff": self.cutoff, "candidates": list(self.candidates),
                "deleted": list(self.deleted)}


class SessionWrites:
    """Lifecycle writes of one pipeline's sessions. Each ``*_nowait`` is safe from any
    thread and never waits on I/O; durable when it returns its receipt."""

    def __init__(self, pipeline: MemoryPipeline) -> None:
        self._p = pipeline

    def describe_nowait(
        self, session_id: str, *, user_id: str | None = None, source: str | None = None,
        model: str | None = None, model_config: Mapping[str, Any] | None = None,
        system_prompt: str | None = None, parent_session_id: str | None = None,
        tokens_estimated: bool | None = None,
    ) -> Receipt:
        """Record what the host knows of a session: its source, model, model config, a
        snapshot of its system prompt and its parent; ``tokens_estimated=True`` marks its
        token counts as (partly) estimated from text. Fields left None keep what the store
        has; the session's row is created if it has none.

        Raises:
            InvalidSessionError: an argument cannot be stored (says which, and why).
            QueueFullError, DiskFullError, PipelineClosedError: as ``sync_turn``.
        """
        sid = _session(session_id)
        fields: dict[str, Any] = {}
        for name, value in (("source", source), ("model", model)):
            if value is not None:
                fields[name] = _name(name, value)
        if parent_session_id is not None:
            parent = _id("parent_session_id", parent_session_id)
            if parent == sid:
                raise InvalidSessionError("parent_session_id must differ from session_id")
            fields["parent_session_id"] = parent
        if model_config is not None:
            fields["model_config"] = _config(model_config)
        if system_prompt is not None:
            if not isinstance(system_prompt, str):
                raise InvalidSessionError(
                    f"system_prompt must be a string, got {type(system_prompt).__name__}")
            fields["system_prompt"] = _text("system_prompt", system_prompt)
        if tokens_estimated is not None:
            if not isinstance(tokens_estimated, bool):
                raise InvalidSessionError("tokens_estimated must be a bool")
            fields["tokens_estimated"] = tokens_estimated
        if not fields:
            raise InvalidSessionError("describe needs at least one field to set")
        return self._accept(sid, _user(user_id), "describe", fields=fields)

    def end_nowait(self, session_id: str, reason: str, *, user_id: str | None = None,
                   first_wins: bool = False) -> Receipt:
        """Mark the session ended now, with why (``"user_exit"``, ``"compression"``, ...).
        Ending it again replaces the time and reason; with ``first_wins`` (Hermes's rule),
        only a stored session not ended yet is ended, and a later end changes nothing
        (``reopen_nowait`` first to end it again).

        Raises:
            InvalidSessionError, QueueFullError, DiskFullError, PipelineClosedError.
        """
        sid = _session(session_id)
        if not isinstance(reason, str) or not reason.strip():
            raise InvalidSessionError("reason must be a non-empty string")
        if len(reason) > MAX_REASON_CHARS:
            raise InvalidSessionError(f"reason is longer than {MAX_REASON_CHARS} characters")
        return self._accept(sid, _user(user_id), "end", reason=_text("reason", reason),
                            first_wins=bool(first_wins))

    def reopen_nowait(self, session_id: str, *, user_id: str | None = None) -> Receipt:
        """Clear the session's end, so it may be resumed (and ended again).

        Raises:
            InvalidSessionError, QueueFullError, DiskFullError, PipelineClosedError.
        """
        return self._change(_session(session_id), _user(user_id), "reopen")

    def update_nowait(self, session_id: str, *, user_id: str | None = None,
                      fields: Mapping[str, Any] | None = None,
                      fill: Mapping[str, Any] | None = None, create: bool = False) -> Receipt:
        """Set ``fields`` on the session's row (a value of None clears it) and ``fill`` the
        ones it has none of; any of our columns and Hermes Agent 0.19's (``ops.UPDATE_FIELDS``:
        title, cwd, git_branch, git_repo_root, chat_id, billing_*, costs, counters, ...).
        ``user_id`` fills the row's user when it has none (a session's user is the scope its
        messages were stored under: never replaced).
        With ``create``, a session with no row gets one (started now, with ``fields`` and
        ``fill``, ``source`` among them or the pipeline's); without, an unknown session is
        left alone.

        Raises:
            InvalidSessionError: an unknown field, a mistyped value, text holding NUL or a
                lone surrogate, a parent equal to the session; nothing was stored.
            QueueFullError, DiskFullError, PipelineClosedError.
        """
        sid = _session(session_id)
        sets = _fields("fields", fields or {}, sid)
        fills = _fields("fill", fill or {}, sid)
        if not sets and not fills and not create and user_id is None:
            raise InvalidSessionError("update needs a field to set or fill")
        return self._change(sid, _user(user_id), "update", fields=sets, fill=fills,
                            create=bool(create))

    def record_usage_nowait(
        self, session_id: str, *, user_id: str | None = None, input_tokens: int = 0,
        output_tokens: int = 0, cache_read_tokens: int = 0, cache_write_tokens: int = 0,
        reasoning_tokens: int = 0, api_call_count: int = 0,
        estimated_cost_usd: float | None = None, actual_cost_usd: float | None = None,
        model: str | None = None, billing_provider: str | None = None,
        billing_base_url: str | None = None, billing_mode: str | None = None,
        cost_status: str | None = None, cost_source: str | None = None,
        pricing_version: str | None = None, absolute: bool = False, task: str = "",
    ) -> Receipt:
        """Account a model call's usage to the session (Hermes Agent's
        ``update_token_counts``): counts and costs are added, or with ``absolute`` set as the
        session's totals; the model and billing route fill what the row lacks, and the first
        call that accounts usage on a route other than the requested one replaces it; each
        call's share is kept per model and route (``session_model_usage``; not for
        ``absolute`` totals, which cannot be split). ``task`` names an auxiliary call
        (vision, compression, ...): only its own per-model row. A session with no row gets
        one (source ``unknown``).

        Raises:
            InvalidSessionError: a count that is not an integer >= 0, a cost that is not a
                finite number, text holding NUL or a lone surrogate; nothing was stored.
            QueueFullError, DiskFullError, PipelineClosedError.
        """
        sid = _session(session_id)
        usage: dict[str, Any] = {"absolute": bool(absolute)}
        for name, count in (("input_tokens", input_tokens), ("output_tokens", output_tokens),
                            ("cache_read_tokens", cache_read_tokens),
                            ("cache_write_tokens", cache_write_tokens),
                            ("reasoning_tokens", reasoning_tokens),
                            ("api_call_count", api_call_count)):
            if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= (
                    MAX_TOTAL if absolute else MAX_TOKENS):
                raise InvalidSessionError(f"{name} must be an integer >= 0, got {count!r:.20}")
            if count:
                usage[name] = count
        for name, cost in (("estimated_cost_usd", estimated_cost_usd),
                           ("actual_cost_usd", actual_cost_usd)):
            if cost is not None:
                if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not (
                        math.isfinite(cost)):
                    raise InvalidSessionError(f"{name} must be a finite number")
                usage[name] = float(cost)
        for name, text in (("model", model), ("billing_provider", billing_provider),
                           ("billing_base_url", billing_base_url),
                           ("billing_mode", billing_mode), ("cost_status", cost_status),
                           ("cost_source", cost_source), ("pricing_version", pricing_version),
                           ("task", task)):
            if text is not None:
                if not isinstance(text, str):
                    raise InvalidSessionError(f"{name} must be a string")
                usage[name] = _text(name, text)
        return self._change(sid, _user(user_id), "usage", usage=usage)

    def replace_messages_nowait(self, session_id: str, messages: Sequence[Mapping[str, Any]],
                                *, user_id: str | None = None, active_only: bool = False,
                                compact: bool = False) -> Receipt:
        """Replace the session's stored messages with ``messages`` (each stored as given, as
        ``sync_turn`` stores them), in one commit; with ``active_only``, only those the host
        has not set aside (``active``) give way. With ``compact`` (Hermes Agent's
        ``archive_and_compact``), its active messages are not deleted but set aside as
        compacted (``active`` 0, ``compacted`` 1: found by Hermes's search, not loaded as
        the live conversation). The receipt's ``first_id`` is the first new
        message's id. Its count columns then count its active messages.

        Raises:
            InvalidTurnError: a message cannot be stored as given (says which, and why).
            InvalidSessionError, QueueFullError, DiskFullError, PipelineClosedError.
        """
        sid = _session(session_id)
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
            raise InvalidSessionError("messages must be a list of message dicts")
        rows = [message_row(i, m) for i, m in enumerate(messages)]
        return self._change(sid, _user(user_id), "replace", messages=rows,
                            active_only=bool(active_only), compact=bool(compact))

    def append_nowait(self, session_id: str, messages: Sequence[Mapping[str, Any]], *,
                      user_id: str | None = None, metadata: Mapping[str, Any] | None = None
                      ) -> Receipt:
        """Append ``messages`` to the session, each stored as given (any role: system, user,
        assistant, tool; an explicit ``timestamp`` kept), after everything accepted for it
        before: ``sync_turn`` without the turn's texts. The receipt's ``first_id`` is the
        first message's id; the others follow.

        Raises:
            InvalidTurnError: a message cannot be stored as given (says which, and why), or
                there is none.
            QueueFullError, DiskFullError, PipelineClosedError.
        """
        sid = _session(session_id)
        user = _user(user_id)
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
            raise InvalidSessionError("messages must be a list of message dicts")
        md = check_metadata(metadata)
        notes: list[int] = []
        rows = [message_row(i, m, notes) for i, m in enumerate(messages)]
        key, at = self._p.new_key(), time.time()
        data, n = encode_rows(key, sid, user, at, rows, md, self._p.settings.max_turn_bytes)
        receipt = self._p.accept_record(key, sid, at, data, n)
        self._p.sanitized += bool(notes)
        return receipt

    def set_message_fields_nowait(self, session_id: str, message_id: int,
                                  values: Mapping[str, Any], *,
                                  only_if_latest: str | None = None) -> Receipt:
        """Set keys of one stored message's fields (a value of None removes the key): what
        Hermes Agent keeps per message beside its text (``api_content``, ``finish_reason``,
        ...). Not its role, content, tool calls, call id, tool name, time or token count,
        which columns and the indexes hold. At commit the message must be the session's
        (and, with ``only_if_latest``, still its newest active message of that role), else
        nothing changes.

        Raises:
            InvalidSessionError: a key that cannot be set, a value JSON cannot hold as given,
                text holding a lone surrogate; nothing was stored.
            QueueFullError, DiskFullError, PipelineClosedError.
        """
        sid = _session(session_id)
        if isinstance(message_id, bool) or not isinstance(message_id, int) or not (
                0 < message_id < 2**63):
            raise InvalidSessionError("message_id must be a positive integer")
        if not isinstance(values, Mapping) or not values:
            raise InvalidSessionError("values must be a non-empty mapping")
        for key in values:
            if (not isinstance(key, str) or MESSAGE_FIELD_KEY.fullmatch(key) is None
                    or key in MESSAGE_FIELD_COLUMNS):
                raise InvalidSessionError(f"a message's field {key!r:.40} cannot be set")
        if only_if_latest is not None:
            _name("only_if_latest", only_if_latest)
        try:
            check_nesting("values", values)
            text = json.dumps(dict(values), ensure_ascii=False, allow_nan=False)
            text.encode("utf-8")
        except (InvalidTurnError, TypeError, ValueError, RecursionError) as exc:
            raise InvalidSessionError(f"values are not storable JSON: {exc}") from None
        return self._change(sid, None, "fields", args={
            "i": message_id, "f": json.loads(text), "r": only_if_latest})

    def set_active_nowait(self, session_id: str, from_message_id: int, active: bool, *,
                          rewind: bool = False) -> Receipt:
        """Set the session's messages from ``from_message_id`` on aside (``active`` False:
        Hermes Agent's rewind; the live conversation and ``get_messages`` leave them out)
        or take them back (True: its restore). Their text stays stored and indexed.
        ``rewind`` also counts one rewind on the session (``rewind_count``).

        Raises:
            InvalidSessionError, QueueFullError, DiskFullError, PipelineClosedError.
        """
        sid = _session(session_id)
        if isinstance(from_message_id, bool) or not isinstance(from_message_id, int) or not (
                0 <= from_message_id < 2**63):
            raise InvalidSessionError("from_message_id must be an integer >= 0")
        return self._change(sid, None, "active", args={
            "from": from_message_id, "on": 1 if active else 0, "rw": bool(rewind)})

    def delete_nowait(self, session_id: str, *, user_id: str | None = None) -> Receipt:
        """Delete the session with its messages, their index rows, its logged tool calls,
        its recall requests and cached blocks, its warm-start row (the template's usage and
        outcome counts keep it: they hold no content), and the turns still waiting for a
        replica backend. A turn of the
        session accepted before this goes too; one accepted after starts it anew.
        ``user_id``, when known, also drops the recall blocks of that user's other
        sessions (they may quote this one).

        Raises:
            InvalidSessionError, QueueFullError, DiskFullError, PipelineClosedError.
        """
        return self._accept(_session(session_id), _user(user_id), "delete")

    async def describe(self, session_id: str, **fields: Any) -> Receipt:
        """``describe_nowait``, as a coroutine."""
        return self.describe_nowait(session_id, **fields)

    async def end(self, session_id: str, reason: str, *, user_id: str | None = None
                  ) -> Receipt:
        """``end_nowait``, as a coroutine."""
        return self.end_nowait(session_id, reason, user_id=user_id)

    async def delete(self, session_id: str, *, user_id: str | None = None) -> Receipt:
        """``delete_nowait``, as a coroutine."""
        return self.delete_nowait(session_id, user_id=user_id)

    async def prune(self, older_than_days: float | None, *, source: str | None = None,
                    timeout_s: float = PRUNE_TIMEOUT_S, by: str = "ended",
                    where: SessionFilter | None = None) -> PruneResult:
        """Delete the sessions that ended more than ``older_than_days`` ago and have had
        nothing stored since (of ``source`` only, when given). Never an open session, nor
        one with a turn pending here or in the shared inbox. Waits for the deletes to commit.
        ``by="started"`` is Hermes Agent's rule: the ended sessions that started more than
        ``older_than_days`` ago. A deleted session's children stay, without a parent.

        ``where``: only the ended sessions these filters pick (Hermes Agent's prune filters:
        ``SessionFilter``); ``older_than_days`` None: no age cut-off. Such a prune's deletes
        check again when they commit that the session is still ended and nothing changed it
        since it was picked (a turn, an update, an archive): one that changed stays.

        Raises:
            InvalidSessionError: ``older_than_days`` is not None or a number >= 0.
            FlushTimeoutError: the deletes did not commit within ``timeout_s`` (they stay
                durable, and commit later).
            QueueFullError, DiskFullError, PipelineClosedError, PipelineFailedError.
        """
        if older_than_days is not None and (
                isinstance(older_than_days, bool)
                or not isinstance(older_than_days, (int, float)) or not older_than_days >= 0):
            raise InvalidSessionError(
                f"older_than_days must be a number >= 0, got {older_than_days!r:.20}")
        if source is not None:
            source = _name("source", source)
        if by not in ("ended", "started"):
            raise InvalidSessionError(f"by must be 'ended' or 'started', got {by!r:.20}")
        if where is not None and not isinstance(where, SessionFilter):
            raise InvalidSessionError("where must be a SessionFilter")
        picked_at = time.time()
        cutoff = None if older_than_days is None else picked_at - float(older_than_days) * DAY_S
        started = by == "started"
        candidates = await self._p.store.prunable_sessions(cutoff, source, started=started,
                                                           where=where)
        cut: dict[str, float]
        if where is not None or cutoff is None:
            cut = {"unchanged_before": picked_at}
        else:
            cut = {"started_before": cutoff} if started else {"ended_before": cutoff}
        receipts = [self._accept(sid, user, "delete", source=source, **cut)
                    for sid, user in candidates]
        await self._p.committed(receipts, timeout_s)
        ids = tuple(sid for sid, _ in candidates)
        remaining = await self._p.store.existing_sessions(ids)
        return PruneResult(cutoff, ids, tuple(s for s in ids if s not in remaining))

    def set_meta_nowait(self, key: str, value: str | None) -> Receipt:
        """Set a key of Hermes Agent's key-value state (``state_meta``; None removes it),
        in the one lane its writes share: they commit in the order they were accepted.

        Raises:
            InvalidSessionError: an empty or overlong key, a value that is not a string, text
                holding NUL or a lone surrogate; nothing was stored.
            QueueFullError, DiskFullError, PipelineClosedError.
        """
        if not isinstance(key, str) or not key or len(key) > MAX_META_KEY_CHARS:
            raise InvalidSessionError(
                f"key must be a non-empty string of at most {MAX_META_KEY_CHARS} characters")
        _text("key", key)
        if value is not None:
            if not isinstance(value, str):
                raise InvalidSessionError(f"value must be a string, got {type(value).__name__}")
            if len(value) > MAX_META_VALUE_CHARS:
                raise InvalidSessionError(
                    f"value is longer than {MAX_META_VALUE_CHARS} characters")
            _text("value", value)
        return self._accept(lane_of_meta(), None, "meta", args={"k": key, "v": value})

    def compression_lock_nowait(self, session_id: str, holder: str, mode: str = "acquire", *,
                                ttl_s: float = 300.0, now: float | None = None) -> Receipt:
        """Acquire, refresh or release (``mode``) the session's compression lock for
        ``holder`` (Hermes Agent's per-session lease): at commit, an acquire drops a lease
        ended before ``now`` and takes the lock if no one holds it; a refresh moves the
        holder's lease to ``now + ttl_s`` if it has not ended; a release drops the holder's
        lock. ``now`` is the caller's clock (default ``time.time()``). ``compression_lock``
        waits and says whether it worked.

        Raises:
            InvalidSessionError: an unknown mode, an empty holder, a ttl that is not a finite
                number >= 0; nothing was stored.
            QueueFullError, DiskFullError, PipelineClosedError.
        """
        sid = _session(session_id)
        if mode not in LOCK_MODES:
            raise InvalidSessionError(f"mode must be one of {sorted(LOCK_MODES)}")
        if not isinstance(holder, str) or not holder:
            raise InvalidSessionError("holder must be a non-empty string")
        _text("holder", holder)
        if (isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float))
                or not math.isfinite(ttl_s) or ttl_s < 0):
            raise InvalidSessionError("ttl_s must be a finite number >= 0")
        at = time.time() if now is None else now
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
            raise InvalidSessionError("now must be a finite number")
        return self._accept(sid, None, "lock", args={
            "m": mode, "h": holder, "n": float(at), "e": float(at) + float(ttl_s)})

    async def compression_lock(self, session_id: str, holder: str, mode: str = "acquire", *,
                               ttl_s: float = 300.0, now: float | None = None,
                               timeout_s: float = LOCK_TIMEOUT_S) -> bool:
        """``compression_lock_nowait``, then once it committed: whether ``holder`` holds the
        lock (acquire: newly, or still), holds it with the lease this call asked for
        (refresh), or no longer holds it (release).

        Raises:
            InvalidSessionError, QueueFullError, DiskFullError, PipelineClosedError.
            FlushTimeoutError: the record did not commit within ``timeout_s``.
        """
        at = time.time() if now is None else now
        receipt = self.compression_lock_nowait(session_id, holder, mode, ttl_s=ttl_s, now=at)
        await self._p.committed([receipt], timeout_s)
        held = await self._p.store.compression_lock(session_id)
        if mode == "release":
            return held is None or held[0] != holder
        if mode == "refresh":
            return held is not None and held == (holder, float(at) + float(ttl_s))
        return held is not None and held[0] == holder

    def _change(self, session_id: str, user_id: str | None, action: str, *,
                messages: Sequence[Sequence[Any]] | None = None, **kw: Any) -> Receipt:
        key, at = self._p.new_key(), time.time()
        data = encode_session_change(key, session_id, user_id, at, action,
                                     messages=messages, **kw).encode("ascii")
        limit = self._p.settings.max_turn_bytes
        if len(data) > limit:
            raise InvalidSessionError(f"the change is {len(data)} bytes encoded; the limit "
                                      f"(max_turn_bytes) is {limit}")
        return self._p.accept_record(key, session_id, at, data, len(messages or ()))

    def _accept(self, session_id: str, user_id: str | None, action: str, **kw: Any
                ) -> Receipt:
        key, at = self._p.new_key(), time.time()
        data = encode_session_op(key, session_id, user_id, at, action, **kw).encode("ascii")
        limit = self._p.settings.max_turn_bytes
        if len(data) > limit:
            raise InvalidSessionError(f"the event is {len(data)} bytes encoded; the limit "
                                      f"(max_turn_bytes) is {limit}")
        return self._p.accept_record(key, session_id, at, data)


def _session(value: object) -> str:
    sid = _id("session_id", value)
    assert sid is not None
    return sid


def _user(value: object) -> str | None:
    return None if value is None else _id("user_id", value)


def _id(name: str, value: object) -> str:
    try:
        checked = check_id(name, value)
    except InvalidTurnError as exc:
        raise InvalidSessionError(str(exc)) from None
    assert checked is not None
    return checked


def _name(name: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidSessionError(f"{name} must be a non-empty string")
    if len(value) > MAX_NAME_CHARS:
        raise InvalidSessionError(f"{name} is longer than {MAX_NAME_CHARS} characters")
    return _text(name, value)


def _text(name: str, value: str) -> str:
    if "\x00" in value:
        raise InvalidSessionError(f"{name} holds a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidSessionError(f"{name} holds a lone surrogate") from None
    return value


def _fields(what: str, values: Mapping[str, Any], session_id: str) -> dict[str, Any]:
    """``values`` checked against ``ops.UPDATE_FIELDS`` (text checked as ``_text`` does,
    model_config as ``_config``)."""
    if not isinstance(values, Mapping):
        raise InvalidSessionError(f"{what} must be a mapping of session fields")
    out: dict[str, Any] = {}
    for name, value in values.items():
        want = UPDATE_FIELDS.get(name) if isinstance(name, str) else None
        if want is None:
            raise InvalidSessionError(f"{what}: {name!r:.40} is not a session field")
        if value is None:
            out[name] = None
        elif name == "model_config":
            out[name] = _config(value)
        elif name == "parent_session_id":
            parent = _id(name, value)
            if parent == session_id:
                raise InvalidSessionError("parent_session_id must differ from session_id")
            out[name] = parent
        elif want is str:
            if not isinstance(value, str):
                raise InvalidSessionError(f"{name} must be a string, got {type(value).__name__}")
            out[name] = _text(name, value)
        elif want is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    math.isfinite(value)):
                raise InvalidSessionError(f"{name} must be a finite number")
            out[name] = float(value)
        elif want is bool:
            if not isinstance(value, bool):
                raise InvalidSessionError(f"{name} must be a bool")
            out[name] = value
        else:
            if isinstance(value, bool) or not isinstance(value, int) or abs(value) > MAX_TOTAL:
                raise InvalidSessionError(f"{name} must be an integer, got {value!r:.20}")
            out[name] = value
    return out


def _config(value: object) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidSessionError(f"model_config must be a mapping, got {type(value).__name__}")
    try:
        check_nesting("model_config", value)
        text = json.dumps(dict(value), ensure_ascii=False, allow_nan=False)
    except (InvalidTurnError, TypeError, ValueError, RecursionError) as exc:
        raise InvalidSessionError(f"model_config is not storable JSON: {exc}") from None
    if "\\u0000" in text:
        raise InvalidSessionError("model_config holds a NUL character")
    _text("model_config", text)
    out: dict[str, Any] = json.loads(text)
    return out
