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


CONFIGS: dict[str, Callable[[str], dict[str, Any]]] = {
    "qwen3_5": _qwen3_5_config,
    "qwen3_5_moe": _qwen3_5_moe_config,
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


def _qwen3_5_hparams(writer: Any, c: dict[str, Any]) -> None:
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


GGUF_TARGETS: dict[str, GgufTarget] = {
    # transformers keeps the tokenizer.json's split regex for model_type qwen3_next (gpt-2's here).
    "qwen3_next": GgufTarget("qwen3next", permute_qk=False, norm_shift=0.0, hf_name=_qwen3_5_name,
                             convert=_qwen3_next_convert, hparams=_qwen3_5_hparams),
    # transformers tokenizes model_type qwen3_5 with Qwen3.5's own split regex (Qwen3_5Tokenizer).
    "qwen3_5": GgufTarget("qwen35", permute_qk=False, norm_shift=0.0, pre="qwen35", hf_name=_qwen3_5_name,
                          convert=_qwen3_5_convert, hparams=_qwen3_5_hparams),
    "qwen3_5_moe": GgufTarget("qwen35moe", permute_qk=False, norm_shift=0.0, pre="qwen35", hf_name=_qwen3_5_name,
                              convert=_qwen3_5_convert, hparams=_qwen3_5_hparams),
}
