"""The one parser of settings from environment variables: ``PREFIX_FIELD`` into a frozen
dataclass's fields, by each field's type.

``Settings``, ``HonchoConfig``, the Hermes provider's config file and the worker's own options
all read through it, so a value reads the same wherever it is set, and a bad one is a
``ConfigurationError`` naming the variable. Only the edge (the CLI, the worker entry point,
the Hermes provider) hands it the process environment; the library is given mappings.

Types: ``int`` (``1_000`` too), ``float`` (finite), ``bool`` (1/0, true/false, yes/no,
on/off), ``str``, ``Path``, a ``Literal`` of strings (checked against its choices), and
``X | None`` of those (an empty value is None). A field whose metadata holds ``PARSE`` is
read by that function instead (a ``ValueError`` from it names the variable).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any, Literal

from .errors import ConfigurationError

# Field metadata key: a function from the variable's text to the field's value.
PARSE = "parse_env"

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def read_env(cls: type[Any], environ: Mapping[str, str], prefix: str, *,
             skip: Collection[str] = (), upper: bool = True) -> dict[str, object]:
    """The fields of dataclass ``cls`` set in ``environ`` as ``prefix + FIELD_NAME``, parsed
    by their types; fields not set (and those in ``skip``) are left out, so the dataclass's
    defaults apply. With ``upper=False`` the names keep the fields' case (``prefix +
    field_name``): the keys of a config file, read the same way.

    Raises:
        ConfigurationError: a variable does not parse as its field's type.
        TypeError: a field has a type this parser does not know (a bug, not a bad value).
    """
    hints = typing.get_type_hints(cls)
    values: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        var = prefix + (f.name.upper() if upper else f.name)
        raw = environ.get(var)
        if raw is None:
            continue
        parse = f.metadata.get(PARSE)
        # A secret's value never goes into an error message.
        shown = "the value" if not f.repr else repr(raw)
        values[f.name] = parse_value(var, hints[f.name], raw, parse=parse, shown=shown)
    return values


def parse_value(var: str, kind: Any, raw: str, *,
                parse: Callable[[str], object] | None = None, shown: str | None = None
                ) -> object:
    """``raw`` (the text of variable ``var``) as a value of type ``kind``.

    Raises:
        ConfigurationError: it does not parse.
        TypeError: ``kind`` is not a type this parser knows.
    """
    shown = repr(raw) if shown is None else shown
    kind, optional = _unwrap_optional(kind)
    if optional and raw.strip() == "":
        return None
    if parse is not None:
        try:
            return parse(raw)
        except ValueError as exc:
            raise ConfigurationError(f"{var}: {exc}") from None
    text = raw.strip()
    if kind is bool:
        lowered = text.lower()
        if lowered in _TRUE or lowered in _FALSE:
            return lowered in _TRUE
        raise ConfigurationError(f"{var}={shown} is not a boolean (true/false, 1/0, yes/no, "
                                 "on/off)")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigurationError(f"{var}={shown} is not an integer") from None
    if kind is float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value):
            raise ConfigurationError(f"{var}={shown} is not a finite number")
        return value
    if kind is str:
        return raw
    if kind is Path:
        if not text:
            raise ConfigurationError(f"{var} is empty: it must name a path")
        return Path(raw)
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        if raw in choices:
            return raw
        raise ConfigurationError(
            f"{var} must be one of {', '.join(map(str, choices))}, got {shown}")
    raise TypeError(f"{var}: no parser for fields of type {kind!r}")


def _unwrap_optional(kind: Any) -> tuple[Any, bool]:
    """(X, True) for ``X | None``; (kind, False) otherwise."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        args = typing.get_args(kind)
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1 and len(args) == 2:
            return rest[0], True
    return kind, False
