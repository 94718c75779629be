"""User text into a safe, scoped FTS5 ``MATCH`` for the session search.

Two syntaxes, chosen by the caller:

- ``"plain"`` (the default): the text is data. Its words are quoted one by one and ANDed,
  so a message matches when it holds every word; ``"``, ``*``, ``AND``, ``NEAR(``, ``-`` and
  ``:`` are searched for as words, or dropped as punctuation. Words joined by a hyphen, a
  dot or an underscore (``full-text``, ``state-of-the-art``, ``P2.2``, ``sp_new``) are one
  word: the phrase of their pieces, found and marked as one.
- ``"fts5"``: FTS5's query syntax, minus column filters. The text is parsed here and written
  out again from its parse tree, every phrase quoted: phrases ``"..."``, prefixes ``word*``,
  ``AND``, ``OR``, ``NOT`` (binary, as in FTS5), ``NEAR(a b, N)``, ``^`` (first token),
  ``a + b`` (phrase concatenation) and parentheses. SQLite never sees the user's text
  outside a quoted phrase, so nothing in it can reach the ``scope`` column that keeps each
  user's rows apart: the expression always runs as ``scope:"<token>" AND content:(<expr>)``.
  A bare word with a hyphen or a dot inside (``full-text``, ``P2.2``) is a phrase, as if
  quoted (FTS5 itself refuses it).

Both read the same way as the FTS5 parser: operators are upper case (``and`` is a word),
``NOT`` binds tighter than ``AND``, ``AND`` tighter than ``OR``, and words side by side are
ANDed tighter than all three (``a b OR c`` is ``(a AND b) OR c``).

A query holding CJK text (``store.text_index.CJK_RANGES``) is searched as substrings instead
(``text_query``): the word index keeps a run of such text as one word, so 大别山 would not
be found in 大别山项目计划书. Each word or phrase is a string the message must hold (case
aside); the operators keep their meaning; ``NEAR(...)`` is the AND of its phrases and a
prefix ``*`` adds nothing (a substring may go on).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, TypeAlias

from ..errors import InvalidTurnError
from ..recall.query import MAX_QUERY_CHARS, fold, quote
from ..store.sessions import Substring, SubstringOp, TextQuery
from ..store.text_index import has_cjk

Syntax = Literal["plain", "fts5"]
SYNTAXES: tuple[str, ...] = ("plain", "fts5")
# Plain text: at most this many distinct words are searched for (the longest, which are the
# rarest-looking); the rest are dropped, which can only widen the result.
PLAIN_MAX_TERMS = 32
# FTS5 syntax: bounds that keep a hostile query from costing more than a long honest one.
FTS5_MAX_PHRASES = 64
FTS5_MAX_DEPTH = 16  # parentheses (and NEAR groups) nested
MAX_NEAR_DISTANCE = 10_000
_OPERATORS = ("AND", "OR", "NOT")
# A plain word: letters and digits, pieces joined by a hyphen (ASCII, U+2010, U+2011), a dot
# or an underscore kept together (the word index splits them; quoted, they are a phrase).
_PLAIN_WORD = re.compile(r"[^\W_]+(?:[-\u2010\u2011._][^\W_]+)*")
# FTS5 syntax: what joins two word characters into one bare word.
_WORD_JOINERS = "-."


class InvalidSearchError(InvalidTurnError):
    """A search or a listing was refused before it ran: the message says which argument is
    wrong and why (for FTS5 syntax, at which character). Nothing was read.

    A subclass of ``InvalidTurnError`` (and so of ``ValueError``), as every refused argument
    of this library is: one ``except InvalidTurnError`` catches them all.
    """


# -- the parse tree --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Part:
    """One quoted string or bare word; ``prefix``: it ended with ``*``."""

    text: str
    prefix: bool


@dataclass(frozen=True, slots=True)
class Phrase:
    """Parts joined by ``+`` (one phrase); ``initial``: it must start the text (``^``)."""

    parts: tuple[Part, ...]
    initial: bool = False


@dataclass(frozen=True, slots=True)
class Near:
    phrases: tuple[Phrase, ...]
    distance: int | None


@dataclass(frozen=True, slots=True)
class Binary:
    op: str  # "AND", "OR" or "NOT"
    left: Node
    right: Node


Node: TypeAlias = Phrase | Near | Binary


def render(node: Node) -> str:
    """``node`` as FTS5 query text: every phrase quoted, every operand that is itself an
    operator in parentheses, so the text reads back as exactly this tree."""
    if isinstance(node, Phrase):
        text = " + ".join(quote(p.text) + ("*" if p.prefix else "") for p in node.parts)
        return "^" + text if node.initial else text
    if isinstance(node, Near):
        inner = " ".join(render(p) for p in node.phrases)
        return f"NEAR({inner})" if node.distance is None else f"NEAR({inner}, {node.distance})"
    # A chain of one operator is written flat ("a AND b AND c", all three left-associative
    # in FTS5), not nested a level per operand: FTS5's parser has a bounded stack.
    return f" {node.op} ".join(
        render(x) if not isinstance(x, Binary) else f"({render(x)})" for x in _chain(node))


def _chain(node: Binary) -> list[Node]:
    """The operands of the run of ``node.op`` that ``node`` heads, left to right."""
    if node.op == "NOT":  # left-associative only: "a NOT b NOT c" is "(a NOT b) NOT c"
        rights: list[Node] = []
        x: Node = node
        while isinstance(x, Binary) and x.op == "NOT":
            rights.append(x.right)
            x = x.left
        return [x, *reversed(rights)]
    out: list[Node] = []
    stack: list[Node] = [node]
    while stack:  # AND and OR are associative: both sides flatten
        x = stack.pop()
        if isinstance(x, Binary) and x.op == node.op:
            stack.append(x.right)
            stack.append(x.left)
        else:
            out.append(x)
    return out


# -- tokens ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Token:
    kind: str  # WORD, STRING, AND, OR, NOT, NEAR, LP, RP, STAR, PLUS, CARET, COMMA, END
    text: str
    pos: int


def _bareword_char(c: str) -> bool:
    """As FTS5: ASCII letters and digits, ``_``, U+001A and every non-ASCII character."""
    return c.isalnum() or c == "_" or c == "\x1a" or ord(c) >= 0x80


_PUNCT = {"(": "LP", ")": "RP", "*": "STAR", "+": "PLUS", "^": "CARET", ",": "COMMA"}


def _tokens(text: str) -> list[_Token]:
    """The FTS5 tokens of ``text``.

    Raises:
        InvalidSearchError: an unclosed quote, a column filter, or a character FTS5 has no
            use for outside quotes.
    """
    out: list[_Token] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif c == '"':
            start, i, chars = i, i + 1, []
            while True:
                end = text.find('"', i)
                if end < 0:
                    raise InvalidSearchError(
                        f"unbalanced double quote: the phrase opened at position {start} is "
                        "never closed (write a double quote inside a phrase as \"\")")
                chars.append(text[i:end])
                if text.startswith('"', end + 1):  # "" is a quote inside the phrase
                    chars.append('"')
                    i = end + 2
                    continue
                i = end + 1
                break
            out.append(_Token("STRING", "".join(chars), start))
            if i < n and text[i] == ":":
                raise _column_filter(text[start:i], start)
        elif c in _PUNCT:
            out.append(_Token(_PUNCT[c], c, i))
            i += 1
        elif _bareword_char(c):
            start = i
            while i < n and _bareword_char(text[i]) and not text[i].isspace():
                i += 1
                if (i + 1 < n and text[i] in _WORD_JOINERS and _bareword_char(text[i + 1])
                        and not text[i + 1].isspace()):
                    i += 1  # full-text, P2.2: one word (FTS5 would refuse it bare)
            word = text[start:i]
            if i < n and text[i] == ":":
                raise _column_filter(word, start)
            kind = word if word in _OPERATORS else "WORD"
            if word == "NEAR" and text[i:].lstrip().startswith("("):
                kind = "NEAR"
            out.append(_Token(kind, word, start))
        elif c == ":":
            raise InvalidSearchError(
                f"':' at position {i}: column filters are not allowed (the search runs over "
                "the message text); put a word holding ':' in double quotes")
        elif c in "{}":
            raise InvalidSearchError(
                f"{c!r} at position {i}: column filters ({{col ...}}:) are not allowed (the "
                "search runs over the message text)")
        elif c == "-":
            raise InvalidSearchError(
                f"'-' at position {i}: FTS5 has no '-' operator outside column filters; to "
                "leave out a word write 'a NOT b', or put a word holding '-' in double quotes")
        else:
            raise InvalidSearchError(
                f"unexpected character {c!r} at position {i}: outside double quotes FTS5 "
                "syntax allows words, \"phrases\", * + ^ ( ) , and AND OR NOT NEAR; put text "
                "holding punctuation in double quotes")
    out.append(_Token("END", "", n))
    return out


def _column_filter(name: str, pos: int) -> InvalidSearchError:
    return InvalidSearchError(
        f"column filter '{name}:' at position {pos} is not allowed (the search runs over the "
        "message text); put a word holding ':' in double quotes")


# -- the parser --------------------------------------------------------------------------


class _Parser:
    """Recursive descent over FTS5's grammar (see the module docstring for precedence)."""

    def __init__(self, tokens: list[_Token]) -> None:
        self.tokens = tokens
        self.i = 0
        self.depth = 0
        self.phrases = 0

    @property
    def tok(self) -> _Token:
        return self.tokens[self.i]

    def take(self) -> _Token:
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def parse(self) -> Node:
        node = self.or_expr()
        tok = self.tok
        if tok.kind == "RP":
            raise InvalidSearchError(
                f"unbalanced parenthesis: ')' at position {tok.pos} closes nothing")
        if tok.kind != "END":  # nothing else can follow a whole expression
            raise self.unexpected(tok)
        return node

    def or_expr(self) -> Node:
        node = self.and_expr()
        while self.tok.kind == "OR":
            op = self.take()
            node = Binary("OR", node, self.and_expr_after(op))
        return node

    def and_expr(self) -> Node:
        node = self.not_expr()
        while self.tok.kind == "AND":
            op = self.take()
            node = Binary("AND", node, self.not_expr_after(op))
        return node

    def and_expr_after(self, op: _Token) -> Node:
        self.need_operand(op)
        return self.and_expr()

    def not_expr(self) -> Node:
        node = self.sequence()
        while self.tok.kind == "NOT":
            op = self.take()
            self.need_operand(op)
            node = Binary("NOT", node, self.sequence())
        return node

    def not_expr_after(self, op: _Token) -> Node:
        self.need_operand(op)
        return self.not_expr()

    def need_operand(self, op: _Token) -> None:
        """Raises InvalidSearchError when nothing that starts a term follows ``op``."""
        if self.tok.kind in ("END", "RP", "AND", "OR", "NOT", "COMMA"):
            where = "at the end" if self.tok.kind == "END" else (
                f"(found {self.tok.text!r} at position {self.tok.pos})")
            raise InvalidSearchError(
                f"{op.text!r} at position {op.pos} needs a term after it {where}")

    def sequence(self) -> Node:
        """Terms side by side: ANDed, tighter than any operator."""
        node = self.primary()
        while self.tok.kind in ("WORD", "STRING", "NEAR", "LP", "CARET"):
            node = Binary("AND", node, self.primary())
        return node

    def primary(self) -> Node:
        tok = self.tok
        if tok.kind == "LP":
            self.take()
            self.enter(tok)
            if self.tok.kind == "END":
                raise InvalidSearchError(
                    f"unbalanced parenthesis: '(' at position {tok.pos} is never closed")
            if self.tok.kind == "RP":
                raise InvalidSearchError(f"empty parentheses at position {tok.pos}")
            node = self.or_expr()
            if self.tok.kind != "RP":
                raise InvalidSearchError(
                    f"unbalanced parenthesis: '(' at position {tok.pos} is never closed"
                    if self.tok.kind == "END" else
                    f"expected ')' to close '(' at position {tok.pos}, found "
                    f"{self.tok.text!r} at position {self.tok.pos}")
            self.take()
            self.depth -= 1
            return node
        if tok.kind == "NEAR":
            return self.near()
        if tok.kind == "CARET":
            self.take()
            if self.tok.kind not in ("WORD", "STRING"):
                raise InvalidSearchError(
                    f"'^' at position {tok.pos} must be followed by a word or a phrase")
            return Phrase(self.phrase().parts, initial=True)
        if tok.kind in ("WORD", "STRING"):
            return self.phrase()
        if tok.kind in _OPERATORS:
            if tok.kind == "NOT" and self.i == 0:
                raise InvalidSearchError(
                    "'NOT' at position 0 needs a term before it: FTS5's NOT is binary "
                    "('a NOT b': a without b)")
            raise InvalidSearchError(f"{tok.text!r} at position {tok.pos} needs a term before it")
        if tok.kind == "END":
            raise InvalidSearchError("the query ends where a term was expected")
        raise self.unexpected(tok)

    def phrase(self) -> Phrase:
        parts = [self.part()]
        while self.tok.kind == "PLUS":
            plus = self.take()
            if self.tok.kind not in ("WORD", "STRING"):
                raise InvalidSearchError(
                    f"'+' at position {plus.pos} must be followed by a word or a phrase")
            parts.append(self.part())
        return Phrase(tuple(parts))

    def part(self) -> Part:
        tok = self.take()
        self.phrases += 1
        if self.phrases > FTS5_MAX_PHRASES:
            raise InvalidSearchError(
                f"too many words or phrases (more than {FTS5_MAX_PHRASES}; the one at "
                f"position {tok.pos} is one too many)")
        prefix = self.tok.kind == "STAR"
        if prefix:
            self.take()
        return Part(tok.text, prefix)

    def near(self) -> Near:
        near = self.take()
        self.enter(near)
        self.take()  # its "(", checked by the tokenizer
        phrases: list[Phrase] = []
        while self.tok.kind in ("WORD", "STRING"):
            phrases.append(self.phrase())
        if not phrases:
            raise InvalidSearchError(
                f"NEAR( at position {near.pos} needs words or phrases, as in "
                "NEAR(a b) or NEAR(a b, 5)")
        distance = None
        if self.tok.kind == "COMMA":
            comma = self.take()
            num = self.tok
            if num.kind != "WORD" or not (num.text.isascii() and num.text.isdigit()):
                raise InvalidSearchError(
                    f"NEAR's distance after ',' at position {comma.pos} must be a number, "
                    f"found {num.text or 'the end'!r}")
            self.take()
            distance = int(num.text)
            if distance > MAX_NEAR_DISTANCE:
                raise InvalidSearchError(
                    f"NEAR's distance {distance} at position {num.pos} is above "
                    f"{MAX_NEAR_DISTANCE}")
        if self.tok.kind != "RP":
            raise InvalidSearchError(
                f"NEAR( at position {near.pos} is never closed" if self.tok.kind == "END" else
                f"NEAR( at position {near.pos} holds {self.tok.text!r} at position "
                f"{self.tok.pos}: only words, phrases and ', N' belong inside")
        self.take()
        self.depth -= 1
        return Near(tuple(phrases), distance)

    def enter(self, tok: _Token) -> None:
        self.depth += 1
        if self.depth > FTS5_MAX_DEPTH:
            raise InvalidSearchError(
                f"the query nests deeper than {FTS5_MAX_DEPTH} levels (at position {tok.pos})")

    @staticmethod
    def unexpected(tok: _Token) -> InvalidSearchError:
        if tok.kind == "STAR":
            return InvalidSearchError(
                f"'*' at position {tok.pos} must follow a word (a prefix search: deploy*)")
        if tok.kind == "RP":
            return InvalidSearchError(
                f"unbalanced parenthesis: ')' at position {tok.pos} closes nothing")
        if tok.kind == "PLUS":
            return InvalidSearchError(
                f"'+' at position {tok.pos} must join two words or phrases (a + b)")
        if tok.kind == "COMMA":
            return InvalidSearchError(
                f"',' at position {tok.pos} belongs only inside NEAR(a b, N)")
        return InvalidSearchError(f"unexpected {tok.text!r} at position {tok.pos}")


def parse_fts5(text: str) -> Node | None:
    """The parse tree of an FTS5 query, or None when it holds no term (blank text).

    Raises:
        InvalidSearchError: the query is malformed, uses a column filter, is longer than
            ``MAX_QUERY_CHARS`` or past the bounds above; the message says where.
    """
    if len(text) > MAX_QUERY_CHARS:
        raise InvalidSearchError(
            f"the query is {len(text)} characters long; at most {MAX_QUERY_CHARS}")
    nul = text.find("\x00")
    if nul >= 0:
        raise InvalidSearchError(f"a NUL character at position {nul}")
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidSearchError(
                f"a lone surrogate at position {exc.start} (not text: no message holds one)"
            ) from None
    tokens = _tokens(text)
    if len(tokens) == 1:
        return None
    return _Parser(tokens).parse()


# -- the MATCH ---------------------------------------------------------------------------


def content_expression(query: str, syntax: str = "plain") -> str | None:
    """What to search the message text for, as FTS5 query text, or None when ``query``
    holds nothing to search for (blank, or punctuation only in plain text).

    Raises:
        InvalidSearchError: ``query`` is not a string, ``syntax`` is not one of
            ``SYNTAXES``, or (``"fts5"``) the query is malformed.
    """
    if not isinstance(query, str):
        raise InvalidSearchError(f"query must be a string, got {type(query).__name__}")
    if syntax == "plain":
        terms = plain_terms(query)
        return " AND ".join(quote(t) for t in terms) if terms else None
    if syntax == "fts5":
        node = parse_fts5(query)
        return None if node is None else render(node)
    raise InvalidSearchError(
        f"syntax must be one of {', '.join(map(repr, SYNTAXES))}, got {syntax!r:.40}")


def plain_terms(query: str) -> list[str]:
    """The distinct words of plain text (``_PLAIN_WORD``; case and accents aside), longest
    first (the rarest-looking), at most ``PLAIN_MAX_TERMS``; as written."""
    seen: dict[str, str] = {}
    for word in _PLAIN_WORD.findall(query[:MAX_QUERY_CHARS]):
        seen.setdefault(fold(word), word)
    return sorted(seen.values(), key=len, reverse=True)[:PLAIN_MAX_TERMS]


def text_query(query: str, syntax: str = "plain") -> TextQuery | None:
    """What to search the message text for as substrings, when ``query`` holds CJK text
    (see the module doc); None when it holds none (the word index serves it) or nothing to
    search for. Call it after ``content_expression``, which checks the query.

    Raises:
        InvalidSearchError: as ``content_expression``.
    """
    if syntax == "plain":
        terms = plain_terms(query)
        if not any(has_cjk(t) for t in terms):
            return None
        node: TextQuery = Substring(terms[0])
        for term in terms[1:]:
            node = SubstringOp("AND", node, Substring(term))
        return node
    tree = parse_fts5(query) if syntax == "fts5" else None
    if tree is None or not any(has_cjk(p.text) for p in _parts(tree)):
        return None
    return _substrings(tree)


def _parts(node: Node) -> list[Part]:
    if isinstance(node, Phrase):
        return list(node.parts)
    if isinstance(node, Near):
        return [p for phrase in node.phrases for p in phrase.parts]
    return _parts(node.left) + _parts(node.right)


def _substrings(node: Node) -> TextQuery:
    """``node`` as substrings: a phrase is its parts' text run together (a space between
    two that are not CJK where they meet), NEAR the AND of its phrases."""
    if isinstance(node, Phrase):
        text = ""
        for part in node.parts:
            if text and part.text and not (has_cjk(text[-1]) or has_cjk(part.text[0])):
                text += " "
            text += part.text
        return Substring(text, node.initial)
    if isinstance(node, Near):
        out: TextQuery = _substrings(node.phrases[0])
        for phrase in node.phrases[1:]:
            out = SubstringOp("AND", out, _substrings(phrase))
        return out
    return SubstringOp(node.op, _substrings(node.left), _substrings(node.right))


def scoped_match(expression: str, scope_tokens: Sequence[str], column: str = "content"
                 ) -> str:
    """``scope:"t1" AND scope:"t2" AND content:(expression)``: the expression can only
    match message text (or, ``column="tool_text"``, the tool index's tool text), and only
    in rows holding every scope token (none: every row)."""
    scoped = [f"scope:{quote(t)}" for t in scope_tokens]
    return " AND ".join([*scoped, f"{column}:({expression})"])


def is_fts5_syntax_error(exc: BaseException) -> bool:
    """Whether SQLite refused a MATCH expression (``fts5: syntax error near ...``), as
    opposed to failing to read."""
    return "fts5:" in str(exc) or "unknown special query" in str(exc)


__all__ = ["SYNTAXES", "InvalidSearchError", "Syntax", "content_expression", "parse_fts5",
           "plain_terms", "render", "scoped_match", "text_query"]
