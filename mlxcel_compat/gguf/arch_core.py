"""The first architectures served from GGUF: llama (and Mistral files), qwen2 (and qwen2vl), qwen3 (and qwen3vl), gemma3, lfm2.

Each builder reads the ``{arch}.*`` metadata into the ``config.json`` mlx-lm would read; the
rows (:data:`SPECS`) say what the converter changed: llama's Q/K rows were permuted for ggml's
interleaved RoPE, Gemma's norms stored as ``1 + w``, LFM2's convolution squeezed to 2-D.
"""

from __future__ import annotations

from typing import Any

from mlxcel_compat.gguf.arch_spec import (ArchSpec, UnsupportedArchitecture, common_config, required)
from mlxcel_compat.gguf.reader import GGUFModelFile


def _llama(file: GGUFModelFile) -> dict[str, Any]:
    config = common_config(file)
    config.setdefault("rope_theta", 10000.0)
    config["attention_bias"] = "blk.0.attn_q.bias" in file.tensors
    config["mlp_bias"] = "blk.0.ffn_up.bias" in file.tensors
    if (window := file.arch_value("attention.sliding_window")) and "rope_freqs.weight" not in file.tensors:
        config["sliding_window"] = int(window)
    return config


def _qwen2(file: GGUFModelFile) -> dict[str, Any]:
    config = common_config(file)
    if config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]:
        raise UnsupportedArchitecture("qwen2 with head_dim != hidden / heads has no mlx-lm equivalent")
    config.setdefault("rope_theta", 1000000.0)
    return config


def _qwen2vl(file: GGUFModelFile) -> dict[str, Any]:
    """Qwen2-VL / Qwen2.5-VL's text model: qwen2 with M-RoPE. Text alone takes one position per
    token on all three axes, which is plain RoPE (mlx-lm's qwen2); the sections are kept for a
    projector (``--mmproj``, ``vision/gguf_model.py``), whose images need the three axes."""
    config = _qwen2(file)
    sections = file.arch_value("rope.dimension_sections")
    if sections is not None:
        config["mrope_section"] = [int(s) for s in list(sections)[:3]]
    return config


def _qwen3(file: GGUFModelFile) -> dict[str, Any]:
    config = common_config(file)
    config.setdefault("rope_theta", 1000000.0)
    return config


def _qwen3vl(file: GGUFModelFile) -> dict[str, Any]:
    """Qwen3-VL's text model: qwen3 with interleaved M-RoPE (llama.cpp's ``IMROPE``). Text alone
    takes one position per token on all three axes, which is plain RoPE (mlx-lm's qwen3); the
    sections and the deepstack count are kept for a projector (``--mmproj``, ``vision/qwen3vl.py``)."""
    config = _qwen3(file)
    sections = file.arch_value("rope.dimension_sections")
    if sections is not None:
        config["mrope_section"] = [int(s) for s in list(sections)[:3]]
    config["n_deepstack_layers"] = int(file.arch_value("n_deepstack_layers", 0))
    return config


def _gemma3(file: GGUFModelFile) -> dict[str, Any]:
    config = common_config(file)
    n_layers = config["num_hidden_layers"]
    pattern = file.arch_value("attention.sliding_window_pattern")
    if isinstance(pattern, list):
        # Per layer, True = sliding. mlx-lm wants a period p: every p-th layer is global.
        period = next((i + 1 for i, sliding in enumerate(pattern) if not sliding), n_layers)
        expected = [(i + 1) % period != 0 for i in range(n_layers)]
        if [bool(x) for x in pattern] != expected:
            raise UnsupportedArchitecture(f"gemma3 sliding-window layout {pattern} is not periodic")
    else:
        period = int(pattern) if pattern else 6  # llama.cpp's built-in value for Gemma 3
    config.update(
        sliding_window=int(file.arch_value("attention.sliding_window", 512)),
        sliding_window_pattern=period,
        rope_local_base_freq=float(file.arch_value("rope.freq_base_swa", 10000.0)),
        # llama.cpp: the 27B (62 layers) scales queries by hidden/heads, the others by head_dim.
        query_pre_attn_scalar=(config["hidden_size"] // config["num_attention_heads"]
                               if n_layers == 62 else config["head_dim"]),
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    )
    config.setdefault("rope_theta", 1000000.0)
    return config


def _lfm2(file: GGUFModelFile) -> dict[str, Any]:
    kv = file.arch_value("attention.head_count_kv")
    n_layers = int(required(file, "block_count"))
    kv_per_layer = kv if isinstance(kv, list) else [kv] * n_layers
    attention = [int(k) for k in kv_per_layer if k]
    if not attention or len(set(attention)) != 1:
        raise UnsupportedArchitecture(f"lfm2 head_count_kv per layer {kv_per_layer} is not supported")
    hidden = int(required(file, "embedding_length"))
    ff = int(required(file, "feed_forward_length"))
    return {
        "hidden_size": hidden,
        "block_dim": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": int(required(file, "attention.head_count")),
        "num_key_value_heads": attention[0],
        "layer_types": ["full_attention" if k else "conv" for k in kv_per_layer],
        "block_ff_dim": ff,
        "intermediate_size": ff,
        "block_auto_adjust_ff_dim": False,  # the GGUF stores the adjusted size
        "block_multiple_of": 256,
        "block_ffn_dim_multiplier": 1.0,
        "conv_L_cache": int(required(file, "shortconv.l_cache")),
        "conv_bias": "blk.0.shortconv.in_proj.bias" in file.tensors,
        "norm_eps": float(file.arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(file.arch_value("rope.freq_base", 1000000.0)),
        "max_position_embeddings": int(file.arch_value("context_length", 128000)),
        "tie_word_embeddings": True,
    }


SPECS: tuple[ArchSpec, ...] = (
    ArchSpec("llama", "llama", "LlamaForCausalLM", _llama, permute_qk=True),
    ArchSpec("qwen2", "qwen2", "Qwen2ForCausalLM", _qwen2),
    ArchSpec("qwen3", "qwen3", "Qwen3ForCausalLM", _qwen3),
    ArchSpec("gemma3", "gemma3_text", "Gemma3ForCausalLM", _gemma3, norm_shift=1.0),
    ArchSpec("lfm2", "lfm2", "Lfm2ForCausalLM", _lfm2),
    ArchSpec("qwen2vl", "qwen2", "Qwen2VLForConditionalGeneration", _qwen2vl),
    ArchSpec("qwen3vl", "qwen3", "Qwen3VLForConditionalGeneration", _qwen3vl),
)
