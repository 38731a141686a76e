"""GGUF architectures served through mlx-lm: the config each one implies, and its tensor mapping.

A GGUF file is turned into an ordinary mlx-lm model. For each supported ``general.architecture``
this module synthesises the ``config.json`` mlx-lm would read for the same model, and maps GGUF
tensor names back to mlx-lm parameter names with gguf-py's own ``TensorNameMap`` (the table
llama.cpp's converter writes with), so no name table is written by hand here.

Then it undoes what the converter changed in the values:

- ``llama`` (also Mistral files, which use the llama architecture): the Q/K rows were permuted
  for ggml's interleaved RoPE (``LlamaModel.permute``); mlx-lm uses the Hugging Face half-split
  layout, so the permutation is reversed. Skipping this gives plausible but wrong logits.
- ``gemma3``: norms were stored as ``1 + w``; mlx-lm's Gemma norm adds the 1 itself.
- ``lfm2``: the depthwise convolution was squeezed to 2-D; mlx-lm wants (C, K, 1).

Any other architecture is refused at start-up with the list of supported ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from mlxcel_compat.gguf.reader import GGUFModelFile


class UnsupportedArchitecture(ValueError):
    """The GGUF's architecture has no mlx-lm model with a mechanical mapping."""


@dataclass(frozen=True)
class ArchSpec:
    gguf_arch: str  # general.architecture
    model_type: str  # mlx-lm's model_type
    hf_architecture: str  # the "architectures" entry of the equivalent config.json
    build_config: Callable[[GGUFModelFile], dict[str, Any]]
    permute_qk: bool = False
    norm_shift: float = 0.0  # the converter added this to every *norm.weight


def _uniform(file: GGUFModelFile, key: str, default: Any = None) -> Any:
    """A per-model hyper-parameter that GGUF may store per layer; it must be the same for all."""
    value = file.arch_value(key, default)
    if isinstance(value, list):
        values = set(value)
        if len(values) != 1:
            raise UnsupportedArchitecture(f"{file.architecture}.{key} differs between layers ({value}); "
                                          "mlx-lm models need one value")
        return values.pop()
    return value


def _required(file: GGUFModelFile, key: str) -> Any:
    value = _uniform(file, key)
    if value is None:
        raise UnsupportedArchitecture(f"'{file.path}' lacks {file.architecture}.{key}")
    return value


def _rope_scaling(file: GGUFModelFile) -> dict[str, Any] | None:
    kind = file.arch_value("rope.scaling.type")
    factor = file.arch_value("rope.scaling.factor")
    if kind in (None, "none") or not factor or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"type": "linear", "rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = file.arch_value("rope.scaling.original_context_length")
        scaling = {"type": "yarn", "rope_type": "yarn", "factor": float(factor),
                   "original_max_position_embeddings": int(original or file.arch_value("context_length", 4096))}
        for key in ("beta_fast", "beta_slow"):  # mlx-lm's defaults (32, 1) are the usual values
            if (value := file.arch_value(f"rope.scaling.yarn_{key}")) is not None:
                scaling[key] = float(value)
        return scaling
    raise UnsupportedArchitecture(f"RoPE scaling type '{kind}' is not supported for GGUF models")


def _common(file: GGUFModelFile) -> dict[str, Any]:
    hidden = int(_required(file, "embedding_length"))
    heads = int(_required(file, "attention.head_count"))
    kv = _uniform(file, "attention.head_count_kv", heads)
    config: dict[str, Any] = {
        "hidden_size": hidden,
        "num_hidden_layers": int(_required(file, "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv),
        "intermediate_size": int(_required(file, "feed_forward_length")),
        "rms_norm_eps": float(file.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(file.arch_value("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in file.tensors,
    }
    key_length = file.arch_value("attention.key_length")
    value_length = file.arch_value("attention.value_length", key_length)
    head_dim = int(key_length) if key_length else hidden // heads
    if value_length is not None and int(value_length) != head_dim:
        raise UnsupportedArchitecture(f"key_length {head_dim} != value_length {value_length} is not supported")
    config["head_dim"] = head_dim
    if (theta := file.arch_value("rope.freq_base")) is not None:
        config["rope_theta"] = float(theta)
    if (scaling := _rope_scaling(file)) is not None:
        config["rope_scaling"] = scaling
    return config


def _llama(file: GGUFModelFile) -> dict[str, Any]:
    config = _common(file)
    config.setdefault("rope_theta", 10000.0)
    config["attention_bias"] = "blk.0.attn_q.bias" in file.tensors
    config["mlp_bias"] = "blk.0.ffn_up.bias" in file.tensors
    if (window := file.arch_value("attention.sliding_window")) and "rope_freqs.weight" not in file.tensors:
        config["sliding_window"] = int(window)
    return config


def _qwen2(file: GGUFModelFile) -> dict[str, Any]:
    config = _common(file)
    if config["head_dim"] != config["hidden_size"] // config["num_attention_heads"]:
        raise UnsupportedArchitecture("qwen2 with head_dim != hidden / heads has no mlx-lm equivalent")
    config.setdefault("rope_theta", 1000000.0)
    return config


def _qwen3(file: GGUFModelFile) -> dict[str, Any]:
    config = _common(file)
    config.setdefault("rope_theta", 1000000.0)
    return config


def _gemma3(file: GGUFModelFile) -> dict[str, Any]:
    config = _common(file)
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
    n_layers = int(_required(file, "block_count"))
    kv_per_layer = kv if isinstance(kv, list) else [kv] * n_layers
    attention = [int(k) for k in kv_per_layer if k]
    if not attention or len(set(attention)) != 1:
        raise UnsupportedArchitecture(f"lfm2 head_count_kv per layer {kv_per_layer} is not supported")
    hidden = int(_required(file, "embedding_length"))
    ff = int(_required(file, "feed_forward_length"))
    return {
        "hidden_size": hidden,
        "block_dim": hidden,
        "num_hidden_layers": n_layers,
        "num_attention_heads": int(_required(file, "attention.head_count")),
        "num_key_value_heads": attention[0],
        "layer_types": ["full_attention" if k else "conv" for k in kv_per_layer],
        "block_ff_dim": ff,
        "intermediate_size": ff,
        "block_auto_adjust_ff_dim": False,  # the GGUF stores the adjusted size
        "block_multiple_of": 256,
        "block_ffn_dim_multiplier": 1.0,
        "conv_L_cache": int(_required(file, "shortconv.l_cache")),
        "conv_bias": "blk.0.shortconv.in_proj.bias" in file.tensors,
        "norm_eps": float(file.arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(file.arch_value("rope.freq_base", 1000000.0)),
        "max_position_embeddings": int(file.arch_value("context_length", 128000)),
        "tie_word_embeddings": True,
    }


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.gguf_arch: spec
    for spec in (
        ArchSpec("llama", "llama", "LlamaForCausalLM", _llama, permute_qk=True),
        ArchSpec("qwen2", "qwen2", "Qwen2ForCausalLM", _qwen2),
        ArchSpec("qwen3", "qwen3", "Qwen3ForCausalLM", _qwen3),
        ArchSpec("gemma3", "gemma3_text", "Gemma3ForCausalLM", _gemma3, norm_shift=1.0),
        ArchSpec("lfm2", "lfm2", "Lfm2ForCausalLM", _lfm2),
    )
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)


def arch_spec(file: GGUFModelFile) -> ArchSpec:
    spec = ARCHITECTURES.get(file.architecture)
    if spec is None:
        raise UnsupportedArchitecture(
            f"GGUF architecture '{file.architecture}' is not supported by mlxcel_compat "
            f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return spec


def model_config(file: GGUFModelFile, spec: ArchSpec, vocab_size: int, eos_ids: list[int],
                 bos_id: int | None) -> dict[str, Any]:
    """The config.json an mlx-lm checkpoint of this model would have."""
    config = spec.build_config(file)
    config.update(
        model_type=spec.model_type,
        architectures=[spec.hf_architecture],
        vocab_size=int(file.arch_value("vocab_size", vocab_size)),
        eos_token_id=eos_ids,
        bos_token_id=bos_id,
    )
    return config


def gguf_names(spec: ArchSpec, parameter_names: list[str], n_layers: int) -> dict[str, str]:
    """GGUF tensor name -> mlx-lm parameter name, for every parameter of the model."""
    import gguf

    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == spec.gguf_arch)
    table = gguf.get_tensor_name_map(arch, n_layers)
    mapping: dict[str, str] = {}
    for name in parameter_names:
        gguf_name = table.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise UnsupportedArchitecture(f"{spec.gguf_arch}: no GGUF tensor corresponds to mlx-lm's '{name}'")
        mapping[gguf_name] = name
    return mapping


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Reverse llama.cpp's ``permute``: rows (or raw block rows) of a Q or K projection."""
    shape = rows.shape
    return rows.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def qk_heads(spec: ArchSpec, config: dict[str, Any], mlx_name: str) -> int | None:
    """How many heads to un-permute ``mlx_name`` with, or None when it was not permuted."""
    if not spec.permute_qk:
        return None
    if ".self_attn.q_proj." in mlx_name:
        return int(config["num_attention_heads"])
    if ".self_attn.k_proj." in mlx_name:
        return int(config["num_key_value_heads"])
    return None
