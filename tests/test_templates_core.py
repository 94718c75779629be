"""Warm-start templates, the pure core: classify, extract, choose, warm_messages,
warm_text, validate_chat and the JSON document, on recorded-style Hermes sessions."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from typing import Any

import pytest

from hermes_async_memory.errors import ConfigurationError, InvalidTurnError
from hermes_async_memory.templates import (
    SCHEMA_VERSION,
    Example,
    InvalidChatError,
    InvalidTemplateError,
    Template,
    TemplateSettings,
    choose,
    classify,
    classify_tools,
    extract,
    family_of,
    validate_chat,
    warm_messages,
    warm_text,
)

from .fixtures_conversations import (
    CODE_SESSION,
    CODE_SHARE,
    FILE_SESSION,
    HERMES_SYSTEM,
    LABELLED,
    MIXED_SESSION,
    RESEARCH_SESSION,
    answer,
    assistant,
    call,
    user,
)

NEW_CHAT = [{"role": "system", "content": "You are Hermes Agent."},
            {"role": "user", "content": "The CSV export test fails, please have a look."}]


def _template(name: str, *, task_type: str = "code", tags: tuple[str, ...] = (),
              used: int = 0, ok: int = 0, failed: int = 0) -> Template:
    return Template(name=name, task_type=task_type, source_session_id=f"s-{name}", tags=tags,
                    usage_count=used, successes=ok, failures=failed)


def _call_ids(messages: list[dict[str, Any]]) -> list[str]:
    return [c["id"] for m in messages for c in m.get("tool_calls") or ()]


# classify


@pytest.mark.parametrize(("label", "session"), LABELLED, ids=[x[0] for x in LABELLED])
def test_classify_labels_recorded_sessions(label: str, session: list[dict[str, Any]]) -> None:
    assert classify(session) == label


def test_threshold_is_a_share_reached_inclusively() -> None:
    assert classify(CODE_SESSION, TemplateSettings(threshold=CODE_SHARE)) == "code"
    assert classify(CODE_SESSION, TemplateSettings(threshold=CODE_SHARE + 0.01)) == "mixed"
    # 2 of 6 calls per family in the mixed session: a low threshold picks the first listed
    assert classify(MIXED_SESSION, TemplateSettings(threshold=0.3)) == "code"


def test_custom_families_and_first_family_wins() -> None:
    families = {"vcs": ("git*",), "shell": ("terminal", "execute_code")}
    settings = TemplateSettings(families=families, threshold=0.5)
    # the code session's terminal calls include `git ...` commands, but it is the tool name
    # that is matched: 5 terminal + 2 execute_code of 10 calls
    assert classify(CODE_SESSION, settings) == "shell"
    assert classify_tools(["git_commit", "git_push", "terminal"], settings) == "vcs"
    # search_files matches both "file" (listed first) and "*search*"
    assert family_of("search_files") == "file"
    assert family_of("session_search") == "research"
    reordered = TemplateSettings(families={"research": ("*search*",), "file": ("*file*",)})
    assert family_of("search_files", reordered) == "research"
    assert family_of("Web_Search") == "research"  # case-insensitive
    assert family_of("todo") is None


def test_unclaimed_tools_dilute_every_share() -> None:
    tools = ["terminal", "terminal", "terminal", "todo", "memory"]
    assert classify_tools(tools) == "code"  # 3 of 5 = 0.6, the threshold itself
    assert classify_tools([*tools, "clarify"]) == "mixed"  # 3 of 6
    assert classify_tools([]) == "chat"


def test_settings_refuse_bad_values() -> None:
    bad: dict[str, Any]
    for bad in ({"threshold": 0}, {"threshold": 1.5}, {"max_examples": -1},
                {"min_evidence": 2.5}, {"min_success_rate": 2}, {"families": {}},
                {"families": {"mixed": ("x",)}}, {"families": {"code": ()}},
                {"families": {"code": "terminal"}}, {"user_pattern_messages": True}):
        with pytest.raises(ConfigurationError):
            TemplateSettings(**bad)


def test_settings_from_env() -> None:
    settings = TemplateSettings.from_env({
        "HERMES_MEMORY_TEMPLATE_THRESHOLD": "0.75",
        "HERMES_MEMORY_TEMPLATE_FAMILIES": "vcs: git*, hg* ; shell:terminal",
        "HERMES_MEMORY_TEMPLATE_MIN_EVIDENCE": "5",
    })
    assert settings.threshold == 0.75 and settings.min_evidence == 5
    assert dict(settings.families) == {"vcs": ("git*", "hg*"), "shell": ("terminal",)}
    with pytest.raises(ConfigurationError, match="HERMES_MEMORY_TEMPLATE_FAMILIES"):
        TemplateSettings.from_env({"HERMES_MEMORY_TEMPLATE_FAMILIES": "terminal"})
    with pytest.raises(ConfigurationError):
        TemplateSettings.from_env({"HERMES_MEMORY_TEMPLATE_THRESHOLD": "0"})


# extract


def test_extract_keeps_only_successful_answered_calls_once() -> None:
    session = [*CODE_SESSION[:-1],
               assistant(call("call_c11", "terminal", command="git push")),  # never answered
               assistant(call("call_c12", "terminal", command="git log -1"),
                         call("call_c13", "execute_code", code="1/0"))]
    session += [answer("call_c12", {"output": "commit 4f2a9c1", "exit_code": 0}),
                answer("call_c13", "Traceback (most recent call last):\n"
                                   "ZeroDivisionError: division by zero")]
    t = extract(session, name="fix-parser-tests", session_id="20260413_123456_abc123",
                now=1_700_000_000.0)
    ids = [e.call_id for e in t.examples]
    # c1 (exit 1), c2 (FileNotFoundError), c5 (ValueError), c11 (no answer), c13
    # (traceback) failed; c10 repeats c8's arguments; c7 repeats failed c1's and is kept
    assert ids == ["call_c3", "call_c4", "call_c6", "call_c7", "call_c8", "call_c9",
                   "call_c12"]
    c7 = t.examples[3]
    assert c7.tool == "terminal"
    assert c7.arguments == {"command": "pytest -q tests/test_parser.py"}
    assert "3 passed" in c7.result
    assert t.task_type == "code"
    assert t.source_session_id == "20260413_123456_abc123"
    assert t.created_at == 1_700_000_000.0
    assert (t.usage_count, t.successes, t.failures, t.success_rate) == (0, 0, 0, None)


def test_extract_caps_examples_in_order() -> None:
    t = extract(FILE_SESSION, name="f", session_id="s", settings=TemplateSettings(
        max_examples=2))
    assert [e.call_id for e in t.examples] == ["call_f1", "call_f2"]
    none = extract(FILE_SESSION, name="f", session_id="s",
                   settings=TemplateSettings(max_examples=0))
    assert none.examples == ()


def test_extract_system_context_user_patterns_and_tags() -> None:
    t = extract(FILE_SESSION, name="  rename-setting ", session_id="s",
                description=" Renames across a package ",
                tags=["Refactor", " python", "refactor", ""])
    assert t.name == "rename-setting"
    assert t.description == "Renames across a package"
    assert t.tags == ("refactor", "python")
    assert t.system_context == HERMES_SYSTEM + "\n\nThe repository is at /home/dev/shop."
    assert t.user_patterns == ("Rename the setting MAX_ITEMS to MAX_CART_ITEMS everywhere.",)
    # content parts are joined and whitespace folded to one line
    research = extract(RESEARCH_SESSION, name="r", session_id="s")
    assert research.user_patterns == (
        "How does asyncio.TaskGroup differ from gather? I care about cancellation.",
        "And what do people say about it in practice?")
    first = extract(RESEARCH_SESSION, name="r", session_id="s",
                    settings=TemplateSettings(user_pattern_messages=1))
    assert first.user_patterns == research.user_patterns[:1]
    long = extract([user("word " * 500)], name="l", session_id="s")
    assert len(long.user_patterns[0]) <= 300 and long.user_patterns[0].endswith("…")
    short = extract(FILE_SESSION, name="f", session_id="s",
                    settings=TemplateSettings(max_context_chars=90))
    assert short.system_context == HERMES_SYSTEM.splitlines()[0]


def test_extract_markers_files_and_urls_from_successful_calls() -> None:
    code = extract(CODE_SESSION, name="c", session_id="s")
    # src/parse.py was a failed read; "--- a/src/parser.py" in the diff names src/parser.py
    assert code.context_markers == ("src/parser.py", "tests/test_parser.py")
    research = extract(RESEARCH_SESSION, name="r", session_id="s")
    assert research.context_markers == (
        "https://docs.python.org/3/library/asyncio-task.html",
        "https://peps.python.org/pep-0654/",
        "https://docs.python.org/3.12/library/asyncio-task.html",
        "https://blog.example.com/posts/taskgroups",
        "notes/asyncio-taskgroup.md")
    assert not any("s3cret" in m or "utm_" in m or "#" in m for m in research.context_markers)
    files = extract(FILE_SESSION, name="f", session_id="s")
    assert "/home/dev/shop/shop/settings.py" in files.context_markers
    assert "/home/dev/shop/shop/cart.py" in files.context_markers
    mixed = extract(MIXED_SESSION, name="m", session_id="s")
    assert "." not in mixed.context_markers  # search_files path="." is no marker
    assert "app/client.py" in mixed.context_markers  # from a JSON answer's "path"
    capped = extract(RESEARCH_SESSION, name="r", session_id="s",
                     settings=TemplateSettings(max_markers=2))
    assert capped.context_markers == research.context_markers[:2]


def test_extract_text_markers_are_conservative() -> None:
    session = [user("go"),
               assistant(call("call_1", "terminal", command="echo 3.14 e.g. v1.2/3 and/or")),
               answer("call_1", "Saw ./build/out.tar.gz, ~/notes/todo.md and /etc/hosts.conf."
                                " Mail dev@example.com/x.py? no.")]
    t = extract(session, name="t", session_id="s")
    assert t.context_markers == ("./build/out.tar.gz", "~/notes/todo.md", "/etc/hosts.conf")


def test_extract_skips_calls_whose_arguments_are_not_an_object() -> None:
    broken = {"id": "call_b", "type": "function",
              "function": {"name": "terminal", "arguments": "ls -la"}}
    session = [user("list"), assistant(broken), answer("call_b", {"output": "a", "exit_code": 0})]
    assert extract(session, name="b", session_id="s").examples == ()


def test_extract_refuses_bad_names_and_task_types() -> None:
    for kwargs in ({"name": " "}, {"name": "a\nb"}, {"session_id": ""},
                   {"task_type": "cooking"}, {"tags": [3]}, {"tags": ["a,b"]}):
        args: dict[str, Any] = {"name": "n", "session_id": "s", **kwargs}
        with pytest.raises(InvalidTemplateError):
            extract(CODE_SESSION, **args)
    assert extract(CODE_SESSION, name="n", session_id="s", task_type="file").task_type == "file"


# warm_messages and validate_chat


@pytest.mark.parametrize(("label", "session"), LABELLED, ids=[x[0] for x in LABELLED])
def test_warm_messages_validate_and_answer_every_call(label: str,
                                                      session: list[dict[str, Any]]) -> None:
    t = extract(session, name=f"{label}-template", session_id="s")
    out = warm_messages(t, NEW_CHAT)
    validate_chat(out)
    ids = _call_ids(out)
    assert len(ids) == len(t.examples) == len(set(ids))
    answered = [m["tool_call_id"] for m in out if m["role"] == "tool"]
    assert sorted(answered) == sorted(ids)
    for i, m in enumerate(out):  # each call is answered right after its assistant message
        if m.get("tool_calls"):
            assert out[i + 1] == {"role": "tool", "tool_call_id": m["tool_calls"][0]["id"],
                                  "content": out[i + 1]["content"]}


def test_warm_messages_layout() -> None:
    t = extract(CODE_SESSION, name="fix-parser-tests", session_id="s", tags=["python"])
    existing = [{"role": "system", "content": "You are Hermes Agent."},
                {"role": "developer", "content": "Work in /srv/app."},
                *NEW_CHAT[1:]]
    before = copy.deepcopy(existing)
    out = warm_messages(t, existing)
    assert existing == before  # the caller's list is not changed
    assert out[:2] == existing[:2]
    note = out[2]
    assert note["role"] == "system"
    for text in ('"fix-parser-tests"', "code task", "tags: python", "src/parser.py",
                 "tests/test_parser.py", t.user_patterns[0], "out of date"):
        assert text in note["content"]
    assert HERMES_SYSTEM in note["content"]  # the source's instructions, not given here
    pairs = out[3:-1]
    assert len(pairs) == 2 * len(t.examples)
    for example, call_message, tool_message in zip(t.examples, pairs[::2], pairs[1::2],
                                                   strict=True):
        function = call_message["tool_calls"][0]["function"]
        assert function["name"] == example.tool
        assert json.loads(function["arguments"]) == example.arguments
        assert tool_message["content"] == example.result
    assert out[-1] == existing[-1]


def test_warm_messages_skips_instructions_already_given_and_avoids_taken_ids() -> None:
    t = extract(CODE_SESSION, name="c", session_id="s")
    out = warm_messages(t, CODE_SESSION)  # the source session itself, as existing
    validate_chat(out)
    assert HERMES_SYSTEM not in out[1]["content"]
    ids = _call_ids(out)
    assert len(ids) == len(set(ids))
    alone = warm_messages(t, [])
    validate_chat(alone)
    assert alone[0]["role"] == "system"


def test_warm_messages_give_empty_results_a_content() -> None:
    t = Template(name="e", task_type="code", source_session_id="s", examples=(
        Example(tool="terminal", arguments={"command": "true"}, result="", call_id="c"),))
    out = warm_messages(t, NEW_CHAT)
    validate_chat(out)
    assert out[3]["content"] == "(no output)"


def test_validate_chat_accepts_recorded_sessions() -> None:
    for _, session in LABELLED:
        validate_chat(session)


def _chat_with(*messages: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "s"}, user("u"), *messages]


@pytest.mark.parametrize(("messages", "index", "words"), [
    (_chat_with(assistant(call("a", "terminal", command="ls"))), None, "never answered"),
    (_chat_with(assistant(call("a", "terminal", command="ls")), user("next")), 3,
     "not answered"),
    (_chat_with(answer("a", "orphan")), 2, "answers no call"),
    (_chat_with(assistant(call("a", "terminal", command="ls")), answer("a", "1"),
                answer("a", "2")), 4, "already answered"),
    (_chat_with(assistant(call("a", "terminal", command="ls")), answer("b", "1")), 3,
     "answers no call"),
    (_chat_with(assistant(call("a", "terminal", command="ls")), user("x"), answer("a", "1")),
     3, "not answered"),
    (_chat_with({"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "t", "arguments": "{not json"}}]},
        answer("a", "1")), 2, "not valid JSON"),
    (_chat_with({"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "t", "arguments": "[1]"}}]},
        answer("a", "1")), 2, "JSON object"),
    (_chat_with({"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "t", "arguments": {"x": 1}}}]},
        answer("a", "1")), 2, "JSON string"),
    (_chat_with({"role": "assistant", "content": None, "tool_calls": [
        {"id": 7, "type": "function", "function": {"name": "t", "arguments": "{}"}}]}), 2,
     "id string"),
    (_chat_with({"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "tool", "function": {"name": "t", "arguments": "{}"}}]}), 2,
     "'function'"),
    (_chat_with({"role": "assistant", "content": None, "tool_calls": [
        {"id": "a", "type": "function", "function": {"arguments": "{}"}}]}), 2, "name"),
    (_chat_with({"role": "assistant", "content": None, "tool_calls": []}), 2, "non-empty"),
    (_chat_with(assistant(call("a", "t")), answer("a", "1"), assistant(call("a", "t")),
                answer("a", "2")), 4, "used twice"),
    (_chat_with({"role": "assistant", "content": None}), 2, "needs content"),
    (_chat_with({"role": "function", "content": "x"}), 2, "unknown role"),
    (_chat_with({"role": "user", "content": 42}), 2, "string or a non-empty list"),
    (_chat_with({"role": "user", "content": [{"type": "video", "url": "x"}]}), 2, "part"),
    (_chat_with({"role": "tool", "content": "x"}), 2, "tool_call_id"),
    ([], None, "empty"),
], ids=["unanswered-at-end", "unanswered-before-user", "orphan-tool", "answered-twice",
        "wrong-id", "answer-too-late", "arguments-not-json", "arguments-not-object",
        "arguments-not-string", "id-not-string", "type-not-function", "no-function-name",
        "empty-tool-calls", "duplicate-id", "assistant-without-content", "unknown-role",
        "bad-content-type", "bad-part-type", "tool-without-id", "empty-list"])
def test_validate_chat_rejects_malformed_lists(messages: list[dict[str, Any]],
                                               index: int | None, words: str) -> None:
    with pytest.raises(InvalidChatError, match=words) as caught:
        validate_chat(messages)
    assert caught.value.index == index
    assert isinstance(caught.value, InvalidTurnError)


def test_validate_chat_accepts_parallel_calls_and_content_parts() -> None:
    validate_chat(_chat_with(
        assistant(call("a", "web_search", query="x"), call("b", "read_file", path="y")),
        answer("b", "2"), answer("a", "1"),
        {"role": "assistant", "content": [{"type": "text", "text": "done"}]},
        {"role": "user", "content": [{"type": "text", "text": "look"},
                                     {"type": "image_url", "image_url": {"url": "x"}}]}))


# warm_text


def test_warm_text_holds_note_examples_and_markers() -> None:
    t = extract(RESEARCH_SESSION, name="asyncio-research", session_id="s", tags=["python"])
    text = warm_text(t)
    assert len(text) <= 2000
    lines = text.splitlines()
    assert lines[0] == '<warm_start template="asyncio-research" task_type="research">'
    assert lines[-1] == "</warm_start>"
    assert "research task" in lines[1]
    assert any(line.startswith("- web_search ") and "TaskGroup" in line for line in lines)
    assert "- https://peps.python.org/pep-0654/" in lines
    assert "- notes/asyncio-taskgroup.md" in lines


@pytest.mark.parametrize("max_chars", [120, 300, 700, 1200, 2000, 5000])
def test_warm_text_is_bounded_and_never_cuts_a_line(max_chars: int) -> None:
    t = extract(CODE_SESSION, name="c", session_id="s")
    full = warm_text(t, max_chars=100_000).splitlines()
    text = warm_text(t, max_chars=max_chars)
    assert len(text) <= max_chars
    lines = text.splitlines()
    assert lines[0] == full[0] and lines[-1] == "</warm_start>"
    assert all(line in full for line in lines)
    if max_chars >= 700:
        assert "Examples:" in lines  # examples come before markers and patterns


def test_warm_text_refuses_a_bound_too_small_for_its_tags() -> None:
    t = extract(CODE_SESSION, name="c", session_id="s")
    with pytest.raises(ValueError, match="max_chars"):
        warm_text(t, max_chars=40)


# choose


def test_choose_prefers_best_rate_then_least_used() -> None:
    a = _template("a", used=20, ok=8, failed=2)  # 0.8
    b = _template("b", used=30, ok=9, failed=1)  # 0.9
    c = _template("c", used=12, ok=18, failed=2)  # 0.9, less used
    d = _template("d", used=12, ok=9, failed=1)  # 0.9, as used as c, less evidence
    assert choose([a, b, c, d], "code") is c
    assert choose([a, b], "code") is b
    assert choose([d, c], "code") is c  # the tie on use goes to more evidence


def test_choose_none_when_best_lacks_evidence() -> None:
    settings = TemplateSettings(min_evidence=3)
    proven = _template("proven", ok=9, failed=1)
    lucky = _template("lucky", ok=2)  # 2 of 2: the best rate, on too little evidence
    assert choose([lucky], "code", settings=settings) is None
    # Under the floor it neither wins nor blocks the proven one.
    assert choose([proven, lucky], "code", settings=settings) is proven
    assert choose([lucky, proven], "code", settings=settings) is proven
    assert choose([proven], "code", settings=settings) is proven
    untried = _template("untried")
    assert choose([untried], "code", settings=settings) is None
    assert choose([untried, proven], "code", settings=settings) is proven  # unknown ranks low
    anything = TemplateSettings(min_evidence=0, min_success_rate=0)
    assert choose([untried], "code", settings=anything) is untried


def test_choose_applies_the_rate_floor() -> None:
    poor = _template("poor", ok=4, failed=6)
    assert choose([poor], "code", settings=TemplateSettings(min_success_rate=0.5)) is None
    assert choose([poor], "code", settings=TemplateSettings(min_success_rate=0.4)) is poor


def test_choose_respects_task_type_and_tags() -> None:
    code = _template("code", tags=("python",), ok=5)
    web = _template("web", task_type="research", tags=("python",), ok=9)
    rust = _template("rust", tags=("rust", "cli"), ok=3, failed=1)
    everything = [code, web, rust]
    assert choose(everything, "research") is web
    assert choose(everything, "file") is None
    assert choose(everything, "code", tags=["Rust", "wasm"]) is rust
    assert choose(everything, "code", tags=["python"]) is code
    assert choose(everything, "code", tags=["go"]) is None
    assert choose(everything, "code") is code
    assert choose(iter(everything), "code") is code  # one pass: an iterator is enough
    assert choose([], "code") is None


# the template document


def test_template_json_round_trip() -> None:
    t = extract(RESEARCH_SESSION, name="r", session_id="s", description="asyncio research",
                tags=["python"], now=1_700_000_000.5)
    t = t.used().used().outcome(True).outcome(False).outcome(True)
    assert (t.usage_count, t.successes, t.failures, t.ended) == (2, 2, 1, 3)
    assert t.success_rate == pytest.approx(2 / 3)
    back = Template.from_json(t.to_json())
    assert back == t
    assert Template.from_json(t.to_json(indent=2).encode()) == t
    assert json.loads(t.to_json())["schema"] == SCHEMA_VERSION


def _doc() -> dict[str, Any]:
    return extract(CODE_SESSION, name="c", session_id="s", now=1.0).to_dict()


@pytest.mark.parametrize("change", [
    lambda d: "not json {",
    lambda d: json.dumps([d]),
    lambda d: json.dumps({**d, "schema": SCHEMA_VERSION + 1}),
    lambda d: json.dumps({k: v for k, v in d.items() if k != "schema"}),
    lambda d: json.dumps({k: v for k, v in d.items() if k != "examples"}),
    lambda d: json.dumps({**d, "colour": "blue"}),
    lambda d: json.dumps({**d, "name": ""}),
    lambda d: json.dumps({**d, "usage_count": -1}),
    lambda d: json.dumps({**d, "successes": True}),
    lambda d: json.dumps({**d, "tags": "python"}),
    lambda d: json.dumps({**d, "created_at": "yesterday"}),
    lambda d: json.dumps({**d, "examples": [{"tool": "t", "arguments": "ls", "result": "",
                                             "call_id": "c"}]}),
    lambda d: json.dumps({**d, "examples": [{"tool": "t"}]}),
], ids=["not-json", "not-object", "newer-schema", "no-schema", "missing-key", "unknown-key",
        "empty-name", "negative-count", "bool-count", "tags-not-list", "bad-time",
        "example-arguments", "example-keys"])
def test_bad_template_document_raises_typed_error(change: Any) -> None:
    with pytest.raises(InvalidTemplateError) as caught:
        Template.from_json(change(_doc()))
    assert isinstance(caught.value, InvalidTurnError)
    assert isinstance(caught.value, ValueError)


def test_round_trip_keeps_a_chosen_template_choosable() -> None:
    t = replace(extract(FILE_SESSION, name="f", session_id="s"), usage_count=5, successes=4,
                failures=1)
    assert choose([Template.from_json(t.to_json())], "file") == t


def test_a_document_with_a_tag_the_store_cannot_take_is_refused_when_read() -> None:
    doc = _template("tagged").to_dict()
    doc["tags"] = ["python,rust"]
    with pytest.raises(InvalidTemplateError, match="comma"):
        Template.from_dict(doc)
    doc["tags"] = [" Python ", "python"]
    assert Template.from_dict(doc).tags == ("python",)
