"""The long-lived worker process: ``python -m workers`` or ``hermes-memory worker``.

It opens a :class:`~hermes_async_memory.MemoryPipeline` on the store file, commits whatever an
earlier run left in the outbox, and runs until SIGTERM or SIGINT, then drains within the
shutdown deadline. See :mod:`workers.main`.
"""
