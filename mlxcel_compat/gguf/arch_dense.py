"""Dense decoder architectures beyond the core ones: mistral3, phi3, gemma2, smollm3, olmo2, granite, glm4, exaone4, cohere2, starcoder2, seed_oss, ernie4_5, apertus.

Each row (:data:`SPECS`) names the mlx-lm model that serves the architecture; its config builder
and the undo steps for what llama.cpp's converter changed sit beside it in this module. What each
builder reads is what the converter's class writes (``convert_hf_to_gguf.py``) and llama.cpp's
loader reads (``src/models/<arch>.cpp``), including the values llama.cpp fixes in code rather than
metadata (SmolLM3's NoPE period, Cohere 2's sliding-window period).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import numpy as np

from mlxcel_compat.gguf import quants
from mlxcel_compat.gguf.arch_spec import ArchSpec, UnsupportedArchitecture, common_config, required
from mlxcel_compat.gguf.reader import GGUFModelFile, read_tensor

log = logging.getLogger(__name__)


def tensor_values(file: GGUFModelFile, name: str) -> np.ndarray:
    """A small tensor's values as float32 (rope factors read into the config)."""
    info = file.tensors[name]
    return quants.dequantize(read_tensor(info), info.ggml_type, info.n_values).astype(np.float32)


def _mistral3(file: GGUFModelFile) -> dict[str, Any]:
    """Ministral 3 (and Mistral Small 3.x, Devstral as the converter now writes them: ``mistral3``).

    mlx-lm's ``ministral3`` is llama plus Llama 4's attention temperature (queries scaled by
    ``1 + beta log(1 + floor(pos / original_context))``), llama.cpp's ``attention.temperature_scale``
    with the YaRN original context as the period; a file without it gets beta 0 (plain llama).
    ``rope.scaling.yarn_log_multiplier`` is the config's ``mscale_all_dim`` (llama.cpp assumes mscale 1)."""
    config = common_config(file)
    rope: dict[str, Any] = dict(config.pop("rope_scaling", None) or {"rope_type": "default"})
    rope["rope_theta"] = config.pop("rope_theta", 1000000.0)
    if (log_mul := file.arch_value("rope.scaling.yarn_log_multiplier")) is not None:
        rope.update(mscale=1.0, mscale_all_dim=float(log_mul))
    rope["llama_4_scaling_beta"] = float(file.arch_value("attention.temperature_scale", 0.0))
    rope.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    config["rope_parameters"] = rope
    return config


PHI3_ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _phi3(file: GGUFModelFile) -> dict[str, Any]:
    """Phi-3 / Phi-4: fused ``attn_qkv`` and ``ffn_up`` (gate and up) as mlx-lm's ``qkv_proj`` and
    ``gate_up_proj``; the rotated share of a head from ``rope.dimension_count``; LongRoPE's factor
    tensors into the config. mlx-lm's ``SuScaledRoPE`` always applies the long factors, scaled by
    ``sqrt(1 + ln(max / original) / ln(original))``, which is the ``rope.scaling.attn_factor`` the
    converter writes; llama.cpp switches to the short factors while a sequence's context is at most
    the original one. The sliding window is ignored, as llama.cpp ignores it for Phi-3."""
    config = common_config(file)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    if config.pop("head_dim") != head_dim:
        raise UnsupportedArchitecture("phi3 with head_dim != hidden / heads has no mlx-lm equivalent")
    rotated = int(file.arch_value("rope.dimension_count", head_dim))
    config["partial_rotary_factor"] = rotated / head_dim
    original = int(file.arch_value("rope.scaling.original_context_length", config["max_position_embeddings"]))
    config["original_max_position_embeddings"] = original
    config.setdefault("rope_theta", 10000.0)
    if all(name in file.tensors for name in PHI3_ROPE_FACTORS):
        long, short = (tensor_values(file, name).tolist() for name in PHI3_ROPE_FACTORS)
        config["rope_scaling"] = {"type": "longrope", "long_factor": long, "short_factor": short}
        factor = config["max_position_embeddings"] / original
        expected = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        stored = float(file.arch_value("rope.scaling.attn_factor", expected))
        if abs(stored - expected) > 1e-6 * expected:
            raise UnsupportedArchitecture(f"phi3 rope.scaling.attn_factor {stored} is not LongRoPE's scale {expected} "
                                          "(mlx-lm's SuScaledRoPE computes its own)")
    return config


def _gemma2(file: GGUFModelFile) -> dict[str, Any]:
    """Gemma 2: norms stored as ``1 + w`` (the row's ``norm_shift``), attention and final logit
    soft-capping, the query scale llama.cpp fixes by size (hidden / heads for the 27B's 46 layers,
    head_dim otherwise: Gemma's ``query_pre_attn_scalar``, which the file does not carry).

    mlx-lm's ``gemma2`` attends to the whole context in every layer; llama.cpp (as transformers)
    limits every other layer to ``attention.sliding_window`` (4096 in the released models). Up to
    that many tokens the two agree; past it they differ, and the start-up log says so."""
    config = common_config(file)
    config.setdefault("rope_theta", 10000.0)
    config["query_pre_attn_scalar"] = (config["hidden_size"] // config["num_attention_heads"]
                                       if config["num_hidden_layers"] == 46 else config["head_dim"])
    config["attn_logit_softcapping"] = float(file.arch_value("attn_logit_softcapping", 50.0))
    config["final_logit_softcapping"] = float(file.arch_value("final_logit_softcapping", 30.0))
    window = int(file.arch_value("attention.sliding_window", 4096))
    if window < config["max_position_embeddings"]:
        log.warning("gemma2: mlx-lm's model attends globally in every layer; llama.cpp limits every other "
                    "layer to %d tokens, so contexts longer than that differ from llama-server's", window)
    return config


def _smollm3(file: GGUFModelFile) -> dict[str, Any]:
    """SmolLM3: llama (Q/K rows permuted) whose every fourth layer has no RoPE. The file does not
    say which: llama.cpp fixes the period at 4 (``n_no_rope_layer_step``), and so does this."""
    config = common_config(file)
    config.setdefault("rope_theta", 10000.0)
    config["attention_bias"] = "blk.0.attn_q.bias" in file.tensors
    config["mlp_bias"] = "blk.0.ffn_up.bias" in file.tensors
    config["no_rope_layer_interval"] = 4
    return config


def _olmo2(file: GGUFModelFile) -> dict[str, Any]:
    """OLMo 2 (post-norms, RMS norms over all the heads' queries and keys): mlx-lm's ``olmo2``.
    Olmo 3 files are ``olmo2`` too, with ``attention.sliding_window`` and its per-layer pattern:
    mlx-lm's ``olmo3`` (its sliding layers take plain RoPE, as llama.cpp's, and the global ones the
    file's scaling)."""
    config = common_config(file)
    config.setdefault("rope_theta", 10000.0)
    config["attention_bias"] = "blk.0.attn_q.bias" in file.tensors
    if (window := file.arch_value("attention.sliding_window")) is not None:
        pattern = file.arch_value("attention.sliding_window_pattern")
        if not isinstance(pattern, list) or len(pattern) != config["num_hidden_layers"]:
            raise UnsupportedArchitecture(f"olmo2 with a sliding window needs a per-layer pattern, not {pattern!r}")
        if float(file.arch_value("rope.freq_base_swa", config["rope_theta"])) != config["rope_theta"]:
            raise UnsupportedArchitecture("olmo2: mlx-lm's olmo3 gives sliding layers the global RoPE base")
        config.update(model_type="olmo3", sliding_window=int(window),
                      layer_types=["sliding_attention" if sliding else "full_attention" for sliding in pattern])
    return config


def _granite(file: GGUFModelFile) -> dict[str, Any]:
    """Granite 3.x: llama (Q/K rows permuted) with the four multipliers as llama.cpp reads them
    (``attention.scale``, ``embedding_scale``, ``residual_scale``, ``logit_scale``, the logits'
    divisor); an absent one means no scaling, the attention's then ``1 / sqrt(head_dim)``."""
    config = common_config(file)
    if config.pop("head_dim") != config["hidden_size"] // config["num_attention_heads"]:
        raise UnsupportedArchitecture("granite with head_dim != hidden / heads has no mlx-lm equivalent")
    config.setdefault("rope_theta", 10000.0)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    config.update(
        attention_bias="blk.0.attn_q.bias" in file.tensors,
        mlp_bias="blk.0.ffn_up.bias" in file.tensors,
        attention_multiplier=float(file.arch_value("attention.scale", 0.0) or head_dim ** -0.5),
        embedding_multiplier=float(file.arch_value("embedding_scale", 0.0) or 1.0),
        residual_multiplier=float(file.arch_value("residual_scale", 0.0) or 1.0),
        logits_scaling=float(required(file, "logit_scale")),
    )
    return config


def _glm4(file: GGUFModelFile) -> dict[str, Any]:
    """GLM-4-0414: fused ``ffn_up`` (gate and up) as mlx-lm's ``gate_up_proj``, sandwich norms,
    interleaved RoPE over the ``rope.dimension_count`` first dimensions of a head (llama.cpp's
    NORM RoPE, mlx-lm's ``rope_traditional``; the converter permutes nothing unless it writes
    M-RoPE sections, which mlx-lm's ``glm4`` does not take). mlx-lm's head is never tied."""
    if file.arch_value("rope.dimension_sections") is not None:
        raise UnsupportedArchitecture("glm4 with M-RoPE sections (GLM-4V) has no mlx-lm text model")
    config = common_config(file)
    config.setdefault("rope_theta", 10000.0)
    rotated = int(file.arch_value("rope.dimension_count", config["head_dim"]))
    config["partial_rotary_factor"] = rotated / config["head_dim"]
    config["attention_bias"] = "blk.0.attn_q.bias" in file.tensors or "blk.0.attn_qkv.bias" in file.tensors
    return config


def _exaone4(file: GGUFModelFile) -> dict[str, Any]:
    """EXAONE 4.0: post-norms, per-head Q/K norms, Llama 3 RoPE factors as the ``rope_freqs``
    tensor (the row's ``llama3_rope_freqs``). llama.cpp takes sliding windows only for the 32B's
    64 layers (its local layers with RoPE, the global ones without), so only then does the
    per-layer pattern become mlx-lm's ``sliding_window_pattern``; otherwise every layer is global
    with RoPE, as llama.cpp runs it."""
    config = common_config(file)
    config.setdefault("rope_theta", 10000.0)
    config.update(rope_scaling=config.get("rope_scaling"), sliding_window=None, sliding_window_pattern=None)
    pattern = file.arch_value("attention.sliding_window_pattern")
    if config["num_hidden_layers"] == 64:
        if not isinstance(pattern, list):
            period = int(pattern or 4)  # llama.cpp's default for EXAONE 4: three local layers, one global
            pattern = [(i + 1) % period != 0 for i in range(64)]
        if float(file.arch_value("rope.freq_base_swa", config["rope_theta"])) != config["rope_theta"]:
            raise UnsupportedArchitecture("exaone4: mlx-lm gives sliding layers the global RoPE base")
        config["sliding_window"] = int(file.arch_value("attention.sliding_window", 4096))
        config["sliding_window_pattern"] = "".join("L" if sliding else "G" for sliding in pattern)
    return config


def sliding_period(file: GGUFModelFile, n_layers: int, default: int) -> int:
    """mlx-lm's ``sliding_window_pattern`` period p (every p-th layer global, the others sliding)
    from ``attention.sliding_window_pattern``: llama.cpp's per-layer flags, a period, or absent
    (llama.cpp's built-in ``default`` for the architecture)."""
    pattern = file.arch_value("attention.sliding_window_pattern")
    if not isinstance(pattern, list):
        return int(pattern or default)
    period = next((i + 1 for i, sliding in enumerate(pattern) if not sliding), n_layers)
    if [bool(x) for x in pattern] != [(i + 1) % period != 0 for i in range(n_layers)]:
        raise UnsupportedArchitecture(f"{file.architecture} sliding-window layout {pattern} is not periodic")
    return period


def _cohere2(file: GGUFModelFile) -> dict[str, Any]:
    """Command R7B / Command A: parallel attention and MLP after one bias-free LayerNorm,
    interleaved RoPE only in the sliding-window layers (three of four: llama.cpp's default
    period), logits times ``logit_scale``, tied embeddings; the converter drops the zero biases."""
    config = common_config(file)
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    if config["head_dim"] != head_dim or int(file.arch_value("rope.dimension_count", head_dim)) != head_dim:
        raise UnsupportedArchitecture("cohere2 with head_dim != hidden / heads or partial RoPE "
                                      "has no mlx-lm equivalent")
    config.setdefault("rope_theta", 10000.0)
    if float(file.arch_value("rope.freq_base_swa", config["rope_theta"])) != config["rope_theta"]:
        raise UnsupportedArchitecture("cohere2: mlx-lm gives sliding layers the global RoPE base")
    config.update(
        layer_norm_eps=float(file.arch_value("attention.layer_norm_epsilon", 1e-5)),
        logit_scale=float(required(file, "logit_scale")),
        sliding_window=int(required(file, "attention.sliding_window")),
        sliding_window_pattern=sliding_period(file, config["num_hidden_layers"], 4),
        attention_bias="blk.0.attn_q.bias" in file.tensors,
        layer_norm_bias=False,
    )
    return config


def _starcoder2(file: GGUFModelFile) -> dict[str, Any]:
    """StarCoder2: LayerNorms and projections with biases, a GELU MLP (``ffn_up``/``ffn_down`` as
    mlx-lm's ``c_fc``/``c_proj``). mlx-lm's MLP takes the exact (erf) GELU; llama.cpp's ``ggml_gelu``
    (as transformers' ``gelu_pytorch_tanh``) the tanh form: logits differ by about 1e-4."""
    config = common_config(file)
    if config.pop("head_dim") != config["hidden_size"] // config["num_attention_heads"]:
        raise UnsupportedArchitecture("starcoder2 with head_dim != hidden / heads has no mlx-lm equivalent")
    config.setdefault("rope_theta", 10000.0)
    config["norm_epsilon"] = float(file.arch_value("attention.layer_norm_epsilon", 1e-5))
    return config


def _seed_oss(file: GGUFModelFile) -> dict[str, Any]:
    """Seed-OSS: llama's layer without the Q/K permutation, biases where the file has them (Q/K/V in
    the released models; the pre-MLP norm is gguf-py's ``post_attention_norm``)."""
    config = common_config(file)
    config.setdefault("rope_theta", 10000.0)
    config.update(attention_bias="blk.0.attn_q.bias" in file.tensors,
                  attention_out_bias="blk.0.attn_output.bias" in file.tensors,
                  mlp_bias="blk.0.ffn_up.bias" in file.tensors)
    return config


def _ernie4_5(file: GGUFModelFile) -> dict[str, Any]:
    """ERNIE 4.5 (dense): llama's layer with interleaved RoPE (llama.cpp's NORM type, mlx-lm's
    traditional one; nothing permuted); the converter splits a fused ``qkv_proj`` into Q, K and V,
    which is mlx-lm's layout. One bias flag for every projection, as mlx-lm's ``use_bias``."""
    config = common_config(file)
    config.setdefault("rope_theta", 10000.0)
    config["use_bias"] = "blk.0.attn_q.bias" in file.tensors
    return config


def _apertus(file: GGUFModelFile) -> dict[str, Any]:
    """Apertus: per-head Q/K norms, an ungated MLP with xIELU (its constants are metadata, see
    :func:`_apertus_xielu`), Llama 3 RoPE factors as ``rope_freqs`` (nothing permuted)."""
    config = common_config(file)
    if config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]:
        raise UnsupportedArchitecture("apertus with head_dim != hidden / heads has no mlx-lm equivalent")
    config.setdefault("rope_theta", 10000.0)
    config.update(rope_scaling=config.get("rope_scaling"), post_norm=False, qk_norm=True,
                  attention_bias="blk.0.attn_q.bias" in file.tensors, mlp_bias="blk.0.ffn_up.bias" in file.tensors)
    return config


def _apertus_xielu(file: GGUFModelFile, config: dict[str, Any]) -> dict[str, np.ndarray]:
    """xIELU's four constants per layer, which the converter moved from the tensors into the
    ``xielu.*`` arrays (raw values: both sides apply the softplus to ``alpha_p`` and ``alpha_n``)."""
    n_layers = config["num_hidden_layers"]
    weights = {}
    for key in ("alpha_n", "alpha_p", "beta", "eps"):
        values = file.metadata.get(f"xielu.{key}")
        values = values if isinstance(values, list) else [values] * n_layers
        if len(values) != n_layers or any(v is None for v in values):
            raise UnsupportedArchitecture(f"apertus: xielu.{key} has no value for each of the {n_layers} layers")
        for i, value in enumerate(values):
            weights[f"model.layers.{i}.mlp.act_fn.{key}"] = np.array(value, dtype=np.float32)
    return weights


SPECS: tuple[ArchSpec, ...] = (
    ArchSpec("mistral3", "ministral3", "Ministral3ForCausalLM", _mistral3, permute_qk=True),
    ArchSpec("phi3", "phi3", "Phi3ForCausalLM", _phi3, config_tensors=PHI3_ROPE_FACTORS),
    ArchSpec("gemma2", "gemma2", "Gemma2ForCausalLM", _gemma2, norm_shift=1.0),
    ArchSpec("smollm3", "smollm3", "SmolLM3ForCausalLM", _smollm3, permute_qk=True),
    ArchSpec("olmo2", "olmo2", "Olmo2ForCausalLM", _olmo2),
    ArchSpec("granite", "granite", "GraniteForCausalLM", _granite, permute_qk=True),
    ArchSpec("glm4", "glm4", "Glm4ForCausalLM", _glm4),
    ArchSpec("exaone4", "exaone4", "Exaone4ForCausalLM", _exaone4, llama3_rope_freqs=True),
    ArchSpec("cohere2", "cohere2", "Cohere2ForCausalLM", _cohere2),
    ArchSpec("starcoder2", "starcoder2", "Starcoder2ForCausalLM", _starcoder2),
    ArchSpec("seed_oss", "seed_oss", "SeedOssForCausalLM", _seed_oss),
    ArchSpec("ernie4_5", "ernie4_5", "Ernie4_5ForCausalLM", _ernie4_5),
    ArchSpec("apertus", "apertus", "ApertusForCausalLM", _apertus, llama3_rope_freqs=True,
             metadata_weights=_apertus_xielu),
)
