"""Helpers that read a store file directly, as a user inspecting it would."""

from __future__ import annotations

import json
import sqlite3
from collections import defaultdict
from pathlib import Path


def stored_turns(db_path: Path) -> dict[str, list[tuple[str, str, str]]]:
    """Every stored message, straight from the file: session -> [(turn_key, role, content)],
    the content as it was given (kept in the message's fields when its column holds an
    indexed copy)."""
    conn = sqlite3.connect(db_path)
    try:
        rows = conn.execute(
            "SELECT session_id, turn_key, role, content, fields FROM messages ORDER BY id"
        ).fetchall()
    finally:
        conn.close()
    out: dict[str, list[tuple[str, str, str]]] = defaultdict(list)
    for session_id, key, role, content, fields in rows:
        given = json.loads(fields) if fields else {}
        out[session_id].append((key, role, given.get("content", content)))
    return out


def count_rows(db_path: Path, sql: str = "SELECT count(*) FROM messages") -> int:
    conn = sqlite3.connect(db_path)
    try:
        return int(conn.execute(sql).fetchone()[0])
    finally:
        conn.close()


def file_rows(db_path: Path, sql: str, *params: object) -> list[tuple[object, ...]]:
    """The rows of one statement, read from the file on a connection of its own."""
    conn = sqlite3.connect(db_path)
    try:
        return conn.execute(sql, params).fetchall()
    finally:
        conn.close()
