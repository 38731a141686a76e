"""Hybrid and recurrent architectures (state kept in session snapshots): qwen35, qwen35moe, qwen3next, granitehybrid, nemotron_h, gemma4.

Each row (:data:`SPECS`) names the mlx-lm model that serves the architecture; its config builder
and the undo steps for what llama.cpp's converter changed sit beside it in this module.

Qwen3.5 (``qwen35``): attention layers every ``full_attention_interval`` layers, gated delta-net
layers between them. The converter stores ``A_log`` as ``-exp(A_log)``, renames ``dt_bias`` to
``ssm_dt.bias``, squeezes the convolution to 2-D and, where there are more value heads than key
heads, reorders the value heads from grouped by key head to tiled (ggml broadcasts that way):
the rows of ``in_proj_qkv``'s value part, ``in_proj_z``, ``in_proj_a/b``, ``A_log``, ``dt_bias``,
the convolution's value channels, and the columns of ``out_proj``. Its norms it stores as
``1 + w`` from a checkpoint that holds ``w``, which is what mlx-lm's ``sanitize`` computes too,
so they load as they are.

Qwen3.5 MoE (``qwen35moe``): the same, with mlx-lm's stacked experts under gguf-py's merged
expert names. Qwen3-Next (``qwen3next``): Qwen3.5 MoE's layers without the value-head reorder,
whose fused ``in_proj_qkvz`` the converter splits into ``attn_qkv`` and ``attn_gate``: the model
gets a two-matrix layer in its place (``stored_parts.py``) before the weights load.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlxcel_compat.gguf.arch_spec import ArchSpec, UnsupportedArchitecture, common_config, required
from mlxcel_compat.gguf.reader import GGUFModelFile, read_tensor
from mlxcel_compat.gguf.stored_parts import FusedGateUpSwitchGLU, StoredPartsLinear
from mlxcel_compat.gguf.tensor_undo import TensorUndo, grouped_from_tiled, llama_rows, with_offset


def _layer_interval(file: GGUFModelFile, n_layers: int) -> int:
    """mlx-lm's ``full_attention_interval`` from the file's per-layer recurrent flags (newer
    converters) or its own key; the flags must follow that period."""
    interval = int(file.arch_value("full_attention_interval", 4))
    flags = file.arch_value("attention.recurrent_layers")
    if isinstance(flags, list):
        flags = [bool(f) for f in flags[:n_layers]]
        attention = [i for i, recurrent in enumerate(flags) if not recurrent]
        interval = attention[0] + 1 if attention else n_layers + 1
        if flags != [(i + 1) % interval != 0 for i in range(n_layers)]:
            raise UnsupportedArchitecture(f"{file.architecture}: recurrent layers {flags} are not periodic")
    return interval


def _qwen35(file: GGUFModelFile) -> dict[str, Any]:
    config = common_config(file, dense_ffn=False)
    # Multi-token-prediction layers (nextn) come after the trunk; mlx-lm has none, so they are not loaded.
    n_layers = config["num_hidden_layers"] - int(file.arch_value("nextn_predict_layers", 0))
    k_heads, v_heads = int(required(file, "ssm.group_count")), int(required(file, "ssm.time_step_rank"))
    rotated = int(file.arch_value("rope.dimension_count", config["head_dim"] // 4))
    config.update(
        num_hidden_layers=n_layers,
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        linear_key_head_dim=int(required(file, "ssm.state_size")),
        linear_value_head_dim=int(required(file, "ssm.inner_size")) // v_heads,
        linear_conv_kernel_dim=int(required(file, "ssm.conv_kernel")),
        full_attention_interval=_layer_interval(file, n_layers),
        rope_parameters={"type": "default", "rope_theta": float(config.pop("rope_theta", 10000000.0)),
                         "partial_rotary_factor": rotated / config["head_dim"]},
    )
    config.pop("rope_scaling", None)  # text positions: llama.cpp's sections rotate as plain RoPE
    return config


def _qwen35moe(file: GGUFModelFile) -> dict[str, Any]:
    """Qwen3.5's config with every layer's MLP a mixture: a softmax router whose top-k weights are
    renormalised (llama.cpp's qwen35moe graph, mlx-lm's ``norm_topk_prob``) and a shared expert."""
    config = _qwen35(file)
    expert_ff = int(required(file, "expert_feed_forward_length"))
    config.update(
        num_experts=int(required(file, "expert_count")),
        num_experts_per_tok=int(required(file, "expert_used_count")),
        moe_intermediate_size=expert_ff,
        shared_expert_intermediate_size=int(file.arch_value("expert_shared_feed_forward_length", expert_ff)),
        norm_topk_prob=True,
        decoder_sparse_step=1,
    )
    config.setdefault("intermediate_size", expert_ff)  # unused: no layer is dense
    return config


def _qwen35_name(mlx_name: str) -> str:
    name = mlx_name.removeprefix("language_model.")
    name = name.replace(".mlp.switch_mlp.", ".mlp.experts.")  # stacked experts: ffn_*_exps
    return name.replace(".linear_attn.dt_bias", ".linear_attn.dt_proj.bias")


def _qwen35_undo(config: dict[str, Any], mlx_name: str) -> TensorUndo | None:
    """Un-tile the delta-net's value heads; ``A_log`` back from ``-exp(A_log)``."""
    values = (lambda a, xp: xp.log(-a)) if mlx_name.endswith(".A_log") else None
    n_k, n_v = config["linear_num_key_heads"], config["linear_num_value_heads"]
    if ".linear_attn." not in mlx_name or n_k == n_v:
        return TensorUndo(values=values) if values else None
    per_k, v_dim = n_v // n_k, config["linear_value_head_dim"]
    heads = grouped_from_tiled(n_k, per_k, v_dim)
    if ".in_proj_qkv." in mlx_name or ".conv1d." in mlx_name:
        return TensorUndo(rows=with_offset(heads, 2 * n_k * config["linear_key_head_dim"]))
    if ".in_proj_z." in mlx_name:
        return TensorUndo(rows=heads)
    if mlx_name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
        return TensorUndo(rows=grouped_from_tiled(n_k, per_k), values=values)
    if ".out_proj." in mlx_name:
        return TensorUndo(columns=heads)
    return None


def _qwen3next(file: GGUFModelFile) -> dict[str, Any]:
    """mlx-lm's flat qwen3_next config: Qwen3.5's layers (without the value-head reorder, which
    the converter applies to Qwen3.5 only), every MLP a mixture with a shared expert."""
    config = _qwen35moe(file)
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
                  mlp_only_layers=[])
    return config


def _qwen3next_name(mlx_name: str) -> str:
    """The two matrices the converter split ``in_proj_qkvz`` into (``_qwen3next_model``) are named
    like Qwen3.5's separate projections, which gguf-py maps to ``attn_qkv`` and ``attn_gate``."""
    name = _qwen35_name(mlx_name)
    return name.replace(".in_proj_qkvz.parts.0.", ".in_proj_qkv.").replace(".in_proj_qkvz.parts.1.", ".in_proj_z.")


def _qwen3next_undo(config: dict[str, Any], mlx_name: str) -> TensorUndo | None:
    return TensorUndo(values=lambda a, xp: xp.log(-a)) if mlx_name.endswith(".A_log") else None


def qkvz_order(n_k: int, k_dim: int, per_k: int, v_dim: int) -> np.ndarray:
    """Row r of Qwen3-Next's fused ``in_proj_qkvz`` (per key head: its q, k, v heads, z heads) as
    a row of ``[attn_qkv; attn_gate]`` (every q, every k, every v; then every z)."""
    v = per_k * v_dim
    q_rows, k_rows = np.arange(n_k * k_dim).reshape(n_k, k_dim), n_k * k_dim + np.arange(n_k * k_dim).reshape(n_k, k_dim)
    v_rows = 2 * n_k * k_dim + np.arange(n_k * v).reshape(n_k, v)
    z_rows = 2 * n_k * k_dim + n_k * v + np.arange(n_k * v).reshape(n_k, v)
    return np.concatenate([q_rows, k_rows, v_rows, z_rows], axis=1).reshape(-1).astype(np.int32)


def _qwen3next_model(model: Any, config: dict[str, Any]) -> None:
    """Each delta-net layer's ``in_proj_qkvz`` as the two matrices the file stores."""
    n_k, k_dim = config["linear_num_key_heads"], config["linear_key_head_dim"]
    n_v, v_dim = config["linear_num_value_heads"], config["linear_value_head_dim"]
    order = qkvz_order(n_k, k_dim, n_v // n_k, v_dim)
    for layer in model.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.in_proj_qkvz = StoredPartsLinear(
                config["hidden_size"], [2 * n_k * k_dim + n_v * v_dim, n_v * v_dim], order)


def _per_layer(file: GGUFModelFile, key: str, n_layers: int) -> list[Any]:
    """A key that may hold one value per layer, as that list."""
    value = file.arch_value(key)
    if value is None:
        raise UnsupportedArchitecture(f"'{file.path}' lacks {file.architecture}.{key}")
    return list(value) if isinstance(value, list) else [value] * n_layers


def _gemma4(file: GGUFModelFile) -> dict[str, Any]:
    """mlx-lm's gemma4_text config. Sliding layers have their own head size, KV heads and RoPE
    (``*_swa`` keys); full-attention layers rotate a share of their dimensions ("proportional"
    RoPE), which the converter stores as ``rope_freqs`` (1 for a rotated pair, 1e30 for the rest).
    Full layers without ``attn_v`` use their keys as values (``attention_k_eq_v``)."""
    n_layers = int(required(file, "block_count"))
    sliding = [bool(s) for s in _per_layer(file, "attention.sliding_window_pattern", n_layers)]
    layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]
    full = [i for i, s in enumerate(sliding) if not s]
    kv = _per_layer(file, "attention.head_count_kv", n_layers)
    kv_swa = {int(kv[i]) for i in range(n_layers) if sliding[i]}
    kv_full = {int(kv[i]) for i in full}
    ff = [int(f) for f in _per_layer(file, "feed_forward_length", n_layers)]
    shared = int(file.arch_value("attention.shared_kv_layers", 0))
    if len(kv_swa) > 1 or len(kv_full) > 1 or len(set(ff[: n_layers - shared])) > 1:
        raise UnsupportedArchitecture(f"gemma4: per-layer sizes {kv} / {ff} are not mlx-lm's layout")
    head_full, head_swa = int(required(file, "attention.key_length")), int(required(file, "attention.key_length_swa"))
    freqs = file.tensors.get("rope_freqs.weight")
    rotated = head_full // 2
    if freqs is not None:  # proportional RoPE: the pairs whose frequency factor is 1 rotate
        from mlxcel_compat.gguf import quants

        factors = quants.dequantize(read_tensor(freqs), freqs.ggml_type, freqs.n_values)
        rotated = int(np.count_nonzero(factors < 1e20))
    per_layer = int(file.arch_value("embedding_length_per_layer_input", 0))
    config: dict[str, Any] = {
        "hidden_size": int(required(file, "embedding_length")),
        "num_hidden_layers": n_layers,
        "intermediate_size": ff[0],
        "use_double_wide_mlp": any(f == 2 * ff[0] for f in ff[n_layers - shared:]) if shared else False,
        "num_attention_heads": int(required(file, "attention.head_count")),
        "num_key_value_heads": kv_swa.pop() if kv_swa else int(kv[0]),
        "num_global_key_value_heads": kv_full.pop() if kv_full else None,
        "head_dim": head_swa,
        "global_head_dim": head_full,
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": per_layer,
        "rms_norm_eps": float(file.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        "sliding_window": int(required(file, "attention.sliding_window")),
        "layer_types": layer_types,
        "max_position_embeddings": int(file.arch_value("context_length", 131072)),
        "final_logit_softcapping": file.arch_value("final_logit_softcapping"),
        "attention_k_eq_v": bool(full) and all(f"blk.{i}.attn_v.weight" not in file.tensors for i in full),
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 2 * rotated / head_full,
                               "rope_theta": float(file.arch_value("rope.freq_base", 1000000.0))},
            "sliding_attention": {"rope_type": "default",
                                  "partial_rotary_factor": int(file.arch_value("rope.dimension_count_swa", head_swa)) / head_swa,
                                  "rope_theta": float(file.arch_value("rope.freq_base_swa", 10000.0))},
        },
    }
    if per_layer:
        config["vocab_size_per_layer_input"] = int(file.tensors["per_layer_token_embd.weight"].shape[0])
    if file.arch_value("expert_count"):
        config.update(enable_moe_block=True, num_experts=int(required(file, "expert_count")),
                      top_k_experts=int(required(file, "expert_used_count")),
                      moe_intermediate_size=int(required(file, "expert_feed_forward_length")))
    return config


def _gemma4_name(mlx_name: str) -> str:
    """The converter's names: the fused expert matrices under the checkpoint's names, the router's
    scales as ``ffn_gate_inp.scale`` and ``ffn_down_exps.scale``, ``layer_scalar`` with a suffix."""
    name = mlx_name.replace(".experts.switch_glu.", ".experts.")
    name = name.replace(".router.scale", ".router.proj.scale").replace(".router.per_expert_scale", ".experts.down_proj.scale")
    return name + ".weight" if name.endswith(".layer_scalar") else name


def _gemma4_model(model: Any, config: dict[str, Any]) -> None:
    """Each expert layer with its gate and up projections as the one matrix the file stores."""
    for layer in model.layers:
        if getattr(layer, "enable_moe", False):
            glu = layer.experts.switch_glu
            layer.experts.switch_glu = FusedGateUpSwitchGLU(config["hidden_size"], config["moe_intermediate_size"],
                                                            config["num_experts"], glu.activation)


def _granitehybrid(file: GGUFModelFile) -> dict[str, Any]:
    """mlx-lm's granitemoehybrid config: layer kinds from the per-layer KV heads (0: Mamba-2),
    Granite's multipliers, RoPE only where ``rope.scaling.finetuned`` says so (llama.cpp's switch),
    the Mamba-2 sizes; experts when the file has them (else the dense MLP)."""
    n_layers = int(required(file, "block_count"))
    kv = [int(k) for k in _per_layer(file, "attention.head_count_kv", n_layers)]
    attention = {k for k in kv if k}
    if len(attention) > 1:
        raise UnsupportedArchitecture(f"granitehybrid: KV heads per layer {kv} differ between attention layers")
    groups = int(required(file, "ssm.group_count"))
    if groups != 1:  # mlx-lm's gated norm spans the whole inner size
        raise UnsupportedArchitecture(f"granitehybrid with {groups} SSM groups has no mlx-lm equivalent")
    heads, hidden = int(required(file, "ssm.time_step_rank")), int(required(file, "embedding_length"))
    mamba = next((i for i, k in enumerate(kv) if not k), None)
    n_heads = int(required(file, "attention.head_count"))
    scale = float(file.arch_value("attention.scale", 0.0))
    config: dict[str, Any] = {
        "hidden_size": hidden,
        "num_hidden_layers": n_layers,
        "intermediate_size": int(required(file, "feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": attention.pop() if attention else n_heads,
        "layer_types": ["attention" if k else "mamba" for k in kv],
        "attention_bias": any(f"blk.{i}.attn_q.bias" in file.tensors for i, k in enumerate(kv) if k),
        "mlp_bias": False,
        "embedding_multiplier": float(file.arch_value("embedding_scale", 1.0)),
        "attention_multiplier": scale or (hidden // n_heads) ** -0.5,
        "residual_multiplier": float(file.arch_value("residual_scale", 1.0)),
        "logits_scaling": float(file.arch_value("logit_scale", 1.0)),
        "rms_norm_eps": float(file.arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(file.arch_value("context_length", 4096)),
        "position_embedding_type": "rope" if file.arch_value("rope.scaling.finetuned", True) else "nope",
        "rope_theta": float(file.arch_value("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in file.tensors,
        "mamba_n_heads": heads,
        "mamba_d_head": int(required(file, "ssm.inner_size")) // heads,
        "mamba_d_state": int(required(file, "ssm.state_size")),
        "mamba_d_conv": int(required(file, "ssm.conv_kernel")),
        "mamba_n_groups": groups,
        "mamba_conv_bias": mamba is not None and f"blk.{mamba}.ssm_conv1d.bias" in file.tensors,
        "mamba_proj_bias": mamba is not None and f"blk.{mamba}.ssm_in.bias" in file.tensors,
    }
    if file.arch_value("expert_count"):
        config.update(num_local_experts=int(required(file, "expert_count")),
                      num_experts_per_tok=int(required(file, "expert_used_count")),
                      shared_intermediate_size=int(required(file, "expert_shared_feed_forward_length")))
    return config


def _granitehybrid_name(mlx_name: str) -> str:
    """gguf-py's names for mlx-lm's: the experts and the shared MLP (split in the file: see
    ``_granitehybrid_model``) under the names of the tensors the converter writes."""
    name = mlx_name.replace(".block_sparse_moe.switch_mlp.gate_proj.", ".mlp.experts.gate_proj.")
    name = name.replace(".block_sparse_moe.switch_mlp.up_proj.", ".mlp.experts.up_proj.")
    name = name.replace(".block_sparse_moe.switch_mlp.down_proj.", ".block_sparse_moe.output_linear.")
    name = name.replace(".shared_mlp.input_linear.parts.0.", ".mlp.shared_expert.gate_proj.")
    name = name.replace(".shared_mlp.input_linear.parts.1.", ".mlp.shared_expert.up_proj.")
    return name.replace(".mamba.dt_bias", ".mamba.dt_proj.bias")


def _granitehybrid_undo(config: dict[str, Any], mlx_name: str) -> TensorUndo | None:
    return TensorUndo(values=lambda a, xp: xp.log(-a)) if mlx_name.endswith(".A_log") else None


def _granitehybrid_model(model: Any, config: dict[str, Any]) -> None:
    """The shared MLP's fused ``input_linear`` (gate rows, then up rows) as the two matrices the
    file stores (``ffn_gate_shexp``, ``ffn_up_shexp``)."""
    width = config.get("shared_intermediate_size")
    for layer in model.layers:
        if hasattr(layer, "shared_mlp"):
            layer.shared_mlp.input_linear = StoredPartsLinear(config["hidden_size"], [width, width],
                                                              np.arange(2 * width))


def _nemotron_h(file: GGUFModelFile) -> dict[str, Any]:
    """mlx-lm's nemotron_h config: each layer one block, told apart as llama.cpp does: KV heads
    (attention), else an MLP width (squared-ReLU MLP), else Mamba-2."""
    n_layers = int(required(file, "block_count"))
    kv = [int(k) for k in _per_layer(file, "attention.head_count_kv", n_layers)]
    ff = [int(f) for f in _per_layer(file, "feed_forward_length", n_layers)]
    pattern = "".join("*" if k else "-" if f else "M" for k, f in zip(kv, ff))
    if file.arch_value("expert_count") or len({k for k in kv if k}) > 1 or len({f for f in ff if f}) > 1:
        raise UnsupportedArchitecture("nemotron_h: experts or per-layer sizes beyond one attention and one MLP "
                                      "shape have no mlx-lm equivalent here")
    heads, mamba = int(required(file, "ssm.time_step_rank")), pattern.find("M")
    n_heads = int(required(file, "attention.head_count"))
    return {
        "hidden_size": int(required(file, "embedding_length")),
        "num_hidden_layers": n_layers,
        "hybrid_override_pattern": list(pattern),
        "intermediate_size": max(ff),
        "num_attention_heads": n_heads,
        "num_key_value_heads": max(kv) or n_heads,
        "head_dim": int(file.arch_value("attention.key_length", int(required(file, "embedding_length")) // n_heads)),
        "attention_bias": any(f"blk.{i}.attn_q.bias" in file.tensors for i, k in enumerate(kv) if k),
        "mlp_bias": any(f"blk.{i}.ffn_up.bias" in file.tensors for i, f in enumerate(ff) if f),
        "use_bias": False,
        "mamba_num_heads": heads,
        "mamba_head_dim": int(required(file, "ssm.inner_size")) // heads,
        "ssm_state_size": int(required(file, "ssm.state_size")),
        "conv_kernel": int(required(file, "ssm.conv_kernel")),
        "n_groups": int(required(file, "ssm.group_count")),
        "use_conv_bias": mamba >= 0 and f"blk.{mamba}.ssm_conv1d.bias" in file.tensors,
        "mamba_proj_bias": mamba >= 0 and f"blk.{mamba}.ssm_in.bias" in file.tensors,
        "layer_norm_epsilon": float(file.arch_value("attention.layer_norm_rms_epsilon",
                                                    file.arch_value("attention.layer_norm_epsilon", 1e-5))),
        "max_position_embeddings": int(file.arch_value("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in file.tensors,
    }


def _nemotron_h_name(mlx_name: str) -> str:
    return mlx_name.replace(".mixer.dt_bias", ".mixer.dt_proj.bias")


def _nemotron_h_undo(config: dict[str, Any], mlx_name: str) -> TensorUndo | None:
    """``A_log`` back from ``-exp``; the attention's Q/K rows back from llama's permutation
    (GraniteHybridModel's ``undo_permute``, which the converter keeps for Nemotron-H)."""
    if mlx_name.endswith(".A_log"):
        return TensorUndo(values=lambda a, xp: xp.log(-a))
    head_dim = config["head_dim"]
    if mlx_name.endswith(".mixer.q_proj.weight"):
        return TensorUndo(rows=llama_rows(config["num_attention_heads"] * head_dim, config["num_attention_heads"]))
    if mlx_name.endswith(".mixer.k_proj.weight"):
        return TensorUndo(rows=llama_rows(config["num_key_value_heads"] * head_dim, config["num_key_value_heads"]))
    return None


SPECS: tuple[ArchSpec, ...] = (
    ArchSpec("qwen35", "qwen3_5", "Qwen3_5ForCausalLM", _qwen35, hf_name=_qwen35_name, undo=_qwen35_undo),
    ArchSpec("qwen35moe", "qwen3_5_moe", "Qwen3_5MoeForCausalLM", _qwen35moe, hf_name=_qwen35_name,
             undo=_qwen35_undo),
    ArchSpec("qwen3next", "qwen3_next", "Qwen3NextForCausalLM", _qwen3next, hf_name=_qwen3next_name,
             undo=_qwen3next_undo, prepare_model=_qwen3next_model),
    ArchSpec("gemma4", "gemma4_text", "Gemma4ForCausalLM", _gemma4, hf_name=_gemma4_name, prepare_model=_gemma4_model),
    ArchSpec("granitehybrid", "granitemoehybrid", "GraniteMoeHybridForCausalLM", _granitehybrid, permute_qk=True,
             hf_name=_granitehybrid_name, undo=_granitehybrid_undo, prepare_model=_granitehybrid_model),
    ArchSpec("nemotron_h", "nemotron_h", "NemotronHForCausalLM", _nemotron_h, hf_name=_nemotron_h_name,
             undo=_nemotron_h_undo),
)
