"""The tool-call log (procedural memory): what a batch's turns add to ``tool_calls``, and the
reads of it.

A turn's tool calls are logged in the transaction that commits the turn, from the message rows
it just inserted: each entry of an assistant message's ``tool_calls``. So a logged call is
exactly as durable as its turn, and is logged once (``UNIQUE (message_id, call_id)``; a turn
commits once). A record is not always a whole turn: Hermes's session store appends one message
at a time, so a call and its answer may come in separate records, and commit in separate
batches. So:

- **The answer** of a call is the first ``tool`` message with its ``tool_call_id`` after it in
  the same session, wherever it comes: in the call's own record (the common case, looked up
  by key), in a later record of the same batch, or in a later batch. An answer from a later
  record counts only if it comes before the call was closed (below).
- **Awaiting.** A call whose record holds no answer after it is logged at once, as
  ``awaiting`` (``awaiting = 1``; ``ok`` 1 and no result until it is settled): no read counts
  it (stats, search, fixes, the prefetch block, templates' counts). Every commit that brings
  messages of its session settles it (``SETTLE``): with its answer, or as never answered.
  (While the store holds no awaiting call, a batch without tool calls skips this:
  ``AwaitingCalls``.)
- **Never answered** (``no_result``, a failure): once a ``user`` message or an ``assistant``
  message without tool calls (the model's reply: it was not waiting for the call any more)
  follows the call in its session without its answer before it, or the session ends. In
  OpenAI's format and Hermes's loop, a model is given every answer of its calls before it is
  asked again, so neither can come between a call and an answer still to come; a tool
  message of a later turn with a reused id does not answer an earlier turn's call. A whole
  turn (user, calls, answers, reply) is thus settled in its own commit, as before: an
  unanswered call of it is never answered. A call whose session neither goes on nor ends
  stays awaiting (it counts towards its user's bound, and is trimmed with the oldest).
- **Goal**: the call's record's first user message, else the session's last one before it.

The answers are judged a success or a failure by the configured ``OutcomeRules``
(``procedural.extract.judge``): the writer judges its batch's own answers on the event loop
(``sources.judge_all``) and hands the outcomes to its transaction; the answers a
commit finds in the store (a late answer, a call settled by a later record) are judged by
``hm_tool_outcomes``, a function the writer connection registers, called once per batch with
all of them. Neither raises, so no tool answer can fail its batch.

In the same transaction: a success that follows a failure of the same tool (same user; same
session for a turn without a user) within the fix window, with other arguments, is recorded as
that failure's fix, the first such success only (the batch's successes as one set: two that
find the same failure, the first keeps it). A call settled after later calls of its tool
(answered late, or closed as never answered) is marked as if it had settled in order: that
tool's successes from it on, within the fix window, lose their fixes and are marked again
with the batch's (``REFIX``), as a whole turn's calls are in its batch; so a session logs
the same calls, outcomes and fixes whether its messages come whole turn by whole turn or one
at a time, in whatever batches. Each user's log is trimmed to its bound, oldest first, once it
passes the bound by a tenth (a trim walks the bound's length of index).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import aiosqlite
import structlog

from ..procedural.extract import OutcomeRules, judge

log = structlog.get_logger(__name__)

_LIKE_ESCAPE = re.compile(r"[\\%_]")  # LIKE's wildcards and its escape character

OUTCOME_FUNCTION = "hm_tool_outcomes"
NEVER_ANSWERED = ("no_result", "the call was never answered")

# The calls awaiting their answer, by session and call id, with the message that made them:
# a commit finds its sessions' awaiting calls here (a few index entries, usually none).
# Made once the column exists (``prepare``).
INDEXES = """
CREATE INDEX IF NOT EXISTS idx_tool_calls_awaiting
    ON tool_calls(session_id, call_id, message_id) WHERE awaiting = 1;
"""

# The batch's tool answers (every tool message with a call id; and the answers SETTLE found
# for calls logged before) and goals (each turn's first user message) go through temporary
# tables with real indexes, so every call finds its answer and goal by key: as CTEs the plan
# depended on the planner choosing automatic indexes, and looked up by session, an answer scan
# covered a session's whole share of the batch per call (quadratic when a batch holds many
# turns of few sessions). An answer is found by (session, call id, the first id after the
# call's message). tool_answer_outcomes holds the outcome of each answer that is not a plain
# success, by the answer's message id. A writer's batch brings those of its own answers,
# judged on the event loop (``sources.judge_all``: by the read-ahead while the last batch
# commits, else as the batch is built), off the store's thread. The answers found in the store
# (and all of them where no batch judged them: a backfill, an import) are judged in ONE call
# of the outcome function (all of them as a JSON array, ``judge`` = 1): called per row, each
# call took the GIL back from a busy event loop, which holds it up to the switch interval
# (5 ms), and a batch of 2,000 turns with five calls each took minutes. tool_settled holds
# the awaiting calls a commit settles (answer: its message id, NULL: never answered),
# tool_refix the successes whose fixes are marked again.
TEMP_TABLES = """
CREATE TEMP TABLE IF NOT EXISTS tool_answers (
    i INTEGER PRIMARY KEY, session_id TEXT NOT NULL, tool_call_id TEXT NOT NULL,
    id INTEGER NOT NULL, turn_key TEXT NOT NULL, content TEXT, judge INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS temp.tool_answers_call
    ON tool_answers(session_id, tool_call_id, id);
CREATE TEMP TABLE IF NOT EXISTS tool_answer_outcomes (id INTEGER PRIMARY KEY, o TEXT NOT NULL);
CREATE TEMP TABLE IF NOT EXISTS tool_goals (turn_key TEXT PRIMARY KEY, goal TEXT);
CREATE TEMP TABLE IF NOT EXISTS tool_settled (
    id INTEGER PRIMARY KEY, answer INTEGER, session_id TEXT NOT NULL, call_id TEXT NOT NULL);
CREATE TEMP TABLE IF NOT EXISTS tool_refix (id INTEGER PRIMARY KEY);
CREATE TEMP TABLE IF NOT EXISTS tool_rows (
    message_id INTEGER NOT NULL, call_id TEXT NOT NULL, tool TEXT NOT NULL, arguments TEXT,
    answer INTEGER NOT NULL, ok INTEGER NOT NULL, error_type TEXT, error_message TEXT,
    duration_ms REAL, goal INTEGER NOT NULL);
"""
# The messages that close the calls before them still awaiting their answer: a user message,
# or the model's reply (an assistant message without tool calls).
_CLOSING = """(k.role = 'user' OR (k.role = 'assistant'
                                  AND (k.tool_calls IS NULL OR k.tool_calls = '[]')))"""
_NO_ID = "9223372036854775807"  # above every message id
# The calls of the batch's sessions awaiting their answer (logged by earlier commits: this
# runs before the batch's calls are), and what settles each: the first message after it in
# its session that is its answer or a closing message, whichever batch brought it (a batch
# that skipped this, see AwaitingCalls, is made up for). Before the answers are judged, so
# that those found are judged with the batch's.
SETTLE = """
DELETE FROM temp.tool_settled;
DELETE FROM temp.tool_refix;
INSERT INTO temp.tool_settled (id, answer, session_id, call_id)
SELECT r.id, iif(e.role = 'tool', e.id, NULL), r.session_id, r.call_id
FROM ({sessions}) AS s
JOIN tool_calls AS r ON r.session_id = s.sid AND r.awaiting = 1
JOIN messages AS e ON e.id = (
    SELECT k.id FROM messages AS k
    WHERE k.session_id = r.session_id AND k.id > r.message_id
      AND ((k.role = 'tool' AND k.tool_call_id = r.call_id) OR {closing})
    ORDER BY k.id LIMIT 1);
"""
# The session ended: its calls still awaiting are settled by what came (above), else never
# answered.
SETTLE_ENDED = SETTLE + """
INSERT OR IGNORE INTO temp.tool_settled (id, answer, session_id, call_id)
SELECT id, NULL, session_id, call_id FROM tool_calls
WHERE session_id = {session} AND awaiting = 1;
"""
# The answers to judge: the batch's (for its calls; with calls only) and those SETTLE found
# (not the batch's: those are in already). The function is not called without any.
ANSWERS = """
DELETE FROM temp.tool_answers;
DELETE FROM temp.tool_answer_outcomes;
"""
# judge: 0 where the batch brings its answers' outcomes ({judged}), else 1.
BATCH_ANSWERS = """
INSERT INTO temp.tool_answers (session_id, tool_call_id, id, turn_key, content, judge)
SELECT t.session_id, t.tool_call_id, t.id, t.turn_key, t.content, {judge} FROM messages AS t
WHERE {t_new} AND t.role = 'tool' AND t.tool_call_id IS NOT NULL
ORDER BY t.id;
"""
FOUND_ANSWERS = """
INSERT INTO temp.tool_answers (session_id, tool_call_id, id, turn_key, content, judge)
SELECT t.session_id, t.tool_call_id, t.id, t.turn_key, t.content, 1 FROM messages AS t
WHERE t.id IN (SELECT answer FROM temp.tool_settled) AND NOT {t_new}
ORDER BY t.id;
"""
# The outcomes a batch brings: a JSON array of [answer's message id, outcome].
JUDGED = """
INSERT INTO temp.tool_answer_outcomes (id, o)
SELECT e.value ->> 0, e.value -> 1 FROM json_each({judged}) AS e;
"""
# The answers to judge here come last (after the batch's, whose ``i`` come first), so the
# k-th of the function's outcomes is the answer at the first such ``i`` plus k.
JUDGE = """
INSERT INTO temp.tool_answer_outcomes (id, o)
SELECT a.id, e.value
FROM json_each(CASE WHEN EXISTS (SELECT 1 FROM temp.tool_answers WHERE judge)
                    THEN hm_tool_outcomes((SELECT json_group_array(content)
                                           FROM (SELECT content FROM temp.tool_answers
                                                 WHERE judge ORDER BY i))) END) AS e
JOIN temp.tool_answers AS a
    ON a.i = (SELECT min(i) FROM temp.tool_answers WHERE judge) + e.key
WHERE e.type = 'array';
"""
# The batch's calls, each settled as far as the batch can: with the first answer after it in
# its session (in its own turn; or in a later record, if no closing message comes between),
# else never answered once a closing message follows it, else awaiting. Its goal: the turn's
# first user message, else (a record without one: Hermes's session store appends message by
# message) the session's last user message before the call. A call answered in its own turn
# (the common case) reads no message: the closing messages are looked for only without.
INSERT_CALLS = """
DELETE FROM temp.tool_goals;
INSERT INTO temp.tool_goals (turn_key, goal)
SELECT g.turn_key, substr(g.content, 1, 500) FROM messages AS g
WHERE {g_new} AND g.role = 'user'
ORDER BY g.id
ON CONFLICT (turn_key) DO NOTHING;
INSERT INTO tool_calls (message_id, call_id, session_id, user_id, tool, arguments, result,
                        ok, error_type, error_message, duration_ms, goal, at, awaiting)
SELECT message_id, call_id, session_id, user_id, tool, arguments,
       CASE WHEN answer AND NOT closed THEN result ELSE '' END,
       CASE WHEN answer AND NOT closed THEN coalesce(o ->> 0, 1) WHEN closed THEN 0 ELSE 1 END,
       CASE WHEN answer AND NOT closed THEN o ->> 1 WHEN closed THEN {never_type} END,
       CASE WHEN answer AND NOT closed THEN o ->> 2 WHEN closed THEN {never_message} END,
       CASE WHEN answer AND NOT closed THEN o ->> 3 END,
       goal, at, NOT answer AND NOT closed
FROM (
    -- A plain success has no outcome row: no JSON is read for it. closed: a closing message
    -- comes after the call before its answer (the answer of its own turn is its answer).
    SELECT c.*, coalesce(substr(a.content, 1, 500), '') AS result, x.o,
           a.i IS NOT NULL AS answer,
           CASE WHEN a.turn_key IS c.turn_key THEN 0 ELSE EXISTS (
               SELECT 1 FROM messages AS k
               WHERE k.session_id = c.session_id AND k.id > c.message_id
                 AND k.id < coalesce(a.id, {no_id}) AND {closing}) END AS closed,
           CASE WHEN g.turn_key IS NOT NULL THEN g.goal ELSE (
               SELECT substr(u.content, 1, 500) FROM messages AS u
               WHERE u.session_id = c.session_id AND u.id < c.message_id AND u.role = 'user'
               ORDER BY u.id DESC LIMIT 1) END AS goal
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
    LEFT JOIN temp.tool_answers AS a ON a.i = (
        SELECT f.i FROM temp.tool_answers AS f
        WHERE f.session_id = c.session_id AND f.tool_call_id = c.call_id
          AND f.id > c.message_id
        ORDER BY f.id LIMIT 1)
    LEFT JOIN temp.tool_answer_outcomes AS x ON x.id = a.id
    LEFT JOIN temp.tool_goals AS g ON g.turn_key = c.turn_key
    -- OFFSET 0: not flattened into the outer query, which would copy closed (its subquery)
    -- into each column that reads it, each compiled (~0.1 ms a batch) and run again.
    LIMIT -1 OFFSET 0
)
WHERE true
ORDER BY message_id, n
ON CONFLICT (message_id, call_id) DO NOTHING;
"""
# The batch's calls where the writer worked out their rows on the loop (``tool_rows``: every
# call of the batch was answered in its own record, the common case): what INSERT_CALLS
# would insert, in the same order, from SQL values ({rows}): each call with the ids of its
# message, its answer and its goal (the record's first user message), and its answer's
# outcome. The texts are read from those messages, and the arguments minified, here as
# INSERT_CALLS does (None: none given).
LOG_ROWS = """
INSERT INTO temp.tool_rows (message_id, call_id, tool, arguments, answer, ok, error_type,
                            error_message, duration_ms, goal)
VALUES {rows};
INSERT INTO tool_calls (message_id, call_id, session_id, user_id, tool, arguments, result,
                        ok, error_type, error_message, duration_ms, goal, at, awaiting)
SELECT r.message_id, r.call_id, m.session_id, coalesce(m.user_id, ''), r.tool,
       CASE WHEN r.arguments IS NULL THEN '{{}}' WHEN json_valid(r.arguments)
            THEN json(r.arguments) ELSE json_quote(r.arguments) END,
       coalesce(substr(a.content, 1, 500), ''), r.ok, r.error_type, r.error_message,
       r.duration_ms, substr(g.content, 1, 500), m.timestamp, 0
FROM temp.tool_rows AS r CROSS JOIN messages AS m ON m.id = r.message_id
CROSS JOIN messages AS a ON a.id = r.answer CROSS JOIN messages AS g ON g.id = r.goal
WHERE true ORDER BY r.rowid
ON CONFLICT (message_id, call_id) DO NOTHING;
DELETE FROM temp.tool_rows;
"""
# The settled calls get their answer's result and outcome (or never answered's).
APPLY = """
WITH v AS MATERIALIZED (
    SELECT s.id, s.answer, a.content, x.o FROM temp.tool_settled AS s
    LEFT JOIN temp.tool_answers AS a ON a.session_id = s.session_id
        AND a.tool_call_id = s.call_id AND a.id = s.answer
    LEFT JOIN temp.tool_answer_outcomes AS x ON x.id = a.id)
UPDATE tool_calls SET awaiting = 0,
    result = coalesce(substr(v.content, 1, 500), ''),
    ok = CASE WHEN v.answer IS NULL THEN 0 WHEN v.o IS NULL THEN 1 ELSE v.o ->> 0 END,
    error_type = CASE WHEN v.answer IS NULL THEN {never_type}
                      WHEN v.o IS NOT NULL THEN v.o ->> 1 END,
    error_message = CASE WHEN v.answer IS NULL THEN {never_message}
                         WHEN v.o IS NOT NULL THEN v.o ->> 2 END,
    duration_ms = CASE WHEN v.o IS NOT NULL THEN v.o ->> 3 END
FROM v WHERE tool_calls.id = v.id;
""".format(never_type=f"'{NEVER_ANSWERED[0]}'", never_message=f"'{NEVER_ANSWERED[1]}'")
# A call settled after later calls of its tool (same user; same session without a user): the
# successes from it on, within the fix window after the latest of them (no later success can
# fix it), lose their fixes, and are marked again with the batch's own calls as one set
# (MARK_FIXES), as the calls of a whole turn are in its batch.
REFIX = """
INSERT OR IGNORE INTO temp.tool_refix (id)
SELECT t.id FROM (
    SELECT c.user_id, c.tool, iif(c.user_id = '', c.session_id, NULL) AS sid,
           min(c.id) AS m, max(c.at) AS top
    FROM temp.tool_settled AS s CROSS JOIN tool_calls AS c ON c.id = s.id
    GROUP BY 1, 2, 3
) AS g
JOIN tool_calls AS t ON t.user_id = g.user_id AND t.tool = g.tool AND t.id >= g.m
WHERE t.ok = 1 AND t.awaiting = 0 AND t.at <= g.top + {window}
  AND (g.sid IS NULL OR t.session_id = g.sid);
UPDATE tool_calls SET fixed_by = NULL
WHERE id IN (SELECT c.fixes FROM temp.tool_refix AS r CROSS JOIN tool_calls AS c
             ON c.id = r.id WHERE c.fixes IS NOT NULL);
UPDATE tool_calls SET fixes = NULL
WHERE id IN (SELECT id FROM temp.tool_refix) AND fixes IS NOT NULL;
"""
REFIXED = "id IN (SELECT id FROM temp.tool_refix)"
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
WHERE {new} AND ok = 1 AND awaiting = 0 AND fixes IS NULL;
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
# Last: whether the store holds a call awaiting its answer now, told to the writer's
# AwaitingCalls only when it changed (the function is called then only).
AWAITING_FUNCTION = "hm_tool_awaiting"
NOW_AWAITING = f"""
SELECT {AWAITING_FUNCTION}(1) WHERE EXISTS (SELECT 1 FROM tool_calls WHERE awaiting = 1);
"""
NONE_AWAITING = f"""
SELECT {AWAITING_FUNCTION}(0) WHERE NOT EXISTS (SELECT 1 FROM tool_calls WHERE awaiting = 1);
"""


class AwaitingCalls:
    """Whether the store holds a call awaiting its answer, as the writer knows: read at open
    (``prepare``) and told by each commit that logs or settles calls (``NOW_AWAITING``,
    ``NONE_AWAITING``). While none does, a commit skips the statements that settle awaiting
    calls (compiling them costs ~0.1-0.2 ms a commit, whatever its size): a batch without tool
    calls has none of them. Skipping is safe even when this is wrong (a commit that told it
    rolled back): what settles an awaiting call is read from the session's messages whenever
    SETTLE runs, so a settling only comes later."""

    __slots__ = ("possible", "told")

    def __init__(self) -> None:
        self.possible = True  # until the store was looked at
        self.told = False  # the writer connection has the function that tells it

    def tell(self, value: Any) -> None:
        """The store holds an awaiting call (1) or none (0). Never raises (a user function's
        exception would fail the commit)."""
        self.possible = bool(value)


class JudgeErrors:
    """Tool answers a rule raised on (a bug: they are logged as successes, and each error
    logged): counted for ``stats().tool_judge_errors``. The loop and the store's thread
    both judge."""

    __slots__ = ("_lock", "count")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def add(self) -> None:
        with self._lock:
            self.count += 1


@dataclass(frozen=True)
class ToolLogConfig:
    """What the writer's commits do with tool calls (``Settings``' tool_log fields), and
    what the writer knows of the store's calls awaiting an answer."""

    rules: OutcomeRules
    max_per_user: int
    fix_window_s: float
    awaiting: AwaitingCalls = field(default_factory=AwaitingCalls, compare=False, repr=False)
    errors: JudgeErrors = field(default_factory=JudgeErrors, compare=False, repr=False)


async def prepare(db: aiosqlite.Connection, config: ToolLogConfig | None) -> None:
    """At open, once the log's columns are there (``store.schema.migrate``), on the writer
    connection: the log's indexes, whether some call awaits its answer, and the function by
    which commits tell it."""
    await db.executescript(INDEXES)
    if config is None:
        return
    async with db.execute("SELECT EXISTS (SELECT 1 FROM tool_calls WHERE awaiting = 1)") as cur:
        row = await cur.fetchone()
    awaiting = config.awaiting
    awaiting.possible = bool(row and row[0])
    await db.create_function(AWAITING_FUNCTION, 1, awaiting.tell)
    awaiting.told = True


def log_statements(config: ToolLogConfig, mine: Callable[[str], str], *,
                   sessions: Callable[[], str], calls: bool = True,
                   judged: str | None = None, rows: str | None = None) -> list[str]:
    """The statements that log a batch's tool calls, and settle its sessions' calls awaiting
    their answer, given ``mine(column)``: the SQL condition that ``column`` is the id of one
    of the batch's messages; ``sessions()``: the batch's sessions, as an SQL literal of a JSON
    array whose items are arrays led by a session id (``Batch.session_rows``). ``calls``:
    some message of the batch has tool calls (else nothing is logged, only settled; nothing
    at all while no call awaits its answer). ``judged``: the outcomes of the batch's own
    answers, judged as it was built (an SQL literal of a JSON array of [message id,
    ``outcome_row``], plain successes left out); None: the function judges them here.
    ``rows``: the rows of all the batch's calls, worked out on the loop (``tool_rows``: SQL
    ``VALUES``, '' for none; given only with ``judged``); None: they are worked out here."""
    return _statements(
        config, lambda alias: mine(f"{alias}.id"), lambda col: mine(f"{col}message_id"),
        sessions=lambda: f"SELECT s.value ->> 0 AS sid FROM json_each({sessions()}) AS s",
        calls=calls, judged=judged, rows=rows)


def range_log_statements(config: ToolLogConfig, after: int, upto: int) -> list[str]:
    """The statements that log the tool calls of the messages with ids in (after, upto], a
    run of whole turns (the backfill of turns committed before the log existed)."""
    a, b = int(after), int(upto)

    def messages(alias: str) -> str:
        return f"{alias}.id > {a} AND {alias}.id <= {b}"

    return _statements(
        config, messages, lambda col: f"({col}message_id > {a} AND {col}message_id <= {b})",
        sessions=lambda: f"SELECT DISTINCT session_id AS sid FROM messages WHERE id > {a} "
                         f"AND id <= {b}", settle=True)


def session_log_statements(config: ToolLogConfig, session_literal: str, *,
                           calls: bool = True) -> list[str]:
    """The statements that log the tool calls of a whole session (an imported one, whose
    message ids are its own): calls already logged stay as they are, those awaiting their
    answer are settled by what it holds now. ``calls``: the part just imported has some."""
    return _statements(config, lambda alias: f"{alias}.session_id = {session_literal}",
                       lambda col: f"({col}session_id = {session_literal})",
                       sessions=lambda: f"SELECT {session_literal} AS sid", calls=calls,
                       settle=True)


def end_statements(config: ToolLogConfig, session_literal: str) -> list[str]:
    """The statements that settle a session's calls still awaiting their answer when it
    ends: by what came for them, else never answered."""
    window = repr(float(config.fix_window_s))
    return [SETTLE_ENDED.format(sessions=f"SELECT {session_literal} AS sid",
                                session=session_literal, closing=_CLOSING),
            ANSWERS, FOUND_ANSWERS.format(t_new="0"), JUDGE, APPLY, REFIX.format(window=window),
            MARK_FIXES.format(new=REFIXED, window=window), *_told(config)]


def _statements(config: ToolLogConfig, messages: Callable[[str], str],
                new: Callable[[str], str], *, sessions: Callable[[], str], calls: bool = True,
                settle: bool | None = None, judged: str | None = None,
                rows: str | None = None) -> list[str]:
    """``messages(alias)``: the SQL condition on the messages to log; ``new(prefix)``: the
    same on the log's rows (their ``message_id`` or ``session_id``, after ``prefix``);
    ``sessions()``: a SELECT of their sessions' ids (``sid``); ``settle``: whether to settle
    the calls awaiting an answer that earlier commits logged (default: if the store may hold
    one); ``judged``, ``rows``: as ``log_statements``."""
    if settle is None:
        settle = config.awaiting.possible
    if not calls and not settle:
        return []  # no call to log, none awaiting an answer
    if judged is None:
        rows = None
    limit = int(config.max_per_user)
    window = repr(float(config.fix_window_s))
    script = [SETTLE.format(sessions=sessions(), closing=_CLOSING)] if settle else []
    # The batch's answers go to the temporary tables for its calls (unless their rows came
    # worked out) and for the awaiting calls they may settle.
    answers = calls and (rows is None or settle)
    if answers or settle:
        script.append(ANSWERS)
    if answers:
        script.append(BATCH_ANSWERS.format(t_new=messages("t"),
                                           judge=1 if judged is None else 0))
        if judged is not None and judged != "'[]'":
            script.append(JUDGED.format(judged=judged))
    if settle:
        script.append(FOUND_ANSWERS.format(t_new=messages("t") if calls else "0"))
    if settle or judged is None:
        script.append(JUDGE)
    if calls and rows is None:
        script.append(INSERT_CALLS.format(
            m_new=messages("m"), g_new=messages("g"), closing=_CLOSING, no_id=_NO_ID,
            never_type=f"'{NEVER_ANSWERED[0]}'", never_message=f"'{NEVER_ANSWERED[1]}'"))
    elif calls and rows:
        script.append(LOG_ROWS.format(rows=rows))
    if settle:
        script += [APPLY, REFIX.format(window=window)]
    # The batch's calls and the late ones' successes, marked as one set (each statement
    # more costs its compiling, per batch).
    marked = f"({new('')} OR {REFIXED})" if calls and settle else new("") if calls else REFIXED
    script.append(MARK_FIXES.format(new=marked, window=window))
    if calls:
        script.append(TRIM.format(new=new(""), limit=limit, slack=max(1, limit // 10)))
    return script + _told(config)


def _told(config: ToolLogConfig) -> list[str]:
    """The statement that tells the writer whether a call awaits its answer now."""
    awaiting = config.awaiting
    if not awaiting.told:
        return []
    return [NONE_AWAITING if awaiting.possible else NOW_AWAITING]


def outcome_function(rules: OutcomeRules, errors: JudgeErrors | None = None) -> Any:
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
        return json.dumps([outcome_row(content, rules, errors)
                           for content in (contents if isinstance(contents, list) else [])])

    return hm_tool_outcomes


def outcome_row(content: str | None, rules: OutcomeRules, errors: JudgeErrors | None = None
                ) -> tuple[int, str | None, str | None, float | None] | None:
    """A tool answer's outcome as the log's statements read it: ``(ok, error_type,
    error_message, duration_ms)`` (a JSON array to them), or None for a success with no
    duration (most answers). A tuple of plain values: the collector lets go of it, and of
    the turn's answers that hold it (``Turn.answers``), at the first collection.
    Never raises: an answer a rule fails on is a success, logged and counted in
    ``errors``."""
    try:
        o = judge(content if content is not None else "", rules)
    except Exception:  # a bug in a rule must not fail the turns' commit
        log.error("tool_outcome_failed", exc_info=True)
        if errors is not None:
            errors.add()
        return None
    if o.ok and o.duration_ms is None:
        return None
    return (int(o.ok), o.error_type, o.error_message, o.duration_ms)


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
    """Reads of the tool-call log. ``user_id`` '' is the calls of turns without a user. A
    call awaiting its answer is in none of them: it is read once it is settled."""

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
        first (a call awaiting its answer is not one: its ``ok`` is 1 until settled)."""
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
    """The condition on the user's settled calls (of ``tools``, when given)."""
    params: list[Any] = [user_id]
    where = "user_id = ? AND awaiting = 0"
    if tools:
        where += f" AND tool IN ({','.join('?' * len(tools))})"
        params += list(tools)
    return where, params
