"""Hermes Agent integration: the MemoryProvider and its plugin folder.

    provider.py   HermesMemoryProvider: hermes-agent 0.19's MemoryProvider contract
    runtime.py    the pipeline on its own event-loop thread, shared per store file; exit hook
    config.py     HERMES_HOME, the provider's config file, Settings resolution
    plugin.py     register(ctx), what the installed plugin folder imports
    install.py    ``hermes-memory hermes install``

Nothing here is imported by ``import hermes_async_memory``; ``HermesMemoryProvider`` is
exported lazily.
"""
