"""The factory's models as Hugging Face checkpoints: mlx-lm's parameters in each family's own form.

A factory directory is what transformers and llama.cpp's converter read, so a family whose
checkpoint differs from mlx-lm's parameters (what mlx-lm's ``sanitize`` turns a checkpoint into)
stores the checkpoint's form: experts one by one, fused gate/up tensors, MLA's whole ``kv_b_proj``,
PyTorch's convolution layout. ``Family.hf_layout`` names the function; ``model_directory.py``
applies it when writing, and mlx-lm's ``sanitize`` maps it back when loading. The factory's GGUF
writer starts from mlx-lm's parameters, as the converter ends at llama.cpp's layout either way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Weights = dict[str, Any]


def lfm2(weights: Weights, config: dict[str, Any]) -> Weights:
    """LFM2's depthwise convolutions as PyTorch stores them: (C, 1, K), where MLX keeps (C, K, 1)."""
    return {name: value.transpose(0, 2, 1) if name.endswith("conv.conv.weight") else value
            for name, value in weights.items()}


def unstack(weights: Weights, stack: str = "switch_mlp", experts: str = "experts") -> Weights:
    """mlx-lm's stacked experts (``...switch_mlp.gate_proj.weight``, [E, rows, cols]) one by one."""
    out = {}
    for k, v in weights.items():
        if f".{stack}." in k:
            prefix, proj = k.split(f".{stack}.")
            for e in range(v.shape[0]):
                out[f"{prefix}.{experts}.{e}.{proj}"] = v[e]
        else:
            out[k] = v
    return out


def experts_one_by_one(weights: Weights, config: dict[str, Any]) -> Weights:
    """Experts one by one, the rest as mlx-lm names it (Qwen3-MoE, Qwen2-MoE, OLMoE, ERNIE-4.5-MoE,
    DeepSeek-V2, whose ``kv_b_proj`` mlx-lm keeps whole)."""
    return unstack(weights)


def gpt_oss_bf16(weights: Weights, config: dict[str, Any]) -> Weights:
    """gpt-oss's BF16 checkpoint form (unsloth/gpt-oss-20b-BF16): gate and up interleaved in one
    [E, hidden, 2 ff] tensor, down as [E, ff, hidden], biases beside them as *_bias.

    llama.cpp's converter reads it; mlx-lm loads only OpenAI's original MXFP4 form, so the
    factory's gpt-oss directory keeps mlx-lm's own parameters (no ``hf_layout``) and the
    converter cross-check (``scripts/check_gguf_architectures.py``) writes this form beside it."""
    out = {}
    for k, v in weights.items():
        if ".mlp.experts.gate_proj." in k or ".mlp.experts.up_proj." in k:
            continue
        if ".mlp.experts.down_proj.weight" in k:
            out[k.replace("down_proj.weight", "down_proj")] = v.transpose(0, 2, 1)
        elif ".mlp.experts.down_proj.bias" in k:
            out[k.replace("down_proj.bias", "down_proj_bias")] = v
        else:
            out[k] = v
    for k in [k for k in weights if k.endswith(".mlp.experts.gate_proj.weight")]:
        prefix = k[: -len("gate_proj.weight")]
        g, u = weights[prefix + "gate_proj.weight"], weights[prefix + "up_proj.weight"]
        gu = np.empty((g.shape[0], 2 * g.shape[1], g.shape[2]), dtype=g.dtype)
        gu[:, ::2], gu[:, 1::2] = g, u
        out[prefix + "gate_up_proj"] = gu.transpose(0, 2, 1)
        gb, ub = weights[prefix + "gate_proj.bias"], weights[prefix + "up_proj.bias"]
        gub = np.empty((gb.shape[0], 2 * gb.shape[1]), dtype=gb.dtype)
        gub[:, ::2], gub[:, 1::2] = gb, ub
        out[prefix + "gate_up_proj_bias"] = gub
    return out


def glm4_moe(weights: Weights, config: dict[str, Any]) -> Weights:
    """Experts one by one, and a NextN layer (the checkpoint has one; mlx-lm drops it): the last
    decoder layer's tensors under the next index, with its eh_proj, enorm, hnorm and shared head
    norm, so the converter's file carries a NextN layer our loader must leave out."""
    out = unstack(weights)
    n = config["num_hidden_layers"]
    rng = np.random.default_rng(7)
    for k in [k for k in out if k.startswith(f"model.layers.{n - 1}.")]:
        out[k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}.")] = out[k].copy()
    h = config["hidden_size"]
    out[f"model.layers.{n}.eh_proj.weight"] = rng.standard_normal((h, 2 * h)).astype(np.float32) / 8
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        out[f"model.layers.{n}.{norm}.weight"] = np.ones(h, np.float32)
    return out


def deepseek_v3(weights: Weights, config: dict[str, Any]) -> Weights:
    """Experts one by one, and MLA's kv_b_proj whole: per head the key rows (embed_q transposed)
    then the value rows (unembed_out), as DeepSeek's checkpoints hold it."""
    out = {}
    for k, v in unstack(weights).items():
        if ".self_attn.embed_q." in k:
            prefix = k.split(".self_attn.embed_q.")[0]
            k_b = v.transpose(0, 2, 1)
            v_b = weights[f"{prefix}.self_attn.unembed_out.weight"]
            kv_b = np.concatenate([k_b, v_b], axis=1)
            out[f"{prefix}.self_attn.kv_b_proj.weight"] = kv_b.reshape(-1, kv_b.shape[-1])
        elif ".self_attn.unembed_out." not in k:
            out[k] = v
    return out


def granitemoe(weights: Weights, config: dict[str, Any]) -> Weights:
    """Granite's JetMoe experts: gate and up stacked in input_linear [E, 2 ff, hidden], down as
    output_linear; the router as block_sparse_moe.router.layer (already so named)."""
    out = {}
    for k, v in weights.items():
        if ".block_sparse_moe.switch_mlp.gate_proj." in k:
            up = weights[k.replace("gate_proj", "up_proj")]
            out[k.replace("switch_mlp.gate_proj", "input_linear")] = np.concatenate([v, up], axis=1)
        elif ".block_sparse_moe.switch_mlp.down_proj." in k:
            out[k.replace("switch_mlp.down_proj", "output_linear")] = v
        elif ".block_sparse_moe.switch_mlp.up_proj." not in k:
            out[k] = v
    return out


def lfm2_moe(weights: Weights, config: dict[str, Any]) -> Weights:
    """LFM2's checkpoint names: w1 / w2 / w3 for gate / down / up (experts one by one), the
    convolution as [C, 1, L]."""
    out = {}
    for k, v in unstack(weights, stack="switch_mlp", experts="experts").items():
        if ".conv.conv.weight" in k:
            v = v.transpose(0, 2, 1)
        for ours, theirs in ((".gate_proj.", ".w1."), (".down_proj.", ".w2."), (".up_proj.", ".w3.")):
            if ".feed_forward." in k:
                k = k.replace(ours, theirs)
        out[k] = v
    return out




def qwen3_next(weights: Weights, config: dict[str, Any]) -> Weights:
    """Qwen3-Next's checkpoint form, the inverse of mlx-lm's ``sanitize``: experts one by one, the
    convolutions as (channels, 1, width) and the RMS norms without the 1 it adds. The factory's
    directory keeps mlx-lm's layout; scripts/check_gguf_architectures.py gives the converter this."""
    norms = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
             ".q_norm.weight", ".k_norm.weight")
    out = {}
    for k, v in unstack(weights).items():
        if "conv1d.weight" in k:
            v = v.transpose(0, 2, 1)
        elif v.ndim == 1 and k.endswith(norms):
            v = v - np.float32(1.0)
        out[k] = v
    return out


def qwen3_5(weights: Weights, config: dict[str, Any]) -> Weights:
    """Qwen3.5's (dense or MoE) checkpoint form, the inverse of mlx-lm's ``sanitize``: the text
    model under ``model.language_model.``, the experts as the stacked ``experts.gate_up_proj`` and
    ``experts.down_proj``, the convolutions and norms as for :func:`qwen3_next`."""
    out = {}
    for k, v in qwen3_next(weights, config).items():
        if k.startswith("language_model.model."):
            k = "model.language_model." + k[len("language_model.model."):]
        elif k.startswith("language_model."):
            k = k[len("language_model."):]
        out[k] = v
    for k in [k for k in out if k.endswith(".mlp.experts.0.gate_proj.weight")]:
        prefix = k[: -len("0.gate_proj.weight")]
        n = sum(1 for name in out if name.startswith(prefix) and name.endswith(".gate_proj.weight"))
        gate = [out.pop(f"{prefix}{e}.gate_proj.weight") for e in range(n)]
        up = [out.pop(f"{prefix}{e}.up_proj.weight") for e in range(n)]
        down = [out.pop(f"{prefix}{e}.down_proj.weight") for e in range(n)]
        out[prefix + "gate_up_proj"] = np.concatenate([np.stack(gate), np.stack(up)], axis=1)
        out[prefix + "down_proj"] = np.stack(down)
    return out


def gemma4_moe(weights: Weights, config: dict[str, Any]) -> Weights:
    """Gemma 4 MoE's checkpoint form, the inverse of mlx-lm's ``sanitize``: the experts as the
    stacked ``experts.gate_up_proj`` (gate rows, then up rows) and ``experts.down_proj``."""
    out = dict(weights)
    for k in [k for k in weights if k.endswith(".experts.switch_glu.gate_proj.weight")]:
        base = k[: -len(".switch_glu.gate_proj.weight")]
        gate, up = out.pop(k), out.pop(f"{base}.switch_glu.up_proj.weight")
        out[f"{base}.gate_up_proj"] = np.concatenate([gate, up], axis=-2)
        out[f"{base}.down_proj"] = out.pop(f"{base}.switch_glu.down_proj.weight")
    return out


def granitemoehybrid(weights: Weights, config: dict[str, Any]) -> Weights:
    """Granite 4.0-H's checkpoint form, the inverse of mlx-lm's ``sanitize``: the experts as for
    :func:`granitemoe` and the Mamba-2 convolutions as (channels, 1, width)."""
    return {k: v.transpose(0, 2, 1) if "conv1d.weight" in k else v for k, v in granitemoe(weights, config).items()}
