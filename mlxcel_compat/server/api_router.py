"""What a load balancer in front of several servers polls: ``/get_load``, ``/get_server_info``,
``/get_model_info`` (the worker endpoints of vllm-router and sglang-router, SGLang's names).

vllm-router's ``power_of_two`` policy reads ``load`` from ``GET /get_load`` on every worker at
each health-check interval and sends the request to the less loaded of two; both routers answer a
client's ``/get_server_info`` and ``/get_model_info`` from one worker. All three are cheap: they
read counters the engine and the HTTP side keep anyway, never wait for the engine thread and never
wake a sleeping model. ``/get_load`` is public like ``/health`` (the router polls it without the
client's API key); the other two need the key when one is set. ``docs/scaling-out.md`` covers the
router set-up.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxcel_compat.server.context import ServerContext
from mlxcel_compat.server.errors import json_response
from mlxcel_compat.server.formats import BUILD_INFO
from mlxcel_compat.server.openapi import Operation
from mlxcel_compat.server.pipeline import SESSION_HEADERS, ctx_of

def load(ctx: ServerContext) -> dict[str, Any]:
    """The load a router balances on: sequences in flight, split into busy slots and queue depth.

    ``load`` counts every sequence the server accepted and has not finished (an ``n: 3`` request
    counts 3), including ones the engine thread has not picked up yet, so a burst shows at once.
    """
    in_flight = ctx.client.in_flight
    running = ctx.engine.n_processing
    return {
        "load": in_flight,
        "running": running,
        "waiting": max(0, in_flight - running),
        "total_slots": len(ctx.engine.slots),
        "is_sleeping": ctx.engine.sleeping,
    }


async def get_load(request: Request) -> Response:
    return json_response(load(ctx_of(request)))


def _prompt_cache(ctx: ServerContext) -> dict[str, Any]:
    cache = ctx.engine.prefix_cache
    if cache is None or not cache.config.enabled:
        return {"enabled": False}
    store = cache.store
    return {
        "enabled": True,
        "capacity_bytes": store.capacity_bytes,
        "max_entries": cache.config.max_entries,
        "ttl_seconds": cache.config.ttl_seconds,
        "apc_enabled": cache.apc_disabled_reason is None,
        "session_headers": list(SESSION_HEADERS),
    }


async def get_server_info(request: Request) -> Response:
    ctx = ctx_of(request)
    m = ctx.model
    s = ctx.settings
    return json_response(
        {
            "version": BUILD_INFO,
            "served_model_name": m.model_id,
            "model_path": m.path,
            "n_ctx": m.n_ctx,
            "total_slots": len(ctx.engine.slots),
            "cont_batching": bool(s.cont_batching),
            "kv_unified": bool(s.kv_unified),
            "batch_size": s.batch_size,
            "sleep_idle_seconds": s.sleep_idle_seconds,
            "prompt_cache": _prompt_cache(ctx),
            "load": load(ctx),
        }
    )


async def get_model_info(request: Request) -> Response:
    ctx = ctx_of(request)
    m = ctx.model
    return json_response(
        {
            "model_path": m.path,
            "tokenizer_path": m.path,
            "is_generation": True,
            "served_model_name": m.model_id,
            "aliases": sorted(m.aliases),
            "format": m.format,
            "n_ctx": m.n_ctx,
            "n_ctx_train": m.n_ctx_train,
            "vocab_size": m.vocab_size,
            "n_params": m.n_params,
        }
    )


ROUTES = [
    Route("/get_load", get_load, methods=["GET"]),
    Route("/get_server_info", get_server_info, methods=["GET"]),
    Route("/get_model_info", get_model_info, methods=["GET"]),
]

LOAD = {
    "type": "object",
    "properties": {"load": {"type": "integer"}, "running": {"type": "integer"}, "waiting": {"type": "integer"}, "total_slots": {"type": "integer"}},
    "required": ["load", "running", "waiting", "total_slots"],
}
OPERATIONS = {
    ("GET", "/get_load"): Operation("Sequences in flight, busy slots and queue depth (for routers; no API key needed)", ok=LOAD),
    ("GET", "/get_server_info"): Operation(
        "Server facts for routers: model, context, slots, prompt cache, load",
        ok={"type": "object", "properties": {"served_model_name": {"type": "string"}, "n_ctx": {"type": "integer"}, "load": LOAD}, "required": ["served_model_name", "n_ctx", "load"]},
    ),
    ("GET", "/get_model_info"): Operation(
        "Model facts for routers",
        ok={"type": "object", "properties": {"model_path": {"type": "string"}, "is_generation": {"const": True}, "n_ctx": {"type": "integer"}}, "required": ["model_path", "is_generation", "n_ctx"]},
    ),
}
