"""A prompt chunk's KV buffers on a model with sliding-window layers (gemma3's), for the CPU
decode runtime's prefill (``CpuDecoder.prefill_rows``).

Why: a sliding layer's cache is mlx-lm's ``RotatingKVCache``, a ring of the window's size that a
decode step writes one slot of. A prompt chunk cannot go through a ring that way (its first rows
need keys the ring has already overwritten by its last ones), so MLX's chunk lays the ring's
newest ``window - 1`` slots out in order and appends the chunk's keys (``_update_concat``), and
masks each row to its window. Gemma's prompts went through MLX for that alone, at 0.56x
llama-server's prefill on the 270M file, most of it MLX's work around the products (norms, RoPE,
the evaluations between the block products). Here the runtime's pass does the same: each
sliding layer gets a new buffer holding the ring's newest ``min(window - 1, offset)`` slots in
order, then room for the chunk (written by the pass's windowed chunk attention,
``mlxcel_chunk_attention_window``), and the cache is left exactly as mlx-lm's concatenating update
leaves it (that buffer, ``_idx`` at its end), so the next step, MLX's pass, the prompt cache and
slot files all find the state they know. The plain (global) layers take the runtime's own growing
buffers (``KvLayout.own``). Arrays others hold (a prompt-cache entry's) are read, never written.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlxcel_compat.runtime.decode_kv import KvLayout, OwnedCache


def _ordered_spans(ring: Any) -> list[tuple[int, int]]:
    """The ring's slots in the order of their positions, as mlx-lm's ``_temporal_order`` takes
    them: a full ring from ``_idx`` (its oldest) round to ``_idx - 1``, a ring not yet wrapped (or
    one a concatenating update left longer than the window) up to ``_idx``."""
    cap, idx = ring.keys.shape[2], ring._idx
    if idx == cap:
        return [(0, cap)]
    if idx < ring.offset:
        return [(idx, cap), (0, idx)]
    return [(0, idx)]


def kept_slots(ring: Any, window: int) -> int:
    """How many of the ring's newest slots a chunk's rows may see: ``min(window - 1, offset)``."""
    return min(window - 1, ring.offset)


def ring_takes_chunk(ring: Any, window: int, n_kv_heads: int, head_dim: int) -> bool:
    """Whether a chunk can start on ``ring`` here: mlx-lm's ``RotatingKVCache`` of the model's
    window (no kept prefix), empty, or float32 keys and values of one sequence holding at least
    the slots the chunk's rows see."""
    from mlx_lm.models.cache import RotatingKVCache

    if type(ring) is not RotatingKVCache or ring.max_size != window or ring.keep != 0:
        return False
    if ring.keys is None:
        return ring.offset == 0
    shape = (1, n_kv_heads, ring.keys.shape[2], head_dim)
    if any(a.dtype != mx.float32 or a.shape != shape for a in (ring.keys, ring.values)):
        return False
    held = sum(b - a for a, b in _ordered_spans(ring))
    return 0 <= ring._idx <= ring.keys.shape[2] and held >= kept_slots(ring, window)


def plain_takes_chunk(c: Any, n_kv_heads: int, head_dim: int) -> bool:
    """Whether a chunk can start on a plain layer's ``c``: an empty mlx-lm ``KVCache`` or one of
    one sequence's float32 keys and values (the runtime copies it into its own buffers if needed)."""
    from mlx_lm.models.cache import KVCache

    if type(c) is not KVCache:
        return False
    if c.keys is None:
        return c.offset == 0
    return all(a.dtype == mx.float32 and a.ndim == 4 and a.shape[0] == 1 and a.shape[1] == n_kv_heads
               and a.shape[3] == head_dim and a.shape[2] >= c.offset for a in (c.keys, c.values))


def _new_buffer(shape: tuple[int, ...]) -> tuple[Any, np.ndarray]:
    """A new MLX float32 array of ``shape`` and a writable NumPy view of its buffer."""
    fresh = mx.zeros(shape, dtype=mx.float32)
    mx.eval(fresh)
    view = np.asarray(fresh)
    if not (view.flags.c_contiguous and view.flags.writeable):
        raise RuntimeError("MLX gave no writable buffer of its own for the KV cache")
    return fresh, view


def _chunk_ring(ring: Any, window: int, rows: int, n_kv_heads: int, head_dim: int) -> tuple[Any, Any, int]:
    """The ring's new buffers for a chunk of ``rows`` rows: its newest :func:`kept_slots` slots in
    order, then the chunk's. Sets them as the ring's arrays, ``_idx`` at the kept slots (the pass
    advances it by ``rows``, as mlx-lm's update leaves it). Returns keys, values, kept."""
    kept = kept_slots(ring, window)
    spans = _ordered_spans(ring) if kept else []
    made = []
    for source in (ring.keys, ring.values):
        fresh, view = _new_buffer((1, n_kv_heads, kept + rows, head_dim))
        src = np.asarray(source) if kept else None
        skip = sum(b - a for a, b in spans) - kept  # the oldest slots fall out of the window
        j = 0
        for a, b in spans:
            drop = min(skip, b - a)
            a, skip = a + drop, skip - drop
            view[:, :, j:j + b - a] = src[:, :, a:b]
            j += b - a
        made.append(fresh)
    ring.keys, ring.values = made
    ring._idx = kept
    return made[0], made[1], kept


def chunk_views(layout: KvLayout, cache: list[Any], owned: OwnedCache, pos: int,
                rows: int) -> list[tuple[int, int, int]]:
    """Every layer's keys, values and capacity for a prompt chunk of ``rows`` rows from ``pos``:
    the plain layers' own buffers with room for the chunk (:meth:`KvLayout.own`), each sliding
    layer a new buffer (:func:`_chunk_ring`) whose capacity is its kept slots plus the chunk; the
    pass writes a sliding layer's chunk at slot ``ring._idx``. ``owned`` then holds every layer's
    arrays. The caller checked every layer (:func:`ring_takes_chunk`, :func:`plain_takes_chunk`)."""
    mx.eval([(c.keys, c.values) for c in cache if c.keys is not None])
    plain_layout = KvLayout(layout.n_kv_heads, layout.head_dim, None, rings=[], plain=list(range(len(layout.plain))))
    mine = len(owned.arrays) == len(cache)
    plain_owned = OwnedCache(arrays=[owned.arrays[i] for i in layout.plain] if mine else [],
                             views=[owned.views[i] for i in layout.plain] if mine else [], reserve=owned.reserve)
    plain_views = plain_layout.own([cache[i] for i in layout.plain], plain_owned, pos, last=pos + rows - 1)
    arrays: list[Any] = [None] * len(cache)
    views: list[Any] = [None] * len(cache)
    for j, i in enumerate(layout.plain):
        arrays[i], views[i] = plain_owned.arrays[j], plain_views[j]
    for i in layout.rings:
        keys, values, kept = _chunk_ring(cache[i], layout.window, rows, layout.n_kv_heads, layout.head_dim)
        arrays[i] = (keys, values)
        views[i] = (np.asarray(keys).ctypes.data, np.asarray(values).ctypes.data, kept + rows)
    owned.arrays, owned.views, owned.apart = arrays, views, None
    return views


__all__ = ["chunk_views", "kept_slots", "plain_takes_chunk", "ring_takes_chunk"]
