"""``python -m workers``: run the worker process (``hermes-memory worker`` does the same)."""

from __future__ import annotations

from hermes_async_memory.worker.main import main

raise SystemExit(main())
