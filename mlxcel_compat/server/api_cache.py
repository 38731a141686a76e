"""Prompt-cache admin routes: ``GET /v1/cache/stats`` and ``POST /v1/cache/reset`` (also as
``POST /flush_cache``, which vllm-router and sglang-router send to every worker on their own
``/flush_cache``).

Stats show the RAM and disk tiers separately (``tiers``) and, on a vision model, the
prepared-image memo's counters (``prepared_images``); reset takes the tier to clear. Both run
on the engine thread (the single owner of the stores) through an engine call. They need the API
key when one is configured (they are not public paths).
"""

from __future__ import annotations

import functools

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxcel_compat.cache.prompt_store import PromptCacheStore
from mlxcel_compat.cache.snapshot import SnapshotStore
from mlxcel_compat.engine.cache_stats import RESET_TIERS, reset_result, tiers_stats
from mlxcel_compat.engine.disk_tier import DiskTier
from mlxcel_compat.engine.kv_blocks import SharedBlocks
from mlxcel_compat.server.errors import InvalidRequest, json_response
from mlxcel_compat.server.openapi import Operation
from mlxcel_compat.server.pipeline import ctx_of, read_json


async def cache_stats(request: Request) -> Response:
    ctx = ctx_of(request)
    cache = ctx.engine.prefix_cache
    extra = {"isolation": ctx.cache_isolation}  # --prompt-cache-isolation as resolved
    if ctx.media is not None:  # a vision model: the prepared-image memo (server/media.py) beside the prompt cache
        extra["prepared_images"] = ctx.media.memo.stats()
    if cache is None:
        out = {**PromptCacheStore.disabled_stats(), **SnapshotStore.disabled_stats(), **SharedBlocks.empty_stats()}
        out["tiers"] = tiers_stats(out, DiskTier.disabled_stats())
        return json_response({**out, **extra})
    return json_response({**await ctx.client.call(cache.stats), **extra})


async def cache_reset(request: Request) -> Response:
    """Body ``{"tier": "ram" | "disk" | "all"}`` (no body: ``all``)."""
    ctx = ctx_of(request)
    tier = (await read_json(request)).get("tier", "all")
    if tier not in RESET_TIERS:
        raise InvalidRequest(f'"tier" must be one of {", ".join(RESET_TIERS)}')
    cache = ctx.engine.prefix_cache
    if cache is None:
        return json_response(reset_result(tier, (0, 0), (0, 0)))
    return json_response(await ctx.client.call(functools.partial(cache.reset, tier)))


async def cache_misses(request: Request) -> Response:
    """The latest prompt-cache misses, newest first (reasons and sizes; never tokens or text),
    and their count by reason: the store's reason, or the explained one where the request asked
    for ``cache_explain``."""
    cache = ctx_of(request).engine.prefix_cache
    if cache is None:
        return json_response({"enabled": False, "misses": [], "by_reason": {}})
    return json_response({"enabled": cache.config.enabled, **await ctx_of(request).client.call(cache.recent_misses)})


ROUTES = [
    Route("/v1/cache/misses", cache_misses, methods=["GET"]),
    Route("/v1/cache/stats", cache_stats, methods=["GET"]),
    Route("/v1/cache/reset", cache_reset, methods=["POST"]),
    Route("/flush_cache", cache_reset, methods=["POST"]),
]

RESET = Operation(
    "Drop prompt-cache entries and snapshots of a tier (body {\"tier\": \"ram\"|\"disk\"|\"all\"}, default all)",
    body=("cache_reset",),
    ok={
        "type": "object",
        "properties": {"success": {"type": "boolean"}, "tier": {"type": "string"}, "cleared_entries": {"type": "integer"}, "cleared_bytes": {"type": "integer"}},
        "required": ["success", "tier", "cleared_entries", "cleared_bytes"],
    },
)
OPERATIONS = {
    ("GET", "/v1/cache/stats"): Operation(
        "Prompt-cache counters and gauges (docs/prompt-cache.md)",
        ok={
            "type": "object",
            "properties": {"enabled": {"type": "boolean"}, "entries": {"type": "integer"}, "bytes": {"type": "integer"}, "capacity_bytes": {"type": "integer"}, "isolation": {"enum": ["none", "salt", "api-key"]}},
            "required": ["enabled", "entries", "bytes", "capacity_bytes", "isolation"],
        },
    ),
    ("GET", "/v1/cache/misses"): Operation(
        "The latest prompt-cache misses and their count by reason (docs/prompt-cache.md, \"Why did my request miss?\")",
        ok={
            "type": "object",
            "properties": {"enabled": {"type": "boolean"}, "misses": {"type": "array", "items": {"type": "object"}},
                           "by_reason": {"type": "object", "additionalProperties": {"type": "integer"}}},
            "required": ["enabled", "misses", "by_reason"],
        },
    ),
    ("POST", "/v1/cache/reset"): RESET,
    ("POST", "/flush_cache"): RESET,
}
