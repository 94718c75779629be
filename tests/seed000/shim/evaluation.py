"""Seed 000's ``agent.memory.evaluation``: the library's evaluation, under the seed's names."""

from __future__ import annotations

from typing import Any

from hermes_async_memory import Settings
from hermes_async_memory.memory.evaluation import Evaluation, evaluate_scratch_blocking

from . import MemoryBackend


class BackendEvaluation:
    """The seed's names for the fields of the library's ``Evaluation`` (the rest read
    through as they are)."""

    def __init__(self, evaluation: Evaluation) -> None:
        self.evaluation = evaluation

    @property
    def backend_name(self) -> str:
        return self.evaluation.backend

    @property
    def store_success(self) -> bool:
        return self._passed("store")

    @property
    def retrieve_success(self) -> bool:
        return self._passed("retrieve")

    @property
    def query_returns_results(self) -> bool:
        return self._passed("query")

    @property
    def data_location(self) -> str:
        return self.evaluation.location

    @property
    def requires_api_key(self) -> bool:
        return self.evaluation.key_required

    @property
    def recommendation(self) -> str:
        return self.evaluation.label

    def _passed(self, check: str) -> bool:
        return bool(self.evaluation.checks.get(check, {}).get("passed"))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.evaluation, name)


def evaluate_backend(backend: MemoryBackend) -> BackendEvaluation:
    return BackendEvaluation(backend.memory.evaluate())


def evaluate_backends() -> dict[str, Any]:
    return evaluate_scratch_blocking(Settings.from_env())
