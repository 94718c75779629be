"""``hermes-memory sessions ...``: the stored sessions, their messages, and their lifecycle.

    hermes-memory sessions list [--source S] [--user U] [--limit N] [--offset N] [--json]
    hermes-memory sessions show ID [--json]
    hermes-memory sessions conversation ID
    hermes-memory sessions chain ID [--json]
    hermes-memory sessions counts [--source S] [--user U] [--session S] [--json]
    hermes-memory sessions export [--output FILE|-] [--user U] [--session S]
    hermes-memory sessions import FILE|- [--json]
    hermes-memory sessions end ID [--reason R] [--json]
    hermes-memory sessions delete ID [--json]
    hermes-memory sessions prune --older-than DAYS [--source S] [--json]

Reads are the library's session reads on the store file, opened read-only (no lock, beside
a running worker). The writes go through the durable path, as the library's do: the CLI
opens the store's pipeline (or, when a worker process holds it, hands the events to that
worker through the shared inbox) and waits for them to commit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import anyio

from ..errors import ConfigurationError
from ..extras import require
from . import PROG
from .common import (
    EXIT_OK,
    db_option,
    guarded,
    json_option,
    non_negative_int,
    one_line,
    positive_int,
    print_json,
    session_reads,
    settings_of,
    store_error,
    table,
    when,
    writing,
)

DEFAULT_LIST_LIMIT = 50
PROMPT_WIDTH = 100  # characters of the system prompt that ``show`` prints


def register(commands: Any) -> None:
    """Add ``sessions`` and its actions to ``commands`` (argparse sub-parsers)."""
    db, as_json = db_option(), json_option()
    sessions = commands.add_parser(
        "sessions", help="read, export, import, end, delete or prune sessions",
        description="The stored sessions: read them, export and import them, end, delete "
                    "or prune them.",
    ).add_subparsers(dest="sessions_command", metavar="ACTION", required=True)
    listing = sessions.add_parser(
        "list", parents=[db, as_json], help="the newest sessions",
        description="List sessions, newest first.",
    )
    listing.add_argument("--source", metavar="S", help="only sessions from this source")
    listing.add_argument("--user", metavar="U", help="only this user's sessions")
    listing.add_argument("--limit", type=positive_int, default=DEFAULT_LIST_LIMIT, metavar="N",
                         help=f"sessions at most (default {DEFAULT_LIST_LIMIT})")
    listing.add_argument("--offset", type=non_negative_int, default=0, metavar="N",
                         help="skip the first N sessions (the next page)")
    listing.set_defaults(handler=guarded(_sessions_list))
    show = sessions.add_parser(
        "show", parents=[db, as_json], help="one session and its messages",
        description="Show one session and its messages, in order.",
    )
    show.add_argument("session_id", metavar="ID")
    show.set_defaults(handler=guarded(_sessions_show))
    conversation = sessions.add_parser(
        "conversation", parents=[db], help="a session as OpenAI chat messages (JSON)",
        description="Print a session's messages as a JSON list in OpenAI chat format, each "
                    "tool result right after the call it answers.",
    )
    conversation.add_argument("session_id", metavar="ID")
    conversation.set_defaults(handler=guarded(_sessions_conversation))
    chain = sessions.add_parser(
        "chain", parents=[db, as_json], help="a session's parents and children",
        description="Walk a session's parent_session_id chain: its ancestors, oldest first, "
                    "and its descendants, breadth first.",
    )
    chain.add_argument("session_id", metavar="ID")
    chain.set_defaults(handler=guarded(_sessions_chain))
    counts = sessions.add_parser(
        "counts", parents=[db, as_json], help="how many sessions and messages",
        description="Count the stored sessions and their messages.",
    )
    counts.add_argument("--source", metavar="S", help="only sessions from this source")
    counts.add_argument("--user", metavar="U", help="only this user's")
    counts.add_argument("--session", metavar="S", help="only this session")
    counts.set_defaults(handler=guarded(_sessions_counts))
    export = sessions.add_parser(
        "export", parents=[db], help="sessions with their messages, as JSON lines",
        description="Write one JSON line per session: the session's row and its messages "
                    "in order. Streams, from one consistent snapshot of the store.",
    )
    export.add_argument("--output", "-o", default="-", metavar="FILE",
                        help="where to write (default -, standard output)")
    export.add_argument("--user", metavar="U", help="only this user's sessions")
    export.add_argument("--session", metavar="S", help="only this session")
    export.set_defaults(handler=guarded(_sessions_export))
    imports = sessions.add_parser(
        "import", parents=[db, as_json], help="import exported sessions",
        description="Import the JSON lines of an export: each session as it was, ids kept. "
                    "Every line is checked before any is accepted: a bad line refuses the "
                    "whole file. A session already in the store is skipped, so a second "
                    "import of a file changes nothing (and completes one cut short). Once "
                    "committed, the store is read back: what it lacks is an error.",
    )
    imports.add_argument("input", metavar="FILE", help="the export to read (- for stdin)")
    imports.set_defaults(handler=guarded(_sessions_import))
    end = sessions.add_parser(
        "end", parents=[db, as_json], help="mark a session ended",
        description="Mark a session ended now, with a reason.",
    )
    end.add_argument("session_id", metavar="ID")
    end.add_argument("--reason", default="ended_by_admin", metavar="R",
                     help="why it ended (default ended_by_admin)")
    end.set_defaults(handler=guarded(_sessions_end))
    delete = sessions.add_parser(
        "delete", parents=[db, as_json], help="delete a session and its messages",
        description="Delete a session with its messages, their index rows and its cached "
                    "recall blocks. Its turns still pending go with it.",
    )
    delete.add_argument("session_id", metavar="ID")
    delete.set_defaults(handler=guarded(_sessions_delete))
    prune = sessions.add_parser(
        "prune", parents=[db, as_json], help="delete old ended sessions",
        description="Delete the sessions that ended more than DAYS ago and have had nothing "
                    "stored since. Never an open session, nor one with a pending turn.",
    )
    prune.add_argument("--older-than", type=float, required=True, metavar="DAYS",
                       dest="older_than", help="age in days since the session ended")
    prune.add_argument("--source", metavar="S", help="only sessions from this source")
    prune.set_defaults(handler=guarded(_sessions_prune))


def _sessions_list(args: argparse.Namespace) -> int:
    async def run() -> list[dict[str, Any]]:
        async with session_reads(settings_of(args)) as reads:
            found = await reads.list_sessions(source=args.source, user_id=args.user,
                                              limit=args.limit, offset=args.offset)
        return [s.as_dict() for s in found]

    sessions = anyio.run(run)
    if args.json:
        print_json(sessions)
    elif not sessions:
        print("no sessions" + (f" for user {args.user}" if args.user else "")
              + (f" from {args.source}" if args.source else ""))
    else:
        table(["SESSION", "USER", "SOURCE", "MESSAGES", "STARTED", "ENDED"],
              [[s["id"], s["user_id"] or "-", s["source"], str(s["message_count"]),
                when(s["started_at"]), _ended(s)] for s in sessions])
    return EXIT_OK


def _sessions_show(args: argparse.Namespace) -> int:
    settings = settings_of(args)

    async def run() -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        async with session_reads(settings) as reads:
            session = await reads.get_session(args.session_id)
            messages = [] if session is None else await reads.messages(args.session_id)
        return (None if session is None else session.as_dict()), messages

    session, messages = anyio.run(run)
    if session is None:
        raise store_error(f"no session {args.session_id!r} in {settings.db_path}")
    if args.json:
        print_json({**session, "messages": messages})
        return EXIT_OK
    estimated = " (estimated)" if session["tokens_estimated"] else ""
    fields = [("session", session["id"]), ("user", session["user_id"] or "-"),
              ("source", session["source"]), ("model", session["model"] or "-"),
              ("parent", session["parent_session_id"] or "-"),
              ("started", when(session["started_at"])),
              ("updated", when(session["updated_at"])), ("ended", _ended(session)),
              ("messages", f"{session['message_count']} ({session['tool_call_count']} tool "
                           f"calls; tokens {session['input_tokens']} in, "
                           f"{session['output_tokens']} out{estimated})")]
    if session["model_config"]:
        fields.append(("config", json.dumps(session["model_config"], ensure_ascii=False)))
    if session["system_prompt"]:
        fields.append(("prompt", one_line(session["system_prompt"], PROMPT_WIDTH)))
    for name, value in fields:
        print(f"{name.ljust(8)}  {value}")
    for m in messages:
        name = f" {m['tool_name']}" if m["tool_name"] else ""
        tokens = f" ({m['token_count']} tokens)" if m["token_count"] is not None else ""
        print(f"\n[{when(m['timestamp'])}] {m['role']}{name}{tokens}:")
        for line in (m["content"] or "").splitlines() or [""]:
            print(f"  {line}")
        if m["tool_calls"]:
            print(f"  tool calls: {json.dumps(m['tool_calls'], ensure_ascii=False)}")
    return EXIT_OK


def _sessions_conversation(args: argparse.Namespace) -> int:
    settings = settings_of(args)

    async def run() -> list[dict[str, Any]] | None:
        async with session_reads(settings) as reads:
            if await reads.get_session(args.session_id) is None:
                return None
            return await reads.conversation(args.session_id)

    messages = anyio.run(run)
    if messages is None:
        raise store_error(f"no session {args.session_id!r} in {settings.db_path}")
    print_json(messages)
    return EXIT_OK


def _sessions_chain(args: argparse.Namespace) -> int:
    settings = settings_of(args)

    async def run() -> tuple[dict[str, Any] | None, dict[str, Any]]:
        async with session_reads(settings) as reads:
            session = await reads.get_session(args.session_id)
            found = await reads.chain(args.session_id)
        return (None if session is None else session.as_dict()), found.as_dict()

    session, chain = anyio.run(run)
    if session is None and not chain["descendants"]:
        raise store_error(f"no session {args.session_id!r} in {settings.db_path}")
    if args.json:
        print_json(chain)
        return EXIT_OK
    rows = [["ancestor", s["id"], s["source"], when(s["started_at"]), _ended(s)]
            for s in chain["ancestors"]]
    if chain["missing_parent"]:
        rows.insert(0, ["missing", chain["missing_parent"], "-", "-", "(not stored)"])
    rows.append(["this", args.session_id, session["source"] if session else "-",
                 when(session["started_at"]) if session else "-",
                 _ended(session) if session else "(not stored)"])
    rows += [["descendant", s["id"], s["source"], when(s["started_at"]), _ended(s)]
             for s in chain["descendants"]]
    table(["", "SESSION", "SOURCE", "STARTED", "ENDED"], rows)
    if chain["truncated"]:
        print("(cut at the walk's bounds: there is more)")
    return EXIT_OK


def _sessions_counts(args: argparse.Namespace) -> int:
    async def run() -> dict[str, Any]:
        async with session_reads(settings_of(args)) as reads:
            found = await reads.counts(source=args.source, user_id=args.user,
                                       session_id=args.session)
        return found.as_dict()

    counts = anyio.run(run)
    if args.json:
        print_json(counts)
    else:
        print(f"{counts['sessions']} sessions, {counts['messages']} messages")
    return EXIT_OK


def _ended(session: dict[str, Any]) -> str:
    if session["ended_at"] is None:
        return "-"
    return f"{when(session['ended_at'])} ({session['end_reason'] or 'no reason'})"


def _sessions_export(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    to_stdout = args.output == "-"
    show_progress = sys.stderr.isatty() and not (to_stdout and sys.stdout.isatty())

    async def run() -> tuple[int, int]:
        async with session_reads(settings) as reads:
            counts = await reads.counts(user_id=args.user, session_id=args.session)
            if args.session and counts.sessions == 0:
                raise store_error(f"no session {args.session!r} in {settings.db_path}"
                                  + (f" for user {args.user!r}" if args.user else ""))
            exported = n_messages = 0
            with _output(args.output) as write, \
                    _progress(counts.sessions, show_progress) as advance:
                # One snapshot: the export is consistent however long it takes.
                async for line in reads.export(user_id=args.user, session_id=args.session):
                    write(line)
                    exported += 1
                    n_messages += line.messages
                    advance()
        return exported, n_messages

    exported, n_messages = anyio.run(run)
    if not to_stdout:
        print(f"exported {exported} sessions ({n_messages} messages) to {args.output}")
    return EXIT_OK


def _sessions_import(args: argparse.Namespace) -> int:
    from ..sessions.transfer import InvalidImportError, import_sessions

    path = None if args.input == "-" else Path(args.input)
    if path is not None and not path.is_file():
        raise store_error(f"no file {args.input}")
    total = sum(1 for _ in path.open("rb")) if path is not None else 0
    show_progress = path is not None and sys.stderr.isatty()

    async def run() -> dict[str, Any]:
        stream = path.open("rb") if path is not None else sys.stdin.buffer
        try:
            with _progress(total, show_progress, "importing sessions") as advance:
                def lines() -> Iterator[str]:
                    for number, raw in enumerate(stream, 1):
                        try:  # line by line, so that a bad byte is named by its line
                            line = raw.decode("utf-8")
                        except UnicodeDecodeError as exc:
                            raise InvalidImportError(
                                f"line {number}: not UTF-8 text ({exc.reason})",
                                number) from None
                        yield line
                        advance()

                async with writing(settings_of(args)) as mem:
                    result = await import_sessions(mem, lines())
        finally:
            if path is not None:
                stream.close()
        return result.as_dict()

    done = anyio.run(run)
    if args.json:
        print_json(done)
    else:
        detached = done["detached"]
        print(f"imported {done['imported']} sessions ({done['messages']} messages); "
              f"{done['skipped']} already there, skipped"
              + (f"; {len(detached)} imported without their parent (itself, not stored nor "
                 f"in the file, or a cycle): {', '.join(detached)}" if detached else ""))
    return EXIT_OK


def _sessions_end(args: argparse.Namespace) -> int:
    async def run() -> dict[str, Any]:
        async with writing(settings_of(args)) as mem:
            receipt = mem.sessions.end_nowait(args.session_id, args.reason)
            await mem.committed([receipt], mem.settings.shutdown_deadline_s)
        return {"session_id": args.session_id, "ended": True, "reason": args.reason}

    done = anyio.run(run)
    print_json(done) if args.json else print(f"ended {args.session_id} ({args.reason})")
    return EXIT_OK


def _sessions_delete(args: argparse.Namespace) -> int:
    async def run() -> dict[str, Any]:
        async with writing(settings_of(args)) as mem:
            receipt = mem.sessions.delete_nowait(args.session_id)
            await mem.committed([receipt], mem.settings.shutdown_deadline_s)
        return {"session_id": args.session_id, "deleted": True}

    done = anyio.run(run)
    print_json(done) if args.json else print(f"deleted {args.session_id}")
    return EXIT_OK


def _sessions_prune(args: argparse.Namespace) -> int:
    async def run() -> dict[str, Any]:
        async with writing(settings_of(args)) as mem:
            result = await mem.sessions.prune(args.older_than, source=args.source)
        return result.as_dict()

    done = anyio.run(run)
    if args.json:
        print_json(done)
    else:
        kept = len(done["candidates"]) - len(done["deleted"])
        print(f"pruned {len(done['deleted'])} sessions"
              + (f" ({kept} kept: a turn arrived meanwhile)" if kept else ""))
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
def _progress(total: int, show: bool, label: str = "exporting sessions"
              ) -> Iterator[Callable[[], None]]:
    """An ``advance()`` that moves a progress bar on stderr, or does nothing."""
    if not show:
        yield lambda: None
        return
    try:
        console = require("rich.console", "cli", "the progress bar")
        bar = require("rich.progress", "cli", "the progress bar")
    except ConfigurationError as exc:  # the export itself needs no extra: go on without
        print(f"{PROG}: {exc}", file=sys.stderr)
        yield lambda: None
        return
    with bar.Progress(
        bar.TextColumn(label), bar.BarColumn(), bar.MofNCompleteColumn(),
        bar.TimeRemainingColumn(), console=console.Console(file=sys.stderr), transient=True,
    ) as progress:
        task = progress.add_task("export", total=total)
        yield lambda: progress.advance(task)
