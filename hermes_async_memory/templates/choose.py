"""Which template a new session of a task type starts from.

Candidates are the templates of that exact task type; with tags asked for, only those that
share at least one of them (a filter, not a score: a template about other things is no
warm start at all). Among candidates the best is the highest success rate, then the least
used (to spread sessions over equals, which also gathers evidence on them), then the most
ended sessions, then the first given. A template no session has ended from has a rate of
0 for this ranking: unknown is not good.

The best is returned only when it has ended sessions at least ``settings.min_evidence``
times and a rate of at least ``settings.min_success_rate``; otherwise there is no choice
(None), even if a worse-ranked template would pass: below the floor of evidence, do not
pick one. A store starting out therefore picks nothing until templates are used by name
and their sessions' outcomes are recorded; with ``min_evidence=0`` and
``min_success_rate=0`` the best there is is always picked.

One pass over the candidates, no sort: the ranking key is built only for those that pass
the filters, and compared as integers (rates are compared by cross-multiplying).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .model import DEFAULT_SETTINGS, Template, TemplateSettings, normalize_tags


def choose(candidates: Iterable[Template], task_type: str, tags: Sequence[str] = (),
           settings: TemplateSettings = DEFAULT_SETTINGS) -> Template | None:
    """The template to start a ``task_type`` session from, or None (see the module's
    docstring).

    Raises:
        InvalidTemplateError: a tag is not a string.
    """
    wanted = frozenset(normalize_tags(tags))
    best: Template | None = None
    best_ok = best_ended = best_used = 0
    for t in candidates:
        if t.task_type != task_type or (wanted and wanted.isdisjoint(t.tags)):
            continue
        ok = t.successes
        ended = ok + t.failures
        if best is None:
            better = True
        else:
            # ok / ended against best_ok / best_ended by cross-multiplying; x / 0 counts as
            # 0, which a factor of 1 in place of the 0 gives (ok is 0 when ended is).
            mine, theirs = ok * (best_ended or 1), best_ok * (ended or 1)
            better = mine > theirs or (mine == theirs and (
                t.usage_count < best_used
                or (t.usage_count == best_used and ended > best_ended)))
        if better:
            best, best_ok, best_ended, best_used = t, ok, ended, t.usage_count
    if best is None or best_ended < settings.min_evidence:
        return None
    rate = best_ok / best_ended if best_ended else 0.0
    return best if rate >= settings.min_success_rate else None
