"""``hermes-memory dead-letters list | replay``: turns the store (or a replica backend)
refused, listed or committed again under their own keys.

    hermes-memory dead-letters list [--limit N] [--backend NAME] [--json]
    hermes-memory dead-letters replay (KEY ... | --all) [--backend NAME]

Listing reads the file read-only. Replaying the store's dead letters writes through
``SqliteStore`` (run with ``asyncio.run``), in the store's own transactions: the code path the
pipeline commits with. A backend's dead letters go back to its outbox with one synchronous
statement (``store.replica.requeue_dead_letters``).
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from . import EXIT_FAILURE, PROG, fail
from .common import (
    ERROR_PREVIEW_CHARS,
    EXIT_OK,
    db_option,
    guarded,
    json_option,
    one_line,
    open_reader,
    positive_int,
    print_json,
    settings_of,
    store_error,
    table,
    usage_error,
    when,
)

if TYPE_CHECKING:
    from ..settings import Settings

DEFAULT_DEAD_LIMIT = 100


def register(commands: Any) -> None:
    """Add ``dead-letters`` and its actions to ``commands`` (argparse sub-parsers)."""
    dead = commands.add_parser(
        "dead-letters", help="turns the store refused: list or replay them",
        description="Turns that could not be stored after every retry.",
    ).add_subparsers(dest="dead_letters_command", metavar="ACTION", required=True)
    dead_list = dead.add_parser(
        "list", parents=[db_option(), json_option()], help="the dead letters, oldest first",
        description="List the dead letters, oldest first, with their last error.",
    )
    dead_list.add_argument("--limit", type=positive_int, default=DEFAULT_DEAD_LIMIT,
                           metavar="N", help=f"entries at most (default {DEFAULT_DEAD_LIMIT})")
    dead_list.set_defaults(handler=guarded(_dead_list))
    replay = dead.add_parser(
        "replay", parents=[db_option()], help="commit dead letters again, under their own keys",
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
    replay.set_defaults(handler=guarded(_dead_replay))


def _dead_list(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    with open_reader(settings) as reader, reader.snapshot():
        if args.backend:
            total, dead = reader.replica_dead_letters(args.backend, args.limit)
            replica_dead: list[tuple[str, int]] = []
        else:
            total, dead = reader.dead_letters(args.limit)
            replica_dead = reader.replica_dead_counts()
    if args.json:
        print_json(dead)
        return EXIT_OK
    if not dead:
        print("no dead letters")
        for backend, n in replica_dead:
            print(f"{n} dead letters of backend {backend!r}: "
                  f"dead-letters list --backend {backend}")
        return EXIT_OK
    table(["KEY", "SESSION", "ATTEMPTS", "DEAD SINCE", "LAST ERROR"],
          [[d["key"], d["session_id"], str(d["attempts"]), when(d["updated_at"]),
            one_line(d["last_error"], ERROR_PREVIEW_CHARS)] for d in dead])
    if total > len(dead):
        print(f"({len(dead)} of {total} shown; --limit N for more)")
    for backend, n in replica_dead:
        print(f"{n} dead letters of backend {backend!r}: dead-letters list --backend {backend}")
    return EXIT_OK


def _dead_replay(args: argparse.Namespace) -> int:
    if args.all == bool(args.keys):
        return usage_error("dead-letters replay needs the KEYs to replay, or --all "
                           "(not both)")
    import asyncio

    settings = settings_of(args)
    # Checked read-only first: the store's open() would add its tables to any SQLite file.
    with open_reader(settings) as reader:
        if args.backend:
            return _replica_replay(settings, args.backend,
                                   None if args.all else list(args.keys))
        keys = reader.dead_letter_keys() if args.all else list(args.keys)
    if not keys:
        print("no dead letters to replay")
        return EXIT_OK
    replayed, failed = asyncio.run(_replay(settings, keys))
    for key in replayed:
        print(f"replayed  {key}")
    for key, error in failed.items():
        print(f"failed    {key}  {one_line(error, ERROR_PREVIEW_CHARS)}")
    print(f"{len(replayed)} replayed, {len(failed)} failed")
    if failed:
        return fail(PROG, store_error(
            f"{len(failed)} of {len(keys)} dead letters were not replayed; a turn that "
            "failed again stays dead with the new error (dead-letters list)"), EXIT_FAILURE)
    return EXIT_OK


def _replica_replay(settings: Settings, backend: str, keys: list[str] | None) -> int:
    """Hand a backend's dead letters back to its outbox; the replicator of the pipeline
    running on this store (the worker) sends them, saying they may have been sent before."""
    from ..store.replica import requeue_dead_letters

    requeued = requeue_dead_letters(settings.db_path, backend, keys,
                                    busy_timeout_ms=settings.busy_timeout_ms)
    print(f"{requeued} dead letters of backend {backend!r} queued to be sent again")
    if keys is not None and requeued < len(keys):
        return fail(PROG, store_error(
            f"{len(keys) - requeued} of {len(keys)} keys are not dead letters of backend "
            f"{backend!r}"), EXIT_FAILURE)
    return EXIT_OK


async def _replay(settings: Settings, keys: list[str]) -> tuple[list[str], dict[str, str]]:
    from ..store.dead_letters import replay_file_dead_letters

    # A replayed turn also goes to the replica backend the worker runs with.
    return await replay_file_dead_letters(
        settings.db_path, keys, source=settings.source,
        replica=None if settings.backend == "null" else settings.backend,
        busy_timeout_ms=settings.busy_timeout_ms)
