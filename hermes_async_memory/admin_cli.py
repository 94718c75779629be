"""``hermes-memory status | search | sessions | dead-letters``: look into a memory file.

    hermes-memory status [--json]
    hermes-memory search QUERY (--user U | --session S) [--limit N] [--json]
    hermes-memory sessions list [--user U] [--limit N] [--json]
    hermes-memory sessions show ID [--json]
    hermes-memory sessions export [--output FILE|-] [--user U] [--session S]
    hermes-memory dead-letters list [--limit N] [--json]
    hermes-memory dead-letters replay (KEY ... | --all)

Every command takes ``--db PATH`` (default: ``Settings.from_env().db_path``). Reads open the
file read-only (``mode=ro``) and take no lock, so they work beside a running worker; only
``dead-letters replay`` writes, through the store's own transaction. Only argparse and the
standard library are imported here at start-up; a command imports what it needs.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import struct
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import quote

from .errors import ConfigurationError
from .extras import require

if TYPE_CHECKING:
    from .outbox import RecordSummary
    from .settings import Settings

PROG = "hermes-memory"
EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
DEFAULT_SEARCH_LIMIT = 10
DEFAULT_LIST_LIMIT = 50
DEFAULT_DEAD_LIMIT = 100
_KEY_CHUNK = 500  # keys per IN (...) lookup, well under SQLite's bound-parameter limit
_ERROR_PREVIEW_CHARS = 100
_TABLES = ("schema_version", "sessions", "messages", "messages_fts", "outbox")
# An outbox record: [u32 length][u32 crc32][payload], the length written last (outbox.py).
_RECORD_HEADER = struct.Struct("<II")
_SEGMENT_SUFFIX = ".seg"
_MESSAGE_COLUMNS = ("id, session_id, turn_key, role, content, tool_calls, tool_call_id, "
                    "tool_name, timestamp, user_id, metadata")

Handler = Callable[[argparse.Namespace], int]


def register(commands: Any) -> None:
    """Add this module's subcommands to ``commands`` (argparse sub-parsers)."""
    db = argparse.ArgumentParser(add_help=False)
    db.add_argument(
        "--db", type=Path, metavar="PATH",
        help="the store file (default: $HERMES_MEMORY_DB_PATH, else memory.db in the user "
             "data directory)",
    )
    as_json = argparse.ArgumentParser(add_help=False)
    as_json.add_argument("--json", action="store_true", help="print JSON")

    status = commands.add_parser(
        "status", parents=[db, as_json], help="counts, outbox depth, lag and dead letters",
        description="Show the store's counts, the turns accepted but not committed yet (the "
                    "outbox depth), the age of the oldest of them, and the dead letters. "
                    "Reads only; works while a worker runs on the file.",
    )
    status.set_defaults(handler=_guarded(_status))

    search = commands.add_parser(
        "search", parents=[db, as_json], help="full-text search in one user's or session's memory",
        description="BM25 search over one user's (or one session's) messages, scoped as the "
                    "library's recall is. Words are quoted, never read as query syntax; words "
                    "too common to rank on are dropped unless nothing else is left.",
    )
    search.add_argument("query", metavar="QUERY")
    search.add_argument("--user", metavar="U", help="search this user's sessions")
    search.add_argument("--session", metavar="S", help="search this session (with --user: "
                                                       "this session of that user)")
    search.add_argument("--limit", type=_positive_int, default=DEFAULT_SEARCH_LIMIT,
                        metavar="N", help=f"hits at most (default {DEFAULT_SEARCH_LIMIT})")
    search.set_defaults(handler=_guarded(_search))

    sessions = commands.add_parser(
        "sessions", help="list, show or export sessions",
        description="List, show or export the stored sessions.",
    ).add_subparsers(dest="sessions_command", metavar="ACTION", required=True)
    listing = sessions.add_parser(
        "list", parents=[db, as_json], help="the newest sessions",
        description="List sessions, newest first.",
    )
    listing.add_argument("--user", metavar="U", help="only this user's sessions")
    listing.add_argument("--limit", type=_positive_int, default=DEFAULT_LIST_LIMIT, metavar="N",
                         help=f"sessions at most (default {DEFAULT_LIST_LIMIT})")
    listing.set_defaults(handler=_guarded(_sessions_list))
    show = sessions.add_parser(
        "show", parents=[db, as_json], help="one session and its messages",
        description="Show one session and its messages, in order.",
    )
    show.add_argument("session_id", metavar="ID")
    show.set_defaults(handler=_guarded(_sessions_show))
    export = sessions.add_parser(
        "export", parents=[db], help="sessions with their messages, as JSON lines",
        description="Write one JSON line per session: the session's row and its messages "
                    "in order. Streams, from one consistent snapshot of the store.",
    )
    export.add_argument("--output", "-o", default="-", metavar="FILE",
                        help="where to write (default -, standard output)")
    export.add_argument("--user", metavar="U", help="only this user's sessions")
    export.add_argument("--session", metavar="S", help="only this session")
    export.set_defaults(handler=_guarded(_sessions_export))

    dead = commands.add_parser(
        "dead-letters", help="turns the store refused: list or replay them",
        description="Turns that could not be stored after every retry.",
    ).add_subparsers(dest="dead_letters_command", metavar="ACTION", required=True)
    dead_list = dead.add_parser(
        "list", parents=[db, as_json], help="the dead letters, oldest first",
        description="List the dead letters, oldest first, with their last error.",
    )
    dead_list.add_argument("--limit", type=_positive_int, default=DEFAULT_DEAD_LIMIT,
                           metavar="N", help=f"entries at most (default {DEFAULT_DEAD_LIMIT})")
    dead_list.set_defaults(handler=_guarded(_dead_list))
    replay = dead.add_parser(
        "replay", parents=[db], help="commit dead letters again, under their own keys",
        description="Commit dead-lettered turns again, each with its original idempotency "
                    "key, in one transaction per turn. A turn that fails again stays dead "
                    "with the new error; the exit code is then 1.",
    )
    replay.add_argument("keys", nargs="*", metavar="KEY", help="the turn keys to replay")
    replay.add_argument("--all", action="store_true", help="replay every dead letter")
    for sub in (dead_list, replay):
        sub.add_argument(
            "--backend", metavar="NAME",
            help="a replica backend's dead letters (turns it refused or never took) instead "
                 "of the store's; replay sends them to that backend again",
        )
    replay.set_defaults(handler=_guarded(_dead_replay))


# -- plumbing --------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def _guarded(handler: Handler) -> Handler:
    """``handler``, quiet when the reader of its output goes away (``... | head``)."""

    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except BrokenPipeError:
            # Point stdout at /dev/null, so the interpreter's last flush does not fail again.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            return EXIT_FAILURE

    return run


def _usage_error(message: str) -> int:
    from .cli import fail

    return fail(PROG, ValueError(message), EXIT_USAGE)


def _settings(args: argparse.Namespace) -> Settings:
    """The settings from the environment, ``--db`` first.

    Raises:
        ConfigurationError: an environment variable does not parse.
    """
    from .settings import Settings

    if args.db is not None:
        return Settings.from_env(db_path=args.db)
    return Settings.from_env()


def _store_error(message: str) -> Exception:
    from .errors import StoreError

    return StoreError(message)


@contextmanager
def _read_only(settings: Settings) -> Iterator[sqlite3.Connection]:
    """A read-only connection to the store file, checked to be a store of ours.

    Raises:
        StoreError: no such file, not an SQLite file, or not a hermes-memory store.
    """
    from .store import SCHEMA_VERSION

    path = settings.db_path
    if not path.exists():
        raise _store_error(f"no memory store at {path} (give --db PATH or set "
                           "HERMES_MEMORY_DB_PATH)")
    if not path.is_file():
        raise _store_error(f"{path} is not a file")
    uri = "file:" + quote(str(path.resolve())) + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, isolation_level=None)
    except sqlite3.Error as exc:
        raise _store_error(f"cannot open {path}: {exc}") from exc
    conn.row_factory = sqlite3.Row  # rows read as dicts by column name
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(settings.busy_timeout_ms)}")
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
        missing = [t for t in _TABLES if t not in tables]
        if missing:
            raise _store_error(f"{path} is not a hermes-memory store (no table "
                               f"{', '.join(missing)})")
        row = conn.execute("SELECT max(version) FROM schema_version").fetchone()
        if row and row[0] is not None and row[0] > SCHEMA_VERSION:
            raise _store_error(f"{path} has schema version {row[0]}; this version of "
                               f"{PROG} knows {SCHEMA_VERSION}")
        yield conn
    except sqlite3.Error as exc:
        raise _store_error(f"cannot read {path}: {exc}") from exc
    finally:
        conn.close()


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(ts))


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _one_line(text: str | None, width: int) -> str:
    flat = " ".join((text or "").split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def _print_json(value: object) -> None:
    print(json.dumps(value, ensure_ascii=False, indent=2))


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Columns padded to their widest cell; the last column is left as it is."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    for row in [header, *rows]:
        cells = [cell.ljust(w) for cell, w in zip(row, widths, strict=False)] + [row[-1]]
        print("  ".join(cells).rstrip())


def _messages(conn: sqlite3.Connection, session_id: str) -> list[dict[str, Any]]:
    """A session's messages in order, as ``SqliteStore.get_messages`` returns them."""
    cur = conn.execute(
        f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE session_id = ? ORDER BY id",
        (session_id,),
    )
    out = []
    for row in cur:
        msg = dict(row)
        for name in ("tool_calls", "metadata"):
            if msg[name]:
                try:
                    msg[name] = json.loads(msg[name])
                except ValueError:
                    pass  # not JSON after all: shown as stored
        out.append(msg)
    return out


def _session_row(conn: sqlite3.Connection, session_id: str) -> dict[str, Any] | None:
    cur = conn.execute("SELECT * FROM sessions WHERE id = ?", (session_id,))
    row = cur.fetchone()
    return None if row is None else dict(row)


# -- status ----------------------------------------------------------------------------


@dataclass
class _OutboxScan:
    records: list[RecordSummary]
    segments: list[Path]


def _outbox_dirs(settings: Settings) -> list[Path]:
    """The outbox folders beside the store: the pipeline's, and any producer slots'."""
    main = settings.outbox_dir
    found = [main] if main.is_dir() else []
    found += sorted(p for p in main.parent.glob(main.name + "-p*")
                    if p.is_dir() and p.name[len(main.name) + 2:].isdigit())
    return found


def _scan_outbox(settings: Settings) -> _OutboxScan:
    """Every intact record in the outbox folders, read-only and without their locks.

    Raises:
        OSError: a folder or segment cannot be read (permissions).
    """
    from .outbox import inspect

    scan = _OutboxScan([], [])
    for directory in _outbox_dirs(settings):
        segments, records = inspect(directory)
        scan.segments += segments
        scan.records += records
    return scan


def _settled_keys(conn: sqlite3.Connection, keys: list[str]) -> set[str]:
    """Which of these keys the store holds as done or dead (or, if the store has a shared
    inbox, holds there: accepted, and counted with the inbox)."""
    tables = ["outbox"]
    if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'inbox'").fetchone():
        tables.append("inbox")
    found: set[str] = set()
    for i in range(0, len(keys), _KEY_CHUNK):
        chunk = keys[i : i + _KEY_CHUNK]
        marks = ",".join("?" * len(chunk))
        for table in tables:
            found.update(r[0] for r in conn.execute(
                f"SELECT key FROM {table} WHERE key IN ({marks})", chunk))
    return found


def _status(args: argparse.Namespace) -> int:
    settings = _settings(args)
    report: dict[str, Any] = {"db": str(settings.db_path)}
    with _read_only(settings) as conn:
        # The segments first, the store second: a turn committed in between then counts as
        # committed, never as both or neither.
        scan: _OutboxScan | None
        try:
            scan = _scan_outbox(settings)
            outbox_error = None
        except OSError as exc:
            scan, outbox_error = None, f"cannot read the outbox: {exc}"
        conn.execute("BEGIN")  # one snapshot for every count
        report["messages"] = conn.execute("SELECT count(*) FROM messages").fetchone()[0]
        report["sessions"] = conn.execute("SELECT count(*) FROM sessions").fetchone()[0]
        by_status = dict(conn.execute("SELECT status, count(*) FROM outbox GROUP BY status"))
        settled = (_settled_keys(conn, [r.key for r in scan.records if r.key is not None])
                   if scan else set())
        # Turns producers handed to the shared inbox wait there for a worker to commit them.
        inbox_turns, inbox_oldest = 0, None
        if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'inbox'").fetchone():
            inbox_turns, inbox_oldest = conn.execute(
                "SELECT count(*), min(accepted_at) FROM inbox").fetchone()
        # Each replica backend's own outbox: turns it does not have yet, and its dead letters.
        replicas: dict[str, dict[str, int]] = {}
        if conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'replica_outbox'").fetchone():
            for backend, status, n in conn.execute(
                    "SELECT backend, status, count(*) FROM replica_outbox "
                    "GROUP BY backend, status ORDER BY backend"):
                replicas.setdefault(backend, {"pending": 0, "dead": 0})[status] = n
        conn.execute("COMMIT")
    now = time.time()
    pending: list[RecordSummary] = []
    if scan is not None:
        # A segment file is deleted only once all its turns are settled; one gone since the
        # scan may have had its done keys pruned meanwhile, so it counts as settled.
        live = {p for p in scan.segments if p.exists()}
        pending = [r for r in scan.records
                   if r.segment in live and (r.key is None or r.key not in settled)]
    accepted = [r.accepted_at for r in pending if r.accepted_at is not None]
    if inbox_oldest is not None:
        accepted.append(inbox_oldest)
    report.update(
        outbox_pending_turns=None if scan is None else len(pending) + inbox_turns,
        outbox_segment_files=None if scan is None else len(scan.segments),
        inbox_turns=inbox_turns,
        outbox_unreadable_records=sum(r.key is None for r in pending),
        outbox_error=outbox_error,
        lag_s=round(max(0.0, now - min(accepted)), 3) if accepted else None,
        dead_letters=by_status.get("dead", 0),
        outbox_table=by_status,
        replicas=replicas,
    )
    if args.json:
        _print_json(report)
        return EXIT_OK
    _print_status(report)
    return EXIT_OK


def _print_status(r: dict[str, Any]) -> None:
    rows = [("store", r["db"]), ("messages", str(r["messages"])),
            ("sessions", str(r["sessions"]))]
    table = ", ".join(f"{k} {v}" for k, v in sorted(r["outbox_table"].items())) or "empty"
    if r["outbox_pending_turns"] is None:
        rows.append(("outbox", f"unknown ({r['outbox_error']}); the outbox table holds "
                               f"{table}"))
    else:
        files = r["outbox_segment_files"]
        line = (f"{r['outbox_pending_turns']} turns accepted, not committed yet "
                f"({files} segment file{'' if files == 1 else 's'})")
        if r["inbox_turns"]:
            line += f"; {r['inbox_turns']} of them handed in to the shared inbox"
        if r["outbox_unreadable_records"]:
            line += f"; {r['outbox_unreadable_records']} records do not decode"
        rows.append(("outbox", line))
    rows.append(("lag", "-" if r["lag_s"] is None
                 else f"{_age(r['lag_s'])} (the oldest turn not committed yet)"))
    rows.append(("dead letters", str(r["dead_letters"])))
    rows.append(("outbox table", table))
    for backend, counts in r["replicas"].items():
        rows.append((f"replica {backend}", f"{counts['pending']} turns to send, "
                                           f"{counts['dead']} dead letters"))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name.ljust(width)}  {value}")


# -- search ----------------------------------------------------------------------------


def _search(args: argparse.Namespace) -> int:
    if not args.user and not args.session:
        return _usage_error("search needs --user or --session: a search reads one user's "
                            "or one session's memory")
    from .recall import match_expression
    from .recall import quote as quote_term
    from .store.messages import SEARCH as _SEARCH
    from .turns import scope_token_for

    settings = _settings(args)
    hits: list[dict[str, Any]] = []
    with _read_only(settings) as conn:
        terms = _search_terms(conn, args.query, settings)
        if terms:
            match = match_expression(terms, scope_token_for(args.user, args.session))
            if args.user and args.session:
                match += f" AND scope:{quote_term(scope_token_for(None, args.session))}"
            rows = conn.execute(_SEARCH, (settings.recall_snippet_tokens, match, args.limit))
            hits = [{"message_id": r[0], "session_id": r[1], "role": r[2], "timestamp": r[3],
                     "snippet": " ".join(r[4].split())} for r in rows]
    if args.json:
        _print_json(hits)
    elif not hits:
        print("no matches")
    else:
        _table(["SESSION", "ROLE", "TIME", "SNIPPET"],
               [[h["session_id"], h["role"], _when(h["timestamp"]), h["snippet"]]
                for h in hits])
    return EXIT_OK


def _search_terms(conn: sqlite3.Connection, query: str, settings: Settings) -> list[str]:
    """The query's terms, less those found in too many messages to rank on (the library's
    cut-off), unless that would leave none: here a person asked, and waits for an answer."""
    from .recall import query_terms

    terms = query_terms(query, frozenset(), max_terms=len(query))
    row = conn.execute("SELECT coalesce(max(id), 0) FROM messages").fetchone()
    limit = max(settings.frequent_term_rows, int(settings.frequent_term_ratio * row[0]))
    rare = [t for t in terms if _term_rows(conn, t) <= limit]
    return (rare or terms)[: settings.recall_max_terms]


def _term_rows(conn: sqlite3.Connection, term: str) -> int:
    row = conn.execute(
        "SELECT doc FROM messages_vocab WHERE col = 'content' AND term = ?", (term,)
    ).fetchone()
    return int(row[0]) if row else 0


# -- sessions --------------------------------------------------------------------------


def _sessions_list(args: argparse.Namespace) -> int:
    settings = _settings(args)
    where, params = ("WHERE user_id = ?", [args.user]) if args.user else ("", [])
    with _read_only(settings) as conn:
        cur = conn.execute(
            "SELECT id, user_id, source, model, message_count, started_at, updated_at "
            f"FROM sessions {where} ORDER BY started_at DESC, id LIMIT ?",
            [*params, args.limit],
        )
        sessions = [dict(r) for r in cur]
    if args.json:
        _print_json(sessions)
    elif not sessions:
        print(f"no sessions for user {args.user}" if args.user else "no sessions")
    else:
        _table(["SESSION", "USER", "MESSAGES", "STARTED", "UPDATED"],
               [[s["id"], s["user_id"] or "-", str(s["message_count"]), _when(s["started_at"]),
                 _when(s["updated_at"])] for s in sessions])
    return EXIT_OK


def _sessions_show(args: argparse.Namespace) -> int:
    settings = _settings(args)
    with _read_only(settings) as conn:
        conn.execute("BEGIN")
        session = _session_row(conn, args.session_id)
        if session is None:
            raise _store_error(f"no session {args.session_id!r} in {settings.db_path}")
        messages = _messages(conn, args.session_id)
        conn.execute("COMMIT")
    if args.json:
        _print_json({**session, "messages": messages})
        return EXIT_OK
    fields = [("session", session["id"]), ("user", session["user_id"] or "-"),
              ("source", session["source"]), ("model", session["model"] or "-"),
              ("parent", session["parent_session_id"] or "-"),
              ("started", _when(session["started_at"])),
              ("updated", _when(session["updated_at"])),
              ("messages", f"{session['message_count']} ({session['tool_call_count']} tool "
                           f"calls; tokens {session['input_tokens']} in, "
                           f"{session['output_tokens']} out)")]
    for name, value in fields:
        print(f"{name.ljust(8)}  {value}")
    for m in messages:
        name = f" {m['tool_name']}" if m["tool_name"] else ""
        print(f"\n[{_when(m['timestamp'])}] {m['role']}{name}:")
        for line in (m["content"] or "").splitlines() or [""]:
            print(f"  {line}")
        if m["tool_calls"]:
            print(f"  tool calls: {json.dumps(m['tool_calls'], ensure_ascii=False)}")
    return EXIT_OK


def _sessions_export(args: argparse.Namespace) -> int:
    settings = _settings(args)
    clauses, params = [], []
    if args.user:
        clauses.append("user_id = ?")
        params.append(args.user)
    if args.session:
        clauses.append("id = ?")
        params.append(args.session)
    where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
    to_stdout = args.output == "-"
    with _read_only(settings) as conn:
        conn.execute("BEGIN")  # one snapshot: the export is consistent however long it takes
        total = conn.execute(f"SELECT count(*) FROM sessions {where}", params).fetchone()[0]
        if args.session and total == 0:
            raise _store_error(f"no session {args.session!r} in {settings.db_path}"
                               + (f" for user {args.user!r}" if args.user else ""))
        cur = conn.execute(f"SELECT * FROM sessions {where} ORDER BY started_at, id", params)
        show_progress = sys.stderr.isatty() and not (to_stdout and sys.stdout.isatty())
        with _output(args.output) as write, _progress(total, show_progress) as advance:
            n_messages = 0
            for row in cur:
                session = dict(row)
                messages = _messages(conn, session["id"])
                n_messages += len(messages)
                write(json.dumps({**session, "messages": messages}, ensure_ascii=False) + "\n")
                advance()
        conn.execute("COMMIT")
    if not to_stdout:
        print(f"exported {total} sessions ({n_messages} messages) to {args.output}")
    return EXIT_OK


@contextmanager
def _output(target: str) -> Iterator[Callable[[str], None]]:
    """A line writer to stdout, or to a file that appears whole or not at all."""
    if target == "-":
        sys.stdout.flush()
        stream: IO[bytes] | None = getattr(sys.stdout, "buffer", None)
        if stream is None:
            yield _text_writer(sys.stdout)
        else:
            yield _utf8_writer(stream)
            stream.flush()
        return
    path = Path(target)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(partial, "wb") as f:
            yield _utf8_writer(f)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def _utf8_writer(stream: IO[bytes]) -> Callable[[str], None]:
    def write(line: str) -> None:
        # backslashreplace: a lone surrogate (which the store never holds) would become its
        # JSON escape, inside a string, instead of an error halfway through the export.
        stream.write(line.encode("utf-8", "backslashreplace"))

    return write


def _text_writer(stream: IO[str]) -> Callable[[str], None]:
    def write(line: str) -> None:
        stream.write(line)

    return write


@contextmanager
def _progress(total: int, show: bool) -> Iterator[Callable[[], None]]:
    """An ``advance()`` that moves a progress bar on stderr, or does nothing."""
    if not show:
        yield lambda: None
        return
    try:
        console = require("rich.console", "cli", "the export progress bar")
        bar = require("rich.progress", "cli", "the export progress bar")
    except ConfigurationError as exc:  # the export itself needs no extra: go on without
        print(f"{PROG}: {exc}", file=sys.stderr)
        yield lambda: None
        return
    with bar.Progress(
        bar.TextColumn("exporting sessions"), bar.BarColumn(), bar.MofNCompleteColumn(),
        bar.TimeRemainingColumn(), console=console.Console(file=sys.stderr), transient=True,
    ) as progress:
        task = progress.add_task("export", total=total)
        yield lambda: progress.advance(task)


# -- dead letters ----------------------------------------------------------------------


def _dead_list(args: argparse.Namespace) -> int:
    settings = _settings(args)
    with _read_only(settings) as conn:
        conn.execute("BEGIN")
        if args.backend:
            where = "FROM replica_outbox WHERE status = 'dead' AND backend = ?"
            total = conn.execute(f"SELECT count(*) {where}", (args.backend,)).fetchone()[0]
            cur = conn.execute(
                f"SELECT turn_key AS key, session_id, attempts, last_error, updated_at {where} "
                "ORDER BY id LIMIT ?", (args.backend, args.limit))
            replica_dead: list[tuple[str, int]] = []
        else:
            total = conn.execute(
                "SELECT count(*) FROM outbox WHERE status = 'dead'").fetchone()[0]
            cur = conn.execute(
                "SELECT key, session_id, attempts, last_error, accepted_at, updated_at "
                "FROM outbox WHERE status = 'dead' ORDER BY updated_at, key LIMIT ?",
                (args.limit,))
            replica_dead = _replica_dead_counts(conn)
        dead = [dict(r) for r in cur]
        conn.execute("COMMIT")
    if args.json:
        _print_json(dead)
        return EXIT_OK
    if not dead:
        print("no dead letters")
        for backend, n in replica_dead:
            print(f"{n} dead letters of backend {backend!r}: "
                  f"dead-letters list --backend {backend}")
        return EXIT_OK
    _table(["KEY", "SESSION", "ATTEMPTS", "DEAD SINCE", "LAST ERROR"],
           [[d["key"], d["session_id"], str(d["attempts"]), _when(d["updated_at"]),
             _one_line(d["last_error"], _ERROR_PREVIEW_CHARS)] for d in dead])
    if total > len(dead):
        print(f"({len(dead)} of {total} shown; --limit N for more)")
    for backend, n in replica_dead:
        print(f"{n} dead letters of backend {backend!r}: dead-letters list --backend {backend}")
    return EXIT_OK


def _replica_dead_counts(conn: sqlite3.Connection) -> list[tuple[str, int]]:
    """Dead letters per replica backend (none in a store from before replica outboxes)."""
    try:
        return [(str(r[0]), int(r[1])) for r in conn.execute(
            "SELECT backend, count(*) FROM replica_outbox WHERE status = 'dead' "
            "GROUP BY backend ORDER BY backend")]
    except sqlite3.OperationalError:
        return []


def _dead_replay(args: argparse.Namespace) -> int:
    if args.all == bool(args.keys):
        return _usage_error("dead-letters replay needs the KEYs to replay, or --all "
                            "(not both)")
    import asyncio

    settings = _settings(args)
    if args.backend:
        return _replica_replay(settings, args.backend, None if args.all else list(args.keys))
    # Checked read-only first: the store's open() would add its tables to any SQLite file.
    with _read_only(settings) as conn:
        keys = ([r[0] for r in conn.execute(
                    "SELECT key FROM outbox WHERE status = 'dead' ORDER BY updated_at, key")]
                if args.all else list(args.keys))
    if not keys:
        print("no dead letters to replay")
        return EXIT_OK
    replayed, failed = asyncio.run(_replay(settings, keys))
    for key in replayed:
        print(f"replayed  {key}")
    for key, error in failed.items():
        print(f"failed    {key}  {_one_line(error, _ERROR_PREVIEW_CHARS)}")
    print(f"{len(replayed)} replayed, {len(failed)} failed")
    if failed:
        from .cli import fail

        return fail(PROG, _store_error(
            f"{len(failed)} of {len(keys)} dead letters were not replayed; a turn that "
            "failed again stays dead with the new error (dead-letters list)"), EXIT_FAILURE)
    return EXIT_OK


def _replica_replay(settings: Settings, backend: str, keys: list[str] | None) -> int:
    """Hand a backend's dead letters back to its outbox; the replicator of the pipeline
    running on this store (the worker) sends them, saying they may have been sent before."""
    with _read_only(settings):
        pass  # a store of ours, checked before anything writes to it
    conn = sqlite3.connect(settings.db_path, timeout=settings.busy_timeout_ms / 1000,
                           isolation_level=None)
    try:
        where = "backend = ? AND status = 'dead'"
        params: list[object] = [backend]
        if keys is not None:
            where += f" AND turn_key IN ({','.join('?' * len(keys))})"
            params += keys
        # attempts = 1: not a first send, so the backend first checks what it already holds.
        cur = conn.execute(
            f"UPDATE replica_outbox SET status = 'pending', attempts = 1 WHERE {where}", params)
        requeued = cur.rowcount
    finally:
        conn.close()
    print(f"{requeued} dead letters of backend {backend!r} queued to be sent again")
    if keys is not None and requeued < len(keys):
        from .cli import fail

        return fail(PROG, _store_error(
            f"{len(keys) - requeued} of {len(keys)} keys are not dead letters of backend "
            f"{backend!r}"), EXIT_FAILURE)
    return EXIT_OK


async def _replay(settings: Settings, keys: list[str]) -> tuple[list[str], dict[str, str]]:
    from .store import SqliteStore

    store = SqliteStore(settings.db_path, readers=0, busy_timeout_ms=settings.busy_timeout_ms,
                        source=settings.source)
    if settings.backend != "null":
        # A replayed turn also goes to the replica backend the worker runs with.
        store.replica = settings.backend
    await store.open()
    try:
        return await store.replay_dead_letters(keys)
    finally:
        await store.aclose()


__all__ = ["register"]
