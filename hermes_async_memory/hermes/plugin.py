"""What the plugin folder ``hermes-memory hermes install`` writes imports: ``register(ctx)``.

Hermes Agent's loader (``plugins.memory._load_provider_from_dir``) imports
``$HERMES_HOME/plugins/hermes_async_memory/__init__.py`` and calls its ``register(ctx)``
with a collector whose ``register_memory_provider`` keeps the provider. That file only
re-exports from here, so upgrading this package upgrades the plugin without a reinstall.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

from ..logs import redact_secrets
from .provider import HermesMemoryProvider

__all__ = ["HermesMemoryProvider", "register", "route_logs_to_logging"]


def register(ctx: Any) -> None:
    """Hermes Agent's plugin entry point: route our log lines, hand over a provider."""
    route_logs_to_logging()
    ctx.register_memory_provider(HermesMemoryProvider())


def route_logs_to_logging() -> None:
    """Send the library's structlog lines to the stdlib logger of each module, unless the
    host configured structlog itself.

    Hermes is the entry point here, and it logs through ``logging`` (files under
    ``$HERMES_HOME/logs``). structlog unconfigured would print to stdout, into the agent's
    terminal UI. Secrets are redacted as in the CLI's set-up.
    """
    if structlog.is_configured():
        return
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            redact_secrets,
            structlog.processors.format_exc_info,
            structlog.processors.KeyValueRenderer(key_order=["event"], sort_keys=True),
        ],
        # Levels are left to logging's own configuration.
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )
