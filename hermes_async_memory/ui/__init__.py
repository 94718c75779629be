"""The memory inspector: read-mostly web pages over a store (``/ui``).

Served by ``hermes-memory worker --http HOST:PORT`` beside /healthz and /metrics, or alone for
a store file by ``hermes-memory ui`` (``ui.server``). The pages need the ``ui`` extra
(Jinja2); this package's top level (the access rules) does not.
"""

from .access import TOKEN_ENV, Access, UiAccessError, check_bind, is_loopback, token_from_env

__all__ = ["TOKEN_ENV", "Access", "UiAccessError", "check_bind", "is_loopback",
           "token_from_env"]
