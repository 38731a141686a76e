"""A prompt chunk's sliding-window layers in the CPU decode runtime (``cpu_decode.CpuDecoder.prefill``):
the buffer mlx-lm's ``RotatingKVCache`` holds after a multi-token update, made once per chunk.

Why: gpt-oss alternates sliding-window layers (a ring of ``sliding_window`` slots) with full
ones, and a prompt's chunks went through MLX's whole pass because the runtime's chunk attention
knew only growing caches. A window is a start offset into the KV: in the chunk, row ``j`` at
slot ``kept + j`` of this buffer attends slots ``kept + j - window + 1`` .. ``kept + j``
(``mlxcel_chunk_attention_window``), and the buffer is exactly what mlx-lm's
``_update_concat`` leaves: the ring's positions in temporal order, trimmed to the newest
``window - 1``, then the chunk's rows (``window - 1 + rows`` slots, so that every row sees a
whole window). The next step's ``ring_plan`` trims it back to a ring of ``window`` slots, as
mlx-lm's next one-token update does, so prefill, steps, the prompt cache and slot files see the
cache as MLX's chunk would have left it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np


def takes(c: Any, window: int) -> bool:
    """Whether ``c`` is a ring the chunk can follow: mlx-lm's ``RotatingKVCache`` of ``window``
    slots, nothing kept at its start, empty or holding one row of float32 keys and values."""
    from mlx_lm.models.cache import RotatingKVCache

    if type(c) is not RotatingKVCache or c.max_size != window or c.keep != 0:
        return False
    return c.keys is None or (c.keys.ndim == 4 and c.keys.shape[0] == 1 and c.keys.dtype == mx.float32
                              and c.values.dtype == mx.float32)


def temporal(c: Any, a: np.ndarray) -> np.ndarray:
    """The ring's slots in the order of their positions (mlx-lm's ``_temporal_order``, keep = 0)."""
    idx = c._idx
    if idx == a.shape[2]:
        return a
    if idx < c.offset:
        return np.concatenate([a[:, :, idx:], a[:, :, :idx]], axis=2)
    return a[:, :, :idx]


def chunk_buffers(c: Any, window: int, rows: int, kv_heads: int, head_dim: int) -> tuple[Any, Any, int]:
    """New keys and values for a chunk of ``rows`` on the ring ``c`` (:func:`takes`): the newest
    ``window - 1`` of its positions in order (``kept`` of them: fewer early on, none in an empty
    ring), then zeros where the chunk's rows go. Returns (keys, values, kept); ``c`` is not changed."""
    made = []
    for a in (c.keys, c.values):
        if a is None:
            old = np.zeros((1, kv_heads, 0, head_dim), np.float32)
        else:
            mx.eval(a)
            old = temporal(c, np.asarray(a))
            old = old[:, :, max(old.shape[2] - window + 1, 0):]
        fresh = mx.zeros((1, kv_heads, old.shape[2] + rows, head_dim), dtype=mx.float32)
        mx.eval(fresh)
        view = np.asarray(fresh)
        if not (view.flags.c_contiguous and view.flags.writeable):
            raise RuntimeError("MLX gave no writable buffer of its own for the KV cache")
        view[:, :, :old.shape[2]] = old
        made.append(fresh)
    return made[0], made[1], made[0].shape[2] - rows


__all__ = ["chunk_buffers", "takes", "temporal"]
