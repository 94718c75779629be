"""Warm-start templates: what a batch's template records (``ops.OP_TEMPLATE``) do to the
``templates`` and ``template_sessions`` tables, and the reads of them.

The records come in one lane, so a batch applies them in the order they were accepted, one
statement (or two) each:

- ``put`` inserts the template, or (mode "save") replaces the content of the one stored
  under its name and keeps that one's usage and outcome counts and creation time: those
  are evidence the store gathered, not content. Mode "keep" leaves a stored one as it is;
  "auto" also inserts nothing when a template of the same task type has the same examples
  (``signature``) or the same source session.
- ``delete`` removes the template. The sessions started from it keep their rows (they
  still count for warm vs cold) but are detached from the name: a template saved later
  under it starts from no evidence, and their ends no longer move its counts.
- ``use`` records a session's start, warm (a template's name) or cold, once: a second start
  of the same session changes nothing, and the template's usage count moves only with the
  first.
- ``outcome`` records how the session ended, and moves its template's successes or
  failures. Ending a session again replaces its outcome: the template's counts take the
  earlier one back first, so a session counts once. A session ended without a recorded
  start is a cold one, started when the store's session row says.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

from ..ops import TemplateOp, parse_template_record
from ..templates.model import Template, normalize_tags
from ..templates.outcome import examples_signature
from ..turns import Turn
from .connections import Connections
from .sql import sql_literal

_JSON = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"))

_COLUMNS = ("name, task_type, tags, description, source_session_id, document, signature, "
            "usage_count, successes, failures, created_at, updated_at")
PUT = """
INSERT INTO templates (""" + _COLUMNS + """)
SELECT {name}, {task_type}, {tags}, {description}, {source}, {document}, {signature},
       {used}, {ok}, {failed}, {created}, {at}
WHERE {condition}
ON CONFLICT (name) DO {conflict};
"""
REPLACE_CONTENT = """UPDATE SET task_type = excluded.task_type, tags = excluded.tags,
    description = excluded.description, source_session_id = excluded.source_session_id,
    document = excluded.document, signature = excluded.signature,
    updated_at = max(templates.updated_at, excluded.updated_at)"""
NOT_A_DUPLICATE = """NOT EXISTS (SELECT 1 FROM templates WHERE task_type = {task_type}
    AND (signature = {signature} OR source_session_id = {source}))"""
DELETE = """
DELETE FROM templates WHERE name = {name};
UPDATE template_sessions SET detached = 1 WHERE template = {name} AND detached = 0;
"""
USE = """
UPDATE templates SET usage_count = usage_count + 1, updated_at = max(updated_at, {at})
WHERE name = {name} AND NOT EXISTS (SELECT 1 FROM template_sessions WHERE session_id = {sid});
INSERT INTO template_sessions (session_id, template, task_type, started_at)
VALUES ({sid}, {name}, {task_type}, {at})
ON CONFLICT (session_id) DO NOTHING;
"""
OUTCOME = """
UPDATE templates SET
    successes = successes + {ok} - coalesce(
        (SELECT ok = 1 FROM template_sessions WHERE session_id = {sid}), 0),
    failures = failures + (1 - {ok}) - coalesce(
        (SELECT ok = 0 FROM template_sessions WHERE session_id = {sid}), 0),
    updated_at = max(updated_at, {at})
WHERE name = (SELECT template FROM template_sessions
              WHERE session_id = {sid} AND detached = 0);
INSERT INTO template_sessions (session_id, template, task_type, started_at, ended_at, ok,
                               first_calls, first_errors)
VALUES ({sid}, NULL, {task_type},
        coalesce((SELECT started_at FROM sessions WHERE id = {sid}), {at}), {at}, {ok},
        {first_calls}, {first_errors})
ON CONFLICT (session_id) DO UPDATE SET
    ended_at = excluded.ended_at, ok = excluded.ok, first_calls = excluded.first_calls,
    first_errors = excluded.first_errors;
"""

# Candidates of a choice: the templates of the task type above the floor of evidence,
# ranked as ``templates.choose`` ranks them (rate, then least used, then most ended; a rate
# is exact as a double for any count below 2**26, so the order is the exact one), name last
# for a stable order. Only the columns the choice reads. The ORDER BY is the expression of
# the index idx_templates_rank (schema): SQLite walks that index from the best template and
# stops after LIMIT rows qualify, instead of sorting every template of the type.
CANDIDATES = """
SELECT name, tags, usage_count, successes, failures FROM templates
WHERE task_type = ? AND successes + failures >= ? AND successes >= ? * (successes + failures)
  AND (successes + failures > 0 OR ? = 0) {tags}
ORDER BY CAST(successes AS REAL) / max(successes + failures, 1) DESC, usage_count,
         successes + failures DESC, name
LIMIT ?
"""
HAS_TAG = "AND EXISTS (SELECT 1 FROM json_each(tags) WHERE value IN ({marks}))"
# The session's tool calls from the log, each with whether it was made in the session's
# first ``?2`` turns: before the first message (ordinal 0) of the turn after them. Message
# ids grow in the order a session's turns commit, which is the order they were accepted.
# A call still awaiting its answer is not counted (store.tool_log).
SESSION_CALLS = """
SELECT tool, ok, message_id < coalesce(
    (SELECT id FROM messages WHERE session_id = ?1 AND ordinal = 0 ORDER BY id
     LIMIT 1 OFFSET ?2), 9223372036854775807)
FROM tool_calls WHERE session_id = ?1 AND awaiting = 0 ORDER BY id
"""
STATS = """
SELECT task_type, template IS NOT NULL, count(*), count(ended_at), coalesce(sum(ok = 1), 0),
       count(CASE WHEN ended_at IS NOT NULL AND first_calls > 0 THEN 1 END),
       coalesce(sum(CASE WHEN ended_at IS NOT NULL THEN first_calls END), 0),
       coalesce(sum(CASE WHEN ended_at IS NOT NULL THEN first_errors END), 0),
       avg(CASE WHEN ended_at IS NOT NULL AND first_calls > 0
           THEN CAST(first_errors AS REAL) / first_calls END)
FROM template_sessions GROUP BY 1, 2 ORDER BY 1, 2
"""


class TemplateRow(NamedTuple):
    """A stored template: its document, and the counts and times the store keeps."""

    document: str
    usage_count: int
    successes: int
    failures: int
    created_at: float
    updated_at: float


class CandidateRow(NamedTuple):
    name: str
    tags: tuple[str, ...]
    usage_count: int
    successes: int
    failures: int


class SessionStartRow(NamedTuple):
    """A session's row of ``template_sessions``."""

    template: str | None
    task_type: str
    started_at: float
    ended_at: float | None
    ok: bool | None


# (task type, warm, sessions, ended, successes, measured, first calls, first errors, average
# first-turn error rate of the measured)
StatsRow = tuple[str, bool, int, int, int, int, int, int, float | None]


def template_statements(ops: Sequence[Turn]) -> list[str]:
    """The statements that apply template records ``ops``, in order, for a batch's
    transaction (their outbox keys are marked done with the batch's other operations)."""
    script = []
    for t in ops:
        op = parse_template_record(t.payload)
        assert op is not None  # the batch hands over template records only
        script.append(_statement(op))
    return script


def _statement(op: TemplateOp) -> str:
    at = repr(op.accepted_at)
    name = _text(op.name)
    if op.action == "put":
        template = Template.from_dict(op.document)
        values = {
            "name": name, "task_type": sql_literal(template.task_type),
            "tags": sql_literal(_JSON.encode(list(normalize_tags(template.tags)))),
            "description": sql_literal(template.description),
            "source": sql_literal(template.source_session_id),
            "document": sql_literal(_JSON.encode(op.document)),
            "signature": sql_literal(examples_signature(template.examples)),
            "used": template.usage_count, "ok": template.successes,
            "failed": template.failures, "created": repr(template.created_at), "at": at,
        }
        condition = NOT_A_DUPLICATE.format(**values) if op.mode == "auto" else "true"
        conflict = REPLACE_CONTENT if op.mode == "save" else "NOTHING"
        return PUT.format(condition=condition, conflict=conflict, **values)
    if op.action == "delete":
        return DELETE.format(name=name)
    sid, task_type = _text(op.session_id), _text(op.task_type)
    if op.action == "use":
        return USE.format(name=name, sid=sid, task_type=task_type, at=at)
    return OUTCOME.format(sid=sid, task_type=task_type, at=at, ok=int(bool(op.ok)),
                          first_calls=op.first_calls, first_errors=op.first_errors)


def _text(value: str | None) -> str:
    return "NULL" if value is None else sql_literal(value)


class Templates(Connections):
    """Reads of the templates and of the sessions started from them (their writes are
    batch statements, above)."""

    async def template_row(self, name: str) -> TemplateRow | None:
        async with self.reader() as db, db.execute(
                "SELECT document, usage_count, successes, failures, created_at, updated_at "
                "FROM templates WHERE name = ?", (name,)) as cur:
            row = await cur.fetchone()
        return None if row is None else TemplateRow(*row)

    async def template_rows(self, task_type: str | None = None) -> list[TemplateRow]:
        """Every template (of ``task_type``), by task type then name."""
        sql = ("SELECT document, usage_count, successes, failures, created_at, updated_at "
               "FROM templates")
        params: tuple[Any, ...] = ()
        if task_type is not None:
            sql += " WHERE task_type = ?"
            params = (task_type,)
        async with self.reader() as db, db.execute(sql + " ORDER BY task_type, name",
                                                   params) as cur:
            return [TemplateRow(*r) for r in await cur.fetchall()]

    async def template_names(self, names: Sequence[str]) -> set[str]:
        """Which of ``names`` are stored."""
        found: set[str] = set()
        async with self.reader() as db:
            for i in range(0, len(names), 500):
                chunk = list(names[i : i + 500])
                async with db.execute(
                        f"SELECT name FROM templates WHERE name IN ({','.join('?' * len(chunk))})",
                        chunk) as cur:
                    found.update(str(r[0]) for r in await cur.fetchall())
        return found

    async def template_candidates(self, task_type: str, tags: Sequence[str], *,
                                  min_evidence: int, min_success_rate: float, limit: int
                                  ) -> list[CandidateRow]:
        """The best ``limit`` templates of ``task_type`` above the floor of evidence (and
        sharing a tag with ``tags``, when given), best first (see ``CANDIDATES``)."""
        where = HAS_TAG.format(marks=",".join("?" * len(tags))) if tags else ""
        params = (task_type, min_evidence, min_success_rate, min_success_rate, *tags, limit)
        async with self.reader() as db, db.execute(CANDIDATES.format(tags=where),
                                                   params) as cur:
            return [CandidateRow(r[0], tuple(json.loads(r[1])), r[2], r[3], r[4])
                    for r in await cur.fetchall()]

    async def template_duplicate(self, task_type: str, signature: str, source: str
                                 ) -> str | None:
        """A template of ``task_type`` with the same examples or source session, if any."""
        async with self.reader() as db, db.execute(
                "SELECT name FROM templates WHERE task_type = ? AND (signature = ? OR "
                "source_session_id = ?) ORDER BY name LIMIT 1",
                (task_type, signature, source)) as cur:
            row = await cur.fetchone()
        return None if row is None else str(row[0])

    async def template_session(self, session_id: str) -> SessionStartRow | None:
        async with self.reader() as db, db.execute(
                "SELECT template, task_type, started_at, ended_at, ok FROM template_sessions "
                "WHERE session_id = ?", (session_id,)) as cur:
            row = await cur.fetchone()
        if row is None:
            return None
        return SessionStartRow(row[0], row[1], row[2], row[3],
                               None if row[4] is None else bool(row[4]))

    async def session_tool_calls(self, session_id: str, first_turns: int
                                 ) -> list[tuple[str, bool, bool]]:
        """The session's logged tool calls in order: (tool, ok, made in its first
        ``first_turns`` turns)."""
        async with self.reader() as db, db.execute(SESSION_CALLS,
                                                   (session_id, first_turns)) as cur:
            return [(str(r[0]), bool(r[1]), bool(r[2])) for r in await cur.fetchall()]

    async def template_stats(self) -> list[StatsRow]:
        async with self.reader() as db, db.execute(STATS) as cur:
            return [(str(r[0]), bool(r[1]), *map(int, r[2:8]), r[8])
                    for r in await cur.fetchall()]
