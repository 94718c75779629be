"""What ``prefetch()`` would return for a (user, session) once a recall of a query is
answered by the local store, each line with where it came from: for an inspector that
explains a block, on a store opened read-only beside the running pipeline.

The block is built by the pipeline's own code, not a copy of it: the stored recent turns as a
warm-up loads them (``service.stored_recent_turns``), the search and its lines
(``service.search_hits``, ``query.hit_lines``), the procedural block
(``procedural.context.session_block_lines``), and the cache's composition of the two
(``cache.block_lines``).

    Recent turns in this session:          heading     the session
    - user: where do locals eat?           recent      message id, role, time, turn key
    - assistant: two streets north …       recent
                                           blank
    Related memory:                        heading
    - [2024-05-01 user] … Lisbon food …    search      message id, session, role, time, rank
                                           blank
    <procedural_memory>                    procedural
    <tool name="web_search">               procedural  tool
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ..errors import InvalidTurnError
from ..fence import Fence
from ..message_rows import check_id
from ..procedural.api import ProceduralMemory
from ..procedural.context import session_block_lines
from ..settings import Settings
from ..store import Hit, SqliteStore, StoredTurn
from ..turns import scope_token_for
from .cache import RECALL_HEADER, _clip, block_lines, block_text
from .query import hit_lines, query_terms, render_hits, with_procedural
from .service import search_hits, stored_recent_turns

Origin = Literal["heading", "recent", "search", "procedural", "blank"]


@dataclass(frozen=True, slots=True)
class PreviewLine:
    """One line of a previewed block and its source.

    ``origin``:
      - "heading": "Recent turns in this session:" (``session_id`` is the session) or
        "Related memory:" over the search hits;
      - "recent": a recent turn's user or assistant text (``role``), from the message
        ``message_id`` (None when the turn has no such message) of ``session_id``, stored at
        ``timestamp``, in the turn ``turn_key``;
      - "search": a search hit: the message ``message_id`` of ``session_id`` (any of the
        user's sessions), with its ``role`` and ``timestamp``, ``rank`` its place in the
        search's results (1: the best; a hit whose words an earlier one gave has no line, so
        ranks may skip);
      - "procedural": a line of the procedural block, about ``tool`` (None: the tags
        around several tools);
      - "blank": the empty line between parts.

    ``fenced``: how many fence tags (``Settings.fence_tags``: the tags the block may be
    wrapped in) the line's stored text held, each made inert in ``text`` (fence.py).
    """

    text: str
    origin: Origin
    session_id: str | None = None
    message_id: int | None = None
    role: str | None = None
    timestamp: float | None = None
    turn_key: str | None = None
    tool: str | None = None
    rank: int | None = None
    fenced: int = 0


@dataclass(frozen=True, slots=True)
class PrefetchPreview:
    """A previewed block (``block``) and its lines, with ``"\\n".join(line.text for line in
    lines) == block``; ``terms``: the words the search looked for (the query's, folded, the
    too frequent ones dropped)."""

    block: str
    lines: tuple[PreviewLine, ...]
    terms: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        """Raises ValueError when the lines do not make up the block."""
        if "\n".join([line.text for line in self.lines]) != self.block:
            raise ValueError("the preview's lines do not make up its block")


async def preview_prefetch(store: SqliteStore, settings: Settings, *, user_id: str | None,
                           session_id: str, query: str,
                           frequent_terms: frozenset[str] | None = None) -> PrefetchPreview:
    """The block ``prefetch(session_id=session_id, user_id=user_id)`` returns once
    ``queue_prefetch(query, ...)`` has been answered by the local store (the null backend,
    the default), as a pipeline on ``settings`` that opens ``store`` now has it: the
    session's stored recent turns as a warm-up loads them, then the recall's block. Reads
    only: works on ``store.open_readonly()``.

    A blank ``query`` queues no recall (``queue_prefetch`` ignores it): the block is then
    the recent turns alone. ``frequent_terms``: the terms too common to search for, as the
    pipeline's store holds them (``store.frequent_terms``); None reads them from the store
    now, as the pipeline's periodic refresh does (a scan of the vocabulary).

    Where it can differ from a running pipeline: that pipeline's frequent terms may be up to
    ``frequent_terms_refresh_s`` old; its recent turns are those it committed itself, while
    this (like a warm-up) looks among the session's last ``recent_turns * WARM_LOOKBACK``
    stored turns, so a user's turns buried under that many of another user's turns with the
    same session id are not shown; and a backend other than the null one answers recalls
    with its own block.

    Raises:
        InvalidTurnError: an id is not one the pipeline takes, or the query is not a string.
        StoreError: the store cannot be read (and the errors of its reads, sqlite3.Error).
    """
    check_id("session_id", session_id)
    check_id("user_id", user_id, optional=True)
    if not isinstance(query, str):
        raise InvalidTurnError(f"query must be a string, got {type(query).__name__}")
    turns = await stored_recent_turns(store, user_id, session_id, settings.recent_turns)
    limit, fence = settings.recent_chars, Fence(settings.fence_tags)
    clipped = [(_clip(t.user_text, limit), _clip(t.assistant_text, limit)) for t in turns]
    recent = [(fence.neutralize(u), fence.neutralize(a)) for u, a in clipped]
    terms: tuple[str, ...] = ()
    recall: list[PreviewLine] = []
    if query.strip():
        if frequent_terms is None:
            frequent_terms = await store.read_frequent_terms(settings.frequent_term_rows,
                                                             settings.frequent_term_ratio)
        terms = tuple(query_terms(query, frequent_terms, settings.recall_max_terms,
                                  stems=store.word_index_stems))
        recall = await _recall_lines(store, settings, user_id, session_id, terms, fence)
    recall_block = "\n".join([line.text for line in recall])
    out = []
    for text, part, position, role in block_lines(recent if settings.recent_turns else (),
                                                   recall_block):
        if part == "recall":
            out.append(recall[position])
        elif part == "recent":
            raw = clipped[position][0 if role == "user" else 1]
            out.append(_recent_line(text, role, turns[position], session_id,
                                    fence.count(raw)))
        elif part == "heading":
            out.append(PreviewLine(text, "heading", session_id=session_id))
        else:
            out.append(PreviewLine(text, "blank"))
    # The block as the cache renders it: the lines must make it up (PrefetchPreview checks).
    block = block_text(recent if settings.recent_turns else (), recall_block)
    return PrefetchPreview(block, tuple(out), terms)


async def _recall_lines(store: SqliteStore, settings: Settings, user_id: str | None,
                        session_id: str, terms: tuple[str, ...],
                        fence: Fence) -> list[PreviewLine]:
    """The recall's block as the local recaller builds it (``LocalRecaller.recall``), as
    lines with their sources."""
    hits = await search_hits(store, terms, scope_token_for(user_id, session_id),
                             limit=settings.recall_limit,
                             chars_per_hit=settings.recall_chars_per_hit)
    rank = {hit.message_id: n for n, hit in enumerate(hits, 1)}
    lines = []
    shown = list(hit_lines(hits, fence))
    if shown:
        lines.append(PreviewLine(RECALL_HEADER, "heading"))
        lines += [PreviewLine(text, "search", session_id=hit.session_id,
                              message_id=hit.message_id, role=hit.role,
                              timestamp=hit.timestamp, rank=rank[hit.message_id],
                              fenced=_hit_fenced(hit, fence))
                  for text, hit in shown]
    procedural: list[tuple[str, str | None]] = []
    if settings.tool_log and settings.procedural_context is not None:
        procedural = await session_block_lines(ProceduralMemory(store), user_id, session_id,
                                               settings.procedural_context)
    if lines and procedural:
        lines.append(PreviewLine("", "blank"))
    # The procedural block escapes every < of the log's text (procedural/format.py): a
    # fence tag there is counted as the text held it.
    lines += [PreviewLine(text, "procedural", tool=tool,
                          fenced=fence.count(text.replace("&lt;", "<")))
              if text else PreviewLine("", "blank")
              for text, tool in procedural]
    # The pipeline's block, built by its own functions: the lines must spell it.
    block = with_procedural(render_hits(hits, fence=fence),
                            "\n".join([text for text, _ in procedural]))
    assert "\n".join([line.text for line in lines]) == block
    return lines


def _hit_fenced(hit: Hit, fence: Fence) -> int:
    """The fence tags in the stored text a hit's line shows (``query.hit_lines``)."""
    texts = [hit.snippet, *(s.text for s in hit.before), *(s.text for s in hit.after)]
    return sum([fence.count(" ".join(text.split())) for text in texts])


def _recent_line(text: str, role: str, turn: StoredTurn, session_id: str,
                 fenced: int) -> PreviewLine:
    if role == "user":
        message_id, timestamp = turn.user_message_id, turn.user_timestamp
    else:
        message_id, timestamp = turn.assistant_message_id, turn.assistant_timestamp
    return PreviewLine(text, "recent", session_id=session_id, message_id=message_id,
                       role=role, timestamp=timestamp, turn_key=turn.key, fenced=fenced)
