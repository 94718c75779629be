"""Recorded-style Hermes sessions in the OpenAI message format, as the store keeps them:
assistant ``tool_calls`` with arguments as JSON text, answered by ``tool`` messages whose
content is the tool's JSON output (Hermes's terminal, read_file, patch, web_search, ...).

Each session carries its label for classification. Calls that fail (a non-zero exit code,
an error field, a traceback) are later fixed by another call, as in real sessions.
"""

from __future__ import annotations

import json
from typing import Any

Message = dict[str, Any]

HERMES_SYSTEM = (
    "You are Hermes Agent, an intelligent AI assistant created by Nous Research.\n"
    "You are helpful, knowledgeable, and direct. Use tools when they help.\n"
    "Prefer running tests after each change. Keep answers short."
)


def call(call_id: str, tool: str, **arguments: Any) -> dict[str, Any]:
    return {"id": call_id, "type": "function",
            "function": {"name": tool, "arguments": json.dumps(arguments)}}


def assistant(*calls: dict[str, Any], content: str | None = None) -> Message:
    message: Message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = list(calls)
    return message


def answer(call_id: str, output: Any) -> Message:
    text = output if isinstance(output, str) else json.dumps(output)
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def user(text: str) -> Message:
    return {"role": "user", "content": text}


CODE_SESSION: list[Message] = [
    {"role": "system", "content": HERMES_SYSTEM},
    user("The parser tests fail since yesterday's merge. Can you fix them?"),
    assistant(call("call_c1", "terminal", command="pytest -q tests/test_parser.py")),
    answer("call_c1", {"output": "F.F\nFAILED tests/test_parser.py::test_dates - "
                                 "AssertionError\n2 failed, 1 passed in 0.31s",
                       "exit_code": 1, "error": None}),
    assistant(call("call_c2", "read_file", path="src/parse.py")),
    answer("call_c2", {"error": "FileNotFoundError: src/parse.py does not exist"}),
    assistant(call("call_c3", "read_file", path="src/parser.py", offset=1, limit=80)),
    answer("call_c3", {"content": "1|import re\n2|DATE = re.compile(r'\\d{4}-\\d{2}')\n",
                       "total_lines": 42}),
    assistant(call("call_c4", "execute_code",
                   code="import re\nprint(re.match(r'\\d{4}-\\d{2}', '2024-05-01'))")),
    answer("call_c4", {"status": "success",
                       "output": "<re.Match object; span=(0, 7), match='2024-05'>"}),
    assistant(call("call_c5", "execute_code",
                   code="from src.parser import parse_date\nparse_date('2024-05-01')")),
    answer("call_c5", {"status": "error",
                       "output": "Traceback (most recent call last):\n  File \"<stdin>\", "
                                 "line 1\nValueError: day is missing",
                       "error": "ValueError: day is missing"}),
    assistant(call("call_c6", "patch", path="src/parser.py",
                   old_string=r"re.compile(r'\d{4}-\d{2}')",
                   new_string=r"re.compile(r'\d{4}-\d{2}-\d{2}')")),
    answer("call_c6", {"success": True, "diff": "--- a/src/parser.py\n+++ b/src/parser.py"}),
    assistant(call("call_c7", "terminal", command="pytest -q tests/test_parser.py")),
    answer("call_c7", {"output": "...\n3 passed in 0.22s", "exit_code": 0, "error": None}),
    user("Great. Commit it please, and show me the status."),
    assistant(call("call_c8", "terminal", command="git status --short")),
    answer("call_c8", {"output": " M src/parser.py", "exit_code": 0, "error": None}),
    assistant(call("call_c9", "terminal",
                   command="git commit -am 'parser: dates need a day'")),
    answer("call_c9", {"output": "[main 4f2a9c1] parser: dates need a day\n 1 file changed",
                       "exit_code": 0, "error": None}),
    assistant(call("call_c10", "terminal", command="git status --short")),
    answer("call_c10", {"output": "", "exit_code": 0, "error": None}),
    assistant(content="Fixed the date pattern in src/parser.py and committed it."),
]
# terminal 5 + execute_code 2 = 7 of 10 calls are code; read_file 2, patch 1.
CODE_SHARE = 0.7

RESEARCH_SESSION: list[Message] = [
    {"role": "system", "content": HERMES_SYSTEM},
    {"role": "user", "content": [
        {"type": "text", "text": "How does asyncio.TaskGroup differ from gather?"},
        {"type": "text", "text": "I care about   cancellation."},
    ]},
    assistant(call("call_r1", "web_search", query="asyncio TaskGroup vs gather cancellation")),
    answer("call_r1", {"data": {"web": [
        {"title": "Coroutines and Tasks", "description": "Task groups ...",
         "url": "https://docs.python.org/3/library/asyncio-task.html?highlight=taskgroup"
                "#task-groups"},
        {"title": "PEP 654", "url": "https://peps.python.org/pep-0654/",
         "description": "Exception groups"},
    ]}}),
    assistant(call("call_r2", "web_extract",
                   urls=["https://docs.python.org/3/library/asyncio-task.html"])),
    answer("call_r2", {"error": "timeout after 30s", "error_type": "TimeoutError"}),
    assistant(call("call_r3", "web_extract",
                   urls=["https://docs.python.org/3.12/library/asyncio-task.html"])),
    answer("call_r3", {"results": [{
        "url": "https://docs.python.org/3.12/library/asyncio-task.html",
        "title": "Coroutines and Tasks",
        "content": "If any task in the group fails, the remaining tasks are cancelled."}]}),
    user("And what do people say about it in practice?"),
    assistant(call("call_r4", "web_search", query="TaskGroup gather experience blog")),
    answer("call_r4", {"data": {"web": [
        {"title": "TaskGroups in practice",
         "url": "https://user:s3cret@blog.example.com/posts/taskgroups?utm_source=x",
         "description": "We moved from gather"}]}}),
    assistant(call("call_r5", "web_search", query="asyncio.timeout TaskGroup")),
    answer("call_r5", {"data": {"web": []}}),
    assistant(call("call_r6", "write_file", path="notes/asyncio-taskgroup.md",
                   content="# TaskGroup vs gather\n- cancels siblings on failure\n")),
    answer("call_r6", {"bytes_written": 52, "path": "notes/asyncio-taskgroup.md"}),
    assistant(content="TaskGroup cancels the other tasks when one fails; gather does not."),
]
# web_search 3 + web_extract 2 = 5 of 6 calls are research.

FILE_SESSION: list[Message] = [
    {"role": "system", "content": HERMES_SYSTEM},
    {"role": "developer", "content": "The repository is at /home/dev/shop."},
    user("Rename the setting MAX_ITEMS to MAX_CART_ITEMS everywhere."),
    assistant(call("call_f1", "search_files", pattern="MAX_ITEMS", path="/home/dev/shop")),
    answer("call_f1", {"matches": [
        {"path": "/home/dev/shop/shop/settings.py", "line": 12,
         "content": "MAX_ITEMS = 50"},
        {"path": "/home/dev/shop/shop/cart.py", "line": 3,
         "content": "from .settings import MAX_ITEMS"}]}),
    assistant(call("call_f2", "read_file", path="/home/dev/shop/shop/settings.py")),
    answer("call_f2", {"content": "12|MAX_ITEMS = 50\n", "total_lines": 30}),
    assistant(call("call_f3", "patch", path="/home/dev/shop/shop/settings.py",
                   old_string="MAX_ITEMS = 50", new_string="MAX_CART_ITEMS = 50")),
    answer("call_f3", {"success": True}),
    assistant(call("call_f4", "patch", path="/home/dev/shop/shop/cart.py",
                   old_string="import MAX_ITEM", new_string="import MAX_CART_ITEMS")),
    answer("call_f4", {"success": False, "error": "old_string not found in file"}),
    assistant(call("call_f5", "read_file", path="/home/dev/shop/shop/cart.py")),
    answer("call_f5", {"content": "3|from .settings import MAX_ITEMS\n", "total_lines": 80}),
    assistant(call("call_f6", "patch", path="/home/dev/shop/shop/cart.py",
                   old_string="import MAX_ITEMS", new_string="import MAX_CART_ITEMS")),
    answer("call_f6", {"success": True}),
    assistant(call("call_f7", "search_files", pattern="MAX_ITEMS", path="/home/dev/shop")),
    answer("call_f7", {"matches": []}),
    assistant(call("call_f8", "read_file", path="/home/dev/shop/CHANGELOG.md")),
    answer("call_f8", {"content": "1|# Changelog\n", "total_lines": 1}),
    assistant(call("call_f9", "terminal", command="python -m compileall -q shop")),
    answer("call_f9", {"output": "", "exit_code": 0, "error": None}),
    assistant(content="Renamed in settings.py and cart.py."),
]
# read_file 3 + search_files 2 + patch 3 = 8 of 9 calls are file; terminal 1.

MIXED_SESSION: list[Message] = [
    {"role": "system", "content": HERMES_SYSTEM},
    user("Check which version of httpx we pin and whether a newer one exists."),
    assistant(call("call_m1", "read_file", path="requirements/base.txt")),
    answer("call_m1", {"content": "1|httpx==0.25.2\n", "total_lines": 9}),
    assistant(call("call_m2", "web_search", query="httpx latest release")),
    answer("call_m2", {"data": {"web": [{"title": "httpx on PyPI",
                                         "url": "https://pypi.org/project/httpx/"}]}}),
    assistant(call("call_m3", "terminal", command="pip index versions httpx")),
    answer("call_m3", {"output": "httpx (0.28.1)", "exit_code": 0, "error": None}),
    assistant(call("call_m4", "web_extract", urls=["https://www.python-httpx.org/changelog/"])),
    answer("call_m4", {"results": [{"content": "## 0.28.0 ... removed the proxies argument"}]}),
    assistant(call("call_m5", "search_files", pattern="proxies=", path=".")),
    answer("call_m5", {"matches": [{"path": "app/client.py", "line": 40}]}),
    assistant(call("call_m6", "terminal", command="pytest -q tests/test_client.py")),
    answer("call_m6", {"output": "4 passed", "exit_code": 0, "error": None}),
    assistant(content="You pin 0.25.2; 0.28.1 is out but drops `proxies=` used in "
                      "app/client.py."),
]
# 2 file, 2 research, 2 code: no family holds 60 %.

CHAT_SESSION: list[Message] = [
    {"role": "system", "content": HERMES_SYSTEM},
    user("What's a good name for a cat?"),
    assistant(content="Miso, Pixel, or Turing."),
]

LABELLED = [
    ("code", CODE_SESSION),
    ("research", RESEARCH_SESSION),
    ("file", FILE_SESSION),
    ("mixed", MIXED_SESSION),
    ("chat", CHAT_SESSION),
]
