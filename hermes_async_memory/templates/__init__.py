"""Warm-start templates: what a finished session teaches a new one of the same kind.

    session messages ──► classify (task type by tool-call share)
                    └──► extract ──► Template (examples, user patterns, files and URLs,
                                              usage and outcome counts; JSON document)
    Templates, task type, tags ──► choose ──► Template | None
    Template ──► warm_messages (chat messages to send) ── validate_chat checks them
             └─► warm_text (one bounded <warm_start> block for text-only clients)

Pure functions over data: no database, no I/O. Storage and the CLI build on this:
``templates.store.TemplateStore`` (``pipeline.templates``) keeps templates in the store
through the durable path, and records how the sessions started from them end.
"""

from __future__ import annotations

from .build import warm_messages, warm_text
from .chat import validate_chat
from .choose import choose
from .classify import classify, classify_tools, family_of
from .extract import extract
from .model import (
    CHAT,
    CODE,
    DEFAULT_FAMILIES,
    FILE,
    MIXED,
    RESEARCH,
    SCHEMA_VERSION,
    Example,
    InvalidChatError,
    InvalidTemplateError,
    Template,
    TemplateExistsError,
    TemplateSettings,
    UnknownTemplateError,
)

__all__ = [
    "CHAT",
    "CODE",
    "DEFAULT_FAMILIES",
    "FILE",
    "MIXED",
    "RESEARCH",
    "SCHEMA_VERSION",
    "Example",
    "InvalidChatError",
    "InvalidTemplateError",
    "Template",
    "TemplateExistsError",
    "TemplateSettings",
    "UnknownTemplateError",
    "choose",
    "classify",
    "classify_tools",
    "extract",
    "family_of",
    "validate_chat",
    "warm_messages",
    "warm_text",
]
