"""llama-server's LoRA routes: ``GET /lora-adapters`` and ``POST /lora-adapters``.

The adapters are served unfused (``lora/layers.py``), so setting the global scales is a
change of one tuple on the HTTP side (``AdapterSet.scales``), effective for the next request: no
engine call, no reload. Requests already running keep the scales they started with, as a
llama-server slot keeps its task's. The new scales also change the prompt cache's ``lora_id`` of
later requests, so none of them reuses KV computed under the old scales.
"""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxcel_compat.server.errors import InvalidRequest, json_response
from mlxcel_compat.server.openapi import Operation
from mlxcel_compat.server.pipeline import INLINE_JSON_BYTES, ctx_of, parse_json

log = logging.getLogger(__name__)


async def lora_adapters(request: Request) -> Response:
    """``[{"id", "path", "scale", "task_name", "prompt_prefix"}]`` for every loaded adapter."""
    return json_response(ctx_of(request).adapters.listing())


async def set_lora_adapters(request: Request) -> Response:
    """Body ``[{"id": i, "scale": s}]``: listed ids take their scale, the others 0 (ids out of
    range are ignored, as llama-server's ``construct_lora_list`` ignores them)."""
    ctx = ctx_of(request)
    raw = await request.body()
    body = parse_json(raw) if len(raw) <= INLINE_JSON_BYTES else await ctx.workers.run(parse_json, raw)
    if not isinstance(body, list):
        raise InvalidRequest("Request body must be an array")
    adapters = ctx.adapters
    try:
        scales = adapters.from_entries(body) if len(raw) <= INLINE_JSON_BYTES else await ctx.workers.run(adapters.from_entries, body)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    adapters.scales = scales
    for i, scale in enumerate(scales):
        log.info("set lora adapter idx=%d scale=%f", i, scale)
    return json_response({"success": True})


ROUTES = [
    Route("/lora-adapters", lora_adapters, methods=["GET"]),
    Route("/lora-adapters", set_lora_adapters, methods=["POST"]),
]

_ADAPTER = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "path": {"type": "string"}, "scale": {"type": "number"},
                   "task_name": {"type": "string"}, "prompt_prefix": {"type": "string"}},
    "required": ["id", "path", "scale", "task_name", "prompt_prefix"],
}
OPERATIONS = {
    ("GET", "/lora-adapters"): Operation("The loaded LoRA adapters and their global scales",
                                         ok={"type": "array", "items": _ADAPTER}),
    ("POST", "/lora-adapters"): Operation(
        "Set the global LoRA scales (body [{\"id\": i, \"scale\": s}]; adapters not listed get 0)",
        ok={"type": "object", "properties": {"success": {"type": "boolean"}}, "required": ["success"]},
        errors=(400,),  # a body that is not an array of {id, scale}
    ),
}
