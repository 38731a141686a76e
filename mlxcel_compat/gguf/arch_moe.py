"""Mixture-of-experts architectures: qwen3moe, qwen2moe, olmoe, granitemoe, glm4moe, ernie4_5-moe, gpt-oss, deepseek2 (MLA), lfm2moe.

Each row (:data:`SPECS`) names the mlx-lm model that serves the architecture; its config builder
and the undo steps for what llama.cpp's converter changed sit beside it in this module.

What every MoE row shares: the converter stacks a layer's per-expert matrices into one
``[n_expert, rows, cols]`` tensor (``blk.N.ffn_{gate,up,down}_exps``), which is exactly the
weight of mlx-lm's ``SwitchGLU`` projections (``...switch_mlp.{gate,up,down}_proj``): no values
change, only the name (``SWITCH_MLP``). The router (``ffn_gate_inp``) stays F32 in every file.
"""

from __future__ import annotations

from typing import Any

from mlxcel_compat.gguf.arch_spec import ArchSpec, UnsupportedArchitecture, common_config, required
from mlxcel_compat.gguf.reader import GGUFModelFile

# mlx-lm's stacked experts, under the name the converter gave its stack of the checkpoint's experts.
SWITCH_MLP = (".mlp.switch_mlp.", ".mlp.experts.")


def expert_config(file: GGUFModelFile) -> dict[str, int]:
    """The expert count, the experts used per token and one expert's width, as llama.cpp reads
    them (``expert_count``, ``expert_used_count``, ``expert_feed_forward_length``; without the
    last, llama.cpp takes ``feed_forward_length / expert_used_count``)."""
    n_expert = int(required(file, "expert_count"))
    n_used = int(required(file, "expert_used_count"))
    if not 0 < n_used <= n_expert:
        raise UnsupportedArchitecture(f"{file.architecture}: expert_used_count {n_used} with {n_expert} experts")
    width = file.arch_value("expert_feed_forward_length")
    if isinstance(width, list):  # per layer in some files; mlx-lm's models take one width
        width = _one(file, "expert_feed_forward_length", [w for w in width if w])
    if not width:
        width = int(required(file, "feed_forward_length")) // n_used
    return {"n_expert": n_expert, "n_used": n_used, "width": int(width)}


def _one(file: GGUFModelFile, key: str, values: list[Any]) -> Any:
    if len(set(values)) != 1:
        raise UnsupportedArchitecture(f"{file.architecture}.{key} differs between layers ({values}); "
                                      "mlx-lm models need one value")
    return values[0]


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


SPECS: tuple[ArchSpec, ...] = (
    ArchSpec("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM", _qwen3moe, renames=(SWITCH_MLP,)),
    # mlx-lm's expert stacks keep the checkpoint's names (mlp.experts.*); the sinks gain ".weight".
    ArchSpec("gpt-oss", "gpt_oss", "GptOssForCausalLM", _gpt_oss,
             renames=((".self_attn.sinks", ".self_attn.sinks.weight"),)),
)
