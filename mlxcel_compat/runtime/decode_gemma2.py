"""What Gemma 2 adds to the CPU decode runtime's Gemma layer (``cpu_decode.CpuDecoder``): its
attention logit soft-capping and its embedding scale.

Why apart: Gemma 2's layer is Gemma 3's (four ``1 + w`` norms, the GELU-tanh gated MLP, the
embedding times ``sqrt(hidden)``) without the per-head query and key norms, and mlx-lm's
``gemma2.py`` keeps a full ``KVCache`` for every layer (no ``make_cache``: no rings; llama.cpp's
sliding window is not mlx-lm's, ``gguf/arch_dense.py`` logs it). What differs is here:

- the attention's scores are soft-capped, ``tanh(s / cap) * cap`` with ``s`` the product of the
  queries already times ``1 / sqrt(query_pre_attn_scalar)`` and the keys, before the mask and
  the softmax. The C pass then takes the plain softmax scale (not times log2 e, as every other
  family's) and its ``_capped`` attention kernels (the native layer's) apply the cap and log2 e
  to each score;
- the embedding is scaled by ``hidden ** 0.5`` as a Python float (MLX rounds it to float32),
  where Gemma 3 rounds the factor through bfloat16 first;
- the final soft-capping of the logits is ``decode_families.LogitTransform``'s (the model's
  ``final_logit_softcapping``), shared with ``engine/forward.last_row_logits``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

# Families whose attention scores are soft-capped (mlx-lm's ``attn_logit_softcapping``).
SOFTCAP_TYPES = ("gemma2",)


def attention_softcap(model: Any) -> float:
    """The attention's soft-cap (``attn_logit_softcapping``), or 0.0 for a family without one."""
    args = getattr(model, "args", None)
    if getattr(args, "model_type", None) not in SOFTCAP_TYPES:
        return 0.0
    return float(args.attn_logit_softcapping)


def embedding_scale(model: Any, hidden: int) -> np.float32:
    """The factor a Gemma model multiplies its embeddings by, as mlx-lm computes it: Gemma 2's
    ``hidden ** 0.5`` (a Python float, rounded to float32 by the product), Gemma 3's rounded
    through bfloat16 (``mx.array(hidden ** 0.5, mx.bfloat16)``)."""
    if model.args.model_type == "gemma2":
        return np.float32(hidden ** 0.5)
    return np.float32(mx.array(hidden ** 0.5, mx.bfloat16).astype(mx.float32).item())


def gemma2_classes() -> tuple[type, type]:
    """mlx-lm's Gemma 2 RMS norm (``1 + w``) and MLP (``down(gelu_approx(gate(x)) * up(x))``)."""
    from mlx_lm.models.gemma2 import MLP, RMSNorm

    return RMSNorm, MLP


__all__ = ["SOFTCAP_TYPES", "attention_softcap", "embedding_scale", "gemma2_classes"]
