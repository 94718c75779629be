"""``store.sql.single_statements``: a script cut into the statements a connection runs one at a
time (a batch with U+0000, a dead letter's retry, the word index's set-up). It steps over
literals, quoted names and comments whole; it must cut exactly where asking
``sqlite3.complete_statement`` at every ``;`` cuts, the way it was written before."""

from __future__ import annotations

import sqlite3

import pytest

from hermes_async_memory.store import schema, text_index, tool_log
from hermes_async_memory.store.sql import single_statements


def asked_at_every_semicolon(sql: str) -> list[str]:
    """The reference: the text so far checked at every ';' (quadratic in a long literal)."""
    out: list[str] = []
    start = 0
    end = sql.find(";")
    while end != -1:
        if sqlite3.complete_statement(sql[start:end + 1]):
            if sql[start:end].strip():
                out.append(sql[start:end + 1])
            start = end + 1
        end = sql.find(";", end + 1)
    if sql[start:].strip():
        out.append(sql[start:])
    return out


ROWS = ("(1,'a;b','t''s; x',NULL,2,0,'E;rr','it''s; \"q;\"',1.5,0),"
        "(3,'[x;]','-- not a comment; ',/* c; 'o' */ '/* nor; this */',4,1,NULL,NULL,NULL,0)")
SCRIPTS = [
    schema.SCHEMA,  # triggers: a ';' inside BEGIN ... END cuts nothing
    text_index.STEM_TABLE,
    text_index.WORD_INDEX_SWAP,
    tool_log.TEMP_TABLES,
    tool_log.LOG_ROWS.format(rows=ROWS),
    tool_log.TRIM.format(new="message_id > 0", limit=10, slack=1),
    "SELECT 'a;b''c;'; SELECT \"x;\"\"y\" FROM t; -- it's; a comment\nSELECT 1; "
    "/* a;'b */ SELECT [c;d] FROM `e;f`;;  ; SELECT 2",
    "SELECT 'unterminated; literal",
    "SELECT 1; /* unterminated; comment",
    "SELECT 1; -- a comment; at the end",
    "INSERT INTO t VALUES ('" + "x;" * 5_000 + "'); SELECT 2;",
    "", ";", "  \n ",
]


@pytest.mark.parametrize("sql", SCRIPTS, ids=range(len(SCRIPTS)))
def test_cut_where_complete_statement_cuts(sql: str) -> None:
    assert single_statements(sql) == asked_at_every_semicolon(sql)


def test_each_statement_runs_alone() -> None:
    conn = sqlite3.connect(":memory:")
    try:
        pieces = single_statements(schema.SCHEMA + tool_log.TEMP_TABLES
                                   + tool_log.LOG_ROWS.format(rows=ROWS))
        for piece in pieces:
            conn.execute(piece)  # raises if a piece held two statements, or half of one
        assert conn.execute("SELECT count(*) FROM sqlite_master WHERE type = 'trigger'"
                            ).fetchone()[0] > 0
    finally:
        conn.close()
