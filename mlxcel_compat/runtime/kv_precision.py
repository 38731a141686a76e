"""KV cache precision: llama-server's ``-ctk``/``-ctv`` (``--cache-type-k``/``--cache-type-v``).

What it does: the KV cache *stores* keys and values in the configured type, and attention reads
the stored values, in a cold prompt as in a prompt-cache hit: the new positions are written into
the cache first and the whole span is read back from it, as llama.cpp does (it writes K and V
into its cache tensors, then attends over views of them). A hit therefore reads exactly what the
cold run read, and equals it at every precision.

How: mlx-lm's KV caches (``KVCache``, ``RotatingKVCache``, their batch forms) allocate their
buffers in the dtype of the first keys and values they are given, and MLX casts a slice
assignment to the buffer's dtype. One wrapper around their ``update_and_fetch`` casts the new
keys and values to the layer's storage type before the update: the buffer's own dtype once it
has one (so a copy, a merged batch or a cache read back from disk keeps its type), else the type
the model's ``make_cache`` stamped on the new layer (:func:`install`). Attention then takes
float32 queries against half-precision keys and values; MLX promotes the products to float32.

``f32``, ``f16`` and ``bf16`` are built. llama-server also accepts ``q8_0`` and ``q4_0`` (ggml's
32-value blocks with an f16 scale) and ``q4_1``, ``iq4_nl``, ``q5_0``, ``q5_1``: start-up refuses
them with a message that says so (settings.py).

Why not a subclass of ``KVCache``: the prompt cache, the CPU decode runtime, batching and the
disk format recognise mlx-lm's own classes by name; a subclass would be a new kind to each.

The CPU decode runtime (``cpu_decode.py``) keeps its own buffers in the same types
(``decode_kv.py``): its C attention writes new rows rounded to f16 or bf16 and widens the stored
rows as it reads them, so its steps and prompt chunks agree with MLX's over the same 16-bit cache
to float32 rounding, and a hit read in place gives the bits of the cold run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx

# llama-server's names (common/arg.cpp: kv_cache_types) and what this server stores each as.
DTYPES: dict[str, Any] = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}

STAMP = "kv_storage"  # a new cache layer's (keys dtype, values dtype), set by the model's make_cache


@dataclass(frozen=True)
class KvTypes:
    """The storage types of keys and values (llama-server's names)."""

    k: str = "f32"
    v: str = "f32"

    @property
    def tag(self) -> str:
        """What a disk entry or slot file records (``f16/f16``): another tag's KV is not adopted."""
        return f"{self.k}/{self.v}"

    @property
    def exact(self) -> bool:
        """float32 both: the KV the model computes, unrounded (the mode the CPU runtime reads)."""
        return self.k == self.v == "f32"

    def dtypes(self) -> tuple[Any, Any]:
        return DTYPES[self.k], DTYPES[self.v]

    def bytes_per_value(self) -> tuple[int, int]:
        """Bytes one stored key element and one value element take."""
        k, v = self.dtypes()
        return k.size, v.size


def _storage(layer: Any) -> tuple[Any, Any] | None:
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if isinstance(keys, mx.array) and isinstance(values, mx.array):
        return keys.dtype, values.dtype
    return layer.__dict__.get(STAMP)


def _storing(update: Callable[..., Any]) -> Callable[..., Any]:
    """``update_and_fetch`` with the new keys and values cast to the layer's storage types first."""

    def update_and_fetch(self: Any, keys: Any, values: Any) -> Any:
        storage = _storage(self)
        if storage is not None:
            k_dtype, v_dtype = storage
            if keys.dtype != k_dtype:
                keys = keys.astype(k_dtype)
            if values.dtype != v_dtype:
                values = values.astype(v_dtype)
        return update(self, keys, values)

    update_and_fetch.unwrapped = update  # type: ignore[attr-defined]
    return update_and_fetch


def patch_caches() -> None:
    """Wrap the ``update_and_fetch`` of mlx-lm's token-indexed KV caches (idempotent). With no
    stamp and float buffers of the model's own dtype, the wrapper casts nothing."""
    from mlx_lm.models import cache

    for name in ("KVCache", "RotatingKVCache", "ChunkedKVCache", "BatchKVCache", "BatchRotatingKVCache"):
        cls = getattr(cache, name, None)
        if cls is not None and "update_and_fetch" in vars(cls) and not hasattr(cls.update_and_fetch, "unwrapped"):
            cls.update_and_fetch = _storing(cls.update_and_fetch)


def stamp(cache: list[Any], types: KvTypes) -> list[Any]:
    """Mark every empty KV layer of a new cache (in ``CacheList``s too) with the storage types."""
    dtypes = types.dtypes()

    def mark(layer: Any) -> None:
        inner = getattr(layer, "caches", None)
        if inner is not None:
            for c in inner:
                mark(c)
        elif hasattr(layer, "update_and_fetch") and hasattr(layer, "keys"):
            layer.__dict__[STAMP] = dtypes

    for layer in cache:
        mark(layer)
    return cache


def install(model: Any, types: KvTypes) -> None:
    """Make every cache ``make_prompt_cache(model)`` builds store KV as ``types`` say: the
    model's ``make_cache`` (mlx-lm's default list of ``KVCache`` where it has none) is wrapped to
    stamp its layers. float32 leaves the model as it is (the computed dtype is stored)."""
    model.kv_types = types
    if types.exact:
        return
    from mlx_lm.models.cache import KVCache

    patch_caches()
    made = getattr(model, "make_cache", None)
    if made is None:
        def made() -> list[Any]:
            return [KVCache() for _ in model.layers]
    model.make_cache = lambda: stamp(made(), types)


def of_model(model: Any) -> KvTypes:
    """The types :func:`install` gave ``model`` (float32 where it was not called)."""
    return getattr(model, "kv_types", None) or KvTypes()


__all__ = ["DTYPES", "KvTypes", "STAMP", "install", "of_model", "patch_caches", "stamp"]
