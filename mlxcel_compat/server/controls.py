"""Completions that can be acted on while they run: their ids (``chatcmpl-...``, as streamed back)
and the engine tasks behind them, for ``POST /v1/chat/completions/control``.

A streamed chat completion registers itself for as long as its stream runs; the control route
finds its tasks by the id the client saw. Touched on the event loop only.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

from mlxcel_compat.engine.request import GenerationRequest


class RunningCompletions:
    """``completion id -> its requests`` while their stream runs."""

    def __init__(self) -> None:
        self.running: dict[str, Sequence[GenerationRequest]] = {}

    @contextlib.contextmanager
    def register(self, completion_id: str, requests: Sequence[GenerationRequest]) -> Iterator[None]:
        self.running[completion_id] = requests
        try:
            yield
        finally:
            self.running.pop(completion_id, None)

    def get(self, completion_id: str) -> Sequence[GenerationRequest] | None:
        return self.running.get(completion_id)
