"""Prompt-cache admin routes: ``GET /v1/cache/stats`` and ``POST /v1/cache/reset`` (also as
``POST /flush_cache``, which vllm-router and sglang-router send to every worker on their own
``/flush_cache``).

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
from mlxcel_compat.server.pipeline import ctx_of


async def cache_stats(request: Request) -> Response:
    ctx = ctx_of(request)
    cache = ctx.engine.prefix_cache
    if cache is None:
        return json_response({**PromptCacheStore.disabled_stats(), **SnapshotStore.disabled_stats()})
    return json_response(await ctx.client.call(cache.stats))


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
    Route("/flush_cache", cache_reset, methods=["POST"]),
]
