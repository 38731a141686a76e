"""Mixture-of-experts architectures: qwen3moe, gpt-oss, glm4moe, deepseek2 (MLA), qwen2moe, olmoe,
granitemoe, ernie4_5-moe, lfm2moe.

Each row (:data:`SPECS`) names the mlx-lm model that serves the architecture; its config builder
and the undo steps for what llama.cpp's converter changed sit beside it in this module.

What every MoE row shares: the converter stacks a layer's per-expert matrices into one
``[n_expert, rows, cols]`` tensor (``blk.N.ffn_{gate,up,down}_exps``), which is exactly the
weight of mlx-lm's ``SwitchGLU`` projections (``...switch_mlp.{gate,up,down}_proj``): no values
change, only the name (``SWITCH_MLP``). The router (``ffn_gate_inp``) stays F32 in every file.
The readers every row shares come first (experts, DeepSeek-style routing, gating, window layout),
then the rows' config builders, most used first.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from mlxcel_compat.gguf.arch_spec import (ArchSpec, Join, UnsupportedArchitecture, common_config, required,
                                          rope_scaling_config)
from mlxcel_compat.gguf.reader import GGUFModelFile, read_tensor

# mlx-lm's stacked experts, under the name the converter gave its stack of the checkpoint's experts.
SWITCH_MLP = (".mlp.switch_mlp.", ".mlp.experts.")
# The experts' selection bias (``exp_probs_b``): every converter reads it as ``e_score_correction.bias``.
SCORE_BIAS = ("e_score_correction_bias", "e_score_correction.bias")
SOFTMAX, SIGMOID = 1, 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*


def expert_config(file: GGUFModelFile, width_is_ff: bool = False) -> dict[str, int]:
    """The expert count, the experts used per token and one expert's width, as llama.cpp reads
    them (``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``; without the
    last, llama.cpp takes ``feed_forward_length / expert_used_count``, or ``feed_forward_length``
    itself for the architectures whose experts are ``width_is_ff``: olmoe, granitemoe)."""
    n_expert = int(required(file, "expert_count"))
    n_used = int(required(file, "expert_used_count"))
    if not 0 < n_used <= n_expert:
        raise UnsupportedArchitecture(f"{file.architecture}: expert_used_count {n_used} with {n_expert} experts")
    width = file.arch_value("expert_feed_forward_length")
    if isinstance(width, list):  # per layer in some files; mlx-lm's models take one width
        width = _one(file, "expert_feed_forward_length", [w for w in width if w])
    if not width:
        width = int(required(file, "feed_forward_length")) // (1 if width_is_ff else n_used)
    return {"n_expert": n_expert, "n_used": n_used, "width": int(width)}


def _one(file: GGUFModelFile, key: str, values: list[Any]) -> Any:
    if len(set(values)) != 1:
        raise UnsupportedArchitecture(f"{file.architecture}.{key} differs between layers ({values}); "
                                      "mlx-lm models need one value")
    return values[0]


def routed_config(file: GGUFModelFile) -> dict[str, Any]:
    """The DeepSeek-V3-style router's settings mlx-lm names (``glm4_moe``, ``deepseek_v3``): the
    sum of the chosen experts scaled by ``expert_weights_scale``, renormalised when
    ``expert_weights_norm``, the groups of ``expert_group_count`` of which the best
    ``expert_group_used_count`` are searched, the shared experts, the leading dense layers."""
    experts = expert_config(file)
    shared = int(file.arch_value("expert_shared_count", 0))
    return {
        "n_routed_experts": experts["n_expert"], "num_experts_per_tok": experts["n_used"],
        "moe_intermediate_size": experts["width"], "n_shared_experts": shared or None,
        "first_k_dense_replace": int(file.arch_value("leading_dense_block_count", 0)),
        "routed_scaling_factor": float(file.arch_value("expert_weights_scale", 1.0) or 1.0),
        "norm_topk_prob": bool(file.arch_value("expert_weights_norm", False)),
        "n_group": int(file.arch_value("expert_group_count", 1) or 1),
        "topk_group": int(file.arch_value("expert_group_used_count", 1) or 1),
    }


def gating(file: GGUFModelFile, default: int) -> int:
    """llama.cpp's ``expert_gating_func`` (1 softmax, 2 sigmoid), the architecture's when absent."""
    return int(file.arch_value("expert_gating_func", 0) or default)


def sliding_layers(file: GGUFModelFile, n_layers: int, period: int) -> list[bool]:
    """Which layers attend through a sliding window, as llama.cpp's ``load_swa_pattern`` reads
    it: a per-layer ``attention.sliding_window_pattern`` array, else a period (the key's value or
    the architecture's own) whose last layer is the full one."""
    pattern = file.arch_value("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        if len(pattern) != n_layers:
            raise UnsupportedArchitecture(f"{file.architecture}: sliding_window_pattern has {len(pattern)} "
                                          f"entries for {n_layers} layers")
        return [bool(x) for x in pattern]
    period = int(pattern) if pattern else period
    return [period == 0 or i % period < period - 1 for i in range(n_layers)]


def nonzero(file: GGUFModelFile, name: str) -> bool:
    """Whether a small F32 tensor of the file holds any value other than zero."""
    info = file.tensors[name]
    if info.ggml_type != GGMLQuantizationType.F32:
        return True
    return bool(np.any(np.frombuffer(read_tensor(info), dtype=np.float32)))


def _qwen3moe(file: GGUFModelFile) -> dict[str, Any]:
    # llama.cpp's qwen3moe makes every layer sparse and always renormalises the top-k weights
    # (build_moe_ffn with norm_w = true): mlx-lm's decoder_sparse_step 1, norm_topk_prob.
    config = common_config(file)
    experts = expert_config(file)
    config.update(num_experts=experts["n_expert"], num_experts_per_tok=experts["n_used"],
                  moe_intermediate_size=experts["width"], decoder_sparse_step=1, mlp_only_layers=[],
                  norm_topk_prob=True)
    config.setdefault("rope_theta", 1000000.0)
    return config


def _gpt_oss(file: GGUFModelFile) -> dict[str, Any]:
    # llama.cpp's openai-moe: softmax over the chosen experts' logits, biases everywhere, sinks,
    # SwiGLU clamped with alpha 1.702 and limit 7 (mlx-lm's SwigluOAI constants), a window on
    # every other layer (period 2, the first sliding).
    config = common_config(file)
    experts = expert_config(file)
    sliding = sliding_layers(file, config["num_hidden_layers"], 2)
    if all(sliding) or not any(sliding):
        raise UnsupportedArchitecture(f"gpt-oss needs sliding and full layers both (pattern {sliding})")
    config.update(num_local_experts=experts["n_expert"], num_experts_per_tok=experts["n_used"],
                  intermediate_size=experts["width"], sliding_window=int(required(file, "attention.sliding_window")),
                  layer_types=["sliding_attention" if s else "full_attention" for s in sliding])
    config.setdefault("rope_theta", 150000.0)
    return config


def _glm4moe(file: GGUFModelFile) -> dict[str, Any]:
    # llama.cpp's glm4moe: sigmoid scores, the selection bias exp_probs_b added for the choice only,
    # the chosen scores renormalised if expert_weights_norm and scaled by expert_weights_scale,
    # a shared expert, NeoX RoPE on rope.dimension_count of each head. block_count includes the
    # NextN layers (nextn_predict_layers), which mlx-lm's model does not run.
    config = common_config(file)
    if gating(file, SIGMOID) != SIGMOID:
        raise UnsupportedArchitecture("glm4moe with softmax gating has no mlx-lm equivalent (glm4_moe is sigmoid)")
    config["num_hidden_layers"] -= int(file.arch_value("nextn_predict_layers", 0))
    rotary = int(file.arch_value("rope.dimension_count", config["head_dim"]))
    config.update(routed_config(file), partial_rotary_factor=rotary / config["head_dim"],
                  use_qk_norm="blk.0.attn_q_norm.weight" in file.tensors,
                  attention_bias="blk.0.attn_q.bias" in file.tensors,
                  scoring_func="sigmoid", topk_method="noaux_tc", rope_scaling=config.get("rope_scaling"))
    config.setdefault("rope_theta", 1000000.0)
    return config


def _deepseek2(file: GGUFModelFile) -> dict[str, Any]:
    # llama.cpp's deepseek2 stores MLA as MQA: one KV head whose key is the latent plus the rotary
    # key (key_length = kv_lora_rank + rope width), the real head sizes in key_length_mla /
    # value_length_mla, kv_b split into k_b (transposed) and v_b, which are mlx-lm deepseek_v3's
    # embed_q and unembed_out as they are. Sigmoid gating is deepseek_v3's router (this row);
    # softmax (DeepSeek-V2 files) is deepseek_v2's (_deepseek2_v2).
    config = _mla_config(file)
    config.update(scoring_func="sigmoid", topk_method="noaux_tc")
    return config


def _deepseek2_v2(file: GGUFModelFile) -> dict[str, Any]:
    # DeepSeek-V2 / V2-Lite / Coder-V2-Lite: softmax over all experts, top-k, scaled by
    # expert_weights_scale and never renormalised (mlx-lm's deepseek_v2 has no normalisation, and
    # these models set none); its kv_b_proj is the converter's k_b (transposed back) and v_b
    # joined head by head (KV_B). Groups are refused: llama.cpp ranks a group by its top two
    # scores (DeepSeek-V3's rule), mlx-lm's group_limited_greedy by its best one (V2's).
    config = _mla_config(file)
    if config["norm_topk_prob"]:
        raise UnsupportedArchitecture("deepseek2 with softmax gating and expert_weights_norm has no mlx-lm "
                                      "equivalent (deepseek_v2 never renormalises)")
    if config["n_group"] > 1:
        raise UnsupportedArchitecture(f"deepseek2 with softmax gating and {config['n_group']} expert groups: "
                                      "llama.cpp ranks groups by their top two scores, mlx-lm's deepseek_v2 by "
                                      "their best one")
    config.update(topk_method="greedy", n_group=None, topk_group=None)
    # mlx-lm's deepseek_v2 builds YaRN RoPE whatever the file says: factor 1 is plain RoPE.
    config.setdefault("rope_scaling", {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096})
    return config


def _kv_b(parts: list[Any], config: dict[str, Any]) -> Any:
    """MLA's kv_b_proj from the converter's halves: per head the key rows (k_b, stored
    [heads, kv_lora_rank, nope], transposed back) then the value rows (v_b, [heads, v, kv_lora_rank])."""
    import mlx.core as mx

    k_b, v_b = parts
    return mx.concatenate([k_b.swapaxes(1, 2), v_b], axis=1).reshape(-1, config["kv_lora_rank"])


KV_B = Join(".self_attn.kv_b_proj.weight", ("attn_k_b.weight", "attn_v_b.weight"), _kv_b)


def _mla_config(file: GGUFModelFile) -> dict[str, Any]:
    """DeepSeek's MLA attention and router, read from the MQA form llama.cpp's converter writes."""
    if "blk.0.attn_kv_b.weight" in file.tensors:
        raise UnsupportedArchitecture("this deepseek2 file predates llama.cpp's MLA split of attn_kv_b into "
                                      "attn_k_b / attn_v_b; llama.cpp asks for it to be converted again too")
    heads = int(required(file, "attention.head_count"))
    rope = int(required(file, "rope.dimension_count"))
    kv_lora = int(required(file, "attention.kv_lora_rank"))
    key_mla = int(required(file, "attention.key_length_mla"))
    config: dict[str, Any] = {
        "hidden_size": int(required(file, "embedding_length")),
        "num_hidden_layers": int(required(file, "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "intermediate_size": int(required(file, "feed_forward_length")),
        "q_lora_rank": int(file.arch_value("attention.q_lora_rank", 0)) or None,
        "kv_lora_rank": kv_lora,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": key_mla - rope,
        "v_head_dim": int(required(file, "attention.value_length_mla")),
        "rms_norm_eps": float(file.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(file.arch_value("context_length", 4096)),
        "rope_theta": float(file.arch_value("rope.freq_base", 10000.0)),
        "moe_layer_freq": 1,
        "attention_bias": "blk.0.attn_q_a.bias" in file.tensors,
    }
    config.update(routed_config(file))
    if (scaling := rope_scaling_config(file)) is not None:
        if scaling["type"] == "yarn":
            # llama.cpp scales the attention by (1 + 0.1 mscale_all_dim ln factor)^2, from the
            # converter's yarn_log_multiplier (0.1 mscale_all_dim), and leaves the rotation
            # itself unscaled: mlx-lm's YaRN with mscale = mscale_all_dim.
            mscale = float(file.arch_value("rope.scaling.yarn_log_multiplier", 0.0)) / 0.1
            scaling.update(mscale=mscale, mscale_all_dim=mscale)
        config["rope_scaling"] = scaling
    return config


def _qwen2moe(file: GGUFModelFile) -> dict[str, Any]:
    # llama.cpp's qwen2moe: softmax top-k not renormalised, a shared expert gated by
    # sigmoid(ffn_gate_inp_shexp x) (expert_shared_feed_forward_length wide, else
    # feed_forward_length), every layer sparse; mlx-lm's head_dim is hidden / heads.
    config = common_config(file)
    if config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]:
        raise UnsupportedArchitecture("qwen2moe with head_dim != hidden / heads has no mlx-lm equivalent")
    experts = expert_config(file)
    config.update(num_experts=experts["n_expert"], num_experts_per_tok=experts["n_used"],
                  moe_intermediate_size=experts["width"],
                  shared_expert_intermediate_size=int(file.arch_value("expert_shared_feed_forward_length", 0)
                                                      or config["intermediate_size"]))
    config.setdefault("rope_theta", 1000000.0)
    return config


def _olmoe(file: GGUFModelFile) -> dict[str, Any]:
    # llama.cpp's olmoe: softmax top-k not renormalised, experts feed_forward_length wide, q/k norms
    # over the whole projection (every head at once), as mlx-lm's olmoe.
    config = common_config(file)
    experts = expert_config(file, width_is_ff=True)
    config.update(num_experts=experts["n_expert"], num_experts_per_tok=experts["n_used"],
                  intermediate_size=experts["width"], norm_topk_prob=False,
                  attention_bias="blk.0.attn_q.bias" in file.tensors)
    config.setdefault("rope_theta", 10000.0)
    return config


def _granitemoe(file: GGUFModelFile) -> dict[str, Any]:
    # llama.cpp's granitemoe (a llama: Q/K rows permuted): softmax top-k renormalised, i.e. a
    # softmax over the chosen logits (mlx-lm's router); experts feed_forward_length wide; the
    # multipliers from the *_scale keys (llama.cpp's defaults where absent: attention
    # 1/sqrt(head_dim), the others 1). The shared-expert variant has no mlx-lm model.
    config = common_config(file)
    if file.arch_value("expert_shared_feed_forward_length"):
        raise UnsupportedArchitecture("granitemoe with a shared expert (GraniteMoeShared) has no mlx-lm model")
    if config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]:
        raise UnsupportedArchitecture("granitemoe with head_dim != hidden / heads has no mlx-lm equivalent")
    experts = expert_config(file, width_is_ff=True)
    config.update(num_local_experts=experts["n_expert"], num_experts_per_tok=experts["n_used"],
                  intermediate_size=experts["width"],
                  attention_multiplier=float(file.arch_value("attention.scale", 0) or config["head_dim"] ** -0.5),
                  embedding_multiplier=float(file.arch_value("embedding_scale", 0) or 1.0),
                  residual_multiplier=float(file.arch_value("residual_scale", 0) or 1.0),
                  logits_scaling=float(file.arch_value("logit_scale", 0) or 1.0),
                  attention_bias="blk.0.attn_q.bias" in file.tensors)
    config.setdefault("rope_theta", 10000.0)
    return config


def _ernie4_5_moe(file: GGUFModelFile) -> dict[str, Any]:
    # llama.cpp's ernie4_5-moe: softmax top-k renormalised, MoE layers from
    # leading_dense_block_count on, every interleave_moe_layer_step-th; shared experts
    # expert_shared_feed_forward_length wide in all (mlx-lm: moe_intermediate_size x their count);
    # GPT-J RoPE (mlx-lm's traditional). llama.cpp adds the optional selection bias exp_probs_b to
    # the softmax scores to choose the experts, as ERNIE's own code does; mlx-lm's ernie4_5_moe
    # drops it (its sanitize removes e_score_correction_bias), so a file whose bias is not zero
    # would choose other experts than llama.cpp: refused.
    if biased := [n for n in file.tensors if n.endswith("exp_probs_b.bias") and nonzero(file, n)]:
        raise UnsupportedArchitecture(f"ernie4_5-moe with an expert selection bias ({biased[0]}, ...): mlx-lm's "
                                      "ernie4_5_moe has no selection bias, so it would choose other experts than "
                                      "llama.cpp")
    config = common_config(file)
    experts = expert_config(file)
    n_shared = int(file.arch_value("expert_shared_count", 0))
    shared_width = int(file.arch_value("expert_shared_feed_forward_length", 0))
    if n_shared and shared_width != n_shared * experts["width"]:
        raise UnsupportedArchitecture(f"ernie4_5-moe shared experts {shared_width} wide for {n_shared} of width "
                                      f"{experts['width']}: mlx-lm's are the product")
    config.update(moe_num_experts=experts["n_expert"], moe_k=experts["n_used"],
                  moe_intermediate_size=experts["width"], moe_num_shared_experts=n_shared,
                  moe_layer_start_index=int(file.arch_value("leading_dense_block_count", 0)),
                  moe_layer_interval=int(required(file, "interleave_moe_layer_step")),
                  moe_layer_end_index=None, moe_gate_act="softmax", moe_use_aux_free=False,
                  use_bias="blk.0.attn_q.bias" in file.tensors)
    config.setdefault("rope_theta", 500000.0)
    return config


def _lfm2moe(file: GGUFModelFile) -> dict[str, Any]:
    # llama.cpp's lfm2moe: LFM2's layers (attention where head_count_kv is not 0, short
    # convolutions elsewhere), the first leading_dense_block_count dense, then sigmoid gating with
    # the selection bias exp_probs_b, renormalised (always, as llama.cpp's build_moe_ffn is called),
    # scaled by expert_weights_scale where present.
    n_layers = int(required(file, "block_count"))
    kv = file.arch_value("attention.head_count_kv")
    kv_per_layer = kv if isinstance(kv, list) else [kv] * n_layers
    attention = {int(k) for k in kv_per_layer if k}
    if len(attention) != 1:
        raise UnsupportedArchitecture(f"lfm2moe head_count_kv per layer {kv_per_layer} is not supported")
    if gating(file, SIGMOID) != SIGMOID:
        raise UnsupportedArchitecture("lfm2moe with softmax gating has no mlx-lm equivalent (lfm2_moe is sigmoid)")
    experts = expert_config(file)
    return {
        "hidden_size": int(required(file, "embedding_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": int(required(file, "attention.head_count")),
        "num_key_value_heads": attention.pop(),
        "layer_types": ["full_attention" if k else "conv" for k in kv_per_layer],
        "intermediate_size": int(required(file, "feed_forward_length")),
        "moe_intermediate_size": experts["width"],
        "num_experts": experts["n_expert"],
        "num_experts_per_tok": experts["n_used"],
        "num_dense_layers": int(file.arch_value("leading_dense_block_count", 0)),
        "use_expert_bias": any(name.endswith("exp_probs_b.bias") for name in file.tensors),
        "norm_topk_prob": True,
        "routed_scaling_factor": float(file.arch_value("expert_weights_scale", 0) or 1.0),
        "conv_L_cache": int(required(file, "shortconv.l_cache")),
        "conv_bias": "blk.0.shortconv.in_proj.bias" in file.tensors,
        "norm_eps": float(file.arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(file.arch_value("rope.freq_base", 1000000.0)),
        "max_position_embeddings": int(file.arch_value("context_length", 128000)),
        "tie_word_embeddings": True,
    }


def _deepseek2_variant(file: GGUFModelFile) -> ArchSpec | None:
    """A softmax-gated deepseek2 file (llama.cpp's default for files without the key) is DeepSeek-V2's."""
    return DEEPSEEK_V2 if gating(file, SOFTMAX) == SOFTMAX else None


DEEPSEEK_V2 = ArchSpec("deepseek2", "deepseek_v2", "DeepseekV2ForCausalLM", _deepseek2_v2, renames=(SWITCH_MLP,),
                       joins=(KV_B,))

SPECS: tuple[ArchSpec, ...] = (
    ArchSpec("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM", _qwen3moe, renames=(SWITCH_MLP,)),
    # mlx-lm's expert stacks keep the checkpoint's names (mlp.experts.*); the sinks gain ".weight".
    ArchSpec("gpt-oss", "gpt_oss", "GptOssForCausalLM", _gpt_oss,
             renames=((".self_attn.sinks", ".self_attn.sinks.weight"),)),
    ArchSpec("glm4moe", "glm4_moe", "Glm4MoeForCausalLM", _glm4moe, renames=(SWITCH_MLP, SCORE_BIAS)),
    ArchSpec("deepseek2", "deepseek_v3", "DeepseekV3ForCausalLM", _deepseek2,
             renames=(SWITCH_MLP, SCORE_BIAS, (".self_attn.embed_q.", ".self_attn.k_b_proj."),
                      (".self_attn.unembed_out.", ".self_attn.v_b_proj.")), variant=_deepseek2_variant),
    ArchSpec("qwen2moe", "qwen2_moe", "Qwen2MoeForCausalLM", _qwen2moe, renames=(SWITCH_MLP,)),
    ArchSpec("olmoe", "olmoe", "OlmoeForCausalLM", _olmoe, renames=(SWITCH_MLP,)),
    # A llama to the converter (Q/K rows permuted); its experts have no checkpoint name of their
    # own in gguf-py (the converter splits input_linear and names the halves itself).
    ArchSpec("granitemoe", "granitemoe", "GraniteMoeForCausalLM", _granitemoe, permute_qk=True,
             renames=((".block_sparse_moe.switch_mlp.", ".mlp.experts."),)),
    ArchSpec("ernie4_5-moe", "ernie4_5_moe", "Ernie4_5_MoeForCausalLM", _ernie4_5_moe, renames=(SWITCH_MLP,)),
    ArchSpec("lfm2moe", "lfm2_moe", "Lfm2MoeForCausalLM", _lfm2moe,
             renames=((".feed_forward.switch_mlp.", ".feed_forward.experts."),
                      (".feed_forward.expert_bias", ".feed_forward.expert_bias.bias"))),
)
