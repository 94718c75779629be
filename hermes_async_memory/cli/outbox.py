"""``hermes-memory outbox clear-destroyed [--json]``: the operator has seen that outbox
records were destroyed (a segment cut short, or emptied): the record of it beside the
segments goes, and with it the health condition ``outbox_records_destroyed`` (at once in a
pipeline or worker running on the store, which looks for the record when asked for its
health). The turns themselves cannot come back. Exit 0 when cleared or nothing was there."""

from __future__ import annotations

import argparse
from typing import Any

from .common import EXIT_OK, db_option, guarded, json_option, print_json, settings_of


def register(commands: Any) -> None:
    """Add ``outbox`` and its actions to ``commands`` (argparse sub-parsers)."""
    outbox = commands.add_parser(
        "outbox", help="the outbox beside the store: clear the record of destroyed turns",
        description="The outbox folder beside the store file.",
    ).add_subparsers(dest="outbox_command", metavar="ACTION", required=True)
    clear = outbox.add_parser(
        "clear-destroyed", parents=[db_option(), json_option()],
        help="acknowledge turns reported destroyed; clears the health condition",
        description="Remove the record of acknowledged turns found destroyed in the outbox "
                    "(a segment truncated or emptied), which 'status' shows and which keeps "
                    "the health condition outbox_records_destroyed raised. Prints how many "
                    "turns it recorded.",
    )
    clear.set_defaults(handler=guarded(_clear))


def _clear(args: argparse.Namespace) -> int:
    from ..outbox.destroyed import clear_destroyed
    from .status import outbox_dirs

    settings = settings_of(args)
    # The pipeline's folder and any producer slots' beside it.
    docs = [doc for d in outbox_dirs(settings) if (doc := clear_destroyed(d)) is not None]
    turns = sum(int(doc.get("turns", 0)) for doc in docs)
    if args.json:
        print_json({"outbox": str(settings.outbox_dir), "cleared": bool(docs),
                    "destroyed_turns": turns})
    elif not docs:
        print("no destroyed turns recorded; nothing to clear")
    else:
        print(f"cleared: {turns} destroyed turns were recorded in {settings.outbox_dir}")
    return EXIT_OK
