"""A PostgreSQL server on this machine for trying the shared store: ``hermes-memory db local
start | stop``.

``start`` makes a cluster under a folder the first time (``initdb``: its superuser is
``hermes``, with a generated password kept in the folder, mode 0600, and SCRAM
authentication), starts it on 127.0.0.1, creates the database ``hermes_memory``, brings its
schema up to date, and returns the DSN to put in ``DATABASE_URL``. Starting it again reuses
the cluster and the password. It is for a try-out, not for production: one cluster, no
backups, no tuning.

``initdb`` and ``pg_ctl`` refuse to run as root: as root the cluster is owned and run by the
``postgres`` account that PostgreSQL's package creates.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ..errors import ConfigurationError, DatabaseError

DATABASE = "hermes_memory"
USER = "hermes"
HOST = "127.0.0.1"
DEFAULT_PORT = 5433  # beside a system server on 5432
PG_BIN_DIRS = tuple(Path(f"/usr/lib/postgresql/{v}/bin") for v in (17, 16, 15))
ROOT_ACCOUNT = "postgres"
COMMAND_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class LocalServer:
    """Where a local cluster lives and how to reach it."""

    folder: Path
    port: int

    @property
    def data(self) -> Path:
        return self.folder / "data"

    @property
    def password_file(self) -> Path:
        return self.folder / "password"

    def dsn(self) -> str:
        password = quote(self.password_file.read_text(encoding="utf-8").strip(), safe="")
        return f"postgresql://{USER}:{password}@{HOST}:{self.port}/{DATABASE}"


def default_folder(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    data_home = env.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "hermes-memory" / "postgres"


def binary(name: str) -> Path:
    """``name`` (initdb, pg_ctl) on PATH, else in PostgreSQL's own folder.

    Raises:
        ConfigurationError: PostgreSQL is not installed here.
    """
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    for folder in PG_BIN_DIRS:
        if os.access(folder / name, os.X_OK):
            return folder / name
    raise ConfigurationError(
        f"{name} is neither on PATH nor in {PG_BIN_DIRS[-1]}: install PostgreSQL "
        "(apt-get install postgresql) to run a local server")


def _account() -> pwd.struct_passwd | None:
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(ROOT_ACCOUNT)
    except KeyError:
        raise ConfigurationError(
            f"running as root, and there is no {ROOT_ACCOUNT!r} account to run PostgreSQL "
            "as (initdb refuses root): run this as an ordinary user") from None


def _run(args: list[str], account: pwd.struct_passwd | None) -> None:
    as_user: dict[str, Any] = {} if account is None else {
        "user": account.pw_uid, "group": account.pw_gid, "extra_groups": []}
    try:
        done = subprocess.run(args, capture_output=True, text=True, check=False,
                              timeout=COMMAND_TIMEOUT_S, cwd="/", **as_user)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DatabaseError(f"{Path(args[0]).name} failed: {exc}") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).strip().splitlines()
        raise DatabaseError(f"{Path(args[0]).name} failed: {said[-1] if said else done.returncode}")


def start(server: LocalServer) -> str:
    """Make the cluster if needed, start it, and return its DSN (the database exists and
    its schema is current once ``prepare`` ran).

    Raises:
        ConfigurationError: PostgreSQL is not installed, or no account to run it as.
        DatabaseError: initdb or pg_ctl failed (the line says why).
    """
    initdb, pg_ctl = binary("initdb"), binary("pg_ctl")
    account = _account()
    server.folder.mkdir(parents=True, exist_ok=True)
    if account is not None:
        os.chown(server.folder, account.pw_uid, account.pw_gid)
    os.chmod(server.folder, 0o700)
    if not (server.data / "PG_VERSION").exists():
        password = "hm-" + secrets.token_urlsafe(18)
        fd = os.open(server.password_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(password + "\n")
        if account is not None:
            os.chown(server.password_file, account.pw_uid, account.pw_gid)
        _run([str(initdb), "-D", str(server.data), f"--username={USER}",
              f"--pwfile={server.password_file}", "--auth=scram-sha-256", "--encoding=UTF8",
              "--locale=C.UTF-8"], account)
    (server.folder / "port").write_text(f"{int(server.port)}\n", encoding="utf-8")
    if not _running(server, pg_ctl, account):
        options = f"-c listen_addresses={HOST} -p {int(server.port)} -c unix_socket_directories=''"
        _run([str(pg_ctl), "start", "-D", str(server.data), "-w", "-l",
              str(server.folder / "server.log"), "-o", options], account)
    return server.dsn()


def stop(server: LocalServer) -> bool:
    """Stop the cluster; False when it was not running.

    Raises:
        ConfigurationError, DatabaseError: as ``start``.
    """
    pg_ctl, account = binary("pg_ctl"), _account()
    if not _running(server, pg_ctl, account):
        return False
    _run([str(pg_ctl), "stop", "-D", str(server.data), "-m", "fast", "-w"], account)
    return True


def _running(server: LocalServer, pg_ctl: Path, account: pwd.struct_passwd | None) -> bool:
    """Whether the cluster's server runs (``pg_ctl status``: a stale pid file after a crash
    is not a running server)."""
    if not (server.data / "PG_VERSION").exists():
        return False
    try:
        _run([str(pg_ctl), "status", "-D", str(server.data)], account)
    except DatabaseError:
        return False
    return True


def saved_port(folder: Path) -> int | None:
    """The port the cluster under ``folder`` was last started on."""
    try:
        return int((folder / "port").read_text(encoding="utf-8").strip())
    except (OSError, ValueError):
        return None


async def prepare(dsn: str) -> None:
    """Create the database (connecting to the cluster's ``postgres`` one) when it is not
    there yet.

    Raises:
        DatabaseError: the server refused or could not be reached.
    """
    import asyncpg

    from .pool import database_errors

    admin = dsn.rsplit("/", 1)[0] + "/postgres"
    async with database_errors(admin):
        conn = await asyncpg.connect(admin)
        try:
            exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1",
                                         DATABASE)
            if not exists:
                await conn.execute(f'CREATE DATABASE "{DATABASE}"')
        finally:
            await conn.close()
