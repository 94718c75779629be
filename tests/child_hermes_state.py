"""A process that writes to Hermes's session store from several threads at once, as a
gateway does, and prints each acknowledgement, to be SIGKILLed by tests.

    python child_hermes_state.py DB ROUND THREADS

It opens ``SessionDB(db_path=DB)`` (``hermes_async_memory.hermes.state``) and runs
``THREADS`` threads over ``SLOTS`` conversation slots. Each slot plays one session after
another (``r<ROUND>-s<slot>-g<gen>``), each session the calls of ``SCRIPT`` in order
(``call_for`` gives the arguments of call ``n`` of a session). A thread takes the next slot
round-robin and makes that slot's next call holding the slot's lock, so one session's calls
are made one at a time, in order, by whichever thread got there (a session moves between
threads, as gateway turns do), while the other slots' calls run beside it.

After a call returns, still holding the slot's lock, the thread prints one line and flushes:
``ACK {"s": session, "n": n, "op": method, "id": message id or null}``. A printed call has
returned: it is acknowledged. A session's next call starts only after that line is out, so
at most one call per session is ever in flight unacknowledged.

It prints ``READY`` once the store is open, and ``ERROR ...`` (then exits 3) if a call
raises. Only these lines go to stdout; anything else written there goes to stderr.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import threading
import traceback
from typing import Any

SLOTS = 8

# One session, call by call: method name and what kind of call it is.
SCRIPT: tuple[str, ...] = (
    "create",           # 0  create_session
    "system",           # 1  append: system prompt snapshot
    "user",             # 2  append: user text
    "assistant_tools",  # 3  append: assistant with two tool calls
    "tool_a",           # 4  append: tool result (first call)
    "tool_b",           # 5  append: tool result (second call)
    "tokens",           # 6  update_token_counts
    "assistant",        # 7  append: assistant text, explicit timestamp
    "user_parts",       # 8  append: user, structured (list) content, explicit timestamp
    "cwd",              # 9  update_session_cwd
    "assistant_tool",   # 10 append: assistant with one tool call
    "tool_one",         # 11 append: its result
    "assistant",        # 12 append: assistant text, explicit timestamp
    "tokens",           # 13 update_token_counts
    "user",             # 14 append: user text
    "assistant",        # 15 append: assistant text, explicit timestamp
    "end",              # 16 end_session
)
APPEND_KINDS = frozenset({"system", "user", "assistant_tools", "tool_a", "tool_b",
                          "assistant", "user_parts", "assistant_tool", "tool_one"})
METHODS = {"create": "create_session", "tokens": "update_token_counts",
           "cwd": "update_session_cwd", "end": "end_session"}


def session_name(round_: int, slot: int, gen: int) -> str:
    return f"r{round_}-s{slot}-g{gen}"


def parse_session(session: str) -> tuple[int, int, int]:
    r, s, g = session.split("-")
    return int(r[1:]), int(s[1:]), int(g[1:])


def marker(session: str, n: int) -> str:
    """The text that names call ``n`` of ``session`` in every message it writes."""
    return f"<{session}#{n}>"


def explicit_timestamp(session: str, n: int) -> float:
    r, s, g = parse_session(session)
    return 1_700_000_000.0 + r * 100_000 + s * 10_000 + g * 100 + n + 0.25


def tool_call(session: str, n: int, suffix: str, name: str) -> dict[str, Any]:
    return {"id": f"{session}-c{n}{suffix}", "type": "function",
            "function": {"name": name, "arguments": json.dumps({"n": n, "s": session})}}


def call_for(session: str, n: int) -> tuple[str, str, dict[str, Any]]:
    """(kind, SessionDB method, keyword arguments besides the session id) of call ``n``."""
    kind = SCRIPT[n]
    m = marker(session, n)
    _, slot, _ = parse_session(session)
    if kind == "create":
        return kind, "create_session", {
            "source": ("telegram", "discord", "cli")[slot % 3], "model": "model-a",
            "user_id": f"user{slot}", "system_prompt": f"system {m}"}
    if kind == "tokens":
        return kind, "update_token_counts", {
            "input_tokens": 100 + n, "output_tokens": 10 + n, "model": "model-a",
            "api_call_count": 1}
    if kind == "cwd":
        return kind, "update_session_cwd", {"cwd": f"/srv/{session}", "git_branch": "main"}
    if kind == "end":
        return kind, "end_session", {"end_reason": "user_exit"}
    args: dict[str, Any]
    if kind == "system":
        args = {"role": "system", "content": f"You are helpful. {m}"}
    elif kind == "user":
        args = {"role": "user", "content": f"please look at {m}"}
    elif kind == "user_parts":
        args = {"role": "user", "content": [
            {"type": "text", "text": f"what is in this picture {m}"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{n:08d}"}}],
            "timestamp": explicit_timestamp(session, n)}
    elif kind == "assistant_tools":
        args = {"role": "assistant", "content": f"checking {m}",
                "tool_calls": [tool_call(session, n, "a", "read_file"),
                               tool_call(session, n, "b", "terminal")],
                "finish_reason": "tool_calls", "token_count": 40 + n}
    elif kind == "assistant_tool":
        args = {"role": "assistant", "content": f"one more {m}",
                "tool_calls": [tool_call(session, n, "a", "web_search")],
                "finish_reason": "tool_calls"}
    elif kind in ("tool_a", "tool_b"):
        suffix = kind[-1]
        first = SCRIPT.index("assistant_tools")
        args = {"role": "tool", "tool_call_id": f"{session}-c{first}{suffix}",
                "tool_name": "read_file" if suffix == "a" else "terminal",
                "content": json.dumps({"output": m, "exit_code": 0})}
    elif kind == "tool_one":
        first = SCRIPT.index("assistant_tool")
        args = {"role": "tool", "tool_call_id": f"{session}-c{first}a",
                "tool_name": "web_search", "content": json.dumps({"results": [m]})}
    elif kind == "assistant":
        args = {"role": "assistant", "content": f"done {m}", "finish_reason": "stop",
                "timestamp": explicit_timestamp(session, n)}
    else:  # pragma: no cover - SCRIPT and this function go together
        raise AssertionError(kind)
    return kind, "append_message", args


class Slot:
    def __init__(self, round_: int, index: int) -> None:
        self.round = round_
        self.index = index
        self.lock = threading.Lock()
        self.gen = 0
        self.n = 0

    @property
    def session(self) -> str:
        return session_name(self.round, self.index, self.gen)


def main(db_path: str, round_: int, threads: int) -> None:
    # The acknowledgements get the stdout pipe to themselves: whatever else writes to stdout
    # (the library's log lines, say) goes to stderr, where it cannot tear an ACK line.
    acks = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from hermes_async_memory.hermes.state import SessionDB

    db = SessionDB(db_path=db_path)
    out_lock = threading.Lock()
    slots = [Slot(round_, i) for i in range(SLOTS)]
    turn = itertools.count()

    def say(line: str) -> None:
        with out_lock:
            acks.write(line + "\n")
            acks.flush()

    def work() -> None:
        try:
            while True:
                slot = slots[next(turn) % SLOTS]
                with slot.lock:
                    session, n = slot.session, slot.n
                    _, method, kwargs = call_for(session, n)
                    result = getattr(db, method)(session, **kwargs)
                    mid = result if method == "append_message" else None
                    # The call returned: acknowledged.
                    say("ACK " + json.dumps({"s": session, "n": n, "op": method, "id": mid}))
                    slot.n += 1
                    if slot.n == len(SCRIPT):
                        slot.gen, slot.n = slot.gen + 1, 0
        except BaseException:
            say("ERROR " + traceback.format_exc().replace("\n", " | "))
            os._exit(3)

    say("READY")
    workers = [threading.Thread(target=work, name=f"gateway-{i}") for i in range(threads)]
    for t in workers:
        t.start()
    for t in workers:  # forever: the test SIGKILLs this process
        t.join()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
