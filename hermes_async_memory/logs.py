"""Logging set-up for entry points (the CLI, the worker process). Library modules never call it.

Modules only do ``log = structlog.get_logger(__name__)``; ``configure_logging`` is the one place
that calls ``structlog.configure``. Lines go to stderr, so stdout stays for what a command prints.
The standard ``logging`` records of dependencies (asyncpg's pool, say) and ``warnings`` go
through the same renderer: with JSON, every line on stderr is one JSON object, a traceback
inside it.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

import structlog
from structlog.typing import Processor, WrappedLogger

from .errors import ConfigurationError

REDACTED = "***"
# A key is secret when its lower-cased name contains one of these ("HONCHO_API_KEY",
# "client_secret", "Authorization", "x-api-key" once "-" is read as "_").
SECRET_MARKERS = ("api_key", "apikey", "secret", "password", "passwd", "authorization")
# "token" is matched as a word (or a word's end: "access_token", "authtoken"), not as a
# substring: "input_tokens" and "recall_snippet_tokens" are counts, not credentials.
TOKEN_MARKER = "token"

# Credentials written inside a value: a URL's password (scheme://user:PASSWORD@host; up to
# the last @ of the run, so a password holding an unescaped @ is covered too), and
# password=... as a query parameter or a libpq keyword/value pair (quoted or not).
_URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://[^\s:/?#@]*):[^\s]*@")
_KEYWORD_PASSWORD = re.compile(
    r"(?i)\b((?:ssl)?password|passwd|pwd)(\s*=\s*)('(?:[^'\\]|\\.)*'?|[^\s&;]*)")

LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
_MAX_DEPTH = 4


def is_secret_key(key: object) -> bool:
    """Whether a log field of this name holds a credential."""
    if not isinstance(key, str):
        return False
    name = key.lower().replace("-", "_")
    if any(marker in name for marker in SECRET_MARKERS):
        return True
    return any(part.endswith(TOKEN_MARKER) for part in name.split("_"))


def redact_credentials(text: str) -> str:
    """``text`` with the passwords written in it replaced by "***": a URL's
    (``postgresql://user:***@host/db``) and ``password=***`` pairs."""
    if "@" in text:
        text = _URL_PASSWORD.sub(rf"\1:{REDACTED}@", text)
    if "=" in text:
        text = _KEYWORD_PASSWORD.sub(rf"\1\2{REDACTED}", text)
    return text


def _redact(value: Any, depth: int) -> Any:
    if isinstance(value, str):
        return redact_credentials(value)
    if depth >= _MAX_DEPTH:
        return value
    if isinstance(value, Mapping):
        return {
            k: REDACTED if is_secret_key(k) else _redact(v, depth + 1) for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        return type(value)(_redact(v, depth + 1) for v in value)
    return value


def redact_secrets(
    logger: WrappedLogger, method_name: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """A structlog processor: the value of every secret-named key, also nested, becomes "***",
    and a password written inside a text (a DSN's) is replaced (``redact_credentials``)."""
    for key, value in event_dict.items():
        if is_secret_key(key):
            event_dict[key] = REDACTED
        elif isinstance(value, (str, Mapping, list, tuple)):
            event_dict[key] = _redact(value, 1)
    return event_dict


def configure_logging(*, json: bool | None = None, level: str = "info") -> None:
    """Send structlog lines to stderr: JSON when stderr is not a TTY (or ``json=True``).

    Raises:
        ConfigurationError: ``level`` is not one of debug, info, warning, error, critical.
    """
    try:
        min_level = LEVELS[level.lower()]
    except KeyError:
        raise ConfigurationError(
            f"log level must be one of {', '.join(LEVELS)}, got {level!r}"
        ) from None
    stream = sys.stderr
    if json is None:
        json = not stream.isatty()
    first: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        redact_secrets,
        structlog.processors.StackInfoRenderer(),
    ]
    # Tracebacks without the frames' local variables: those hold what the code was given, a
    # DSN with its password, an API key, users' messages (structlog renders them by default).
    render: list[Processor]
    if json:
        render = [
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)),
            structlog.processors.JSONRenderer()]
    else:
        render = [structlog.dev.ConsoleRenderer(
            colors=stream.isatty(), exception_formatter=_console_tracebacks())]
    processors = first + render
    _route_standard_logging(first, render, min_level)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(min_level),
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        # Not cached: an entry point (or a test) that configures again must reach the
        # module-level loggers too. The lookup costs ~1 µs, and lines are per batch.
        cache_logger_on_first_use=False,
    )


class StandardLogging(logging.StreamHandler):  # type: ignore[type-arg]
    """The root logger's handler ``configure_logging`` installs: records rendered as
    structlog's lines, to the ``sys.stderr`` of the moment (a test may swap it)."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def _route_standard_logging(first: list[Processor], render: list[Processor],
                            min_level: int) -> None:
    """The root logger's records (a dependency's: asyncpg's pool tracebacks, say) and
    ``warnings`` rendered as structlog's lines at ``min_level``; replaces the handler an
    earlier call installed, leaves any other alone."""
    handler = StandardLogging()
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *first],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *render]))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, StandardLogging)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(min_level)
    logging.captureWarnings(True)


def _console_tracebacks() -> structlog.typing.ExceptionRenderer:
    """rich's tracebacks when rich is installed (the cli extra), without locals; else the
    plain ones (better-exceptions, structlog's other choice, prints variables' values)."""
    if importlib.util.find_spec("rich") is None:
        return structlog.dev.plain_traceback
    return structlog.dev.RichTracebackFormatter(show_locals=False)
