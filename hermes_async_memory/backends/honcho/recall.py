"""Recall from Honcho: one source per ``recall_mode``, rendered as a block of text.

``recall_mode`` picks the session context (``tokens=``), the user peer's representation or
card, a message search over the user's messages, or the dialectic ``peer.chat`` at a reasoning
level. Each runs under ``recall_deadline_s``; on an error, a timeout or an empty answer the
local store answers instead. ``recall_with_source`` says which source answered.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import anyio
import structlog

from ...errors import BackendError
from ..base import RecallRequest
from .client import HonchoClient, sdk, sdk_reason
from .config import HonchoConfig, RecallMode
from .mapping import USER_FIELD, Mapper

log = structlog.get_logger(__name__)

_RECALL_TEXT_CHARS = 400  # characters kept per message in a recall block
# recall_with_source's sources that mean Honcho did not answer (recall() raises for them).
RECALL_FAILED = frozenset({"local:circuit_open", "local:timeout", "local:error"})


class Recaller:
    """Answers recalls from the configured Honcho source."""

    def __init__(self, config: HonchoConfig, client: HonchoClient, mapper: Mapper) -> None:
        self.config = config
        self.client = client
        self.mapper = mapper
        self.last_source: str | None = None
        self.sources: Counter[str] = Counter()

    async def recall_with_source(self, request: RecallRequest) -> tuple[str | None, str]:
        """The block (or None) and which source answered: ``honcho:<mode>``, or
        ``local:<why>`` (off, circuit_open, timeout, error, empty)."""
        mode = self.config.recall_mode
        block: str | None = None
        if mode == "off":
            source = "local:off"
        elif self.client.breaker.is_open():
            source = "local:circuit_open"
        else:
            try:
                with anyio.fail_after(self.config.recall_deadline_s):
                    block = await self._recall_from(mode, request)
            except TimeoutError:
                source = "local:timeout"
            except Exception as exc:  # the per-job boundary: the local store answers instead
                honcho_sdk = sdk()
                if isinstance(exc, honcho_sdk.NotFoundError):
                    source = "local:empty"  # Honcho has nothing on this session or user yet
                else:
                    source = "local:error"
                    log.warning("honcho_recall_failed", mode=mode, error=sdk_reason(exc),
                                bug=not isinstance(exc, (honcho_sdk.HonchoError, BackendError)))
            else:
                source = f"honcho:{mode}" if block else "local:empty"
                block = block or None
        self.last_source = source
        self.sources[source] += 1
        return block, source

    async def _recall_from(self, mode: RecallMode, request: RecallRequest) -> str:
        honcho_sdk = sdk()
        honcho = self.client.honcho()
        user = self.mapper.user_peer_name(request.user_id, request.session_id)
        session_name = self.mapper.session_name(request.session_id)
        limit = max(1, min(request.limit, 100))
        query = request.query.strip()
        self.client.calls[f"recall_{mode}"] += 1
        if mode == "context":
            ctx = await honcho_sdk.Session(session_name, honcho).aio.context(
                summary=True, tokens=self.config.context_tokens, peer_target=user,
                search_query=query or None)
            return _render_context(ctx, limit)
        if mode == "representation":
            text = await honcho_sdk.Peer(user, honcho).aio.representation(
                search_query=query or None, search_top_k=limit if query else None)
            return _section("What Honcho knows about the user", [str(text or "")])
        if mode == "card":
            card = await honcho_sdk.Peer(user, honcho).aio.get_card()
            return _section("User profile", [str(line) for line in card or []])
        if mode == "search":
            if not query:
                return ""
            found = await honcho.aio.search(query, filters={"metadata": {USER_FIELD: user}},
                                            limit=limit)
            return _render_messages("Related memory (Honcho)", found, limit)
        answer = await honcho_sdk.Peer(user, honcho).aio.chat(
            query or "What matters about this user right now?", session=session_name,
            reasoning_level=self.config.reasoning_level,
            timeout=self.config.recall_deadline_s)
        return _section("Honcho on the user", [str(answer or "")])


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= _RECALL_TEXT_CHARS else text[:_RECALL_TEXT_CHARS - 1] + "…"


def _section(title: str, lines: Sequence[str]) -> str:
    body = [_clip(line) for line in lines if line and line.strip()]
    if not body:
        return ""
    if len(body) == 1:
        return f"{title}:\n{body[0]}"
    return f"{title}:\n" + "\n".join(f"- {line}" for line in body)


def _render_messages(title: str, messages: Iterable[Any], limit: int) -> str:
    lines = []
    seen = set()
    for m in messages:
        text = _clip(str(m.content or ""))
        if not text or text in seen:
            continue
        seen.add(text)
        role = (m.metadata or {}).get("role") or m.peer_id
        day = m.created_at.strftime("%Y-%m-%d") if m.created_at else "?"
        lines.append(f"- [{day} {role}] {text}")
        if len(lines) >= limit:
            break
    return f"{title}:\n" + "\n".join(lines) if lines else ""


def _render_context(ctx: Any, limit: int) -> str:
    """Session context as a block: summary, what Honcho concluded, the card, the last words."""
    blocks = []
    if ctx.summary is not None and ctx.summary.content:
        blocks.append(_section("Conversation so far", [ctx.summary.content]))
    if ctx.peer_representation:
        blocks.append(_section("What Honcho knows about the user", [ctx.peer_representation]))
    if ctx.peer_card:
        blocks.append(_section("User profile", [str(x) for x in ctx.peer_card]))
    recent = list(ctx.messages or [])[-limit:]
    if recent:
        blocks.append(_render_messages("Recent messages", recent, limit))
    return "\n\n".join(b for b in blocks if b)

