"""A template from a finished session's OpenAI-format messages (as the store keeps them).

What is kept:
  - system context: the text of the system and developer messages, each once, joined,
    cut at a line end to ``max_context_chars``;
  - examples: the calls that were answered and judged a success (``procedural.extract``
    decides, by its ``OutcomeRules``) with a JSON object for arguments, the first of each
    (tool, arguments) pair, at most ``max_examples``. A failed call is never an example,
    the call that fixed it is;
  - user patterns: the first ``user_pattern_messages`` non-empty user messages, on one line
    each, cut to ``USER_PATTERN_CHARS``;
  - context markers: files and URLs in the arguments and answers (read as JSON when they
    are) of those successful calls (a failed call's path may not exist), first seen first,
    at most ``max_markers``. A file is a string under a key named like a path
    (``PATH_KEYS``), or text matching ``PATH_PATTERN``: a path with a directory and an
    extension, deliberately narrow ("--- a/x.py" in a diff names x.py). A URL keeps its
    scheme, host, port and path; its credentials, query and fragment are dropped, since
    they may hold tokens and a template is shown to other sessions.
"""

from __future__ import annotations

import json
import re
import time
import unicodedata
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from ..procedural.extract import CallRecord, OutcomeRules, calls_in
from .classify import DEFAULT_RULES, classify
from .model import (
    DEFAULT_SETTINGS,
    RESERVED_TYPES,
    Example,
    InvalidTemplateError,
    Template,
    TemplateSettings,
    normalize_tags,
)

USER_PATTERN_CHARS = 300
MARKER_CHARS = 260  # a longer string is not taken for a path
NAME_CHARS = 200
PATH_KEYS = frozenset({"path", "file", "filename", "file_path", "filepath", "paths", "files",
                       "target_file", "source_file"})
URL_PATTERN = re.compile(r"https?://[^\s<>\"'`()\[\]{}|\\^]+", re.IGNORECASE)
PATH_PATTERN = re.compile(
    r"(?<![\w/.:@~-])"  # not inside a word, a URL or an e-mail address
    r"((?:~|\.{1,2})?/?(?:[\w.-]+/)+"  # at least one directory
    r"[\w-][\w.-]*\.[A-Za-z][A-Za-z0-9]{0,7})"  # a name with an extension
    r"(?![\w/-])")
_URL_TAIL = ".,;:!?'\""
_DIFF_HEADER = re.compile(r"(?m)^(?:---|\+\+\+) [ab]/")  # "--- a/src/x.py" names src/x.py


def extract(messages: Sequence[Mapping[str, Any]], *, name: str, session_id: str,
            settings: TemplateSettings = DEFAULT_SETTINGS, description: str | None = None,
            tags: Iterable[str] = (), task_type: str | None = None,
            rules: OutcomeRules = DEFAULT_RULES, now: float | None = None) -> Template:
    """The template a session's ``messages`` make (see the module's docstring).

    ``task_type`` defaults to ``classify(messages, settings)``; ``now`` (epoch seconds) to
    the current time.

    Raises:
        InvalidTemplateError: ``name`` or ``session_id`` is empty, ``task_type`` is not a
            family of ``settings`` nor "mixed" or "chat", or a tag is not a string.
    """
    name = _checked_name(name, "name")
    session_id = _checked_name(session_id, "session_id")
    if task_type is None:
        task_type = classify(messages, settings)
    elif task_type not in settings.families and task_type not in RESERVED_TYPES:
        known = ", ".join([*settings.families, *RESERVED_TYPES])
        raise InvalidTemplateError(f"task type {task_type!r} is not one of {known}")
    good = [c for c in calls_in(messages, rules) if c.answered and c.outcome.ok]
    return Template(
        name=name,
        task_type=task_type,
        source_session_id=session_id,
        description=(description or "").strip(),
        tags=normalize_tags(tags),
        system_context=system_context(messages, settings.max_context_chars),
        examples=examples(good, settings.max_examples),
        user_patterns=user_patterns(messages, settings.user_pattern_messages),
        context_markers=markers(good, settings.max_markers),
        created_at=time.time() if now is None else now,
    )


def examples(calls: Iterable[CallRecord], limit: int) -> tuple[Example, ...]:
    """The first ``limit`` calls with object arguments, one per (tool, arguments)."""
    seen: set[tuple[str, str]] = set()
    out: list[Example] = []
    for c in calls:
        if len(out) >= limit:
            break
        key = (c.tool, c.arguments_json)
        if not isinstance(c.arguments, dict) or key in seen:
            continue  # other arguments could not be replayed as a valid request
        seen.add(key)
        out.append(Example(tool=c.tool, arguments=c.arguments, result=c.result,
                           call_id=c.call_id))
    return tuple(out)


def system_context(messages: Sequence[Mapping[str, Any]], limit: int) -> str:
    """The system and developer messages' text, each distinct one once, cut at a line end
    to ``limit`` characters."""
    parts: dict[str, None] = {}
    for m in messages:
        if m.get("role") in ("system", "developer"):
            text = text_of(m.get("content")).strip()
            if text:
                parts[text] = None
    return cut_lines("\n\n".join(parts), limit)


def user_patterns(messages: Sequence[Mapping[str, Any]], count: int) -> tuple[str, ...]:
    """The first ``count`` non-empty user messages, each on one line and cut short."""
    out: list[str] = []
    for m in messages:
        if len(out) >= count:
            break
        if m.get("role") == "user":
            text = " ".join(text_of(m.get("content")).split())
            if text:
                out.append(shorten(text, USER_PATTERN_CHARS))
    return tuple(out)


def markers(calls: Iterable[CallRecord], limit: int) -> tuple[str, ...]:
    """Files and URLs in the calls' arguments and answers, first seen first."""
    found: dict[str, None] = {}
    for c in calls:
        for marker in (*_argument_markers(c.arguments), *_result_markers(c.result)):
            if len(found) >= limit:
                return tuple(found)
            found[marker] = None
    return tuple(found)


def markers_in_text(text: str) -> Iterator[str]:
    """URLs (cleaned) then file paths in ``text``, in order of each kind."""
    for match in URL_PATTERN.finditer(text):
        url = clean_url(match.group(0))
        if url:
            yield url
    text = _DIFF_HEADER.sub(" ", URL_PATTERN.sub(" ", text))
    for match in PATH_PATTERN.finditer(text):
        yield match.group(1)


def _result_markers(result: str) -> Iterator[str]:
    # A JSON answer is read as data: its strings unescaped, its "path" keys known as such.
    # A summary cut short is not JSON any more; its text is scanned as it is.
    if result.lstrip().startswith(("{", "[")):
        try:
            doc = json.loads(result)
        except ValueError:
            pass
        else:
            yield from _argument_markers(doc)
            return
    yield from markers_in_text(result)


def clean_url(url: str) -> str | None:
    """``url`` without credentials, query or fragment (None when it has no host)."""
    url = url.rstrip(_URL_TAIL)
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not host:
        return None
    netloc = host if port is None else f"{host}:{port}"
    return f"{parts.scheme.lower()}://{netloc}{parts.path}"


def _argument_markers(arguments: Any, key: str | None = None) -> Iterator[str]:
    if isinstance(arguments, Mapping):
        for k, v in arguments.items():
            yield from _argument_markers(v, str(k).lower())
    elif isinstance(arguments, list):
        for v in arguments:
            yield from _argument_markers(v, key)
    elif isinstance(arguments, str):
        value = arguments.strip()
        if (key in PATH_KEYS and any(ch.isalnum() for ch in value)  # not ".", "/" or "~"
                and len(value) <= MARKER_CHARS and "\n" not in value
                and not URL_PATTERN.match(value)):
            yield value
        else:
            yield from markers_in_text(arguments)


def text_of(content: Any) -> str:
    """A message content's text: the string, or its text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p["text"] for p in content
                         if isinstance(p, Mapping) and isinstance(p.get("text"), str))
    return ""


def shorten(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters at a space when it can, with an ellipsis."""
    if len(text) <= limit:
        return text
    if limit <= 1:
        return "…"[:limit]
    head = text[:limit - 1]
    space = head.rfind(" ")
    if space > limit // 2:
        head = head[:space]
    return head.rstrip() + "…"


def cut_lines(text: str, limit: int) -> str:
    """``text`` cut at a line end to at most ``limit`` characters; a first line that is
    longer on its own is shortened."""
    if len(text) <= limit:
        return text
    if limit <= 0:
        return ""
    end = text.rfind("\n", 0, limit + 1)
    if end <= 0:
        return shorten(text.split("\n", 1)[0], limit)
    return text[:end].rstrip()


def _checked_name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidTemplateError(f"{what} must be a non-empty string, got {value!r}")
    text: str = value.strip()
    if len(text) > NAME_CHARS or any(unicodedata.category(ch) == "Cc" for ch in text):
        raise InvalidTemplateError(
            f"{what} must be at most {NAME_CHARS} characters without control characters")
    return text
