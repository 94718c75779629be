"""A session's task type, from the share of its tool calls each tool family holds.

Every call counts, answered or not and successful or not: the type says what the session
was doing, not how well. A call to a tool no family claims still counts in the total, so
unclaimed tools dilute every family's share. With several families at or above the
threshold (possible only with a threshold of one half or less) the larger share wins, then
the family listed first.
"""

from __future__ import annotations

import fnmatch
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from ..procedural.extract import OutcomeRules, calls_in
from .model import CHAT, DEFAULT_SETTINGS, MIXED, TemplateSettings

DEFAULT_RULES = OutcomeRules()

_FamiliesKey = tuple[tuple[str, tuple[str, ...]], ...]


def classify(messages: Sequence[Mapping[str, Any]],
             settings: TemplateSettings = DEFAULT_SETTINGS) -> str:
    """The task type of a session's OpenAI-format messages: the family holding at least
    ``settings.threshold`` of its tool calls, ``"mixed"`` when none does, ``"chat"`` when
    it made no tool call."""
    return classify_tools((c.tool for c in calls_in(messages, DEFAULT_RULES)), settings)


def classify_tools(tools: Iterable[str], settings: TemplateSettings = DEFAULT_SETTINGS
                   ) -> str:
    """The task type of a session that called ``tools`` (one name per call, repeats
    included); see ``classify``."""
    counts = Counter(tools)
    total = sum(counts.values())
    if total == 0:
        return CHAT
    per_family: Counter[str] = Counter()
    for tool, n in counts.items():
        family = family_of(tool, settings)
        if family is not None:
            per_family[family] += n
    best: str | None = None
    for family in settings.families:  # listed order breaks ties
        n = per_family.get(family, 0)
        # n / total, not threshold * total: a ratio equal to the threshold's decimal
        # rounds to the same float, so "at least" holds exactly.
        if n and n / total >= settings.threshold and (best is None or n > per_family[best]):
            best = family
    return best if best is not None else MIXED


def family_of(tool: str, settings: TemplateSettings = DEFAULT_SETTINGS) -> str | None:
    """The first family whose patterns match ``tool`` (case-insensitively), or None."""
    for family, pattern in _compiled(tuple(settings.families.items())):
        if pattern.match(tool):
            return family
    return None


@lru_cache(maxsize=32)
def _compiled(families: _FamiliesKey) -> tuple[tuple[str, re.Pattern[str]], ...]:
    return tuple(
        (name, re.compile("|".join(f"(?:{fnmatch.translate(p)})" for p in patterns),
                          re.IGNORECASE))
        for name, patterns in families)
