"""GGUF architectures served through mlx-lm: the table, and the mapping of a file onto its model.

A GGUF file is turned into an ordinary mlx-lm model. For each supported ``general.architecture``
a row (``gguf/arch_spec.py: ArchSpec``) synthesises the ``config.json`` mlx-lm would read for the
same model; the rows live in the module of their kind (``arch_core.py``: llama, qwen2, qwen3,
gemma3, lfm2; ``arch_dense.py``, ``arch_moe.py``, ``arch_hybrid.py``) and are assembled here into
:data:`ARCHITECTURES`. GGUF tensor names map back to mlx-lm parameter names with gguf-py's own
``TensorNameMap`` (the table llama.cpp's converter writes with), so no name table is written by
hand; each row says what the converter changed in the values, which the loader undoes.

Any other architecture is refused at start-up with the list of supported ones.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlxcel_compat.gguf import arch_core, arch_dense, arch_hybrid, arch_moe
from mlxcel_compat.gguf.arch_spec import ArchSpec, UnsupportedArchitecture
from mlxcel_compat.gguf.reader import GGUFModelFile

ARCHITECTURES: dict[str, ArchSpec] = {
    spec.gguf_arch: spec for spec in (*arch_core.SPECS, *arch_dense.SPECS, *arch_moe.SPECS, *arch_hybrid.SPECS)
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
        gguf_name = table.get_name(spec.hf_name(name) if spec.hf_name else name,
                                   try_suffixes=(".weight", ".bias", ".scale"))
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
