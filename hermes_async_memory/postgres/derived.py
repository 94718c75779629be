"""What the PostgreSQL store derives from the records the backend writes: the tool-call log's
rows (in the write), and the work done later by shared jobs that worker processes on any
machine claim (``postgres.jobs``; the runner calls ``DERIVED_HANDLERS[job.kind]``).

**The tool-call log** means what the SQLite store's means (``store.tool_log``): each call of
a message's ``tool_calls``, matched by id with the first ``tool`` message after it in its
session (in its own record, or a later one before a closing message: a user message or the
model's reply), judged by the configured ``OutcomeRules`` with the same function
(``procedural.extract.judge``), with its record's first user message as its goal (else the
session's last one before it). SQLite does the extraction in SQL (its JSON functions, in C,
so a batch's commit runs without the GIL); ``call_rows`` is the same extraction in Python,
for the write that stages its turns' rows from their payloads anyway (the judge is Python on
both sides). Only the turns a write inserts log calls: a resend logs nothing. A call whose
record holds no answer for it is logged ``awaiting``; the write that brings its answer or a
closing message settles it (``settle_awaiting``), as does its session's end
(``CLOSE_ENDED``), and queues its user's job. An awaiting call is not a job's to mark.

**Jobs.** A write that logs calls queues ``procedural:<user>``; one that starts or ends a
session from a template queues ``template_stats:<name>``; a key is one job while it is
queued (``statements.ENQUEUE_JOBS``). Handlers are idempotent, as a job runs again when
its worker dies after the work and before completing it:

- ``procedural``: the user's calls still ``pending`` (logged, or settled, since the last run;
  not awaiting) are taken as SQLite takes a commit's batch: a success after a failure of
  the same tool (same user; same session for calls without a user) within the fix window,
  with other arguments, fixes the latest such failure not fixed yet, the first such
  success only. A call settled after later calls of its tool had been taken is marked as if
  in order: that tool's successes from it on, within the fix window, are taken again with
  the batch (SQLite's ``REFIX``). Then the user's count grows by them, and past the bound
  by a tenth the log is trimmed to the bound, oldest first (the count made exact: the calls
  no run has taken yet are counted by theirs). They stop being pending in that
  transaction: run again, it finds nothing to do. The batch is what is pending when the
  job runs, so two successes of separate writes can contend for one failure here where
  SQLite, committing them apart, would have given the second an older failure.
- ``template_stats``: the template's usage, successes and failures recounted from its
  sessions that were not detached by a delete, on top of the counts it came with.

A job gives up its key as it starts (``_RELEASE_KEY``), before it reads: a write that
found the key taken holds the job's row locked until it commits (``ENQUEUE_JOBS``), so
giving it up waits for that write, and the run reads what the write committed; a write
after that queues a new job. Runs of one key's work (a job run again after its lease ran
out while the first run still works) take a transaction-level advisory lock, one at a
time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from ..procedural.extract import GOAL_CHARS, RESULT_CHARS, Outcome, OutcomeRules, judge
from . import jobs

if TYPE_CHECKING:
    from asyncpg import Pool, Record
    from asyncpg.pool import PoolConnectionProxy

log = structlog.get_logger(__name__)

PROCEDURAL = "procedural"
TEMPLATE_STATS = "template_stats"

Handler = Callable[["Pool[Record]", jobs.Job], Awaitable[None]]

# A call row as staged (``statements.STAGE_CALL_COLUMNS`` without pos and turn key): the
# calling message's ordinal, call id, tool, arguments (JSON), result, ok, error type, error
# message, duration (ms), goal, awaiting its answer.
CallRow = tuple[int, str, str, str, str, bool, "str | None", "str | None", "float | None",
                "str | None", bool]
GOAL = 9  # a CallRow's goal

_NEVER_ANSWERED = Outcome(False, "no_result", "the call was never answered")
_AWAITING = Outcome(True)  # what an awaiting call holds until it is settled
_SUCCESS = Outcome(True)
# Valid JSON's tokens: its strings as written, and the runs between them and JSON's
# whitespace; joined, they are the text minified as SQLite's json() minifies it.
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[^ \t\n\r"]+')
_JSON_SPACE = " \t\n\r"
_COMPACT = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode
_QUOTE = json.JSONEncoder(ensure_ascii=False).encode


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# JSON as SQLite's json_valid takes it (NaN and Infinity are not JSON), read by the C
# scanner without json.loads' Python wrappers (as turns.Turn.decode reads records).
_scan: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder(
    parse_constant=_not_json).scan_once  # type: ignore[attr-defined]
_NOT_JSON = object()


def _json(text: str) -> Any:
    """The value the JSON ``text`` holds, or ``_NOT_JSON``."""
    text = text.strip(_JSON_SPACE)
    try:
        value, end = _scan(text, 0)
    except (StopIteration, ValueError, RecursionError):
        return _NOT_JSON
    return value if end == len(text) else _NOT_JSON


def procedural_job(user_id: str, max_per_user: int, fix_window_s: float) -> tuple[str, str]:
    """The key and payload of the procedural job of ``user_id`` ('' for turns without a
    user)."""
    return (f"{PROCEDURAL}:{user_id}", json.dumps(
        {"user_id": user_id, "max_per_user": int(max_per_user),
         "fix_window_s": float(fix_window_s)}, separators=(",", ":")))


def template_stats_job(name: str) -> tuple[str, str]:
    """The key and payload of the stats job of the template ``name``."""
    return f"{TEMPLATE_STATS}:{name}", json.dumps({"name": name}, separators=(",", ":"))


# -- the tool-call log's rows ------------------------------------------------------------


def closing(role: str, calls: str | None) -> bool:
    """Whether a message closes the calls before it still awaiting their answer (a user
    message, or the model's reply: an assistant message without tool calls), as
    ``store.tool_log`` says."""
    return role == "user" or (role == "assistant" and (calls is None or calls == "[]"))


def call_rows(messages: Sequence[Sequence[Any]], rules: OutcomeRules,
              goal_before: str | None = None) -> list[CallRow]:
    """The tool-call log's rows of one record, in order, as ``store.tool_log.INSERT_CALLS``
    and ``SETTLE`` make them in SQLite: each call with the first answer after it in the
    record; without one, never answered if a closing message follows it in the record, else
    awaiting (``settle_awaiting`` looks further). ``messages``: the record's message rows as
    ``turns.payload_rows`` gives them (session, key, ordinal, role, content, tool calls, tool
    call id, ...); the goal is its first user message, else ``goal_before`` (the session's
    last one before the record)."""
    answers: dict[str, list[tuple[int, str | None]]] = {}
    closers: list[int] = []
    goal: str | None = goal_before
    has_goal = False
    calling = []
    for k, m in enumerate(messages):
        role, content, calls, call_id = m[3], m[4], m[5], m[6]
        if role == "tool" and call_id is not None:
            answers.setdefault(call_id, []).append((k, content))
        elif role == "user" and not has_goal:
            has_goal = True
            goal = None if content is None else content[:GOAL_CHARS]
        if closing(role, calls):
            closers.append(k)
        if calls is not None:
            calling.append((k, m))
    rows: list[CallRow] = []
    judged: dict[int, Outcome] = {}
    for k, m in calling:
        for n, call in _entries(m[5]):
            if type(call) is not dict:
                continue
            function = call.get("function")
            if type(function) is not dict or type(function.get("name")) is not str:
                continue
            call_id = _sql_text(call.get("id"))
            if call_id is None:
                call_id = f"#{n}"
            found = next((a for a in answers.get(call_id, ()) if a[0] > k), None)
            awaiting = False
            if found is not None:
                answer = found[1] or ""
                outcome = judged.get(found[0]) or _judged(answer, rules)
                judged[found[0]] = outcome
                result = answer[:RESULT_CHARS]
            elif any(c > k for c in closers):
                outcome, result = _NEVER_ANSWERED, ""
            else:
                outcome, result, awaiting = _AWAITING, "", True
            rows.append((m[2], call_id, function["name"],
                         _arguments(function.get("arguments", None)), result, outcome.ok,
                         outcome.error_type, outcome.error_message, outcome.duration_ms,
                         goal, awaiting))
    return rows


# The awaiting calls of a write's sessions ($1), with the (turn, ordinal) of their message.
_AWAITING_CALLS = """
SELECT c.id, c.session_id, c.call_id, c.user_id, m.turn_key, m.ordinal
FROM tool_calls AS c JOIN messages AS m ON m.id = c.message_id
WHERE c.awaiting AND c.session_id = ANY($1::text[])
"""
# Settled: the answer's result and outcome (or never answered's); its user's job takes it.
_APPLY_SETTLED = """
UPDATE tool_calls AS c SET awaiting = false, pending = true, result = v.result, ok = v.ok,
    error_type = v.error_type, error_message = v.error_message, duration_ms = v.duration_ms
FROM unnest($1::bigint[], $2::text[], $3::boolean[], $4::text[], $5::text[],
            $6::float8[]) AS v(id, result, ok, error_type, error_message, duration_ms)
WHERE c.id = v.id
"""
# The session ($1) ended: its calls still awaiting were never answered. Returns their users.
CLOSE_ENDED = f"""
UPDATE tool_calls SET awaiting = false, pending = true, result = '', ok = false,
    error_type = '{_NEVER_ANSWERED.error_type}',
    error_message = '{_NEVER_ANSWERED.error_message}'
WHERE session_id = $1 AND awaiting
RETURNING user_id
"""
# Each session's ($1) last user message (its first $2 characters), before a write's.
LAST_GOALS = """
SELECT s.id, (SELECT left(m.content, $2) FROM messages AS m
              WHERE m.session_id = s.id AND m.role = 'user'
              ORDER BY m.seq DESC, m.ordinal DESC LIMIT 1)
FROM unnest($1::text[]) AS s(id)
"""
# A written message as settle_awaiting reads it: turn key, ordinal, role, content, tool
# calls, tool call id.
Written = tuple[str, int, str, "str | None", "str | None", "str | None"]


async def last_goals(conn: PoolConnectionProxy[Record], sessions: Sequence[str]
                     ) -> dict[str, str | None]:
    """Each session's last user message before this write (its goal's characters)."""
    return {r[0]: r[1] for r in await conn.fetch(LAST_GOALS, list(sessions), GOAL_CHARS)}


async def settle_awaiting(conn: PoolConnectionProxy[Record],
                          written: Mapping[str, Sequence[Written]], rules: OutcomeRules
                          ) -> set[str]:
    """Settle the calls of ``written``'s sessions awaiting their answer (SQLite's ``SETTLE``):
    with the first answer after the call among the messages this write inserted (each
    session's, in order), unless a closing message comes first; as never answered once one
    follows. Returns the users whose calls were settled (their jobs mark them)."""
    if not written:
        return set()
    found = await conn.fetch(_AWAITING_CALLS, list(written))
    if not found:
        return set()
    places = {sid: {(m[0], m[1]): k for k, m in enumerate(messages)}
              for sid, messages in written.items()}
    judged: dict[tuple[str, int], Outcome] = {}
    settled: list[tuple[int, str, bool, str | None, str | None, float | None]] = []
    users: set[str] = set()
    for r in found:
        messages = written[r["session_id"]]
        start = places[r["session_id"]].get((r["turn_key"], r["ordinal"]), -1) + 1
        for k in range(start, len(messages)):
            _, _, role, content, calls, call_id = messages[k]
            if role == "tool" and call_id == r["call_id"]:
                answer = content or ""
                outcome = judged.get((r["session_id"], k)) or _judged(answer, rules)
                judged[r["session_id"], k] = outcome
                result = answer[:RESULT_CHARS]
                break
            if closing(role, calls):
                outcome, result = _NEVER_ANSWERED, ""
                break
        else:
            continue
        settled.append((r["id"], result, outcome.ok, outcome.error_type,
                        outcome.error_message, outcome.duration_ms))
        users.add(r["user_id"])
    if settled:
        await conn.execute(_APPLY_SETTLED, *(list(c) for c in zip(*settled, strict=True)))
    return users


def _entries(calls: str) -> Any:
    """What SQLite's ``json_each`` walks in a message's tool calls: an array's items by
    index, an object's members by name; nothing for text that is not JSON or a scalar."""
    doc = _json(calls)
    if type(doc) is list:
        return enumerate(doc)
    if type(doc) is dict:
        return doc.items()
    return ()


def _judged(content: str, rules: OutcomeRules) -> Outcome:
    """``judge``, as SQLite's outcome function calls it: it never fails the batch (an answer
    it cannot judge is a success, logged)."""
    try:
        return judge(content, rules)
    except Exception:  # a bug in a rule must not fail the turns' write
        log.error("tool_outcome_failed", exc_info=True)
        return _SUCCESS


def _arguments(value: Any) -> str:
    """The arguments as SQLite's log keeps them: JSON text minified as written, other text
    quoted as a JSON string, none (or null) as ``{}``, a JSON value as compact JSON."""
    if value is None:
        return "{}"
    if type(value) is str:
        if _json(value) is _NOT_JSON:
            return str(_QUOTE(value))
        return "".join(_JSON_TOKENS.findall(value))
    return str(_COMPACT(value))


def _sql_text(value: Any) -> str | None:
    """A JSON value as SQLite's ``->>`` hands it to a text column."""
    if value is None or type(value) is str:
        return value
    if type(value) is bool:
        return "1" if value else "0"
    if type(value) is int and -(2**63) <= value < 2**63:
        return str(value)
    if type(value) in (int, float):
        text = f"{float(value):.15g}"  # SQLite's REAL as text: 15 digits, with a point
        mantissa, e, exponent = text.partition("e")
        if "." not in mantissa and mantissa.lstrip("-").isdigit():
            mantissa += ".0"
        return mantissa + (f"e{exponent}" if e else "")
    return str(_COMPACT(value))


# -- the jobs ------------------------------------------------------------------------------

# The job no longer holds its key: a write from now on queues a new one (module doc).
_RELEASE_KEY = "UPDATE jobs SET key = NULL WHERE id = $1 AND key IS NOT NULL"
_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))"
# The user's calls logged (or settled) since the last run, locked: this run's batch.
_PENDING = ("SELECT id FROM tool_calls WHERE user_id = $1 AND pending AND NOT awaiting "
            "ORDER BY id FOR UPDATE")
# store.tool_log.REFIX: the successes whose fixes are marked again with the batch ($1; $2
# the user, $3 the window): per tool (and session, without a user), those from the batch's
# first call on, up to the window after its latest; taken by an earlier run, or the batch's.
# Without a call settled late, the batch's own.
_REFIX = """
SELECT t.id FROM (
    SELECT tool, CASE WHEN user_id = '' THEN session_id END AS sid, min(id) AS m,
           max(at) AS top
    FROM tool_calls WHERE id = ANY($1::bigint[]) GROUP BY 1, 2
) AS g JOIN tool_calls AS t ON t.user_id = $2 AND t.tool = g.tool AND t.id >= g.m
WHERE t.ok AND NOT t.awaiting AND t.at <= g.top + $3
  AND (g.sid IS NULL OR t.session_id = g.sid) AND (NOT t.pending OR t.id = ANY($1::bigint[]))
"""
_UNFIX = (
    """UPDATE tool_calls SET fixed_by = NULL WHERE id IN (
        SELECT fixes FROM tool_calls WHERE id = ANY($1::bigint[]) AND fixes IS NOT NULL)""",
    "UPDATE tool_calls SET fixes = NULL WHERE id = ANY($1::bigint[]) AND fixes IS NOT NULL",
)
# store.tool_log.MARK_FIXES, for the batch's ids ($1; $2 the user, $3 the window).
_MARK_FIXES = (
    """UPDATE tool_calls AS s SET fixes = (
        SELECT f.id FROM tool_calls AS f
        WHERE f.user_id = s.user_id AND f.tool = s.tool AND NOT f.ok
          AND f.fixed_by IS NULL AND f.id < s.id AND f.at >= s.at - $3
          AND (f.user_id <> '' OR f.session_id = s.session_id)
          AND f.arguments IS DISTINCT FROM s.arguments
        ORDER BY f.id DESC LIMIT 1)
    WHERE s.id = ANY($1::bigint[]) AND s.user_id = $2 AND s.ok AND s.fixes IS NULL""",
    """UPDATE tool_calls AS t SET fixed_by = v.first
    FROM (SELECT fixes, min(id) AS first FROM tool_calls
          WHERE id = ANY($1::bigint[]) AND user_id = $2 AND fixes IS NOT NULL
          GROUP BY fixes) AS v
    WHERE t.id = v.fixes""",
    """UPDATE tool_calls AS s SET fixes = NULL
    WHERE s.id = ANY($1::bigint[]) AND s.user_id = $2 AND s.fixes IS NOT NULL
      AND s.id IS DISTINCT FROM (SELECT f.fixed_by FROM tool_calls AS f WHERE f.id = s.fixes)""",
)
_DONE = "UPDATE tool_calls SET pending = false WHERE id = ANY($1::bigint[])"
_COUNT = """
INSERT INTO tool_log_counts (user_id, n) VALUES ($1, $2)
ON CONFLICT (user_id) DO UPDATE SET n = tool_log_counts.n + excluded.n
RETURNING n
"""
# store.tool_log.TRIM: the user's newest $2 calls stay, and the count is made exact.
_TRIM = """
DELETE FROM tool_calls WHERE user_id = $1 AND id <= (
    SELECT x.id FROM tool_calls AS x WHERE x.user_id = $1 ORDER BY x.id DESC
    LIMIT 1 OFFSET $2)
"""
_RECOUNT = ("UPDATE tool_log_counts SET n = (SELECT count(*) FROM tool_calls "
            "WHERE user_id = $1 AND NOT pending) WHERE user_id = $1")
# The template's counts: what it came with, and its sessions a delete did not detach.
_TEMPLATE_STATS = """
UPDATE templates AS t SET usage_count = t.base_usage + s.used,
    successes = t.base_successes + s.ok, failures = t.base_failures + s.failed,
    updated_at = greatest(t.updated_at, s.latest)
FROM (SELECT count(*) AS used, count(*) FILTER (WHERE ok) AS ok,
             count(*) FILTER (WHERE NOT ok) AS failed,
             max(greatest(started_at, ended_at)) AS latest
      FROM template_sessions WHERE template = $1 AND NOT detached) AS s
WHERE t.name = $1
"""


async def handle_procedural(pool: Pool[Record], job: jobs.Job) -> None:
    """Mark the fixes among a user's calls logged since the last run, count them, and trim
    the user's log past its bound (module doc). Idempotent.

    Raises:
        ValueError, KeyError, TypeError: the payload is not a procedural job's.
        asyncpg.PostgresError, OSError: the database failed (nothing of the run is kept).
    """
    doc = json.loads(job.payload)
    user, limit, window = str(doc["user_id"]), int(doc["max_per_user"]), float(
        doc["fix_window_s"])
    async with pool.acquire() as conn:
        await conn.execute(_RELEASE_KEY, job.id)
        async with conn.transaction():
            await conn.execute(_LOCK, f"{PROCEDURAL}:{user}")
            ids = [r["id"] for r in await conn.fetch(_PENDING, user)]
            if not ids:
                return
            marked = [r["id"] for r in await conn.fetch(_REFIX, ids, user, window)]
            for statement in _UNFIX:
                await conn.execute(statement, marked)
            find, link, unlink = _MARK_FIXES
            await conn.execute(find, marked, user, window)
            await conn.execute(link, marked, user)
            await conn.execute(unlink, marked, user)
            await conn.execute(_DONE, ids)
            n = await conn.fetchval(_COUNT, user, len(ids))
            trimmed = 0
            if n > limit + max(1, limit // 10):
                status = await conn.execute(_TRIM, user, limit)
                trimmed = int(status.rsplit(" ", 1)[-1])
                await conn.execute(_RECOUNT, user)
    log.info("procedural_job", job=job.id, calls=len(ids), trimmed=trimmed)


async def handle_template_stats(pool: Pool[Record], job: jobs.Job) -> None:
    """Recount a template's usage, successes and failures from its sessions (module doc).
    Idempotent; nothing to do for a template that is no longer stored.

    Raises:
        ValueError, KeyError, TypeError: the payload is not a stats job's.
        asyncpg.PostgresError, OSError: the database failed.
    """
    name = str(json.loads(job.payload)["name"])
    async with pool.acquire() as conn:
        await conn.execute(_RELEASE_KEY, job.id)
        async with conn.transaction():
            await conn.execute(_LOCK, f"{TEMPLATE_STATS}:{name}")
            await conn.execute(_TEMPLATE_STATS, name)


DERIVED_HANDLERS: dict[str, Handler] = {
    PROCEDURAL: handle_procedural,
    TEMPLATE_STATS: handle_template_stats,
}
