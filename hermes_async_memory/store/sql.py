"""SQL text helpers shared by the store's modules."""

from __future__ import annotations

# Keys per IN (...) lookup, well under SQLite's bound-parameter limit.
KEY_CHUNK = 500


def sql_literal(text: str) -> str:
    """``text`` as an SQL string literal. Only for text without U+0000 (SQLite ends a
    literal there); the caller routes such text through bound parameters instead."""
    if "\x00" in text:
        raise ValueError("an SQL literal cannot hold U+0000")
    return "'" + text.replace("'", "''") + "'"
