"""Hermes Agent integration: the MemoryProvider and its plugin folder."""
