"""Mixture-of-experts families: the factory's rows for them, their configs and their GGUF conversion.

Each family is named by its mlx-lm ``model_type`` and built at small sizes with its real model's
config structure; :data:`GGUF_TARGETS` says what llama.cpp's converter does to it.

The factory stores a family's weights under mlx-lm's names (what its ``sanitize`` leaves), so a
stacked expert tensor is already one ``[n_expert, rows, cols]`` array (``...switch_mlp.gate_proj``),
as the converter's stack of the checkpoint's per-expert matrices is. A target's ``renames`` read
those names back as the Hugging Face names gguf-py's ``TensorNameMap`` knows (the "merged" expert
names, ``...mlp.experts.gate_proj``), which is how the converter names what it stacked.

Tiny sizes keep each real model's structure at hidden 64 (expert count to top-k, shared experts,
layer pattern, head layout); small sizes, for benchmarks, at hidden 768 with 150-250M parameters.
Expert widths are multiples of 32, so their rows fill whole Q8_0 / Q4_0 blocks as the real ones do.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import hf_layouts
from .family import Family
from .gguf_target import GgufTarget

# mlx-lm's SwitchGLU parameters (stacked experts) under the name the converter gives its stack.
SWITCH_MLP = (".mlp.switch_mlp.", ".mlp.experts.")
# Granite's experts (block_sparse_moe), under gguf-py's names for stacked experts.
GRANITE_EXPERTS = (".block_sparse_moe.switch_mlp.", ".mlp.experts.")
# LFM2-MoE's experts (feed_forward) and selection bias, under gguf-py's names (its dense MLPs
# keep mlx-lm's gate/up/down_proj names, which gguf-py knows from llama4).
LFM2_MOE_RENAMES = ((".feed_forward.switch_mlp.", ".feed_forward.experts."),
                    (".feed_forward.expert_bias", ".feed_forward.expert_bias.bias"))
# The experts' selection bias: every converter reads ``e_score_correction_bias`` as a ``.bias``.
SCORE_BIAS = ("e_score_correction_bias", "e_score_correction.bias")


def _qwen3_moe_config(size: str) -> dict[str, Any]:
    # Qwen3-30B-A3B: 128 experts, top-8, every layer sparse, normalised softmax gating, q/k norms,
    # GQA 32:4 with head_dim 128. Tiny: 16 experts, top-4; small: 64 experts, top-8.
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, intermediate_size=192, num_experts=16, num_experts_per_tok=4,
                    moe_intermediate_size=32)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2,
                    head_dim=64, intermediate_size=2048, num_experts=64, num_experts_per_tok=8,
                    moe_intermediate_size=128)
    return dict(dims, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6,
                rope_theta=1000000.0, tie_word_embeddings=False, attention_bias=False, hidden_act="silu")


def _gpt_oss_config(size: str) -> dict[str, Any]:
    # gpt-oss-20b: 32 experts, top-4 (softmax over the chosen four), biases on every projection and
    # expert, attention sinks, sliding (128) and full layers alternating, YaRN x32 from 4096 (here
    # x8: the factory's 32K context), GQA 64:8 at head_dim 64 (queries wider than the hidden size).
    # Tiny: 8 experts, top-2, window 16.
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                    head_dim=16, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                    sliding_window=16)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2,
                    head_dim=64, intermediate_size=384, num_local_experts=32, num_experts_per_tok=4,
                    sliding_window=128)
    layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(dims["num_hidden_layers"])]
    return dict(dims, layer_types=layer_types, rms_norm_eps=1e-5, rope_theta=150000.0,
                rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
                              "beta_fast": 32.0, "beta_slow": 1.0},
                tie_word_embeddings=False, attention_bias=True, hidden_act="silu")


def _glm4_moe_config(size: str) -> dict[str, Any]:
    # GLM-4.5-Air: 128 routed experts, top-8, one shared expert, sigmoid gating with a selection
    # bias, the first layer dense, half the head rotary, q/k/v biases, one NextN (multi-token
    # prediction) layer the converter counts in block_count; GLM-4.6 scales the routed sum by 2.5.
    # Tiny: 16 experts, top-4, the first of 3 layers dense.
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                    head_dim=16, intermediate_size=192, n_routed_experts=16, num_experts_per_tok=4,
                    moe_intermediate_size=32)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=2,
                    head_dim=64, intermediate_size=2048, n_routed_experts=64, num_experts_per_tok=8,
                    moe_intermediate_size=128)
    return dict(dims, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                n_group=1, topk_group=1, scoring_func="sigmoid", topk_method="noaux_tc", partial_rotary_factor=0.5,
                use_qk_norm=False, attention_bias=True, num_nextn_predict_layers=1, rms_norm_eps=1e-5,
                rope_theta=1000000.0, rope_scaling=None, tie_word_embeddings=False, hidden_act="silu")


def _deepseek_v3_config(size: str) -> dict[str, Any]:
    # DeepSeek-V3 / R1: MLA attention (queries through a rank-1536 LoRA pair with a norm between,
    # keys and values from one rank-512 latent and a shared 64-wide rotary key, nope 128 + rope 64,
    # v 128, as many KV heads as heads), 256 routed experts in 8 groups of which the best 4 are
    # searched, top-8, one shared expert, sigmoid gating with its selection bias, routed scale
    # 2.5, the first 3 layers dense, YaRN x40 from 4096 with mscale 1. Tiny: 16 experts in 4
    # groups, best 2, top-4, the first of 3 layers dense.
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                    q_lora_rank=32, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                    intermediate_size=192, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                    n_group=4, topk_group=2)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=12,
                    q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                    intermediate_size=2048, n_routed_experts=64, num_experts_per_tok=8, moe_intermediate_size=128,
                    n_group=8, topk_group=4)
    return dict(dims, n_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1, routed_scaling_factor=2.5,
                norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc", attention_bias=False,
                rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
                rope_scaling={"type": "yarn", "rope_type": "yarn", "factor": 8.0,
                              "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                              "mscale": 1.0, "mscale_all_dim": 1.0})


def _qwen2_moe_config(size: str) -> dict[str, Any]:
    # Qwen1.5-MoE-A2.7B: 60 experts, top-4 (softmax, not renormalised), a shared expert four
    # experts wide behind its own sigmoid gate, every layer sparse, q/k/v biases, MHA with
    # head_dim = hidden / heads. Tiny: 16 experts, top-4.
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                    intermediate_size=128, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32,
                    shared_expert_intermediate_size=128)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=12,
                    intermediate_size=768, num_experts=60, num_experts_per_tok=4, moe_intermediate_size=192,
                    shared_expert_intermediate_size=768)
    return dict(dims, decoder_sparse_step=1, norm_topk_prob=False, rms_norm_eps=1e-6, rope_theta=1000000.0,
                tie_word_embeddings=False, hidden_act="silu")


def _olmoe_config(size: str) -> dict[str, Any]:
    # OLMoE-1B-7B: 64 experts, top-8 (softmax, not renormalised), every layer sparse, the experts
    # intermediate_size wide, q/k RMS norms over the whole projection, MHA. Tiny: 16 experts, top-4.
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                    intermediate_size=32, num_experts=16, num_experts_per_tok=4)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=12,
                    intermediate_size=192, num_experts=64, num_experts_per_tok=8)
    return dict(dims, norm_topk_prob=False, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                attention_bias=False, hidden_act="silu")


def _granitemoe_config(size: str) -> dict[str, Any]:
    # Granite-3.1-1B-A400M: 32 experts, top-8 (softmax over the chosen logits), experts
    # intermediate_size wide, tied embeddings, Granite's multipliers (embedding x12, residual
    # x0.22, attention scale 1/64, logits / 6), GQA 16:8. Tiny: 16 experts, top-4.
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=32, num_local_experts=16, num_experts_per_tok=4)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=6,
                    intermediate_size=384, num_local_experts=32, num_experts_per_tok=8)
    return dict(dims, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                logits_scaling=6.0, attention_bias=False, rms_norm_eps=1e-6, rope_theta=10000.0,
                tie_word_embeddings=True, hidden_act="silu")


def _ernie4_5_moe_config(size: str) -> dict[str, Any]:
    # ERNIE-4.5-21B-A3B: 64 experts, top-6 (softmax, renormalised), two shared experts, the first
    # layer dense, GQA 20:4 at head_dim 128, GPT-J RoPE, tied embeddings. Tiny: 16 experts, top-4.
    # (Without its expert selection bias: mlx-lm's model has none; files with one are refused.)
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, intermediate_size=128, moe_num_experts=16, moe_k=4, moe_intermediate_size=32)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
                    head_dim=64, intermediate_size=1024, moe_num_experts=64, moe_k=6, moe_intermediate_size=128)
    # The converter writes the shared experts' width as intermediate_size / num_key_value_heads,
    # which is ERNIE's 2 x moe_intermediate_size; the configs keep that identity.
    return dict(dims, moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_interval=1,
                moe_gate_act="softmax", moe_use_aux_free=False, use_bias=False, rms_norm_eps=1e-5,
                rope_theta=500000.0, tie_word_embeddings=True, hidden_act="silu")


def _lfm2_moe_config(size: str) -> dict[str, Any]:
    # LFM2-8B-A1B: LFM2's short convolutions with a few attention layers (q/k norms), 32 experts,
    # top-4, sigmoid gating with a selection bias, renormalised, the first two layers dense, tied
    # embeddings. Tiny: 4 layers (attention at 2), the first dense, 16 experts, top-2.
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    intermediate_size=192, moe_intermediate_size=32, num_experts=16, num_experts_per_tok=2,
                    num_dense_layers=1)
        attention = (2,)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                    intermediate_size=2048, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4,
                    num_dense_layers=2)
        attention = (2, 6, 9)
    layer_types = ["full_attention" if i in attention else "conv" for i in range(dims["num_hidden_layers"])]
    return dict(dims, layer_types=layer_types, use_expert_bias=True, norm_topk_prob=True, routed_scaling_factor=1.0,
                conv_L_cache=3, conv_bias=False, norm_eps=1e-5, rope_theta=1000000.0, tie_word_embeddings=True)


def _deepseek_v2_config(size: str) -> dict[str, Any]:
    # DeepSeek-V2 (and V2-Lite, Coder-V2-Lite): MLA as in V3 with kv_b_proj whole, softmax gating
    # over all experts, top-6, not renormalised, scaled (V2: x16), two shared experts, the first
    # layer dense, YaRN x40 with mscale 0.707. Tiny: 16 experts, top-4, no groups (llama.cpp
    # ranks groups by V3's rule), with V2's query LoRA: llama.cpp takes a model without one only
    # at V2-Lite's depths (26 or 27 layers).
    config = _deepseek_v3_config(size)
    for key in ("scoring_func", "norm_topk_prob", "n_group", "topk_group"):
        del config[key]
    config.update(topk_method="greedy", n_shared_experts=2, routed_scaling_factor=2.0,
                  rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
                                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707})
    if size == "small":
        config.update(n_routed_experts=64, num_experts_per_tok=6)
    return config


def _split_kv_b(name: str, data: Any, config: dict[str, Any]) -> list[tuple[str, Any]]:
    """``DeepseekV2Model.modify_tensors``: MLA's kv_b_proj split per head into the key rows,
    transposed ([heads, kv_lora_rank, nope]: ``k_b_proj``), and the value rows (``v_b_proj``)."""
    if not name.endswith(".self_attn.kv_b_proj.weight"):
        return [(name, data)]
    nope, heads = config["qk_nope_head_dim"], config["num_attention_heads"]
    kv_b = data.reshape(heads, nope + config["v_head_dim"], data.shape[-1])
    return [(name.replace("kv_b_proj", "k_b_proj"), np.ascontiguousarray(kv_b[:, :nope].transpose(0, 2, 1))),
            (name.replace("kv_b_proj", "v_b_proj"), np.ascontiguousarray(kv_b[:, nope:]))]


def _expert_keys(writer: Any, config: dict[str, Any]) -> None:
    """What the converter writes for every MoE checkpoint (``TextModel``: the expert count and
    top-k) and for Qwen's (``Qwen2MoeModel``: the experts' width)."""
    writer.add_expert_count(config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])


def _drop_common_keys(writer: Any, *keys: str) -> None:
    """Take back ``{arch}.KEY`` values ``gguf_metadata.add_hparams`` wrote for every family, where
    this family's converter writes others or none (gguf-py's writer would warn on a rewrite)."""
    for key in keys:
        del writer.kv_data[0][f"{writer.arch}.{key}"]


def _gpt_oss_keys(writer: Any, config: dict[str, Any]) -> None:
    """``GptOssModel``: the expert counts (``TextModel``), the window, the experts' width."""
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])


def _glm4_moe_keys(writer: Any, config: dict[str, Any]) -> None:
    """``Glm4MoeModel``: the rotary width, routed and shared experts, the leading dense layers,
    sigmoid gating, the routed scale and normalisation, the NextN layers (counted in
    ``block_count`` too: ``gguf_metadata.add_hparams``); ``TextModel``'s top-k and groups."""
    import gguf

    writer.add_rope_dimension_count(int(config["head_dim"] * config["partial_rotary_factor"]))
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_group_count(config["n_group"])
    writer.add_expert_group_used_count(config["topk_group"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    writer.add_expert_weights_norm(config["norm_topk_prob"])
    writer.add_nextn_predict_layers(config["num_nextn_predict_layers"])


def _deepseek_keys(writer: Any, config: dict[str, Any]) -> None:
    """``DeepseekV2Model`` (V2 and V3): MLA as MQA with one KV head whose key is the latent and
    the rotary key (``key_length``, ``value_length``; the real head sizes as ``*_mla``), the LoRA
    ranks, the experts, the gating (``scoring_func``: sigmoid for V3, none written for V2) and
    routed scale, the rotary width, YaRN's attention factor as ``yarn_log_multiplier`` (0.1 x
    mscale_all_dim); ``TextModel``'s top-k and groups (V3's)."""
    import gguf

    c = config
    _drop_common_keys(writer, "attention.head_count_kv", "attention.key_length", "attention.value_length")
    writer.add_head_count_kv(1)
    writer.add_key_length(c["kv_lora_rank"] + c["qk_rope_head_dim"])
    writer.add_value_length(c["kv_lora_rank"])
    writer.add_key_length_mla(c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
    writer.add_value_length_mla(c["v_head_dim"])
    writer.add_q_lora_rank(c["q_lora_rank"])
    writer.add_kv_lora_rank(c["kv_lora_rank"])
    writer.add_leading_dense_block_count(c["first_k_dense_replace"])
    writer.add_expert_count(c["n_routed_experts"])
    writer.add_expert_used_count(c["num_experts_per_tok"])
    if "n_group" in c:
        writer.add_expert_group_count(c["n_group"])
        writer.add_expert_group_used_count(c["topk_group"])
    if c.get("scoring_func") == "sigmoid":
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    writer.add_expert_shared_count(c["n_shared_experts"])
    writer.add_expert_weights_scale(c["routed_scaling_factor"])
    if c.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(c["qk_rope_head_dim"])
    writer.add_rope_scaling_yarn_log_mul(0.1 * c["rope_scaling"]["mscale_all_dim"])


def _qwen2_moe_keys(writer: Any, config: dict[str, Any]) -> None:
    """``Qwen2MoeModel``: the experts' and the shared expert's widths, ``TextModel``'s counts."""
    _expert_keys(writer, config)
    writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])


def _counts(writer: Any, config: dict[str, Any]) -> None:
    """``TextModel``'s expert keys alone (``num_experts``, ``num_experts_per_tok``): OlmoeModel's."""
    writer.add_expert_count(config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])


def _granitemoe_keys(writer: Any, config: dict[str, Any]) -> None:
    """``GraniteMoeModel`` (a ``LlamaModel``): the rotary width, Granite's multipliers as
    ``*_scale`` keys, ``TextModel``'s expert counts; Granite writes no head_dim (key_length)."""
    _drop_common_keys(writer, "attention.key_length", "attention.value_length")
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_attention_scale(config["attention_multiplier"])
    writer.add_embedding_scale(config["embedding_multiplier"])
    writer.add_residual_scale(config["residual_multiplier"])
    writer.add_logit_scale(config["logits_scaling"])


def _ernie4_5_moe_keys(writer: Any, config: dict[str, Any]) -> None:
    """``Ernie4_5MoeModel``: the expert counts, the MoE layer step and the leading dense
    layers, the experts' width, the shared experts' count and width (as the converter computes it)."""
    c = config
    writer.add_expert_count(c["moe_num_experts"])
    writer.add_expert_used_count(c["moe_k"])
    writer.add_interleave_moe_layer_step(c["moe_layer_interval"])
    writer.add_leading_dense_block_count(c["moe_layer_start_index"])
    writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    writer.add_expert_shared_count(c["moe_num_shared_experts"])
    writer.add_expert_shared_feed_forward_length(c["intermediate_size"] // c["num_key_value_heads"])


def _lfm2_moe_keys(writer: Any, config: dict[str, Any]) -> None:
    """``LFM2MoeModel`` (after LFM2's keys, ``gguf_metadata.add_hparams``): the expert counts,
    width, leading dense layers and sigmoid gating."""
    import gguf

    writer.add_expert_count(config["num_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_leading_dense_block_count(config["num_dense_layers"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)


FAMILIES: tuple[Family, ...] = (
    Family("qwen3_moe", "Qwen3MoeForCausalLM", thinking=True, add_bos=False, norm_one=1.0, hf_layout=hf_layouts.experts_one_by_one),
    Family("gpt_oss", "GptOssForCausalLM", thinking=False, add_bos=False, norm_one=1.0),
    Family("glm4_moe", "Glm4MoeForCausalLM", thinking=True, add_bos=False, norm_one=1.0, hf_layout=hf_layouts.glm4_moe),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", thinking=False, add_bos=True, norm_one=1.0, hf_layout=hf_layouts.deepseek_v3),
    Family("deepseek_v2", "DeepseekV2ForCausalLM", thinking=False, add_bos=True, norm_one=1.0, hf_layout=hf_layouts.experts_one_by_one),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", thinking=False, add_bos=False, norm_one=1.0, hf_layout=hf_layouts.experts_one_by_one),
    Family("olmoe", "OlmoeForCausalLM", thinking=False, add_bos=False, norm_one=1.0, hf_layout=hf_layouts.experts_one_by_one),
    Family("granitemoe", "GraniteMoeForCausalLM", thinking=False, add_bos=False, norm_one=1.0, hf_layout=hf_layouts.granitemoe),
    Family("ernie4_5_moe", "Ernie4_5_MoeForCausalLM", thinking=False, add_bos=False, norm_one=1.0, hf_layout=hf_layouts.experts_one_by_one),
    Family("lfm2_moe", "Lfm2MoeForCausalLM", thinking=False, add_bos=False, norm_one=1.0, hf_layout=hf_layouts.lfm2_moe),
)
CONFIGS: dict[str, Callable[[str], dict[str, Any]]] = {
    "qwen3_moe": _qwen3_moe_config,
    "gpt_oss": _gpt_oss_config,
    "glm4_moe": _glm4_moe_config,
    "deepseek_v3": _deepseek_v3_config,
    "deepseek_v2": _deepseek_v2_config,
    "qwen2_moe": _qwen2_moe_config,
    "olmoe": _olmoe_config,
    "granitemoe": _granitemoe_config,
    "ernie4_5_moe": _ernie4_5_moe_config,
    "lfm2_moe": _lfm2_moe_config,
}
GGUF_TARGETS: dict[str, GgufTarget] = {
    "qwen3_moe": GgufTarget("qwen3moe", permute_qk=False, norm_shift=0.0, renames=(SWITCH_MLP,),
                            hparams=_expert_keys),
    # The checkpoint's attention sinks have no ".weight"; the converter appends one.
    "gpt_oss": GgufTarget("gpt-oss", permute_qk=False, norm_shift=0.0,
                          renames=((".self_attn.sinks", ".self_attn.sinks.weight"),), hparams=_gpt_oss_keys),
    "glm4_moe": GgufTarget("glm4moe", permute_qk=False, norm_shift=0.0, renames=(SWITCH_MLP, SCORE_BIAS),
                           hparams=_glm4_moe_keys),
    # mlx-lm keeps MLA's kv_b_proj split as the converter does, but names the halves embed_q (the
    # key half, transposed: the converter's k_b_proj) and unembed_out (v_b_proj).
    "deepseek_v3": GgufTarget("deepseek2", permute_qk=False, norm_shift=0.0,
                              renames=(SWITCH_MLP, SCORE_BIAS, (".self_attn.embed_q.", ".self_attn.k_b_proj."),
                                       (".self_attn.unembed_out.", ".self_attn.v_b_proj.")),
                              hparams=_deepseek_keys),
    "deepseek_v2": GgufTarget("deepseek2", permute_qk=False, norm_shift=0.0, renames=(SWITCH_MLP,),
                              hparams=_deepseek_keys, split=_split_kv_b),
    "qwen2_moe": GgufTarget("qwen2moe", permute_qk=False, norm_shift=0.0, renames=(SWITCH_MLP,),
                            hparams=_qwen2_moe_keys),
    "olmoe": GgufTarget("olmoe", permute_qk=False, norm_shift=0.0, renames=(SWITCH_MLP,), hparams=_counts),
    # A LlamaModel: Q/K rows permuted. The checkpoint's input_linear (gate and up stacked) has no
    # gguf-py name of its own; the converter names its halves ffn_{gate,up}_exps directly.
    "granitemoe": GgufTarget("granitemoe", permute_qk=True, norm_shift=0.0, renames=(GRANITE_EXPERTS,),
                             hparams=_granitemoe_keys),
    "ernie4_5_moe": GgufTarget("ernie4_5-moe", permute_qk=False, norm_shift=0.0, renames=(SWITCH_MLP,),
                               hparams=_ernie4_5_moe_keys),
    "lfm2_moe": GgufTarget("lfm2moe", permute_qk=False, norm_shift=0.0, renames=LFM2_MOE_RENAMES,
                           hparams=_lfm2_moe_keys),
}
