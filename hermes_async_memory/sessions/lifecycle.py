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
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import InvalidTurnError
from ..ops import encode_session_op
from ..turns import Receipt, check_id, check_nesting

if TYPE_CHECKING:
    from ..pipeline import MemoryPipeline

MAX_REASON_CHARS = 200
MAX_NAME_CHARS = 512
DAY_S = 86_400.0
PRUNE_TIMEOUT_S = 60.0  # prune waits this long for its deletes to commit


class InvalidSessionError(InvalidTurnError):
    """A session write was refused before it was accepted: the message says which argument
    and what was expected. Nothing was stored."""


@dataclass(frozen=True, slots=True)
class PruneResult:
    """What a prune did: the sessions it asked to delete, and those that went (a session
    with a turn committed meanwhile is kept)."""

    cutoff: float
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

    def end_nowait(self, session_id: str, reason: str, *, user_id: str | None = None
                   ) -> Receipt:
        """Mark the session ended now, with why (``"user_exit"``, ``"compression"``, ...).
        Ending it again replaces the time and reason.

        Raises:
            InvalidSessionError, QueueFullError, DiskFullError, PipelineClosedError.
        """
        sid = _session(session_id)
        if not isinstance(reason, str) or not reason.strip():
            raise InvalidSessionError("reason must be a non-empty string")
        if len(reason) > MAX_REASON_CHARS:
            raise InvalidSessionError(f"reason is longer than {MAX_REASON_CHARS} characters")
        return self._accept(sid, _user(user_id), "end", reason=_text("reason", reason))

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

    async def prune(self, older_than_days: float, *, source: str | None = None,
                    timeout_s: float = PRUNE_TIMEOUT_S) -> PruneResult:
        """Delete the sessions that ended more than ``older_than_days`` ago and have had
        nothing stored since (of ``source`` only, when given). Never an open session, nor
        one with a turn pending here or in the shared inbox. Waits for the deletes to commit.

        Raises:
            InvalidSessionError: ``older_than_days`` is not a number >= 0.
            FlushTimeoutError: the deletes did not commit within ``timeout_s`` (they stay
                durable, and commit later).
            QueueFullError, DiskFullError, PipelineClosedError, PipelineFailedError.
        """
        if (isinstance(older_than_days, bool) or not isinstance(older_than_days, (int, float))
                or not older_than_days >= 0):
            raise InvalidSessionError(
                f"older_than_days must be a number >= 0, got {older_than_days!r:.20}")
        if source is not None:
            source = _name("source", source)
        cutoff = time.time() - float(older_than_days) * DAY_S
        candidates = await self._p.store.prunable_sessions(cutoff, source)
        receipts = [self._accept(sid, user, "delete", ended_before=cutoff, source=source)
                    for sid, user in candidates]
        await self._p.committed(receipts, timeout_s)
        ids = tuple(sid for sid, _ in candidates)
        remaining = await self._p.store.existing_sessions(ids)
        return PruneResult(cutoff, ids, tuple(s for s in ids if s not in remaining))

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
