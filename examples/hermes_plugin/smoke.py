"""Drive the installed plugin the way Hermes Agent does, without a model.

    HERMES_HOME=/tmp/hermes-demo python examples/hermes_plugin/smoke.py

Loads the provider named in $HERMES_HOME/config.yaml through Hermes's own plugin loader,
runs two sessions through its MemoryManager (initialize, prefetch, sync, queued recall,
a /new, the memory_search tool, shutdown) and prints what the agent would see.
"""

from __future__ import annotations

import json
import sys

from agent.memory_manager import MemoryManager, build_memory_context_block
from plugins.memory import _get_active_memory_provider, load_memory_provider

TURNS = [
    ("Where do locals eat in Lisbon?", "Two streets north of Rossio station there is a "
     "small counter; the grilled sardines are the thing to order."),
    ("And for coffee?", "A bica at the kiosk in Praça das Flores."),
]


def main() -> int:
    name = _get_active_memory_provider()
    provider = load_memory_provider(name) if name else None
    if provider is None:
        print(f"memory.provider is {name!r} in config.yaml, and no such plugin loads; run "
              "`hermes-memory hermes install` and `hermes config set memory.provider "
              "hermes_async_memory` with the same HERMES_HOME", file=sys.stderr)
        return 1
    mm = MemoryManager()
    mm.add_provider(provider)
    mm.initialize_all(session_id="demo-1", platform="cli", agent_context="primary")
    print(f"provider: {provider.name}; tools: {sorted(mm.get_all_tool_names())}")

    messages: list[dict[str, str]] = []
    for turn, (user, assistant) in enumerate(TURNS, 1):
        mm.on_turn_start(turn, user)
        print(f"\n> {user}")
        context = mm.prefetch_all(user)  # what run_agent appends to the API copy of the turn
        print(build_memory_context_block(context) or "(no memory yet)")
        messages += [{"role": "user", "content": user},
                     {"role": "assistant", "content": assistant}]
        mm.sync_all(user, assistant, session_id="demo-1", messages=messages)
        mm.queue_prefetch_all(user, session_id="demo-1")
        # The next turn comes a model call later (seconds); here, wait for the manager's
        # worker and for the commit instead (milliseconds).
        mm.flush_pending(timeout=10)
        provider.flush()

    # /new: the old session's turns are committed, the provider moves to the new session.
    mm.commit_session_boundary_async(messages, new_session_id="demo-2",
                                     parent_session_id="demo-1")
    mm.flush_pending(timeout=10)
    result = json.loads(mm.handle_tool_call("memory_search", {"query": "sardines Lisbon"}))
    print("\nmemory_search in the new session:\n" + result.get("results", json.dumps(result)))

    mm.on_session_end(messages)
    mm.shutdown_all()
    print(f"\nshutdown: {mm.shutdown_drain_state}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
