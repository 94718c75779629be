"""Where the Honcho replica is and how to talk to it: ``HonchoConfig``, read from ``HONCHO_*``."""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from ...env import read_env
from ...errors import ConfigurationError

# The server's limit on a message's content (settings.MAX_MESSAGE_SIZE in honcho): longer
# contents are split across messages.
MAX_MESSAGE_CHARS = 25_000

RecallMode = Literal["context", "representation", "card", "search", "chat", "off"]
RECALL_MODES: tuple[RecallMode, ...] = (
    "context", "representation", "card", "search", "chat", "off",
)
ReasoningLevel = Literal["minimal", "low", "medium", "high", "max"]
REASONING_LEVELS: tuple[ReasoningLevel, ...] = ("minimal", "low", "medium", "high", "max")
ENV_PREFIX = "HONCHO_"
PRODUCTION_URL = "https://api.honcho.dev"
_LOOPBACK_NAMES = ("localhost", "localhost.localdomain")


@dataclass(frozen=True, slots=True)
class HonchoConfig:
    """Where the Honcho replica is and how to talk to it. Build it once and pass it in."""

    base_url: str = PRODUCTION_URL
    # Not needed for a server on this machine (a loopback base URL); required otherwise.
    api_key: str | None = field(default=None, repr=False)
    workspace_id: str = "hermes"
    assistant_peer: str = "hermes"
    user_peer_prefix: str = "user-"
    # Session-level observation (SessionPeerConfig), set once when a session is first seen.
    # The default: Honcho reasons about the user, the assistant keeps a theory of mind of the
    # user, and nobody models the assistant. configure_sessions=False skips that call (one
    # fewer per new session); the server then creates the session with its own defaults when
    # the first messages arrive.
    configure_sessions: bool = True
    user_observe_me: bool = True
    user_observe_others: bool = False
    assistant_observe_me: bool = False
    assistant_observe_others: bool = True
    # Writing.
    write_concurrency: int = 16  # sessions written at once (and HTTP connections kept)
    request_timeout_s: float = 10.0
    max_attempts: int = 5  # per call, before its turns fail
    backoff_base_s: float = 0.25
    backoff_max_s: float = 8.0
    retry_after_max_s: float = 60.0  # a longer Retry-After fails the batch instead of waiting
    # The longest the server may still run a request after its client gave up, counted from
    # when the client sent it (Honcho does not abort a request whose client disconnected;
    # about 10 s for Honcho 3.0.x). A batch whose outcome is unknown is not checked and sent
    # again before then; nor, after a start, is anything an earlier run may have sent.
    max_inflight_s: float = 10.0
    breaker_failures: int = 5  # consecutive failed calls that open the circuit
    breaker_cooldown_s: float = 30.0
    max_message_chars: int = MAX_MESSAGE_CHARS  # longer contents are split across messages
    known_sessions: int = 100_000  # sessions remembered as configured (LRU)
    # Recall.
    recall_mode: RecallMode = "context"
    recall_deadline_s: float = 2.0
    context_tokens: int = 2_000
    reasoning_level: ReasoningLevel = "low"

    def __post_init__(self) -> None:
        positive_ints = ("write_concurrency", "max_attempts", "breaker_failures",
                         "max_message_chars", "known_sessions", "context_tokens")
        for name in positive_ints:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigurationError(f"{name} must be a positive integer, got {value!r}")
        positive = ("request_timeout_s", "recall_deadline_s")
        non_negative = ("backoff_base_s", "backoff_max_s", "retry_after_max_s",
                        "breaker_cooldown_s", "max_inflight_s")
        for name in positive + non_negative:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0 or (
                    value == 0 and name in positive):
                raise ConfigurationError(f"{name} must be a positive number, got {value!r}")
        if self.max_message_chars > MAX_MESSAGE_CHARS:
            raise ConfigurationError(
                f"max_message_chars must be at most {MAX_MESSAGE_CHARS} (the server's limit)")
        if self.recall_mode not in RECALL_MODES:
            raise ConfigurationError(
                f"recall_mode must be one of {', '.join(RECALL_MODES)}, got {self.recall_mode!r}")
        if self.reasoning_level not in REASONING_LEVELS:
            raise ConfigurationError(
                f"reasoning_level must be one of {', '.join(REASONING_LEVELS)}, "
                f"got {self.reasoning_level!r}")
        parts = urlsplit(self.base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigurationError(f"base_url must be an http(s) URL, got {self.base_url!r}")
        if not self.api_key and not is_loopback_url(self.base_url):
            raise ConfigurationError(
                "api_key is required for a Honcho server that is not on this machine "
                f"({parts.hostname}); set HONCHO_API_KEY")
        for name in ("workspace_id", "assistant_peer", "user_peer_prefix"):
            if not getattr(self, name):
                raise ConfigurationError(f"{name} must not be empty")
        if self.assistant_peer.startswith(self.user_peer_prefix):
            # Then some user's peer could be the assistant's.
            raise ConfigurationError(
                f"assistant_peer {self.assistant_peer!r} must not start with user_peer_prefix "
                f"{self.user_peer_prefix!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: object
                 ) -> HonchoConfig:
        """Read ``HONCHO_<FIELD>`` variables: ``HONCHO_API_KEY``, ``HONCHO_BASE_URL``,
        ``HONCHO_WORKSPACE_ID``, ``HONCHO_ASSISTANT_PEER``, ``HONCHO_USER_PEER_PREFIX``,
        ``HONCHO_RECALL_MODE``, ...

        Raises:
            ConfigurationError: a variable does not parse as its field's type, or the values
                are invalid together (say, a remote base URL without an API key).
        """
        env = os.environ if environ is None else environ
        values = read_env(cls, env, ENV_PREFIX)
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]

    def replace(self, **changes: object) -> HonchoConfig:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


def is_loopback_url(url: str) -> bool:
    """Whether ``url`` names this machine (localhost, 127.0.0.0/8, ::1)."""
    host = (urlsplit(url).hostname or "").lower()
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


