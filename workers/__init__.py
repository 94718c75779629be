"""``python -m workers`` from a checkout: the worker process's entry point.

Everything it runs lives in the library (``hermes_async_memory.worker``); this folder only
starts it, and is not installed with the package.
"""
