"""The embedded SQLite store: the only place with SQL.

``SqliteStore`` is the one class the library uses. Its parts, one module each, are the data
they hold: ``connections`` (opening, pragmas, closing), ``schema`` (tables and migrations),
``batch`` (one group commit's statements), ``messages`` (messages and sessions),
``memories`` (key-value memory), ``lifecycle`` (session lifecycle events), ``keys``
(done keys), ``inbox`` (the shared inbox), ``recalls`` (recall requests and results),
``replica`` (the replica outbox), ``tool_log`` (procedural memory's tool calls),
``templates`` (warm-start templates and the sessions started from them),
``session_state`` (Hermes Agent's key-value state and compression locks),
``session_filters`` (a bulk prune's or archive's filters) and ``dead_letters``; ``sql``
holds the helpers they share.
``inspect.StoreReader`` reads a store file read-only and synchronously, for the admin CLI.
"""

from __future__ import annotations

from .batch import Batch
from .connections import STATEMENT_BUSY_MS
from .dead_letters import DeadLetter, DeadLetters
from .inbox import Inbox
from .keys import DoneKeys
from .lifecycle import Lifecycle
from .memories import EntryRow, Memories
from .messages import Hit, Messages, PoolRow, Said, StoredTurn
from .recalls import Recalls
from .replica import ReplicaOutbox, ReplicaRow
from .schema import SCHEMA, SCHEMA_VERSION
from .session_filters import InvalidFilterError, SessionFilter
from .session_state import SessionState
from .sessions import SessionQueries
from .sql import sql_literal
from .templates import Templates
from .tool_log import CallRow, ToolLog, ToolLogConfig


class SqliteStore(Messages, Memories, Lifecycle, DoneKeys, Inbox, Recalls, ReplicaOutbox,
                  DeadLetters, SessionQueries, SessionState, ToolLog, Templates):
    """The system of record. ``open()`` before use, ``aclose()`` after.

    One class over the parts, each a table's reads and writes on the connections they
    share (``Connections``): the library holds one object, and the parts share its settings
    (``source``, ``replica``, the clock) and the writer's transaction hook.
    """


__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "STATEMENT_BUSY_MS",
    "Batch",
    "CallRow",
    "DeadLetter",
    "EntryRow",
    "Hit",
    "InvalidFilterError",
    "PoolRow",
    "ReplicaRow",
    "Said",
    "SessionFilter",
    "SqliteStore",
    "StoredTurn",
    "ToolLogConfig",
    "sql_literal",
]
