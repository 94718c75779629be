"""Writing committed turns to Honcho: per session, in order, in batches, exactly once.

``write(turns)`` groups the turns by session and keeps their order. A session's turns go out
in ``add_messages`` calls of at most 100 messages (the server's limit; it answers 422 above
it). Sessions run in parallel under a capacity limit. Calls to one session never overlap, also
across concurrent ``write`` calls, which run in the order they were made.

Exactly once. Each message carries its turn's idempotency key and its index within the turn
in ``metadata`` (see ``mapping``). Before a batch whose outcome is unknown (a timeout, a
connection dropped after sending, a 5xx) is sent again, the session's messages are listed with
a metadata filter on those keys and only the missing ones are sent; so before each resend.

The server has no idempotency keys of its own, does not abort a request whose client went
away, and runs a session's writes one after the other: a request still running there when the
check runs is missed by it, commits later, and the resend queued behind it commits too. So a
check first waits until no request of its session can still be running:

- ``max_inflight_s`` after the last one sent to it that got no answer (a timeout, a connection
  lost after sending, a gateway's 504, a write cancelled while its request was out);
- in a write that says its turns may have been sent before (``maybe_sent``), also
  ``max_inflight_s`` after this writer started, for an earlier run's requests; not when each
  of the session's turns there first failed here, in a write of new turns.

That holds as long as the server keeps to ``max_inflight_s``. A 5xx the server sent itself
means it is done with the request: the check runs after the usual backoff.

Waiting. The session waits in its lane, so its order holds; the other sessions of the same
write go on in theirs. ``write`` returns once every lane is done, so its caller's next write
(the replicator sends one at a time) waits for it: up to ``max_inflight_s`` more per unknown
outcome. A lane that waits keeps its share of ``write_concurrency``: while a struggling server
times requests out, that keeps new sessions from adding to its load. The wait is cancellable:
a shutdown does not wait for it; the turns stay with the caller, whose next write
(``maybe_sent``) checks first, after the wait.

Failures. A batch the server refuses (422, 400, 413) is split in halves until the refused turn
is alone; the other turns are written, in order, and the turn fails with the server's reason.
When a batch cannot be written after ``max_attempts``, it and the rest of its session's turns
in that call fail (so nothing is written out of order). Either way ``write`` raises
``HonchoWriteError`` naming each failed turn, why, whether retrying the same turn can help,
and whether it was sent at all: the turns behind a failed batch, and those the open circuit
held back, were not (``TurnFailure.attempted``), so their failure uses up none of their attempts.

Session lifecycle records. A describe, end, delete or import (``mapping.Action``) runs in its
session's order: after the messages of the session's turns before it in the same write, and
before those after it (a metadata call that a later call of the same write overwrites is not
made). Its call (``set_metadata``, ``delete_session``) goes through the same breaker and
retries as a batch, and may be repeated: setting the same metadata again changes nothing, and
deleting a session Honcho does not have (a 404: never created there, or deleted by an earlier
send whose answer was lost) counts as done. One the server refuses is that record's failure
alone; one still failing after ``max_attempts`` also holds back the rest of its session, as a
batch does.
"""

from __future__ import annotations

import functools
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog

from ...turns import Turn
from ..base import TurnFailure
from .breaker import CIRCUIT_OPEN
from .client import (
    CallFailed,
    CallRetry,
    CircuitOpenError,
    HonchoClient,
    HonchoWriteError,
    sdk,
)
from .config import HonchoConfig
from .mapping import INDEX_FIELD, KEY_FIELD, Action, Mapper, Msg, Unit

log = structlog.get_logger(__name__)

# The server's rules (honcho src/schemas/api.py): MessageBatchCreate takes 1..100 messages;
# fastapi-pagination pages hold at most 100 items.
MAX_MESSAGES_PER_CALL = 100
LIST_PAGE_SIZE = 100
_KEYS_PER_LISTING = 50  # turn keys per metadata filter when checking what the server holds
# turns_written: records written (or found on the server by a check), each once.
# turns_failed: records a write could not deliver, each counted once, at its first failure:
#   its failures in later writes (a turn failing in 3 writes, or held back by the open circuit
#   again and again) add nothing until it has been written; one that fails again after that,
#   or after FAILED_REMEMBERED other failing records, counts again.
# dedupe_checks: listings of what the server holds before a resend; inflight_waits: how often
#   a check first waited out max_inflight_s; resend_skipped: messages a check found there.
COUNTERS = ("turns_written", "turns_failed", "dedupe_checks", "inflight_waits",
            "resend_skipped", "bisections")
FAILED_REMEMBERED = 20_000  # failing records remembered so as to count each once
_INFLIGHT_PRUNE_AT = 1_024  # sessions with a request maybe in flight, before expired ones go


@dataclass(slots=True)
class _Lane:
    session_id: str
    turns: list[Turn]
    after: anyio.Event | None  # the previous write of this session is done
    done: anyio.Event


@dataclass(slots=True)
class _Outcome:
    failures: list[TurnFailure] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)
    written: int = 0

    def fail(self, turns: Iterable[Turn], reason: str, *, permanent: bool,
             attempted: bool = True) -> None:
        for t in turns:
            if t.key not in self.failed:
                self.failed.add(t.key)
                self.failures.append(
                    TurnFailure(t.key, t.session_id, reason, permanent, attempted))


class _LRU:
    """A bounded map from a session id to the peers configured in it."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._data: OrderedDict[str, set[str]] = OrderedDict()

    def get(self, key: str) -> set[str] | None:
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key: str, value: set[str]) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        while len(self._data) > self._size:
            self._data.popitem(last=False)

    def discard(self, key: str) -> None:
        self._data.pop(key, None)


class SessionWriter:
    """Writes turns to Honcho through ``client``, per session in order (see the module doc).

    ``clock`` and ``sleep`` time the wait for requests that may still be in flight."""

    def __init__(self, config: HonchoConfig, client: HonchoClient, mapper: Mapper, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = anyio.sleep) -> None:
        self.config = config
        self.client = client
        self.mapper = mapper
        self.counts: Counter[str] = Counter()
        self._clock = clock
        self._sleep = sleep
        self._started = clock()  # an earlier run's requests were all sent before this
        # Honcho session -> when the last request sent to it whose outcome is unknown can no
        # longer commit on the server.
        self._in_flight: dict[str, float] = {}
        # The keys counted in turns_failed, each with whether it first came in a write that
        # said it was never sent before (so no earlier run can have it in flight).
        self._failing: OrderedDict[str, bool] = OrderedDict()
        self._ready = False
        self._ready_lock = anyio.Lock()
        self._limiter = anyio.CapacityLimiter(config.write_concurrency)
        self._lanes: dict[str, anyio.Event] = {}  # session -> the last write queued on it
        self._sessions = _LRU(config.known_sessions)

    async def write(self, turns: Sequence[Turn], *, maybe_sent: bool = False) -> None:
        """See ``HonchoBackend.write``.

        Raises:
            CircuitOpenError: the circuit is open; nothing was sent.
            HonchoWriteError: some turns were not written (``failures`` says which and why).
            BackendError: the backend is closed, or honcho-ai is missing.
        """
        if not turns:
            return
        self.client.honcho()
        started = time.perf_counter()
        calls_before = sum(self.client.calls.values())
        if self.client.breaker.is_open():
            held = [TurnFailure(t.key, t.session_id, CIRCUIT_OPEN, False, attempted=False)
                    for t in turns]
            self._count_failed(held, fresh=not maybe_sent)
            raise CircuitOpenError(held, written=0)
        groups: dict[str, list[Turn]] = {}
        for t in turns:
            groups.setdefault(t.session_id, []).append(t)
        # Queue on each session's lane now, before any await: that fixes the order of
        # concurrent writes of one session to the order of the calls.
        lanes = []
        for session_id, group in groups.items():
            done = anyio.Event()
            lanes.append(_Lane(session_id, group, self._lanes.get(session_id), done))
            self._lanes[session_id] = done
        outcome = _Outcome()
        try:
            async with anyio.create_task_group() as tg:
                for lane in lanes:
                    tg.start_soon(self._run_lane, lane, outcome, maybe_sent)
        finally:
            for lane in lanes:
                lane.done.set()
                if self._lanes.get(lane.session_id) is lane.done:
                    del self._lanes[lane.session_id]
        self.counts["turns_written"] += outcome.written
        self._count_failed(outcome.failures, fresh=not maybe_sent)
        for t in turns:
            if t.key not in outcome.failed:
                self._failing.pop(t.key, None)  # written: a later failure counts again
        fields = dict(turns=len(turns), sessions=len(groups),
                      http_calls=sum(self.client.calls.values()) - calls_before,
                      failed=len(outcome.failures),
                      duration_ms=round((time.perf_counter() - started) * 1000, 1))
        if outcome.failures:
            log.warning("honcho_write", **fields)
            raise HonchoWriteError(outcome.failures, written=outcome.written)
        log.info("honcho_write", **fields)

    async def _run_lane(self, lane: _Lane, outcome: _Outcome, maybe_sent: bool) -> None:
        try:
            if lane.after is not None:
                await lane.after.wait()
            async with self._limiter:
                await self._write_session(lane.session_id, lane.turns, outcome, maybe_sent)
        except Exception as exc:  # the per-job boundary: one session's bug fails its turns only
            log.exception("honcho_write_bug", session=self.mapper.session_name(lane.session_id))
            outcome.fail(lane.turns, f"unexpected error: {type(exc).__name__}: {exc}",
                         permanent=False)
        finally:
            lane.done.set()

    async def _write_session(self, session_id: str, turns: list[Turn], outcome: _Outcome,
                             maybe_sent: bool) -> None:
        honcho_sdk = sdk()
        name = self.mapper.session_name(session_id)
        session = honcho_sdk.Session(name, self.client.honcho())
        runs = _runs(_superseded([self.mapper.unit(t) for t in turns]))
        for i, run in enumerate(runs):
            failed = await self._write_run(session, name, run, outcome, maybe_sent)
            last = run[-1]
            if failed is None and last.action is not None and last.turn.key not in outcome.failed:
                failed = await self._act(session, last, last.action, outcome)
            if failed is not None:
                # The session stops here: its later records wait for the next write, in order.
                rest = [last.turn] if last.action is not None else []
                rest += [u.turn for r in runs[i + 1:] for u in r]
                outcome.fail(rest, f"not attempted after an earlier call of this session "
                             f"failed: {failed.reason}", permanent=False, attempted=False)
                return

    async def _write_run(self, session: Any, name: str, units: list[Unit], outcome: _Outcome,
                         maybe_sent: bool) -> CallFailed | None:
        """The messages of ``units``, in order; the failure that stops the session, if one
        did (the units it kept from being sent have failed, not attempted)."""
        turns = [u.turn for u in units]
        if not any(u.msgs for u in units):
            outcome.written += sum(1 for u in units if u.action is None)
            return None
        try:
            await self._ensure_ready()
            await self._ensure_session(session, {m.params.peer_id for u in units
                                                 for m in u.msgs} - {self.mapper.assistant})
            if maybe_sent:
                # Sent before: nothing of it may still be in flight, an earlier run's neither,
                # unless each of these turns failed here first in a write of new turns.
                earlier_run = any(not self._failing.get(u.turn.key, False)
                                  for u in units if u.msgs)
                await self._settle(name, since_start=earlier_run)
                units = await self._without_present(session, units)
        except CallFailed as f:
            # The set-up was for the session's first batch: only that batch was tried (when
            # the call went out at all); the turns behind it were not.
            head = [u.turn for u in next(iter(self._groups(units)), [])]
            self._note_failure(name, turns, f)
            outcome.fail(head, f.reason, permanent=f.permanent, attempted=f.sent)
            outcome.fail(turns, f.reason, permanent=f.permanent, attempted=False)
            return f
        # All on the server already (a record's action is counted once it has run).
        outcome.written += sum(1 for u in units if not u.msgs and u.action is None)
        queue = deque(self._groups(units))
        while queue:
            group = queue.popleft()
            try:
                await self._send_group(session, group)
            except CallFailed as f:
                if f.bisect and len(group) > 1:
                    self.counts["bisections"] += 1
                    mid = len(group) // 2
                    queue.extendleft([group[mid:], group[:mid]])  # the first half goes first
                    continue
                refused = [u.turn for u in group]
                self._note_failure(name, refused, f)
                outcome.fail(refused, f.reason, permanent=f.permanent, attempted=f.sent)
                if f.bisect:
                    continue  # the server refused this turn alone; the next ones still go
                rest = [u.turn for g in queue for u in g]
                # Unreachable: the session's later turns wait for the next write, in order.
                outcome.fail(rest, f"not attempted after an earlier batch of this session "
                             f"failed: {f.reason}", permanent=False, attempted=False)
                return f
            outcome.written += sum(1 for u in group if u.action is None)
        return None

    async def _act(self, session: Any, unit: Unit, action: Action, outcome: _Outcome
                   ) -> CallFailed | None:
        """A lifecycle record's call (retried); the failure that stops the session, if any:
        one the server refused is the record's alone."""
        try:
            if action.delete:
                await self._delete(session)
            else:
                await self.client.call("set_metadata", functools.partial(
                    session.aio.set_metadata, action.metadata))
        except CallFailed as f:
            self._note_failure(session.id, [unit.turn], f)
            outcome.fail([unit.turn], f.reason, permanent=f.permanent, attempted=f.sent)
            return None if f.permanent else f
        outcome.written += 1
        return None

    async def _delete(self, session: Any) -> None:
        """Delete the Honcho session (its messages go with it); one it does not have counts
        as deleted.

        Raises:
            CallFailed: as ``HonchoClient.call``.
        """
        not_found = sdk().NotFoundError

        async def delete() -> None:
            try:
                await session.aio.delete()
            except not_found:
                pass  # never created there, or deleted by a send whose answer was lost

        try:
            await self.client.call("delete_session", delete)
        finally:
            self._sessions.discard(session.id)  # a later turn makes it anew, with its peers

    def _count_failed(self, failures: Iterable[TurnFailure], *, fresh: bool) -> None:
        """Count in ``turns_failed`` the records failing for the first time (see COUNTERS);
        ``fresh``: their write said they were never sent before."""
        failing = self._failing
        for f in failures:
            if f.key in failing:
                failing.move_to_end(f.key)
                continue
            failing[f.key] = fresh
            self.counts["turns_failed"] += 1
            if len(failing) > FAILED_REMEMBERED:
                failing.popitem(last=False)

    def _sent_unanswered(self, name: str, sent_at: float) -> None:
        """A request to session ``name`` sent at ``sent_at`` got no answer: it may still
        commit on the server up to ``max_inflight_s`` after that."""
        until = sent_at + self.config.max_inflight_s
        self._in_flight[name] = max(until, self._in_flight.get(name, -math.inf))
        if len(self._in_flight) > _INFLIGHT_PRUNE_AT:
            now = self._clock()
            for key in [k for k, t in self._in_flight.items() if t <= now]:
                del self._in_flight[key]

    async def _settle(self, name: str, *, since_start: bool = False) -> None:
        """Return once no request this writer sent to session ``name`` can still commit on
        the server (see ``_sent_unanswered``) and, with ``since_start``, none an earlier run
        sent either (those went before this writer started): a check of what the server
        holds, made earlier, can miss one still running there, and the resend it allows
        then lands twice. Cancellable: a shutdown does not wait for it."""
        deadline = self._in_flight.get(name, -math.inf)
        if since_start:
            deadline = max(deadline, self._started + self.config.max_inflight_s)
        wait = deadline - self._clock()
        if wait > 0:
            self.counts["inflight_waits"] += 1
            log.info("honcho_inflight_wait", session=name, wait_s=round(wait, 3))
            await self._sleep(wait)
        # The session's calls never overlap, so nothing was sent to it meanwhile.
        self._in_flight.pop(name, None)

    def _note_failure(self, session: str, turns: Sequence[Turn], f: CallFailed) -> None:
        log.warning("honcho_batch_failed", session=session, turns=len(turns), reason=f.reason,
                    permanent=f.permanent)

    @staticmethod
    def _groups(units: list[Unit]) -> list[list[Unit]]:
        """Whole turns packed into calls of at most 100 messages (a longer turn alone)."""
        groups: list[list[Unit]] = []
        size = MAX_MESSAGES_PER_CALL + 1
        for u in units:
            n = len(u.msgs)
            if not n:
                continue
            if size + n > MAX_MESSAGES_PER_CALL:
                groups.append([])
                size = 0
            groups[-1].append(u)
            size += n
        return groups

    async def _send_group(self, session: Any, group: list[Unit]) -> None:
        msgs = [m for u in group for m in u.msgs]
        for i in range(0, len(msgs), MAX_MESSAGES_PER_CALL):
            try:
                await self._send(session, msgs[i:i + MAX_MESSAGES_PER_CALL])
            except CallFailed as f:
                f.sent = f.sent or i > 0  # part of the group went out: the group was tried
                raise

    async def _send(self, session: Any, msgs: list[Msg]) -> None:
        """One ``add_messages`` call, retried; a retry after an unknown outcome first waits
        until the earlier requests can no longer commit, then asks the server which of
        these messages it already holds, and sends only the others.

        Raises:
            CallFailed: the batch was refused, or not written after max_attempts.
        """
        pending = msgs
        unknown = False
        attempt = 0
        while True:
            attempt += 1
            try:
                if unknown:
                    await self._settle(session.id)
                    self.counts["dedupe_checks"] += 1
                    present = await self._present(session, sorted({m.key for m in pending}))
                    unknown = False
                    before = len(pending)
                    pending = [m for m in pending if (m.key, m.pos) not in present]
                    self.counts["resend_skipped"] += before - len(pending)
                    if not pending:
                        return
                await self._add(session, pending)
                return
            except CallRetry as r:
                unknown = unknown or r.unknown
                await self.client.pause("add_messages", attempt, r)
            except CallFailed as f:
                # An earlier attempt went out and failed: the batch was tried, even when this
                # one was held back by the circuit that failure helped open.
                f.sent = f.sent or attempt > 1
                raise

    async def _add(self, session: Any, msgs: list[Msg]) -> None:
        """One attempt of ``add_messages``; one that got no answer is remembered as maybe
        still in flight (see ``_settle``).

        Raises:
            CallRetry, CallFailed: as ``HonchoClient.attempt``.
        """
        batch = [m.params for m in msgs]
        sent_at = self._clock()
        try:
            await self.client.attempt(
                "add_messages", functools.partial(session.aio.add_messages, batch))
        except CallRetry as r:
            if r.in_flight:
                self._sent_unanswered(session.id, sent_at)
            raise
        except anyio.get_cancelled_exc_class():
            self._sent_unanswered(session.id, sent_at)  # the request may be out, unanswered
            raise

    async def _present(self, session: Any, keys: Sequence[str]) -> set[tuple[str, int]]:
        """(turn key, index) of the session's messages that carry one of ``keys``.

        Raises:
            CallRetry, CallFailed: as ``HonchoClient.attempt``.
        """
        found: set[tuple[str, int]] = set()
        for i in range(0, len(keys), _KEYS_PER_LISTING):
            chunk = list(keys[i:i + _KEYS_PER_LISTING])
            filters = {"metadata": {KEY_FIELD: {"in": chunk}}}
            page = await self.client.attempt("list_messages", functools.partial(
                session.aio.messages, filters=filters, size=LIST_PAGE_SIZE))
            while page is not None:
                for m in page.items:
                    md = m.metadata or {}
                    index = md.get(INDEX_FIELD)
                    if isinstance(index, int):
                        found.add((str(md.get(KEY_FIELD)), index))
                if not page.has_next_page():
                    break
                page = await self.client.attempt("list_messages", page.get_next_page)
        return found

    async def _without_present(self, session: Any, units: list[Unit]) -> list[Unit]:
        """The units with the messages the server already holds taken out (retried)."""
        keys = sorted({u.turn.key for u in units if u.msgs})
        present = await self.client.retrying("list_messages",
                                       functools.partial(self._present, session, keys))
        if not present:
            return units
        kept = []
        for u in units:
            msgs = [m for m in u.msgs if (m.key, m.pos) not in present]
            self.counts["resend_skipped"] += len(u.msgs) - len(msgs)
            kept.append(u._replace(msgs=msgs))
        return kept

    async def _ensure_ready(self) -> None:
        """The workspace and the assistant peer exist (get-or-create, once per process)."""
        if self._ready:
            return
        async with self._ready_lock:
            if self._ready:
                return
            honcho = self.client.honcho()
            # aio.peer() first gets-or-creates the workspace (once per client), then the peer.
            await self.client.call("peer", lambda: honcho.aio.peer(self.mapper.assistant))
            self._ready = True

    async def _ensure_session(self, session: Any, users: set[str]) -> None:
        """The session exists with its peers' observation settings (once per session)."""
        if not self.config.configure_sessions:
            return
        known = self._sessions.get(session.id)
        honcho_sdk = sdk()
        c = self.config
        user_config = honcho_sdk.api_types.SessionPeerConfig(
            observe_me=c.user_observe_me, observe_others=c.user_observe_others)
        new = sorted(users - known) if known is not None else sorted(users)
        if known is None:
            peers = [(u, user_config) for u in new]
            peers.append((self.mapper.assistant, honcho_sdk.api_types.SessionPeerConfig(
                observe_me=c.assistant_observe_me, observe_others=c.assistant_observe_others)))
            honcho = self.client.honcho()
            await self.client.call("session", lambda: honcho.aio.session(session.id, peers=peers))
            self._sessions.put(session.id, {*new, self.mapper.assistant})
        elif new:
            added = [(u, user_config) for u in new]
            await self.client.call("add_peers", lambda: session.aio.add_peers(added))
            known.update(new)


def _superseded(units: list[Unit]) -> list[Unit]:
    """A session's ``units`` with no metadata call that a later call of theirs overwrites
    (a later snapshot, or the delete): its record counts as written with nothing sent. A host
    that describes its session at each turn start then costs one metadata call per write, not
    one per turn, and a backlog still goes out in batches. (Should the later call be refused
    for good, the dropped snapshot is lost with it: its dead letter, replayed, sends a newer.)"""
    out: list[Unit] = []
    later = False
    for u in reversed(units):
        if later and not u.msgs and u.action is not None and not u.action.delete:
            u = u._replace(action=None)
        later = later or u.action is not None
        out.append(u)
    out.reverse()
    return out


def _runs(units: list[Unit]) -> list[list[Unit]]:
    """``units`` cut after each one with an action: its call runs after the messages before
    it, and before those after it."""
    runs: list[list[Unit]] = [[]]
    for u in units:
        runs[-1].append(u)
        if u.action is not None:
            runs.append([])
    return [r for r in runs if r]
