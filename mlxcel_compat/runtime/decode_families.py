"""Which models the CPU decode runtime (``cpu_decode.CpuDecoder``) runs, and how their families
differ: the tables of mlx-lm ``model_type`` values it takes, :func:`unsupported` (why another model
keeps MLX's step: the start-up log's reason), and the facts of a model's layout the decoder reads
(its attention shape, its sliding-window layers, the RoPE dimensions it rotates).

Why apart from the decoder: a new family is mostly a row here and a difference resolved in
``decode_layers.py``; the decoder itself is the pass.

Which models: mlx-lm's ``llama`` (and ``mistral``, which mlx-lm runs as llama), ``qwen2``,
``qwen3`` and ``gemma3_text`` modules, with float32 weights or weights in ggml's blocks
(``block_layers.py``), every layer the cache mlx-lm's ``make_cache`` gives it; and the
mixture-of-experts ``qwen3_moe``, ``qwen2_moe`` and ``olmoe`` (attention as qwen3's and qwen2's;
olmoe's q and k norms over the whole projection) where the
GGUF loader keeps the expert stacks in the file's blocks, or where they are mlx-lm's float
``SwitchLinear`` stacks (a directory, an F32 file: ``mlxcel_expert_matmul_f32``): each MoE layer runs in the same C loop
(router, softmax top-k, only the chosen experts' rows of the stacks grouped by expert, the
weighted sum, qwen2_moe's gated shared expert; ``decode_moe.py``); and the hybrids ``qwen3_5``,
``qwen3_5_moe`` and ``qwen3_next``: their gated delta-net layers in the same loop
(``decode_delta.py``: the recurrent state stays in each layer's ``ArraysCache``, updated in place
in arrays made for the sequence), their attention layers with a sigmoid output gate and a partial
RoPE (no prompt-cache borrowing, no speculative drafts there: the state cannot be trimmed); the
LFM2 hybrids ``lfm2`` and ``lfm2_moe`` (``decode_conv.py`` checks their layout: short convolutions
whose state stays in each layer's ``ArraysCache`` under the same rule, attention with per-head q/k
norms, SwiGLU or lfm2_moe's sigmoid-gated experts; the same restrictions);
``gpt_oss`` (top-k then softmax, biased experts, clamped SwiGLU, attention sinks, sliding-window
rings named by ``layer_types`` beside full layers, its prompt chunks' rings as Gemma 3's:
``ring_chunks.py``) and ``granitemoe`` (granite's multipliers). Gemma 3 brings
the sliding-window layers (a ring of ``sliding_window`` positions, their own RoPE base), the
GELU-gated MLP, four norms a layer plus per-head query and key norms (each ``1 + w``), the
embedding scaled by ``sqrt(hidden)`` (rounded through bfloat16, as mlx-lm does) and
``query_pre_attn_scalar``. Dense families with a row here beside llama's: ``granite``
(granite's multipliers), ``seed_oss`` and ``ernie4_5`` (biases, interleaved RoPE: llama's layer),
``smollm3`` (every fourth layer without RoPE: its NoPE module's angles are 0), ``olmo2`` and
``olmo3`` (each branch's output normed before its sum and no input norms; OLMo 3's sliding layers
by ``layer_types``), ``exaone4`` (the same norms, per-head q/k norms, local layers on rings and
global ones without RoPE), ``phi3`` (fused qkv and gate-up projections, LongRoPE over part of each
head) and ``glm4`` (fused gate-up, four norms a layer, half of each head rotated, interleaved),
``ministral3`` (Llama 4's attention temperature: the queries scaled by position), ``starcoder2``
(LayerNorms with biases, biases everywhere, an MLP without a gate: exact GELU), ``cohere2``
(attention and MLP in parallel from one LayerNorm, sliding layers with RoPE and global ones
without, logits times ``logit_scale``), ``apertus`` (an MLP without a gate: xIELU), ``gemma2``
(Gemma 3's layer without q/k norms, attention logit soft-capping in the attention kernels:
``decode_gemma2.py``) and ``exaone`` (EXAONE 3.5: llama's layer under its own module names,
seen through ``decode_exaone.runtime_view``).
``gemma4_text`` (dense and with experts) has its own decoder and pass (``decode_gemma4.py``: per-layer
head sizes, KV sharing, per-layer embeddings), which :func:`unsupported` asks.
The Mamba-2 hybrids: ``granitemoehybrid`` (Granite 4.0-H: Mamba-2 layers, ``decode_mamba.py``,
between attention layers without RoPE; granite's multipliers; granitemoe's experts beside a
shared MLP, or dense) and ``nemotron_h`` (Nemotron-H: its one-branch blocks paired into layers by
``decode_nemotron.py``, the MLP squared ReLU without a gate, a layer without an MLP where two
mixers follow each other).
DeepSeek's ``deepseek_v3`` and ``deepseek_v2`` bring multi-head latent attention (``decode_mla.py``:
each layer checked and held there, its cache in mlx-lm's own form) beside their MoE layers, whose
routers may rank expert groups first (``decode_moe.expert_groups``, glm4_moe's too).
Anything else (MLX-quantized weights, other families, a llama with sliding layers) keeps MLX's
step; ``cpu_decode.build`` says why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn

from mlxcel_compat.runtime import (decode_conv, decode_delta, decode_exaone, decode_gemma4, decode_mamba, decode_mla,
                                  decode_moe, decode_nemotron, kv_precision)
from mlxcel_compat.runtime.block_layers import BlockEmbedding, BlockLinear, block_weight_of
from mlxcel_compat.runtime.decode_layers import attention_heads, gemma_mlp, gemma_norm, head_dim, layer_mlp

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "qwen3_moe", "qwen2_moe", "olmoe", "qwen3_5",
               "qwen3_5_moe", "qwen3_next", "gpt_oss", "granitemoe", "granite", "seed_oss", "ernie4_5",
               "smollm3", "olmo2", "olmo3", "phi3", "glm4", "exaone4", "ministral3", "starcoder2",
               "cohere2", "apertus", "ernie4_5_moe", "glm4_moe", "gemma4_text", "granitemoehybrid",
               "nemotron_h", "gemma2", "exaone", "lfm2", "lfm2_moe", "deepseek_v3",
               "deepseek_v2")
# Families whose MoE layers the decode pass runs (decode_moe.py), attention as qwen3's and qwen2's
# (olmoe's q/k norms over the whole projection; gpt-oss's sinks and sliding layers).
MOE_TYPES = ("qwen3_moe", "qwen2_moe", "olmoe", "qwen3_5_moe", "qwen3_next", "gpt_oss", "granitemoe", "ernie4_5_moe",
             "glm4_moe", "granitemoehybrid", "lfm2_moe", "deepseek_v3", "deepseek_v2")
# Families whose attention is DeepSeek's multi-head latent attention (decode_mla.py), their layers
# checked and held there (MLP or MoE block included).
MLA_TYPES = ("deepseek_v3", "deepseek_v2")
# Hybrids: gated delta-net layers (decode_delta.py) between attention layers with an output gate and a
# partial RoPE.
HYBRID_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
# LFM2's hybrids (short convolutions between attention layers, their own names): decode_conv.CONV_TYPES,
# checked by decode_conv.unsupported; the same restrictions as these (the state cannot be trimmed).
# Families other than Gemma 3 whose sliding-window layers (named by the model's ``layer_types``)
# run on their RotatingKVCache rings here: gpt-oss's alternate with full ones.
LAYER_TYPE_WINDOWS = ("gpt_oss", "olmo3")
# Families whose layers norm each branch's output before its residual sum and not its input (OLMo 2, 3).
POST_NORM_TYPES = ("olmo2", "olmo3", "exaone4")
# RoPE modules that rotate nothing (smollm3's NoPE layers; EXAONE 4's global layers have none at all):
# their angles are 0, cos 1 and sin 0.
NO_ROPE = ("NoPE",)
# Families whose queries are scaled by position after RoPE (Llama 4's attention temperature: ministral3).
Q_TEMPERATURE_TYPES = ("ministral3",)
# Families whose norms are LayerNorms (mean and variance; starcoder2's with a bias).
LAYER_NORM_TYPES = ("starcoder2", "cohere2")
# The MLP's projections where they are not gate, up and down (or phi3's and glm4's gate_up, down).
MLP_PROJECTIONS = {"starcoder2": ("c_fc", "c_proj"), "apertus": ("up_proj", "down_proj")}
# Families whose attention and MLP both read the layer's one norm, their outputs summed (cohere2).
PARALLEL_TYPES = ("cohere2",)
# The MLP's activation by family (decode_pass.ACT_CODES); the others' is SwiGLU.
ACTIVATIONS = {"gemma3_text": "gelu_tanh_gate", "gemma2": "gelu_tanh_gate", "starcoder2": "gelu_erf", "apertus": "xielu",
               "nemotron_h": "relu2"}
# Families with granite's multipliers (embedding, residual branches, logits).
MULTIPLIER_TYPES = ("granitemoe", "granite", "granitemoehybrid")
# mlx-lm's stacked-expert modules (switch_layers.py): in another family, an MoE layer the decode pass has no kernel for.
EXPERT_MODULES = ("SwitchGLU", "SwitchMLP", "BlockSwitchGLU",  # BlockSwitchGLU: block_experts.py
                  "FusedGateUpSwitchGLU")  # Gemma 4's fused gate-up experts (gguf/stored_parts.py)
# the Gemma layer: GELU gating, 1 + w norms (Gemma 3's sliding windows and per-head q/k norms;
# Gemma 2's attention soft-capping: decode_gemma2.py)
GEMMA_TYPES = ("gemma3_text", "gemma2")

@dataclass(frozen=True)
class LogitTransform:
    """What a family does to the output head's logits after the product, in mlx-lm's order:
    granite's division by ``logits_scaling``, cohere2's ``logit_scale`` factor, Gemma 2's and
    Gemma 4's final soft-capping (``tanh(x / cap) * cap``).

    Why one place: the CPU decode runtime applies it to the rows its pass returns (NumPy) and
    ``engine/forward.last_row_logits`` to the last row MLX computes for a prompt-cache hit's rest; the
    two must be the same expression, or a hit would differ from a cold run."""

    divisor: float | None = None
    factor: float | None = None
    softcap: float | None = None

    def apply(self, logits: Any, tanh: Callable[[Any], Any]) -> Any:
        """``logits`` transformed (a new array), with ``tanh`` the array library's (``np.tanh``,
        ``mx.tanh``)."""
        if self.divisor is not None:
            logits = logits / self.divisor
        if self.factor is not None:
            logits = logits * self.factor
        if self.softcap is not None:
            logits = tanh(logits / self.softcap) * self.softcap
        return logits

    @property
    def identity(self) -> bool:
        return self.divisor is None and self.factor is None and self.softcap is None


def logit_transform(model: Any) -> LogitTransform:
    """The family's :class:`LogitTransform` (all None: the head's product as it is)."""
    model_type = getattr(getattr(model, "args", None), "model_type", None)
    inner = getattr(model, "model", None)
    return LogitTransform(
        divisor=float(model.logits_scaling) if model_type in MULTIPLIER_TYPES else None,
        factor=float(inner.args.logit_scale) if model_type in PARALLEL_TYPES else None,
        softcap=getattr(model, "final_logit_softcapping", None) or None)


def head_module(model: Any) -> Any:
    """The output projection's module: ``lm_head``, or the embedding when the head is tied
    (mlx-lm drops ``lm_head`` then; gemma3 also says so by ``tie_word_embeddings``); qwen3_5's
    is its ``language_model``'s."""
    model = getattr(model, "language_model", model)
    if getattr(model, "tie_word_embeddings", False) or not hasattr(model, "lm_head"):
        return model.model.embed_tokens
    return model.lm_head


def unsupported(model: Any) -> str | None:
    """Why this model's decode steps stay in MLX, or None if :class:`CpuDecoder` runs them."""
    # Nemotron-H's blocks paired into the decoder's layers; EXAONE 3.5's modules under llama's names
    model = decode_exaone.runtime_view(decode_nemotron.decoder_view(model))
    model_type = getattr(getattr(model, "args", None), "model_type", None)
    if model_type == decode_gemma4.MODEL_TYPE:  # its own decoder and pass (decode_gemma4.py)
        return decode_gemma4.unsupported(model)
    if model_type not in MOE_TYPES and any(type(m).__name__ in EXPERT_MODULES for _, m in model.named_modules()):
        return (f"mixture-of-experts layers ({model_type}): their steps run in MLX, the experts' products on "
                f"ggml's blocks where the file's are quantized")
    if model_type not in MODEL_TYPES:
        return f"model type {model_type!r} (supported: {', '.join(MODEL_TYPES)})"
    if any(type(m).__name__.startswith("Quantized") for _, m in model.named_modules()):
        return "quantized weights"
    if model_type in decode_nemotron.PAIRED_TYPES:  # its own layout (decode_nemotron.py)
        return decode_nemotron.unsupported(model)
    if model_type in decode_conv.CONV_TYPES:  # LFM2's layout: its short convolutions, its names (decode_conv.py)
        return decode_conv.unsupported(model)
    gemma = model_type in GEMMA_TYPES
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers or not isinstance(getattr(inner, "embed_tokens", None), (nn.Embedding, BlockEmbedding)):
        return "unexpected module layout"
    if model_type not in LAYER_TYPE_WINDOWS and not gemma and getattr(model.args, "sliding_window", None) and any(
            t != "full_attention" for t in getattr(model.args, "layer_types", None) or ()):
        return "sliding-window layers"
    norm_type = gemma_norm() if gemma else nn.LayerNorm if model_type in LAYER_NORM_TYPES else nn.RMSNorm
    norm_names = ("input_layernorm", "post_attention_layernorm")
    if model_type in POST_NORM_TYPES:
        norm_names = ("post_attention_layernorm", "post_feedforward_layernorm")
    elif model_type == "glm4":
        norm_names += ("post_self_attn_layernorm", "post_mlp_layernorm")
    elif model_type in PARALLEL_TYPES:
        norm_names = ("input_layernorm",)
    elif model_type == "apertus":
        norm_names = ("attention_layernorm", "feedforward_layernorm")
    if gemma:
        norm_names += ("pre_feedforward_layernorm", "post_feedforward_layernorm")
    head = head_module(model)
    weights = [m.weight for m in (inner.embed_tokens, head) if block_weight_of(m) is None]
    hybrid = model_type in HYBRID_TYPES
    if model_type in MLA_TYPES and any(kv_precision.of_model(model).blocks):
        return f"latent attention layers ({model_type}) with a KV cache in ggml's blocks (-ctk/-ctv q8_0, q4_0)"
    if all(decode_delta.is_delta(layer) or decode_mamba.is_mamba(layer) for layer in layers):
        return "no attention layer (a recurrent model's position is its attention layers')"
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), layer_mlp(layer)
        if model_type in MLA_TYPES and decode_mla.is_mla(attn):  # the whole layer checked there
            reason = decode_mla.layer_unsupported(layer, model_type)
            if reason is not None:
                return reason
            continue
        mamba = decode_mamba.is_mamba(layer)  # Granite 4.0-H's Mamba-2 layers, in place of attention
        if mamba:
            reason = decode_mamba.unsupported(decode_mamba.mixer_of(layer)) or decode_mamba.shared_mlp_unsupported(layer)
            if reason is not None:
                return f"Mamba-2 layers ({model_type}): {reason}"
        delta = hybrid and decode_delta.is_delta(layer) or mamba
        if delta and not mamba:
            reason = decode_delta.unsupported(layer.linear_attn)
            if reason is not None:
                return f"gated delta-net layers ({model_type}): {reason}"
        if model_type in MOE_TYPES and decode_moe.is_moe(mlp):
            reason = decode_moe.unsupported(mlp)
            if reason is not None:
                return f"mixture-of-experts layers ({model_type}): {reason}"
            moe_linears = decode_moe.shared_modules(mlp)  # router, shared expert: checked as the projections
            reason = decode_mamba.shared_mlp_unsupported(layer)  # Granite 4.0-H's shared MLP beside the experts
            if reason is not None:
                return f"mixture-of-experts layers ({model_type}): {reason}"
            moe_linears += decode_mamba.shared_mlp_modules(layer)
            mlp = None  # the MLP's checks below do not apply
        elif (attn is None and not delta) or mlp is None or not any(
                c.__name__ in ("MLP", "Qwen3NextMLP", "Olmo3MLP", "Glm4MLP", "ApertusMLP", "Ernie4_5_MLP",
                               "GraniteMoeHybridMLP", "ExaoneMLP") for c in type(mlp).__mro__):
            return "unexpected layer layout"
        if gemma and not isinstance(mlp, gemma_mlp()):
            return "unexpected layer layout"
        fused_qkv = not delta and hasattr(attn, "qkv_proj")  # phi3
        projections = (decode_mamba.linear_modules(decode_mamba.mixer_of(layer)) if mamba
                       else decode_delta.linear_modules(layer.linear_attn) if delta
                       else [getattr(attn, n, None) for n in (("qkv_proj",) if fused_qkv else ("q_proj", "k_proj", "v_proj"))
                             + ("o_proj",)])
        if mlp is None:
            projections += moe_linears
        else:
            projections += [getattr(mlp, n, None) for n in MLP_PROJECTIONS.get(model_type, (("gate_up_proj", "down_proj")
                            if hasattr(mlp, "gate_up_proj") else ("gate_proj", "up_proj", "down_proj")))]
        if not all(isinstance(m, (nn.Linear, BlockLinear)) for m in projections) or (
                not delta and attention_shape(attn) is None):
            return "unexpected attention layout"
        norms = [getattr(layer, n, None) for n in norm_names]
        norms += [getattr(attn, n, None) for n in ("q_norm", "k_norm") if not delta and hasattr(attn, n)]
        if not all(isinstance(n, norm_type) for n in norms):
            return "norms other than Gemma's RMSNorm" if gemma else "norms other than RMSNorm"
        dims = None if delta else rotated_dims(layer_rope(attn), attention_shape(attn)[2])
        if not delta and dims != attention_shape(attn)[2] and not (
                isinstance(dims, int) and 0 < dims < attention_shape(attn)[2] and dims % 2 == 0):
            return "partial or unknown rotary embedding"
        weights += [m.weight for m in projections if block_weight_of(m) is None]
    if any(w.dtype != mx.float32 for w in weights):
        return "weights are neither float32 nor in ggml's blocks"
    return None


def rotated_dims(rope: Any, head_dim: int) -> int | None:
    """How many of a head's dimensions a RoPE module rotates (``dims``; phi3's SuScaledRoPE:
    ``dim``); all of them for a module that rotates none (NoPE: its angles are 0)."""
    if rope is None or type(rope).__name__ in NO_ROPE:  # EXAONE 4's global layers have no module
        return head_dim
    dims = getattr(rope, "dims", getattr(rope, "dim", None))
    return dims if isinstance(dims, int) else None


def attention_shape(attn: Any) -> tuple[int, int, int] | None:
    """(heads, KV heads, head size) of an attention module: mlx-lm's llama-style one (gpt-oss's
    names too: ``decode_layers.attention_heads``), or the hybrids' (qwen3_next's attention: its q
    projection twice as wide, queries and gates)."""
    if type(attn).__name__ in decode_delta.GATED_ATTENTION:
        return attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim
    heads = attention_heads(attn)
    if heads is None:
        return None
    return heads[0], heads[1], head_dim(attn)


def sliding_layers(model: Any) -> list[bool]:
    """Which layers attend over a sliding window (a ``RotatingKVCache`` ring of ``sliding_window``
    slots): Gemma 3's say so (``is_sliding``), gpt-oss's model names them in ``layer_types``."""
    inner = model.model
    if model.args.model_type in LAYER_TYPE_WINDOWS:
        return [t == "sliding_attention" for t in inner.layer_types]
    attns = [getattr(layer, "self_attn", None) for layer in inner.layers]  # EXAONE 4 says is_local, cohere2
    return [bool(getattr(a, "is_sliding", getattr(a, "is_local", getattr(a, "use_sliding_window", False))))
            for a in attns]


def layer_rope(attn: Any) -> Any:
    """The RoPE module a layer applies, or None where it applies none: EXAONE 4's global layers
    have no module, cohere2's have one they do not call (only its sliding layers rotate)."""
    if attn is None or getattr(attn, "use_sliding_window", True) is False:
        return None
    if decode_mla.is_mla(attn):  # its rotary part's module (deepseek_v2's says neither its width nor its layout)
        return decode_mla.rope_of(attn)
    return getattr(attn, "rope", None)


__all__ = ["EXPERT_MODULES", "GEMMA_TYPES", "MLA_TYPES", "HYBRID_TYPES", "LAYER_TYPE_WINDOWS", "MODEL_TYPES", "MOE_TYPES",
           "MULTIPLIER_TYPES", "NO_ROPE", "PARALLEL_TYPES", "POST_NORM_TYPES", "Q_TEMPERATURE_TYPES",
           "ACTIVATIONS", "LAYER_NORM_TYPES", "MLP_PROJECTIONS", "layer_rope", "attention_shape", "head_module", "rotated_dims",
           "sliding_layers", "unsupported"]
