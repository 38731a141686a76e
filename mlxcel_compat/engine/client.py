"""The asyncio side of the engine: submit a request, iterate over its events.

The engine thread appends events to a per-request deque and wakes the event loop with
``loop.call_soon_threadsafe``; nothing here blocks the event loop. Leaving the iteration early
(the client went away, the handler was cancelled) cancels the sequence at the engine's next step.

Waking the loop costs more than the event: the loop thread takes the GIL from the engine thread
for its self-pipe read, the queue's future and the handler's step, a few hundred microseconds a
token that the engine's next step then waits for (10 % of the GIL's time in a decoding server,
py-spy). So the loop is woken only when the deque becomes non-empty (events that pile up while it
is busy are taken in one wake), and for a consumer that needs no event before the last (a
non-streaming response, ``incremental=False``) only by the finish or an error.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, AsyncIterator, Callable

from mlxcel_compat.runtime.native.blas_shim import StreamedConsumers
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

    async def generate(self, request: GenerationRequest, incremental: bool = True) -> AsyncIterator[EngineEvent]:
        """Yield the request's events until (and including) its finish or error event.
        ``incremental=False``: the caller needs none before the last (the events still come, all
        of them, once the sequence has finished)."""
        loop = asyncio.get_running_loop()
        events: collections.deque[EngineEvent] = collections.deque()
        ready = asyncio.Event()

        def sink(event: EngineEvent) -> None:  # on the engine thread
            events.append(event)
            if (incremental and len(events) == 1) or isinstance(event, (FinishEvent, ErrorEvent)):
                loop.call_soon_threadsafe(ready.set)

        self.engine.submit(request, sink)
        self.in_flight += 1
        if incremental:
            StreamedConsumers.started()
        done = False
        try:
            while True:
                if not events:
                    ready.clear()
                    if not events:  # an event appended from now on sets ``ready`` after this
                        await ready.wait()
                    continue
                event = events.popleft()
                if isinstance(event, (FinishEvent, ErrorEvent)):
                    done = True
                yield event
                if done:
                    return
        finally:
            self.in_flight -= 1
            if incremental:
                StreamedConsumers.ended()
            if not done:
                self.engine.cancel(request.task_id)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread and await its result."""
        return await asyncio.wrap_future(self.engine.call(fn))

    async def embed(self, job: EmbeddingJob) -> list[Any]:
        """The job's embeddings (NumPy arrays), computed on the engine thread between steps."""
        engine = self.engine

        def run() -> list[Any]:
            t0 = time.perf_counter()
            vectors = embed(engine.loaded.model, job)
            engine.metrics.add_embedding([len(p) for p in job.prompts], time.perf_counter() - t0, engine.config.batch_size)
            return vectors

        return await asyncio.wrap_future(engine.call(run, wake=True))

    async def call_on_slot(self, slot_id: int, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(slot)`` on the engine thread once the slot is idle, and await its result."""
        return await asyncio.wrap_future(self.engine.call_on_slot(slot_id, fn))
