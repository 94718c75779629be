"""SQL text helpers shared by the store's modules."""

from __future__ import annotations

import contextlib
import json
import re
import sqlite3
from collections.abc import Sequence
from typing import Any

import aiosqlite

from ..message_rows import message_of

# Keys per IN (...) lookup, well under SQLite's bound-parameter limit.
KEY_CHUNK = 500


# What may hold a ';' that ends no statement: a literal or a quoted name ('', "", ``, []),
# a comment (--, /* */); and the ';' itself.
_SKIPPED = re.compile(r"['\"`\[;]|--|/\*")
# Where each ends. A doubled quote ('it''s') needs nothing of its own: it ends one literal
# and begins the next, and no ';' is between them.
_CLOSERS = {"'": "'", '"': '"', "`": "`", "[": "]", "--": "\n", "/*": "*/"}


def single_statements(sql: str) -> list[str]:
    """``sql`` cut into its statements, for a connection that runs one at a time inside an
    open transaction. A ``;`` in a literal, a quoted name or a comment is no cut, nor one
    inside a trigger's body (``sqlite3.complete_statement`` says where one ends). Literals,
    names and comments are stepped over whole: asking at each ``;`` in them whether the
    text so far is a statement made this quadratic, seconds on the event loop for a long
    text full of ``;``."""
    out: list[str] = []
    start = i = 0
    n = len(sql)
    while i < n:
        m = _SKIPPED.search(sql, i)
        if m is None:
            break
        token, i = m.group(), m.end()
        if token == ";":
            if sqlite3.complete_statement(sql[start:i]):
                if sql[start:i - 1].strip():
                    out.append(sql[start:i])
                start = i
        else:
            closer = _CLOSERS[token]
            end = sql.find(closer, i)
            i = n if end < 0 else end + len(closer)
    if sql[start:].strip():
        out.append(sql[start:])
    return out


def sql_literal(text: str) -> str:
    """``text`` as an SQL string literal. Only for text without U+0000 (SQLite ends a
    literal there); the caller routes such text through bound parameters instead."""
    if "\x00" in text:
        raise ValueError("an SQL literal cannot hold U+0000")
    return "'" + text.replace("'", "''") + "'"


async def fetch_dicts(db: aiosqlite.Connection, sql: str,
                      params: Sequence[Any] | dict[str, Any] = ()) -> list[dict[str, Any]]:
    """The rows as dicts by column name (the shared connection's row factory stays as is)."""
    async with db.execute(sql, params) as cur:
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row, strict=True)) for row in await cur.fetchall()]


# A commit that inserts messages raises the highest id ever given (``message_id_high``).
ID_HIGH = "UPDATE message_id_high SET high = max(high, {high});"

# A message as read back (seed 001's ``get_messages`` columns, plus its turn, its fields and
# whether the host set it aside): for the library's reads, the export and the admin CLI alike.
MESSAGE_COLUMNS = ("id, session_id, turn_key, role, content, tool_calls, tool_call_id, "
                   "tool_name, timestamp, user_id, metadata, token_count, fields, active")
SESSION_MESSAGES = f"SELECT {MESSAGE_COLUMNS} FROM messages WHERE session_id = ? ORDER BY id"


def decode_message(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` (``MESSAGE_COLUMNS``) with its tool calls and metadata decoded (text that
    is not JSON, written by an older version, is kept as stored), and ``message``: the
    message exactly as it was handed over (``message_rows.message_of``); ``fields`` goes into it."""
    fields = message.pop("fields", None)
    message["message"] = message_of(message["role"], message["content"],
                                    message["tool_calls"], message["tool_call_id"], fields,
                                    tool_name=message["tool_name"])
    for name in ("tool_calls", "metadata"):
        if message[name]:
            with contextlib.suppress(ValueError):
                message[name] = json.loads(message[name])
    return message


def where_equal(*columns: tuple[str, object]) -> tuple[str, list[Any]]:
    """`` WHERE col = ? AND ...`` for the (column, value) pairs with a value (not None), and
    the values to bind; ``("", [])`` when none has one."""
    given = [(col, value) for col, value in columns if value is not None]
    clauses = [f"{col} = ?" for col, _ in given]
    params = [value for _, value in given]
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), params
