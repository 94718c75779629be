"""Optional parts and the extras that install them, with one clear error when one is missing.

    honcho   honcho-ai           the Honcho backend
    cli      rich                the admin commands' progress display
    metrics  prometheus-client   the worker's GET /metrics (and --http)
    ui       jinja2              the memory inspector (/ui, hermes-memory ui)
    postgres asyncpg             the shared PostgreSQL store (hermes-memory db)
    all      every one of them

README.md's table of extras says the same, with test and dev.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import ConfigurationError

PACKAGE = "hermes-async-memory"


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import ``module``, which ``extra`` installs; ``what`` is the feature that needs it.

    Raises:
        ConfigurationError: the module is not installed (the message names the extra).
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigurationError(
            f"{what} needs the {extra} extra: pip install '{PACKAGE}[{extra}]'"
        ) from exc
