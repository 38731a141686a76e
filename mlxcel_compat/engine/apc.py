"""APC (automatic prefix caching: partial reuse of a cached prompt, block by block) as the engine
decides and reports it: whether it runs for the model (decided once, at start-up) and the
``MLXCEL_APC_TRACE=1`` line of each lookup. The block hashes and the lookup itself are
``cache/block_hash.py`` and ``cache/store.py``."""

from __future__ import annotations

from typing import Any

from mlxcel_compat.cache import kv
from mlxcel_compat.cache.families import recurrent_family
from mlxcel_compat.cache.records import LookupResult
from mlxcel_compat.engine.prefix_cache_config import PrefixCacheConfig


def apc_decision(config: PrefixCacheConfig, model_config: dict[str, Any], probe: list[Any]) -> tuple[str | None, str]:
    """Whether APC runs for this model: ``(None, detail)`` if so, else ``(reason, detail)``.

    Reasons, first that applies: "cache_off" (the prompt cache is off, so APC has nothing to
    work on), "flag" (``--apc-enabled=false``), "recurrent_family" (the spec's model_type list),
    "non_trimmable_cache" (a layer of the model's mlx-lm cache cannot be cut at every length).
    """
    if not config.enabled:
        return "cache_off", "the prompt cache is off"
    if not config.apc_enabled:
        return "flag", "--apc-enabled=false / APC_ENABLED"
    family = recurrent_family(model_config)
    if family is not None:
        return "recurrent_family", family.describe()
    blockers = kv.untruncatable_layers(probe)
    if blockers:
        return "non_trimmable_cache", "the model cache holds " + ", ".join(blockers)
    return None, "token-granular KV cache"


def trace_line(task_id: int, n_prompt: int, result: LookupResult, failed: bool = False) -> str:
    """One lookup decision: candidate, common prefix, verified lengths, adopted length and why.

    ``block_verified`` is what agreeing full blocks vouch for, ``verified`` adds the token-by-token
    extension, ``adopted`` is after the ``len(prompt) - 1`` clamp.
    """
    hit = result.hit
    if hit is None:
        decision, reason, why = "miss", result.reason, result.detail
        candidate, common, block, verified, adopted = result.candidate_id, result.common_len, "-", result.best_len, 0
    else:
        candidate, common, block, verified = hit.entry.id, hit.common_len, hit.block_len, hit.verified_len
        if not hit.partial:
            why = "whole_entry_prefix"
        elif hit.verified_len > hit.block_len:
            why = "apc_blocks_then_tokens"
        else:
            why = "apc_blocks"
        if hit.matched_len < hit.verified_len:
            why += ",clamped_to_prompt_minus_1"
        if failed:
            decision, reason, adopted = "miss", "adoption_failed", 0
        else:
            decision, reason, adopted = "hit", hit.stage, hit.matched_len
    return (
        f"{decision} task={task_id} prompt={n_prompt} candidate={'-' if candidate is None else candidate} "
        f"common={common} block_verified={block} verified={verified} adopted={adopted} reason={reason} why={why}"
    )
