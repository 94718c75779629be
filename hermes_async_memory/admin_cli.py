"""``hermes-memory status | search | sessions | dead-letters``: look into a memory file."""

from __future__ import annotations

import argparse
from typing import Any


def register(commands: Any) -> None:
    """Add this module's subcommands to ``commands`` (argparse sub-parsers)."""
    del commands  # the subcommands land here (issue 3)


__all__ = ["argparse", "register"]
