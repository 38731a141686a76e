"""What the CPU decode runtime holds of DeepSeek V2/V3's multi-head latent attention (MLA), and
which layers it takes: mlx-lm's ``deepseek_v3`` and ``deepseek_v2`` attention modules.

Why apart: MLA is not the plain attention the C loop's other layers run. Its queries come through
a LoRA pair with a norm between (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``; or one ``q_proj``),
its keys and values from one compressed row per token (``kv_a_proj_with_mqa``: a latent, normed by
``kv_a_layernorm``, and one rotary key every head shares), and each mlx-lm module caches that in
its own form: ``deepseek_v3`` the latent and the rotated key themselves (a ``KVCache`` of one
"head" whose keys are the latent rows and whose values are the rotary keys), attending in the
latent space through the absorbed ``embed_q`` / ``unembed_out`` multi-linears; ``deepseek_v2`` the
per-head keys (nope part from ``kv_b_proj``, then the rotary key) and values expanded. The C
layer (the native layer's MLA attention) writes and reads exactly those rows, so MLX's prefill, the
prompt cache and slot files see the cache either side wrote.

Softmax scale: the module's own (``q_head_dim ** -0.5`` times YaRN's ``mscale ** 2`` where its
rope scaling says so); the rotary angles come from the module's own RoPE (``rope_angles.py``:
YaRN's frequencies and its ``mscale`` on the rotated part, taken as the module computes them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxcel_compat.runtime.block_layers import BlockLinear, block_weight_of
from mlxcel_compat.runtime.decode_layers import (LayerWeights, LinearWeights, NormWeights, float32_array, layer_mlp,
                                                 linear_weights, norm_weights)

# mlx-lm's MLA attention modules by the form their cache holds: "latent" (deepseek_v3: the latent
# and the rotary key, absorbed multi-linears) or "expanded" (deepseek_v2: per-head keys and values).
MLA_MODULES = {"DeepseekV3Attention": "latent", "DeepseekV2Attention": "expanded"}


@dataclass
class MlaWeights:
    """One MLA attention as ``struct mlxcel_mla`` reads it."""

    q: LinearWeights | None  # a plain query projection, or None with the LoRA pair
    q_a: LinearWeights | None
    q_b: LinearWeights | None
    q_a_norm: NormWeights | None
    kv_a: LinearWeights  # hidden -> kv_lora + rope
    kv_norm: NormWeights
    kv_b: LinearWeights | None  # deepseek_v2: kv_lora -> heads * (nope + v_dim)
    o: LinearWeights
    embed_q: np.ndarray | None  # deepseek_v3: (heads, kv_lora, nope) float32
    unembed_out: np.ndarray | None  # deepseek_v3: (heads, v_dim, kv_lora) float32
    heads: int
    nope: int
    rope: int
    kv_lora: int
    v_dim: int
    scale: float

    @property
    def linears(self) -> list[LinearWeights]:
        return [w for w in (self.q, self.q_a, self.q_b, self.kv_a, self.kv_b, self.o) if w is not None]


class TraditionalRope:
    """deepseek_v2's YaRN module as ``rope_angles.RopeAngles`` reads a RoPE module: it rotates
    interleaved pairs of its whole input (``traditional``) but says neither that nor its width."""

    traditional = True

    def __init__(self, rope: Any, dims: int) -> None:
        self.rope, self.dims = rope, dims

    def __call__(self, x: Any, offset: int = 0) -> Any:
        return self.rope(x, offset)


def is_mla(attn: Any) -> bool:
    return type(attn).__name__ in MLA_MODULES


def expanded(attn: Any) -> bool:
    """Whether the module caches per-head keys and values (deepseek_v2), not the latent."""
    return MLA_MODULES[type(attn).__name__] == "expanded"


def rope_of(attn: Any) -> Any:
    """The RoPE module the layer applies to its rotary part, with ``traditional`` and ``dims`` set."""
    return TraditionalRope(attn.rope, attn.qk_rope_head_dim) if expanded(attn) else attn.rope


def cache_shape(attn: Any) -> tuple[int, int, int, int]:
    """(query heads, cached heads, a cached key's width, a cached value's width) in mlx-lm's cache."""
    if expanded(attn):
        return attn.num_heads, attn.num_heads, attn.q_head_dim, attn.v_head_dim
    return attn.num_heads, 1, attn.kv_lora_rank, attn.qk_rope_head_dim


def _projections(attn: Any) -> list[Any]:
    names = ["q_proj"] if attn.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
    names += ["kv_a_proj_with_mqa", "o_proj"] + (["kv_b_proj"] if expanded(attn) else [])
    return [getattr(attn, n, None) for n in names]


def unsupported(attn: Any) -> str | None:
    """Why this MLA layer stays in MLX's step, or None if the C loop runs it."""
    if not all(isinstance(m, (nn.Linear, BlockLinear)) for m in _projections(attn)):
        return "projections other than linear layers or ggml's blocks"
    norms = [attn.kv_a_layernorm] + ([attn.q_a_layernorm] if attn.q_lora_rank is not None else [])
    if not all(isinstance(n, nn.RMSNorm) for n in norms):
        return "norms other than RMSNorm"
    if not getattr(rope_of(attn), "traditional", False) or attn.qk_rope_head_dim % 2:
        return "a rotary embedding other than interleaved pairs"
    weights = [m.weight for m in _projections(attn) if block_weight_of(m) is None]
    if not expanded(attn):
        if not all(type(m).__name__ == "MultiLinear" for m in (attn.embed_q, attn.unembed_out)):
            return "quantized absorbed multi-linears (embed_q, unembed_out)"
        weights += [attn.embed_q.weight, attn.unembed_out.weight]
    if any(w.dtype != mx.float32 for w in weights):
        return "weights are neither float32 nor in ggml's blocks"
    return None


def layer_unsupported(layer: Any, model_type: str) -> str | None:
    """Why a DeepSeek decoder layer (MLA attention, then an MLP or an MoE block) stays in MLX's
    step (the start-up log's reason, named as the other families' are), or None."""
    from mlxcel_compat.runtime import decode_moe

    reason = unsupported(layer.self_attn)
    if reason is not None:
        return f"latent attention layers ({model_type}): {reason}"
    mlp = layer_mlp(layer)
    if decode_moe.is_moe(mlp):
        reason = decode_moe.unsupported(mlp)
        if reason is not None:
            return f"mixture-of-experts layers ({model_type}): {reason}"
        linears = decode_moe.shared_modules(mlp)
    else:
        linears = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    if not all(isinstance(m, (nn.Linear, BlockLinear)) for m in linears):
        return f"latent attention layers ({model_type}): an MLP other than gate, up and down linear layers"
    if not all(isinstance(getattr(layer, n, None), nn.RMSNorm) for n in ("input_layernorm", "post_attention_layernorm")):
        return f"latent attention layers ({model_type}): norms other than RMSNorm"
    if any(m.weight.dtype != mx.float32 for m in linears if block_weight_of(m) is None):
        return "weights are neither float32 nor in ggml's blocks"
    return None


def mla_weights(attn: Any) -> MlaWeights:
    lin, lora = linear_weights, attn.q_lora_rank is not None
    wide = expanded(attn)
    return MlaWeights(
        q=None if lora else lin(attn.q_proj), q_a=lin(attn.q_a_proj) if lora else None,
        q_b=lin(attn.q_b_proj) if lora else None, q_a_norm=norm_weights(attn.q_a_layernorm) if lora else None,
        kv_a=lin(attn.kv_a_proj_with_mqa), kv_norm=norm_weights(attn.kv_a_layernorm),
        kv_b=lin(attn.kv_b_proj) if wide else None, o=lin(attn.o_proj),
        embed_q=None if wide else float32_array(attn.embed_q.weight),
        unembed_out=None if wide else float32_array(attn.unembed_out.weight),
        heads=int(attn.num_heads), nope=int(attn.qk_nope_head_dim), rope=int(attn.qk_rope_head_dim),
        kv_lora=int(attn.kv_lora_rank), v_dim=int(attn.v_head_dim), scale=float(attn.scale))


def mla_layer(layer: Any, rope: int, moe: Any = None) -> LayerWeights:
    """A DeepSeek decoder layer: its MLA attention, and its MLP (gate, up, down) or MoE block
    (``moe``: ``decode_moe.moe_weights``)."""
    m = layer_mlp(layer)
    mlp = (dict(gate=None, up=None, down=None, moe=moe) if moe is not None
           else dict(gate=linear_weights(m.gate_proj), up=linear_weights(m.up_proj), down=linear_weights(m.down_proj)))
    return LayerWeights(n1=norm_weights(layer.input_layernorm), n2=norm_weights(layer.post_attention_layernorm),
                        q=None, k=None, v=None, o=None, q_norm=None, k_norm=None, rope=rope,
                        mla=mla_weights(layer.self_attn), **mlp)


__all__ = ["MLA_MODULES", "MlaWeights", "TraditionalRope", "cache_shape", "expanded", "is_mla", "layer_unsupported", "mla_layer",
           "mla_weights", "rope_of", "unsupported"]
