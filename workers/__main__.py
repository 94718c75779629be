"""``python -m workers``: run the worker process."""

from __future__ import annotations

from workers.main import main

raise SystemExit(main())
