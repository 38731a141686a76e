"""A prompt chunk's KV buffers on a model with sliding-window layers (gemma3's, gpt-oss's), for the CPU
decode runtime's prefill (``CpuDecoder.prefill_rows``).

Why: a sliding layer's cache is mlx-lm's ``RotatingKVCache``, a ring of the window's size that a
decode step writes one slot of. A chunk's rows see up to ``window - 1`` positions before their
own, so MLX's chunk lays the ring's newest ``window - 1`` slots out in order, appends the chunk's
keys (``_update_concat``) and masks each row to its window. Gemma's prompts went through MLX for
that alone, at 0.56x llama-server's prefill on the 270M file, most of it MLX's work around the
products (norms, RoPE, the evaluations between the block products). Now the runtime's pass does
it (the native pass's ``ring_chunk``): per sliding layer, the ring's newest slots and the chunk's
rows laid out in order in one scratch buffer, the windowed chunk attention
(``mlxcel_chunk_attention_window``) over it, and the newest ``window`` slots written back into
the ring in order from slot 0. The ring stays a ring of at most ``window`` slots (MLX's chunk
leaves ``window - 1 + rows`` slots a layer: 30 MiB more at the peak of a 1K prompt on the 270M
model), in a state mlx-lm's updates and the runtime's step take (``_idx`` after the newest slot,
``window`` when full: the next write wraps to the oldest; a shorter prompt's ring holds its
positions only, as MLX's chunk leaves it, and grows as mlx-lm's steps grow it).

gpt-oss's sliding layers alternate with full ones and add attention sinks: the same layout, the
layer's sinks in the same windowed chunk attention. The buffers are of the layout's storage types
(``KvLayout.dtypes``: -ctk/-ctv, f16 by default), as the pass writes and reads them.

Each chunk writes a new ring (the last one's newest slots copied in first), so arrays others hold
(a prompt-cache entry's, a boundary snapshot's) are read, never written. The plain (global) layers take the runtime's own
growing buffers (``KvLayout.own``).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlxcel_compat.runtime.decode_kv import KvLayout, OwnedCache, host_view


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


def ring_takes_chunk(ring: Any, window: int, n_kv_heads: int, widths: tuple[int, int],
                     dtypes: tuple[Any, Any] = (mx.float32, mx.float32)) -> bool:
    """Whether a chunk can start on ``ring`` here: mlx-lm's ``RotatingKVCache`` of the model's
    window (no kept prefix), empty, or keys and values of ``dtypes`` (the storage types) and row
    ``widths`` of one sequence holding at least the slots the chunk's rows see."""
    from mlx_lm.models.cache import RotatingKVCache

    if type(ring) is not RotatingKVCache or ring.max_size != window or ring.keep != 0:
        return False
    if ring.keys is None:
        return ring.offset == 0
    if any(a.dtype != t or a.shape != (1, n_kv_heads, ring.keys.shape[2], w)
           for a, t, w in zip((ring.keys, ring.values), dtypes, widths)):
        return False
    held = sum(b - a for a, b in _ordered_spans(ring))
    return 0 <= ring._idx <= ring.keys.shape[2] and held >= min(window, ring.offset)


def plain_takes_chunk(c: Any, n_kv_heads: int, widths: tuple[int, int],
                      dtypes: tuple[Any, Any] = (mx.float32, mx.float32)) -> bool:
    """Whether a chunk can start on a plain layer's ``c``: an empty mlx-lm ``KVCache`` or one of
    one sequence's keys and values of ``dtypes`` and row ``widths`` (the runtime copies it into
    its own buffers if needed)."""
    from mlx_lm.models.cache import KVCache

    if type(c) is not KVCache:
        return False
    if c.keys is None:
        return c.offset == 0
    return all(a.dtype == t and a.ndim == 4 and a.shape[0] == 1 and a.shape[1] == n_kv_heads
               and a.shape[3] == w and a.shape[2] >= c.offset for a, t, w in zip((c.keys, c.values), dtypes, widths))


def _new_buffer(shape: tuple[int, ...], dtype: Any) -> tuple[Any, np.ndarray]:
    """A new MLX array of ``shape`` and ``dtype`` and a writable NumPy view of its buffer
    (``host_view``: bfloat16 as its bits)."""
    fresh = mx.zeros(shape, dtype=dtype)
    mx.eval(fresh)
    view = host_view(fresh)
    if not (view.flags.c_contiguous and view.flags.writeable):
        raise RuntimeError("MLX gave no writable buffer of its own for the KV cache")
    return fresh, view


def _own_ring(ring: Any, window: int, rows: int, n_kv_heads: int, widths: tuple[int, int],
              dtypes: tuple[Any, Any]) -> tuple[Any, Any, int]:
    """A new ring for a chunk of ``rows`` rows: ``min(window, offset + rows)`` slots (a short
    prompt's ring holds its positions only, as MLX's does), ``ring``'s newest ones (at most its
    offset) in order from slot 0, set as the ring's arrays with ``_idx`` after them (``window``
    when full), of ``dtypes``. Returns keys, values and the capacity."""
    spans = _ordered_spans(ring) if ring.keys is not None else []
    held = sum(b - a for a, b in spans)
    kept = min(held, ring.offset, window)
    capacity = min(window, ring.offset + rows)
    made = []
    for source, dtype, width in zip((ring.keys, ring.values), dtypes, widths):
        fresh, view = _new_buffer((1, n_kv_heads, capacity, width), dtype)
        skip, j = held - kept, 0  # the oldest slots fall out of the window
        for a, b in spans:
            drop = min(skip, b - a)
            a, skip = a + drop, skip - drop
            view[:, :, j:j + b - a] = host_view(source)[:, :, a:b]
            j += b - a
        made.append(fresh)
    ring.keys, ring.values = made
    ring._idx = kept
    return made[0], made[1], capacity


def chunk_views(layout: KvLayout, cache: list[Any], owned: OwnedCache, pos: int,
                rows: int) -> list[tuple[int, int, int]]:
    """Every layer's keys, values and capacity for a prompt chunk of ``rows`` rows from ``pos``:
    the plain layers' own buffers with room for the chunk (:meth:`KvLayout.own`), each sliding
    layer a new ring of at most ``window`` slots (:func:`_own_ring`): the pass writes a ring's slots over,
    and a boundary snapshot taken between two chunks holds views of the last chunk's ring (a
    growing cache's chunk only appends past what such a view sees).
    ``owned`` then holds every layer's arrays. The caller checked every layer
    (:func:`ring_takes_chunk`, :func:`plain_takes_chunk`) and fills in each ring's slot and
    valid slots (``_idx``, ``offset``); the pass leaves the ring in order (``CpuDecoder._run``)."""
    mx.eval([(c.keys, c.values) for c in cache if c.keys is not None])
    mine = len(owned.arrays) == len(cache)
    plain_layout = KvLayout(layout.n_kv_heads, layout.head_dim, None, rings=[], plain=list(range(len(layout.plain))),
                            dtypes=layout.dtypes, blocks=layout.blocks)
    plain_owned = OwnedCache(arrays=[owned.arrays[i] for i in layout.plain] if mine else [],
                             views=[owned.views[i] for i in layout.plain] if mine else [], reserve=owned.reserve)
    plain_views = plain_layout.own([cache[i] for i in layout.plain], plain_owned, pos, last=pos + rows - 1)
    arrays: list[Any] = [None] * len(cache)
    views: list[Any] = [None] * len(cache)
    for j, i in enumerate(layout.plain):
        arrays[i], views[i] = plain_owned.arrays[j], plain_views[j]
    for i in layout.rings:  # a new ring every chunk: a snapshot taken between chunks may hold the last one
        keys, values, capacity = _own_ring(cache[i], layout.window, rows, layout.n_kv_heads, layout.widths,
                                           layout.dtypes)
        arrays[i] = (keys, values)
        views[i] = (host_view(keys).ctypes.data, host_view(values).ctypes.data, capacity)
    owned.arrays, owned.views, owned.apart = arrays, views, None
    return views


__all__ = ["chunk_views", "plain_takes_chunk", "ring_takes_chunk"]
