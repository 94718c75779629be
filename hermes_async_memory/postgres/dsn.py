"""The PostgreSQL DSN: which one applies, the TLS options merged into it, and how it is shown.

A DSN is a ``postgresql://`` URL (asyncpg reads no other form). Its password never leaves
this process in text: what is logged or put in an error is ``redact_dsn(dsn)``
(``postgresql://hermes:***@db.example:5432/memory``), and the text of an error of the
driver's is passed through ``scrub`` before it becomes ours. This module imports no driver.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from ..errors import ConfigurationError
from ..logs import REDACTED, redact_credentials
from ..settings import Settings

DSN_HELP = ("give --dsn, or set DATABASE_URL (or HERMES_MEMORY_POSTGRES_DSN), e.g. "
            "postgresql://USER:PASSWORD@HOST:5432/DATABASE")


def redact_dsn(dsn: str) -> str:
    """``dsn`` as it may be shown: its password, in the URL or as a parameter, is ``***``."""
    return redact_credentials(dsn)


def dsn_secrets(dsn: str) -> frozenset[str]:
    """Every form of ``dsn``'s password a text might hold: as written in the URL and
    unescaped, read up to the first ``@`` (as asyncpg reads it) and up to the last (as a URL
    parser does), and a ``password=`` parameter's. Empty when it has none."""
    found: set[str] = set()
    rest = dsn.split("://", 1)[1] if "://" in dsn else dsn
    netloc = rest.split("/", 1)[0]
    for userinfo in (netloc.partition("@")[0] if "@" in netloc else "",
                     netloc.rpartition("@")[0]):
        if ":" in userinfo:
            found.add(userinfo.partition(":")[2])
    query = dsn.partition("?")[2]
    for name, value in parse_qsl(query, keep_blank_values=True):
        if name.lower() in ("password", "sslpassword"):
            found.add(value)
    found |= {unquote(secret) for secret in found}
    return frozenset(s for s in found if s)


def scrub(text: str, dsn: str | None) -> str:
    """``text`` without ``dsn``'s password in any form, nor any URL's or ``password=``'s."""
    if dsn is not None:
        # Longest first: a password that holds another form of itself is replaced whole.
        for secret in sorted(dsn_secrets(dsn), key=len, reverse=True):
            text = text.replace(secret, REDACTED)
    return redact_credentials(text)


def settings_dsn(settings: Settings) -> str:
    """The DSN to connect with: ``settings.postgres_dsn`` with the settings' TLS options
    (``postgres_sslmode``, ``postgres_sslrootcert``) set in its query, over any the URL has.

    Raises:
        ConfigurationError: no DSN is set (``Settings`` checked its form).
    """
    dsn = settings.postgres_dsn
    if not dsn:
        raise ConfigurationError(f"no PostgreSQL database is configured: {DSN_HELP}")
    options: dict[str, str] = {}
    if settings.postgres_sslmode is not None:
        options["sslmode"] = settings.postgres_sslmode
    if settings.postgres_sslrootcert is not None:
        options["sslrootcert"] = str(settings.postgres_sslrootcert)
    return with_query(dsn, options) if options else dsn


def with_query(dsn: str, options: dict[str, str]) -> str:
    """``dsn`` with ``options`` set as query parameters (replacing the same names). The
    rest of the URL, its escaped password included, is kept as written."""
    parts = urlsplit(dsn)
    query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True)
             if k not in options]
    query += list(options.items())
    return urlunsplit(parts._replace(query=urlencode(query)))
