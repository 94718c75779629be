"""``PostgresBackend``: the shared PostgreSQL store as one more sink of the replicator.

Each machine keeps its durable local accept (outbox, then the SQLite store); the replicator
sends the committed records on from the store's replica outbox, and this backend writes
them to PostgreSQL. So a gateway accepts while the database is down, and the backlog drains
when it returns.

One ``write`` is one transaction. Its records are applied in their lanes' order, in phases:
phase *p* holds, for every lane (a session, or a user's key-value lane), the turns after its
*p*-th operation; the phase's turns go in together, then each lane's next operation. A batch
with no operation (the common case) is one phase.

- **Turns.** Their messages are copied (``COPY``) into a temporary staging table, then
  ``INSERT … SELECT … ON CONFLICT (turn_key, ordinal) DO NOTHING``: measured on 2,000-turn
  batches (4,000 messages) against a local server, COPY with staging took ~115 ms a batch,
  ``executemany`` of the same INSERT ~131 ms, one INSERT of ``unnest`` arrays ~160 ms.
- **Counters** (messages, tool calls, tokens) mean what they mean in SQLite, and count only
  the turns this write inserted (the INSERT's ``RETURNING``): a batch sent again after an
  unknown outcome adds nothing.
- **Tool calls.** The calls of the turns' messages are logged as SQLite logs them
  (``derived.call_rows``, with ``Settings.tool_log``), staged beside the messages and
  inserted by the same statement, joined to the messages it inserted: a resend logs
  nothing. Then the calls of the write's sessions that await their answer are settled by
  the messages it inserted (``derived.settle_awaiting``: one query, and an update when some
  are), and a session's end settles its own. What SQLite does next in its commit (fixes,
  the per-user bound) is a shared job per user (``derived``), queued in this transaction.
- **seq.** A session's turns are numbered in the order they reach the database: the
  session's highest ``seq`` plus the turn's place among the session's turns of the write,
  under the session row's lock (taken first, by the sessions upsert, in id order so two
  writers never wait on each other in a cycle). A session is written through one gateway,
  whose replicator sends its turns in its local commit order, which is their accept order:
  so ``seq`` is the accept order, whatever the machines' clocks say. (Two gateways writing
  one session at once are ordered by their commits here.) Reads order by ``(seq, ordinal)``.
- **Operations** (session describe, end, delete, import; key-value put and delete;
  template put, delete, use and outcome: ``mirrors_templates``) are applied once each: the
  record's key goes into ``applied_records`` in the transaction that applies it, and only
  when that insert took. A resent batch whose session delete was applied before skips the
  turns of that session before the delete too: they were applied then and the delete
  removed them; inserting them again would bring them back. A template start or end that
  moves a template's counts queues its stats job (``derived``).
- **NUL.** PostgreSQL text cannot hold U+0000: it is stored as U+FFFD (the replacement
  character) in message text, so the batch never fails for it and the place stays visible.
  (JSON text, metadata and tool calls, holds it escaped, as ``\\u0000``, unchanged.)
- **NOTIFY.** The transaction sends ``pg_notify(WRITES_CHANNEL, …)`` naming the users (and
  the sessions without a user) it wrote, and this backend's ``origin``; PostgreSQL
  delivers it at commit, and only then. ``watch`` LISTENs on the channel (``listen``) and
  reports the other origins' writes, so each machine refreshes its prefetch cache for those
  users; after a reconnect it reports everyone (what was sent meanwhile is lost).

Outages. A failure to reach the server (refused, lost, timed out, shutting down) raises
``BackendUnavailableError``: the replicator keeps the records and counts no attempt, and
``available()`` is False until a write or a recall gets through again. A connection lost
while committing leaves the outcome unknown: the replicator resends the batch with
``maybe_sent``, and the unique keys make that a no-op for what is there.

The schema is checked, never changed, at start: a schema too old is a ``SchemaVersionError``
saying to run ``hermes-memory db upgrade``. Migrations are a deploy step, taken once by an
operator: several gateways of different versions share one database, and one of them
starting must not change the schema under the others (DDL also locks tables they write).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import structlog

from ..backends.base import (
    Backend,
    BackendUnavailableError,
    BackendWriteError,
    RecallRequest,
    TurnFailure,
    WriteNotice,
)
from ..errors import (
    BackendError,
    DatabaseError,
    DatabaseUnavailableError,
    SchemaVersionError,
    describe,
)
from ..ops import OP_KV, OP_SESSION, OP_TEMPLATE, KvOp, SessionOp, parse_op
from ..procedural.extract import GOAL_CHARS, OutcomeRules
from ..retry import Backoff
from ..settings import Settings
from ..turns import TURN, Turn, payload_rows, scope_token_for
from .derived import (
    CLOSE_ENDED,
    GOAL,
    PROCEDURAL,
    TEMPLATE_STATS,
    Written,
    call_rows,
    last_goals,
    procedural_job,
    settle_awaiting,
    template_stats_job,
)
from .dsn import redact_dsn, settings_dsn
from .jobs import JOBS_CHANNEL
from .listen import Listener
from .notices import WRITES_CHANNEL, notify_payload, parse_notice
from .operations import apply_session, apply_template, clean, phases
from .pool import UnclassifiedErrors, close_pool, create_pool, database_errors
from .recall import recall_block
from .schema import check
from .statements import (
    ADD_COUNTERS,
    CLAIM_RECORD,
    ENQUEUE_JOBS,
    INSERT_MESSAGES,
    INSERT_MESSAGES_AND_CALLS,
    KV_DELETE,
    KV_PUT,
    STAGE,
    STAGE_CALL_COLUMNS,
    STAGE_CALLS,
    STAGE_COLUMNS,
    UPSERT_SESSIONS,
)

if TYPE_CHECKING:
    from asyncpg import Pool, Record
    from asyncpg.pool import PoolConnectionProxy

    Conn = PoolConnectionProxy[Record]

log = structlog.get_logger(__name__)

_DEFAULT_RULES = OutcomeRules()
# While the database is known down, a recall tries it again at most this often (each try
# may wait up to the connect time-out); the replicator's writes try on their own backoff.
PROBE_INTERVAL_S = 5.0



@dataclass(slots=True)
class _Written:
    inserted: int = 0  # turns inserted
    skipped: int = 0  # turns already there (a resend)
    applied: int = 0  # operations applied
    already: int = 0  # operations applied before
    users: set[str] = field(default_factory=set)
    sessions: set[str] = field(default_factory=set)  # of turns with no user
    procedural: set[str] = field(default_factory=set)  # users whose calls were logged
    templates: set[str] = field(default_factory=set)  # whose counts changed

    def add(self, other: _Written) -> None:
        self.inserted += other.inserted
        self.skipped += other.skipped
        self.applied += other.applied
        self.already += other.already
        self.users |= other.users
        self.sessions |= other.sessions
        self.procedural |= other.procedural
        self.templates |= other.templates


class PostgresBackend(Backend):
    """Replicates committed records to the shared PostgreSQL store and answers recalls from
    it (see the module doc). Selected by ``Settings.backend = "postgres"``."""

    name = "postgres"
    recalls = True
    mirrors_kv = True
    mirrors_templates = True
    watches = True

    def __init__(self, settings: Settings, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Raises ConfigurationError: no DSN is configured."""
        self._settings = settings
        self._dsn = settings_dsn(settings)
        self._clock = clock
        self._pool: Pool[Record] | None = None
        self._connecting = asyncio.Lock()
        self._down: str | None = None  # why the database is known down, while it is
        self._next_probe = 0.0
        self._closed = False
        # Names this process's writes in their notifications: its own are not reported back.
        self.origin = uuid.uuid4().hex[:16]
        self.listener: Listener | None = None
        self.counts: Counter[str] = Counter()
        self._unclassified = UnclassifiedErrors(clock=clock)

    def __repr__(self) -> str:
        return f"PostgresBackend(dsn={redact_dsn(self._dsn)!r})"

    # -- life cycle ----------------------------------------------------------------------

    async def startup(self) -> None:
        """Open the pool and check the schema. A database that cannot be reached now does
        not stop the pipeline (it accepts locally; writes try again later).

        Raises:
            SchemaVersionError: the schema is older (run ``hermes-memory db upgrade``) or
                newer than this library's.
            DatabaseError: the server refused us (a wrong password, no such database).
        """
        try:
            await self._ensure_pool()
        except DatabaseUnavailableError as exc:
            self._mark_down(exc)
            log.warning("postgres_unavailable_at_start", dsn=redact_dsn(self._dsn),
                        error=describe(exc))

    async def aclose(self) -> None:
        """Close the pool. Idempotent."""
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            await close_pool(pool)

    def available(self) -> bool:
        return self._down is None

    def stats(self) -> dict[str, object]:
        return {**{k: self.counts[k] for k in (
            "turns_inserted", "turns_skipped", "ops_applied", "ops_skipped", "unavailable")},
            "down": self._down}

    async def _ensure_pool(self) -> Pool[Record]:
        """The pool, opened (and the schema checked) on first use.

        Raises:
            DatabaseUnavailableError: the server cannot be reached.
            SchemaVersionError, DatabaseError: as ``startup``.
            BackendError: the backend is closed.
        """
        if self._closed:
            raise BackendError("the PostgreSQL backend is closed")
        if self._pool is not None:
            return self._pool
        async with self._connecting:
            if self._pool is None:
                pool = await create_pool(self._settings)
                try:
                    async with database_errors(self._dsn, self._unclassified):
                        await check(pool)
                except BaseException:
                    await close_pool(pool)
                    raise
                self._pool = pool
            return self._pool

    def _mark_down(self, exc: BaseException) -> None:
        if self._down is None:
            log.warning("postgres_down", dsn=redact_dsn(self._dsn), error=describe(exc))
        self._down = describe(exc)
        self._next_probe = self._clock() + PROBE_INTERVAL_S

    def _mark_up(self) -> None:
        if self._down is not None:
            log.info("postgres_up", dsn=redact_dsn(self._dsn))
        self._down = None

    # -- writing -------------------------------------------------------------------------

    async def write(self, turns: Sequence[Turn], *, maybe_sent: bool = False) -> None:
        """Write ``turns`` (and operations) in one transaction, each once (module doc).

        A batch the database refuses is split to find the records it refuses (``_isolate``):
        the other lanes are written, and so is each refused lane up to its first refused
        record.

        Raises:
            BackendUnavailableError: the database cannot be reached (or its schema is not
                this library's yet); nothing was written, or (a connection lost at commit)
                the outcome is unknown: send again with ``maybe_sent``.
            BackendWriteError: the database refused records (``failures``: each refused
                record, and its lane's later ones, not attempted); the rest were written.
        """
        if not turns:
            return
        started = time.perf_counter()
        try:
            written = await self._commit(turns, maybe_sent)
        except DatabaseError as exc:
            if isinstance(exc, (DatabaseUnavailableError, SchemaVersionError)) or len(turns) == 1:
                self._failed(turns, exc)
            log.warning("postgres_batch_refused", records=len(turns), error=describe(exc))
            written, failures = await self._isolate(turns, maybe_sent)
        else:
            failures = []
        self._mark_up()
        self.counts["turns_inserted"] += written.inserted
        self.counts["turns_skipped"] += written.skipped
        self.counts["ops_applied"] += written.applied
        self.counts["ops_skipped"] += written.already
        log.info("postgres_write", records=len(turns), turns_inserted=written.inserted,
                 turns_skipped=written.skipped, ops_applied=written.applied,
                 ops_skipped=written.already, maybe_sent=maybe_sent, refused=len(failures),
                 duration_ms=round((time.perf_counter() - started) * 1000, 1))
        if failures:
            raise BackendWriteError(failures, written=len(turns) - len(failures),
                                    message=failures[0].reason)

    async def _commit(self, turns: Sequence[Turn], maybe_sent: bool) -> _Written:
        """``turns`` in one transaction, with its NOTIFY.

        Raises:
            DatabaseError: the transaction failed (ours: scrubbed, typed).
            BackendError: the backend is closed.
        """
        pool = await self._ensure_pool()
        async with database_errors(self._dsn, self._unclassified):
            async with pool.acquire() as conn, conn.transaction():
                written = await self._apply(conn, turns, maybe_sent)
                await conn.execute(
                    "SELECT pg_notify($1, $2)", WRITES_CHANNEL,
                    notify_payload(self.origin, written.users, written.sessions))
        return written

    async def _isolate(self, turns: Sequence[Turn], maybe_sent: bool
                       ) -> tuple[_Written, list[TurnFailure]]:
        """Write a refused batch in parts: its lanes in halves, each part one transaction,
        until a lane alone is refused; then that lane's longest prefix the database takes
        (halving the rest). The record it refuses fails, attempted; the lane's later records
        wait for it (not attempted), so the lane keeps its order. A bad record costs
        O(log n) transactions; the other sessions go in.

        Raises:
            BackendUnavailableError: the database went away meanwhile: the parts written
                stay (the resend, ``maybe_sent``, skips them).
        """
        total, failures = _Written(), []
        lanes: dict[str, list[Turn]] = {}
        for t in turns:
            lanes.setdefault(t.session_id, []).append(t)
        groups: list[list[list[Turn]]] = [list(lanes.values())]
        while groups:
            group = groups.pop()
            records = [t for lane in group for t in lane]
            try:
                total.add(await self._commit(records, maybe_sent))
                continue
            except DatabaseError as exc:
                if isinstance(exc, (DatabaseUnavailableError, SchemaVersionError)):
                    self._failed(records, exc)
                if len(group) > 1:
                    half = len(group) // 2
                    groups += [group[half:], group[:half]]  # the first half next
                    continue
            failures += await self._lane_prefix(group[0], maybe_sent, total)
        return total, failures

    async def _lane_prefix(self, lane: list[Turn], maybe_sent: bool, total: _Written
                           ) -> list[TurnFailure]:
        """Write the longest prefix of ``lane`` the database takes; the failures of the
        first record it refuses and of those after it."""
        start = 0
        size = max(1, len(lane) // 2)  # the whole lane was refused already
        while start < len(lane):
            try:
                total.add(await self._commit(lane[start:start + size], maybe_sent))
            except DatabaseError as exc:
                if isinstance(exc, (DatabaseUnavailableError, SchemaVersionError)):
                    self._failed(lane[start:], exc)
                if size > 1:
                    size //= 2
                    continue
                reason = describe(exc)
                bad = lane[start]
                log.warning("postgres_record_refused", key=bad.key, session_id=bad.session_id,
                            error=reason)
                return [TurnFailure(bad.key, bad.session_id, reason, False)] + [
                    TurnFailure(t.key, t.session_id, f"waits for refused record {bad.key}",
                                False, attempted=False) for t in lane[start + 1:]]
            start += size
            size = len(lane) - start
        return []

    def _failed(self, turns: Sequence[Turn], exc: DatabaseError) -> NoReturn:
        """Raise the backend error for a write that failed with ``exc`` (ours, scrubbed):
        unavailable for an outage, and for a schema not upgraded yet (the records wait for
        the operator's ``hermes-memory db upgrade`` rather than use up their attempts)."""
        reason = describe(exc)
        if isinstance(exc, (DatabaseUnavailableError, SchemaVersionError)):
            if isinstance(exc, SchemaVersionError):
                log.error("postgres_schema_mismatch", error=reason)
            self._mark_down(exc)
            self.counts["unavailable"] += 1
            raise BackendUnavailableError(
                [TurnFailure(t.key, t.session_id, reason, False, attempted=False)
                 for t in turns], written=0, message=reason) from None
        log.warning("postgres_write_failed", records=len(turns), error=reason)
        raise BackendWriteError([TurnFailure(t.key, t.session_id, reason, False)
                                 for t in turns], written=0, message=reason) from None

    async def _apply(self, conn: Conn, turns: Sequence[Turn], maybe_sent: bool) -> _Written:
        written = _Written()
        records = list(turns)
        if maybe_sent:
            records = await self._without_deleted(conn, records, written)
        await conn.execute(STAGE)
        for phase in phases(records):
            if phase.turns:
                await self._write_turns(conn, phase.turns, written)
            for op in phase.ops:
                await self._apply_op(conn, op, written)
        await self._enqueue_derived(conn, written)
        return written

    async def _enqueue_derived(self, conn: Conn, written: _Written) -> None:
        """Queue the jobs of the work derived from what this transaction wrote (``derived``),
        so they commit with it."""
        s = self._settings
        for kind, jobs in (
                (PROCEDURAL, [procedural_job(u, s.tool_log_max_per_user, s.tool_fix_window_s)
                              for u in sorted(written.procedural)]),
                (TEMPLATE_STATS, [template_stats_job(n) for n in sorted(written.templates)])):
            if jobs and await conn.fetchval(ENQUEUE_JOBS, kind, [k for k, _ in jobs],
                                            [p for _, p in jobs]):
                await conn.execute("SELECT pg_notify($1, $2)", JOBS_CHANNEL, kind)

    async def _without_deleted(self, conn: Conn, records: list[Turn], written: _Written
                               ) -> list[Turn]:
        """``records`` without those at or before a session delete applied before: that
        write applied them and the delete removed them."""
        keys = [t.key for t in records if t.kind == OP_SESSION]
        if not keys:
            return records
        applied = {r["record_key"] for r in await conn.fetch(
            "SELECT record_key FROM applied_records WHERE record_key = ANY($1::text[]) "
            "AND kind = 'session'", keys)}
        cut: dict[str, int] = {}
        for i, t in enumerate(records):
            if t.key in applied and parse_op(json.loads(t.payload), t.payload).action == "delete":
                cut[t.session_id] = i
        if not cut:
            return records
        kept = []
        for i, t in enumerate(records):
            if i <= cut.get(t.session_id, -1):
                if t.kind == TURN:
                    written.skipped += 1
                else:
                    written.already += 1
                continue
            kept.append(t)
        return kept

    async def _write_turns(self, conn: Conn, turns: list[Turn], written: _Written) -> None:
        sessions: dict[str, list[Any]] = {}
        default_source = self._settings.source
        for t in turns:
            row = sessions.get(t.session_id)
            if row is None:
                sessions[t.session_id] = [t.source or default_source, t.user_id, t.model,
                                          t.parent_session_id, t.accepted_at, t.accepted_at]
                continue
            row[1] = row[1] or t.user_id
            row[2] = t.model or row[2]
            row[3] = row[3] or t.parent_session_id
            row[4] = min(row[4], t.accepted_at)
            row[5] = max(row[5], t.accepted_at)
        ids = sorted(sessions)
        await conn.execute(UPSERT_SESSIONS, ids, *(
            [sessions[i][k] for i in ids] for k in range(6)))
        await conn.execute("DELETE FROM hermes_stage")
        calls: list[tuple[Any, ...]] | None = [] if self._settings.tool_log else None
        calling: Counter[str] = Counter()  # calls per turn key
        goalless: dict[str, list[int]] = {}
        staged = stage_rows(turns, calls, calling, self._settings.tool_outcome_rules,
                            goalless)
        if calls and goalless:  # their goal is a user message before this write
            goals = await last_goals(conn, list(goalless))
            for sid, places in goalless.items():
                for i in places:
                    staged_call = calls[i]  # (pos, turn key, *derived.CallRow)
                    calls[i] = (*staged_call[:GOAL + 2], goals.get(sid),
                                *staged_call[GOAL + 3:])
        await conn.copy_records_to_table("hermes_stage", records=staged,
                                         columns=STAGE_COLUMNS)
        insert = INSERT_MESSAGES
        if calls:
            await conn.execute(STAGE_CALLS)
            await conn.copy_records_to_table("hermes_stage_calls", records=calls,
                                             columns=STAGE_CALL_COLUMNS)
            insert = INSERT_MESSAGES_AND_CALLS
        inserted = {r["turn_key"] for r in await conn.fetch(insert)}
        if calls is not None:
            # The calls of these sessions awaiting their answer, settled by what came now.
            written_by: dict[str, list[Written]] = {}
            for m in staged:
                if m[3] in inserted:
                    written_by.setdefault(m[1], []).append((m[3], m[4], m[5], m[6], m[7], m[8]))
            written.procedural |= await settle_awaiting(conn, written_by,
                                                        self._settings.tool_outcome_rules)
        totals: dict[str, list[int]] = {}
        for t in turns:
            if t.key not in inserted:
                written.skipped += 1
                continue
            written.inserted += 1
            if t.user_id:
                written.users.add(t.user_id)
            else:
                written.sessions.add(t.session_id)
            if calling[t.key]:
                written.procedural.add(t.user_id or "")
            total = totals.setdefault(t.session_id, [0, 0, 0, 0])
            total[0] += t.n_messages
            total[1] += t.tool_calls
            total[2] += t.input_tokens
            total[3] += t.output_tokens
        if totals:
            ids = list(totals)
            await conn.execute(ADD_COUNTERS, ids, *(
                [totals[i][k] for i in ids] for k in range(4)))

    async def _apply_op(self, conn: Conn, record: Turn, written: _Written) -> None:
        op = parse_op(json.loads(record.payload), record.payload)
        kind = (OP_KV if isinstance(op, KvOp) else OP_SESSION if isinstance(op, SessionOp)
                else OP_TEMPLATE)
        session = op.session_id if isinstance(op, SessionOp) else None
        if not await conn.fetchval(CLAIM_RECORD, op.record_key, kind, session):
            written.already += 1
            return
        written.applied += 1
        if isinstance(op, KvOp):
            written.users.add(op.user_id)
            if op.action == "put":
                await conn.execute(
                    KV_PUT, op.user_id, op.key, op.value,
                    None if op.metadata is None else json.dumps(op.metadata),
                    op.accepted_at, scope_token_for(op.user_id, None))
            else:
                await conn.execute(KV_DELETE, op.user_id, op.key)
        elif isinstance(op, SessionOp):
            if op.user_id:
                written.users.add(op.user_id)
            else:
                written.sessions.add(op.session_id)
            await apply_session(conn, op, self._settings.source)
            if op.action == "end" and self._settings.tool_log:
                # Its calls still awaiting their answer were never answered.
                written.procedural |= {r["user_id"] for r in await conn.fetch(
                    CLOSE_ENDED, op.session_id)}
        else:
            name = await apply_template(conn, op)
            if name is not None:
                written.templates.add(name)

    # -- other machines' writes ----------------------------------------------------------

    async def watch(self, on_write: Callable[[WriteNotice], None]) -> None:
        """Report other processes' writes (their NOTIFY) until cancelled; after each
        (re)connect, report everyone. Run as a supervised part.

        Raises:
            DatabaseError: the server refused the connection for a lasting reason.
        """
        listener = Listener(self._settings, backoff=Backoff())
        self.listener = listener

        def on_notification(payload: str) -> None:
            notice = parse_notice(payload, self.origin)
            if notice is not None:
                on_write(notice)

        listener.subscribe(WRITES_CHANNEL, on_notification)

        def on_connect() -> None:
            # The database answers again: recalls stop falling back now, not at the next
            # probe, so the refresh that follows reads it (and clears stale blocks).
            self._mark_up()
            on_write(WriteNotice(everyone=True))

        listener.on_connect(on_connect)
        await listener.run()

    # -- recall --------------------------------------------------------------------------

    async def recall(self, request: RecallRequest) -> str | None:
        """A block of the user's (else the session's) messages that match the query, from
        the shared store, in the local store's format; None while the database is down (the
        local store answers).

        Raises:
            BackendError: the database failed otherwise (the local store answers).
        """
        if self._down is not None and self._clock() < self._next_probe:
            return None
        try:
            pool = await self._ensure_pool()
            async with database_errors(self._dsn, self._unclassified):
                block = await recall_block(pool, request, self._settings)
        except DatabaseUnavailableError as exc:
            self._mark_down(exc)
            return None
        except DatabaseError as exc:
            raise BackendError(f"PostgreSQL recall failed: {describe(exc)}") from None
        self._mark_up()
        return block


def stage_rows(turns: Iterable[Turn], calls: list[tuple[Any, ...]] | None = None,
               calling: Counter[str] | None = None, rules: OutcomeRules = _DEFAULT_RULES,
               goalless: dict[str, list[int]] | None = None) -> list[tuple[Any, ...]]:
    """The staging rows of ``turns``' messages, in order, each with its turn's rank among
    its session's turns here (1, 2, ...). With ``calls``, the staging rows of their tool
    calls (``derived.call_rows``, judged by ``rules``) are added to it, and ``calling``
    counts them per turn; a call of a turn without a user message takes the session's last
    one before it as its goal, and ``goalless`` gets, per session, the places in ``calls``
    of those whose goal is one before these turns (the caller looks it up)."""
    rows: list[tuple[Any, ...]] = []
    ranks: Counter[str] = Counter()
    last_user: dict[str, str | None] = {}  # the latest user message of a session here
    for t in turns:
        ranks[t.session_id] += 1
        rank = ranks[t.session_id]
        messages = payload_rows(t.payload)
        for (sid, key, ordinal, *texts, at, user, scope, metadata, tokens) in messages:
            if t.has_nul:
                texts = [clean(v) for v in texts]
            rows.append((len(rows), sid, rank, key, ordinal, *texts, float(at), user, scope,
                         metadata, tokens))
        if calls is not None and t.tool_calls:
            before = last_user.get(t.session_id)
            found = call_rows(messages, rules, before)
            if calling is not None:
                calling[t.key] += len(found)
            if (goalless is not None and found and t.session_id not in last_user
                    and not any(m[3] == "user" for m in messages)):
                goalless.setdefault(t.session_id, []).extend(
                    range(len(calls), len(calls) + len(found)))
            for row in found:
                if t.has_nul:
                    row = tuple(clean(v) for v in row)
                calls.append((len(calls), t.key, *row))
        if calls is not None:
            for m in messages:
                if m[3] == "user":
                    last_user[t.session_id] = (None if m[4] is None
                                               else clean(m[4][:GOAL_CHARS]))
    return rows
