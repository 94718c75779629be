"""Warm-start templates as data: the settings that shape them, a template with its examples
and statistics, its JSON document, and the errors of this package.

    InvalidTurnError (errors.py)   input refused before anything was stored
    ├── InvalidTemplateError       a template document or a template's field is unusable
    │   ├── UnknownTemplateError   no template of that name is stored
    │   └── TemplateExistsError    a template of that name is stored already
    └── InvalidChatError           a message list would not validate as a chat request
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

from ..env import PARSE, read_env
from ..errors import ConfigurationError, InvalidTurnError

SCHEMA_VERSION = 1  # of the JSON document; a newer one is refused, not guessed at
ENV_PREFIX = "HERMES_MEMORY_TEMPLATE_"

CODE = "code"
FILE = "file"
RESEARCH = "research"
MIXED = "mixed"  # tool calls, but no family holds the threshold share of them
CHAT = "chat"  # no tool call at all
RESERVED_TYPES = (MIXED, CHAT)

# Task type -> tool-name patterns (fnmatch, case-insensitive). Order matters: a tool that
# matches several families counts for the first. "patch" is a file tool, as in the Hermes
# research behind templates: code sessions are execute_code/terminal-led feedback loops,
# file sessions are read/search/patch edits. "file" comes before "research" so that
# search_files is a file tool although it also matches "*search*".
DEFAULT_FAMILIES: Mapping[str, tuple[str, ...]] = MappingProxyType({
    CODE: ("terminal", "execute_code", "run_*", "python*", "shell*", "bash*", "git*",
           "process*"),
    FILE: ("read_file", "write_file", "search_files", "patch", "*file*", "list_dir*",
           "edit*"),
    RESEARCH: ("web_search", "web_extract", "web_*", "browser_*", "*search*", "fetch*",
               "arxiv*"),
})


class InvalidTemplateError(InvalidTurnError):
    """A template document cannot be read, or a template's field is unusable."""


class UnknownTemplateError(InvalidTemplateError):
    """No template of that name is stored."""


class TemplateExistsError(InvalidTemplateError):
    """A template of that name is stored already (and replacing it was not asked for)."""


class InvalidChatError(InvalidTurnError):
    """A message list would not validate as an OpenAI chat completion request.

    ``index`` is the position of the message at fault (None when the list as a whole is)."""

    def __init__(self, message: str, index: int | None = None) -> None:
        self.index = index
        super().__init__(message if index is None else f"messages[{index}]: {message}")


def parse_families(text: str) -> dict[str, tuple[str, ...]]:
    """``"code:terminal,run_*;file:read_file,*file*"`` as a families mapping (in that order).

    Raises:
        ValueError: an entry is not ``name:pattern,...``.
    """
    out: dict[str, tuple[str, ...]] = {}
    for entry in text.split(";"):
        if not entry.strip():
            continue
        name, sep, patterns = entry.partition(":")
        if not sep:
            raise ValueError(f"{entry.strip()!r} is not 'task_type:pattern,pattern'")
        out[name.strip()] = tuple(p.strip() for p in patterns.split(",") if p.strip())
    return out


def parse_words(text: str) -> tuple[str, ...]:
    """``"error, failed,crash"`` as ``("error", "failed", "crash")`` (lower-cased)."""
    return tuple(w.strip().lower() for w in text.split(",") if w.strip())


@dataclass(frozen=True)
class TemplateSettings:
    """How sessions are classified, what a template keeps, when one is chosen, how a
    session's outcome is judged, and when a session becomes a template by itself."""

    threshold: float = 0.6  # share of a session's tool calls its dominant family holds
    families: Mapping[str, tuple[str, ...]] = field(
        default_factory=lambda: DEFAULT_FAMILIES, metadata={PARSE: parse_families})
    max_examples: int = 10  # successful tool calls kept per template
    user_pattern_messages: int = 10  # first user messages kept as patterns
    max_markers: int = 30  # files and URLs kept per template
    max_context_chars: int = 4000  # of the source session's system messages
    min_evidence: int = 3  # ended sessions before a template's success rate counts
    min_success_rate: float = 0.5  # a template chosen must have at least this rate
    # A session's outcome, in this order: explicit feedback; an end reason in
    # failure_reasons (case aside) is a failure; a share of failed tool calls above
    # max_error_rate is a failure; else a success.
    failure_reasons: tuple[str, ...] = field(
        default=("error", "failed", "aborted", "crash"), metadata={PARSE: parse_words})
    max_error_rate: float = 0.5
    first_turns: int = 3  # warm vs cold compares the tool error rate of this many turns
    # When on, a session that ends a success with at least auto_min_calls successful tool
    # calls becomes a template, unless one of its task type has the same examples or source.
    auto_create: bool = False
    auto_min_calls: int = 3
    # Warm starts in a host that can only take text (the Hermes provider): a brand-new
    # session starts from the template chosen for warm_task_type (unset: the task type the
    # user's recent tool calls make) and warm_tags, delivered through the system prompt
    # block and the session's first prefetch; every new session is recorded as a warm or a
    # cold start, and its end as its outcome.
    warm_start: bool = False
    warm_task_type: str = ""
    warm_tags: tuple[str, ...] = field(default=(), metadata={PARSE: parse_words})
    warm_max_chars: int = 2000

    def __post_init__(self) -> None:
        if not (isinstance(self.threshold, (int, float)) and 0.0 < self.threshold <= 1.0):
            raise ConfigurationError(f"threshold must be in (0, 1], got {self.threshold!r}")
        if not (isinstance(self.min_success_rate, (int, float))
                and 0.0 <= self.min_success_rate <= 1.0):
            raise ConfigurationError(
                f"min_success_rate must be in [0, 1], got {self.min_success_rate!r}")
        if not (isinstance(self.max_error_rate, (int, float))
                and not isinstance(self.max_error_rate, bool)
                and 0.0 <= self.max_error_rate <= 1.0):
            raise ConfigurationError(
                f"max_error_rate must be in [0, 1], got {self.max_error_rate!r}")
        if not isinstance(self.auto_create, bool):
            raise ConfigurationError(f"auto_create must be a bool, got {self.auto_create!r}")
        reasons = self.failure_reasons
        if isinstance(reasons, str) or not isinstance(reasons, (tuple, list, frozenset)) or (
                not all(isinstance(r, str) for r in reasons)):
            raise ConfigurationError(
                f"failure_reasons must be a sequence of strings, got {reasons!r}")
        object.__setattr__(self, "failure_reasons",
                           tuple(dict.fromkeys(r.strip().lower() for r in reasons if r.strip())))
        for name in ("max_examples", "user_pattern_messages", "max_markers",
                     "max_context_chars", "min_evidence", "first_turns", "auto_min_calls",
                     "warm_max_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigurationError(f"{name} must be an integer >= 0, got {value!r}")
        if self.first_turns < 1:
            raise ConfigurationError(f"first_turns must be at least 1, got {self.first_turns}")
        object.__setattr__(self, "families", _checked_families(self.families))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None,
                 **overrides: object) -> TemplateSettings:
        """Read ``HERMES_MEMORY_TEMPLATE_<FIELD>`` variables (``..._FAMILIES`` as
        ``code:terminal,run_*;file:read_file``, ``..._FAILURE_REASONS`` as
        ``error,failed``).

        Raises:
            ConfigurationError: a variable does not parse, or a value is out of range.
        """
        values = read_env(cls, os.environ if environ is None else environ, ENV_PREFIX)
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


def _checked_families(families: Any) -> Mapping[str, tuple[str, ...]]:
    if not isinstance(families, Mapping) or not families:
        raise ConfigurationError("families must be a non-empty mapping of task type to "
                                 "tool-name patterns")
    out: dict[str, tuple[str, ...]] = {}
    for name, patterns in families.items():
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise ConfigurationError(f"a family name must be a trimmed string, got {name!r}")
        if name in RESERVED_TYPES:
            raise ConfigurationError(f"{name!r} is reserved; it cannot name a family")
        if isinstance(patterns, str) or not isinstance(patterns, (tuple, list)) or not all(
                isinstance(p, str) and p.strip() for p in patterns) or not patterns:
            raise ConfigurationError(
                f"family {name!r} needs a non-empty sequence of patterns, got {patterns!r}")
        out[name] = tuple(patterns)
    return MappingProxyType(out)


DEFAULT_SETTINGS = TemplateSettings()  # immutable: a safe default argument


@dataclass(frozen=True)
class Example:
    """A successful, answered tool call of the source session, replayable as it was."""

    tool: str
    arguments: Mapping[str, Any]  # a JSON object: calls with other arguments are not kept
    result: str  # the start of the tool's answer (a summary)
    call_id: str  # its id in the source session


@dataclass(frozen=True)
class Template:
    """What a finished session teaches a new one, with how well it has served since."""

    name: str
    task_type: str
    source_session_id: str
    description: str = ""
    tags: tuple[str, ...] = ()
    system_context: str = ""
    examples: tuple[Example, ...] = ()
    user_patterns: tuple[str, ...] = ()  # the first user messages, trimmed
    context_markers: tuple[str, ...] = ()  # files and URLs seen, first seen first
    usage_count: int = 0  # sessions started from it
    successes: int = 0  # of those, ended well
    failures: int = 0  # of those, ended badly
    created_at: float = 0.0  # epoch seconds

    @property
    def ended(self) -> int:
        """Sessions started from this template whose outcome is known."""
        return self.successes + self.failures

    @property
    def success_rate(self) -> float | None:
        """Successes per ended session; None before any ended. ``choose`` applies the
        evidence floor, since the floor is a setting."""
        return self.successes / self.ended if self.ended else None

    def used(self) -> Template:
        """This template with one more session started from it."""
        return replace(self, usage_count=self.usage_count + 1)

    def outcome(self, ok: bool) -> Template:
        """This template with one more ended session, a success when ``ok``."""
        if ok:
            return replace(self, successes=self.successes + 1)
        return replace(self, failures=self.failures + 1)

    def to_dict(self) -> dict[str, Any]:
        """The JSON document as a dict (``schema`` first)."""
        return {
            "schema": SCHEMA_VERSION,
            "name": self.name,
            "description": self.description,
            "task_type": self.task_type,
            "tags": list(self.tags),
            "source_session_id": self.source_session_id,
            "system_context": self.system_context,
            "examples": [{"tool": e.tool, "arguments": dict(e.arguments), "result": e.result,
                          "call_id": e.call_id} for e in self.examples],
            "user_patterns": list(self.user_patterns),
            "context_markers": list(self.context_markers),
            "usage_count": self.usage_count,
            "successes": self.successes,
            "failures": self.failures,
            "created_at": self.created_at,
        }

    def to_json(self, *, indent: int | None = None) -> str:
        """The template as a JSON document that ``from_json`` reads back equal."""
        return json.dumps(self.to_dict(), ensure_ascii=False, indent=indent)

    @classmethod
    def from_dict(cls, doc: Any) -> Template:
        """A template from its document (as ``to_dict`` makes it).

        Raises:
            InvalidTemplateError: not a dict, another schema version, a key missing or
                unknown, or a value of the wrong type.
        """
        if not isinstance(doc, Mapping):
            raise InvalidTemplateError(
                f"a template document must be a JSON object, got {type(doc).__name__}")
        schema = doc.get("schema")
        if schema != SCHEMA_VERSION or isinstance(schema, bool):
            raise InvalidTemplateError(
                f"template schema {schema!r} is not supported (this version reads "
                f"{SCHEMA_VERSION})")
        unknown = sorted(set(doc) - set(_FIELDS) - {"schema"})
        if unknown:
            raise InvalidTemplateError(f"unknown template key(s): {', '.join(unknown)}")
        missing = [k for k in _FIELDS if k not in doc]
        if missing:
            raise InvalidTemplateError(f"missing template key(s): {', '.join(missing)}")
        values = {k: _check(k, doc[k], kind) for k, kind in _FIELDS.items()}
        values["examples"] = tuple(_example(i, e) for i, e in enumerate(doc["examples"]))
        # As stored and chosen by: a tag the store could not take is refused here, where a
        # record is read, not when its batch is built (which would fail the whole batch).
        values["tags"] = normalize_tags(values["tags"])
        return cls(**values)

    @classmethod
    def from_json(cls, text: str | bytes) -> Template:
        """A template from its JSON document.

        Raises:
            InvalidTemplateError: the text is not JSON, or not a template document.
        """
        try:
            doc = json.loads(text)
        except (ValueError, TypeError) as exc:
            raise InvalidTemplateError(f"a template document must be JSON: {exc}") from exc
        return cls.from_dict(doc)


def normalize_tags(tags: Any) -> tuple[str, ...]:
    """``tags`` trimmed, lower-cased and deduplicated in order; empty ones dropped. A single
    string is one tag, not its letters.

    Raises:
        InvalidTemplateError: a tag is not a string, or holds a comma (the CLI's separator).
    """
    if isinstance(tags, str):
        tags = (tags,)
    out: dict[str, None] = {}
    for tag in tags:
        if not isinstance(tag, str) or "," in tag:
            raise InvalidTemplateError(f"a tag must be a string without commas, got {tag!r}")
        tag = tag.strip().lower()
        if tag:
            out[tag] = None
    return tuple(out)


# Field -> its kind in the document: "str", "count" (int >= 0), "time" (finite number),
# "strs" (a list of strings), "list" (checked by its own reader).
_FIELDS: dict[str, str] = {
    "name": "name", "description": "str", "task_type": "name", "tags": "strs",
    "source_session_id": "str", "system_context": "str", "examples": "list",
    "user_patterns": "strs", "context_markers": "strs", "usage_count": "count",
    "successes": "count", "failures": "count", "created_at": "time",
}


def _check(key: str, value: Any, kind: str) -> Any:
    ok: bool
    if kind in ("str", "name"):
        ok = isinstance(value, str) and (kind == "str" or bool(value.strip()))
    elif kind == "count":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    elif kind == "time":
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value))
        value = float(value) if ok else value
    elif kind == "strs":
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        value = tuple(value) if ok else value
    else:
        ok = isinstance(value, list)
    if not ok:
        raise InvalidTemplateError(f"template key {key!r} has an invalid value: {value!r}"
                                   [:300])
    return value


def _example(i: int, doc: Any) -> Example:
    if not (isinstance(doc, Mapping) and set(doc) == {"tool", "arguments", "result",
                                                       "call_id"}):
        raise InvalidTemplateError(
            f"examples[{i}] must be an object with tool, arguments, result and call_id")
    tool, arguments, result, call_id = (doc["tool"], doc["arguments"], doc["result"],
                                        doc["call_id"])
    if not (isinstance(tool, str) and tool and isinstance(arguments, dict)
            and isinstance(result, str) and isinstance(call_id, str)):
        raise InvalidTemplateError(
            f"examples[{i}]: tool must be a name, arguments an object, result and call_id "
            "strings")
    return Example(tool=tool, arguments=arguments, result=result, call_id=call_id)
