"""Hooks a pipeline calls as it works, for a host that records metrics (histograms, alerts).

Counters and queue depths need no hook: ``MemoryPipeline.stats()`` has them. These methods
carry what a snapshot cannot: the distribution of each batch's size and commit time, and of
each recall's time. The pipeline calls them on its event-loop thread, once per batch or
recall, so an implementation must return quickly, must not block, and must not raise.
"""

from __future__ import annotations


class PipelineObserver:
    """Receives the pipeline's per-batch and per-recall events; every method here is a no-op.

    Subclass it and override what you record. The pipeline uses this class itself when it is
    given no observer.
    """

    def batch_committed(self, turns: int, rows: int, seconds: float) -> None:
        """A batch of ``turns`` turns (``rows`` messages) was committed in one transaction;
        ``seconds`` from building the batch to its commit, retries included."""

    def recall_done(self, seconds: float, ok: bool) -> None:
        """A recall ran for ``seconds``; ``ok`` is False when it failed (a recall error)."""

    def commit_retried(self) -> None:
        """The store was busy, locked or failing, and a write to it is retried."""
