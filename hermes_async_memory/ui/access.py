"""Who may open the memory inspector, and who may replay dead letters.

- Bound to a loopback address (the default, 127.0.0.1), the pages are open to whoever can
  reach the port: the machine's own users.
- Any other address needs ``HERMES_MEMORY_UI_TOKEN``: without one the server refuses to
  start (``check_bind``); with one, every page asks for it (HTTP Basic with the token as the
  password, or ``Authorization: Bearer <token>``).
- Replaying dead letters, the page's only write, always needs the token, typed into the
  form: a browser resends Basic credentials on its own, also with a form another site
  posted, so they do not count for it. Without a token set, replay is off.

Tokens are compared in constant time (``hmac.compare_digest``).
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import ConfigurationError

TOKEN_ENV = "HERMES_MEMORY_UI_TOKEN"
# A token shorter than this is refused: it would be guessed.
MIN_TOKEN_CHARS = 16


class UiAccessError(ConfigurationError):
    """The inspector cannot be served as asked (an open address without a token, a weak
    token). The message is one line, for the operator."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` only takes connections from this machine: ``localhost`` or a
    loopback address (``127.0.0.0/8``, ``::1``). A wildcard (``0.0.0.0``, ``::``) is not."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def token_from_env(environ: Mapping[str, str]) -> str | None:
    """``HERMES_MEMORY_UI_TOKEN``, or None when unset or blank.

    Raises:
        UiAccessError: the token is too short to be secret.
    """
    token = environ.get(TOKEN_ENV, "").strip()
    if not token:
        return None
    if len(token) < MIN_TOKEN_CHARS:
        raise UiAccessError(f"{TOKEN_ENV} is {len(token)} characters: use at least "
                            f"{MIN_TOKEN_CHARS} (e.g. python -c 'import secrets; "
                            "print(secrets.token_urlsafe())')")
    return token


def check_bind(host: str, token: str | None) -> None:
    """Refuse to serve the inspector on an address other machines can reach without a token.

    Raises:
        UiAccessError: ``host`` is not loopback and ``token`` is None.
    """
    if token is None and not is_loopback(host):
        raise UiAccessError(
            f"the memory inspector would be open to the network on {host}: set {TOKEN_ENV} "
            "to a secret, or bind to 127.0.0.1")


@dataclass(frozen=True)
class Access:
    """The rules for one server: its ``token`` (None: none set) and whether it is bound to
    loopback only."""

    token: str | None
    loopback: bool

    @classmethod
    def for_bind(cls, host: str, token: str | None) -> Access:
        """Raises: UiAccessError (see ``check_bind``)."""
        check_bind(host, token)
        return cls(token, is_loopback(host))

    @property
    def replay_enabled(self) -> bool:
        return self.token is not None

    def may_read(self, authorization: str | None) -> bool:
        """Whether a request with this ``Authorization`` header may see the pages."""
        if self.loopback:
            return True
        return self.token is not None and self.matches(_credential(authorization))

    def matches(self, given: str | None) -> bool:
        """Whether ``given`` is the token (constant time; False when no token is set)."""
        if self.token is None or given is None:
            return False
        return hmac.compare_digest(given.encode("utf-8", "surrogatepass"),
                                   self.token.encode())


def _credential(header: str | None) -> str | None:
    """The secret an ``Authorization`` header carries: a Bearer token, or Basic's password."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    scheme = scheme.lower()
    if scheme == "bearer":
        return value.strip()
    if scheme == "basic":
        try:
            decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2]
    return None
