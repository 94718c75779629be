"""``hermes-memory db upgrade | status | jobs | local``: the shared PostgreSQL store's schema,
its job queue, and a server on this machine to try it with.

    hermes-memory db upgrade [--dsn DSN]
    hermes-memory db status [--dsn DSN] [--json]
    hermes-memory db jobs [--dsn DSN] [--json]
    hermes-memory db local start|stop [--dir DIR] [--port PORT]

The database is ``--dsn``, else ``HERMES_MEMORY_POSTGRES_DSN``, else ``DATABASE_URL``; it is
shown with its password as ``***``, in the output and in errors alike. Needs the postgres
extra (asyncpg), imported when a command runs. Exit 0 when done; 1 when the database cannot
be reached or refuses (one line on stderr); 2 when no DSN is given or it is not a URL.
"""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import anyio

from .common import EXIT_OK, guarded, json_option, print_json, table

if TYPE_CHECKING:
    from ..postgres.schema import SchemaStatus, Upgrade
    from ..settings import Settings

T = TypeVar("T")


def register(commands: Any) -> None:
    """Add ``db`` and its actions to ``commands`` (argparse sub-parsers)."""
    db = commands.add_parser(
        "db", help="the shared PostgreSQL store: schema upgrade and status",
        description="The shared PostgreSQL store (the postgres extra). The database is "
                    "--dsn, else $HERMES_MEMORY_POSTGRES_DSN, else $DATABASE_URL.",
    ).add_subparsers(dest="db_command", metavar="ACTION", required=True)
    upgrade = db.add_parser(
        "upgrade", parents=[_dsn_option()], help="bring the database's schema up to date",
        description="Apply the migrations the database has not had yet, in one "
                    "transaction. Safe to run from several machines at once: one applies "
                    "them, the others wait and find nothing to do. A database with a newer "
                    "schema than this library is left as it is (exit 1).",
    )
    upgrade.set_defaults(handler=guarded(_upgrade))
    status = db.add_parser(
        "status", parents=[_dsn_option(), json_option()],
        help="the database's schema version against this library's",
        description="Show the database's schema version, the migrations applied and those "
                    "pending. Reads only.",
    )
    status.set_defaults(handler=guarded(_status))
    jobs = db.add_parser(
        "jobs", parents=[_dsn_option(), json_option()],
        help="the shared job queue: queued, running and dead jobs by kind",
        description="Show the shared jobs by kind: how many are queued, running (leased "
                    "to a worker) and dead (given up after their last attempt), and how "
                    "long ago the oldest of each was queued. Reads only.",
    )
    jobs.set_defaults(handler=guarded(_jobs))
    local = db.add_parser(
        "local", help="a PostgreSQL server on this machine, to try the shared store",
        description="start: make a cluster under --dir the first time (its password is "
                    "generated and kept there), start it on 127.0.0.1, create the database "
                    "hermes_memory with a current schema, and print the DATABASE_URL line "
                    "to export. stop: stop it. For trying things, not for production.",
    )
    local.add_argument("action", choices=("start", "stop"))
    local.add_argument("--dir", type=Path, default=None,
                       help="the cluster's folder (default: "
                            "$XDG_DATA_HOME/hermes-memory/postgres)")
    local.add_argument("--port", type=int, default=None,
                       help="TCP port on 127.0.0.1 (default: the one it last started on, "
                            "else 5433)")
    local.set_defaults(handler=guarded(_local))


def _dsn_option() -> argparse.ArgumentParser:
    dsn = argparse.ArgumentParser(add_help=False)
    dsn.add_argument(
        "--dsn", metavar="DSN",
        help="postgresql://USER:PASSWORD@HOST:PORT/DATABASE (default: "
             "$HERMES_MEMORY_POSTGRES_DSN, else $DATABASE_URL). A password given here is "
             "visible to other users of this machine in the process list: prefer the "
             "environment")
    return dsn


def _settings(args: argparse.Namespace) -> Settings:
    """The settings from the environment, ``--dsn`` first; asyncpg checked to be there.

    Raises:
        ConfigurationError: no postgres extra, a variable does not parse, or the DSN is not
            a postgresql:// URL.
    """
    from ..extras import require
    from ..logs import configure_logging
    from ..settings import Settings

    require("asyncpg", "postgres", "hermes-memory db")
    configure_logging(level="warning")  # stdout is the command's; warnings go to stderr
    if args.dsn is not None:
        return Settings.from_env(postgres_dsn=args.dsn)
    return Settings.from_env()


def _on_one_connection(settings: Settings, action: Callable[[Any], Awaitable[T]]) -> T:
    """``action(pool)`` on a pool of one connection to the settings' database; the driver's
    errors raised as ours (the password scrubbed)."""
    from ..postgres.dsn import settings_dsn
    from ..postgres.pool import database_errors, open_pool

    async def run() -> T:
        async with open_pool(settings.replace(postgres_pool_min_size=1,
                                              postgres_pool_max_size=1)) as pool, \
                database_errors(settings_dsn(settings)):
            return await action(pool)

    return anyio.run(run)


def _upgrade(args: argparse.Namespace) -> int:
    from ..postgres.dsn import redact_dsn, settings_dsn
    from ..postgres.schema import upgrade

    settings = _settings(args)
    dsn = settings_dsn(settings)
    done: Upgrade = _on_one_connection(settings, upgrade)
    for step in done.applied:
        print(f"applied {step.version}  {step.name}")
    where = f'database "{done.database}" ({redact_dsn(dsn)})'
    if done.applied:
        print(f"{where}: schema version {done.to_version} (was {done.from_version}), "
              f"in {done.duration_s:.2f} s")
    else:
        print(f"{where}: schema version {done.to_version}, up to date")
    return EXIT_OK


def _status(args: argparse.Namespace) -> int:
    from ..postgres.dsn import redact_dsn, settings_dsn
    from ..postgres.schema import status

    settings = _settings(args)
    dsn = settings_dsn(settings)
    found: SchemaStatus = _on_one_connection(settings, status)
    if args.json:
        print_json({"dsn": redact_dsn(dsn), **found.as_dict()})
        return EXIT_OK
    if found.current:
        state = "up to date"
    elif found.version > found.expected:
        state = "newer than this library: upgrade hermes-async-memory here"
    else:
        n = len(found.pending)
        state = (f"{n} migration{'' if n == 1 else 's'} pending: run "
                 "`hermes-memory db upgrade`")
    rows = [("database", f"{found.database} ({redact_dsn(dsn)})"),
            ("server", f"PostgreSQL {found.server_version}"),
            ("schema version", f"{found.version} (this library: {found.expected})"),
            ("state", state),
            ("stemmed recall index", found.stemmed_index)]
    rows += [(f"applied {a.version}", f"{a.name} ({a.applied_at:%Y-%m-%d %H:%M:%S %Z})")
             for a in found.applied]
    rows += [(f"pending {m.version}", m.name) for m in found.pending]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name.ljust(width)}  {value}")
    return EXIT_OK


def _jobs(args: argparse.Namespace) -> int:
    from ..postgres.jobs import JOB_STATUSES, QueueRow, queue_summary

    rows: list[QueueRow] = _on_one_connection(_settings(args), queue_summary)
    kinds: dict[str, dict[str, object]] = {}
    for r in rows:
        kind = kinds.setdefault(r.kind, {s: 0 for s in JOB_STATUSES} | {
            f"oldest_{s}_age_s": None for s in JOB_STATUSES})
        kind[r.status] = r.jobs
        kind[f"oldest_{r.status}_age_s"] = round(r.oldest_age_s, 3)
    if args.json:
        print_json({"kinds": kinds,
                    "total": {s: sum(r.jobs for r in rows if r.status == s)
                              for s in JOB_STATUSES}})
        return EXIT_OK
    if not kinds:
        print("no jobs")
        return EXIT_OK

    def age(value: object) -> str:
        return "-" if value is None else f"{value:.1f} s"

    table(["kind", "queued", "running", "dead", "oldest queued", "oldest running",
           "oldest dead"],
          [[k, *(str(v[s]) for s in JOB_STATUSES),
            *(age(v[f"oldest_{s}_age_s"]) for s in JOB_STATUSES)]
           for k, v in sorted(kinds.items())])
    return EXIT_OK


def _local(args: argparse.Namespace) -> int:
    from ..extras import require
    from ..logs import configure_logging
    from ..postgres import local
    from ..postgres.schema import upgrade
    from ..settings import Settings

    require("asyncpg", "postgres", "hermes-memory db local")
    configure_logging(level="warning")
    folder = args.dir or local.default_folder()
    server = local.LocalServer(
        folder, args.port or local.saved_port(folder) or local.DEFAULT_PORT)
    if args.action == "stop":
        stopped = local.stop(server)
        print(f"stopped the server in {server.folder}" if stopped
              else f"no server running in {server.folder}")
        return EXIT_OK
    dsn = local.start(server)
    anyio.run(local.prepare, dsn)
    _on_one_connection(Settings(postgres_dsn=dsn), upgrade)
    print(f"# PostgreSQL on {local.HOST}:{server.port}, data in {server.data}")
    print(f"export DATABASE_URL='{dsn}'")
    return EXIT_OK
