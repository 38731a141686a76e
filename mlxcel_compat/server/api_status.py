"""What the server says about itself: ``/health``, ``/props``, ``/models``, ``/slots``, ``/metrics``."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxcel_compat.server.context import ServerContext
from mlxcel_compat.server.errors import NotSupported, Unavailable, json_response
from mlxcel_compat.server.formats import BUILD_INFO, metrics_params
from mlxcel_compat.server.media import MEDIA_MARKER
from mlxcel_compat.server.openapi import TEXT, Operation
from mlxcel_compat.server.pipeline import ctx_of, read_json
from mlxcel_compat.settings import mcp_proxy_enabled


async def health(request: Request) -> Response:
    """200 only while requests can be served; routers take a replica out of rotation on 503.

    While the model loads, the gate in ``app.py`` answers 503 "Loading model" before this runs.
    Asleep (``--sleep-idle-seconds``) is healthy: the next request reloads the weights. A stopped
    engine thread (shutdown, or a crash) is not.
    """
    if not ctx_of(request).engine.alive:
        raise Unavailable("Engine stopped")
    return json_response({"status": "ok"})


def _default_params(ctx: ServerContext) -> dict[str, Any]:
    from mlxcel_compat.engine.request import GenerationRequest
    from mlxcel_compat.server.params import Body, parse_sampling, spec_type_names

    sampling = parse_sampling(Body({}), ctx.settings, ctx.model.vocab_size, ctx.tokenize)
    request = GenerationRequest(prompt_tokens=[], sampling=sampling, n_predict=-1, lora=ctx.adapters.scales,
                                spec_types=spec_type_names(ctx.settings))
    return metrics_params(request, False)


async def props(request: Request) -> Response:
    ctx = ctx_of(request)
    m = ctx.model
    s = ctx.settings
    template = m.chat_template
    body: dict[str, Any] = {
        "default_generation_settings": {"params": _default_params(ctx), "n_ctx": m.n_ctx},
        "total_slots": len(ctx.engine.slots),
        "model_alias": m.model_id,
        "model_ftype": m.file_type,
        "model_path": m.path,
        "modalities": {"vision": ctx.media is not None and ctx.media.facts.images, "video": False,
                       "audio": ctx.media is not None and ctx.media.facts.audio is not None},
        "media_marker": MEDIA_MARKER,
        "endpoint_slots": bool(s.slots),
        "endpoint_props": bool(s.props),
        "endpoint_metrics": bool(s.metrics),
        "ui": bool(s.ui),
        "ui_settings": ctx.ui_settings,
        "chat_template": template.source if template else "",
        "chat_template_caps": template.caps() if template else {},
        "bos_token": m.bos_token,
        "eos_token": m.eos_token,
        "build_info": BUILD_INFO,
        "is_sleeping": ctx.engine.sleeping,
        "cors_proxy_enabled": mcp_proxy_enabled(s),
    }
    if template is not None and template.tool_use_source:  # llama-server: Jinja mode, when the model has one
        body["chat_template_tool_use"] = template.tool_use_source
    return json_response(body)


async def props_post(request: Request) -> Response:
    if not ctx_of(request).settings.props:
        raise NotSupported("This server does not support changing global properties. Start it with `--props`")
    await read_json(request)
    return json_response({"success": True})


async def models(request: Request) -> Response:
    ctx = ctx_of(request)
    m = ctx.model
    name = m.model_id
    return json_response(
        {
            "models": [
                {
                    "name": name,
                    "model": name,
                    "modified_at": "",
                    "size": "",
                    "digest": "",
                    "type": "model",
                    "description": "",
                    "tags": [""],
                    "capabilities": ["completion", "multimodal"] if ctx.media is not None else ["completion"],
                    "parameters": "",
                    "details": {
                        "parent_model": "",
                        "format": m.format,
                        "family": "",
                        "families": [""],
                        "parameter_size": "",
                        "quantization_level": "",
                    },
                }
            ],
            "object": "list",
            "data": [
                {
                    "id": name,
                    "aliases": sorted(m.aliases),
                    "tags": list(m.tags),
                    "object": "model",
                    "created": int(ctx.started),
                    "owned_by": "llamacpp",
                    "meta": {
                        "vocab_type": 2,
                        "n_vocab": m.vocab_size,
                        "n_ctx": m.n_ctx,
                        "n_ctx_train": m.n_ctx_train,
                        "n_embd": m.n_embd,
                        "n_params": m.n_params,
                        "size": m.size_bytes,
                        "ftype": m.file_type,
                    },
                }
            ],
        }
    )


async def slots(request: Request) -> Response:
    ctx = ctx_of(request)
    if not ctx.settings.slots:
        raise NotSupported("This server does not support slots endpoint. Start it with `--slots`")
    if request.query_params.get("fail_on_no_slot") in ("1", "true") and all(s.is_processing for s in ctx.engine.slots):
        raise Unavailable("no slot available")
    return json_response([slot.to_json() for slot in ctx.engine.slots])


async def metrics(request: Request) -> Response:
    ctx = ctx_of(request)
    if not ctx.settings.metrics:
        raise NotSupported("This server does not support metrics endpoint. Start it with `--metrics`")
    body = ctx.metrics.render()
    # Scrapers compare it between scrapes to notice a restart (llama-server's value and clock).
    start = str(ctx.engine.metrics.t_start_us)
    # The content type exactly as llama-server sends it (Starlette would add a charset).
    response = Response(body, headers={"Content-Type": "text/plain; version=0.0.4"})
    # The header's name with llama-server's capitals (Starlette lowercases the names it is given):
    # clients that read headers into a plain dict (llama.cpp's own tests do) look it up so.
    response.raw_headers.append((b"Process-Start-Time-Unix", start.encode("latin-1")))
    return response


ROUTES = [
    Route("/health", health, methods=["GET"]),
    Route("/v1/health", health, methods=["GET"]),
    Route("/props", props, methods=["GET"]),
    Route("/props", props_post, methods=["POST"]),
    Route("/models", models, methods=["GET"]),
    Route("/v1/models", models, methods=["GET"]),
    Route("/slots", slots, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]

HEALTH = Operation("Liveness: 200 once the model is loaded", ok={"type": "object", "properties": {"status": {"const": "ok"}}, "required": ["status"]})
MODEL_SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"}, "owned_by": {"type": "string"}, "meta": {"type": "object"}},
    "required": ["id", "object", "created", "owned_by"],
}
MODELS = Operation(
    "The served model (OpenAI list and llama-server's models array)",
    ok={"type": "object", "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": MODEL_SCHEMA}, "models": {"type": "array"}}, "required": ["object", "data"]},
)
SLOT_SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer"}, "n_ctx": {"type": "integer"}, "is_processing": {"type": "boolean"}, "speculative": {"type": "boolean"}},
    "required": ["id", "n_ctx", "is_processing"],
}
OPERATIONS = {
    ("GET", "/health"): HEALTH,
    ("GET", "/v1/health"): HEALTH,
    ("GET", "/props"): Operation(
        "Server properties and default generation settings",
        ok={
            "type": "object",
            "properties": {"default_generation_settings": {"type": "object"}, "total_slots": {"type": "integer"}, "model_alias": {"type": "string"}, "chat_template": {"type": "string"}},
            "required": ["default_generation_settings", "total_slots", "model_alias", "chat_template"],
        },
    ),
    ("POST", "/props"): Operation(
        "Accepted and ignored, as in llama-server (needs --props)",
        body=(),
        ok={"type": "object", "properties": {"success": {"const": True}}, "required": ["success"]},
        errors=(501,),
    ),
    ("GET", "/models"): MODELS,
    ("GET", "/v1/models"): MODELS,
    ("GET", "/slots"): Operation(
        "Slot states (needs --slots, on by default)",
        ok={"type": "array", "items": SLOT_SCHEMA},
        errors=(501,),
        query={"fail_on_no_slot": {"type": "string"}},
    ),
    ("GET", "/metrics"): Operation("Prometheus metrics (needs --metrics)", media=(TEXT,), errors=(501,)),
}
