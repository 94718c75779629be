"""Applying a replica batch's records in PostgreSQL, other than its turns' messages: the
order they go in (``phases``) and what each operation does (a session's lifecycle event, an
import, a template record), with the same meaning as in the SQLite store. ``backend`` runs
them inside its write's transaction, once each (``applied_records``).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..ops import OP_SESSION, OP_TEMPLATE, SessionOp, TemplateOp
from ..templates.model import Template, normalize_tags
from ..templates.outcome import examples_signature
from ..turns import TURN, Turn, scope_tokens
from .statements import (
    DELETE_SESSION,
    DESCRIBE,
    END,
    IMPORT_MESSAGES,
    IMPORT_ROW,
    IMPORT_TARGET,
    LAST_SEQ,
    PRUNABLE,
    TEMPLATE_DELETE,
    TEMPLATE_KEEP,
    TEMPLATE_OUTCOME,
    TEMPLATE_SAVE,
    TEMPLATE_USE,
)

if TYPE_CHECKING:
    from asyncpg import Record
    from asyncpg.pool import PoolConnectionProxy

    Conn = PoolConnectionProxy[Record]

NUL = "\x00"
NUL_STORED = "\ufffd"
# A template's tags and document as the local store writes them (store.templates).
_JSON = json.JSONEncoder(ensure_ascii=True, separators=(",", ":"))


@dataclass(slots=True)
class Phase:
    turns: list[Turn] = field(default_factory=list)
    ops: list[Turn] = field(default_factory=list)


def phases(records: Sequence[Turn]) -> list[Phase]:
    """``records`` in phases (module doc): phase p holds each lane's turns after its p-th
    operation, and then each lane's (p+1)-th operation, in batch order.

    A template record and a session's event (their lanes differ) may touch the same
    session's warm-start row (a start, then the session's delete): of two such, the one
    first in the batch goes in a phase no later than the other's, so first (within a phase,
    operations go in batch order), as SQLite committed them."""
    out: list[Phase] = []
    next_op: Counter[str] = Counter()  # per lane: the phase of its next operation, at least
    last = {OP_SESSION: 0, OP_TEMPLATE: 0}  # the phase of the latest operation of each kind
    for t in records:
        p = next_op[t.session_id]
        if t.kind in last:
            p = max(p, last[OP_TEMPLATE if t.kind == OP_SESSION else OP_SESSION])
            last[t.kind] = max(last[t.kind], p)
        while len(out) <= p:
            out.append(Phase())
        if t.kind == TURN:
            out[p].turns.append(t)
        else:
            out[p].ops.append(t)
            next_op[t.session_id] = p + 1
    return out



async def apply_template(conn: Conn, op: TemplateOp) -> str | None:
    """A template record, as ``store.templates`` applies it in SQLite. Returns the name of
    the template whose counts a start or an end moved (the caller queues its stats job)."""
    if op.action == "put":
        t = Template.from_dict(op.document)
        await conn.execute(
            TEMPLATE_SAVE if op.mode == "save" else TEMPLATE_KEEP, op.name, t.task_type,
            _JSON.encode(list(normalize_tags(t.tags))), t.description,
            t.source_session_id, _JSON.encode(op.document),
            examples_signature(t.examples), t.usage_count, t.successes, t.failures,
            t.created_at, op.accepted_at, op.mode == "auto")
        return None
    if op.action == "delete":
        for statement in TEMPLATE_DELETE:
            await conn.execute(statement, op.name)
        return None
    if op.action == "use":
        name = await conn.fetchval(TEMPLATE_USE, op.session_id, op.name, op.task_type,
                                   op.accepted_at)
    else:
        name = await conn.fetchval(TEMPLATE_OUTCOME, op.session_id, op.task_type,
                                   op.accepted_at, bool(op.ok), op.first_calls,
                                   op.first_errors)
    return None if name is None else str(name)



async def apply_session(conn: Conn, op: SessionOp, source: str) -> None:
    """A session's lifecycle event (describe, end, delete, import), as the local store
    applies it; ``source`` for a session the event creates."""
    if op.action == "describe":
        f = op.fields
        config = f.get("model_config")
        await conn.execute(
            DESCRIBE, op.session_id, op.accepted_at, source, f.get("source"), op.user_id,
            f.get("model"), f.get("parent_session_id"),
            None if config is None else json.dumps(config, separators=(",", ":")),
            f.get("system_prompt"), bool(f.get("tokens_estimated")))
    elif op.action == "end":
        await conn.execute(END, op.session_id, op.accepted_at, source, op.user_id,
                           op.reason)
    elif op.action == "delete":
        if op.ended_before is None or await conn.fetchval(
                PRUNABLE, op.session_id, op.ended_before, op.source):
            for statement in DELETE_SESSION:
                await conn.execute(statement, op.session_id)
    elif op.action == "import":
        await _import(conn, op, source)
    # update, usage, reopen (the session store's Hermes fields and accounting) and replace
    # are not mirrored here yet: the shared schema has no columns for them (see
    # docs/postgresql.md).



async def _import(conn: Conn, op: SessionOp, source: str) -> None:
    """An import part: the exported row if the session is not here; its messages if
    the session is the exported one (same start), each once."""
    r = op.row
    if r is not None:
        await conn.execute(
            IMPORT_ROW, op.session_id, r.get("source"), r.get("user_id"), r.get("model"),
            r.get("parent_session_id"), _float(r.get("started_at")),
            _float(r.get("updated_at")), _float(r.get("ended_at")), r.get("end_reason"),
            int(r.get("message_count") or 0), int(r.get("tool_call_count") or 0),
            int(r.get("input_tokens") or 0), int(r.get("output_tokens") or 0),
            _json_text(r.get("model_config")), r.get("system_prompt"),
            bool(r.get("tokens_estimated")), source, op.accepted_at)
    messages = op.messages or []
    if not messages or not await conn.fetchval(IMPORT_TARGET, op.session_id,
                                               op.started_at):
        return
    last = int(await conn.fetchval(LAST_SEQ, op.session_id))
    ranks: dict[str, int] = {}
    for m in messages:
        ranks.setdefault(str(m[1]), last + len(ranks) + 1)
    columns: list[list[Any]] = [[] for _ in range(12)]
    for m in messages:
        values = (ranks[str(m[1])], str(m[1]), int(m[2]), m[3], clean(m[4]),
                  clean(m[5]), clean(m[6]), clean(m[7]), float(m[8]), m[9],
                  _json_text(m[10]), None if m[11] is None else int(m[11]))
        for column, value in zip(columns, values, strict=True):
            column.append(value)
    await conn.execute(IMPORT_MESSAGES, op.session_id,
                       scope_tokens(op.user_id, op.session_id), *columns)


def clean(value: Any) -> Any:
    """``value`` with U+0000 (which PostgreSQL text cannot hold) as U+FFFD."""
    return value.replace(NUL, NUL_STORED) if isinstance(value, str) and NUL in value else value


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _json_text(value: Any) -> str | None:
    """A JSON document as text, as the local store keeps it (a text stays text)."""
    if value is None or isinstance(value, str):
        return None if value is None else str(clean(value))
    return json.dumps(value, separators=(",", ":"))
