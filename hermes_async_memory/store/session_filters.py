"""Which sessions a bulk prune or archive picks: Hermes Agent's filters (its
``_prune_filter_where``), as one SQL condition on a ``sessions`` row (alias ``s``) that
the async store (``Lifecycle.prunable_sessions``) and the synchronous reads
(``hermes_reads.prune_candidates``) share.

Only ended sessions are ever picked. Every filter given must hold (AND). Substring filters
(``title_like``, ``model_like``, ``branch_like``) match case-insensitively (ASCII case, as
SQLite's ``lower``), ``%`` and ``_`` in them as themselves; ``provider`` matches
``billing_provider`` case-insensitively; the others exactly. Tokens are input plus output
tokens; the cost is the actual one, else the estimated one. ``archived``: None for both,
True for only archived sessions, False for only the others.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any


class InvalidFilterError(TypeError):
    """A filter that does not exist, or a value of the wrong type (Hermes raises TypeError
    for an unknown keyword)."""


@dataclass(frozen=True, slots=True)
class SessionFilter:
    """A bulk selection's filters; None (the default) leaves a filter out."""

    started_before: float | None = None
    started_after: float | None = None
    source: str | None = None
    title_like: str | None = None
    end_reason: str | None = None
    cwd_prefix: str | None = None
    min_messages: int | None = None
    max_messages: int | None = None
    archived: bool | None = None
    model_like: str | None = None
    provider: str | None = None
    user_id: str | None = None
    chat_id: str | None = None
    chat_type: str | None = None
    branch_like: str | None = None
    min_tokens: int | None = None
    max_tokens: int | None = None
    min_cost: float | None = None
    max_cost: float | None = None
    min_tool_calls: int | None = None
    max_tool_calls: int | None = None

    @classmethod
    def of(cls, **filters: Any) -> SessionFilter:
        """The filters named by keyword, checked.

        Raises:
            InvalidFilterError: a name that is not a filter, or a value of the wrong type.
        """
        names = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = sorted(set(filters) - set(names))
        if unknown:
            raise InvalidFilterError(f"unknown session filter(s): {', '.join(unknown)}")
        for name, value in filters.items():
            if value is None:
                continue
            kind = names[name]
            if kind == "bool | None":
                ok = isinstance(value, bool)
            elif kind == "int | None":
                ok = isinstance(value, int) and not isinstance(value, bool)
            elif kind == "float | None":
                ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
                      and math.isfinite(value))
            else:
                ok = isinstance(value, str)
            if not ok:
                raise InvalidFilterError(f"the session filter {name} is mistyped: "
                                         f"{type(value).__name__}")
        return cls(**filters)

    def where(self, alias: str = "s") -> tuple[str, list[Any]]:
        """The condition on ``alias`` (a ``sessions`` row) and its parameters."""
        a = alias
        clauses = [f"{a}.ended_at IS NOT NULL"]
        params: list[Any] = []

        def add(clause: str, value: Any) -> None:
            clauses.append(clause)
            params.append(value)

        if self.started_before is not None:
            add(f"{a}.started_at < ?", self.started_before)
        if self.started_after is not None:
            add(f"{a}.started_at >= ?", self.started_after)
        if self.source:
            add(f"{a}.source = ?", self.source)
        if self.end_reason:
            add(f"{a}.end_reason = ?", self.end_reason)
        if self.cwd_prefix:
            clause, values = cwd_prefix(self.cwd_prefix, alias)
            clauses.append(clause)
            params.extend(values)
        for column, needle in (("title", self.title_like), ("model", self.model_like),
                               ("git_branch", self.branch_like)):
            if needle:
                add(f"lower(coalesce({a}.{column}, '')) LIKE ? ESCAPE '\\'",
                    like_contains(needle.lower()))
        if self.provider:
            add(f"lower(coalesce({a}.billing_provider, '')) = ?", self.provider.lower())
        for column, value in (("user_id", self.user_id), ("chat_id", self.chat_id),
                              ("chat_type", self.chat_type)):
            if value:
                add(f"{a}.{column} = ?", value)
        tokens = f"(coalesce({a}.input_tokens, 0) + coalesce({a}.output_tokens, 0))"
        cost = f"coalesce({a}.actual_cost_usd, {a}.estimated_cost_usd, 0)"
        for expr, low, high in ((f"{a}.message_count", self.min_messages, self.max_messages),
                                (tokens, self.min_tokens, self.max_tokens),
                                (cost, self.min_cost, self.max_cost),
                                (f"coalesce({a}.tool_call_count, 0)", self.min_tool_calls,
                                 self.max_tool_calls)):
            if low is not None:
                add(f"{expr} >= ?", low)
            if high is not None:
                add(f"{expr} <= ?", high)
        if self.archived is not None:
            clauses.append(f"{a}.archived = {1 if self.archived else 0}")
        return " AND ".join(clauses), params


def like_contains(needle: str) -> str:
    """A LIKE pattern (``ESCAPE '\\'``) for text holding ``needle``, its wildcards literal."""
    escaped = needle.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


def cwd_prefix(prefix: str, alias: str = "s") -> tuple[str, list[str]]:
    """The condition that a session's cwd is ``prefix`` or a folder under it (either
    separator), its LIKE wildcards literal."""
    prefix = prefix.rstrip("/\\") or prefix
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return (f"({alias}.cwd = ? OR {alias}.cwd LIKE ? ESCAPE '\\' "
            f"OR {alias}.cwd LIKE ? ESCAPE '\\')",
            [prefix, f"{escaped}/%", f"{escaped}\\\\%"])
