"""What the CPU decode runtime (``cpu_decode.CpuDecoder``) holds of a model: each layer's weights as
NumPy buffers or ggml blocks, with their addresses taken once, as each family applies them, and
the activation buffers of a pass.

Why: the C loop (``native/decode_pass.py`` describes these to it once) reads the weights in place,
so they are taken from the modules as they are (float32 buffers, ``BlockWeight``s, the LoRA
adapters served unfused) and only the families' differences are resolved here: Gemma 3's four
norms a layer, each ``1 + w``, its attention's and MLP's outputs normed before the residual sum,
its sliding-window layers; qwen3's and gemma3's per-head query and key norms; gpt-oss's
attention sinks (one logit per query head in the softmax's denominator, kept times log2 e as
the C softmax is a power of 2) and its sliding layers (named by ``layer_types``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.nn as nn
import numpy as np

from mlxcel_compat.runtime.block_layers import block_weight_of
from mlxcel_compat.runtime.block_weight import BlockWeight
from mlxcel_compat.runtime.lora_rows import Factor, factors_of
from mlxcel_compat.runtime.native import decode_pass


def check_token_ids(tokens: list[int], vocab: int) -> None:
    """Refuse a token id outside the vocabulary before a pass reads its embedding row: NumPy would
    wrap a negative index silently, and the block embedding's C reader would read out of bounds."""
    for token in tokens:
        if not 0 <= token < vocab:
            raise ValueError(f"token id {token} is outside the vocabulary (0..{vocab - 1})")


def float32_array(a: Any) -> np.ndarray:
    """A float32 NumPy view of an evaluated MLX array (its buffer), or a contiguous copy."""
    return np.ascontiguousarray(np.asarray(a), dtype=np.float32)


@dataclass
class LoraFactors:
    """One adapter on one projection (``lora_rows.Factor``) with its factors' addresses."""

    factor: Factor
    a_ptr: int = field(init=False)  # (r, K)
    b_ptr: int = field(init=False)  # (N, r)

    def __post_init__(self) -> None:
        self.a_ptr, self.b_ptr = self.factor.a.ctypes.data, self.factor.b.ctypes.data

    @property
    def rank(self) -> int:
        return self.factor.a.shape[0]


@dataclass
class LinearWeights:
    """A projection's weight, bias and unfused adapters, as the C loop reads them."""

    weight: np.ndarray | BlockWeight  # (N, K): the module's own float32 buffer, or its blocks
    bias: np.ndarray | None
    lora: list[LoraFactors] = field(default_factory=list)  # adapters served unfused (lora/layers.py)
    ptr: int = field(init=False)  # the weight's address, taken once (``ndarray.ctypes`` costs ~1 us a call)
    block: BlockWeight | None = field(init=False)  # quantized (ggml's kernels), else None

    def __post_init__(self) -> None:
        self.block = self.weight if isinstance(self.weight, BlockWeight) else None
        self.ptr = 0 if self.block is not None else self.weight.ctypes.data


@dataclass
class NormWeights:
    """A norm's gain as the model applies it, and its epsilon: an RMS norm, or (``layer``) a
    LayerNorm with its bias, if any (starcoder2's, cohere2's)."""

    weight: np.ndarray
    eps: float
    bias: np.ndarray | None = None
    layer: bool = False
    ptr: int = field(init=False)

    def __post_init__(self) -> None:
        self.ptr = self.weight.ctypes.data


@dataclass
class LayerWeights:
    """One decoder layer: its norms and projections, and which RoPE module and cache kind it takes."""

    n1: NormWeights | None  # before attention (None: OLMo 2, whose branches are normed after)
    n2: NormWeights | None  # before the MLP
    q: LinearWeights | None  # None in a delta-net layer (``delta``)
    k: LinearWeights | None
    v: LinearWeights | None
    o: LinearWeights | None
    gate: LinearWeights | None  # None in a mixture-of-experts layer (``moe``)
    up: LinearWeights | None
    down: LinearWeights | None
    q_norm: NormWeights | None  # qwen3's and gemma3's per-head norms
    k_norm: NormWeights | None
    attn_out: NormWeights | None = None  # gemma3: the attention's output is normed before the residual sum
    mlp_out: NormWeights | None = None  # and the MLP's
    sliding: bool = False  # gemma3: a sliding-window layer (its cache a RotatingKVCache ring)
    rope: int = 0  # which of the decoder's RoPE modules (gemma3: sliding layers have their own base)
    moe: Any = None  # a mixture-of-experts layer in place of the MLP (decode_moe.MoeWeights), or None
    delta: Any = None  # a hybrid's gated delta-net in place of attention (decode_delta.DeltaWeights), or None
    gated_q: bool = False  # the hybrids' attention: q's projection holds per head d queries and d gates
    sinks: np.ndarray | None = None  # gpt-oss: (heads) attention sink logits times log2 e, float32
    qkv: LinearWeights | None = None  # phi3: q, k and v in one projection (then q, k, v are None)
    gate_up: LinearWeights | None = None  # phi3, glm4: gate and up in one projection (then gate, up are None)
    xielu: tuple[float, float, float, float] | None = None  # Apertus's activation: alpha_p, alpha_n, beta, eps
    mamba: Any = None  # a Mamba-2 mixer in place of attention (decode_mamba.MambaWeights), or None
    conv: Any = None  # LFM2's short convolution in place of attention (decode_conv.ConvWeights), or None
    mla: Any = None  # DeepSeek's latent attention in place of q, k, v, o (decode_mla.MlaWeights), or None

    @property
    def recurrent(self) -> Any:
        """The weights of a layer that holds recurrent state instead of KV (``delta``, ``mamba`` or
        ``conv``: ``decode_delta.state_shapes`` reads their state's shapes), or None."""
        return next((w for w in (self.delta, self.mamba, self.conv) if w is not None), None)


@dataclass
class PassBuffers:
    """One pass's activations for ``rows`` rows, allocated once per row count, and the C
    structure that points at them."""

    x: np.ndarray  # (rows, hidden): the residual stream
    h: np.ndarray  # (rows, hidden): normed
    branch: np.ndarray  # (rows, hidden): gemma3's attention or MLP output, before its norm
    q: np.ndarray  # (rows, heads * head_dim)
    k_new: np.ndarray  # (rows, kv_heads * head_dim): the new keys
    v_new: np.ndarray  # and values
    att: np.ndarray  # (rows, heads * head_dim)
    gate: np.ndarray  # (rows, intermediate)
    up: np.ndarray
    logits: np.ndarray  # (rows, vocabulary)
    q_scale: np.ndarray  # (rows, 1): ministral3's queries' factor by position
    native: decode_pass.NativeBuffers = field(init=False)

    def __post_init__(self) -> None:
        self.native = decode_pass.buffers({name: a for name, a in vars(self).items() if isinstance(a, np.ndarray)})


def attention_heads(attn: Any) -> tuple[int, int, float] | None:
    """An attention module's query heads, KV heads and softmax scale, under mlx-lm's names
    (``n_heads``, ``n_kv_heads``, ``scale``; gpt-oss's ``num_attention_heads``,
    ``num_key_value_heads``, ``sm_scale``; OLMo 3's with ``scale``), or None where it has none of them set."""
    for names in (("n_heads", "n_kv_heads", "scale"), ("num_attention_heads", "num_key_value_heads", "sm_scale"),
                  ("num_attention_heads", "num_key_value_heads", "scale"),
                  ("num_heads", "num_key_value_heads", "scale")):  # Nemotron-H's
        if all(hasattr(attn, n) for n in names):
            heads, kv_heads, scale = (getattr(attn, n) for n in names)
            return int(heads), int(kv_heads), float(scale)
    return None


def head_dim(attn: Any) -> int:
    """The head size of an attention module: its query projection's rows over its heads (phi3's
    fused projection: its ``head_dim``)."""
    if not hasattr(attn, "q_proj"):
        return int(attn.head_dim)
    block = block_weight_of(attn.q_proj)
    rows = block.n if block is not None else attn.q_proj.weight.shape[0]
    return rows // attention_heads(attn)[0]


def gemma_norm() -> tuple[type, ...]:
    """mlx-lm's Gemma RMS norms, Gemma 3's and Gemma 2's (they scale by ``1 + w``; nn.RMSNorm by ``w``)."""
    from mlx_lm.models.gemma3_text import RMSNorm

    from mlxcel_compat.runtime.decode_gemma2 import gemma2_classes

    return RMSNorm, gemma2_classes()[0]


def gemma_mlp() -> tuple[type, ...]:
    """mlx-lm's Gemma 3 and Gemma 2 MLPs: ``down(gelu_approx(gate(x)) * up(x))``."""
    from mlx_lm.models.gemma3_text import MLP

    from mlxcel_compat.runtime.decode_gemma2 import gemma2_classes

    return MLP, gemma2_classes()[1]


def layer_mlp(layer: Any) -> Any:
    """A decoder layer's MLP or MoE block: ``mlp``, granitemoe's ``block_sparse_moe``, LFM2's
    ``feed_forward``; None if none."""
    if hasattr(layer, "mlp"):
        return layer.mlp
    return getattr(layer, "block_sparse_moe", getattr(layer, "feed_forward", None))


def linear_weights(module: Any) -> LinearWeights:
    """A linear (or block) layer's weight, bias and adapters."""
    bias = module.bias if "bias" in module else None
    return LinearWeights(block_weight_of(module) or float32_array(module.weight),
                         float32_array(bias) if bias is not None else None,
                         [LoraFactors(f) for f in factors_of(module)])


def norm_weights(module: Any) -> NormWeights | None:
    """The norm's gain as the model applies it: ``w``, or Gemma's ``1 + w`` (computed by MLX
    in float32, as the module computes it on every call)."""
    if module is None:
        return None
    if isinstance(module, nn.LayerNorm):
        bias = getattr(module, "bias", None)
        return NormWeights(float32_array(module.weight), float(module.eps),
                           float32_array(bias) if bias is not None else None, layer=True)
    gain = 1.0 + module.weight if isinstance(module, gemma_norm()) else module.weight
    return NormWeights(float32_array(gain), float(module.eps))


def xielu_parameters(act: Any) -> tuple[float, float, float, float]:
    """Apertus's xIELU as mlx-lm's ``xielu`` applies it: alpha_p = softplus(alpha_p), alpha_n =
    beta + softplus(alpha_n) (computed by MLX in float32), beta, eps."""
    alpha_p = nn.softplus(act.alpha_p)
    alpha_n = act.beta + nn.softplus(act.alpha_n)
    return tuple(float(np.float32(np.array(v))) for v in (alpha_p, alpha_n, act.beta, act.eps))


def layer_weights(layer: Any, rope: int, gemma: bool, moe: Any = None, sliding: bool = False) -> LayerWeights:
    """One of the model's layers, ``rope`` the index of its RoPE module, ``gemma`` for Gemma 3's
    layer, ``moe`` its mixture-of-experts block's weights (``decode_moe.moe_weights``) in place of an MLP,
    ``sliding`` for a sliding-window layer of another family (gpt-oss; Gemma 3's says so itself)."""
    a, m, lin, norm = layer.self_attn, layer_mlp(layer), linear_weights, norm_weights
    if moe is not None:
        mlp = dict(gate=None, up=None, down=None, moe=moe)
    elif hasattr(m, "gate_up_proj"):  # phi3, glm4: fused, gate first (mlx-lm splits the output in halves)
        mlp = dict(gate=None, up=None, gate_up=lin(m.gate_up_proj), down=lin(m.down_proj))
    elif hasattr(m, "c_fc"):  # starcoder2: no gate (up, GELU, down)
        mlp = dict(gate=None, up=lin(m.c_fc), down=lin(m.c_proj))
    elif not hasattr(m, "gate_proj"):  # Apertus: no gate (up, xIELU, down)
        mlp = dict(gate=None, up=lin(m.up_proj), down=lin(m.down_proj), xielu=xielu_parameters(m.act_fn))
    else:
        mlp = dict(gate=lin(m.gate_proj), up=lin(m.up_proj), down=lin(m.down_proj))
    qkv = dict(q=None, k=None, v=None, qkv=lin(a.qkv_proj)) if hasattr(a, "qkv_proj") else dict(
        q=lin(a.q_proj), k=lin(a.k_proj), v=lin(a.v_proj))
    common = dict(**qkv, o=lin(a.o_proj), **mlp,
                  q_norm=norm(getattr(a, "q_norm", None)), k_norm=norm(getattr(a, "k_norm", None)), rope=rope,
                  sinks=sink_logits(a))
    if gemma:  # post_attention_layernorm norms the attention's output; pre_feedforward the MLP's input
        return LayerWeights(n1=norm(layer.input_layernorm), n2=norm(layer.pre_feedforward_layernorm),
                            attn_out=norm(layer.post_attention_layernorm), mlp_out=norm(layer.post_feedforward_layernorm),
                            sliding=bool(getattr(a, "is_sliding", False)), **common)  # Gemma 2: none
    if hasattr(layer, "attention_layernorm"):  # Apertus's names
        return LayerWeights(n1=norm(layer.attention_layernorm), n2=norm(layer.feedforward_layernorm),
                            sliding=sliding, **common)
    if not hasattr(layer, "post_attention_layernorm") and hasattr(layer, "input_layernorm"):  # cohere2: one norm
        return LayerWeights(n1=norm(layer.input_layernorm), n2=None, sliding=sliding, **common)
    if hasattr(layer, "post_self_attn_layernorm"):  # glm4: both branches' inputs and outputs normed
        return LayerWeights(n1=norm(layer.input_layernorm), n2=norm(layer.post_attention_layernorm),
                            attn_out=norm(layer.post_self_attn_layernorm), mlp_out=norm(layer.post_mlp_layernorm),
                            sliding=sliding, **common)
    if not hasattr(layer, "input_layernorm"):  # OLMo 2: each branch's output normed before its sum, no input norms
        return LayerWeights(n1=None, n2=None, attn_out=norm(layer.post_attention_layernorm),
                            mlp_out=norm(layer.post_feedforward_layernorm), sliding=sliding, **common)
    return LayerWeights(n1=norm(layer.input_layernorm), n2=norm(layer.post_attention_layernorm), sliding=sliding,
                        **common)


LOG2E = 1.4426950408889634


def sink_logits(attn: Any) -> np.ndarray | None:
    """gpt-oss's attention sinks (``attn.sinks``, one logit per query head) times log2 e, as the
    C softmax's powers of 2 take them; None for an attention without sinks."""
    sinks = getattr(attn, "sinks", None)
    if sinks is None:
        return None
    return (float32_array(sinks) * np.float32(LOG2E)).astype(np.float32)


__all__ = ["attention_heads", "LayerWeights", "LinearWeights", "LoraFactors", "NormWeights", "PassBuffers", "float32_array",
           "gemma_mlp", "gemma_norm", "head_dim", "layer_mlp", "layer_weights", "linear_weights", "norm_weights", "sink_logits"]
