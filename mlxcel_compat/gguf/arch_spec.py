"""What a GGUF architecture row says, and the metadata readers every row's config builder shares.

A row (:class:`ArchSpec`) names the ``general.architecture``, the mlx-lm model that serves it and
how to build that model's ``config.json`` from the ``{arch}.*`` metadata; its fields also say
what llama.cpp's converter changed in the tensors, which the loader (``gguf/load.py``) undoes.
The rows themselves live in the ``gguf/arch_*.py`` module of their kind; ``gguf/architectures.py``
assembles the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from mlxcel_compat.gguf.reader import GGUFModelFile
from mlxcel_compat.gguf.tensor_undo import TensorUndo


class UnsupportedArchitecture(ValueError):
    """The GGUF's architecture has no mlx-lm model with a mechanical mapping."""


@dataclass(frozen=True)
class Join:
    """An mlx-lm parameter llama.cpp's converter wrote as several tensors of its layer."""

    parameter: str  # how the mlx-lm parameter's name ends, e.g. ".self_attn.kv_b_proj.weight"
    parts: tuple[str, ...]  # its layer's GGUF tensors, e.g. ("attn_k_b.weight", "attn_v_b.weight")
    join: Callable[[list[Any], dict[str, Any]], Any]  # (the parts as MLX arrays, the config) -> the parameter


@dataclass(frozen=True)
class ArchSpec:
    gguf_arch: str  # general.architecture
    model_type: str  # mlx-lm's model_type
    hf_architecture: str  # the "architectures" entry of the equivalent config.json
    build_config: Callable[[GGUFModelFile], dict[str, Any]]
    permute_qk: bool = False
    norm_shift: float = 0.0  # the converter added this to every *norm.weight
    # (mlx-lm name fragment, Hugging Face fragment): mlx-lm's ``sanitize`` renamed the checkpoint's
    # tensors, so a parameter is looked up in gguf-py's ``TensorNameMap`` under the name the
    # converter read (``.mlp.switch_mlp.`` -> ``.mlp.experts.``: a stack of experts, ``ffn_*_exps``).
    renames: tuple[tuple[str, str], ...] = ()
    joins: tuple[Join, ...] = ()  # parameters the converter split into several tensors
    # Another row for some files of this architecture (a DeepSeek-V2 deepseek2 file is served by
    # mlx-lm's deepseek_v2, a V3 one by deepseek_v3), or None to keep this one.
    variant: Callable[[GGUFModelFile], ArchSpec | None] | None = None
    # Parameters the converter moved out of the tensors into metadata (Apertus's per-layer xIELU
    # constants): mlx-lm name -> value, rebuilt from the file; no GGUF tensor is looked up for them.
    metadata_weights: Callable[[GGUFModelFile, dict[str, Any]], dict[str, np.ndarray]] | None = None
    # Tensors the config builder reads (Phi-3's LongRoPE factors), which the model has no parameter for.
    config_tensors: tuple[str, ...] = ()
    # The file's ``rope_freqs`` tensor holds Llama 3 RoPE factors for a row without the Q/K
    # permutation (EXAONE 4); the llama-permuted rows take them anyway.
    llama3_rope_freqs: bool = False
    # No row serves the architecture: tried through mlx-lm's class of its name (generic_path.py),
    # strictly; a misfit stops loading with the architecture's name and the served ones.
    generic: bool = False
    # mlx-lm parameter name -> the checkpoint name gguf-py's TensorNameMap maps (where they differ:
    # a wrapper's prefix, mlx-lm's own module names); None: the same name
    hf_name: Callable[[str], str] | None = None
    # (config, mlx-lm parameter name) -> what turns the stored tensor back into the parameter's
    # values (``tensor_undo.py``: row and column orders, element-wise maps), or None
    undo: Callable[[dict[str, Any], str], TensorUndo | None] | None = None
    # (model, config): reshape mlx-lm's freshly built model into the layout the file stores, before
    # its parameters are named (``stored_parts.py``: a fused layer the converter split); None: nothing
    prepare_model: Callable[[Any, dict[str, Any]], None] | None = None


def uniform(file: GGUFModelFile, key: str, default: Any = None) -> Any:
    """A per-model hyper-parameter that GGUF may store per layer; it must be the same for all."""
    value = file.arch_value(key, default)
    if isinstance(value, list):
        values = set(value)
        if len(values) != 1:
            raise UnsupportedArchitecture(f"{file.architecture}.{key} differs between layers ({value}); "
                                          "mlx-lm models need one value")
        return values.pop()
    return value


def required(file: GGUFModelFile, key: str) -> Any:
    value = uniform(file, key)
    if value is None:
        raise UnsupportedArchitecture(f"'{file.path}' lacks {file.architecture}.{key}")
    return value


def rope_scaling_config(file: GGUFModelFile) -> dict[str, Any] | None:
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


def common_config(file: GGUFModelFile, dense_ffn: bool = True) -> dict[str, Any]:
    """The keys every attention model shares. ``dense_ffn=False``: a mixture-of-experts model
    whose config may lack ``feed_forward_length`` (then ``intermediate_size`` is left out)."""
    hidden = int(required(file, "embedding_length"))
    heads = int(required(file, "attention.head_count"))
    kv = uniform(file, "attention.head_count_kv", heads)
    config: dict[str, Any] = {
        "hidden_size": hidden,
        "num_hidden_layers": int(required(file, "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv),
        "rms_norm_eps": float(file.arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(file.arch_value("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in file.tensors,
    }
    if dense_ffn or file.arch_value("feed_forward_length") is not None:
        config["intermediate_size"] = int(required(file, "feed_forward_length"))
    key_length = file.arch_value("attention.key_length")
    value_length = file.arch_value("attention.value_length", key_length)
    head_dim = int(key_length) if key_length else hidden // heads
    if value_length is not None and int(value_length) != head_dim:
        raise UnsupportedArchitecture(f"key_length {head_dim} != value_length {value_length} is not supported")
    config["head_dim"] = head_dim
    if (theta := file.arch_value("rope.freq_base")) is not None:
        config["rope_theta"] = float(theta)
    if (scaling := rope_scaling_config(file)) is not None:
        config["rope_scaling"] = scaling
    return config
