"""Which of the messages Hermes hands ``sync_turn`` are this turn's, and their token counts.

Hermes (0.19, ``AIAgent._sync_external_memory_for_turn`` -> ``MemoryManager.sync_all``) passes
its whole conversation, the live list, to a worker thread after each completed turn; an
interrupted turn is not synced, and its messages are in the next turn's list. By the time
``sync_turn`` runs, the list may already hold the next user message, and the reply text it
is given (``assistant_content``) may differ from the reply in the list (a footer appended,
whitespace stripped, a plugin's transform). ``TurnCursors`` picks the span to store:

- the end is this turn's final reply: the last assistant message without tool calls whose
  text matches ``assistant_content`` (equal, equal once stripped, or one a prefix of the
  other), else the last assistant message without tool calls, else the list's end; what
  follows it (the next turn's user message) is left for the next call;
- the start is where the messages handed to the store so far end (a cursor per session),
  so a turn split across two calls, and an interrupted turn, are stored with each message
  once; on first sight of a session, or when the list no longer holds what was handed at
  the cursor (``/undo``, ``/retry``, a compression), the start of this turn (``turn_start``).

The span's messages are copies of Hermes's, every key kept and nothing changed.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from ..errors import InvalidTurnError
from ..message_rows import MAX_TOKENS, content_text, is_token_count

CHARS_PER_TOKEN = 4  # the estimate when a turn's messages report no usage
# Roles that may lead a turn before its user message (a system prompt, a developer note) or
# stand next to it (two user messages in a row).
LEADING_ROLES = frozenset({"user", "system", "developer"})
# How many of the last messages handed over are fingerprinted, to tell a rewritten list.
PRINTS = 8


class Span(NamedTuple):
    """A turn's messages out of the list Hermes handed over."""

    rows: list[dict[str, Any]]  # copies of the messages list[start:end], in order
    start: int
    end: int  # where the next call starts, once these are handed to the store
    prints: tuple[bytes, ...]  # fingerprints of the messages just before ``end``
    held: tuple[bytes, ...]  # and of those just before ``start``
    rewritten: bool  # the list no longer held what was handed at the cursor


class TurnCursors:
    """Per session, how much of Hermes's conversation has been handed to the store (the
    cursor) and fingerprints of the last messages handed; at most ``max_sessions``
    sessions, the least recently synced forgotten first. Thread-safe."""

    def __init__(self, max_sessions: int) -> None:
        self._max = max_sessions
        self._state: dict[str, tuple[int, tuple[bytes, ...]]] = {}
        self._lock = threading.Lock()

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._state

    def __len__(self) -> int:
        return len(self._state)

    def span(self, session_id: str, messages: Sequence[Any], assistant_content: object,
             user_content: object = None) -> Span:
        """This turn's span of ``messages`` (see the module's docstring). Nothing is
        recorded until ``advance``.

        Raises:
            InvalidTurnError: ``messages`` is not a list.
        """
        if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
            raise InvalidTurnError("messages must be a list of message dicts")
        snapshot = list(messages)  # the live list may grow meanwhile: one consistent view
        with self._lock:
            state = self._state.get(session_id)
        cursor = None
        if state is not None and _holds(snapshot, *state):
            cursor = state[0]
        end = turn_end(snapshot, cursor or 0, assistant_content, known=cursor is not None,
                       user_content=user_content)
        start = cursor if cursor is not None else turn_start(snapshot, end)
        rows = [dict(m) if isinstance(m, Mapping) else m for m in snapshot[start:end]]
        prints = tuple(fingerprint(m) for m in snapshot[max(0, end - PRINTS):end])
        held = tuple(fingerprint(m) for m in snapshot[max(0, start - PRINTS):start])
        return Span(rows, start, end, prints, held, state is not None and cursor is None)

    def advance(self, session_id: str, span: Span) -> None:
        """Record ``span`` as handed to the store: the session's next call starts after it."""
        self._set(session_id, span.end, span.prints)

    def hold(self, session_id: str, span: Span) -> None:
        """Record that ``span`` was not handed to the store: the session's next call starts
        where it started (the cursor, or this turn's start on first sight)."""
        self._set(session_id, span.start, span.held)

    def _set(self, session_id: str, cursor: int, prints: tuple[bytes, ...]) -> None:
        with self._lock:
            self._state.pop(session_id, None)
            self._state[session_id] = (cursor, prints)
            while len(self._state) > self._max:
                self._state.pop(next(iter(self._state)))

    def forget(self, session_id: str) -> None:
        """The session's next call starts at its turn's start (the transcript was rewound)."""
        with self._lock:
            self._state.pop(session_id, None)


def turn_end(messages: Sequence[Any], lo: int, assistant_content: object,
             known: bool = False, user_content: object = None) -> int:
    """Where this turn ends in ``messages[lo:]``: after its final reply (an assistant message
    without tool calls whose text equals ``assistant_content``, stripped or not, then one
    whose text is a prefix of it or has it as a prefix); the list's end when there is none.

    ``known``: ``lo`` is where the session's last call ended, so this turn is the first one
    after it: its reply is the first that matches from there, however many later turns the
    list already holds (Hermes's memory thread may run behind the conversation); with no
    match, the first final reply. Else (the session's first call here, or a rewritten list)
    the reply is looked for among the last two user-led turns (an older turn's reply may say
    the same words), then anywhere (the list may hold later turns) where the turn's user
    message says ``user_content`` too, the latest first; with no match, the last final
    reply."""
    finals = [i for i in range(lo, len(messages)) if is_final_reply(messages[i])]
    if not finals:
        return len(messages)
    want = _text(assistant_content).strip()
    texts = {i: _text(messages[i].get("content")).strip() for i in finals}

    def matching(order: Sequence[int]) -> int | None:
        for i in order:
            if texts[i] == want:
                return i + 1
        if want:
            for i in order:
                if texts[i] and (texts[i].startswith(want) or want.startswith(texts[i])):
                    return i + 1
        return None

    if known:
        found = matching(finals)
        return found if found is not None else finals[0] + 1
    near = _last_turns_start(messages, lo)
    latest_first = finals[::-1]
    found = matching([i for i in latest_first if i >= near])
    asked = _text(user_content).strip()
    if found is None and near > lo and asked:
        found = matching([i for i in latest_first
                          if i < near and _asked(messages, i, lo) == asked])
    return found if found is not None else finals[-1] + 1


def _asked(messages: Sequence[Any], reply: int, lo: int) -> str:
    """The text of the user message that leads the turn of the reply at ``reply``."""
    for i in range(reply - 1, lo - 1, -1):
        if _role(messages[i]) == "user":
            return _text(messages[i].get("content")).strip()
        if is_final_reply(messages[i]):
            break
    return ""


def turn_start(messages: Sequence[Any], end: int) -> int:
    """Where the turn ending at ``end`` starts: back over its steps (assistant and tool
    messages) to its user message, then back over the user, system and developer messages
    right before it; never past the previous turn's final reply."""
    i = end - 1
    while i >= 0 and _role(messages[i]) != "user":
        if i < end - 1 and is_final_reply(messages[i]):
            return i + 1
        i -= 1
    while i >= 0 and _role(messages[i]) in LEADING_ROLES:
        i -= 1
    return i + 1


def is_final_reply(m: object) -> bool:
    """An assistant message that calls no tool: a turn's reply (or an interrupted turn's
    closing message)."""
    return (isinstance(m, Mapping) and m.get("role") == "assistant"
            and not m.get("tool_calls") and not m.get("function_call"))


def fingerprint(m: object) -> bytes:
    """A digest of what makes a message itself (role, content, tool calls, call id), to tell
    whether a list still holds it; the bookkeeping keys Hermes adds later do not count."""
    if isinstance(m, Mapping):
        core = [m.get("role"), m.get("content"), m.get("tool_calls"), m.get("tool_call_id"),
                m.get("function_call")]
        try:
            text = json.dumps(core, sort_keys=True, default=repr, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):
            text = f"unprintable {id(m)}"  # the same object, while the list holds it
    else:
        text = f"not a message {id(m)}"
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def token_counts(rows: Sequence[Mapping[str, Any]] | None, user_content: str,
                 assistant_content: str) -> tuple[int, int, bool]:
    """(input tokens, output tokens, estimated) of a turn: the usage its assistant messages
    report when every one of them reports it (OpenAI's ``prompt_tokens`` and
    ``completion_tokens``, or ``input_tokens`` and ``output_tokens``); else estimated at
    about four characters a token, from what was sent (user, system and tool text) and what
    came back (assistant text and tool calls). Structured content counts its text parts."""
    rows = [m for m in rows or () if isinstance(m, Mapping)]
    replies = [m for m in rows if m.get("role") == "assistant"]
    if replies and all(isinstance(m.get("usage"), Mapping) for m in replies):
        tokens_in = tokens_out = 0
        for m in replies:
            usage = m["usage"]
            got_in = usage.get("prompt_tokens", usage.get("input_tokens"))
            got_out = usage.get("completion_tokens", usage.get("output_tokens"))
            if not (is_token_count(got_in) and is_token_count(got_out)):
                break
            tokens_in += got_in
            tokens_out += got_out
        else:
            return min(tokens_in, MAX_TOKENS), min(tokens_out, MAX_TOKENS), False
    sent = len(_text(user_content)) if not rows else 0
    said = len(_text(assistant_content)) if not rows else 0
    for m in rows:
        size = len(_text(m.get("content")))
        if m.get("role") == "assistant":
            calls = m.get("tool_calls")
            said += size + (len(json.dumps(calls, default=str)) if calls else 0)
        else:
            sent += size
    return -(-sent // CHARS_PER_TOKEN), -(-said // CHARS_PER_TOKEN), True


def _role(m: object) -> object:
    return m.get("role") if isinstance(m, Mapping) else None


def _text(content: object) -> str:
    """A message's text: its content when a string, the text parts of structured content
    (as Hermes flattens a reply for ``assistant_content``), else ""."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    return content_text(content) or ""


def _holds(messages: Sequence[Any], cursor: int, prints: tuple[bytes, ...]) -> bool:
    """Whether ``messages`` still holds, just before ``cursor``, the messages handed last."""
    first = cursor - len(prints)
    if first < 0 or cursor > len(messages):
        return False
    return all(fingerprint(messages[first + k]) == p for k, p in enumerate(prints))


def _last_turns_start(messages: Sequence[Any], lo: int) -> int:
    """The start of the second-to-last run of user messages in ``messages[lo:]`` (this
    turn's, when the next turn's user message is already there), else ``lo``."""
    runs = 0
    in_run = False
    for i in range(len(messages) - 1, lo - 1, -1):
        if _role(messages[i]) == "user":
            if not in_run:
                runs += 1
                in_run = True
        else:
            if in_run and runs == 2:
                return i + 1
            in_run = False
    return lo
