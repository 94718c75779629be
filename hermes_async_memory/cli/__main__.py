"""``python -m hermes_async_memory.cli``: the ``hermes-memory`` command."""

from __future__ import annotations

from . import main

raise SystemExit(main())
