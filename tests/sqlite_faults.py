"""Connections to a SQLite built without one of its parts (the FTS5 module, the trigram
tokenizer), as faults a test cannot cause with the SQLite it has: a statement that would
need the missing part is refused with that SQLite's own message, whichever way it is run
(a connection's execute, executemany or executescript, or a cursor's execute); everything
else runs as it would."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import Any


def refusing_connection(needs: str, message: str) -> type[sqlite3.Connection]:
    """A ``sqlite3.Connection`` class (a ``factory=``) that raises
    ``OperationalError(message)`` for any statement whose text holds ``needs``."""

    def check(sql: str) -> None:
        if needs in sql:
            raise sqlite3.OperationalError(message)

    class Cursor(sqlite3.Cursor):
        def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
            check(sql)
            return super().execute(sql, *args)

    class Connection(sqlite3.Connection):
        def cursor(self, factory: Callable[..., sqlite3.Cursor] | None = None
                   ) -> sqlite3.Cursor:
            return super().cursor(factory or Cursor)

        def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
            check(sql)
            return super().execute(sql, *args)

        def executemany(self, sql: str, *args: Any) -> sqlite3.Cursor:
            check(sql)
            return super().executemany(sql, *args)

        def executescript(self, sql: str) -> sqlite3.Cursor:
            check(sql)
            return super().executescript(sql)

    return Connection
