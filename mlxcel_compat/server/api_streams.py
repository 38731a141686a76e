"""The resumable-stream routes (llama-server's): replay, look up and stop a conversation's stream.

- ``GET /v1/stream?conv_id=<id>&from=N``: the stream's bytes from offset ``N`` (default 0), then
  live bytes until the generation ends, as ``text/event-stream``. The id travels in the query
  string because a router's id may name a model with slashes (``id::org/repo``).
- ``POST /v1/streams/lookup`` ``{"conversation_ids": [...]}``: the status of the ids asked for,
  and only those: there is no route that lists live sessions.
- ``DELETE /v1/stream?conv_id=<id>``: stop the generation and forget its buffer (204, idempotent).

The sessions themselves, and how a streamed request becomes one, are in ``server/streams.py``.
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from mlxcel_compat.server.errors import InvalidRequest, NotFound, json_response
from mlxcel_compat.server.openapi import SSE, Operation
from mlxcel_compat.server.pipeline import SSE_HEADERS, ctx_of, read_json
from mlxcel_compat.server.streams import OffsetLost


def _conversation(request: Request) -> str:
    conv = request.query_params.get("conv_id", "")
    if not conv:
        raise InvalidRequest("Missing conversation id in path")
    return conv


async def stream_get(request: Request) -> Response:
    session = ctx_of(request).streams.get(_conversation(request))
    if session is None:
        raise NotFound("Stream not found or expired")
    raw = request.query_params.get("from", "")
    if raw and not raw.isdigit():
        raise InvalidRequest("Invalid 'from' offset")
    offset = int(raw) if raw else 0
    try:
        session.check_offset(offset)
    except OffsetLost:
        raise InvalidRequest("Stream offset lost, please restart") from None
    return StreamingResponse(session.read_from(offset), media_type="text/event-stream", headers=SSE_HEADERS)


async def streams_lookup(request: Request) -> Response:
    """Ids that are not non-empty strings are skipped, as llama-server skips them."""
    body = await read_json(request)
    ids = body.get("conversation_ids")
    wanted = [i for i in ids if isinstance(i, str) and i] if isinstance(ids, list) else []
    return json_response([s.to_json() for s in ctx_of(request).streams.lookup(wanted)])


async def stream_delete(request: Request) -> Response:
    ctx_of(request).streams.cancel(_conversation(request))
    return Response(status_code=204)


ROUTES = [
    Route("/v1/stream", stream_get, methods=["GET"]),
    Route("/v1/stream", stream_delete, methods=["DELETE"]),
    Route("/v1/streams/lookup", streams_lookup, methods=["POST"]),
]

CONV_ID = {"conv_id": {"type": "string"}}
SESSION = {
    "type": "object",
    "properties": {
        "conversation_id": {"type": "string"},
        "is_done": {"type": "boolean"},
        "total_bytes": {"type": "integer"},
        "buffered_bytes": {"type": "integer"},
        "started_at": {"type": "integer"},
        "completed_at": {"type": "integer"},
    },
    "required": ["conversation_id", "is_done", "total_bytes", "started_at", "completed_at"],
}
OPERATIONS = {
    ("GET", "/v1/stream"): Operation(
        "Replay a resumable stream (X-Conversation-Id) from a byte offset and follow it live",
        media=(SSE,), errors=(400, 404), query={**CONV_ID, "from": {"type": "integer", "minimum": 0}},
    ),
    ("DELETE", "/v1/stream"): Operation("Stop a resumable stream's generation and drop its buffer (204)", media=(), query=CONV_ID, ok_status=204, errors=(400,)),
    ("POST", "/v1/streams/lookup"): Operation(
        "The status of the resumable streams whose ids are given (live streams are never listed)",
        body=("streams_lookup",), ok={"type": "array", "items": SESSION},
    ),
}
