"""Hybrid and recurrent families: the factory's rows for them, their configs and their GGUF conversion.

Each family is named by its mlx-lm ``model_type`` and built at small sizes with its real model's
config structure; :data:`GGUF_TARGETS` says what llama.cpp's converter does to it.

The directories hold mlx-lm's layout (what ``sanitize`` leaves: convolutions as ``(C, K, 1)``,
Qwen3.5's norms as plain gains). The GGUF conversions here start from that layout, take it back
to the checkpoint's (the names, ``1 + w`` norms) and apply what ``convert_hf_to_gguf.py`` applies
to the checkpoint, step by step, so the loader's undo steps are checked against an independent
writing of the converter's rules (and against the converter itself: ``docs/gguf.md``).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .family import Family
from .gguf_target import GgufTarget

FAMILIES: tuple[Family, ...] = (
    # Qwen3.5 (dense): gated delta-net layers, every fourth layer full attention with a gated query.
    Family("qwen3_5", "Qwen3_5ForCausalLM", thinking=True, add_bos=False, norm_one=1.0),
    # Qwen3.5 MoE: the same layers with a routed mixture of experts and a gated shared expert.
    Family("qwen3_5_moe", "Qwen3_5MoeForCausalLM", thinking=True, add_bos=False, norm_one=1.0),
    # Gemma 4 E2B's layer kinds: per-layer embeddings, layers that share earlier layers' KV (with
    # double-wide MLPs), sliding layers with a smaller head than the full ones, logit soft-capping.
    Family("gemma4_text", "Gemma4ForCausalLM", thinking=False, add_bos=False, norm_one=1.0),
    # Gemma 4 26B-A4B's: a dense MLP beside routed experts in every layer, full layers whose keys
    # are their values and with fewer KV heads.
    Family("gemma4_text_moe", "Gemma4ForCausalLM", thinking=False, add_bos=False, norm_one=1.0,
           model_type="gemma4_text"),
    # Granite 4.0-H (Tiny's structure): Mamba-2 layers with a few attention layers without RoPE,
    # every MLP a mixture of experts beside a shared MLP, Granite's multipliers.
    Family("granitemoehybrid", "GraniteMoeHybridForCausalLM", thinking=False, add_bos=False, norm_one=1.0),
    # Nemotron-H (8B's structure): Mamba-2 layers (grouped gated norm), attention layers without
    # RoPE and squared-ReLU MLP layers, each its own block.
    Family("nemotron_h", "NemotronHForCausalLM", thinking=False, add_bos=False, norm_one=1.0),
)


def _qwen3_5_config(size: str) -> dict[str, Any]:
    # Qwen3.5-9B's structure: 3 delta-net layers to 1 attention layer, twice as many value heads
    # as key heads in the delta-net (so the converter's value-head reorder is exercised), GQA,
    # a quarter of each head rotated, an untied output head.
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, intermediate_size=192, linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=16)
        sections = [1, 1, 0]  # half of the 4 rotated dimensions
    else:
        dims = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=6, num_key_value_heads=2,
                    head_dim=128, intermediate_size=2048, linear_num_key_heads=6, linear_num_value_heads=12,
                    linear_key_head_dim=64, linear_value_head_dim=64)
        sections = [6, 5, 5]
    interval = 4
    layer_types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                   for i in range(dims["num_hidden_layers"])]
    return dict(dims, full_attention_interval=interval, layer_types=layer_types, linear_conv_kernel_dim=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": sections, "mrope_interleaved": True},
                rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, hidden_act="silu")


def _qwen3_5_moe_config(size: str) -> dict[str, Any]:
    # Qwen3.5-35B-A3B's structure: every layer's MLP a mixture (softmax router, top-k renormalised)
    # plus a shared expert behind a sigmoid gate; no dense intermediate_size in its config.
    config = _qwen3_5_config(size)
    del config["intermediate_size"]
    if size == "tiny":
        config.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    else:
        config.update(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
                      shared_expert_intermediate_size=64)
    return config


def _gemma4_layers(n_layers: int, period: int) -> list[str]:
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n_layers)]


def _gemma4_text_config(size: str) -> dict[str, Any]:
    from . import tokenizer as tok

    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
                    head_dim=16, global_head_dim=32, intermediate_size=128, hidden_size_per_layer_input=16,
                    num_kv_shared_layers=3, sliding_window=64, layer_types=_gemma4_layers(6, 3))
    else:
        dims = dict(hidden_size=768, num_hidden_layers=15, num_attention_heads=8, num_key_value_heads=1,
                    head_dim=64, global_head_dim=128, intermediate_size=1408, hidden_size_per_layer_input=64,
                    num_kv_shared_layers=5, sliding_window=512, layer_types=_gemma4_layers(15, 5))
    return dict(dims, vocab_size_per_layer_input=tok.VOCAB_SIZE, use_double_wide_mlp=True, attention_k_eq_v=False,
                num_global_key_value_heads=None, enable_moe_block=False, num_experts=None, top_k_experts=None,
                moe_intermediate_size=None, **_GEMMA4_COMMON)


def _gemma4_text_moe_config(size: str) -> dict[str, Any]:
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    num_global_key_value_heads=1, head_dim=16, global_head_dim=32, intermediate_size=64,
                    num_experts=8, top_k_experts=2, moe_intermediate_size=32, sliding_window=64,
                    layer_types=_gemma4_layers(4, 4))
    else:
        dims = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=8, num_key_value_heads=4,
                    num_global_key_value_heads=2, head_dim=64, global_head_dim=128, intermediate_size=512,
                    num_experts=8, top_k_experts=2, moe_intermediate_size=256, sliding_window=512,
                    layer_types=_gemma4_layers(12, 6))
    return dict(dims, hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False,
                attention_k_eq_v=True, enable_moe_block=True, **_GEMMA4_COMMON)


_GEMMA4_COMMON: dict[str, Any] = dict(
    rms_norm_eps=1e-6, final_logit_softcapping=30.0, tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh",
    rope_parameters={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                        "rope_theta": 1000000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})


def _granitemoehybrid_config(size: str) -> dict[str, Any]:
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    layer_types=["mamba", "mamba", "attention", "mamba"], mamba_n_heads=8, mamba_d_head=16,
                    mamba_d_state=16, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                    shared_intermediate_size=64, attention_multiplier=0.0625)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                    layer_types=["attention" if i % 6 == 5 else "mamba" for i in range(12)], mamba_n_heads=24,
                    mamba_d_head=64, mamba_d_state=64, num_local_experts=8, num_experts_per_tok=2,
                    intermediate_size=160, shared_intermediate_size=512, attention_multiplier=0.015625)
    return dict(dims, mamba_expand=2, mamba_n_groups=1, mamba_d_conv=4, mamba_conv_bias=True, mamba_proj_bias=False,
                position_embedding_type="nope", embedding_multiplier=12.0, residual_multiplier=0.22,
                logits_scaling=6.0, rms_norm_eps=1e-5, rope_theta=10000.0, attention_bias=False, mlp_bias=False,
                tie_word_embeddings=True, hidden_act="silu")


def _nemotron_h_config(size: str) -> dict[str, Any]:
    if size == "tiny":
        dims = dict(hidden_size=64, hybrid_override_pattern="M-M*-M-", num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
                    intermediate_size=128)
    else:
        dims = dict(hidden_size=768, hybrid_override_pattern="M-M-M*-M-M-M*-", num_attention_heads=8,
                    num_key_value_heads=2, head_dim=96, mamba_num_heads=24, mamba_head_dim=64, ssm_state_size=64,
                    n_groups=4, intermediate_size=5632)
    return dict(dims, num_hidden_layers=len(dims["hybrid_override_pattern"]), conv_kernel=4, layer_norm_epsilon=1e-5,
                attention_bias=False, mlp_bias=False, use_bias=False, use_conv_bias=True, mamba_proj_bias=False,
                mlp_hidden_act="relu2", tie_word_embeddings=False)


CONFIGS: dict[str, Callable[[str], dict[str, Any]]] = {
    "granitemoehybrid": _granitemoehybrid_config,
    "nemotron_h": _nemotron_h_config,
    "qwen3_5": _qwen3_5_config,
    "qwen3_5_moe": _qwen3_5_moe_config,
    "gemma4_text": _gemma4_text_config,
    "gemma4_text_moe": _gemma4_text_moe_config,
}


# --- Qwen3.5: what convert_hf_to_gguf.py's Qwen3_5TextModel (Qwen3NextModel, _LinearAttentionVReorderBase) does

# Norms that Qwen3.5's checkpoint stores as w - 1 (mlx-lm's sanitize adds the 1), and the converter
# stores as w + 1: every norm but the delta-net's gated one.
_QWEN35_SHIFTED_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                         ".q_norm.weight", ".k_norm.weight")


def _qwen3_5_name(mlx_name: str) -> str:
    """mlx-lm's name -> the converter's: the checkpoint has no ``language_model.`` wrapper, and the
    converter renames ``dt_bias`` to ``dt_proj.bias``."""
    name = mlx_name.removeprefix("language_model.")
    name = name.replace(".mlp.switch_mlp.", ".mlp.experts.")  # the converter's merged expert names
    return name.replace(".linear_attn.dt_bias", ".linear_attn.dt_proj.bias")


def _tiled(data: np.ndarray, axis: int, n_k: int, per_k: int, width: int) -> np.ndarray:
    """The converter's ``_reorder_v_heads``: value heads grouped by key head -> tiled."""
    shape = list(data.shape)
    grouped = data.reshape(*shape[:axis], n_k, per_k, width, *shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(grouped, axis, axis + 1).reshape(shape))


def _qwen3_next_convert(config: dict[str, Any], name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Qwen3NextModel.modify_tensors: norms, ``A_log``, the convolution, and ``in_proj_qkvz`` split
    into every head's q, k, v (``attn_qkv``) and every z (``attn_gate``)."""
    if name.endswith(_QWEN35_SHIFTED_NORMS):
        data = (data - np.float32(1.0)) + np.float32(1.0)  # the checkpoint's w - 1, then the converter's + 1
    if name.endswith(".A_log"):
        data = -np.exp(data)
    if "conv1d" in name:
        data = data.reshape(data.shape[0], data.shape[1])  # the checkpoint's (C, 1, K), squeezed
    if ".in_proj_qkvz." in name:
        n_k, k_dim = config["linear_num_key_heads"], config["linear_key_head_dim"]
        v = config["linear_num_value_heads"] // n_k * config["linear_value_head_dim"]
        heads = data.reshape(n_k, 2 * k_dim + 2 * v, -1)  # rows per key head: q, k, v, z
        q, k, vv, z = np.split(heads, [k_dim, 2 * k_dim, 2 * k_dim + v], axis=1)
        qkv = np.concatenate([part.reshape(-1, data.shape[1]) for part in (q, k, vv)])
        stem = name.replace(".in_proj_qkvz.", ".")
        return [(stem.replace(".linear_attn.", ".linear_attn.in_proj_qkv."), qkv),
                (stem.replace(".linear_attn.", ".linear_attn.in_proj_z."), z.reshape(-1, data.shape[1]))]
    return [(name, data)]


def _qwen3_5_convert(config: dict[str, Any], name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """_LinearAttentionVReorderBase.modify_tensors (value heads tiled), then Qwen3NextModel's."""
    n_k, n_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if n_k != n_v and ".linear_attn." in name:
        per_k, k_dim, v_dim = n_v // n_k, config["linear_key_head_dim"], config["linear_value_head_dim"]
        qk = 2 * n_k * k_dim
        if "conv1d" in name:
            data = data.reshape(data.shape[0], data.shape[1])
        if ".in_proj_qkv." in name or ".conv1d." in name:  # only the value rows (channels)
            data = np.concatenate([data[:qk], _tiled(data[qk:], 0, n_k, per_k, v_dim)])
        elif ".in_proj_z." in name:
            data = _tiled(data, 0, n_k, per_k, v_dim)
        elif ".in_proj_b." in name or ".in_proj_a." in name or ".A_log" in name or ".dt_proj." in name:
            data = _tiled(data, 0, n_k, per_k, 1)
        elif ".out_proj." in name:
            data = _tiled(data, 1, n_k, per_k, v_dim)
    return _qwen3_next_convert(config, name, data)


def _qwen3_5_hparams(writer: Any, c: dict[str, Any], weights: dict[str, Any] | None = None) -> None:
    """TextModel's keys, then Qwen3NextModel's (the delta-net's sizes, the layer pattern, the rotated
    dimensions) and Qwen3.5's rope sections, in the converter's order (Qwen3-Next: its flat rope
    keys, no sections)."""
    rope = c.get("rope_parameters") or {"rope_theta": c["rope_theta"], "partial_rotary_factor": c["partial_rotary_factor"]}
    interval = c["full_attention_interval"]
    layer_types = c.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                           for i in range(c["num_hidden_layers"])]  # transformers' default
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    if "intermediate_size" in c:  # the MoE's config has none
        writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    if "mrope_section" in rope:
        writer.add_rope_dimension_sections([*rope["mrope_section"], 0, 0, 0][:4])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if "num_experts" in c:
        writer.add_expert_count(c["num_experts"])
        writer.add_expert_used_count(c["num_experts_per_tok"])
    writer.add_key_length(c["head_dim"])
    writer.add_value_length(c["head_dim"])
    if "moe_intermediate_size" in c:  # Qwen2MoeModel's keys
        writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    writer.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(c["linear_key_head_dim"])
    writer.add_ssm_group_count(c["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(c["linear_num_value_heads"])
    writer.add_ssm_inner_size(c["linear_value_head_dim"] * c["linear_num_value_heads"])
    # add_recurrent_layers is newer than the gguf-py installed here: the same key, written by hand
    writer.add_array(f"{writer.arch}.attention.recurrent_layers", [t == "linear_attention" for t in layer_types])
    writer.add_full_attention_interval(interval)
    writer.add_rope_dimension_count(int(c["head_dim"] * rope["partial_rotary_factor"]))


# --- Gemma 4: what convert_hf_to_gguf.py's Gemma4Model (a Gemma3Model without the norm shift) does


def _gemma4_checkpoint(config: dict[str, Any], weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The checkpoint keeps each expert layer's gate and up projections fused (``gate_up_proj``,
    gate rows first), which mlx-lm's sanitize splits."""
    out = dict(weights)
    for name in [n for n in weights if n.endswith(".experts.switch_glu.gate_proj.weight")]:
        stem = name.removesuffix(".switch_glu.gate_proj.weight")
        up = out.pop(f"{stem}.switch_glu.up_proj.weight")
        out[f"{stem}.switch_glu.gate_up_proj.weight"] = np.concatenate([out.pop(name), up], axis=1)
    return out


def _gemma4_name(mlx_name: str) -> str:
    """The converter's names: experts under the checkpoint's ``experts.*``; the router's scale as
    ``ffn_gate_inp.scale`` and its per-expert scale as ``ffn_down_exps.scale`` (its modify_tensors);
    ``layer_scalar`` with a ``.weight`` suffix (its filter_tensors)."""
    name = mlx_name.replace(".experts.switch_glu.", ".experts.")
    name = name.replace(".router.scale", ".router.proj.scale").replace(".router.per_expert_scale", ".experts.down_proj.scale")
    return name + ".weight" if name.endswith(".layer_scalar") else name


def _gemma4_rope_freqs(config: dict[str, Any]) -> dict[str, np.ndarray]:
    """generate_extra_tensors: proportional RoPE for the full layers as frequency factors, 1 for a
    rotated pair and 1e30 (no rotation) for the rest."""
    full = config["rope_parameters"]["full_attention"]
    half = config["global_head_dim"] // 2
    rotated = int(config["global_head_dim"] * full["partial_rotary_factor"] / 2)
    return {"rope_freqs.weight": np.array([1.0] * rotated + [1e30] * (half - rotated), dtype=np.float32)}


def _gemma4_hparams(writer: Any, c: dict[str, Any], weights: dict[str, Any] | None = None) -> None:
    """TextModel's, Gemma3Model's and Gemma4Model's keys, each at its final value."""
    n_layers, shared = c["num_hidden_layers"], c["num_kv_shared_layers"]
    rope = c["rope_parameters"]
    sliding = [t == "sliding_attention" for t in c["layer_types"]]
    writer.add_block_count(n_layers)
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    ff = c["intermediate_size"]
    writer.add_feed_forward_length([ff if i < n_layers - shared else 2 * ff for i in range(n_layers)]
                                   if c["use_double_wide_mlp"] else ff)
    writer.add_head_count(c["num_attention_heads"])
    kv, kv_full = c["num_key_value_heads"], c.get("num_global_key_value_heads")
    writer.add_head_count_kv([kv if s else kv_full for s in sliding] if kv_full is not None else kv)
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if c.get("num_experts"):
        writer.add_expert_count(c["num_experts"])
        writer.add_expert_used_count(c["top_k_experts"])
    writer.add_key_length(c["global_head_dim"])
    writer.add_value_length(c["global_head_dim"])
    writer.add_final_logit_softcapping(c["final_logit_softcapping"])
    writer.add_sliding_window(c["sliding_window"])
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(c["hidden_size_per_layer_input"] or 0)
    writer.add_sliding_window_pattern(sliding)
    writer.add_key_length_swa(c["head_dim"])
    writer.add_value_length_swa(c["head_dim"])
    if c.get("moe_intermediate_size") is not None:
        writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    writer.add_rope_dimension_count(c["global_head_dim"])
    writer.add_rope_dimension_count_swa(c["head_dim"])


# --- Granite 4.0-H: what convert_hf_to_gguf.py's GraniteHybridModel (Mamba2Model, GraniteMoeModel) does


def _granite_name(mlx_name: str) -> str:
    """mlx-lm's names -> names gguf-py maps as the converter's tensors: the experts (the checkpoint's
    ``input_linear`` split into gate and up), the shared MLP's split ``input_linear`` (below),
    ``dt_bias`` as ``dt_proj.bias``."""
    name = mlx_name.replace(".block_sparse_moe.switch_mlp.gate_proj.", ".mlp.experts.gate_proj.")
    name = name.replace(".block_sparse_moe.switch_mlp.up_proj.", ".mlp.experts.up_proj.")
    name = name.replace(".block_sparse_moe.switch_mlp.down_proj.", ".block_sparse_moe.output_linear.")
    return name.replace(".mamba.dt_bias", ".mamba.dt_proj.bias")


def _granite_convert(config: dict[str, Any], name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Mamba2Model.modify_tensors on the Mamba layers (the convolution squeezed, ``A`` from ``A_log``
    and ``D`` as (heads, 1), the gated norm as (groups, inner / groups)); GraniteMoeModel's split of
    the shared MLP's ``input_linear`` into gate and up."""
    if "conv1d.weight" in name:
        data = data.reshape(data.shape[0], data.shape[1])
    elif name.endswith(".A_log"):
        data = (-np.exp(data)).reshape(-1, 1)
    elif name.endswith((".mamba.D", ".mixer.D")):
        data = data.reshape(-1, 1)
    elif name.endswith((".mamba.norm.weight", ".mixer.norm.weight")):
        data = data.reshape(config["mamba_n_groups"], -1)
    elif name.endswith(".shared_mlp.input_linear.weight"):
        gate, up = np.split(data, 2)
        stem = name.removesuffix(".shared_mlp.input_linear.weight")
        return [(f"{stem}.mlp.shared_expert.gate_proj.weight", gate), (f"{stem}.mlp.shared_expert.up_proj.weight", up)]
    return [(name, data)]


def _granite_hparams(writer: Any, c: dict[str, Any], weights: dict[str, Any] | None = None) -> None:
    """TextModel's and LlamaModel's keys, Granite's multipliers, the shared MLP, the Mamba-2 sizes,
    KV heads per layer (0: a Mamba layer) and RoPE's switch (Granite 4.0-H's attention has none)."""
    d_inner = c["mamba_expand"] * c["hidden_size"]
    use_rope = c["position_embedding_type"] != "nope"
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"] if use_rope else 2**20)
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv([c["num_key_value_heads"] if t == "attention" else 0 for t in c["layer_types"]])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if c.get("num_local_experts"):
        writer.add_expert_count(c["num_local_experts"])
        writer.add_expert_used_count(c["num_experts_per_tok"])
    writer.add_vocab_size(c["vocab_size"])
    writer.add_rope_dimension_count(c["hidden_size"] // c["num_attention_heads"])
    writer.add_attention_scale(c["attention_multiplier"])
    writer.add_embedding_scale(c["embedding_multiplier"])
    writer.add_residual_scale(c["residual_multiplier"])
    writer.add_logit_scale(c["logits_scaling"])
    if c.get("shared_intermediate_size"):
        writer.add_expert_shared_feed_forward_length(c["shared_intermediate_size"])
    writer.add_ssm_conv_kernel(c["mamba_d_conv"])
    writer.add_ssm_state_size(c["mamba_d_state"])
    writer.add_ssm_group_count(c["mamba_n_groups"])
    writer.add_ssm_inner_size(d_inner)
    writer.add_ssm_time_step_rank(c["mamba_n_heads"])
    writer.add_rope_scaling_finetuned(use_rope)


# --- Nemotron-H: what convert_hf_to_gguf.py's NemotronHModel (a GraniteHybridModel) does


def _nemotron_h_convert(config: dict[str, Any], name: str, data: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """Mamba2Model.modify_tensors on the Mamba layers (as Granite's, with its groups), and LlamaModel's
    Q/K permutation on the attention layers, which GraniteHybridModel's ``undo_permute`` keeps
    (llama.cpp does not rotate these heads: the order of a head's dimensions cancels in q.k)."""
    for suffix, heads in ((".mixer.q_proj.weight", config["num_attention_heads"]),
                          (".mixer.k_proj.weight", config["num_key_value_heads"])):
        if name.endswith(suffix):  # LlamaModel.permute: within each head, the two halves interleaved
            return [(name, data.reshape(heads, 2, data.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(data.shape))]
    return _granite_convert({**config, "mamba_n_groups": config["n_groups"]}, name, data)


def _nemotron_h_name(mlx_name: str) -> str:
    return mlx_name.replace(".mixer.dt_bias", ".mixer.dt_proj.bias")


def _nemotron_h_hparams(writer: Any, c: dict[str, Any], weights: dict[str, Any] | None = None) -> None:
    """GraniteHybridModel's keys (a LlamaModel's, the Mamba-2 sizes, RoPE off), then NemotronHModel's:
    the attention head size and the MLP width per layer (0: not an MLP layer)."""
    pattern = c["hybrid_override_pattern"]
    n_heads = c["num_attention_heads"]
    writer.add_block_count(len(pattern))
    writer.add_context_length(2**20)
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length([c["intermediate_size"] if b == "-" else 0 for b in pattern])
    writer.add_head_count(n_heads)
    writer.add_head_count_kv([c["num_key_value_heads"] if b == "*" else 0 for b in pattern])
    writer.add_layer_norm_eps(c["layer_norm_epsilon"])
    writer.add_vocab_size(c["vocab_size"])
    writer.add_rope_dimension_count(c["hidden_size"] // n_heads)
    writer.add_ssm_conv_kernel(c["conv_kernel"])
    writer.add_ssm_state_size(c["ssm_state_size"])
    writer.add_ssm_group_count(c["n_groups"])
    writer.add_ssm_inner_size(c["mamba_num_heads"] * c["mamba_head_dim"])
    writer.add_ssm_time_step_rank(c["mamba_num_heads"])
    writer.add_rope_scaling_finetuned(False)
    writer.add_key_length(c["head_dim"])
    writer.add_value_length(c["head_dim"])


GGUF_TARGETS: dict[str, GgufTarget] = {
    "nemotron_h": GgufTarget("nemotron_h", permute_qk=False, norm_shift=0.0, hf_name=_nemotron_h_name,
                             convert=_nemotron_h_convert, all_hparams=_nemotron_h_hparams),
    "granitemoehybrid": GgufTarget("granitehybrid", permute_qk=True, norm_shift=0.0, hf_name=_granite_name,
                                   convert=_granite_convert, all_hparams=_granite_hparams),
    # transformers keeps the tokenizer.json's split regex for model_type qwen3_next (gpt-2's here).
    "qwen3_next": GgufTarget("qwen3next", permute_qk=False, norm_shift=0.0, hf_name=_qwen3_5_name,
                             convert=_qwen3_next_convert, all_hparams=_qwen3_5_hparams),
    # transformers tokenizes model_type qwen3_5 with Qwen3.5's own split regex (Qwen3_5Tokenizer).
    "qwen3_5": GgufTarget("qwen35", permute_qk=False, norm_shift=0.0, pre="qwen35", hf_name=_qwen3_5_name,
                          convert=_qwen3_5_convert, all_hparams=_qwen3_5_hparams),
    "gemma4_text": GgufTarget("gemma4", permute_qk=False, norm_shift=0.0, hf_name=_gemma4_name,
                              checkpoint=_gemma4_checkpoint, extra_tensors=_gemma4_rope_freqs, all_hparams=_gemma4_hparams),
    "gemma4_text_moe": GgufTarget("gemma4", permute_qk=False, norm_shift=0.0, hf_name=_gemma4_name,
                                  checkpoint=_gemma4_checkpoint, extra_tensors=_gemma4_rope_freqs,
                                  all_hparams=_gemma4_hparams),
    "qwen3_5_moe": GgufTarget("qwen35moe", permute_qk=False, norm_shift=0.0, pre="qwen35", hf_name=_qwen3_5_name,
                              convert=_qwen3_5_convert, all_hparams=_qwen3_5_hparams),
}
