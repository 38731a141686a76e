"""The prompt cache's settings as the engine takes them (``PrefixCacheConfig``, resolved from the
settings table) and the model-aware defaults of its RAM and disk budgets."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxcel_compat.cache.block_pool import KV_BLOCK_TOKENS
from mlxcel_compat.cache.disk_directory import list_entry_files
from mlxcel_compat.runtime.kv_precision import of_model

GIB = 1 << 30
KV_FLOOR_BYTES = 2 * GIB
DISK_DEFAULT_CEILING = 16 * GIB


@dataclass
class PrefixCacheConfig:
    """The prompt-cache settings the engine needs (resolved from the settings table)."""

    enabled: bool = True
    capacity_bytes: int | None = None  # None: model-aware default
    max_entries: int = 1024
    ttl_seconds: float = 3600.0
    min_prefix: int = 32
    apc_enabled: bool = True
    apc_block_size: int = 16
    apc_num_blocks: int | None = None
    apc_hash: str = "sha256"
    apc_trace: bool = False
    snapshot_capacity_bytes: int | None = None  # None: model-aware default
    snapshot_max_entries: int = 4096
    snapshot_ttl_seconds: float = 7200.0
    boundary_snapshots: bool = True  # MLXCEL_DISABLE_BOUNDARY_SNAPSHOT=1 turns it off
    warmup: bool = True  # MLXCEL_DISABLE_CACHE_WARMUP=1 turns it off
    pin_max_entries: int = 64  # explicit cache breakpoints kept pinned at once (0: none)
    pin_capacity_bytes: int | None = None  # None: a quarter of the KV budget
    disk_dir: str | None = None  # --prompt-cache-dir: the disk tier (off when None)
    disk_capacity_bytes: int | None = None  # None: disk_capacity_default
    disk_write_through: bool = False  # --prompt-cache-write-through: write entries when stored
    # Positions per shared KV block (docs/prompt-cache.md, "Shared KV blocks"); 0 stores every
    # entry whole, as before (scripts/bench_kv_sharing.py measures one against the other).
    kv_block_tokens: int = KV_BLOCK_TOKENS

    @classmethod
    def from_settings(cls, s: Any) -> "PrefixCacheConfig":
        return cls(
            enabled=bool(s.prompt_cache_enabled),
            capacity_bytes=s.prompt_cache_capacity_bytes,
            max_entries=s.prompt_cache_max_entries,
            ttl_seconds=float(s.prompt_cache_ttl),
            min_prefix=s.prompt_cache_min_prefix,
            apc_enabled=bool(s.apc_enabled),
            apc_block_size=s.apc_block_size,
            apc_num_blocks=s.apc_num_blocks,
            apc_hash=s.apc_hash,
            apc_trace=bool(s.apc_trace),
            snapshot_capacity_bytes=s.prompt_cache_snapshot_capacity_bytes,
            snapshot_max_entries=s.prompt_cache_snapshot_max_entries,
            snapshot_ttl_seconds=float(s.prompt_cache_snapshot_ttl),
            boundary_snapshots=not s.disable_boundary_snapshot,
            warmup=not s.disable_cache_warmup,
            pin_max_entries=s.prompt_cache_pin_max_entries,
            pin_capacity_bytes=s.prompt_cache_pin_capacity_bytes,
            disk_dir=s.prompt_cache_dir,
            disk_capacity_bytes=s.prompt_cache_disk_capacity_bytes,
            disk_write_through=bool(s.prompt_cache_write_through),
        )


def physical_memory_bytes() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * GIB


def kv_bytes_per_token(config: dict[str, Any], dtype_bytes: int = 4) -> int:
    """KV bytes one token costs across all layers, from ``config.json`` (text_config aware)."""
    cfg = {**config.get("text_config", {}), **{k: v for k, v in config.items() if k != "text_config"}}
    layers = int(cfg.get("num_hidden_layers") or 0)
    heads = int(cfg.get("num_attention_heads") or 1)
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or (int(cfg.get("hidden_size") or 0) // heads))
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def model_aware_capacity(config: dict[str, Any], ctx_size: int, model_bytes: int, total_memory: int,
                         token_bytes: int | None = None) -> tuple[int, int]:
    """The spec's default KV budget: ``max(2 GiB, min(6 * entry, left / 4))`` + one-entry floor.
    ``token_bytes``: one token's KV at the configured precision (:func:`kv_accounting`'s; default
    float32's), so that an f16 cache's six entries are six entries at f16, not three.

    Returns (capacity_bytes, entry_bytes).
    """
    entry = (token_bytes or kv_bytes_per_token(config)) * min(ctx_size, 8192)
    left = max(total_memory - model_bytes, 0)
    capacity = max(KV_FLOOR_BYTES, min(6 * entry, left // 4))
    if entry > capacity and entry <= left // 2:
        capacity = entry
    return capacity, entry


def disk_capacity_default(root: Path) -> int:
    """Half of what the cache directory could use (free space plus the cache's own files), at
    most 16 GiB. The cache's files count in so that a restart does not shrink the budget."""
    ours = sum(f.size for f in list_entry_files(root))
    return min(DISK_DEFAULT_CEILING, (shutil.disk_usage(root).free + ours) // 2)


def kv_accounting(loaded: Any) -> dict[str, Any]:
    """The stats' KV precision fields: the storage types (-ctk/-ctv) and what one token's keys and
    values take in them across the layers (from the model's config, as the default budget is)."""
    types = of_model(loaded.model)
    k_bytes, v_bytes = types.bytes_per_value()
    return {"kv_cache_type_k": types.k, "kv_cache_type_v": types.v,
            "kv_bytes_per_token": int(kv_bytes_per_token(loaded.config, 1) * (k_bytes + v_bytes) / 2)}
