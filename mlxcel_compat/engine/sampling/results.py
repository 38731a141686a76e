"""What one sampling step gives back (``SampleResult``) and the top-n lists read from it for
``n_probs`` and OpenAI's logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlxcel_compat.engine.sampling.candidates import NEG_INF

_FLOAT32_LOWEST = float(np.finfo(np.float32).min)


@dataclass
class SampleResult:
    """One sampling step. All arrays are lazy until the engine evaluates them.

    ``token``: int32 scalar. ``logprobs``: log-softmax of the raw logits (before
    bias), shape (vocab,), for ``n_probs`` / OpenAI logprobs. ``probs``: the
    probabilities of the final draw over the vocabulary (zero for removed
    tokens), only when ``post_sampling_probs`` is on.
    """

    token: mx.array
    logprobs: mx.array
    probs: mx.array | None = None


def _top_pairs(values: mx.array, n: int) -> tuple[list[int], list[float]]:
    """Ids and values of the ``n`` largest entries, best first, ties by lower id."""
    flat = values.reshape(-1).astype(mx.float32)
    size = flat.shape[0]
    n = min(n, size)
    if n <= 0:
        return [], []
    if n < size:
        idx = mx.argpartition(-flat, kth=n - 1)[:n]
    else:
        idx = mx.arange(size)
    ids = np.array(idx).astype(np.int64)
    vals = np.array(flat[idx]).astype(np.float64)
    order = np.lexsort((ids, -vals))
    return ids[order].tolist(), vals[order].tolist()


def top_logprobs(logprobs: mx.array, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens as ``(id, logprob)``; log(0) becomes the lowest float.

    llama.cpp never reports ``-inf`` (JSON would turn it into null).
    """
    ids, vals = _top_pairs(logprobs, n)
    return [(i, v if v != NEG_INF else _FLOAT32_LOWEST) for i, v in zip(ids, vals)]


def top_probs(probs: mx.array, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely tokens after the chain as ``(id, prob)``, zeros dropped."""
    ids, vals = _top_pairs(probs, n)
    return [(i, v) for i, v in zip(ids, vals) if v > 0.0]
