"""One group commit's turns (``Batch``), and the statements its transaction runs.

The FTS5 indexes have external content and no insert trigger: the batch fills them once from
the rows it just inserted, as it does the sessions' counters, the replica outbox and the done
keys (the trigram index only with the messages of turns holding CJK text, the tool index
with those that have tool text: ``text_index``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from ..message_ids import MessageIds
from ..ops import OP_KV, OP_SESSION, OP_TEMPLATE
from ..tool_rows import values
from ..turns import TURN, UNJUDGED, Turn, store_rows
from .lifecycle import session_statements
from .memories import op_statements, ops_done, replica_statement
from .sql import ID_HIGH, sql_literal
from .templates import template_statements
from .text_index import (
    INDEX_SESSION_TRIGRAM,
    INDEX_TOOLS,
    INDEX_TRIGRAM,
    INDEX_WORDS,
    payload_has_cjk,
)
from .tool_log import ToolLogConfig, log_statements

# A big token count is written as an integer and read back by SQLite as a real, as the old
# summing in SQL did on overflow; NaN cannot occur (counts are integers).
_ROWS = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"))

# Sessions are created lazily and their counters summed. The batch adds up each session's
# share as it is built (Batch.add, a few dict operations a turn on the loop) and hands SQLite
# one small JSON row per session: summing them in SQL from the inserted messages, with their
# metadata read back through json_extract, cost the writer thread ~4 µs a turn.
SESSION_COLUMNS = """sessions (id, source, user_id, model, parent_session_id, started_at,
    updated_at, message_count, tool_call_count, input_tokens, output_tokens)"""
# What a commit does to a session it has seen before (also the benchmarks' raw baseline).
SESSION_CONFLICT = """
ON CONFLICT (id) DO UPDATE SET
    updated_at = excluded.updated_at,
    user_id = coalesce(sessions.user_id, excluded.user_id),
    model = coalesce(excluded.model, sessions.model),
    parent_session_id = coalesce(sessions.parent_session_id, excluded.parent_session_id),
    message_count = sessions.message_count + excluded.message_count,
    tool_call_count = sessions.tool_call_count + excluded.tool_call_count,
    input_tokens = sessions.input_tokens + excluded.input_tokens,
    output_tokens = sessions.output_tokens + excluded.output_tokens"""
UPSERT_SESSIONS = f"""
INSERT INTO {SESSION_COLUMNS}
SELECT r.value ->> 0, coalesce(r.value ->> 1, {{source}}), r.value ->> 2, r.value ->> 3,
       r.value ->> 4, r.value ->> 5, {{now}}, r.value ->> 6, r.value ->> 7, r.value ->> 8,
       r.value ->> 9
FROM json_each({{rows}}) AS r WHERE true{SESSION_CONFLICT};
"""
# Every message of every turn in the batch, in batch order then message order, under the ids
# its record took when it was accepted (``message_ids``). Each turn's JSON is taken from the
# batch once (t) and its fields read with ->> (u), which parses it once: json_extract on
# json_each's value re-renders the value for every call.
INSERT_MESSAGES = """
WITH t AS MATERIALIZED (
    SELECT j.key AS n, j.value AS v FROM json_each({turns}) AS j
), u AS MATERIALIZED (
    SELECT n, v ->> '$.i' AS i, v ->> '$.s' AS s, v ->> '$.k' AS k, v ->> '$.t' AS ts,
           v ->> '$.u' AS u, v ->> '$.c' AS c, v ->> '$.d' AS d, v -> '$.m' AS m
    FROM t
)
INSERT INTO messages (id, session_id, turn_key, ordinal, role, content, tool_calls,
                      tool_call_id, tool_name, timestamp, user_id, scope, metadata, token_count,
                      fields)
SELECT u.i + e.key, u.s, u.k, e.key, e.value ->> 0, e.value ->> 1, e.value ->> 2,
       e.value ->> 3, e.value ->> 4, coalesce(e.value ->> 6, u.ts), u.u, u.c, u.d,
       e.value ->> 5, e.value ->> 7
FROM u, json_each(u.m) AS e
ORDER BY u.n, e.key;
"""
INSERT_MESSAGE_ROW = """
INSERT INTO messages (id, session_id, turn_key, ordinal, role, content, tool_calls,
                      tool_call_id, tool_name, timestamp, user_id, scope, metadata, token_count,
                      fields)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
"""
INDEX_BATCH = INDEX_WORDS
# The batch's turns wait for the replica backend: one row per turn, with its message rows.
INSERT_REPLICA = """
INSERT INTO replica_outbox (backend, turn_key, session_id, first_id, n_messages)
SELECT {backend}, turn_key, session_id, min(id), count(*) FROM messages WHERE {mine}
GROUP BY turn_key ORDER BY min(id)
ON CONFLICT (backend, turn_key) DO NOTHING;
"""
# The batch's turns are 'done': one row per turn, read back from the messages it just
# inserted, for one run of outbox segment (its turns' ids: ``{run}``).
INSERT_DONE = """
INSERT INTO outbox (key, session_id, segment, status, attempts, accepted_at, updated_at)
SELECT turn_key, session_id, {segment}, 'done', 1, timestamp, {now}
FROM messages WHERE ({run}) AND ordinal = 0;
"""


class Batch:
    """The parameters of one group commit, built up a chunk of turns at a time.

    Each table gets its rows as ONE JSON text parameter that SQLite unpacks with
    ``json_each`` in C, with the GIL released. Binding rows one by one from Python
    (``executemany``) takes and releases the GIL per row, and a busy event-loop thread holds
    each hand-back for up to the interpreter's switch interval (5 ms): a batch then took
    seconds. The turns' JSON is the outbox payload built on the accept path, so building the
    parameter is a string join.
    """

    def __init__(self, source: str, ids: MessageIds | None = None) -> None:
        self.source = source
        # The outcomes of its turns' tool answers, judged on the loop (``sources.judge_all``):
        # (answer's message id, outcome_row) of those not a plain success. One answer that
        # came unjudged, and the transaction judges them all (``tool_log.JUDGE``).
        self._judged: list[tuple[int, Any]] = []
        self._unjudged = False
        # Gives ids to a turn that came without (a producer's, an earlier version's).
        self._ids = ids
        self.turns: list[Turn] = []
        self.n_messages = 0
        self._payloads: list[str] = []
        # Runs of consecutive turns from one outbox segment: [segment, their message ids].
        self._runs: list[tuple[int, IdRanges]] = []
        self._ids_of = IdRanges()  # every turn's messages
        self._cjk_ids = IdRanges()  # those of turns that may hold CJK text
        # Each session's share of the batch: [source, user_id, model, parent_session_id,
        # started_at, messages, tool calls, input tokens, output tokens]; text fields keep the
        # least (source, parent) or greatest (user, model) value seen, as SQL's min and max.
        self._sessions: dict[str, list[Any]] = {}
        self._session_json: str | None = None  # their rows as JSON, once sealed
        self._has_nul = False
        self._has_tool_calls = False
        # The log's rows of its turns' calls as SQL values, a piece per turn, worked out on
        # the loop (``tool_rows``); ``_log_sql``: some turn's calls must be logged the SQL way
        # (``Turn.log_plan`` False), and then all of them are.
        self._log_rows: list[str] = []
        self._log_sql = False
        self._log_after = 0  # the first id of the last turn with rows: they go in id order
        # Turns claimed from the shared inbox: their rows, and the lease they are under.
        self.inbox_ids: list[int] = []
        self.lease_owner: str | None = None
        self.ops: list[Turn] = []  # operations' records, in batch order

    @classmethod
    def of(cls, turns: Sequence[Turn], source: str, ids: MessageIds | None = None) -> Batch:
        batch = cls(source, ids)
        batch.add(turns)
        return batch

    def __len__(self) -> int:
        return len(self.turns)

    def add(self, items: Sequence[Turn]) -> None:
        """Add turns (and operations), in order. A turn without ids takes its ids here.

        Raises:
            ValueError: a turn without ids, and no ``ids`` to give them.
        """
        self._session_json = None
        if any([t.first_id is None and t.kind == TURN for t in items]):
            items = [self._with_ids(t) if t.first_id is None and t.kind == TURN else t
                     for t in items]
        self.turns.extend(items)
        turns: Sequence[Turn] = items
        if any([t.kind != TURN for t in items]):  # operations: applied by their statements
            self.ops.extend([t for t in items if t.kind != TURN])
            turns = [t for t in items if t.kind == TURN]
        sessions = self._sessions
        for t in turns:
            row = sessions.get(t.session_id)
            if row is None:
                sessions[t.session_id] = [t.source, t.user_id, t.model, t.parent_session_id,
                                          t.accepted_at, t.n_messages, t.tool_calls,
                                          t.input_tokens, t.output_tokens]
                continue
            if t.source is not None and (row[0] is None or t.source < row[0]):
                row[0] = t.source
            if t.user_id is not None and (row[1] is None or t.user_id > row[1]):
                row[1] = t.user_id
            if t.model is not None and (row[2] is None or t.model > row[2]):
                row[2] = t.model
            if t.parent_session_id is not None and (row[3] is None
                                                    or t.parent_session_id < row[3]):
                row[3] = t.parent_session_id
            if t.accepted_at < row[4]:
                row[4] = t.accepted_at
            row[5] += t.n_messages
            row[6] += t.tool_calls
            row[7] += t.input_tokens
            row[8] += t.output_tokens
        self._has_nul = self._has_nul or any([t.has_nul for t in turns])
        self._payloads.extend([t.payload for t in turns])
        runs, ids_of = self._runs, self._ids_of
        for t in turns:
            self.n_messages += t.n_messages
            if t.tool_calls:
                self._has_tool_calls = True
            first = t.first_id
            assert first is not None  # given above
            for ordinal, _, outcome in t.answers:
                if outcome is UNJUDGED:
                    self._unjudged = True
                elif outcome is not None:
                    self._judged.append((first + ordinal, outcome))
            if t.log_plan is not None and not self._log_sql:
                self._add_log_rows(t, first)
            last = first + t.n_messages - 1
            ids_of.add(first, last)
            if payload_has_cjk(t.payload):
                self._cjk_ids.add(first, last)
            if not runs or runs[-1][0] != t.segment:
                runs.append((t.segment, IdRanges()))
            runs[-1][1].add(first, last)

    def _add_log_rows(self, t: Turn, first: int) -> None:
        """The log's rows of ``t``'s calls (its first message id ``first``), if the batch's
        calls are still all worked out here. INSERT_CALLS logs the calls in id order: a turn
        out of that order, and the batch goes the SQL way (a batch's turns come in order as
        a rule, ``IdRanges``)."""
        plan = t.log_plan
        if self._unjudged or first <= self._log_after:
            rows = None
        elif type(plan) is str:  # worked out for its ids as it was judged (with_outcomes)
            rows = plan
        elif type(plan) is tuple:
            rows = values(plan, first, {ordinal: outcome for ordinal, _, outcome in t.answers})
        else:
            rows = None
        self._log_after = first
        if rows is None:
            self._log_sql = True
            self._log_rows = []
        elif rows:
            self._log_rows.append(rows)

    def _with_ids(self, t: Turn) -> Turn:
        if self._ids is None:
            raise ValueError(f"turn {t.key} has no message ids and the batch cannot give any")
        return t.with_first_id(self._ids.for_record(t.key, t.n_messages))

    @property
    def has_nul(self) -> bool:
        """Whether some text holds U+0000, which SQLite's JSON functions cut short."""
        return self._has_nul

    def message_rows(self) -> list[tuple[Any, ...]]:
        """The messages as bound rows, for a batch whose text SQLite's JSON would cut."""
        return [row for payload in self._payloads for row in store_rows(payload)]

    def mine(self, column: str = "id") -> str:
        """The SQL condition on ``column`` (a message id) that holds for this batch's
        messages: their id ranges (a batch's turns took consecutive ids as a rule)."""
        return self._ids_of.sql(column)

    def literal_parts(self) -> list[str]:
        """The turns' JSON as an SQL string literal, in pieces to join once with the rest of
        the script (payloads hold no single quote): a 2,000-turn batch is about a megabyte,
        and every extra copy of it is event-loop time."""
        parts = ["'["]
        for payload in self._payloads:
            parts.append(payload)
            parts.append(",")
        if len(parts) > 1:
            parts.pop()
        parts.append("]'")
        return parts

    def segment_runs(self) -> list[tuple[int, str]]:
        """(segment, the SQL condition on a message's id for its turns) of each run."""
        return [(segment, ranges.sql("id")) for segment, ranges in self._runs]

    def session_count(self) -> int:
        return len(self._sessions)

    def seal(self, chunk: int = 100) -> Iterator[None]:
        """Encode the sessions' rows ``chunk`` sessions at a time, for a caller that lets
        the loop run between steps (a thousand sessions take ~1 ms). Add no turns after."""
        items = list(self._sessions.items())
        parts = []
        for i in range(0, len(items), chunk):
            rows = _ROWS.encode([[sid, *row] for sid, row in items[i : i + chunk]])
            parts.append(rows[1:-1])
            yield
        self._session_json = "[" + ",".join(parts) + "]"

    def session_rows(self) -> str:
        """Each session's share of the batch, as an SQL literal of JSON rows (ASCII)."""
        if self._session_json is None:
            for _ in self.seal():
                pass
        assert self._session_json is not None
        return sql_literal(self._session_json)

    def statements(self, *, replica: str | None, now: float, replica_kv: bool = False,
                   replica_templates: bool = False, tool_log: ToolLogConfig | None = None
                   ) -> list[str]:
        """What the batch's transaction runs after inserting its messages: the replica
        outbox rows, the FTS indexes, the sessions, the tool-call log (when ``tool_log``: the
        turns' calls, and their sessions' calls awaiting an answer), and the outbox keys
        marked 'done'; then
        the key-value records (with replica rows of their own when ``replica_kv``), the
        session lifecycle events (with replica rows of their own whenever there is a
        ``replica``) and the template records (with replica rows of their own when
        ``replica_templates``), each kind in batch order, and their keys marked 'done'."""
        mine = self.mine()
        now_sql = repr(now)
        script = [INSERT_REPLICA.format(backend=sql_literal(replica), mine=mine)
                  ] if replica else []
        if self._cjk_ids:
            script.append(INDEX_TRIGRAM.format(mine=self._cjk_ids.sql("id")))
        if self._ids_of:
            script += [INDEX_BATCH.format(mine=mine), INDEX_TOOLS.format(mine=mine),
                       ID_HIGH.format(high=self._ids_of.high()),
                       UPSERT_SESSIONS.format(rows=self.session_rows(), now=now_sql,
                                              source=sql_literal(self.source))]
        if tool_log is not None and self._ids_of:
            # Its calls are logged, and its messages settle its sessions' calls that await
            # their answer (no statement at all without calls while none awaits one).
            judged = None if self._unjudged else sql_literal(_ROWS.encode(self._judged))
            rows = None if self._log_sql else ",".join(self._log_rows)  # (None if unjudged)
            script += log_statements(tool_log, self.mine, sessions=self.session_rows,
                                     calls=self._has_tool_calls, judged=judged, rows=rows)
        script += [
            INSERT_DONE.format(segment=int(segment), now=now_sql, run=run)
            for segment, run in self.segment_runs()
        ]
        if self.ops:
            kv = [t for t in self.ops if t.kind == OP_KV]
            if kv:
                script += op_statements(kv, replica if replica_kv else None)
            lifecycle = [t for t in self.ops if t.kind == OP_SESSION]
            if lifecycle:
                script += session_statements(lifecycle, self.source, replica, tool_log,
                                             self._ids)
                script += [INDEX_SESSION_TRIGRAM.format(session=sql_literal(sid)) for sid in
                           sorted({t.session_id for t in lifecycle
                                   if payload_has_cjk(t.payload)})]
            templates = [t for t in self.ops if t.kind == OP_TEMPLATE]
            if templates:
                script += template_statements(templates)
                if replica is not None and replica_templates:
                    script.append(replica_statement(templates, replica))
            script.append(ops_done(self.ops, now_sql))
        return script

    def lease_statements(self) -> list[str]:
        """For a batch of inbox turns: they leave the inbox in the same transaction, and
        only while this worker's lease on every one of them holds (else: IntegrityError,
        rolled back). One statement per item: a batch with NUL runs them one execute() each."""
        if not self.inbox_ids:
            return []
        ids = ",".join(str(int(i)) for i in self.inbox_ids)
        owner = sql_literal(self.lease_owner or "")
        return [
            f"INSERT INTO temp.lease_guard (held) SELECT count(*) = {len(self.inbox_ids)} "
            f"FROM inbox WHERE id IN ({ids}) AND lease_owner = {owner};",
            "DELETE FROM temp.lease_guard;",
            f"DELETE FROM inbox WHERE id IN ({ids});",
        ]


class IdRanges:
    """Message ids as ranges [first, last], merged as turns add their spans.

    A batch's turns come in id order as a rule (they took their ids when accepted), so each
    span extends the last range or starts a new one, and the ranges are ready when the
    statements ask: no sort of a 2,000-turn batch's spans on the event loop (~2 ms there)
    between its last slice and its commit. Spans out of order are merged once, when asked.
    """

    __slots__ = ("_in_order", "_ranges")

    def __init__(self) -> None:
        self._ranges: list[list[int]] = []  # sorted, disjoint, not adjacent while in order
        self._in_order = True

    def add(self, first: int, last: int) -> None:
        ranges = self._ranges
        if ranges:
            tail = ranges[-1]
            if tail[0] <= first <= tail[1] + 1:
                if last > tail[1]:
                    tail[1] = last
                return
            if first < tail[0]:
                self._in_order = False
        ranges.append([first, last])

    def __bool__(self) -> bool:
        return bool(self._ranges)

    def merged(self) -> list[list[int]]:
        if not self._in_order:
            self._ranges, self._in_order = merge_spans(self._ranges), True
        return self._ranges

    def high(self) -> int:
        """The greatest id (there must be one)."""
        return self.merged()[-1][1]

    def sql(self, column: str) -> str:
        """The SQL condition that ``column`` is one of the ids; ``0`` (false) for none."""
        return ranges_sql(self.merged(), column)


def merge_spans(spans: list[list[int]]) -> list[list[int]]:
    """``spans`` (first, last) in order, adjacent and overlapping ones merged."""
    merged: list[list[int]] = []
    for first, last in sorted(spans):
        if merged and first <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], last)
        else:
            merged.append([first, last])
    return merged


def ranges_sql(merged: Sequence[Sequence[int]], column: str) -> str:
    """The SQL condition that ``column`` is in one of the ``merged`` ranges (``merge_spans``);
    ``0`` (false) for none."""
    if not merged:
        return "0"
    return "(" + " OR ".join(
        f"{column} = {a}" if a == b else f"{column} BETWEEN {a} AND {b}"
        for a, b in merged) + ")"
