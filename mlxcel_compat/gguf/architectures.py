"""GGUF architectures served through mlx-lm: the table, and the mapping of a file onto its model.

A GGUF file is turned into an ordinary mlx-lm model. For each supported ``general.architecture``
a row (``gguf/arch_spec.py: ArchSpec``) synthesises the ``config.json`` mlx-lm would read for the
same model; the rows live in the module of their kind (``arch_core.py``: llama, qwen2, qwen3,
gemma3, lfm2; ``arch_dense.py``, ``arch_moe.py``, ``arch_hybrid.py``) and are assembled here into
:data:`ARCHITECTURES`. GGUF tensor names map back to mlx-lm parameter names with gguf-py's own
``TensorNameMap`` (the table llama.cpp's converter writes with), so no name table is written by
hand; each row says what the converter changed in the values, which the loader undoes.

Any other architecture for which mlx-lm has a class is tried through the generic path
(``generic_path.py``); one that has none, or does not fit, is refused at start-up with a message
naming it and the served ones (:func:`unsupported`).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from mlxcel_compat.gguf import arch_core, arch_dense, arch_hybrid, arch_moe, generic_path
from mlxcel_compat.gguf.arch_spec import ArchSpec, Join, UnsupportedArchitecture
from mlxcel_compat.gguf.reader import GGUFModelFile

ARCHITECTURES: dict[str, ArchSpec] = {
    spec.gguf_arch: spec for spec in (*arch_core.SPECS, *arch_dense.SPECS, *arch_moe.SPECS, *arch_hybrid.SPECS)
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(ARCHITECTURES)
# gguf-py's names of the stacked expert tensors (MODEL_TENSOR.FFN_*_EXP), as a GGUF name ends.
EXPERT_STACK_SUFFIXES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_up_exps")


def unsupported(architecture: str, reason: str) -> UnsupportedArchitecture:
    """The start-up error for an architecture this server cannot serve: its name, why, the served ones."""
    return UnsupportedArchitecture(f"GGUF architecture '{architecture}' is not supported by mlxcel_compat: {reason} "
                                   f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")


def arch_spec(file: GGUFModelFile) -> ArchSpec:
    """The architecture's row, or the generic one when mlx-lm has a class of its name."""
    spec = ARCHITECTURES.get(file.architecture) or generic_path.generic_spec(file.architecture)
    if spec is None:
        raise unsupported(file.architecture, "no row serves it and mlx-lm has no model class of that name")
    if spec.variant is not None and (variant := spec.variant(file)) is not None:
        return variant
    return spec


def model_config(file: GGUFModelFile, spec: ArchSpec, vocab_size: int, eos_ids: list[int],
                 bos_id: int | None) -> dict[str, Any]:
    """The config.json an mlx-lm checkpoint of this model would have."""
    config = spec.build_config(file)
    config.update(
        model_type=config.get("model_type", spec.model_type),  # a builder may pick the class from the metadata
        architectures=[spec.hf_architecture],
        vocab_size=int(file.arch_value("vocab_size", vocab_size)),
        eos_token_id=eos_ids,
        bos_token_id=bos_id,
    )
    return config


def gguf_names(spec: ArchSpec, parameter_names: list[str], n_layers: int) -> dict[str, str]:
    """GGUF tensor name -> mlx-lm parameter name, for every parameter of the model."""
    import gguf

    arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == spec.gguf_arch), None)
    if arch is None:
        raise UnsupportedArchitecture(f"gguf-py has no tensor names for '{spec.gguf_arch}'")
    table = gguf.get_tensor_name_map(arch, n_layers)
    mapping: dict[str, str] = {}
    for name in parameter_names:
        if any(name.endswith(join.parameter) for join in spec.joins):
            continue  # read from its parts (joined_parameters)
        gguf_name = table.get_name(checkpoint_name(spec, name), try_suffixes=(".weight", ".bias", ".scale"))
        if gguf_name is None:
            raise UnsupportedArchitecture(f"{spec.gguf_arch}: no GGUF tensor corresponds to mlx-lm's '{name}'")
        mapping[gguf_name] = name
    return mapping


def joined_parameters(spec: ArchSpec, parameter_names: list[str]) -> dict[str, tuple[Join, tuple[str, ...]]]:
    """mlx-lm parameter name -> (its :class:`Join`, the GGUF tensors it is joined from), for the
    parameters the converter split (``ArchSpec.joins``); each is a layer's (``model.layers.N.``)."""
    joined: dict[str, tuple[Join, tuple[str, ...]]] = {}
    for name in parameter_names:
        for join in spec.joins:
            if name.endswith(join.parameter) and (layer := re.search(r"\.layers\.(\d+)\.", name)):
                joined[name] = (join, tuple(f"blk.{layer.group(1)}.{part}" for part in join.parts))
    return joined


def checkpoint_name(spec: ArchSpec, parameter_name: str) -> str:
    """The Hugging Face checkpoint's name of an mlx-lm parameter: the name llama.cpp's converter
    mapped to a GGUF tensor (the row's ``hf_name`` and ``renames`` undo mlx-lm's ``sanitize``)."""
    if spec.hf_name is not None:
        parameter_name = spec.hf_name(parameter_name)
    for mlx_part, checkpoint_part in spec.renames:
        parameter_name = parameter_name.replace(mlx_part, checkpoint_part)
    return parameter_name


def is_expert_stack(gguf_name: str) -> bool:
    """Whether a GGUF tensor holds the weights of every expert of an MoE layer, ``[n_expert, rows,
    cols]`` (``blk.N.ffn_{gate,up,down,gate_up}_exps.weight``): not one linear layer's weight; on
    the CPU a quantized one stays in its blocks as one weight of ``n_expert * rows`` rows, and
    only the chosen experts' rows are computed (``runtime/block_experts.py``). Their biases
    (gpt-oss) are F32 in every file."""
    stem, suffix = gguf_name.rsplit(".", 1)
    return suffix == "weight" and stem.endswith(EXPERT_STACK_SUFFIXES)


def layer_index(gguf_name: str) -> int | None:
    """N of a ``blk.N.*`` tensor, else None."""
    parts = gguf_name.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[0] == "blk" and parts[1].isdecimal() else None


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
