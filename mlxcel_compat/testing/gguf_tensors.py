"""A factory model's tensors as llama.cpp's ``convert_hf_to_gguf.py`` stores them.

Per family, what the converter does differently (:class:`GgufTarget`: the GGUF architecture,
llama's Q/K row permutation, Gemma's norm shift, the pre-tokenizer's name); the tensors' GGUF
names and layout (:func:`converted_tensors`); and each tensor's stored type in a file of a given
type, with llama-quantize's mixes and row-length fallbacks (:func:`stored_type`,
:func:`encode_tensor`). ``gguf_writer.py`` writes whole files from these.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from . import families_dense, families_hybrid, families_moe
from .gguf_target import GgufTarget

GGUF_TYPES: tuple[str, ...] = ("f32", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k",
                               "q5_k", "q6_k", "q4_k_m", "q5_k_m", "mxfp4", "iq4_nl", "iq4_xs", "iq3_s",
                               "iq3_xxs", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_m", "iq1_s")
# llama-quantize's fallbacks for types of 256-value blocks, for rows that are not whole blocks
# (``tensor_type_fallback`` in llama.cpp's src/llama-quant.cpp).
_FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0",
             **{t: "iq4_nl" for t in ("iq4_xs", "iq3_s", "iq3_xxs", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_m", "iq1_s")}}
# The types llama-quantize quantizes only with an importance matrix (its tensor_requires_imatrix;
# ggml's quantizer asserts one for IQ2_XXS, IQ2_XS and IQ1_S). The factory has no activations
# to measure one from: it gives them a uniform one (every input column weighs 1).
IMPORTANCE_TYPES = frozenset({"iq3_xxs", "iq2_s", "iq2_xs", "iq2_xxs", "iq1_m", "iq1_s"})
# Tensors the converter (and llama-quantize) always keeps in F32 whatever the file's type:
# convolutions, routers, norms.
F32_TENSORS: tuple[str, ...] = ("shortconv.conv.weight", "ssm_conv1d.weight", "ffn_gate_inp.weight",
                                "ffn_gate_inp_shexp.weight", "_norm.weight")


GGUF_TARGETS: dict[str, GgufTarget] = {
    "llama": GgufTarget("llama", permute_qk=True, norm_shift=0.0),
    "mistral": GgufTarget("llama", permute_qk=True, norm_shift=0.0),
    # transformers tokenizes model_type qwen2 with Qwen2's own regex, whatever tokenizer.json says,
    # and llama.cpp's converter names the pre-tokenizer after that behaviour.
    "qwen2": GgufTarget("qwen2", permute_qk=False, norm_shift=0.0, pre="qwen2"),
    "qwen3": GgufTarget("qwen3", permute_qk=False, norm_shift=0.0),
    "gemma3_text": GgufTarget("gemma3", permute_qk=False, norm_shift=1.0),
    "lfm2": GgufTarget("lfm2", permute_qk=False, norm_shift=0.0),
    "qwen2_coder": GgufTarget("qwen2", permute_qk=False, norm_shift=0.0, pre="qwen2"),
}
# The families the family-wide GGUF tests run on (the FIM family has its own tests).
GGUF_FAMILIES: tuple[str, ...] = tuple(f for f in GGUF_TARGETS if f != "qwen2_coder")
# Each kind of architecture's families, converted as llama.cpp's converter converts them.
GGUF_TARGETS.update({**families_dense.GGUF_TARGETS, **families_moe.GGUF_TARGETS, **families_hybrid.GGUF_TARGETS})


# Matrices the converter and llama-quantize keep in F32 whatever the file's type: the
# convolution, and the MoE routers (``ffn_gate_inp``, the shared expert's gate).


def permute_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: within each head, interleave the two rotary halves."""
    return (weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


def file_type(gguf_type: str) -> int:
    """The ``general.file_type`` (llama.cpp's ``LlamaFileType``) of a file of ``gguf_type``."""
    from gguf import LlamaFileType as F

    # Each i-quant type is its own file type's main type (IQ2_S is IQ2_M's: llama.cpp's IQ2_S
    # files are mostly IQ2_XS); MXFP4's is MXFP4_MOE (gpt-oss: the experts MXFP4).
    return {"f32": F.ALL_F32, "f16": F.MOSTLY_F16, "q8_0": F.MOSTLY_Q8_0, "q4_0": F.MOSTLY_Q4_0,
            "q4_1": F.MOSTLY_Q4_1, "q5_0": F.MOSTLY_Q5_0, "q5_1": F.MOSTLY_Q5_1, "q2_k": F.MOSTLY_Q2_K,
            "q3_k": F.MOSTLY_Q3_K_M, "q4_k": F.MOSTLY_Q4_K_S, "q5_k": F.MOSTLY_Q5_K_S, "q6_k": F.MOSTLY_Q6_K,
            "q4_k_m": F.MOSTLY_Q4_K_M, "q5_k_m": F.MOSTLY_Q5_K_M, "mxfp4": F.MOSTLY_MXFP4_MOE,
            "iq4_nl": F.MOSTLY_IQ4_NL, "iq4_xs": F.MOSTLY_IQ4_XS, "iq3_s": F.MOSTLY_IQ3_S,
            "iq3_xxs": F.MOSTLY_IQ3_XXS, "iq2_s": F.MOSTLY_IQ2_M, "iq2_xs": F.MOSTLY_IQ2_XS,
            "iq2_xxs": F.MOSTLY_IQ2_XXS, "iq1_m": F.MOSTLY_IQ1_M, "iq1_s": F.MOSTLY_IQ1_S}[gguf_type]


def use_more_bits(layer: int, n_layers: int) -> bool:
    """llama-quantize's choice of the layers whose attn_v / ffn_down get more bits in *_M mixes."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def tensor_type(name: str, gguf_type: str, n_layers: int) -> str:
    """The type one matrix gets in a file of ``gguf_type`` (before the row-length fallbacks)."""
    if gguf_type not in ("q4_k_m", "q5_k_m"):
        return gguf_type
    base = gguf_type[:4]
    if name == "output.weight":
        return "q6_k"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        layer = int(name.split(".")[1])
        return "q6_k" if use_more_bits(layer, n_layers) else base
    return base


def stored_type(name: str, shape: tuple[int, ...], gguf_type: str, n_layers: int = 1) -> str:
    """The type one tensor of ``shape`` is stored as in a file of ``gguf_type``, the row-length
    fallbacks included: ``f32`` for 1-D tensors, tensors not named ``*.weight`` (biases, gpt-oss's
    2-D expert biases, Mamba-2's ``ssm_a``/``ssm_d``; LoRA factors aside), convolutions, routers and
    norms, ``f16`` for rows that are not whole 32-value blocks, llama-quantize's fallbacks for rows
    that are not whole 256-value blocks (the K-quants' to Q4_0-Q8_0, the i-quants' to IQ4_NL)."""
    if (len(shape) < 2 or gguf_type == "f32" or name.endswith(F32_TENSORS)
            or not name.endswith((".weight", ".lora_a", ".lora_b"))):
        return "f32"
    if gguf_type == "f16" or shape[-1] % 32:
        return "f16"
    kind = tensor_type(name, gguf_type, n_layers)
    if kind in _FALLBACK and shape[-1] % 256:
        kind = _FALLBACK[kind]
    return kind


def encode_tensor(name: str, data: np.ndarray, gguf_type: str, n_layers: int = 1) -> tuple[np.ndarray, Any]:
    """The stored array and its raw GGML type (None for plain float arrays)."""
    from gguf import GGMLQuantizationType, quants

    kind = stored_type(name, data.shape, gguf_type, n_layers)
    if kind == "f32":
        return data.astype(np.float32), None
    if kind == "f16":
        return data.astype(np.float16), None
    if kind in ("q8_0", "q4_0"):
        qtype = GGMLQuantizationType.Q8_0 if kind == "q8_0" else GGMLQuantizationType.Q4_0
        return quants.quantize(data.astype(np.float32), qtype), qtype
    from mlxcel_compat.runtime import ggml_cpu

    kernels = ggml_cpu.kernels()
    if isinstance(kernels, str):
        raise RuntimeError(f"writing {kind.upper()} tensors needs ggml's quantizer: {kernels}")
    qtype = GGMLQuantizationType[kind.upper()]
    rows = data.astype(np.float32).reshape(-1, data.shape[-1])
    importance = np.ones(rows.shape[1], dtype=np.float32) if kind in IMPORTANCE_TYPES else None
    return kernels.quantize(qtype, rows, importance).reshape(*data.shape[:-1], -1), qtype


def converted_tensors(family: str, config: dict[str, Any], weights: dict[str, Any]) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array in the converter's layout."""
    import gguf

    target = GGUF_TARGETS[family]
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == target.arch)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    out: dict[str, np.ndarray] = {}
    arrays = {name: np.array(w, dtype=np.float32) for name, w in weights.items()}
    if target.checkpoint is not None:  # the checkpoint's own split or fusion of tensors (Gemma 4)
        arrays = target.checkpoint(config, arrays)
    if target.split is not None:  # the converter's own splits of a tensor (DeepSeek-V2's kv_b_proj)
        arrays = {piece: data for name in arrays for piece, data in target.split(name, arrays[name], config)}
    stored: list[tuple[str, np.ndarray]] = []
    for mlx_name in sorted(arrays):
        if target.dropped and mlx_name.endswith(target.dropped):
            continue
        hf_name = target.hf_name(mlx_name) if target.hf_name else mlx_name
        for factory_part, checkpoint_part in target.renames:
            hf_name = hf_name.replace(factory_part, checkpoint_part)
        data = arrays[mlx_name]
        stored += target.convert(config, hf_name, data) if target.convert is not None else [(hf_name, data)]
    for hf_name, data in stored:
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias", ".scale"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {hf_name} in {target.arch}")
        if target.permute_qk and ".self_attn.q_proj." in hf_name:
            data = permute_rows(data, config["num_attention_heads"])
        elif target.permute_qk and ".self_attn.k_proj." in hf_name:
            data = permute_rows(data, config["num_key_value_heads"])
        if hf_name.endswith("norm.weight"):
            data = data + np.float32(target.norm_shift)
        if gguf_name.endswith("shortconv.conv.weight"):
            data = data.reshape(data.shape[0], data.shape[1])  # (C, K, 1) -> (C, K)
        out[gguf_name] = data
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "llama3":
        out["rope_freqs.weight"] = llama3_rope_factors(config)
    if target.extra_tensors is not None:
        out.update(target.extra_tensors(config))
    return out


def llama3_rope_factors(config: dict[str, Any]) -> np.ndarray:
    """The ``rope_freqs`` tensor the converter writes for ``rope_type: llama3``: per rotary
    frequency, the factor ggml divides the rotation speed by (1 for short wavelengths, ``factor``
    for long ones, a smooth blend between)."""
    scaling = config["rope_scaling"]
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    factor = float(scaling.get("factor", 8.0))
    low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
    context = float(scaling.get("original_max_position_embeddings", 8192))
    inv_freq = 1.0 / (float(config["rope_theta"]) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factors = []
    for freq in inv_freq:
        wavelength = 2 * math.pi / float(freq)
        if wavelength < context / high:
            factors.append(1.0)
        elif wavelength > context / low:
            factors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)
