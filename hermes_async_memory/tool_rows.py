"""The tool log's rows of a whole turn, worked out on the event loop.

A commit logs every tool call of its turns (``store.tool_log``). The general way reads the
calls out of the messages' JSON in SQL and finds each call's answer and goal by key, on the
store's thread, which is what a tool turn's commit waits on. In the common case a record
holds a whole turn: the user's message, the calls, an answer to each, the reply. Everything
a call's row holds is then in the record, and the writer works the rows out as it decodes
the record (``plan``, from the calls it parses anyway to count them) and, once the turn's
answers are judged and its ids known, writes them as SQL values (``values``). The store's
thread then inserts rows, and reads no JSON but the arguments it minifies. On a batch of
1,000 bench tool turns that takes the log from 608 to 392 million instructions
(docs/benchmark-notes.md).

Every value is the one the SQL way gives (``tool_log.INSERT_CALLS``); tests commit the same
turns both ways and compare the logs. Where a record leaves any doubt, its plan is False,
and the batch logs its calls the SQL way: a call not answered in its record (its answer may come
later, or a closing message settles it), a record without a user message (the goal is the
session's last one), a call id that is neither text nor missing, arguments that are neither
text nor missing, calls that are not a JSON list, text that an SQL literal cannot hold
(U+0000, a lone surrogate), or a turn out of id order (``store.batch.Batch``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

# One call's row: (its message's ordinal, call id, tool, arguments as given (None: none),
# its answer's ordinal).
CallPlan = tuple[int, str, str, "str | None", int]
# A turn's: (its first user message's ordinal: the goal, its calls' rows in order).
Plan = tuple[int, tuple[CallPlan, ...]]


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # Python reads NaN and Infinity; SQLite does not


_CALLS = json.JSONDecoder(parse_constant=_no_constant).decode


def _read(text: str) -> Any:
    """A message's calls as ``_CALLS`` reads them, by orjson where it can (~2.5x). Where it
    reads differently (an integer past 64 bits, as a float) is never a value a plan keeps: a
    call id, a name or arguments must be text. What it refuses (NaN, 1e400, the escape of a
    lone surrogate, not JSON) goes to ``_CALLS``."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return _CALLS(text)


def read_calls(messages: Sequence[Sequence[Any]],
               calls_at: Sequence[tuple[int, str]]) -> tuple[int, Plan | bool]:
    """(how many tool calls the turn holds, as Hermes counts them: the entries of its
    messages' ``tool_calls`` lists; its plan, or False: the SQL way) for a decoded record's
    ``messages`` (``MessageRow`` lists) and ``calls_at``: (ordinal, the ``tool_calls`` JSON
    text) of each message that has some."""
    count = 0
    parsed: list[tuple[int, list[Any]]] = []
    sure = True
    for i, text in calls_at:
        try:
            calls = _read(text)
        except ValueError:
            sure = False
            try:
                calls = json.loads(text)
            except ValueError:
                continue
        if type(calls) is list:
            count += len(calls)
            parsed.append((i, calls))
        else:
            sure = False
    plan = _plan(messages, parsed) if sure else None
    return count, (False if plan is None else plan)


def _plan(messages: Sequence[Sequence[Any]], parsed: Sequence[tuple[int, list[Any]]]
          ) -> Plan | None:
    goal = -1
    answers: dict[str, list[int]] = {}
    for k, m in enumerate(messages):
        role = m[0]
        if role == "user":
            if goal < 0:
                goal = k
        elif role == "tool" and m[3] is not None:
            if type(m[3]) is not str:
                return None  # not this version's record
            answers.setdefault(m[3], []).append(k)
    if goal < 0:
        return None
    rows: list[CallPlan] = []
    for i, calls in parsed:
        for n, call in enumerate(calls):
            if type(call) is not dict:
                continue  # not logged (INSERT_CALLS: only objects)
            function = call.get("function")
            if type(function) is not dict:
                continue
            tool = function.get("name")
            if type(tool) is not str:
                continue  # not logged: no name
            call_id = call.get("id")
            if call_id is None:
                call_id = f"#{n}"
            elif type(call_id) is not str:
                return None
            arguments = function.get("arguments")
            if arguments is not None and type(arguments) is not str:
                return None
            answer = next((k for k in answers.get(call_id, ()) if k > i), None)
            if answer is None:
                return None
            rows.append((i, call_id, tool, arguments, answer))
    return goal, tuple(rows)


def _q(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def values(plan: Plan, first_id: int, outcomes: Mapping[int, Any]) -> str | None:
    """The SQL ``VALUES`` rows of a turn's calls (``tool_log.LOG_ROWS``' columns, in order),
    for its first message id and its answers' judged outcomes by ordinal (None or missing: a
    plain success; else ``tool_log.outcome_row``). '' for none; None when some value cannot
    be an SQL literal (U+0000, a lone surrogate, an odd outcome): the SQL way then."""
    goal, calls = plan
    tail = f",{first_id + goal})"
    parts = []
    for i, call_id, tool, arguments, answer in calls:
        o = outcomes.get(answer)
        if o is None:
            outcome = "1,NULL,NULL,NULL"
        elif type(o) is not tuple or len(o) != 4:
            return None  # not judged (``turns.UNJUDGED``)
        else:
            ok, error_type, message, duration = o
            if type(ok) is not int or not (duration is None or (
                    type(duration) in (int, float) and math.isfinite(duration))):
                return None
            outcome = (f"{ok},{'NULL' if error_type is None else _q(error_type)},"
                       f"{'NULL' if message is None else _q(message)},"
                       f"{'NULL' if duration is None else repr(duration)}")
        parts.append(f"({first_id + i},{_q(call_id)},{_q(tool)},"
                     f"{'NULL' if arguments is None else _q(arguments)},{first_id + answer},"
                     f"{outcome}{tail}")
    text = ",".join(parts)
    if "\x00" in text or (not text.isascii() and has_surrogate(text)):
        return None
    return text


def has_surrogate(text: str) -> bool:
    """Whether ``text`` holds a lone surrogate, which UTF-8 cannot hold (here rather than in
    ``turns``, which imports this module)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
