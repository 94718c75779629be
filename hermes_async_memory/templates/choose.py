"""Which template a new session of a task type starts from.

Candidates are the templates of that exact task type; with tags asked for, only those that
share at least one of them (a filter, not a score: a template about other things is no
warm start at all). Among candidates the best is the highest success rate, then the least
used (to spread sessions over equals, which also gathers evidence on them), then the most
ended sessions, then the first given. A template no session has ended from has a rate of
0 for this ranking: unknown is not good.

Below the floor of evidence no template is picked: a candidate counts only once sessions
have ended from it at least ``settings.min_evidence`` times (its source session counts as
one, when it met the bar a template is made from) with a rate of at least
``settings.min_success_rate``; with none such, there is no choice (None). A lucky 2-of-2
template under a floor of 3 neither wins nor blocks a proven 9-of-10 one.

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
        if ended < settings.min_evidence or ok < settings.min_success_rate * ended or (
                ended == 0 and settings.min_success_rate > 0):
            continue
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
    return best
