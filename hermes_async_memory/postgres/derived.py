"""What the PostgreSQL store derives from the records the backend writes: the tool-call log's
rows (in the write), and the work done later by shared jobs that worker processes on any
machine claim (``postgres.jobs``; the runner calls ``DERIVED_HANDLERS[job.kind]``).

**The tool-call log** means what the SQLite store's means (``store.tool_log``): each call of
a message's ``tool_calls``, matched by id with the first ``tool`` message of its turn that
answered it, judged by the configured ``OutcomeRules`` with the same function
(``procedural.extract.judge``), with the turn's first user message as its goal. SQLite
does the extraction in SQL (its JSON functions, in C, so a batch's commit runs without the
GIL); ``call_rows`` is the same extraction in Python, for the write that stages its turns'
rows from their payloads anyway (the judge is Python on both sides). Only the turns a write
inserts log calls: a resend logs nothing.

**Jobs.** A write that logs calls queues ``procedural:<user>``; one that starts or ends a
session from a template queues ``template_stats:<name>``; a key is one job while it is
queued (``statements.ENQUEUE_JOBS``). Handlers are idempotent, as a job runs again when
its worker dies after the work and before completing it:

- ``procedural``: the user's calls still ``pending`` (logged since the last run) are taken
  as SQLite takes a commit's batch: a success after a failure of the same tool (same user;
  same session for calls without a user) within the fix window, with other arguments,
  fixes the latest such failure not fixed yet, the first such success only; then the
  user's count grows by them, and past the bound by a tenth the log is trimmed to the
  bound, oldest first. They stop being pending in that transaction: run again, it finds
  nothing to do. The batch is what is pending when the job runs, so two successes of
  separate writes can contend for one failure here where SQLite, committing them
  apart, would have given the second an older failure.
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
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from ..procedural.extract import GOAL_CHARS, RESULT_CHARS, Outcome, OutcomeRules, judge
from . import jobs

if TYPE_CHECKING:
    from asyncpg import Pool, Record

log = structlog.get_logger(__name__)

PROCEDURAL = "procedural"
TEMPLATE_STATS = "template_stats"

Handler = Callable[["Pool[Record]", jobs.Job], Awaitable[None]]

# A call row as staged (``statements.STAGE_CALL_COLUMNS`` without pos and turn key): the
# calling message's ordinal, call id, tool, arguments (JSON), result, ok, error type, error
# message, duration (ms), goal.
CallRow = tuple[int, str, str, str, str, bool, "str | None", "str | None", "float | None",
                "str | None"]

_NEVER_ANSWERED = Outcome(False, "no_result", "the call was never answered")
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


def call_rows(messages: Sequence[Sequence[Any]], rules: OutcomeRules) -> list[CallRow]:
    """The tool-call log's rows of one turn, in order, as ``store.tool_log.INSERT_CALLS``
    makes them in SQLite. ``messages``: the turn's message rows as ``turns.payload_rows``
    gives them (session, key, ordinal, role, content, tool calls, tool call id, ...)."""
    answers: dict[str, str | None] = {}
    goal: str | None = None
    has_goal = False
    calling = []
    for m in messages:
        role, content, calls, call_id = m[3], m[4], m[5], m[6]
        if role == "tool" and call_id is not None:
            answers.setdefault(call_id, content)
        elif role == "user" and not has_goal:
            has_goal = True
            goal = None if content is None else content[:GOAL_CHARS]
        if calls is not None:
            calling.append(m)
    rows: list[CallRow] = []
    judged: dict[str, Outcome] = {}
    for m in calling:
        for n, call in _entries(m[5]):
            if type(call) is not dict:
                continue
            function = call.get("function")
            if type(function) is not dict or type(function.get("name")) is not str:
                continue
            call_id = _sql_text(call.get("id"))
            if call_id is None:
                call_id = f"#{n}"
            if call_id not in answers:
                outcome, result = _NEVER_ANSWERED, ""
            else:
                answer = answers[call_id] or ""
                outcome = judged.get(call_id) or _judged(answer, rules)
                judged[call_id] = outcome
                result = answer[:RESULT_CHARS]
            rows.append((m[2], call_id, function["name"],
                         _arguments(function.get("arguments", None)), result, outcome.ok,
                         outcome.error_type, outcome.error_message, outcome.duration_ms,
                         goal))
    return rows


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
# The user's calls logged since the last run, locked: this run's batch.
_PENDING = "SELECT id FROM tool_calls WHERE user_id = $1 AND pending ORDER BY id FOR UPDATE"
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
            "WHERE user_id = $1) WHERE user_id = $1")
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
            find, link, unlink = _MARK_FIXES
            await conn.execute(find, ids, user, window)
            await conn.execute(link, ids, user)
            await conn.execute(unlink, ids, user)
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
