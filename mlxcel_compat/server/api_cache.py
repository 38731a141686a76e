"""Prompt-cache admin routes: ``GET /v1/cache/stats`` and ``POST /v1/cache/reset``.

Both run on the engine thread (the single owner of the store) through an engine call. They need
the API key when one is configured (they are not public paths).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxcel_compat.cache.snapshot import SnapshotStore
from mlxcel_compat.cache.store import PromptCacheStore
from mlxcel_compat.server.errors import json_response
from mlxcel_compat.server.openapi import Operation
from mlxcel_compat.server.pipeline import ctx_of


async def cache_stats(request: Request) -> Response:
    ctx = ctx_of(request)
    cache = ctx.engine.prefix_cache
    isolation = {"isolation": ctx.cache_isolation}  # --prompt-cache-isolation as resolved
    if cache is None:
        return json_response({**PromptCacheStore.disabled_stats(), **SnapshotStore.disabled_stats(), **isolation})
    return json_response({**await ctx.client.call(cache.stats), **isolation})


async def cache_reset(request: Request) -> Response:
    await request.body()  # drain any body: an unread body breaks the next request on a kept-alive connection
    ctx = ctx_of(request)
    cache = ctx.engine.prefix_cache
    if cache is None:
        return json_response({"success": True, "cleared_entries": 0, "cleared_bytes": 0})
    return json_response(await ctx.client.call(cache.reset))


ROUTES = [
    Route("/v1/cache/stats", cache_stats, methods=["GET"]),
    Route("/v1/cache/reset", cache_reset, methods=["POST"]),
]

OPERATIONS = {
    ("GET", "/v1/cache/stats"): Operation(
        "Prompt-cache counters and gauges (docs/prompt-cache.md)",
        ok={
            "type": "object",
            "properties": {"enabled": {"type": "boolean"}, "entries": {"type": "integer"}, "bytes": {"type": "integer"}, "capacity_bytes": {"type": "integer"}, "isolation": {"enum": ["none", "salt", "api-key"]}},
            "required": ["enabled", "entries", "bytes", "capacity_bytes", "isolation"],
        },
    ),
    ("POST", "/v1/cache/reset"): Operation(
        "Drop every prompt-cache entry and snapshot",
        ok={
            "type": "object",
            "properties": {"success": {"type": "boolean"}, "cleared_entries": {"type": "integer"}, "cleared_bytes": {"type": "integer"}},
            "required": ["success", "cleared_entries", "cleared_bytes"],
        },
    ),
}
