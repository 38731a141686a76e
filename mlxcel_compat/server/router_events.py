"""The router's event stream, ``GET /models/sse``: what happens to its models, as it happens.

llama-server's router (``tools/server/server-models.cpp: notify_sse``) broadcasts one JSON object
per event to every client of ``/models/sse``: ``{"model": NAME, "event": EVENT, "data": {...}}``,
sent as ``data: <json>\\n\\n``. The events: ``status_change`` (``data.status``: loading, loaded,
unloading, unloaded, with ``exit_code`` when unloaded), ``download_progress`` (``data.progress``:
bytes done and total per file), ``download_finished`` / ``download_failed``, ``model_remove``
and ``models_reload`` (model ``*``). A client hears the events broadcast after it subscribed;
there is no replay, as there.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import orjson
from starlette.responses import StreamingResponse

QUEUE_EVENTS = 1024  # a client this far behind loses the oldest events rather than growing memory


class RouterEvents:
    """The subscribers of ``/models/sse``: one queue each, fed by :meth:`notify` on the event loop."""

    def __init__(self) -> None:
        self.subscribers: set[asyncio.Queue[dict[str, Any]]] = set()

    def notify(self, event: str, model: str, data: dict[str, Any] | None = None) -> None:
        message: dict[str, Any] = {"model": model, "event": event}
        if data is not None:
            message["data"] = data
        for queue in self.subscribers:
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(message)

    def subscribe(self) -> asyncio.Queue[dict[str, Any]]:
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(QUEUE_EVENTS)
        self.subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue[dict[str, Any]]) -> None:
        self.subscribers.discard(queue)


def event_stream(events: RouterEvents) -> StreamingResponse:
    """The ``/models/sse`` response. The client is subscribed before the response starts, so an
    event caused after its headers arrive reaches it (llama.cpp's tests rely on that)."""
    queue = events.subscribe()

    async def lines() -> AsyncIterator[bytes]:
        try:
            while True:
                message = await queue.get()
                yield b"data: " + orjson.dumps(message) + b"\n\n"
        finally:
            events.unsubscribe(queue)

    return StreamingResponse(lines(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


__all__ = ["RouterEvents", "event_stream"]
