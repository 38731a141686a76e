"""Attention for MLX's CPU backend, installed into mlx-lm's model modules when a model loads.

On the CPU, ``mx.fast.scaled_dot_product_attention`` runs as a matmul, a softmax and a matmul,
and the softmax's ``exp`` is a scalar loop (~18 ns an element on these cores) that dominates
attention over many keys. Two paths replace it (scripts/bench_cpu_kernels.py, docs/benchmarks/cpu.md):

- **Decode steps** (one query a row) stay lazy in MLX, where evaluating each layer's inputs in
  the middle of the step measured 1.27x slower at 1K context (docs/benchmarks/cpu.md): the softmax
  is a power of 2 of scores taken in log2 units, about three times faster than ``exp`` there,
  and the output is normalised instead of the weights, which saves a pass over the scores. 8 rows
  decoding at 4K context 29 -> 13 ms a layer.
- **Prompt chunks** (more than one query a row, at least ``NUMPY_ATTENTION_MIN`` scores) are
  evaluated up to the attention and computed on NumPy arrays (:func:`attend_numpy`): the two
  products by the same BLAS as MLX's matmuls, called directly, and the softmax by NumPy's float32
  loops, which are vectorized (~0.4 ns an element here against ~9 ns for MLX's scalar power of
  2). Each query block's scores are computed, exponentiated and multiplied by the values in place,
  one KV head at a time, so no score matrix goes back to MLX: only the output does. 512 queries
  over 1K keys: 137 ms a layer with ``mx.fast``, 26 ms with the softmax alone in NumPy, 21 ms
  with the whole attention there, 13.5 ms since the softmax skips the row-maximum shift and
  takes its sums from the product (:func:`weigh`); over 2.5K keys 360, 96, 46 and 41 ms
  (docs/benchmarks/cpu.md). It runs on the calling thread: two threads calling OpenBLAS at once
  measured 1.7x slower.

Both agree with ``mx.fast`` to a few 1e-6 relative (tests/runtime/test_attention.py). Only what these
paths handle exactly is routed here (CPU, no attention sinks, no quantized KV, masks that are
None, "causal" or a boolean/additive array broadcastable per KV-head group); everything else goes
to mlx-lm's own function unchanged.
"""

from __future__ import annotations

import contextlib
import sys
from functools import partial
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from mlxcel_compat.runtime import backend
from mlxcel_compat.runtime.cpu_fusion import LOG2E, evaluated_numpy

# A causal prompt chunk attends in blocks of this many queries, each block to the keys up to its
# own end only: the fully masked part of the scores is never computed (about half of them for a
# fresh prompt), and a block's scores for one KV head stay in the core's cache while they are
# exponentiated and multiplied. 64 beat 128 by 4-6 % on a 1K prefill of the small llama with the
# softmax in NumPy (32 and 256 were slower; scripts/bench_cpu_kernels.py section 8).
QUERY_BLOCK = 64
# Attention of prompt chunks with at least this many scores (elements, all heads) is computed on
# NumPy arrays (:func:`attend_numpy`); smaller ones, and decode steps, stay lazy in MLX.
NUMPY_ATTENTION_MIN = 1 << 16

# A prompt chunk's softmax exponentiates the scores without shifting them by their row maxima when
# every row's sum stays in [2^-64, 2^64] (see :func:`weigh`), and shifted otherwise.
UNSHIFTED_SOFTMAX = True
# A chunk of at most this many queries (a cache hit's rest) computes its attention's products on
# the engine thread alone, OpenBLAS's threads idle (``backend.one_blas_thread``): each product is
# small (a query block's rows of one KV head by the keys seen), and OpenBLAS's per-call split and
# synchronisation cost about what it saved on a quiet machine and 2-4x more on a busy one (17 and
# 52 queries over 1K keys: 1.0 and 2.5 ms a layer alone against 0.9-4.1 and 2.0-8.3 split). A
# 512-token chunk's products are big enough to gain from the split (17 against 22 ms a layer when
# quiet), so they keep it. Measured in docs/benchmarks/prompt-cache.md (issue 29).
SINGLE_THREAD_MAX_QUERIES = 128
_SUM_MIN, _SUM_MAX = np.float32(2.0**-64), np.float32(2.0**64)
# KV dtypes a prompt chunk's NumPy attention takes (16-bit ones widened to float32 first).
STORED_TYPES = (mx.float32, mx.float16, mx.bfloat16)

_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112  # CBLAS enums


@partial(mx.compile, shapeless=True)
def exp2_shifted(scores: Any, top: Any) -> Any:
    """2 ** (scores - top) as one fused loop on the CPU (MLX compiles element-wise chains with the
    system C++ compiler, and falls back to the plain ops without one); bit-identical to the ops."""
    return mx.power(2.0, scores - top)


def group_mask(mask: Any, B: int, Hq: int, Hk: int, L: int, S: int) -> Any:
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
    causal = isinstance(mask, str) and mask == "causal"
    grouped = None if causal else group_mask(mask, B, Hq, Hk, L, S)
    if grouped is False:
        return None
    if (L > 1 and B * Hq * L * S >= NUMPY_ATTENTION_MIN and queries.dtype == mx.float32
            and keys.dtype in STORED_TYPES and values.dtype in STORED_TYPES):
        # 16-bit KV (-ctk/-ctv, runtime/kv_precision.py) is widened exactly to float32 for the
        # BLAS: a copy of the span's keys and values per layer, small beside the products.
        out = attend_numpy(queries, widened(keys), widened(values), scale, "causal" if causal else grouped)
        if out is not None:
            return out
    if causal and L > QUERY_BLOCK:
        blocks = []
        for start in range(0, L, QUERY_BLOCK):
            end = min(L, start + QUERY_BLOCK)
            seen = S - L + end  # the block's last query sees keys [0, seen)
            q = queries[:, :, start:end]
            blocks.append(attend_mlx(q, keys[:, :, :seen], values[:, :, :seen], scale, group_mask(mask, B, Hq, Hk, end - start, seen)))
        return mx.concatenate(blocks, axis=2)
    return attend_mlx(queries, keys, values, scale, group_mask(mask, B, Hq, Hk, L, S) if causal else grouped)


def widened(a: Any) -> Any:
    """``a`` as float32: itself when it is (a cache's strided view stays a view), else a copy."""
    return a if a.dtype == mx.float32 else a.astype(mx.float32)


def attend_mlx(queries: Any, keys: Any, values: Any, scale: float, grouped: Any) -> Any:
    """The lazy MLX path; ``grouped`` is a mask from :func:`group_mask` or None."""
    B, Hq, L, D = queries.shape
    Hk, S = keys.shape[1], keys.shape[2]
    r = Hq // Hk
    # Scores in log2 units (scale * log2 e folded into the queries), so the softmax's exponential
    # is one power of 2; the normalisation divides the (L, D) output, not the (L, S) weights.
    scores = ((queries * (scale * LOG2E)).reshape(B, Hk, r * L, D) @ keys.swapaxes(-1, -2)).reshape(B, Hk, r, L, S)
    if grouped is not None:
        scores = mx.where(grouped, scores, -mx.inf) if grouped.dtype == mx.bool_ else scores + grouped * LOG2E
    weights = exp2_shifted(scores, mx.max(scores, axis=-1, keepdims=True))
    total = mx.sum(weights, axis=-1, keepdims=True)
    out = (weights.reshape(B, Hk, r * L, S) @ values) / total.reshape(B, Hk, r * L, 1)
    return out.reshape(B, Hq, L, values.shape[-1]).astype(queries.dtype)


def attend_numpy(queries: Any, keys: Any, values: Any, scale: float, mask: Any) -> Any | None:
    """A prompt chunk's attention on NumPy arrays (float32); None inside an ``mx.compile`` trace,
    where nothing can be evaluated mid-step and the caller stays in MLX.

    ``mask`` is "causal", None, or a grouped mask (:func:`group_mask`). Queries go in blocks of
    ``QUERY_BLOCK`` (causal: each block to the keys up to its own end), and for each block and KV
    head: scores = Q K^T by the BLAS into one buffer, masked, exponentiated in place (a power of
    2: the scale folds in log2 e; unshifted where that is safe, see :func:`weigh`), then
    multiplied by [V | 1], and the (queries, D) result divided by the sums that the column of ones
    gives. Reading the inputs costs one evaluation in the middle of the step; MLX gets back one
    (B, Hq, L, Dv) array, a view of a token-major one.
    """
    causal = isinstance(mask, str)
    generic = mask is not None and not causal
    views = evaluated_numpy(queries, keys, values, *((mask,) if generic else ()))
    if views is None:
        return None
    q, k, v = views[:3]
    B, Hq, L, D = q.shape
    Hk, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    r = Hq // Hk
    m = np.broadcast_to(views[3], (B, Hk, r, L, S)) if generic else None
    q = q.reshape(B, Hk, r, L, D)  # query heads grouped by the KV head they share
    # The output is written token-major, (B, L, Hq, Dv), and handed to MLX as a (B, Hq, L, Dv)
    # view of it: the caller's transpose back to (B, L, Hq * Dv) for the output projection is
    # then free, where a head-major array costs a strided copy per layer.
    out = np.empty((B, L, Hk, r, Dv), dtype=np.float32)
    # The values with a column of ones, [V | 1]: the product by the weights then also gives each
    # row's sum of weights, in its last column, which spares a pass over the weights (the 65th
    # column of a 64-wide head costs the BLAS 5-15 % more, less than that pass).
    v1 = np.empty((B, Hk, S, Dv + 1), dtype=np.float32)
    v1[..., :Dv] = v
    v1[..., Dv] = 1.0
    with backend.one_blas_thread() if L <= SINGLE_THREAD_MAX_QUERIES else contextlib.nullcontext():
        _attend_blocks(q, k, v1, out, scale, causal, m)
    return mx.array(out.reshape(B, L, Hq, Dv)).transpose(0, 2, 1, 3)


def _attend_blocks(q: np.ndarray, k: np.ndarray, v1: np.ndarray, out: np.ndarray, scale: float, causal: bool,
                   m: np.ndarray | None) -> None:
    """The loop of :func:`attend_numpy`: ``q`` (B, Hk, r, L, D), ``v1`` the values with their
    column of ones, ``out`` (B, L, Hk, r, Dv) written in place."""
    B, Hk, r, L, D = q.shape
    S, Dv = k.shape[2], v1.shape[-1] - 1
    for start in range(0, L, QUERY_BLOCK):
        end = min(L, start + QUERY_BLOCK)
        n = end - start
        seen = S - L + end if causal else S  # causal: the block's last query sees keys [0, seen)
        block = q[:, :, :, start:end] * np.float32(scale * LOG2E)  # contiguous (B, Hk, r, n, D)
        scores = np.empty((r, n, seen), dtype=np.float32)
        weighted = np.empty((r, n, Dv + 1), dtype=np.float32)
        # Causal: query i of the block sees keys up to seen - n + i, so the last n columns hide
        # an upper triangle.
        hidden = np.triu(np.ones((n, n), dtype=np.bool_), k=1) if causal else None
        for b in range(B):
            for h in range(Hk):
                bias = None
                if m is not None:  # a boolean mask hides scores, an additive one biases them
                    bm = m[b, h, :, start:end]
                    hidden, bias = (np.logical_not(bm), None) if bm.dtype == np.bool_ else (None, bm)
                _scores(block[b, h], k[b, h, :seen], scores, bias)
                if not weigh(scores, v1[b, h, :seen], weighted, hidden, shifted=not UNSHIFTED_SOFTMAX):
                    _scores(block[b, h], k[b, h, :seen], scores, bias)  # again, shifted this time
                    weigh(scores, v1[b, h, :seen], weighted, hidden, shifted=True)
                np.divide(weighted[..., :Dv], weighted[..., Dv:], out=out[b, start:end, h].transpose(1, 0, 2))


def _scores(block: np.ndarray, keys: np.ndarray, scores: np.ndarray, bias: np.ndarray | None) -> None:
    """scores = block K^T for one KV head's query block (r, n, D), plus ``bias`` (r, n, seen), an
    additive mask in natural-log units, if given (boolean masks are applied by :func:`weigh`)."""
    r, n, D = block.shape
    matmul(block.reshape(r * n, D), keys, scores.reshape(r * n, scores.shape[-1]), transpose_b=True)
    if bias is not None:
        scores += bias * np.float32(LOG2E)


def weigh(scores: np.ndarray, values: np.ndarray, weighted: np.ndarray, hidden: np.ndarray | None,
          shifted: bool) -> bool:
    """weighted = 2 ** scores @ values for one KV head's block: ``scores`` (r, n, seen) in log2
    units, exponentiated in place; ``values`` (seen, Dv + 1) ends with a column of ones, so the
    last column of ``weighted`` (r, n, Dv + 1) holds the rows' sums. ``hidden``, if given, marks
    the scores the queries must not see, in the last ``hidden.shape[-1]`` columns (a causal
    block's (n, n) upper triangle, or a boolean mask's (r, n, seen) complement): their weights are
    set to zero after the exponential, because ``exp2(-inf)`` takes the vector math library's
    slow path for special values (a 1024-key block 119 µs against 88, measured). False if
    a row's sum is outside [2^-64, 2^64] without the shift (``scores`` must then be computed
    again, shifted).

    A softmax shifts each row by its maximum so that the exponential cannot overflow; that costs
    two passes over the scores (the maximum, the subtraction). Without the shift the weights are
    the same up to float32 rounding whenever the row's sum is in range: below 2^64 no term
    overflowed, and above 2^-64 the largest term (at least the sum over the number of keys) is a
    normal float, so the terms that underflowed to zero were under 2^-30 of the sum, below
    float32's resolution of it. Rows of logits that large or that small are rare (a weight of
    e^44 against the rest), and the caller recomputes them shifted."""
    r, n, seen = scores.shape
    tail = scores[..., seen - hidden.shape[-1]:] if hidden is not None else None
    if shifted:
        if hidden is not None:  # hidden scores must not set the shift
            np.copyto(tail, np.float32(-np.inf), where=hidden)
        scores -= scores.max(axis=-1, keepdims=True)
    with np.errstate(over="ignore"):
        np.exp2(scores, out=scores)
    if hidden is not None and not shifted:
        np.copyto(tail, np.float32(0.0), where=hidden)
    matmul(scores.reshape(r * n, seen), values, weighted.reshape(r * n, weighted.shape[-1]), transpose_b=False)
    if shifted:
        return True
    total = weighted[..., -1]
    return bool(((total >= _SUM_MIN) & (total <= _SUM_MAX)).all())  # false for inf and nan too


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray, transpose_b: bool) -> None:
    """out = a @ b (or a @ b.T), float32, by the BLAS MLX uses (:func:`backend.cblas_sgemm`).

    ``a`` and ``out`` are C-contiguous; ``b`` may be a strided view (a KV cache's rows), as long
    as its last axis is contiguous. Without a loaded BLAS, NumPy's own computes it.
    """
    sgemm = backend.cblas_sgemm()
    if sgemm is None:
        np.matmul(a, b.T if transpose_b else b, out=out)
        return
    if b.strides[1] != 4 or b.strides[0] % 4 or b.strides[0] // 4 < b.shape[1]:
        b = np.ascontiguousarray(b)
    (M, K), N = a.shape, out.shape[1]
    sgemm(_ROW_MAJOR, _NO_TRANS, _TRANS if transpose_b else _NO_TRANS, M, N, K, 1.0, a.ctypes.data, K,
          b.ctypes.data, b.strides[0] // 4, 0.0, out.ctypes.data, N)


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


__all__ = ["attend_mlx", "attend_numpy", "cpu_attention", "exp2_shifted", "group_mask", "install", "make_attention",
           "matmul", "weigh", "widened"]
