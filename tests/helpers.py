"""Helpers that read a store file directly, as a user inspecting it would."""

from __future__ import annotations

import sqlite3
from collections import defaultdict
from pathlib import Path


def stored_turns(db_path: Path) -> dict[str, list[tuple[str, str, str]]]:
    """Every stored message, straight from the file: session -> [(turn_key, role, content)]."""
    conn = sqlite3.connect(db_path)
    try:
        rows = conn.execute(
            "SELECT session_id, turn_key, role, content FROM messages ORDER BY id"
        ).fetchall()
    finally:
        conn.close()
    out: dict[str, list[tuple[str, str, str]]] = defaultdict(list)
    for session_id, key, role, content in rows:
        out[session_id].append((key, role, content))
    return out


def count_rows(db_path: Path, sql: str = "SELECT count(*) FROM messages") -> int:
    conn = sqlite3.connect(db_path)
    try:
        return int(conn.execute(sql).fetchone()[0])
    finally:
        conn.close()
