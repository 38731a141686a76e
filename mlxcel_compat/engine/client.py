"""The asyncio side of the engine: submit a request, iterate over its events.

The engine thread pushes events with ``loop.call_soon_threadsafe`` into a per-request
``asyncio.Queue``; nothing here blocks the event loop. Leaving the iteration early (the client
went away, the handler was cancelled) cancels the sequence at the engine's next step.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable

from mlxcel_compat.engine.core import Engine
from mlxcel_compat.engine.embedding import EmbeddingJob, embed
from mlxcel_compat.engine.request import EngineEvent, ErrorEvent, FinishEvent, GenerationRequest


class EngineClient:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # Sequences submitted whose finish the HTTP side has not seen yet: queued, in a slot, or
        # still in the engine's command queue. Touched on the event loop only (no lock needed).
        self.in_flight = 0

    @property
    def ready(self) -> bool:
        return self.engine.state == "ready"

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineEvent]:
        """Yield the request's events until (and including) its finish or error event."""
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[EngineEvent] = asyncio.Queue()

        def sink(event: EngineEvent) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        self.engine.submit(request, sink)
        self.in_flight += 1
        done = False
        try:
            while True:
                event = await events.get()
                if isinstance(event, (FinishEvent, ErrorEvent)):
                    done = True
                yield event
                if done:
                    return
        finally:
            self.in_flight -= 1
            if not done:
                self.engine.cancel(request.task_id)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread and await its result."""
        return await asyncio.wrap_future(self.engine.call(fn))

    async def embed(self, job: EmbeddingJob) -> list[Any]:
        """The job's embeddings (NumPy arrays), computed on the engine thread between steps."""
        engine = self.engine
        return await asyncio.wrap_future(engine.call(lambda: embed(engine.loaded.model, job), wake=True))

    async def call_on_slot(self, slot_id: int, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(slot)`` on the engine thread once the slot is idle, and await its result."""
        return await asyncio.wrap_future(self.engine.call_on_slot(slot_id, fn))
