"""Session search: plain text is data, FTS5 syntax works without reaching past the user's own
rows, malformed queries fail with a typed error that says where, filters and paging, and each
hit's neighbours come from its own session."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from hermes_async_memory import MemoryPipeline, Settings
from hermes_async_memory.errors import InvalidTurnError
from hermes_async_memory.sessions import InvalidSearchError, SearchHit, SessionReads
from hermes_async_memory.turns import scope_token_for

WEATHER_CALL = {"id": "call_w", "type": "function",
                "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}


def _weather_turn() -> list[dict[str, Any]]:
    return [
        {"role": "user", "content": "check the weather in Oslo"},
        {"role": "assistant", "content": "", "tool_calls": [WEATHER_CALL]},
        {"role": "tool", "tool_call_id": "call_w", "name": "weather",
         "content": "Oslo: 4°C and rain"},
        {"role": "assistant", "content": "It is 4°C and raining in Oslo."},
    ]


@pytest.fixture
async def mem(tmp_path: Path) -> AsyncIterator[MemoryPipeline]:
    """Two users and a session without one, their turns interleaved in one commit so that
    message ids of different sessions alternate."""
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db", source="cli")) as pipeline:
        p = pipeline
        p.sync_turn("how do I deploy the docker stack", "use docker compose up to deploy",
                    session_id="ann-1", user_id="ann", metadata={"model": "m1"})
        p.sync_turn("docker secrets for bob only", "bob keeps his docker secrets here",
                    session_id="bob-1", user_id="bob", metadata={"model": "m2"})
        p.sync_turn("check the weather in Oslo", "It is 4°C and raining in Oslo.",
                    session_id="ann-1", user_id="ann", messages=_weather_turn(),
                    metadata={"model": "m1"})
        p.sync_turn("kubernetes is not docker", "right, kubernetes orchestrates containers",
                    session_id="ann-2", user_id="ann",
                    metadata={"source": "telegram", "model": "m3"})
        p.sync_turn("NEAR AND OR NOT are words here", "and so are quotes",
                    session_id="ann-2", user_id="ann", metadata={"source": "telegram"})
        p.sync_turn("docker without a user", "anonymous docker answer", session_id="anon-1")
        await p.flush()
        yield p


def _texts(hits: list[SearchHit]) -> list[str]:
    """The hits' snippets without the match marks."""
    return [h.snippet.replace(">>>", "").replace("<<<", "") for h in hits]


async def test_plain_text_is_data_and_every_word_must_appear(mem: MemoryPipeline) -> None:
    reads = SessionReads(mem)
    # Both words: the message with only one of them is not a hit.
    assert _texts(await reads.search("docker compose", user_id="ann")) == [
        "use docker compose up to deploy"]
    # FTS5 operators and quotes are words: NOT does not exclude, it is searched for.
    assert _texts(await reads.search("NOT docker", user_id="ann")) == [
        "kubernetes is not docker"]
    assert _texts(await reads.search('NEAR("and" OR', user_id="ann")) == [
        "NEAR AND OR NOT are words here"]
    found = _texts(await reads.search("Docker", user_id="ann", roles=["user"]))
    assert sorted(found) == ["how do I deploy the docker stack", "kubernetes is not docker"]
    assert await reads.search("docker zebra", user_id="ann") == []
    assert await reads.search("   ", user_id="ann") == []
    assert await reads.search("?!*", user_id="ann") == []  # punctuation only: nothing to find


async def test_fts5_syntax_phrases_prefix_and_or_not_near(mem: MemoryPipeline) -> None:
    reads = SessionReads(mem)

    async def find(query: str) -> set[str]:
        return set(_texts(await reads.search(query, user_id="ann", syntax="fts5")))

    assert await find('"docker compose"') == {"use docker compose up to deploy"}
    assert await find('"compose docker"') == set()  # a phrase keeps its word order
    assert await find("kube*") == {"kubernetes is not docker",
                                   "right, kubernetes orchestrates containers"}
    assert await find("docker AND deploy") == {"how do I deploy the docker stack",
                                               "use docker compose up to deploy"}
    assert await find("compose OR orchestrates") == {
        "use docker compose up to deploy", "right, kubernetes orchestrates containers"}
    assert await find("docker NOT kubernetes") == {
        "how do I deploy the docker stack", "use docker compose up to deploy"}
    assert await find("NEAR(docker stack, 1)") == {"how do I deploy the docker stack"}
    assert await find("NEAR(deploy stack, 1)") == set()  # three words apart
    assert await find("(stack OR compose) AND deploy") == {
        "how do I deploy the docker stack", "use docker compose up to deploy"}
    assert await find("^use docker") == {"use docker compose up to deploy"}
    # Upper case only: lower-case "and" is a word, as in FTS5 (no docker message holds it).
    assert await find("docker and") == set()
    assert await find("words and here") == {"NEAR AND OR NOT are words here"}


async def test_hits_carry_their_message_session_and_marked_snippet(mem: MemoryPipeline) -> None:
    reads = SessionReads(mem)
    [hit] = await reads.search("Oslo", user_id="ann", roles=["tool"])
    assert (hit.session_id, hit.user_id, hit.source, hit.model) == ("ann-1", "ann", "cli", "m1")
    assert (hit.role, hit.tool_name) == ("tool", "weather")
    assert hit.snippet == ">>>Oslo<<<: 4°C and rain"
    stored = await mem.get_messages("ann-1")
    assert hit.message_id == next(m["id"] for m in stored if m["role"] == "tool")
    assert hit.as_dict()["before"] == {"role": "assistant", "content": ""}
    [hit] = await reads.search("kubernetes containers", user_id="ann")
    assert (hit.source, hit.model, hit.role, hit.tool_name) == (
        "telegram", "m3", "assistant", None)


async def test_context_is_the_neighbouring_messages_of_the_same_session(
        mem: MemoryPipeline) -> None:
    reads = SessionReads(mem)
    [hit] = await reads.search("compose", user_id="ann")
    # Bob's turn was committed between ann-1's two turns: its ids sit between them.
    ids = {m["id"] for m in await mem.get_messages("bob-1")}
    assert hit.message_id + 1 in ids
    assert hit.before is not None and hit.after is not None
    assert (hit.before.role, hit.before.content) == ("user", "how do I deploy the docker stack")
    assert (hit.after.role, hit.after.content) == ("user", "check the weather in Oslo")
    # Bob's messages also sit right before ann-1's second turn.
    [second] = await reads.search("weather", user_id="ann", roles=["user"])
    assert second.message_id - 1 in ids
    assert second.before is not None and second.before.content == (
        "use docker compose up to deploy")
    [first] = await reads.search("stack", user_id="ann")
    assert first.before is None  # the session's first message
    assert first.after is not None and first.after.content == "use docker compose up to deploy"
    # (The word index stems: "raining" finds the tool's "rain" too.)
    [last] = await reads.search("raining", user_id="ann", roles=["assistant"])
    assert last.after is None and last.before is not None
    assert last.before.content == "Oslo: 4°C and rain"


async def test_context_text_is_cut_to_200_characters(tmp_path: Path) -> None:
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db")) as mem:
        mem.sync_turn("x" * 500 + " question", "needle answer", session_id="s", user_id="u")
        await mem.flush()
        [hit] = await SessionReads(mem).search("needle", user_id="u")
        assert hit.before is not None and hit.before.content == "x" * 200


QUERIES_THAT_TRY_TO_REACH_SCOPE = [
    "scope:docker", "scope : docker", '{scope}: docker', "{content scope}: bob",
    "content:docker OR scope:anything", "- content: docker", '"scope":docker',
    "docker OR {scope}", "NEAR(scope: docker)",
]


@pytest.mark.parametrize("query", QUERIES_THAT_TRY_TO_REACH_SCOPE)
async def test_column_filters_are_refused_with_a_reason(mem: MemoryPipeline, query: str) -> None:
    with pytest.raises(InvalidSearchError, match=r"column filter|'-'|':'"):
        await SessionReads(mem).search(query, user_id="ann", syntax="fts5")


async def test_no_query_reaches_another_users_rows(mem: MemoryPipeline) -> None:
    reads = SessionReads(mem)
    bob = scope_token_for("bob", None)
    # Knowing the other user's scope token does not help: a phrase searches message text.
    attempts = [f'"{bob}"', f'docker OR "{bob}"', f"{bob}", f"{bob}*", "u*", "scope",
                f'scope:"{bob}"', f"docker OR scope:{bob}", "bob", "secrets"]
    for syntax in ("plain", "fts5"):
        for query in attempts:
            try:
                hits = await reads.search(query, user_id="ann", syntax=syntax, limit=100)
            except InvalidSearchError:
                continue
            assert all(h.user_id == "ann" for h in hits), (syntax, query)
    # What ann can see of docker, bob's rows left out; bob's own search finds them.
    assert {h.session_id for h in await reads.search("docker", user_id="ann", limit=100)} == {
        "ann-1", "ann-2"}
    assert {h.user_id for h in await reads.search("secrets", user_id="bob")} == {"bob"}


async def test_scope_is_required_and_a_session_without_user_shows_only_its_own_rows(
        mem: MemoryPipeline) -> None:
    reads = SessionReads(mem)
    with pytest.raises(InvalidSearchError, match="needs a user_id"):
        await reads.search("docker")
    # A session id alone reads the rows stored without a user: bob's session shows nothing.
    found = _texts(await reads.search("docker", session_id="anon-1"))
    assert sorted(found) == ["anonymous docker answer", "docker without a user"]
    assert await reads.search("docker", session_id="bob-1") == []
    # An administrator's search covers everyone.
    everyone = await reads.search("docker", all_users=True, limit=100)
    assert {h.session_id for h in everyone} == {"ann-1", "ann-2", "bob-1", "anon-1"}
    assert {h.user_id for h in everyone} == {"ann", "bob", None}


async def test_filters_by_source_role_and_session(mem: MemoryPipeline) -> None:
    reads = SessionReads(mem)

    async def sessions(**kw: Any) -> set[tuple[str, str]]:
        hits = await reads.search("docker OR kubernetes OR Oslo", syntax="fts5", limit=100,
                                  **kw)
        return {(h.session_id, h.role) for h in hits}

    everything = await sessions(user_id="ann")
    assert {s for s, _ in everything} == {"ann-1", "ann-2"}
    assert {s for s, _ in await sessions(user_id="ann", sources=["telegram"])} == {"ann-2"}
    assert {s for s, _ in await sessions(user_id="ann", sources="telegram")} == {"ann-2"}
    assert {s for s, _ in await sessions(user_id="ann", exclude_sources=["telegram"])} == {
        "ann-1"}
    assert await sessions(user_id="ann", sources=[]) == set()
    assert await sessions(user_id="ann", sources=["cli", "telegram"]) == everything
    assert {r for _, r in await sessions(user_id="ann", roles=["tool"])} == {"tool"}
    assert {r for _, r in await sessions(user_id="ann", roles=["user", "tool"])} == {
        "user", "tool"}
    assert {s for s, _ in await sessions(user_id="ann", session_id="ann-2")} == {"ann-2"}
    assert await sessions(user_id="ann", session_id="bob-1") == set()  # not ann's
    assert await sessions(user_id="ann", session_id="ann-2", exclude_sources=["telegram"]) \
        == set()
    # An admin narrows by source across users.
    assert {s for s, _ in await sessions(all_users=True, sources=["cli"])} == {
        "ann-1", "bob-1", "anon-1"}


async def test_pages_are_disjoint_consecutive_and_cover_every_hit(tmp_path: Path) -> None:
    async with MemoryPipeline(Settings(db_path=tmp_path / "m.db")) as mem:
        for i in range(13):
            # Ranks differ with the text's length; several tie (same length): ties go by id.
            mem.sync_turn(f"paging test {'word ' * (i % 4)}", "reply without the term",
                          session_id=f"s{i % 3}", user_id="u")
        mem.sync_turn("paging for another user", "x", session_id="other", user_id="v")
        await mem.flush()
        reads = SessionReads(mem)
        everything = await reads.search("paging", user_id="u", limit=100)
        assert len(everything) == 13
        assert [h.rank for h in everything] == sorted(h.rank for h in everything)
        pages = [await reads.search("paging", user_id="u", limit=5, offset=o)
                 for o in (0, 5, 10, 15)]
        assert [len(p) for p in pages] == [5, 5, 3, 0]
        assert [h.message_id for p in pages for h in p] == [h.message_id for h in everything]


HOSTILE = ['"', '""', "'", "NEAR(", "NEAR(a", "a AND", "OR", "NOT x", "NOT", "*", "**", "a**",
           "key:value", ":", "(", ")", "((a)", "a))", "()", "^", "^x", "+", "a +", "-", "-x",
           "x - y", "'; DROP TABLE messages; --", "\\", "\x00", "a\x00b", '"a\x00b"', "\x1a",
           "ünïcödé", "日本語 テキスト", "emoji 🐳 docker", "\u200b", "\ufeffdocker", "\u3000",
           "", "   ", "\n\t", "x" * 5000, "docker " * 2000, "(" * 500, ")" * 500, "NEAR(" * 50,
           "a AND " * 100 + "b", '"' * 101, "a" * 100_000, "docker*" * 40, "NEAR(a b, -1)",
           "NEAR(a b, 99999999999999999999999)", "NEAR(a b,)", "NEAR(a b, 3", "{", "}",
           "scope", "rank:1", "messages_fts", "a OR OR b", "a NOT NOT b", "*docker", ",",
           "docker,compose", "\ud800", "\udfff lone", "%", "_", "__init__", "?", "$1"]


@pytest.mark.parametrize("syntax", ["plain", "fts5"])
async def test_hostile_strings_give_hits_or_invalid_search_error_only(
        mem: MemoryPipeline, syntax: str) -> None:
    reads = SessionReads(mem)
    refused = 0
    for query in HOSTILE:
        try:
            hits = await reads.search(query, user_id="ann", syntax=syntax)
        except InvalidSearchError as exc:
            assert str(exc), query
            refused += 1
            continue
        assert all(isinstance(h, SearchHit) and h.user_id == "ann" for h in hits), query
    if syntax == "plain":
        assert refused == 0  # plain text is data: nothing in it is malformed
    else:
        assert refused > 0


@pytest.mark.parametrize(("query", "says"), [
    ('docker "compose', "unbalanced double quote: the phrase opened at position 7"),
    ("(docker OR compose", "unbalanced parenthesis: '(' at position 0 is never closed"),
    ("docker) OR compose", "')' at position 6 closes nothing"),
    ("docker AND", "'AND' at position 7 needs a term after it"),
    ("docker OR AND compose", "'OR' at position 7 needs a term after it"),
    ("NOT docker", "'NOT' at position 0 needs a term before it"),
    ("OR docker", "'OR' at position 0 needs a term before it"),
    ("*", "'*' at position 0 must follow a word"),
    ("NEAR(docker compose", "NEAR( at position 0 is never closed"),
    ("NEAR(docker compose, far)", "distance after ',' at position 19 must be a number"),
    ("NEAR()", "NEAR( at position 0 needs words or phrases"),
    ("docker ()", "empty parentheses at position 7"),
    ("docker = compose", "unexpected character '=' at position 7"),
    ("a\x00b", "NUL character at position 1"),
    ("x" * 5000, "5000 characters long"),
    ("(" * 40 + "a" + ")" * 40, "nests deeper than"),
])
async def test_malformed_fts5_says_what_and_where(mem: MemoryPipeline, query: str,
                                                  says: str) -> None:
    with pytest.raises(InvalidSearchError) as caught:
        await SessionReads(mem).search(query, user_id="ann", syntax="fts5")
    assert says in str(caught.value)
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, InvalidTurnError)


async def test_invalid_arguments_are_refused_with_typed_errors(mem: MemoryPipeline) -> None:
    reads = SessionReads(mem)
    with pytest.raises(InvalidSearchError, match="syntax must be one of 'plain', 'fts5'"):
        await reads.search("docker", user_id="ann", syntax="regex")
    for limit in (0, 101, -1, True, 1.5, "10"):
        with pytest.raises(InvalidSearchError, match="limit must be an integer from 1 to 100"):
            await reads.search("docker", user_id="ann", limit=limit)  # type: ignore[arg-type]
    for offset in (-1, 10**30, None):
        with pytest.raises(InvalidSearchError, match="offset must be an integer"):
            await reads.search("docker", user_id="ann", offset=offset)  # type: ignore[arg-type]
    with pytest.raises(InvalidSearchError, match="query must be a string"):
        await reads.search(None, user_id="ann")  # type: ignore[arg-type]
    with pytest.raises(InvalidSearchError, match="user_id must be a non-empty string"):
        await reads.search("docker", user_id="")
    with pytest.raises(InvalidSearchError, match="sources must be a list of strings"):
        await reads.search("docker", user_id="ann", sources=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidSearchError, match="roles must be a non-empty string"):
        await reads.search("docker", user_id="ann", roles=["user", 3])  # type: ignore[list-item]


async def test_a_query_sqlite_refuses_is_an_invalid_search_error(mem: MemoryPipeline) -> None:
    """The parser is the first check; SQLite's own refusal of a MATCH is mapped too."""
    reads = SessionReads(mem)
    store = mem.store
    original = store.search_messages

    async def unchecked(match: str, **kw: Any) -> list[dict[str, Any]]:
        return await original('content:("docker" AND', **kw)

    store.search_messages = unchecked  # type: ignore[method-assign]
    try:
        with pytest.raises(InvalidSearchError, match="fts5: syntax error"):
            await reads.search("docker", user_id="ann")
    finally:
        del store.search_messages


async def test_search_after_close_is_refused(tmp_path: Path) -> None:
    from hermes_async_memory.errors import PipelineClosedError

    mem = MemoryPipeline(Settings(db_path=tmp_path / "m.db"))
    reads = SessionReads(mem)
    with pytest.raises(PipelineClosedError):
        await reads.search("docker", user_id="ann")
    async with mem:
        assert await reads.search("docker", user_id="ann") == []
    with pytest.raises(PipelineClosedError):
        await reads.search("docker", user_id="ann")
