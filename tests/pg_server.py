"""A real PostgreSQL server for the tests: a new cluster under a temporary folder, on
127.0.0.1 and a free port, with password (SCRAM) authentication over TCP.

``initdb`` and ``pg_ctl`` refuse to run as root, and CI runs as root: the cluster is then
owned and run by an unprivileged account that the image already has (``postgres``, which
the PostgreSQL package creates, else ``nobody``), through ``subprocess``'s ``user=`` and
``group=``; nothing is added to the system. Run as another user, it runs as that user.

Two roles, both with passwords: the superuser ``postgres`` (creates databases) and the
application's ``hermes``, which owns each test's database and is what the code under test
connects as. The application's password holds characters a URL must escape, so a test can
look for it in both forms.

The server can be stopped and started again on the same port and data folder (an outage
test). ``cleanup`` stops it and removes the folder; a watchdog process does the same if the
test run dies without calling it (SIGKILL included), so no postgres process outlives the run.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

PG_VERSION = "15"
PG_BIN_DIR = Path(f"/usr/lib/postgresql/{PG_VERSION}/bin")
ADMIN_USER = "postgres"
APP_USER = "hermes"
# A template every test database is copied from (CREATE DATABASE ... TEMPLATE is a file
# copy: ~10 ms), owned by the application's role.
EMPTY_TEMPLATE = "hermes_empty"
HOST = "127.0.0.1"
START_TIMEOUT_S = 60
STOP_TIMEOUT_S = 60
COMMAND_TIMEOUT_S = 60.0
PORT_ATTEMPTS = 3
# Unprivileged accounts to run the server as when the tests run as root, in this order.
SERVER_ACCOUNTS = ("postgres", "nobody")
# Test settings: durability is not what these tests check (a stopped or killed server still
# keeps what the OS holds), and fsync makes CREATE DATABASE and every commit slow.
SERVER_CONF = """
listen_addresses = '127.0.0.1'
port = {port}
unix_socket_directories = ''
max_connections = 200
fsync = off
synchronous_commit = off
full_page_writes = off
password_encryption = 'scram-sha-256'
log_min_messages = warning
"""

# Runs beside the test process and waits for its end (its standard input reaches EOF when
# the test process exits, however it exits); then stops a server still running and removes
# the folder. Arguments: pg_ctl, data folder, base folder, uid, gid.
_WATCHDOG = """
import os, shutil, subprocess, sys
pg_ctl, data, base, uid, gid = sys.argv[1:6]
sys.stdin.buffer.read()
if os.path.exists(os.path.join(data, "postmaster.pid")):
    as_user = {} if int(uid) == os.geteuid() else {"user": int(uid), "group": int(gid),
                                                    "extra_groups": []}
    subprocess.run([pg_ctl, "stop", "-D", data, "-m", "immediate", "-w"],
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False, **as_user)
shutil.rmtree(base, ignore_errors=True)
"""


class PostgresUnavailable(RuntimeError):
    """The PostgreSQL binaries are missing, or the server did not start."""


def find_binaries() -> tuple[Path, Path, Path]:
    """initdb, pg_ctl and psql: on PATH, else PostgreSQL 15's own folder.

    Raises:
        PostgresUnavailable: one of them is in neither place.
    """
    found: list[Path] = []
    for name in ("initdb", "pg_ctl", "psql"):
        on_path = shutil.which(name)
        path = Path(on_path) if on_path else PG_BIN_DIR / name
        if not os.access(path, os.X_OK):
            raise PostgresUnavailable(
                f"PostgreSQL {PG_VERSION} is needed for these tests and {name} is neither on "
                f"PATH nor in {PG_BIN_DIR} (apt-get install postgresql-{PG_VERSION})")
        found.append(path)
    return found[0], found[1], found[2]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def server_account() -> pwd.struct_passwd | None:
    """The account to run the server as: None (this process's own) unless this is root."""
    if os.geteuid() != 0:
        return None
    for name in SERVER_ACCOUNTS:
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise PostgresUnavailable(
        f"running as root, and none of the accounts {', '.join(SERVER_ACCOUNTS)} exists to "
        "run PostgreSQL as (initdb refuses root)")


@dataclass
class PostgresServer:
    """One cluster for the test run. ``start()`` makes it on first use."""

    base: Path
    port: int
    admin_password: str = field(default_factory=lambda: "adm-" + secrets.token_hex(8))
    # Characters a URL must escape (@ : / %), so a leak of either form can be looked for.
    app_password: str = field(
        default_factory=lambda: f"pw-{secrets.token_hex(8)}@:/%x")
    _created: bool = False
    _databases: int = 0
    _watchdog: subprocess.Popen[bytes] | None = None

    def __post_init__(self) -> None:
        self.initdb, self.pg_ctl, self.psql = find_binaries()
        self.account = server_account()
        self.data = self.base / "data"
        self.log_file = self.base / "server.log"

    @classmethod
    def create(cls) -> PostgresServer:
        """A server in a new temporary folder, not started yet.

        Raises:
            PostgresUnavailable: the binaries are missing.
        """
        find_binaries()  # fail before making anything
        base = Path(tempfile.mkdtemp(prefix="hermes-pg-"))
        server = cls(base=base, port=free_port())
        if server.account is not None:
            # mkdtemp made the folder 0700 and root's: it becomes the server account's.
            os.chown(base, server.account.pw_uid, server.account.pw_gid)
        return server

    # The server's life.

    def start(self) -> None:
        """Start the server (making the cluster the first time) and wait until it accepts
        connections.

        Raises:
            PostgresUnavailable: initdb or pg_ctl failed (their output and the server's log
                are in the message).
        """
        first = not self._created
        if first:
            self._initdb()
            self._start_watchdog()
        for attempt in range(PORT_ATTEMPTS if first else 1):
            try:
                self._run_as_server([str(self.pg_ctl), "start", "-D", str(self.data), "-l",
                                     str(self.log_file), "-w", "-t", str(START_TIMEOUT_S)],
                                    what="pg_ctl start")
                break
            except PostgresUnavailable as exc:
                # The free port found at creation was taken since: another one, once made.
                if attempt + 1 == PORT_ATTEMPTS or "could not bind" not in str(exc):
                    raise
                self.port = free_port()
                with (self.data / "postgresql.conf").open("a") as conf:
                    conf.write(f"port = {self.port}\n")
        if first:
            self._make_roles()

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``mode``: smart, fast or immediate) and wait until it is gone.
        Connections are cut; the data and the port stay for ``start()``."""
        if self.running:
            self._run_as_server([str(self.pg_ctl), "stop", "-D", str(self.data), "-m", mode,
                                 "-w", "-t", str(STOP_TIMEOUT_S)], what="pg_ctl stop")

    def restart(self) -> None:
        self.stop()
        self.start()

    @property
    def running(self) -> bool:
        """Whether the server holds its data folder (its pid file is there)."""
        return (self.data / "postmaster.pid").exists()

    def cleanup(self) -> None:
        """Stop the server if it runs and remove everything it had. Idempotent."""
        try:
            if self.running:
                self.stop(mode="immediate")
        finally:
            shutil.rmtree(self.base, ignore_errors=True)
            if self._watchdog is not None:
                assert self._watchdog.stdin is not None
                self._watchdog.stdin.close()  # its EOF: it finds nothing left to do
                self._watchdog.wait(timeout=COMMAND_TIMEOUT_S)
                self._watchdog = None

    # Addresses.

    def dsn(self, database: str = "postgres", *, user: str = APP_USER,
            password: str | None = None, port: int | None = None) -> str:
        """A postgresql:// URL to ``database`` as ``user`` (the application's role by
        default), with that role's password unless another is given."""
        if password is None:
            password = self.admin_password if user == ADMIN_USER else self.app_password
        return (f"postgresql://{quote(user, safe='')}:{quote(password, safe='')}@{HOST}:"
                f"{self.port if port is None else port}/{quote(database, safe='')}")

    @property
    def admin_dsn(self) -> str:
        return self.dsn("postgres", user=ADMIN_USER)

    def password_forms(self) -> list[str]:
        """What a leak of a password would look like: the application's as written and as
        escaped in a URL, its part before its '@' (what a parser stopping there takes), and
        the superuser's."""
        app = self.app_password
        return [app, quote(app, safe=""), app.split("@")[0], self.admin_password]

    def assert_no_password(self, text: str) -> None:
        for secret in self.password_forms():
            assert secret not in text, f"a password in: {text[:2000]}"

    # Databases.

    def create_database(self, prefix: str = "test") -> str:
        """A new, empty database owned by the application's role, copied from the template;
        returns its DSN (as the application's role)."""
        self._databases += 1
        name = f"{prefix}_{self._databases}_{secrets.token_hex(3)}"
        self.sql(f'CREATE DATABASE "{name}" TEMPLATE "{EMPTY_TEMPLATE}" OWNER "{APP_USER}"')
        return self.dsn(name)

    def sql(self, statement: str, *, database: str = "postgres") -> str:
        """Run ``statement`` as the superuser through psql over TCP; returns its output
        (unaligned, tuples only).

        Raises:
            PostgresUnavailable: psql failed (its error is in the message).
        """
        env = {**os.environ, "PGPASSWORD": self.admin_password, "PGCONNECT_TIMEOUT": "10"}
        result = subprocess.run(
            [str(self.psql), "-X", "-q", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h", HOST,
             "-p", str(self.port), "-U", ADMIN_USER, "-d", database, "-c", statement],
            capture_output=True, text=True, env=env, timeout=COMMAND_TIMEOUT_S, check=False)
        if result.returncode != 0:
            raise PostgresUnavailable(f"psql failed: {result.stderr.strip()}")
        return result.stdout.strip()

    # Inside.

    def _initdb(self) -> None:
        pwfile = self.base / "admin.pw"
        pwfile.write_text(self.admin_password + "\n")
        if self.account is not None:
            os.chown(pwfile, self.account.pw_uid, self.account.pw_gid)
        try:
            self._run_as_server(
                [str(self.initdb), "-D", str(self.data), "-U", ADMIN_USER,
                 f"--pwfile={pwfile}", "--auth-host=scram-sha-256", "--auth-local=reject",
                 "--encoding=UTF8", "--locale=C", "--no-sync"],
                what="initdb")
        finally:
            pwfile.unlink(missing_ok=True)
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(SERVER_CONF.format(port=self.port))
        self._created = True

    def _make_roles(self) -> None:
        password = self.app_password.replace("'", "''")
        self.sql(f"CREATE ROLE \"{APP_USER}\" LOGIN PASSWORD '{password}'")
        self.sql(f'CREATE DATABASE "{EMPTY_TEMPLATE}" OWNER "{APP_USER}" IS_TEMPLATE true')

    def _start_watchdog(self) -> None:
        uid = self.account.pw_uid if self.account else os.geteuid()
        gid = self.account.pw_gid if self.account else os.getegid()
        self._watchdog = subprocess.Popen(
            [sys.executable, "-c", _WATCHDOG, str(self.pg_ctl), str(self.data), str(self.base),
             str(uid), str(gid)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            # Its own session: a Ctrl-C to the test run's terminal does not end it first.
            start_new_session=True)

    def _run_as_server(self, argv: Sequence[str], *, what: str) -> None:
        as_user: dict[str, object] = {}
        if self.account is not None:
            as_user = {"user": self.account.pw_uid, "group": self.account.pw_gid,
                       "extra_groups": []}
        # The server account may not read the test's working directory (root's home).
        result = subprocess.run(argv, capture_output=True, text=True, cwd=self.base,
                                timeout=START_TIMEOUT_S + COMMAND_TIMEOUT_S, check=False,
                                **as_user)  # type: ignore[call-overload]
        if result.returncode != 0:
            log = ""
            if self.log_file.exists():
                log = "; server log: " + " | ".join(self.log_file.read_text().splitlines()[-5:])
            output = " ".join((result.stdout + result.stderr).split())
            raise PostgresUnavailable(f"{what} failed (exit {result.returncode}): {output}{log}")


@contextlib.asynccontextmanager
async def upgraded_pool(dsn: str, *setup: str) -> AsyncIterator[Any]:
    """A small pool on the test's database, upgraded to the library's schema, after the
    test's own statements (``setup``: the tables its probes write)."""
    from hermes_async_memory import Settings
    from hermes_async_memory.postgres import open_pool, upgrade

    async with open_pool(Settings(postgres_dsn=dsn, postgres_pool_max_size=4)) as pool:
        await upgrade(pool)
        for statement in setup:
            await pool.execute(statement)
        yield pool
