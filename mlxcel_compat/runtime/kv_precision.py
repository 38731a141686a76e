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

``f32``, ``f16``, ``bf16``, ``q8_0`` and ``q4_0`` are built. The two block types store ggml's
32-value blocks with an f16 scale (``kv_blocks.py``): the wrapper quantizes the new keys and
values into the layer's uint8 rows and hands attention the stored rows dequantized to the
computed dtype. llama-server also accepts ``q4_1``, ``iq4_nl``, ``q5_0`` and ``q5_1``: start-up
refuses them with a message that says so (settings.py).

Keys and values may be of different types (``-ctk q8_0 -ctv f16``: every pair, as llama-server
on the CPU): a stamp is a (keys, values) pair, and mlx-lm's batch caches, which allocate a merged
batch's values in the keys' dtype, get ``merge`` and ``extend`` wrappers that keep the values' own
type (:func:`patch_caches`).

Why not a subclass of ``KVCache``: the prompt cache, the CPU decode runtime, batching and the
disk format recognise mlx-lm's own classes by name; a subclass would be a new kind to each.

The CPU decode runtime (``cpu_decode.py``) keeps its own buffers in the same types
(``decode_kv.py``): its C attention writes new rows rounded to f16 or bf16 and widens the stored
rows as it reads them, so its steps and prompt chunks agree with MLX's over the same 16-bit cache
to float32 rounding, and a hit read in place gives the bits of the cold run.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx

from mlxcel_compat.runtime import kv_blocks

# llama-server's names (common/arg.cpp: kv_cache_types) and what this server stores each as:
# float types as themselves, ggml's block types as rows of uint8 (kv_blocks.py).
DTYPES: dict[str, Any] = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}
BLOCK_TYPES = tuple(kv_blocks.BLOCK_BYTES)  # q8_0, q4_0

# a new cache layer's (keys storage, values storage), set by the model's make_cache: a float dtype,
# or a block type's name (q8_0, q4_0)
STAMP = "kv_storage"


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

    @property
    def blocks(self) -> tuple[str | None, str | None]:
        """Each side's block type (q8_0, q4_0), or None where it is a float type: -ctk and -ctv
        may differ (``-ctk q8_0 -ctv f16``), as in llama-server."""
        return tuple(t if t in BLOCK_TYPES else None for t in (self.k, self.v))  # type: ignore[return-value]

    def dtypes(self) -> tuple[Any, Any]:
        """The cache arrays' dtypes: uint8 rows for the block types."""
        return tuple(mx.uint8 if t in BLOCK_TYPES else DTYPES[t] for t in (self.k, self.v))  # type: ignore[return-value]

    def storage(self) -> tuple[Any, Any]:
        """What a layer's stamp holds: each side's float dtype or block type name."""
        return tuple(t if t in BLOCK_TYPES else DTYPES[t] for t in (self.k, self.v))  # type: ignore[return-value]

    def bytes_per_value(self) -> tuple[float, float]:
        """Bytes one stored key element and one value element take (a block's bytes over its 32
        values for q8_0 and q4_0: 34/32 and 18/32)."""
        return tuple(kv_blocks.BLOCK_BYTES[t] / kv_blocks.QK if t in BLOCK_TYPES else DTYPES[t].size
                     for t in (self.k, self.v))  # type: ignore[return-value]


def _stored(buffer: Any, head_dim: int) -> Any:
    """A buffer's storage: its dtype, or for uint8 rows the block type their width says."""
    if buffer.dtype == mx.uint8:
        return kv_blocks.kind_of(buffer.shape[-1], head_dim)
    return buffer.dtype


def _storage(layer: Any, keys: Any, values: Any) -> tuple[Any, Any] | None:
    buffers = getattr(layer, "keys", None), getattr(layer, "values", None)
    if all(isinstance(b, mx.array) for b in buffers):
        return _stored(buffers[0], keys.shape[-1]), _stored(buffers[1], values.shape[-1])
    return layer.__dict__.get(STAMP)


def _to_storage(x: Any, storage: Any) -> Any:
    if isinstance(storage, str):
        return kv_blocks.quantize(x, storage)
    return x if storage is None or x.dtype == storage else x.astype(storage)


def _from_storage(stored: Any, storage: Any, dtype: Any) -> Any:
    return kv_blocks.dequantize(stored, storage, dtype) if isinstance(storage, str) else stored


def _storing(update: Callable[..., Any]) -> Callable[..., Any]:
    """``update_and_fetch`` with the new keys and values cast (or quantized) to the layer's
    storage types first, and block rows handed back dequantized to the computed dtype."""

    def update_and_fetch(self: Any, keys: Any, values: Any) -> Any:
        storage = _storage(self, keys, values)
        if storage is None:
            return update(self, keys, values)
        k_store, v_store = storage
        dtype = keys.dtype
        k, v = update(self, _to_storage(keys, k_store), _to_storage(values, v_store))
        return _from_storage(k, k_store, dtype), _from_storage(v, v_store, dtype)

    update_and_fetch.unwrapped = update  # type: ignore[attr-defined]
    return update_and_fetch


def _values_as_keys(layer: Any) -> Any:
    """A shallow twin of ``layer`` with its keys and values swapped (a paged layer gathered first)."""
    keys, values = layer.keys, layer.values
    twin = copy.copy(layer)
    twin.keys, twin.values = values, keys
    return twin


def _merging(merge: Callable[..., Any]) -> Callable[..., Any]:
    """A batch cache's ``merge`` that keeps the values' own type: mlx-lm's allocates the merged
    values in the keys' dtype, which casts them where -ctk and -ctv differ (uint8 rows of q8_0
    blocks cast to f16 numbers, or back). The values are then merged again as if they were keys
    (the same padding and order), and that result's keys are the merged values."""

    def merged(cls: Any, caches: list[Any]) -> Any:
        out = merge(cls, caches)
        full = [c for c in caches if c.keys is not None]
        if out.values is None or all(c.keys.dtype == c.values.dtype for c in full):
            return out
        out.values = merge(cls, [_values_as_keys(c) if c.keys is not None else c for c in caches]).keys
        return out

    merged.unwrapped = merge  # type: ignore[attr-defined]
    return classmethod(merged)  # type: ignore[return-value]


def _extending(extend: Callable[..., Any]) -> Callable[..., Any]:
    """A batch cache's ``extend`` that keeps the values' own type: mlx-lm's pads an empty side's
    values in the keys' dtype, and the concatenation then promotes the values (q8_0 rows' bytes
    to f16, f16 with bf16 to float32). Every such promotion is exact, so casting back restores
    the stored bits."""

    def extended(self: Any, other: Any) -> None:
        dtype = next((c.values.dtype for c in (self, other) if c.values is not None), None)
        extend(self, other)
        if dtype is not None and self.values is not None and self.values.dtype != dtype:
            self.values = self.values.astype(dtype)

    extended.unwrapped = extend  # type: ignore[attr-defined]
    return extended


def patch_caches() -> None:
    """Wrap the ``update_and_fetch`` of mlx-lm's token-indexed KV caches, and their batch forms'
    ``merge`` and ``extend`` (idempotent). With no stamp and float buffers of the model's own
    dtype, the wrapper casts nothing; with keys and values of one type the batch wrappers change
    nothing."""
    from mlx_lm.models import cache

    for name in ("KVCache", "RotatingKVCache", "ChunkedKVCache", "BatchKVCache", "BatchRotatingKVCache"):
        cls = getattr(cache, name, None)
        if cls is not None and "update_and_fetch" in vars(cls) and not hasattr(cls.update_and_fetch, "unwrapped"):
            cls.update_and_fetch = _storing(cls.update_and_fetch)
    for name in ("BatchKVCache", "BatchRotatingKVCache"):
        cls = getattr(cache, name, None)
        if cls is None:
            continue
        if "merge" in vars(cls) and not hasattr(vars(cls)["merge"].__func__, "unwrapped"):
            cls.merge = _merging(vars(cls)["merge"].__func__)
        if "extend" in vars(cls) and not hasattr(cls.extend, "unwrapped"):
            cls.extend = _extending(cls.extend)


def stamp(cache: list[Any], types: KvTypes) -> list[Any]:
    """Mark every empty KV layer of a new cache (in ``CacheList``s too) with the storage types."""
    dtypes = types.storage()

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


# models whose attention llama.cpp computes on one latent cache (MLA): it refuses -ctk != -ctv there
MLA_MODELS = frozenset({"deepseek_v2", "deepseek_v3", "deepseek_v32", "kimi_k2", "kimi_linear"})


def _model_type(model: Any) -> str | None:
    args = getattr(model, "args", None)
    return args.get("model_type") if isinstance(args, dict) else getattr(args, "model_type", None)


def _head_dim(model: Any) -> int | None:
    """The model's attention head size from its mlx-lm arguments, where they say it."""
    args = getattr(model, "args", None)
    args = getattr(args, "text_config", None) or args
    if isinstance(args, dict):
        get = args.get
    else:
        def get(name: str) -> Any:
            return getattr(args, name, None)
    head_dim = get("head_dim")
    if head_dim is None and get("hidden_size") and get("num_attention_heads"):
        head_dim = get("hidden_size") // get("num_attention_heads")
    return int(head_dim) if isinstance(head_dim, int) else None


def install(model: Any, types: KvTypes) -> None:
    """Make every cache ``make_prompt_cache(model)`` builds store KV as ``types`` say: the
    model's ``make_cache`` (mlx-lm's default list of ``KVCache`` where it has none) is wrapped to
    stamp its layers. float32 leaves the model as it is (the computed dtype is stored)."""
    model.kv_types = types
    if types.exact:
        return
    head_dim = _head_dim(model)
    for kind in types.blocks:
        if kind and head_dim is not None:
            kv_blocks.row_width(kind, head_dim)  # raises for a head size blocks cannot hold
    if types.k != types.v and _model_type(model) in MLA_MODELS:
        raise ValueError(f"this model ({_model_type(model)}) does not support different K ({types.k}) and V "
                         f"({types.v}) cache types")  # as llama.cpp (llama-context.cpp)
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


__all__ = ["BLOCK_TYPES", "DTYPES", "KvTypes", "STAMP", "install", "of_model", "patch_caches", "stamp"]
