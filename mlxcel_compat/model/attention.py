"""Attention for MLX's CPU backend, installed into mlx-lm's model modules when a model loads.

On the CPU, ``mx.fast.scaled_dot_product_attention`` runs as a matmul, a softmax and a matmul,
and the softmax's ``exp`` is a scalar loop (~18 ns an element on these cores) that dominates
attention over many keys. Computing the same softmax with a power of 2 (the scores taken in log2
units) is about three times faster there, and normalising the output instead of the weights saves
a pass over the scores; the result agrees to a few 1e-6 relative. Per layer of the small llama
(scripts/bench_cpu_kernels.py, docs/benchmarks.md): 8 rows decoding at 4K context 29 -> 13 ms,
74 new prompt tokens over a 2K cached prefix (a prompt-cache hit) 44 -> 23 ms. A prompt chunk's
softmax goes further, to NumPy's vectorized loops (:func:`_exp2_numpy`): 512 queries over 1K keys
65 -> 26 ms a layer.

Only what this path handles exactly is routed here (CPU, no attention sinks, no quantized KV,
masks that are None, "causal" or a boolean/additive array broadcastable per KV-head group);
everything else goes to mlx-lm's own function unchanged.
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
from functools import lru_cache, partial
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from mlxcel_compat.model.cpu_fusion import LOG2E, evaluated_numpy

# A causal prompt chunk attends in blocks of this many queries, each block to the keys up to its
# own end only: the fully masked part of the scores is never computed (about half of them for a
# fresh prompt). See scripts/bench_cpu_kernels.py (which also measured the blocks on two MLX CPU
# streams, i.e. two threads: no gain on two cores, the BLAS already uses both). With the softmax
# in NumPy, 64 beat 128 by 4-6 % on a 1K prefill of the small llama (32 and 256 were slower).
QUERY_BLOCK = 64
# Score matrices of prompt chunks at least this large (elements, all heads) take their softmax in
# NumPy (:func:`_exp2_numpy`); decode steps (one query a row) stay lazy in MLX, where an
# evaluation in the middle of the step would stall the pipelined decode.
NUMPY_SOFTMAX_MIN = 1 << 16


@partial(mx.compile, shapeless=True)
def _exp2_shifted(scores: Any, top: Any) -> Any:
    """2 ** (scores - top) as one fused loop on the CPU (MLX compiles element-wise chains with the
    system C++ compiler, and falls back to the plain ops without one); bit-identical to the ops."""
    return mx.power(2.0, scores - top)


def _group_mask(mask: Any, B: int, Hq: int, Hk: int, L: int, S: int) -> Any:
    """``mask`` shaped to broadcast over (B, Hk, Hq // Hk, L, S), or ``False`` if it cannot be."""
    if mask is None:
        return None
    if isinstance(mask, str):
        if mask != "causal":
            return False
        return mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]  # queries are the last L positions
    if mask.ndim == 2:
        return mask
    if mask.ndim == 4 and mask.shape[1] == 1:
        return mx.expand_dims(mask, 2)
    if mask.ndim == 4 and mask.shape[1] == Hq:
        return mask.reshape(mask.shape[0], Hk, Hq // Hk, L, S)
    return False


def cpu_attention(queries: Any, keys: Any, values: Any, scale: float, mask: Any) -> Any | None:
    """softmax(scale * Q K^T + mask) V for grouped-query attention; None if ``mask`` is of a kind
    this path does not handle."""
    B, Hq, L, D = queries.shape
    Hk, S = keys.shape[1], keys.shape[2]
    if Hq % Hk:
        return None
    if isinstance(mask, str) and mask == "causal" and L > QUERY_BLOCK:
        blocks = []
        for start in range(0, L, QUERY_BLOCK):
            end = min(L, start + QUERY_BLOCK)
            seen = S - L + end  # the block's last query sees keys [0, seen)
            q = queries[:, :, start:end]
            blocks.append(_attend(q, keys[:, :, :seen], values[:, :, :seen], scale, "causal"))
        return mx.concatenate(blocks, axis=2)
    return _attend(queries, keys, values, scale, mask)


def _attend(queries: Any, keys: Any, values: Any, scale: float, mask: Any) -> Any | None:
    B, Hq, L, D = queries.shape
    Hk, S = keys.shape[1], keys.shape[2]
    grouped = _group_mask(mask, B, Hq, Hk, L, S)
    if grouped is False:
        return None
    r = Hq // Hk
    # Scores in log2 units (scale * log2 e folded into the queries), so the softmax's exponential
    # is one power of 2; the normalisation divides the (L, D) output, not the (L, S) weights.
    scores = ((queries * (scale * LOG2E)).reshape(B, Hk, r * L, D) @ keys.swapaxes(-1, -2)).reshape(B, Hk, r, L, S)
    numpy_path = None
    if L > 1 and B * Hq * L * S >= NUMPY_SOFTMAX_MIN and scores.dtype == mx.float32:
        numpy_path = _exp2_numpy(scores, mask if isinstance(mask, str) else grouped)
    if numpy_path is not None:
        weights, total = numpy_path
    else:
        if grouped is not None:
            scores = mx.where(grouped, scores, -mx.inf) if grouped.dtype == mx.bool_ else scores + grouped * LOG2E
        weights = _exp2_shifted(scores, mx.max(scores, axis=-1, keepdims=True))
        total = mx.sum(weights, axis=-1, keepdims=True)
    out = (weights.reshape(B, Hk, r * L, S) @ values) / total.reshape(B, Hk, r * L, 1)
    return out.reshape(B, Hq, L, values.shape[-1]).astype(queries.dtype)


def _exp2_numpy(scores: Any, mask: Any) -> tuple[Any, Any] | None:
    """``2 ** (masked scores - row max)`` and its row sums, computed by NumPy (None inside an
    ``mx.compile`` trace: the caller stays in MLX).

    NumPy's float32 ``exp2``, ``max`` and ``sum`` are vectorized on x86 (~0.4 ns an element
    here) where MLX's CPU kernels are scalar loops (~9 ns for the power of 2), so for a prompt
    chunk's score matrix (millions of elements a layer) the cost of evaluating the scores first,
    mid-graph, and of copying the weights back is small beside what it saves (docs/benchmarks.md).
    The rows are split over one thread per core (NumPy releases the GIL in its loops; the BLAS
    threads wait meanwhile). Agrees with the MLX path to float32 rounding (tests/test_attention.py).
    """
    causal = isinstance(mask, str)
    generic = mask is not None and not causal
    views = evaluated_numpy(scores, *((mask,) if generic else ()))
    if views is None:
        return None
    view, m = views if generic else (views[0], None)
    L, S = view.shape[-2:]
    w = np.empty(view.shape, dtype=np.float32)
    if generic:  # an array mask broadcasts over the 5-D scores: applied here, whole
        if m.dtype == np.bool_:
            np.copyto(w, np.where(m, view, np.float32(-np.inf)))
        else:
            np.add(view, m * np.float32(LOG2E), out=w)
    src, rows = view.reshape(-1, L, S), w.reshape(-1, L, S)  # groups of the L queries
    total = np.empty((rows.shape[0], L, 1), dtype=np.float32)
    # Causal: queries are the last L positions, so query i masks the keys after it, all among the
    # last L: an additive 0 / -inf triangle on the last L columns.
    future = np.triu(np.full((L, L), -np.inf, dtype=np.float32), k=1) if causal else None

    def part(lo: int, hi: int) -> None:
        out = rows[lo:hi]
        if not generic:
            np.copyto(out, src[lo:hi])
        if future is not None:
            out[..., S - L :] += future
        out -= out.max(axis=-1, keepdims=True)
        np.exp2(out, out=out)
        np.sum(out, axis=-1, keepdims=True, out=total[lo:hi])

    groups = rows.shape[0]
    bounds = np.linspace(0, groups, min(_SOFTMAX_THREADS, groups) + 1).astype(int)
    list(_softmax_pool().map(part, bounds[:-1], bounds[1:]))
    return mx.array(w), mx.array(total.reshape(*w.shape[:-1], 1))


# The softmax runs while the BLAS threads wait for it, so it may use every core this process has.
_SOFTMAX_THREADS = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


@lru_cache(maxsize=1)
def _softmax_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(_SOFTMAX_THREADS, thread_name_prefix="mlxcel-softmax")


def make_attention(original: Callable[..., Any]) -> Callable[..., Any]:
    """mlx-lm's ``scaled_dot_product_attention`` with the CPU path in front of it."""

    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):  # noqa: ANN001, ANN202
        if sinks is None and not hasattr(cache, "bits") and mx.default_device() == mx.cpu:
            out = cpu_attention(queries, keys, values, scale, mask)
            if out is not None:
                return out
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    scaled_dot_product_attention.original = original  # type: ignore[attr-defined]
    return scaled_dot_product_attention


def install() -> int:
    """Route every imported mlx-lm model module's attention through :func:`make_attention`.

    The model modules import the function by name (``from .base import ...``), so each module's
    binding is replaced. Idempotent; returns how many modules were switched now."""
    from mlx_lm.models import base

    original = base.scaled_dot_product_attention
    original = getattr(original, "original", original)
    patched = make_attention(original)
    switched = 0
    for name, module in list(sys.modules.items()):
        if name.startswith("mlx_lm.models.") and getattr(module, "scaled_dot_product_attention", None) is original:
            module.scaled_dot_product_attention = patched
            switched += 1
    return switched


__all__ = ["cpu_attention", "install", "make_attention"]
