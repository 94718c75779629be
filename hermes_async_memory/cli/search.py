"""``hermes-memory search``: the session store's search (``SessionReads.search``) from a
shell, on the store file read-only, beside a running worker.

    hermes-memory search QUERY (--user U | --session S | --all-users) [--syntax plain|fts5]
                         [--source S]... [--exclude-source S]... [--role R]...
                         [--limit N] [--offset N] [--json]
"""

from __future__ import annotations

import argparse
from typing import Any

import anyio

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
    table,
    usage_error,
    when,
)

DEFAULT_SEARCH_LIMIT = 10
SNIPPET_WIDTH = 100  # characters of a snippet in the table


def register(commands: Any) -> None:
    """Add ``search`` to ``commands`` (argparse sub-parsers)."""
    search = commands.add_parser(
        "search", parents=[db_option(), json_option()],
        help="full-text search of the stored messages",
        description="Search the stored messages, best first (bm25), each hit with its "
                    "session, source, a snippet with the matched words between >>> and <<<, "
                    "and the message on each side. Plain text by default: every word must "
                    "be there, and operators are words. --syntax fts5 takes FTS5 syntax: "
                    "\"phrases\", prefix*, AND, OR, NOT, NEAR(a b, 5).",
    )
    search.add_argument("query", metavar="QUERY")
    whose = search.add_argument_group("whose messages (one is required)")
    whose.add_argument("--user", metavar="U", help="this user's messages")
    whose.add_argument("--session", metavar="S",
                       help="this session's (with --user: this session of that user; alone: "
                            "a session stored without a user)")
    whose.add_argument("--all-users", action="store_true", dest="all_users",
                       help="everyone's messages (an administrator's search)")
    search.add_argument("--syntax", choices=("plain", "fts5"), default="plain",
                        help="how QUERY is read (default plain)")
    search.add_argument("--source", action="append", dest="sources", metavar="S",
                        help="only sessions from this source (repeat for several)")
    search.add_argument("--exclude-source", action="append", dest="exclude_sources",
                        metavar="S", help="no sessions from this source (repeatable)")
    search.add_argument("--role", action="append", dest="roles", metavar="R",
                        help="only messages of this role: user, assistant, tool (repeatable)")
    search.add_argument("--limit", type=positive_int, default=DEFAULT_SEARCH_LIMIT,
                        metavar="N", help=f"hits at most (default {DEFAULT_SEARCH_LIMIT})")
    search.add_argument("--offset", type=non_negative_int, default=0, metavar="N",
                        help="skip the first N hits (the next page)")
    search.set_defaults(handler=guarded(_search))


def _search(args: argparse.Namespace) -> int:
    if not (args.user or args.session or args.all_users):
        return usage_error("search needs --user, --session or --all-users: whose messages "
                           "to read")

    async def run() -> list[dict[str, Any]]:
        async with session_reads(settings_of(args)) as reads:
            hits = await reads.search(
                args.query, user_id=args.user, session_id=args.session,
                all_users=args.all_users, syntax=args.syntax, sources=args.sources,
                exclude_sources=args.exclude_sources, roles=args.roles, limit=args.limit,
                offset=args.offset)
        return [h.as_dict() for h in hits]

    hits = anyio.run(run)
    if args.json:
        print_json(hits)
    elif not hits:
        print("no matches")
    else:
        table(["SESSION", "SOURCE", "ROLE", "TIME", "SNIPPET"],
              [[h["session_id"], h["source"] or "-", h["role"], when(h["timestamp"]),
                one_line(h["snippet"], SNIPPET_WIDTH)] for h in hits])
    return EXIT_OK
