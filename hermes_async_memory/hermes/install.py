"""``hermes-memory hermes install``: write the plugin folder Hermes Agent loads."""

from __future__ import annotations

from typing import Any


def register(commands: Any) -> None:
    """Add ``hermes`` to ``commands`` (argparse sub-parsers)."""
    del commands  # the subcommand lands here (issue 3)
