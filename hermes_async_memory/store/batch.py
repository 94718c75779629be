"""One group commit's turns (``Batch``), and the statements its transaction runs.

The FTS5 index has external content and no insert trigger: the batch fills it once from the
rows it just inserted, as it does the sessions' counters, the replica outbox and the done keys.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from ..turns import Turn
from .sql import sql_literal

# Sessions are created lazily and their counters summed, from the messages the batch just
# inserted: no per-turn work in Python. Token counts are summed once per turn (ordinal 0).
UPSERT_SESSIONS = """
INSERT INTO sessions (id, source, user_id, model, parent_session_id, started_at, updated_at,
                      message_count, tool_call_count, input_tokens, output_tokens)
SELECT session_id,
       coalesce(min(CASE WHEN json_type(metadata, '$.source') = 'text'
                         THEN json_extract(metadata, '$.source') END), {source}),
       max(user_id),
       max(CASE WHEN json_type(metadata, '$.model') = 'text'
                THEN json_extract(metadata, '$.model') END),
       min(CASE WHEN json_type(metadata, '$.parent_session_id') = 'text'
                THEN json_extract(metadata, '$.parent_session_id') END),
       min(timestamp), {now}, count(*),
       sum(role = 'tool' OR tool_calls IS NOT NULL),
       sum(CASE WHEN ordinal = 0 AND json_type(metadata, '$.input_tokens') = 'integer'
                THEN json_extract(metadata, '$.input_tokens') ELSE 0 END),
       sum(CASE WHEN ordinal = 0 AND json_type(metadata, '$.output_tokens') = 'integer'
                THEN json_extract(metadata, '$.output_tokens') ELSE 0 END)
FROM messages WHERE id > {start} GROUP BY session_id
ON CONFLICT (id) DO UPDATE SET
    updated_at = excluded.updated_at,
    user_id = coalesce(sessions.user_id, excluded.user_id),
    model = coalesce(excluded.model, sessions.model),
    parent_session_id = coalesce(sessions.parent_session_id, excluded.parent_session_id),
    message_count = sessions.message_count + excluded.message_count,
    tool_call_count = sessions.tool_call_count + excluded.tool_call_count,
    input_tokens = sessions.input_tokens + excluded.input_tokens,
    output_tokens = sessions.output_tokens + excluded.output_tokens;
"""
# Every message of every turn in the batch, in batch order then message order. The CTE
# reads each turn's fields once, not once per message.
INSERT_MESSAGES = """
WITH t AS MATERIALIZED (
    SELECT j.key AS i, json_extract(j.value, '$.s') AS s, json_extract(j.value, '$.k') AS k,
           json_extract(j.value, '$.t') AS ts, json_extract(j.value, '$.u') AS u,
           json_extract(j.value, '$.c') AS c, json_extract(j.value, '$.d') AS d,
           json_extract(j.value, '$.m') AS m
    FROM json_each({turns}) AS j
)
INSERT INTO messages (session_id, turn_key, ordinal, role, content, tool_calls, tool_call_id,
                      tool_name, timestamp, user_id, scope, metadata)
SELECT t.s, t.k, e.key, json_extract(e.value, '$[0]'), json_extract(e.value, '$[1]'),
       json_extract(e.value, '$[2]'), json_extract(e.value, '$[3]'),
       json_extract(e.value, '$[4]'), t.ts, t.u, t.c, t.d
FROM t, json_each(t.m) AS e
ORDER BY t.i, e.key;
"""
INSERT_MESSAGE_ROW = """
INSERT INTO messages (session_id, turn_key, ordinal, role, content, tool_calls, tool_call_id,
                      tool_name, timestamp, user_id, scope, metadata)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
"""
INDEX_BATCH = """
INSERT INTO messages_fts (rowid, content, scope)
SELECT id, content, scope FROM messages WHERE id > {start};
"""
# The batch's turns wait for the replica backend: one row per turn, with its message rows.
INSERT_REPLICA = """
INSERT INTO replica_outbox (backend, turn_key, session_id, first_id, n_messages)
SELECT {backend}, turn_key, session_id, min(id), count(*) FROM messages WHERE id > {start}
GROUP BY turn_key ORDER BY min(id)
ON CONFLICT (backend, turn_key) DO NOTHING;
"""
# The batch's turns are 'done': one row per turn, read back from the messages it just
# inserted (ids are consecutive inside the transaction), for one run of outbox segment.
INSERT_DONE = """
INSERT INTO outbox (key, session_id, segment, status, attempts, accepted_at, updated_at)
SELECT turn_key, session_id, {segment}, 'done', 1, timestamp, {now}
FROM messages WHERE id > {start} + {after} AND id <= {start} + {upto} AND ordinal = 0;
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

    def __init__(self, source: str) -> None:
        self.source = source
        self.turns: list[Turn] = []
        self.n_messages = 0
        self._payloads: list[str] = []
        # Runs of consecutive turns from one outbox segment: [segment, messages in the run].
        self._runs: list[list[int]] = []
        self._session_ids: set[str] = set()
        self._has_nul = False
        # Turns claimed from the shared inbox: their rows, and the lease they are under.
        self.inbox_ids: list[int] = []
        self.lease_owner: str | None = None

    @classmethod
    def of(cls, turns: Sequence[Turn], source: str) -> Batch:
        batch = cls(source)
        batch.add(turns)
        return batch

    def __len__(self) -> int:
        return len(self.turns)

    def add(self, turns: Sequence[Turn]) -> None:
        self.turns.extend(turns)
        self._session_ids.update([t.session_id for t in turns])
        self._has_nul = self._has_nul or any([t.has_nul for t in turns])
        self._payloads.extend([t.payload for t in turns])
        runs = self._runs
        for t in turns:
            self.n_messages += t.n_messages
            if runs and runs[-1][0] == t.segment:
                runs[-1][1] += t.n_messages
            else:
                runs.append([t.segment, t.n_messages])

    @property
    def has_nul(self) -> bool:
        """Whether some text holds U+0000, which SQLite's JSON functions cut short."""
        return self._has_nul

    def message_rows(self) -> list[tuple[Any, ...]]:
        """The messages as bound rows, for a batch whose text SQLite's JSON would cut."""
        rows = []
        for payload in self._payloads:
            doc = json.loads(payload)
            md = json.dumps(doc["d"], ensure_ascii=False) if doc["d"] else None
            for i, (role, content, calls, call_id, name) in enumerate(doc["m"]):
                rows.append((doc["s"], doc["k"], i, role, content, calls, call_id, name,
                             doc["t"], doc["u"], doc["c"], md))
        return rows

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

    def segment_runs(self, first_id: int) -> list[tuple[int, int, int]]:
        """(segment, after id, up to id) of each run, given the id before the batch's first."""
        out = []
        start = first_id
        for segment, n in self._runs:
            out.append((segment, start, start + n))
            start += n
        return out

    def session_count(self) -> int:
        return len(self._session_ids)

    def statements(self, *, replica: str | None, now: float) -> list[str]:
        """What the batch's transaction runs after inserting its messages: the replica
        outbox rows, the FTS index, the sessions, and the outbox keys marked 'done'."""
        # The batch's messages are the last n_messages rows once inserted: ids are
        # consecutive inside the transaction.
        start = f"((SELECT max(id) FROM messages) - {int(self.n_messages)})"
        now_sql = repr(now)
        script = [INSERT_REPLICA.format(backend=sql_literal(replica), start=start)
                  ] if replica else []
        script += [INDEX_BATCH.format(start=start),
                   UPSERT_SESSIONS.format(start=start, now=now_sql,
                                          source=sql_literal(self.source))]
        script += [
            INSERT_DONE.format(segment=int(segment), now=now_sql, start=start, after=after,
                               upto=upto)
            for segment, after, upto in self.segment_runs(0)
        ]
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
