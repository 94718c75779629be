"""Seed 000's own backend tests (``test_seed000_backends``), run against this library through
a shim (``shim``) that ``conftest`` registers as ``agent.memory*`` for these tests only."""
