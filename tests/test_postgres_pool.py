"""The PostgreSQL pool and its configuration against a real server: settings from the
environment, pool sizes, TLS options, errors typed and without the password (in messages,
reprs, tracebacks and log lines), and a server that goes away and comes back."""

from __future__ import annotations

import traceback
from pathlib import Path
from urllib.parse import quote

import asyncpg
import pytest
import structlog
from asyncpg import utils as asyncpg_utils
from structlog.testing import capture_logs

from hermes_async_memory import (
    ConfigurationError,
    DatabaseError,
    DatabaseUnavailableError,
    Settings,
)
from hermes_async_memory.errors import LeaseLostError
from hermes_async_memory.logs import configure_logging, redact_credentials
from hermes_async_memory.postgres import check, create_pool, open_pool, redact_dsn, upgrade
from hermes_async_memory.postgres.dsn import dsn_secrets, scrub, settings_dsn
from hermes_async_memory.postgres.pool import (
    APPLICATION_NAME,
    UnclassifiedErrors,
    close_pool,
    database_errors,
)

from .pg_server import PostgresServer, free_port

SECRET = "s3cr3t-p@ss:w/rd%"


def test_a_dsn_is_shown_without_its_password() -> None:
    quoted = quote(SECRET, safe="")
    assert redact_dsn(f"postgresql://me:{quoted}@db:5432/mem") == \
        "postgresql://me:***@db:5432/mem"
    # Unescaped, a password may hold '@' and '/': everything up to the host's '@' goes.
    assert redact_dsn(f"postgresql://me:{SECRET}@db/mem") == "postgresql://me:***@db/mem"
    assert redact_dsn("postgres://me:pw@h1:5432,h2:5433/mem?sslmode=require") == \
        "postgres://me:***@h1:5432,h2:5433/mem?sslmode=require"
    assert redact_dsn("postgresql://db/mem?user=me&password=pw&sslmode=require") == \
        "postgresql://db/mem?user=me&password=***&sslmode=require"
    assert redact_dsn("host=db user=me password='a b' dbname=mem") == \
        "host=db user=me password=*** dbname=mem"
    assert redact_dsn("postgresql://me@db/mem") == "postgresql://me@db/mem"


def test_scrub_removes_every_form_of_the_password() -> None:
    dsn = f"postgresql://me:{quote(SECRET, safe='')}@db/mem"
    assert SECRET in dsn_secrets(dsn) and quote(SECRET, safe="") in dsn_secrets(dsn)
    text = scrub(f"bad {SECRET} and {quote(SECRET, safe='')} and {dsn}", dsn)
    assert SECRET not in text and quote(SECRET, safe="") not in text
    assert "me:***@db/mem" in text


def test_settings_read_the_dsn_and_pool_options_from_the_environment() -> None:
    env = {"DATABASE_URL": "postgresql://me:pw@db/mem",
           "HERMES_MEMORY_POSTGRES_POOL_MIN_SIZE": "2",
           "HERMES_MEMORY_POSTGRES_POOL_MAX_SIZE": "20",
           "HERMES_MEMORY_POSTGRES_SSLMODE": "verify-full",
           "HERMES_MEMORY_POSTGRES_SSLROOTCERT": "/etc/ca.pem"}
    settings = Settings.from_env(env)
    assert settings.postgres_dsn == "postgresql://me:pw@db/mem"
    assert (settings.postgres_pool_min_size, settings.postgres_pool_max_size) == (2, 20)
    assert settings_dsn(settings) == ("postgresql://me:pw@db/mem?sslmode=verify-full"
                                      "&sslrootcert=%2Fetc%2Fca.pem")
    assert "pw" not in repr(settings).replace("postgres_pool", "")
    # The library's own variable wins over the generic one.
    env["HERMES_MEMORY_POSTGRES_DSN"] = "postgresql://other@db2/mem"
    assert Settings.from_env(env).postgres_dsn == "postgresql://other@db2/mem"


def test_a_database_url_of_another_kind_is_not_ours() -> None:
    """DATABASE_URL is a shared name: another application's MySQL or SQLite URL there must
    not stop this library from starting."""
    for url in ("mysql://me:pw@db/app", "sqlite:///app.db"):
        assert Settings.from_env({"DATABASE_URL": url}).postgres_dsn is None


def test_bad_postgres_settings_are_refused_without_the_password() -> None:
    with pytest.raises(ConfigurationError) as not_a_url:
        Settings.from_env({"HERMES_MEMORY_POSTGRES_DSN": f"host=db password={SECRET}"})
    assert "postgresql:// URL" in str(not_a_url.value)
    assert SECRET not in str(not_a_url.value)
    with pytest.raises(ConfigurationError, match="postgres_pool_max_size"):
        Settings(postgres_pool_min_size=5, postgres_pool_max_size=2)
    with pytest.raises(ConfigurationError, match="HERMES_MEMORY_POSTGRES_SSLMODE"):
        Settings.from_env({"HERMES_MEMORY_POSTGRES_SSLMODE": "sometimes"})
    with pytest.raises(ConfigurationError, match="DATABASE_URL"):
        settings_dsn(Settings())


async def test_the_pool_opens_its_minimum_of_connections(pg_dsn: str) -> None:
    settings = Settings(postgres_dsn=pg_dsn, postgres_pool_min_size=3,
                        postgres_pool_max_size=5)
    async with open_pool(settings) as pool:
        ours = await pool.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 "
            "AND datname = current_database()", APPLICATION_NAME)
        assert ours == 3
        assert pool.get_max_size() == 5


def everything_shown(exc: BaseException) -> str:
    """What a user or a log could see of an error: message, repr, traceback (with its
    causes), and its dsn."""
    return "\n".join([str(exc), repr(exc), "".join(traceback.format_exception(exc)),
                      str(getattr(exc, "dsn", ""))])


async def test_unreachable_server_is_unavailable_and_shows_no_password(
        pg_server: PostgresServer, pg_dsn: str) -> None:
    database = pg_dsn.rsplit("/", 1)[1]
    nobody_listens = pg_server.dsn(database, port=free_port())

    with pytest.raises(DatabaseUnavailableError) as caught:
        await create_pool(Settings(postgres_dsn=nobody_listens))

    assert caught.value.dsn == f"postgresql://hermes:***@127.0.0.1:{nobody_listens.split(':')[-1]}"
    assert "Connect call failed" in str(caught.value) or "refused" in str(caught.value)
    pg_server.assert_no_password(everything_shown(caught.value))


async def test_a_wrong_password_is_a_database_error_showing_neither_password(
        pg_server: PostgresServer, pg_dsn: str) -> None:
    database = pg_dsn.rsplit("/", 1)[1]
    wrong = pg_server.app_password + "-wrong"

    with pytest.raises(DatabaseError) as caught:
        await create_pool(Settings(postgres_dsn=pg_server.dsn(database, password=wrong)))

    assert not isinstance(caught.value, DatabaseUnavailableError)
    assert 'password authentication failed for user "hermes"' in str(caught.value)
    assert isinstance(caught.value.__cause__, asyncpg.InvalidPasswordError)
    shown = everything_shown(caught.value)
    pg_server.assert_no_password(shown)
    assert wrong not in shown and quote(wrong, safe="") not in shown


async def test_a_dsn_the_driver_cannot_read_is_not_echoed(pg_server: PostgresServer) -> None:
    # A port that is not a number: the driver's ValueError is about the DSN's text.
    broken = f"postgresql://hermes:{quote(pg_server.app_password, safe='')}@127.0.0.1:x/db"

    with pytest.raises(DatabaseError) as caught:
        await create_pool(Settings(postgres_dsn=broken))

    pg_server.assert_no_password(everything_shown(caught.value))


async def test_tls_options_from_settings_reach_the_connection(
        pg_server: PostgresServer, pg_dsn: str) -> None:
    # The test server has no TLS: "require" must fail, "disable" must work.
    with pytest.raises(DatabaseError) as required:
        await create_pool(Settings(postgres_dsn=pg_dsn, postgres_sslmode="require"))
    assert "SSL" in str(required.value)
    pg_server.assert_no_password(everything_shown(required.value))

    missing = Path("/nonexistent/root.crt")
    with pytest.raises(ConfigurationError) as verify:
        await create_pool(Settings(postgres_dsn=pg_dsn, postgres_sslmode="verify-full",
                                   postgres_sslrootcert=missing))
    assert str(missing) in str(verify.value)

    async with open_pool(Settings(postgres_dsn=pg_dsn, postgres_sslmode="disable")) as pool:
        assert await pool.fetchval("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()"
                                   ) is False


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "console"])
async def test_logs_never_hold_the_password(pg_server: PostgresServer, pg_dsn: str,
                                            capsys: pytest.CaptureFixture[str],
                                            as_json: bool) -> None:
    """Every line the library logs while it opens, upgrades and fails, rendered by the
    entry points' own configuration (JSON or console, secrets redacted), tracebacks
    included: structlog renders each frame's local variables by default, and asyncpg's
    frames hold the password."""
    database = pg_dsn.rsplit("/", 1)[1]
    configure_logging(json=as_json, level="debug")
    log = structlog.get_logger("test")
    with capture_logs() as events:
        async with open_pool(Settings(postgres_dsn=pg_dsn)) as pool:
            await upgrade(pool)
            await check(pool)
    try:
        await create_pool(Settings(postgres_dsn=pg_server.dsn(database, port=free_port())))
    except DatabaseError:
        # What an entry point does with an error it cannot handle: log it, traceback and all.
        log.exception("postgres.failed", dsn=pg_dsn, database_url=pg_dsn)
    # A host that logs the DSN by mistake, in a message or under any key.
    log.warning(f"connecting to {pg_dsn}", target={"url": pg_dsn})

    opened = [e for e in events if e["event"] == "postgres.pool_open"]
    assert opened and opened[0]["dsn"] == redact_dsn(pg_dsn)
    assert {e["event"] for e in events} >= {"postgres.migration", "postgres.upgrade"}
    pg_server.assert_no_password(repr(events))
    rendered = capsys.readouterr().err
    assert "postgres.failed" in rendered and "DatabaseUnavailableError" in rendered
    assert "hermes:***@127.0.0.1" in rendered
    pg_server.assert_no_password(rendered)


def test_redact_credentials_leaves_other_text_alone() -> None:
    for text in ("no secrets here", "input_tokens=12", "http://127.0.0.1:8000/v1/chat",
                 "user@example.com wrote a=b"):
        assert redact_credentials(text) == text


async def test_a_stopped_server_is_unavailable_until_it_is_back(
        pg_server: PostgresServer, pg_dsn: str) -> None:
    """The outage tests' primitive: stop the server, see the typed error, start it on the
    same port and data, and find what was committed before."""
    settings = Settings(postgres_dsn=pg_dsn, postgres_pool_min_size=0)
    async with open_pool(settings) as pool:
        await upgrade(pool)
        await pool.execute("INSERT INTO sessions (id, source, started_at, updated_at) "
                           "VALUES ('kept', 'api', 0, 0)")
    pg_server.stop()
    try:
        with pytest.raises(DatabaseUnavailableError):
            await create_pool(settings.replace(postgres_pool_min_size=1))
    finally:
        pg_server.start()
    async with open_pool(settings) as pool:
        assert await check(pool) > 0
        assert await pool.fetchval("SELECT id FROM sessions") == "kept"


async def test_a_connection_cut_under_a_pool_becomes_unavailable(
        pg_server: PostgresServer, pg_dsn: str) -> None:
    from hermes_async_memory.postgres import database_errors

    pool = await create_pool(Settings(postgres_dsn=pg_dsn))
    try:
        pg_server.stop(mode="immediate")
        try:
            with pytest.raises(DatabaseUnavailableError) as caught:
                async with database_errors(pg_dsn):
                    await pool.fetchval("SELECT 1")
        finally:
            pg_server.start()
        pg_server.assert_no_password(everything_shown(caught.value))
        # The pool reconnects by itself once the server is back.
        assert await pool.fetchval("SELECT 1") == 1
    finally:
        await close_pool(pool)



# -- what a driver's error means -----------------------------------------------------------


def _raised_by_the_driver() -> BaseException:
    """An error no class names, raised from inside the driver's code (a helper of its
    given what it does not expect)."""
    try:
        asyncpg_utils._quote_ident(None)  # type: ignore[arg-type]
    except AttributeError as raised:
        return raised
    raise AssertionError("the driver's helper took None")


@pytest.mark.parametrize(("exc", "unavailable"), [
    # The reported case: a pooled connection released while the server stops.
    (asyncpg.InternalClientError("cannot switch to state 15; another operation (2) is in "
                                 "progress"), True),
    (asyncpg.InterfaceError("cannot call Connection.fetch(): the underlying connection is "
                            "closed"), True),
    (asyncpg.ConnectionDoesNotExistError("connection was closed in the middle of operation"),
     True),
    (asyncpg.AdminShutdownError("terminating connection due to administrator command"), True),
    (asyncpg.CannotConnectNowError("the database system is starting up"), True),
    (asyncpg.TooManyConnectionsError("sorry, too many clients already"), True),
    (ConnectionResetError(104, "Connection reset by peer"), True),
    (ConnectionRefusedError(111, "Connection refused"), True),
    (TimeoutError(), True),
    (asyncpg.UniqueViolationError("duplicate key value violates unique constraint"), False),
    (asyncpg.InvalidPasswordError("password authentication failed"), False),
    (asyncpg.UndefinedTableError('relation "jobs" does not exist'), False),
    (asyncpg.exceptions.ClientConfigurationError("invalid sslmode"), False),
    (FileNotFoundError(2, "No such file", "/etc/ca.pem"), False),
])
async def test_driver_errors_are_typed_by_what_they_mean(exc: BaseException,
                                                         unavailable: bool) -> None:
    """An outage (server down, connection lost, out of slots) raises
    DatabaseUnavailableError, which every part waits out; a refusal raises DatabaseError."""
    with pytest.raises(DatabaseError) as raised:
        async with database_errors("postgresql://me:pw@db/mem"):
            raise exc
    assert isinstance(raised.value, DatabaseUnavailableError) is unavailable
    assert "pw" not in str(raised.value).replace("PostgreSQL", "")


async def test_an_unclassified_driver_error_is_an_outage_for_a_bounded_time() -> None:
    """An error from inside the driver that no class names counts as an outage until it has
    gone on for the limit with no success between; then it is a failure. A success
    starts the count again."""
    now = [0.0]
    window = UnclassifiedErrors(limit_s=60.0, clock=lambda: now[0])
    odd = _raised_by_the_driver()

    async def once(exc: BaseException | None) -> type[BaseException] | None:
        try:
            async with database_errors("postgresql://db/mem", window):
                if exc is not None:
                    raise exc
        except DatabaseError as raised:
            return type(raised)
        return None

    assert await once(odd) is DatabaseUnavailableError
    now[0] = 59.0
    assert await once(odd) is DatabaseUnavailableError
    now[0] = 60.0
    assert await once(odd) is DatabaseError  # a minute without a success: it counts
    assert await once(None) is None
    now[0] = 100.0
    assert await once(odd) is DatabaseUnavailableError  # counted afresh
    # Our own code's errors are not the driver's: they pass through as they are.
    with pytest.raises(KeyError):
        async with database_errors("postgresql://db/mem", window):
            raise KeyError("ours")
    with pytest.raises(LeaseLostError):
        async with database_errors("postgresql://db/mem", window):
            raise LeaseLostError("job 1 is no longer leased to w1")
