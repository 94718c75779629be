"""``hermes-memory search QUERY (--user U | --session S) [--limit N] [--json]``: full-text
search in one user's or one session's memory, scoped as the library's recall is."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from .common import (
    EXIT_OK,
    db_option,
    guarded,
    json_option,
    open_reader,
    positive_int,
    print_json,
    settings_of,
    table,
    usage_error,
    when,
)

if TYPE_CHECKING:
    from ..settings import Settings
    from ..store.inspect import StoreReader

DEFAULT_SEARCH_LIMIT = 10


def register(commands: Any) -> None:
    """Add ``search`` to ``commands`` (argparse sub-parsers)."""
    search = commands.add_parser(
        "search", parents=[db_option(), json_option()],
        help="full-text search in one user's or session's memory",
        description="BM25 search over one user's (or one session's) messages, scoped as the "
                    "library's recall is. Words are quoted, never read as query syntax; words "
                    "too common to rank on are dropped unless nothing else is left.",
    )
    search.add_argument("query", metavar="QUERY")
    search.add_argument("--user", metavar="U", help="search this user's sessions")
    search.add_argument("--session", metavar="S", help="search this session (with --user: "
                                                       "this session of that user)")
    search.add_argument("--limit", type=positive_int, default=DEFAULT_SEARCH_LIMIT,
                        metavar="N", help=f"hits at most (default {DEFAULT_SEARCH_LIMIT})")
    search.set_defaults(handler=guarded(_search))


def _search(args: argparse.Namespace) -> int:
    if not args.user and not args.session:
        return usage_error("search needs --user or --session: a search reads one user's "
                           "or one session's memory")
    from ..recall import match_expression
    from ..recall import quote as quote_term
    from ..turns import scope_token_for

    settings = settings_of(args)
    hits: list[dict[str, Any]] = []
    with open_reader(settings) as reader:
        terms = _search_terms(reader, args.query, settings)
        if terms:
            match = match_expression(terms, scope_token_for(args.user, args.session))
            if args.user and args.session:
                match += f" AND scope:{quote_term(scope_token_for(None, args.session))}"
            found = reader.search(match, limit=args.limit,
                                  snippet_tokens=settings.recall_snippet_tokens)
            hits = [{"message_id": h.message_id, "session_id": h.session_id, "role": h.role,
                     "timestamp": h.timestamp, "snippet": " ".join(h.snippet.split())}
                    for h in found]
    if args.json:
        print_json(hits)
    elif not hits:
        print("no matches")
    else:
        table(["SESSION", "ROLE", "TIME", "SNIPPET"],
              [[h["session_id"], h["role"], when(h["timestamp"]), h["snippet"]] for h in hits])
    return EXIT_OK


def _search_terms(reader: StoreReader, query: str, settings: Settings) -> list[str]:
    """The query's terms, less those found in too many messages to rank on (the library's
    cut-off), unless that would leave none: here a person asked, and waits for an answer."""
    from ..recall import query_terms

    terms = query_terms(query, frozenset(), max_terms=len(query))
    limit = max(settings.frequent_term_rows,
                int(settings.frequent_term_ratio * reader.max_message_id()))
    rows = reader.term_rows(terms)
    rare = [t for t in terms if rows[t] <= limit]
    return (rare or terms)[: settings.recall_max_terms]
