"""Warm-start templates kept in the store: ``pipeline.templates`` (``TemplateStore``), and
the same reads on a store file opened read-only (``open_template_reads``, for the CLI).

Every write is a record in the outbox (``ops.OP_TEMPLATE``), in the one lane of templates,
committed by the writer in order as a turn is: durable when accepted, applied once (see
``store.templates`` for what each record does). The awaitable writes return once their
records are committed, so any reader of the store, another process too, sees them; the
``*_nowait`` ones return as soon as the record is durable, from any thread.

A session's life with templates:

    choose(task_type, tags) ──► Template | None ──► warm_messages / warm_text (the core)
    start(session_id, template | None, task_type)     a warm start counts as a use
    end(session_id, reason=..., feedback=...)          judged by the stated rules
        (``templates.outcome``); moves the template's successes or failures, records the
        session's first-turn tool error rate for warm vs cold (``stats``), and, when
        ``auto_create`` is on, may make the session a template itself.

``choose`` stays fast with many templates: the floor of evidence and the ranking run in
SQL on the task type's index, which hands back a few candidates' counts (no documents);
the core ``choose`` decides among them, and only the winner's document is read.
"""

from __future__ import annotations

import builtins
import dataclasses
import json
import sqlite3
import time
import unicodedata
from collections.abc import AsyncIterator, Awaitable, Iterable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..errors import InvalidTurnError, PipelineClosedError, StoreError
from ..message_rows import check_id
from ..ops import encode_template_op, lane_of_templates
from ..turns import Receipt
from .choose import choose
from .classify import classify, classify_tools
from .extract import NAME_CHARS, extract
from .model import (
    InvalidTemplateError,
    Template,
    TemplateExistsError,
    TemplateSettings,
    UnknownTemplateError,
    normalize_tags,
)
from .outcome import (
    NO_SESSIONS,
    SessionOutcome,
    StartStats,
    TaskTypeStats,
    auto_name,
    examples_signature,
    judge_session,
)

if TYPE_CHECKING:
    from ..pipeline import MemoryPipeline
    from ..store import SqliteStore

T = TypeVar("T")
WRITE_TIMEOUT_S = 10.0  # an awaitable write waits this long for its records to commit
CHOOSE_POOL = 16  # candidates the SQL ranking hands the core choose
MAX_REASON_CHARS = 200
_READABLE = ("open", "failed", "closing")  # a failed pipeline's store still reads


class TemplateReads:
    """Reads of the stored templates and of the sessions started from them, over a store:
    a pipeline's (``TemplateStore``) or a file's (``open_template_reads``)."""

    def __init__(self, store: SqliteStore, settings: TemplateSettings) -> None:
        self._file_store: SqliteStore | None = store
        self.settings = settings

    def _store(self) -> SqliteStore:
        if self._file_store is None:
            raise PipelineClosedError("the store file is closed")
        return self._file_store

    async def get(self, name: str) -> Template | None:
        """The template stored under ``name`` (with the store's counts), or None.

        Raises:
            InvalidTemplateError: ``name`` is not a template name. StoreError.
        """
        row = await _read(self._store().template_row(_name(name)))
        return None if row is None else _template(*row)

    async def choose(self, task_type: str, tags: Sequence[str] = ()) -> Template | None:
        """The template a new ``task_type`` session should start from (``templates.choose``:
        best success rate, then least used; none below the floor of evidence), or None.

        Raises:
            InvalidTemplateError: a bad task type or tag. StoreError.
        """
        task_type = _task_type(task_type)
        wanted = normalize_tags(tags)
        s = self.settings
        rows = await _read(self._store().template_candidates(
            task_type, wanted, min_evidence=s.min_evidence,
            min_success_rate=s.min_success_rate, limit=CHOOSE_POOL))
        best = choose((Template(name=r.name, task_type=task_type, source_session_id="",
                                tags=r.tags, usage_count=r.usage_count,
                                successes=r.successes, failures=r.failures) for r in rows),
                      task_type, wanted, s)
        return None if best is None else await self.get(best.name)

    async def stats(self) -> list[TaskTypeStats]:
        """Per task type (by name), warm against cold starts: sessions, outcomes, and the
        tool error rate of their first ``settings.first_turns`` turns (``StartStats``)."""
        sides: dict[str, dict[bool, StartStats]] = {}
        for row in await _read(self._store().template_stats()):
            task_type, warm, sessions, ended, ok, measured, calls, errors, avg = row
            sides.setdefault(task_type, {})[warm] = StartStats(sessions, ended, ok, measured,
                                                               calls, errors, avg)
        return [TaskTypeStats(t, by.get(True, NO_SESSIONS), by.get(False, NO_SESSIONS))
                for t, by in sorted(sides.items())]

    async def export(self) -> str:
        """Every template as one JSON text: a list of template documents, by task type then
        name, with the store's counts; ``TemplateStore.import_`` reads it."""
        docs = [t.to_dict() for t in await self.list()]
        return json.dumps(docs, ensure_ascii=False, indent=1) + "\n"

    async def list(self, task_type: str | None = None) -> builtins.list[Template]:
        """Every template (of ``task_type``), by task type then name.

        Raises:
            InvalidTemplateError: a bad task type. StoreError.
        """
        if task_type is not None:
            task_type = _task_type(task_type)
        return [_template(*r) for r in await _read(self._store().template_rows(task_type))]


class TemplateStore(TemplateReads):
    """A pipeline's templates: the reads, and the writes through its outbox."""

    def __init__(self, pipeline: MemoryPipeline) -> None:
        super().__init__(pipeline.store, pipeline.settings.templates)
        self._p = pipeline

    def _store(self) -> SqliteStore:
        if self._p.state not in _READABLE:
            raise PipelineClosedError(f"the pipeline is {self._p.state}")
        return self._p.store

    # -- writes: durable on return, no I/O -----------------------------------------------

    def save_nowait(self, template: Template) -> Receipt:
        """Store ``template`` under its name. A template already stored under it gets this
        one's content and keeps its own usage and outcome counts and creation time; a new
        one starts with the counts ``template`` has. Durable when this returns; any thread.

        Raises:
            InvalidTemplateError: not a storable template (says why).
            QueueFullError, DiskFullError, PipelineClosedError: as ``sync_turn``.
        """
        return self._accept(self._put(_checked(template), "save"))

    def delete_nowait(self, name: str) -> Receipt:
        """Delete the template stored under ``name`` (nothing happens when there is none).

        Raises:
            InvalidTemplateError, QueueFullError, DiskFullError, PipelineClosedError.
        """
        return self._accept(self._record("delete", name=_name(name)))

    def start_nowait(self, session_id: str, template: Template | str | None,
                     task_type: str | None = None) -> Receipt:
        """Record that a session starts from ``template`` (a template or its name; None: a
        cold start) as a ``task_type`` session (default: the template's task type). A warm
        start counts as a use of the template once it commits. A session starts once: a
        second start of it changes nothing.

        Raises:
            InvalidTemplateError: a bad id, name or task type, or no task type for a cold
                start or a template given by name.
            QueueFullError, DiskFullError, PipelineClosedError.
        """
        sid = _session(session_id)
        name = None
        if isinstance(template, Template):
            name = _name(template.name)
            task_type = template.task_type if task_type is None else task_type
        elif template is not None:
            name = _name(template)
        if task_type is None:
            raise InvalidTemplateError("a cold start, or a start from a template given by "
                                       "name, needs its task_type")
        return self._accept(self._record("use", name=name, session_id=sid,
                                         task_type=_task_type(task_type)))

    # -- writes that wait for their commit -----------------------------------------------

    async def save(self, template: Template, *, timeout_s: float | None = WRITE_TIMEOUT_S
                   ) -> Template:
        """``save_nowait``, once committed: returns the template as stored.

        Raises:
            InvalidTemplateError, FlushTimeoutError (it stays durable and commits later),
            QueueFullError, DiskFullError, PipelineClosedError, PipelineFailedError.
        """
        checked = _checked(template)
        await self._p.committed([self._accept(self._put(checked, "save"))], timeout_s)
        return await self.get(checked.name) or checked

    async def delete(self, name: str, *, timeout_s: float | None = WRITE_TIMEOUT_S) -> None:
        """Delete the template stored under ``name``; returns once committed.

        Raises:
            UnknownTemplateError: no template is stored under ``name``.
            InvalidTemplateError, FlushTimeoutError, PipelineClosedError, ...
        """
        name = _name(name)
        deadline = _deadline(timeout_s)
        await self._p.lane_committed(lane_of_templates(), _left(deadline))
        if await _read(self._store().template_row(name)) is None:
            raise UnknownTemplateError(f"no template {name!r}")
        await self._p.committed([self.delete_nowait(name)], _left(deadline))

    async def start(self, session_id: str, template: Template | str | None,
                    task_type: str | None = None, *, timeout_s: float | None = WRITE_TIMEOUT_S
                    ) -> Receipt:
        """``start_nowait`` for a template that is stored (a name alone is enough: its task
        type is the template's), once committed.

        Raises:
            UnknownTemplateError: no template of that name is stored.
            InvalidTemplateError, FlushTimeoutError, PipelineClosedError, ...
        """
        deadline = _deadline(timeout_s)
        if template is not None:
            name = _name(template.name if isinstance(template, Template) else template)
            await self._p.lane_committed(lane_of_templates(), _left(deadline))
            stored = await self.get(name)
            if stored is None:
                raise UnknownTemplateError(f"no template {name!r}")
            template = stored
        receipt = self.start_nowait(session_id, template, task_type)
        await self._p.committed([receipt], _left(deadline))
        return receipt

    async def end(self, session_id: str, *, reason: str | None = None,
                  feedback: bool | None = None, timeout_s: float | None = WRITE_TIMEOUT_S
                  ) -> SessionOutcome:
        """Record how a session ended: a success or a failure by the stated rules
        (``templates.outcome``: ``feedback``, else ``reason``, else its tool error rate),
        which moves the successes or failures of the template it started from, and the tool
        error rate of its first ``settings.first_turns`` turns. Ending it again replaces
        the outcome. A session never started here counts as a cold start of the task type
        its tool calls make it. With ``settings.auto_create`` on, a success with at least
        ``auto_min_calls`` successful tool calls becomes a template (``created``), unless
        one of its task type has the same examples or the same source session.

        Waits for the session's accepted turns to commit first (their tool calls are read
        from the log), and returns once its records have committed.

        Raises:
            InvalidTemplateError: a bad argument, or a session neither started here nor
                stored.
            FlushTimeoutError, PipelineClosedError, PipelineFailedError, StoreError.
        """
        sid = _session(session_id)
        if reason is not None and (not isinstance(reason, str)
                                   or len(reason) > MAX_REASON_CHARS):
            raise InvalidTemplateError(
                f"reason must be a string of at most {MAX_REASON_CHARS} characters")
        if feedback is not None and not isinstance(feedback, bool):
            raise InvalidTemplateError(f"feedback must be True, False or None, got {feedback!r}")
        s, store, deadline = self.settings, self._store(), _deadline(timeout_s)
        await self._p.lane_committed(sid, _left(deadline))  # its turns, so its tool calls
        await self._p.lane_committed(lane_of_templates(), _left(deadline))  # its start
        started = await _read(store.template_session(sid))
        calls = await _read(store.session_tool_calls(sid, s.first_turns))
        if started is None and await _read(store.get_session(sid)) is None:
            raise InvalidTemplateError(f"no session {sid!r}: it was neither started here nor "
                                       "stored")
        task_type = (started.task_type if started is not None
                     else classify_tools((tool for tool, _, _ in calls), s))
        errors = sum(1 for _, ok, _ in calls if not ok)
        first = [ok for _, ok, in_first in calls if in_first]
        first_errors = sum(1 for ok in first if not ok)
        ok, rule = judge_session(s, feedback=feedback, reason=reason, calls=len(calls),
                                 errors=errors)
        template = None if started is None else started.template
        receipt = self._accept(self._record(
            "outcome", name=template, session_id=sid, task_type=task_type, ok=ok,
            first_calls=len(first), first_errors=first_errors))
        await self._p.committed([receipt], _left(deadline))
        created = None
        if s.auto_create and ok and len(calls) - errors >= s.auto_min_calls:
            created = await self._auto_create(sid, _left(deadline))
        return SessionOutcome(sid, template, task_type, ok, rule, reason, len(calls), errors,
                              len(first), first_errors, created)

    async def extract(self, session_id: str, name: str, *, description: str | None = None,
                      tags: Iterable[str] = (), task_type: str | None = None,
                      overwrite: bool = False, timeout_s: float | None = WRITE_TIMEOUT_S
                      ) -> Template:
        """Make a template of a stored session (its conversation, classified and extracted
        by the core, with the pipeline's tool outcome rules) and save it under ``name``.
        The source session counts as one success when its recorded outcome is one.

        Raises:
            TemplateExistsError: a template is stored under ``name`` and not ``overwrite``.
            InvalidTemplateError: a bad argument, or a session with no stored messages.
            FlushTimeoutError, PipelineClosedError, PipelineFailedError, StoreError.
        """
        sid, name, deadline = _session(session_id), _name(name), _deadline(timeout_s)
        await self._p.lane_committed(sid, _left(deadline))
        messages = await self._p.sessions.conversation(sid)
        if not messages:
            raise InvalidTemplateError(f"session {sid!r} has no stored messages")
        template = extract(messages, name=name, session_id=sid, settings=self.settings,
                           description=description, tags=tags, task_type=task_type,
                           rules=self._p.settings.tool_outcome_rules)
        await self._p.lane_committed(lane_of_templates(), _left(deadline))
        if not overwrite and await _read(self._store().template_row(name)) is not None:
            raise TemplateExistsError(f"a template {name!r} is stored already")
        started = await _read(self._store().template_session(sid))
        if started is not None and started.ok:
            template = dataclasses.replace(template, successes=1)
        return await self.save(template, timeout_s=_left(deadline))

    async def import_(self, text: str | bytes, *,
                      timeout_s: float | None = WRITE_TIMEOUT_S) -> int:
        """Store the templates of an export (``export``'s JSON: a list of template
        documents; one document alone is read too), counts included; returns how many
        were new. A template whose name is stored already is left as it is, so importing
        the same text again changes nothing. Every document is checked before any is
        accepted.

        Raises:
            InvalidTemplateError: not JSON, a document that is not a template, a name twice.
            FlushTimeoutError, QueueFullError, DiskFullError, PipelineClosedError, ...
        """
        try:
            docs = json.loads(text)
        except (ValueError, TypeError) as exc:
            raise InvalidTemplateError(f"templates must be JSON: {exc}") from exc
        if isinstance(docs, dict):
            docs = [docs]
        if not isinstance(docs, builtins.list):
            raise InvalidTemplateError("templates must be a JSON list of template documents")
        templates = []
        for i, doc in enumerate(docs):
            try:
                templates.append(_checked(Template.from_dict(doc)))
            except InvalidTemplateError as exc:
                raise InvalidTemplateError(f"template [{i}]: {exc}") from None
        names = [t.name for t in templates]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise InvalidTemplateError(f"template name(s) given twice: {', '.join(twice)}")
        deadline = _deadline(timeout_s)
        await self._p.lane_committed(lane_of_templates(), _left(deadline))
        stored = await _read(self._store().template_names(names))
        records = [self._put(t, "keep") for t in templates if t.name not in stored]
        receipts = [self._accept(r) for r in records]
        await self._p.committed(receipts, _left(deadline))
        return len(receipts)

    async def _auto_create(self, session_id: str, timeout_s: float | None) -> str | None:
        """The session's template, saved unless one of its task type has the same examples
        or source session (checked here, and again exactly when it commits); its name, or
        None when none was made."""
        messages = await self._p.sessions.conversation(session_id)
        task_type = classify(messages, self.settings)
        template = extract(messages, name=auto_name(task_type, session_id),
                           session_id=session_id, settings=self.settings, task_type=task_type,
                           rules=self._p.settings.tool_outcome_rules,
                           description=f"Made automatically from session {session_id}.")
        if not template.examples:
            return None
        duplicate = await _read(self._store().template_duplicate(
            task_type, examples_signature(template.examples), session_id))
        if duplicate is not None:
            return None
        # Its source session counts as one success: it met the bar.
        template = dataclasses.replace(template, successes=1)
        await self._p.committed([self._accept(self._put(_checked(template), "auto"))],
                                timeout_s)
        stored = await self.get(template.name)
        return template.name if stored and stored.source_session_id == session_id else None

    # -- records -------------------------------------------------------------------------

    def _put(self, template: Template, mode: str) -> tuple[str, float, bytes]:
        return self._record("put", name=template.name, document=template.to_dict(),
                            mode=mode)

    def _record(self, action: str, **fields: Any) -> tuple[str, float, bytes]:
        """A record ready to accept: (key, time, bytes). Raises InvalidTemplateError past
        ``max_turn_bytes``."""
        key, at = self._p.new_key(), time.time()
        data = encode_template_op(key, at, action, **fields).encode("ascii")
        limit = self._p.settings.max_turn_bytes
        if len(data) > limit:
            raise InvalidTemplateError(f"the template record is {len(data)} bytes encoded; "
                                       f"the limit (max_turn_bytes) is {limit}")
        return key, at, data

    def _accept(self, record: tuple[str, float, bytes]) -> Receipt:
        key, at, data = record
        return self._p.accept_record(key, lane_of_templates(), at, data)


@asynccontextmanager
async def open_template_reads(path: Path | str, settings: TemplateSettings, *,
                              busy_timeout_ms: int = 10_000
                              ) -> AsyncIterator[TemplateReads]:
    """The template reads of the store file at ``path``, opened read-only (no writer, no
    lock, no migration): safe beside a running pipeline or worker.

    Raises:
        StoreError: no such file, not a store of ours, another schema version, unreadable.
    """
    from ..store import SqliteStore

    store = SqliteStore(Path(path), readers=1, busy_timeout_ms=busy_timeout_ms)
    await store.open_readonly()
    reads = TemplateReads(store, settings)
    try:
        yield reads
    finally:
        reads._file_store = None
        await store.aclose()


def _template(document: str, usage_count: int, successes: int, failures: int,
              created_at: float, updated_at: float) -> Template:
    """A stored row as a template: its document, with the store's counts."""
    try:
        template = Template.from_json(document)
    except InvalidTemplateError as exc:
        raise StoreError(f"a stored template cannot be read: {exc}") from exc
    return dataclasses.replace(template, usage_count=usage_count, successes=successes,
                               failures=failures, created_at=created_at)


def _checked(template: object) -> Template:
    """``template`` with its tags normalized (and a creation time, when it has none), once
    its document reads back and every text of it can be stored.

    Raises:
        InvalidTemplateError: it cannot.
    """
    if not isinstance(template, Template):
        raise InvalidTemplateError(f"a Template is needed, got {type(template).__name__}")
    _name(template.name)
    _task_type(template.task_type)
    checked = dataclasses.replace(template, tags=normalize_tags(template.tags))
    if not checked.created_at:  # a template made by hand: it is created now
        checked = dataclasses.replace(checked, created_at=time.time())
    try:
        doc = checked.to_dict()
        text = json.dumps(doc, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidTemplateError(f"template {template.name!r} is not JSON: {exc}") from exc
    if "\x00" in text or "\\u0000" in text:
        raise InvalidTemplateError(f"template {template.name!r} holds a NUL character")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidTemplateError(
            f"template {template.name!r} holds a lone surrogate") from None
    return Template.from_dict(json.loads(text))


def _name(value: object) -> str:
    """A template name: a trimmed string of at most ``NAME_CHARS`` characters without
    control characters (the CLI prints names as they are)."""
    if (not isinstance(value, str) or not value or value != value.strip()
            or len(value) > NAME_CHARS
            or any(unicodedata.category(ch) in ("Cc", "Cs") for ch in value)):
        raise InvalidTemplateError(
            f"a template name must be a trimmed, non-empty string of at most {NAME_CHARS} "
            f"characters without control characters, got {value!r:.60}")
    return value


def _task_type(value: object) -> str:
    try:
        return _name(value)
    except InvalidTemplateError:
        raise InvalidTemplateError(f"a task type must be a name, got {value!r:.60}") from None


def _session(value: object) -> str:
    try:
        checked = check_id("session_id", value)
    except InvalidTurnError as exc:
        raise InvalidTemplateError(str(exc)) from None
    assert checked is not None
    return checked


async def _read(aw: Awaitable[T]) -> T:
    """Await a store read; SQLite's errors become StoreError."""
    try:
        return await aw
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read the store: {exc}") from exc


def _deadline(timeout_s: float | None) -> float | None:
    return None if timeout_s is None else time.monotonic() + timeout_s


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())
