"""The messages' full-text indexes and how they are filled: the word index ``messages_fts``
(``schema.SCHEMA``) and, beside it, the trigram index ``messages_trgm`` for text the word
index cannot split into words, and the tool index ``messages_tools`` for what a message says
of tools (see below).

The word index's tokenizer (unicode61) splits text at spaces and punctuation. Chinese and
Japanese put no spaces between words, and Korean attaches particles to them, so a run of
such text is ONE token there ("大别山项目计划书" is a single word): a search for 大别山 finds
nothing. The trigram index holds every three characters of a text as a token, so any
substring of three or more characters is found, and ranked with bm25.

Which messages it holds: those whose text has a CJK character (``CJK_RANGES``). A search
goes to it only when its query holds CJK text, so a message without any could never be
found through it: indexing every message would more than double the store (49.9 MB of
trigram index beside 10.5 MB of word index for 16.4 MB of English text) and cost ~24 µs a
message at commit, half the pipeline's throughput.

It has external content (``messages``): the index is all it stores (a contentless table
would be as small, but SQLite before 3.43 cannot delete from one). As the word index, it has
no insert trigger: a commit fills it once from the rows it just inserted (``INDEX_TRIGRAM``,
``INDEX_MESSAGES``), for the turns whose record holds CJK text (``payload_has_cjk``), and
after a session operation whose record holds such text (an import, a replacement), with the
session's messages it lacks (``INDEX_SESSION_TRIGRAM``). A deleted message leaves it through
``messages_trgm_delete``, which removes only what the index holds (the row's entry in
``messages_trgm_docsize``, which FTS5 keeps for each indexed row): a message inserted by a
path that did not fill the index is not found through it, and its delete cannot take from
the index what was never there (for an external-content table that would corrupt it).
``INSERT INTO messages_trgm (messages_trgm, rank) VALUES ('integrity-check', 1)`` compares
the index with every message, so it reports the messages without CJK text as missing: the
check without content (rank 0, the default) is the one that applies.

The tool index holds, for each message with a tool name or tool calls, the generated column
``tool_text``: the tool name and the calls' JSON (each call's function name and arguments),
as Hermes Agent indexes them beside a message's text, so that a session search finds a
message by the tool it ran or the arguments it gave. It is an index of its own (the word
index holds the text alone, which recall ranks on, untouched): a search that wants tool text
asks both and merges the hits (a message found by both is one hit). Filled like the trigram
index: by each commit from the rows it inserted (``INDEX_TOOLS``), and left through
``messages_tools_delete`` only by what it holds.

A SQLite without the trigram tokenizer (``no such tokenizer: trigram``) opens the store all
the same (``ensure_trigram``): the table is not made, fills go to temporary tables on the
writer connection that keep nothing, and the search falls back to LIKE.

A SQLite without FTS5 at all (``fts5_available``) opens the store too, without its
full-text indexes: every write goes on as before, searches raise
``FullTextUnavailableError`` and recalls find nothing, and the store's health says so
(``full_text``). The rule that makes this safe in both directions: **an index is kept
exactly while its delete trigger exists**. Such an open drops the triggers
(``disable_text_indexes``: a trigger on a table whose module is missing would fail every
delete of a message or a memory), and sends the fills to temporary tables that keep
nothing (``TEXT_SINKS``). The next open by a SQLite with FTS5 finds the triggers missing and
rebuilds each index from the rows, in one transaction per index (``ensure_word_index``,
``ensure_memory_index``, ``ensure_trigram``, ``ensure_tool_index``): what was written
meanwhile is found again. That start takes as long as indexing the whole store does.

Only the process that commits the store does either (``schema.settle_text_indexes``, once
it holds the outbox's lock): a producer, or a start that fails on the lock, whose SQLite
differs from the writer's would otherwise change the indexes under the writer's feet.
"""

from __future__ import annotations

import contextlib
import re
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiosqlite

from .sql import single_statements

# What the trigram index serves: the scripts written without spaces between words, or with
# particles attached (Hangul). Code points, inclusive: Hangul Jamo; CJK radicals, symbols
# and punctuation, kana, Bopomofo, Hangul compatibility Jamo, enclosed and compatibility
# characters, Extension A and the unified ideographs; Hangul Jamo Extended-A; Hangul
# syllables and Jamo Extended-B; compatibility ideographs; vertical forms; half- and
# full-width forms; the kana supplement; the supplementary and tertiary ideographic planes.
# A superset of Hermes Agent 0.19's (``SessionDB._is_cjk_codepoint``).
CJK_RANGES: tuple[tuple[int, int], ...] = (
    (0x1100, 0x11FF), (0x2E80, 0x9FFF), (0xA960, 0xA97F), (0xAC00, 0xD7FF),
    (0xF900, 0xFAFF), (0xFE30, 0xFE4F), (0xFF00, 0xFFEF), (0x1B000, 0x1B16F),
    (0x20000, 0x3FFFF),
)
_CLASS = "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi in CJK_RANGES)
CJK = re.compile(f"[{_CLASS}]")
# The same set as an SQL GLOB (its character classes take code point ranges).
CJK_GLOB = f"'*[{_CLASS}]*'"
# The set as it shows in a turn's record, which is ASCII JSON (``turns.encode_payload``),
# lower-cased: \\uXXXX escapes, a character past U+FFFF as a surrogate pair (its high half
# is matched: D82C for the kana supplement, D840-D8BF for the ideographic planes). May say
# yes for a record without (an escaped backslash before "u4e00", say): the fill's GLOB
# decides which messages go in.
_ESCAPED = re.compile(
    r"\\u(?:11[0-9a-f]{2}|2e[89a-f][0-9a-f]|2f[0-9a-f]{2}|[3-9][0-9a-f]{3}|a9[67][0-9a-f]"
    r"|a[c-f][0-9a-f]{2}|[bc][0-9a-f]{3}|d[0-7][0-9a-f]{2}|f[9a][0-9a-f]{2}|fe[34][0-9a-f]"
    r"|ff[0-9a-e][0-9a-f]|d82c|d8[4-9ab][0-9a-f])")


def has_cjk(text: str) -> bool:
    """Whether ``text`` holds a character of ``CJK_RANGES``."""
    return not text.isascii() and CJK.search(text) is not None


def payload_has_cjk(payload: str) -> bool:
    """Whether a turn's record (ASCII JSON, or text of an earlier version) may hold CJK text:
    never no when it does. ~30 ns for a record without escapes, ~1 µs for one with (Latin
    text with typographic quotes or dashes)."""
    if payload.isascii():
        return "\\" in payload and _ESCAPED.search(payload.lower()) is not None
    return CJK.search(payload) is not None


TRIGRAM_TABLE = """
CREATE VIRTUAL TABLE IF NOT EXISTS messages_trgm USING fts5(
    content, content='messages', content_rowid='id', tokenize='trigram'
);
"""
TRIGRAM_DELETE = """
CREATE TRIGGER IF NOT EXISTS messages_trgm_delete AFTER DELETE ON messages
WHEN EXISTS (SELECT 1 FROM messages_trgm_docsize WHERE id = old.id) BEGIN
    INSERT INTO messages_trgm (messages_trgm, rowid, content)
    VALUES ('delete', old.id, old.content);
END;
"""
TOOL_INDEX = "messages_tools"
TOOLS_TABLE = """
CREATE VIRTUAL TABLE IF NOT EXISTS messages_tools USING fts5(
    tool_text, scope, content='messages', content_rowid='id',
    tokenize='unicode61 remove_diacritics 2'
);
"""
TOOLS_DELETE = """
CREATE TRIGGER IF NOT EXISTS messages_tools_delete AFTER DELETE ON messages
WHEN EXISTS (SELECT 1 FROM messages_tools_docsize WHERE id = old.id) BEGIN
    INSERT INTO messages_tools (messages_tools, rowid, tool_text, scope)
    VALUES ('delete', old.id, old.tool_text, old.scope);
END;
"""
# Without the trigram tokenizer: what the fills insert goes nowhere (the temporary tables
# shadow the names on the writer connection, and the trigger drops each row).
TRIGRAM_SINK = """
CREATE TEMP TABLE IF NOT EXISTS messages_trgm (content TEXT);
CREATE TEMP TABLE IF NOT EXISTS messages_trgm_docsize (id INTEGER PRIMARY KEY, sz BLOB);
CREATE TEMP TRIGGER IF NOT EXISTS messages_trgm_sink BEFORE INSERT ON messages_trgm BEGIN
    SELECT RAISE(IGNORE);
END;
"""

# The word index (every message's text, ranked on the text alone) and the key-value
# memories' index, each with the triggers that keep it (``ensure_word_index``,
# ``ensure_memory_index``). The word index stems its words (see its rebuild, below).
WORD_TOKENIZER = "porter unicode61 remove_diacritics 2"
WORD_TABLE = """
CREATE VIRTUAL TABLE IF NOT EXISTS messages_fts USING fts5(
    content, scope,
    content='messages', content_rowid='id',
    tokenize='""" + WORD_TOKENIZER + """'
);
"""
WORD_VOCAB = """
CREATE VIRTUAL TABLE IF NOT EXISTS messages_vocab USING fts5vocab(messages_fts, 'col');
"""
WORD_DELETE = """
CREATE TRIGGER IF NOT EXISTS messages_fts_delete AFTER DELETE ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content, scope)
    VALUES ('delete', old.id, old.content, old.scope);
END;
"""
MEMORY_TABLE = """
CREATE VIRTUAL TABLE IF NOT EXISTS memories_fts USING fts5(
    key, value, scope,
    content='memories', content_rowid='id',
    tokenize='unicode61 remove_diacritics 2'
);
"""
MEMORY_TRIGGERS = ("""
CREATE TRIGGER IF NOT EXISTS memories_fts_insert AFTER INSERT ON memories BEGIN
    INSERT INTO memories_fts(rowid, key, value, scope)
    VALUES (new.id, new.key, new.value, new.scope);
END;
""", """
CREATE TRIGGER IF NOT EXISTS memories_fts_update AFTER UPDATE ON memories BEGIN
    INSERT INTO memories_fts(memories_fts, rowid, key, value, scope)
    VALUES ('delete', old.id, old.key, old.value, old.scope);
    INSERT INTO memories_fts(rowid, key, value, scope)
    VALUES (new.id, new.key, new.value, new.scope);
END;
""", """
CREATE TRIGGER IF NOT EXISTS memories_fts_delete AFTER DELETE ON memories BEGIN
    INSERT INTO memories_fts(memories_fts, rowid, key, value, scope)
    VALUES ('delete', old.id, old.key, old.value, old.scope);
END;
""")
# Every trigger that writes to a full-text index (the rebuild's two included).
INDEX_TRIGGERS = ("messages_fts_delete", "messages_trgm_delete", "messages_tools_delete",
                  "messages_stem_insert", "messages_stem_delete", "memories_fts_insert",
                  "memories_fts_update", "memories_fts_delete")
# Without FTS5: what the fills of a commit, an import or a replacement insert goes nowhere
# (temporary tables shadow the indexes' names on a writing connection; each row is dropped).
TEXT_SINKS = TRIGRAM_SINK + """
CREATE TEMP TABLE IF NOT EXISTS messages_fts (content TEXT, scope TEXT);
CREATE TEMP TRIGGER IF NOT EXISTS messages_fts_sink BEFORE INSERT ON messages_fts BEGIN
    SELECT RAISE(IGNORE);
END;
CREATE TEMP TABLE IF NOT EXISTS messages_tools (tool_text TEXT, scope TEXT);
CREATE TEMP TRIGGER IF NOT EXISTS messages_tools_sink BEFORE INSERT ON messages_tools BEGIN
    SELECT RAISE(IGNORE);
END;
"""
# A statement that needs the FTS5 module and nothing of the file.
_FTS5_PROBE = "CREATE VIRTUAL TABLE temp.fts5_probe USING fts5(x)"

# The fills, for the messages that hold ``{mine}`` (an SQL condition on ``id``): run in the
# transaction that inserted them, once (a row indexed twice corrupts an external-content
# index). The word index takes every message, the trigram index those with CJK text.
INDEX_WORDS = """
INSERT INTO messages_fts (rowid, content, scope)
SELECT id, content, scope FROM messages WHERE {mine};
"""
INDEX_TRIGRAM = """
INSERT INTO messages_trgm (rowid, content)
SELECT id, content FROM messages WHERE ({mine}) AND content GLOB """ + CJK_GLOB + """;
"""
INDEX_TOOLS = """
INSERT INTO messages_tools (rowid, tool_text, scope)
SELECT id, tool_text, scope FROM messages WHERE ({mine}) AND tool_text IS NOT NULL;
"""
# Both, for a statement that inserts messages outside a batch's turns (an import, a
# replacement of a session's messages): ``INDEX_MESSAGES.format(mine=...)``.
INDEX_MESSAGES = INDEX_WORDS + INDEX_TRIGRAM
# After a batch's session operations whose records hold CJK text: the session's messages
# with CJK text that the trigram index lacks (an operation's statements that inserted them
# did not fill it). Idempotent: what the index holds is left out (its docsize row).
INDEX_SESSION_TRIGRAM = """
INSERT INTO messages_trgm (rowid, content)
SELECT id, content FROM messages AS m WHERE session_id = {session} AND content GLOB """ + \
    CJK_GLOB + """
AND NOT EXISTS (SELECT 1 FROM messages_trgm_docsize AS d WHERE d.id = m.id);
"""


async def ensure_trigram(db: aiosqlite.Connection) -> bool:
    """Make the trigram index if the file has none, and fill it from the stored messages
    (a store from before version 9). True when the index is there and kept; False when
    this SQLite has no trigram tokenizer: fills then go nowhere on ``db`` (``TRIGRAM_SINK``)
    and the search uses LIKE.

    The index is kept exactly while its delete trigger exists: it is made, filled and given
    its trigger in one transaction, so a run cut short leaves none of it. A file last opened
    by a SQLite without the tokenizer has lost the trigger there (its deletes must go on):
    its index is emptied and filled again.

    Raises:
        sqlite3.Error: the file cannot be read or written.
    """
    await db.execute("BEGIN IMMEDIATE")
    try:
        stale = await _exists(db, "table", "messages_trgm")
        if stale and await _exists(db, "trigger", "messages_trgm_delete"):
            # Kept: only whether this SQLite can read it (connecting checks the tokenizer).
            await db.execute("SELECT 1 FROM messages_trgm WHERE rowid = 0")
        else:
            await db.execute("DROP TRIGGER IF EXISTS messages_trgm_delete")
            await db.execute(TRIGRAM_TABLE)
            if stale:
                await db.execute("INSERT INTO messages_trgm (messages_trgm) VALUES ('delete-all')")
            await db.execute(INDEX_TRIGRAM.format(mine="true"))
            await db.execute(TRIGRAM_DELETE)
        await db.execute("COMMIT")
        return True
    except sqlite3.OperationalError as exc:
        await _rollback(db)
        if "no such tokenizer" not in str(exc).lower():
            raise
    except BaseException:
        await _rollback(db)
        raise
    # Deletes must not reach an index this SQLite cannot open: the next open by one that
    # can makes it again (above).
    await db.execute("DROP TRIGGER IF EXISTS messages_trgm_delete")
    await db.executescript(TRIGRAM_SINK)
    return False


async def ensure_tool_index(db: aiosqlite.Connection) -> None:
    """Make the tool index if the file has none, filled from the stored messages with tool
    text (a store from before version 10), with its delete trigger, in one transaction.

    Raises:
        sqlite3.Error: the file cannot be read or written.
    """
    if await _exists(db, "trigger", "messages_tools_delete"):
        return
    async with _immediate(db):
        if await _exists(db, "table", "messages_tools"):  # never without its trigger: anew
            await db.execute("DROP TABLE messages_tools")
        await db.execute(TOOLS_TABLE)
        await db.execute("INSERT INTO messages_tools (messages_tools, rank) "
                         "VALUES ('rank', 'bm25(1.0, 0.0)')")
        await db.execute(INDEX_TOOLS.format(mine="true"))
        await db.execute(TOOLS_DELETE)


async def fts5_available(db: aiosqlite.Connection) -> bool:
    """Whether this SQLite has the FTS5 module: a temporary FTS5 table is made and dropped
    (through a cursor of ``db``'s, as any statement of the store runs). No file change.

    Raises:
        sqlite3.Error: any other failure than a missing module.
    """
    async with db.cursor() as cur:
        try:
            await cur.execute(_FTS5_PROBE)
        except sqlite3.OperationalError as exc:
            if is_missing_fts5(exc):
                return False
            raise
        await cur.execute("DROP TABLE temp.fts5_probe")
    return True


def is_missing_fts5(exc: BaseException) -> bool:
    """Whether SQLite refused a statement because it has no FTS5 module."""
    return "no such module: fts5" in str(exc).lower()


async def text_indexes_kept(db: aiosqlite.Connection) -> bool:
    """Whether the file's word index is kept (its delete trigger exists): False after an
    open by a SQLite without FTS5, until one with it rebuilds the indexes."""
    return await _exists(db, "trigger", "messages_fts_delete")


async def disable_text_indexes(db: aiosqlite.Connection) -> None:
    """For a SQLite without FTS5: drop every trigger that writes to a full-text index, stop
    a rebuild of the word index under way and mark the indexes not kept
    (``text_index_off``), in one transaction, so that writes go on and leave the indexes as
    they are; then send the fills on ``db`` nowhere
    (``TEXT_SINKS``). The indexes' tables stay (dropping one needs the module); the next
    open with FTS5 rebuilds each (``ensure_word_index`` and the others).

    Raises:
        sqlite3.Error: the file cannot be written.
    """
    async with _immediate(db):
        for name in INDEX_TRIGGERS:
            await db.execute(f"DROP TRIGGER IF EXISTS {name}")
        if await _exists(db, "table", "index_rebuild"):
            await db.execute("DELETE FROM index_rebuild WHERE name = 'messages_fts'")
        await db.execute("INSERT INTO text_index_off (since) "
                         "SELECT (julianday('now') - 2440587.5) * 86400.0 "
                         "WHERE NOT EXISTS (SELECT 1 FROM text_index_off)")
    await db.executescript(TEXT_SINKS)


async def ensure_word_index(db: aiosqlite.Connection) -> None:
    """Make the word index if the file has none, or rebuild it from the messages when its
    delete trigger is missing (an open by a SQLite without FTS5 dropped it), with its
    vocabulary and its trigger, in one transaction. Nothing to do when the trigger is
    there. A rebuilt index keeps its tokenizer (``start_word_reindex`` then decides).

    Raises:
        sqlite3.Error: the file cannot be read or written.
    """
    if await _exists(db, "trigger", "messages_fts_delete"):
        return
    async with _immediate(db):
        if not await _exists(db, "table", "messages_fts"):
            await db.execute(WORD_TABLE)
            # Rank on the text column only; the scope column is a filter, not evidence.
            await db.execute("INSERT INTO messages_fts (messages_fts, rank) "
                             "VALUES ('rank', 'bm25(1.0, 0.0)')")
        await db.execute("INSERT INTO messages_fts (messages_fts) VALUES ('rebuild')")
        await db.execute(WORD_VOCAB)
        await db.execute(WORD_DELETE)


async def ensure_memory_index(db: aiosqlite.Connection) -> None:
    """The key-value memories' index, as ``ensure_word_index`` the word index: made, or
    rebuilt from the memories when any of its three triggers is missing.

    Raises:
        sqlite3.Error: the file cannot be read or written.
    """
    async with db.execute("SELECT count(*) FROM sqlite_master WHERE type = 'trigger' AND "
                          "name IN ('memories_fts_insert', 'memories_fts_update', "
                          "'memories_fts_delete')") as cur:
        row = await cur.fetchone()
    if row is not None and row[0] == len(MEMORY_TRIGGERS):
        return
    async with _immediate(db):
        await db.execute(MEMORY_TABLE)
        await db.execute("INSERT INTO memories_fts (memories_fts) VALUES ('rebuild')")
        for trigger in MEMORY_TRIGGERS:
            await db.execute(trigger)


def is_missing_trigram(exc: BaseException) -> bool:
    """Whether SQLite refused the trigram index because it lacks the tokenizer (or, on a
    reader, because the index was never made for that reason)."""
    text = str(exc).lower()
    return "no such tokenizer" in text or "no such table: messages_trgm" in text


async def _exists(db: aiosqlite.Connection, kind: str, name: str) -> bool:
    async with db.execute("SELECT 1 FROM sqlite_master WHERE type = ? AND name = ?",
                          (kind, name)) as cur:
        return await cur.fetchone() is not None


@contextlib.asynccontextmanager
async def _immediate(db: aiosqlite.Connection) -> AsyncIterator[None]:
    """One write transaction on ``db``: committed when the block ends, undone if it
    raises (the error raised is the block's)."""
    await db.execute("BEGIN IMMEDIATE")
    try:
        yield
        await db.execute("COMMIT")
    except BaseException:
        await _rollback(db)
        raise


async def _rollback(db: aiosqlite.Connection) -> None:
    """Undo the open transaction, if one is (the error being raised is the one to see)."""
    with contextlib.suppress(sqlite3.Error, ValueError):
        await db.execute("ROLLBACK")


# -- the word index's tokenizer, and its rebuild -----------------------------------------
#
# The word index stems its words (SQLite's porter over unicode61): "running" and "runs" are
# found by "run", the same folding on both sides (FTS5 stems a query's words with the
# index's tokenizer). A store made before version 12 has an index
# without stemming; it is rebuilt beside the old one, in slices, while the store works:
#   - at open, ``start_word_reindex`` makes the new index (``messages_stem``), a trigger
#     that indexes every message inserted from then on (any connection, any path), one
#     that removes a deleted message it holds, and the plan (``index_rebuild``: the highest
#     message id when it started; everything up to it is for the slices);
#   - ``word_reindex_step`` indexes the next slice of those messages (the writer runs one
#     between batches, so it never waits on the writer's lock and never blocks accept);
#     a message indexed already (an import under an old id) is left out;
#   - the last step swaps the new index in under the old one's name, in one transaction.
# Until then searches read the old index: recall answers as before, never from half an
# index.
REINDEX_SLICE = 2_000
STEM_TABLE = """
CREATE VIRTUAL TABLE IF NOT EXISTS messages_stem USING fts5(
    content, scope, content='messages', content_rowid='id',
    tokenize='""" + WORD_TOKENIZER + """'
);
INSERT INTO messages_stem (messages_stem, rank) VALUES ('rank', 'bm25(1.0, 0.0)');
CREATE TABLE IF NOT EXISTS index_rebuild (
    name TEXT PRIMARY KEY,
    upto INTEGER NOT NULL,  -- the messages up to this id are the slices' (the rest: trigger)
    done INTEGER NOT NULL,  -- indexed up to this id
    total INTEGER NOT NULL, -- messages to index at the start, for progress
    indexed INTEGER NOT NULL DEFAULT 0,
    started_at REAL NOT NULL
);
CREATE TRIGGER IF NOT EXISTS messages_stem_insert AFTER INSERT ON messages BEGIN
    INSERT INTO messages_stem (rowid, content, scope) VALUES (new.id, new.content, new.scope);
END;
CREATE TRIGGER IF NOT EXISTS messages_stem_delete AFTER DELETE ON messages
WHEN EXISTS (SELECT 1 FROM messages_stem_docsize WHERE id = old.id) BEGIN
    INSERT INTO messages_stem (messages_stem, rowid, content, scope)
    VALUES ('delete', old.id, old.content, old.scope);
END;
"""
# The old index goes, the new one takes its name, its vocabulary and its delete trigger.
WORD_INDEX_SWAP = """
DROP TRIGGER IF EXISTS messages_stem_insert;
DROP TRIGGER IF EXISTS messages_stem_delete;
DROP TRIGGER IF EXISTS messages_fts_delete;
DROP TABLE IF EXISTS messages_vocab;
DROP TABLE IF EXISTS messages_fts;
ALTER TABLE messages_stem RENAME TO messages_fts;
CREATE VIRTUAL TABLE messages_vocab USING fts5vocab(messages_fts, 'col');
CREATE TRIGGER messages_fts_delete AFTER DELETE ON messages BEGIN
    INSERT INTO messages_fts(messages_fts, rowid, content, scope)
    VALUES ('delete', old.id, old.content, old.scope);
END;
DELETE FROM index_rebuild WHERE name = 'messages_fts';
"""


@dataclass(frozen=True, slots=True)
class Reindex:
    """A rebuild of the word index under way: messages indexed of those at its start."""

    indexed: int
    total: int
    started_at: float

    @property
    def fraction(self) -> float:
        return min(1.0, self.indexed / self.total) if self.total else 1.0


async def word_index_stems(db: aiosqlite.Connection) -> bool:
    """Whether the word index the searches read (``messages_fts``) stems its words."""
    async with db.execute("SELECT sql FROM sqlite_master WHERE type = 'table' "
                          "AND name = 'messages_fts'") as cur:
        row = await cur.fetchone()
    return row is not None and "porter" in str(row[0]).lower()


async def start_word_reindex(db: aiosqlite.Connection, now: float) -> None:
    """A store whose word index does not stem (made before version 12): begin its rebuild,
    in one transaction (see above). Nothing to do when it stems or a rebuild is under way."""
    if await word_index_stems(db) or await word_reindex_state(db) is not None:
        return
    async with _immediate(db):
        await db.execute("DROP TABLE IF EXISTS messages_stem")  # a start cut short: anew
        for statement in single_statements(STEM_TABLE):
            await db.execute(statement)
        await db.execute(
            "INSERT INTO index_rebuild (name, upto, done, total, started_at) "
            "SELECT 'messages_fts', coalesce(max(id), 0), 0, count(*), ? FROM messages",
            (now,))


async def word_reindex_state(db: aiosqlite.Connection) -> Reindex | None:
    """The rebuild under way, or None."""
    if not await _exists(db, "table", "index_rebuild"):
        return None
    async with db.execute("SELECT indexed, total, started_at FROM index_rebuild "
                          "WHERE name = 'messages_fts'") as cur:
        row = await cur.fetchone()
    return None if row is None else Reindex(int(row[0]), int(row[1]), float(row[2]))


async def word_reindex_step(db: aiosqlite.Connection, slice_rows: int | None = None
                            ) -> Reindex | None:
    """Index the next slice of the messages the rebuild has left, in one transaction; the
    last one swaps the new index in. Returns the rebuild's progress, None once it is done.
    Run on the writer's connection, between its batches. ``slice_rows``: REINDEX_SLICE."""
    slice_rows = REINDEX_SLICE if slice_rows is None else slice_rows
    await db.execute("BEGIN IMMEDIATE")
    try:
        async with db.execute("SELECT upto, done FROM index_rebuild "
                              "WHERE name = 'messages_fts'") as cur:
            row = await cur.fetchone()
        if row is None:
            await db.execute("COMMIT")
            return None
        upto, done = int(row[0]), int(row[1])
        async with db.execute(
                "SELECT max(id), count(*) FROM (SELECT id FROM messages WHERE id > ? "
                "AND id <= ? ORDER BY id LIMIT ?)", (done, upto, slice_rows)) as cur:
            last, n = await cur.fetchone()  # type: ignore[misc]
        if not n:
            for statement in single_statements(WORD_INDEX_SWAP):
                await db.execute(statement)
            await db.execute("COMMIT")
            return None
        await db.execute(
            "INSERT INTO messages_stem (rowid, content, scope) "
            "SELECT id, content, scope FROM messages AS m WHERE id > ? AND id <= ? "
            "AND NOT EXISTS (SELECT 1 FROM messages_stem_docsize AS d WHERE d.id = m.id)",
            (done, int(last)))
        await db.execute("UPDATE index_rebuild SET done = ?, indexed = indexed + ? "
                         "WHERE name = 'messages_fts'", (int(last), int(n)))
        async with db.execute("SELECT indexed, total, started_at FROM index_rebuild "
                              "WHERE name = 'messages_fts'") as cur:
            state = await cur.fetchone()
        await db.execute("COMMIT")
    except BaseException:
        await _rollback(db)
        raise
    assert state is not None
    return Reindex(int(state[0]), int(state[1]), float(state[2]))

