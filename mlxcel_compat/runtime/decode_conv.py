"""What the CPU decode runtime holds of LFM2's layers (mlx-lm ``lfm2`` and ``lfm2_moe``, LFM2-VL's
text model), which models it takes, and the short-convolution state it updates.

Why: LFM2 is a hybrid people run on CPUs: most of its layers are short convolutions, a few are
attention. In MLX's step a convolution layer is a handful of small operations (the split, B * x,
a concatenation with the state, a depthwise convolution, C * the result), each evaluated between
the products; the decode pass's C loop (the native layer's short convolution) runs the layer in one call
instead: the in-projection on the file's blocks, B * x, the causal depthwise convolution over the
rolling state of the last ``L_cache - 1`` inputs, C * its output, the out-projection added to the
residual stream. Its attention layers are the loop's own (per-head q and k RMS norms, RoPE over
the whole head) and its feed-forward SwiGLU (``w1`` gate, ``w3`` up, ``w2`` down; lfm2_moe's dense
layers under mlx-lm's usual names), or an MoE layer (``decode_moe.py``: sigmoid scores chosen with
the expert bias, renormalised by their sum + 1e-6, times ``routed_scaling_factor``).

The state: mlx-lm's ``ArraysCache(size=1)`` of the layer holds the last ``L_cache - 1`` values of
B * x ((1, L_cache - 1, hidden), float32). The pass updates it in place, but only in an array made
for the sequence (``decode_delta.own_states``'s rule, which this layer shares through its
``state_shapes``): a cache holding anyone else's (MLX's prefill, a restored snapshot, a
prompt-cache hit) gets a copy first, so session snapshots and prompt-cache entries keep what the
state was when they were taken.

Which models: :func:`unsupported` (LFM2's layout, float32 weights or ggml's blocks, no convolution
bias: LFM2's checkpoints have none).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxcel_compat.runtime import decode_moe
from mlxcel_compat.runtime.block_layers import BlockEmbedding, BlockLinear, block_weight_of
from mlxcel_compat.runtime.decode_layers import LayerWeights, LinearWeights, float32_array, linear_weights, norm_weights

# mlx-lm's families whose layers this module describes (LFM2-VL's text model is mlx-lm's lfm2).
CONV_TYPES = ("lfm2", "lfm2_moe")


@dataclass
class ConvWeights:
    """One short-convolution layer as ``struct mlxcel_short_conv`` reads it."""

    inp: LinearWeights  # hidden -> 3 hidden: B, C, x (mlx-lm splits the output in thirds)
    out: LinearWeights  # hidden -> hidden
    conv: np.ndarray  # (hidden, L_cache): each channel's taps, oldest input first
    hidden: int
    kernel: int  # L_cache

    @property
    def linears(self) -> list[LinearWeights]:
        return [self.inp, self.out]

    @property
    def state_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The ``ArraysCache`` arrays of one sequence: the last ``L_cache - 1`` values of B * x."""
        return ((1, self.kernel - 1, self.hidden),)


def is_conv(layer: Any) -> bool:
    """Whether a decoder layer is one of LFM2's short-convolution layers (not attention)."""
    return not getattr(layer, "is_attention_layer", True) and getattr(layer, "conv", None) is not None


def _mlp_modules(ff: Any) -> list[Any]:
    """An LFM2 feed-forward's gate, up and down modules (lfm2: w1, w3, w2; lfm2_moe's dense layers:
    gate_proj, up_proj, down_proj), or [] for another kind."""
    for names in (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj")):
        if all(hasattr(ff, n) for n in names):
            return [getattr(ff, n) for n in names]
    return []


def unsupported_conv(conv: Any) -> str | None:
    """Why this short-convolution module stays in MLX's step, or None if the C loop runs it."""
    if type(conv).__name__ != "ShortConv":
        return f"{type(conv).__name__}: not LFM2's short convolution"
    if conv.bias or "bias" in conv.conv:
        return "a short convolution with biases (LFM2's checkpoints have none)"
    hidden, kernel = conv.args.hidden_size, conv.L_cache
    if kernel < 2 or conv.conv.weight.shape != (hidden, kernel, 1) or conv.conv.weight.dtype != mx.float32:
        return "a short convolution of unexpected shape or type"
    return None


def unsupported(model: Any) -> str | None:
    """Why this LFM2 model's decode steps stay in MLX, or None if the decoder runs them (every
    layer a short convolution or attention, its feed-forward SwiGLU or an MoE block
    ``decode_moe`` takes, projections float32 or in ggml's blocks, RMS norms)."""
    model_type = model.args.model_type
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    embedding_ok = isinstance(getattr(inner, "embed_tokens", None), (nn.Embedding, BlockEmbedding))
    if not layers or not embedding_ok or not isinstance(getattr(inner, "embedding_norm", None), nn.RMSNorm) or hasattr(
            model, "lm_head"):  # LFM2's head is its embedding (tied)
        return "unexpected module layout"
    weights = [] if block_weight_of(inner.embed_tokens) is not None else [inner.embed_tokens.weight]
    for layer in layers:
        ff = getattr(layer, "feed_forward", None)
        norms = [getattr(layer, n, None) for n in ("operator_norm", "ffn_norm")]
        if is_conv(layer):
            reason = unsupported_conv(layer.conv)
            if reason is not None:
                return f"short-convolution layers ({model_type}): {reason}"
            projections = [layer.conv.in_proj, layer.conv.out_proj]
        else:
            attn = getattr(layer, "self_attn", None)
            if type(attn).__name__ != "Attention" or not hasattr(attn, "out_proj"):
                return "unexpected layer layout"
            rope = attn.rope
            if getattr(rope, "dims", None) != attn.head_dim or not isinstance(rope, nn.RoPE):
                return "partial or unknown rotary embedding"
            projections = [attn.q_proj, attn.k_proj, attn.v_proj, attn.out_proj]
            norms += [attn.q_layernorm, attn.k_layernorm]
        if decode_moe.is_moe(ff):
            reason = decode_moe.unsupported(ff)
            if reason is not None:
                return f"mixture-of-experts layers ({model_type}): {reason}"
            projections += decode_moe.shared_modules(ff)
            bias = getattr(ff, "expert_bias", None)
            if bias is not None:
                weights.append(bias)
        elif _mlp_modules(ff):
            projections += _mlp_modules(ff)
        else:
            return "unexpected layer layout"
        if not all(isinstance(m, (nn.Linear, BlockLinear)) for m in projections):
            return "unexpected attention layout"
        if not all(isinstance(n, nn.RMSNorm) for n in norms):
            return "norms other than RMSNorm"
        weights += [m.weight for m in projections if block_weight_of(m) is None]
    if any(w.dtype != mx.float32 for w in weights):
        return "weights are neither float32 nor in ggml's blocks"
    return None


def conv_weights(conv: Any) -> ConvWeights:
    """A short convolution :func:`unsupported_conv` accepts, as the C loop reads it."""
    return ConvWeights(inp=linear_weights(conv.in_proj), out=linear_weights(conv.out_proj),
                       conv=float32_array(conv.conv.weight[..., 0]), hidden=int(conv.args.hidden_size),
                       kernel=int(conv.L_cache))


def layer_weights(layer: Any, rope: int, moe: Any = None) -> LayerWeights:
    """One LFM2 layer as ``decode_layers.layer_weights`` gives another family's: its two norms, its
    feed-forward (or ``moe``), and its short convolution (``conv``) or attention (per-head q and k
    norms, ``out_proj``; ``rope`` its RoPE module's index)."""
    lin, norm = linear_weights, norm_weights
    mlp = dict(gate=None, up=None, down=None, moe=moe) if moe is not None else dict(
        zip(("gate", "up", "down"), (lin(m) for m in _mlp_modules(layer.feed_forward))))
    common = dict(n1=norm(layer.operator_norm), n2=norm(layer.ffn_norm), **mlp)
    if is_conv(layer):
        return LayerWeights(q=None, k=None, v=None, o=None, q_norm=None, k_norm=None, conv=conv_weights(layer.conv),
                            **common)
    a = layer.self_attn
    return LayerWeights(q=lin(a.q_proj), k=lin(a.k_proj), v=lin(a.v_proj), o=lin(a.out_proj),
                        q_norm=norm(a.q_layernorm), k_norm=norm(a.k_layernorm), rope=rope, **common)


__all__ = ["CONV_TYPES", "ConvWeights", "conv_weights", "is_conv", "layer_weights", "unsupported", "unsupported_conv"]
