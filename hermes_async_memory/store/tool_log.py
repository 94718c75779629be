"""The tool-call log (procedural memory): what a batch's turns add to ``tool_calls``, and the
reads of it.

A turn's tool calls are logged in the transaction that commits the turn, from the message rows
it just inserted: an assistant message's ``tool_calls`` entries, each matched by id with the
``tool`` message of the same turn that answered it. So a logged call is exactly as durable as
its turn, and is logged once (``UNIQUE (message_id, call_id)``; a turn commits once). The
answer is judged a success or a failure by ``hm_tool_outcomes``, a function the writer
connection registers with the configured ``OutcomeRules`` (``procedural.extract.judge``); it
never raises, so no tool answer can fail its batch.

In the same transaction: a success that follows a failure of the same tool (same user; same
session for a turn without a user) within the fix window, with other arguments, is recorded as
that failure's fix, the first such success only; and each user's log is trimmed to its
bound, oldest first, once it passes the bound by a tenth (a trim walks the bound's length of
index).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import structlog

from ..procedural.extract import OutcomeRules, judge

log = structlog.get_logger(__name__)

_LIKE_ESCAPE = re.compile(r"[\\%_]")  # LIKE's wildcards and its escape character

OUTCOME_FUNCTION = "hm_tool_outcomes"

# The batch's tool answers (the first tool message of a turn with a call's id) and goals
# (each turn's first user message) go through temporary tables with real indexes, so every
# call finds its answer and goal by key: as CTEs the plan depended on the planner choosing
# automatic indexes, and looked up by session, an answer scan covered a session's whole share
# of the batch per call (quadratic when a batch holds many turns of few sessions). The
# answers are judged in ONE call of the outcome function per batch (all of them as a JSON
# array): called per row, each call took the GIL back from a busy event loop, which holds it
# up to the switch interval (5 ms), and a batch of 2,000 turns with five calls each took
# minutes.
TEMP_TABLES = """
CREATE TEMP TABLE IF NOT EXISTS tool_answers (
    i INTEGER PRIMARY KEY, turn_key TEXT NOT NULL, tool_call_id TEXT NOT NULL,
    id INTEGER NOT NULL, content TEXT, UNIQUE (turn_key, tool_call_id));
CREATE TEMP TABLE IF NOT EXISTS tool_outcomes (i INTEGER PRIMARY KEY, o TEXT NOT NULL);
CREATE TEMP TABLE IF NOT EXISTS tool_goals (turn_key TEXT PRIMARY KEY, goal TEXT);
"""
INSERT_CALLS = """
DELETE FROM temp.tool_answers;
DELETE FROM temp.tool_outcomes;
DELETE FROM temp.tool_goals;
INSERT INTO temp.tool_answers (turn_key, tool_call_id, id, content)
SELECT t.turn_key, t.tool_call_id, min(t.id), t.content FROM messages AS t
WHERE {t_new} AND t.role = 'tool' AND t.tool_call_id IS NOT NULL
GROUP BY t.turn_key, t.tool_call_id
ORDER BY min(t.id);
INSERT INTO temp.tool_outcomes (i, o)
SELECT e.key + 1, e.value
FROM json_each(hm_tool_outcomes((SELECT json_group_array(content)
                                 FROM (SELECT content FROM temp.tool_answers ORDER BY i))))
     AS e
WHERE e.type = 'array';
INSERT INTO temp.tool_goals (turn_key, goal)
SELECT g.turn_key, substr(g.content, 1, 500) FROM messages AS g
WHERE {g_new} AND g.role = 'user'
ORDER BY g.id
ON CONFLICT (turn_key) DO NOTHING;
INSERT INTO tool_calls (message_id, call_id, session_id, user_id, tool, arguments, result,
                        ok, error_type, error_message, duration_ms, goal, at)
SELECT message_id, call_id, session_id, user_id, tool, arguments, result,
       CASE WHEN answered IS NULL THEN 0 WHEN o IS NULL THEN 1 ELSE o ->> 0 END,
       CASE WHEN answered IS NULL THEN 'no_result' WHEN o IS NOT NULL THEN o ->> 1 END,
       CASE WHEN answered IS NULL THEN 'the call was never answered'
            WHEN o IS NOT NULL THEN o ->> 2 END,
       CASE WHEN o IS NOT NULL THEN o ->> 3 END,
       goal, at
FROM (
    -- A plain success has no outcome row: no JSON is read for it.
    SELECT c.*, coalesce(substr(a.content, 1, 500), '') AS result, a.id AS answered,
           x.o, g.goal
    FROM (
        SELECT m.id AS message_id, m.turn_key, m.session_id,
               coalesce(m.user_id, '') AS user_id, m.timestamp AS at, e.key AS n,
               coalesce(e.value ->> '$.id', '#' || e.key) AS call_id,
               e.value ->> '$.function.name' AS tool,
               CASE json_type(e.value, '$.function.arguments')
                   WHEN 'text' THEN iif(json_valid(e.value ->> '$.function.arguments'),
                                        json(e.value ->> '$.function.arguments'),
                                        json_quote(e.value ->> '$.function.arguments'))
                   WHEN 'null' THEN '{{}}'
                   ELSE coalesce(e.value -> '$.function.arguments', '{{}}')
               END AS arguments
        FROM messages AS m,
             json_each(iif(json_valid(m.tool_calls), m.tool_calls, '[]')) AS e
        -- e.type first: no path is read from a value that is not an object (a malformed
        -- JSON error would fail the batch).
        WHERE {m_new} AND m.tool_calls IS NOT NULL
          AND CASE WHEN e.type = 'object'
                   THEN json_type(e.value, '$.function.name') = 'text' END
    ) AS c
    LEFT JOIN temp.tool_answers AS a ON a.turn_key = c.turn_key AND a.tool_call_id = c.call_id
    LEFT JOIN temp.tool_outcomes AS x ON x.i = a.i
    LEFT JOIN temp.tool_goals AS g ON g.turn_key = c.turn_key
)
WHERE true
ORDER BY message_id, n
ON CONFLICT (message_id, call_id) DO NOTHING;
"""
# A success after a failure of the same tool, same user (or session, without a user), within
# the window and with other arguments fixes the latest such failure not yet fixed; when two
# of the batch's successes find the same failure, the first one keeps it. The batch's rows
# are read once by their range (a min() over all of them walked the whole log, per failure).
MARK_FIXES = """
UPDATE tool_calls SET fixes = (
    SELECT f.id FROM tool_calls AS f
    WHERE f.user_id = tool_calls.user_id AND f.tool = tool_calls.tool AND f.ok = 0
      AND f.fixed_by IS NULL AND f.id < tool_calls.id AND f.at >= tool_calls.at - {window}
      AND (f.user_id != '' OR f.session_id = tool_calls.session_id)
      AND f.arguments IS NOT tool_calls.arguments
    ORDER BY f.id DESC LIMIT 1)
WHERE {new} AND ok = 1 AND fixes IS NULL;
WITH w AS MATERIALIZED (SELECT id, fixes FROM tool_calls WHERE {new} AND fixes IS NOT NULL)
UPDATE tool_calls SET fixed_by = v.first
FROM (SELECT fixes, min(id) AS first FROM w GROUP BY fixes) AS v
WHERE tool_calls.id = v.fixes;
UPDATE tool_calls SET fixes = NULL
WHERE {new} AND fixes IS NOT NULL
  AND id IS NOT (SELECT f.fixed_by FROM tool_calls AS f WHERE f.id = tool_calls.fixes);
"""
# Each user's log keeps its newest {limit} calls; a user's count is kept beside it, and the
# trim (a walk of {limit} index entries) runs once the count passes the bound by a tenth.
TRIM = """
WITH b AS MATERIALIZED (SELECT user_id FROM tool_calls WHERE {new})
INSERT INTO tool_log_counts (user_id, n)
SELECT user_id, count(*) FROM b WHERE true GROUP BY user_id
ON CONFLICT (user_id) DO UPDATE SET n = tool_log_counts.n + excluded.n;
WITH b AS MATERIALIZED (SELECT user_id FROM tool_calls WHERE {new})
DELETE FROM tool_calls WHERE id IN (
    SELECT t.id FROM tool_log_counts AS c JOIN tool_calls AS t ON t.user_id = c.user_id
    WHERE c.user_id IN (SELECT user_id FROM b)
      AND c.n > {limit} + {slack}
      AND t.id <= (SELECT x.id FROM tool_calls AS x WHERE x.user_id = c.user_id
                   ORDER BY x.id DESC LIMIT 1 OFFSET {limit}));
UPDATE tool_log_counts SET n = (SELECT count(*) FROM tool_calls
                                WHERE tool_calls.user_id = tool_log_counts.user_id)
WHERE n > {limit} + {slack};
"""


class ToolLogConfig(NamedTuple):
    """What the writer's commits do with tool calls (``Settings``' tool_log fields)."""

    rules: OutcomeRules
    max_per_user: int
    fix_window_s: float


def log_statements(config: ToolLogConfig, mine: Callable[[str], str]) -> list[str]:
    """The statements that log a batch's tool calls, given ``mine(column)``: the SQL
    condition that ``column`` is the id of one of the batch's messages."""
    return _statements(config, lambda alias: mine(f"{alias}.id"), mine("message_id"))


def range_log_statements(config: ToolLogConfig, after: int, upto: int) -> list[str]:
    """The statements that log the tool calls of the messages with ids in (after, upto], a
    run of whole turns (the backfill of turns committed before the log existed)."""
    def messages(alias: str) -> str:
        return f"{alias}.id > {int(after)} AND {alias}.id <= {int(upto)}"
    return _statements(config, messages,
                       f"message_id > {int(after)} AND message_id <= {int(upto)}")


def session_log_statements(config: ToolLogConfig, session_literal: str) -> list[str]:
    """The statements that log the tool calls of a whole session (an imported one, whose
    message ids are its own): calls already logged stay as they are."""
    return _statements(config, lambda alias: f"{alias}.session_id = {session_literal}",
                       f"session_id = {session_literal}")


def _statements(config: ToolLogConfig, messages: Callable[[str], str], new: str
                ) -> list[str]:
    """``messages(alias)``: the SQL condition on the messages to log; ``new``: the same on
    the log's rows (its ``message_id`` or ``session_id``)."""
    limit = int(config.max_per_user)
    return [
        INSERT_CALLS.format(m_new=messages("m"), g_new=messages("g"), t_new=messages("t")),
        MARK_FIXES.format(new=new, s_new="s." + new,
                          window=repr(float(config.fix_window_s))),
        TRIM.format(new=new, limit=limit, slack=max(1, limit // 10)),
    ]


def outcome_function(rules: OutcomeRules) -> Any:
    """``hm_tool_outcomes(answers)``: for a JSON array of tools' answers (texts, or null),
    the JSON array of their ``[ok, error_type, error_message, duration_ms]``, null for a
    success with no duration (most answers: the statement then reads no JSON for them). It
    never raises (an exception from a user function aborts its statement, and with it the
    batch of turns): an answer it cannot judge is a success, logged."""

    def hm_tool_outcomes(answers: Any) -> str:
        try:
            contents = json.loads(answers) if isinstance(answers, str) else []
        except ValueError:
            log.error("tool_outcomes_unreadable", exc_info=True)
            return "[]"
        out = []
        for content in contents if isinstance(contents, list) else []:
            try:
                o = judge(content if content is not None else "", rules)
                out.append(None if o.ok and o.duration_ms is None else
                           [int(o.ok), o.error_type, o.error_message, o.duration_ms])
            except Exception:  # a bug in a rule must not fail the turns' commit
                log.error("tool_outcome_failed", exc_info=True)
                out.append(None)
        return json.dumps(out)

    return hm_tool_outcomes


class CallRow(NamedTuple):
    id: int
    call_id: str
    tool: str
    arguments: str
    result: str
    ok: int
    error_type: str | None
    error_message: str | None
    duration_ms: float | None
    session_id: str
    user_id: str
    goal: str | None
    at: float
    fixed_by: int | None
    fixes: int | None


_CALL_COLUMNS = ("id, call_id, tool, arguments, result, ok, error_type, error_message, "
                 "duration_ms, session_id, user_id, goal, at, fixed_by, fixes")


class ToolLog:
    """Reads of the tool-call log. ``user_id`` '' is the calls of turns without a user."""

    reader: Any  # from Connections

    async def tool_totals(self, user_id: str, tools: Sequence[str] | None = None
                          ) -> list[tuple[str, int, int, float | None, float]]:
        """(tool, calls, successes, average duration ms, last at) per tool."""
        where, params = _user_tools(user_id, tools)
        async with self.reader() as db, db.execute(
            f"SELECT tool, count(*), sum(ok), avg(duration_ms), max(at) FROM tool_calls "
            f"WHERE {where} GROUP BY tool ORDER BY count(*) DESC, tool", params) as cur:
            return [tuple(r) for r in await cur.fetchall()]

    async def tool_errors(self, user_id: str, tool: str, limit: int
                          ) -> list[tuple[str, int, int]]:
        """(error type, count, latest failing call's id) of a tool's failures, most frequent
        first."""
        async with self.reader() as db, db.execute(
            "SELECT coalesce(error_type, 'error'), count(*), max(id) FROM tool_calls "
            "WHERE user_id = ? AND tool = ? AND ok = 0 GROUP BY 1 "
            "ORDER BY count(*) DESC, max(id) DESC LIMIT ?", (user_id, tool, limit)) as cur:
            return [tuple(r) for r in await cur.fetchall()]

    async def tool_calls_by_id(self, ids: Sequence[int]) -> list[CallRow]:
        if not ids:
            return []
        marks = ",".join("?" * len(ids))
        async with self.reader() as db, db.execute(
            f"SELECT {_CALL_COLUMNS} FROM tool_calls WHERE id IN ({marks})",
                tuple(ids)) as cur:
            return [CallRow(*r) for r in await cur.fetchall()]

    async def tool_call_search(
        self, user_id: str, *, tools: Sequence[str] | None = None, ok: bool | None = None,
        error_type: str | None = None, text: str | None = None, fixed: bool | None = None,
        session_id: str | None = None, limit: int = 20,
    ) -> list[CallRow]:
        """The newest calls that match, newest first. ``text`` is a substring of the
        arguments, result, error message or goal (case-insensitive for ASCII)."""
        where, params = _user_tools(user_id, tools)
        if ok is not None:
            where += " AND ok = ?"
            params.append(int(ok))
        if error_type is not None:
            where += " AND error_type = ?"
            params.append(error_type)
        if fixed is not None:
            where += " AND fixed_by IS NOT NULL" if fixed else " AND fixed_by IS NULL"
        if session_id is not None:
            where += " AND session_id = ?"
            params.append(session_id)
        if text:
            like = "%" + _LIKE_ESCAPE.sub(r"\\\g<0>", text) + "%"
            where += (" AND (arguments LIKE ? ESCAPE '\\' OR result LIKE ? ESCAPE '\\'"
                      " OR error_message LIKE ? ESCAPE '\\' OR goal LIKE ? ESCAPE '\\')")
            params += [like] * 4
        async with self.reader() as db, db.execute(
            f"SELECT {_CALL_COLUMNS} FROM tool_calls WHERE {where} ORDER BY id DESC LIMIT ?",
                (*params, limit)) as cur:
            return [CallRow(*r) for r in await cur.fetchall()]


def _user_tools(user_id: str, tools: Sequence[str] | None) -> tuple[str, list[Any]]:
    params: list[Any] = [user_id]
    where = "user_id = ?"
    if tools:
        where += f" AND tool IN ({','.join('?' * len(tools))})"
        params += list(tools)
    return where, params
