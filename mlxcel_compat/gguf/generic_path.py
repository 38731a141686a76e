"""The generic path: a GGUF architecture no row serves, tried through mlx-lm's class of that name.

llama.cpp names an architecture after the model's Hugging Face ``model_type`` (the converter's
class is registered for the HF architecture, ``ExaoneForCausalLM`` -> ``exaone``), usually up to
its separators (``qwen3moe``, ``gpt-oss``), and mlx-lm names its model modules by the same
``model_type``. So an unknown architecture is looked up among mlx-lm's modules by its name with
``-`` and ``_`` ignored, or through :data:`MODEL_TYPE_ALIASES` for the few llama.cpp names that
differ more. Its config is the one every builder starts from (:func:`generic_config`: the shared
keys, under the names mlx-lm's classes use for them), its tensor names gguf-py's ``TensorNameMap``.

The path is strict where a row may be lenient: every parameter of the model must have its tensor
and every tensor of the file its parameter, else loading stops with a message that names the
architecture and the served ones (``architectures.unsupported``). What it cannot check is a value
the converter changed (llama's Q/K permutation, Gemma's ``1 + w`` norms): a family whose converter
does that needs a row, and the log says a model was served generically.
"""

from __future__ import annotations

import importlib.util
import pkgutil
from functools import lru_cache
from typing import Any

from mlxcel_compat.gguf.arch_spec import ArchSpec, common_config
from mlxcel_compat.gguf.reader import GGUFModelFile

# llama.cpp architecture -> the HF model_type (mlx-lm module) it was converted from, where the two
# differ beyond '-' and '_' (convert_hf_to_gguf.py's registrations).
MODEL_TYPE_ALIASES: dict[str, str] = {
    "command-r": "cohere",
    "deepseek2": "deepseek_v2",
    "starcoder": "gpt_bigcode",
    "granitehybrid": "granitemoehybrid",
    "hunyuan-dense": "hunyuan_v1_dense",
    "hunyuan-moe": "hunyuan",
    "minimax-m2": "minimax",
}


@lru_cache(maxsize=1)
def _mlx_lm_modules() -> frozenset[str]:
    spec = importlib.util.find_spec("mlx_lm.models")
    if spec is None or not spec.submodule_search_locations:
        return frozenset()
    return frozenset(m.name for m in pkgutil.iter_modules(spec.submodule_search_locations))


def mlx_model_type(architecture: str) -> str | None:
    """The mlx-lm module (model_type) for a llama.cpp architecture name, or None."""
    modules = _mlx_lm_modules()
    if (alias := MODEL_TYPE_ALIASES.get(architecture)) is not None:
        return alias if alias in modules else None
    if architecture in modules:
        return architecture
    key = architecture.replace("-", "").replace("_", "")
    return next((m for m in sorted(modules) if m.replace("_", "") == key), None)


def generic_config(file: GGUFModelFile) -> dict[str, Any]:
    """The shared config, also under the other names mlx-lm's classes give the same values (the
    converter's ``find_hparam`` lists: ``num_layers``, ``layer_norm_epsilon``, ...), biases where
    the file has them. A class whose other arguments have no default does not fit."""
    config = common_config(file)
    config.setdefault("rope_theta", 10000.0)
    eps = file.arch_value("attention.layer_norm_rms_epsilon", file.arch_value("attention.layer_norm_epsilon", 1e-6))
    for name in ("rms_norm_eps", "norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"):
        config[name] = float(eps)
    config.update(num_layers=config["num_hidden_layers"], n_layers=config["num_hidden_layers"],
                  attention_bias="blk.0.attn_q.bias" in file.tensors, mlp_bias="blk.0.ffn_up.bias" in file.tensors)
    return config


def generic_spec(architecture: str) -> ArchSpec | None:
    """The generic row for an architecture mlx-lm has a class for, or None."""
    model_type = mlx_model_type(architecture)
    if model_type is None:
        return None
    return ArchSpec(architecture, model_type, "", generic_config, llama3_rope_freqs=True, generic=True)
