"""What llama.cpp's converter does differently for one factory family (:class:`GgufTarget`).

The rows are in ``gguf_tensors.py`` (the first families) and in the ``families_*.py`` module of
each kind of architecture, beside the family they convert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


@dataclass(frozen=True)
class GgufTarget:
    """What llama.cpp's converter does differently for one factory family."""

    arch: str  # general.architecture
    permute_qk: bool  # llama-family Q/K row permutation
    norm_shift: float  # added to every *norm.weight
    pre: str = "gpt-2"  # tokenizer.ggml.pre: the split regex transformers applies to this family
    # (factory name fragment, Hugging Face fragment): how the factory's mlx-lm names read as the
    # checkpoint names the converter maps (``.mlp.switch_mlp.`` -> ``.mlp.experts.``: a stack of
    # experts, which gguf-py names ``ffn_*_exps``).
    renames: tuple[tuple[str, str], ...] = ()
    # The family's own ``{arch}.*`` keys (expert counts, gating), written after the common ones.
    hparams: Callable[[Any, dict[str, Any]], None] | None = None
    # The converter's own split of a tensor: (name, float32 array, config) -> [(name, array), ...]
    # under names it then maps (DeepSeek-V2's kv_b_proj into k_b_proj and v_b_proj).
    split: Callable[[str, Any, dict[str, Any]], list[tuple[str, Any]]] | None = None
    # Writes every ``{arch}.*`` key the converter writes for the family, from (writer, config,
    # weights), instead of ``gguf_metadata.add_hparams``'s shared ones (families_dense.py).
    all_hparams: Callable[[Any, dict[str, Any], dict[str, Any]], None] | None = None
    # Name suffixes of weights the converter does not store as tensors (it moves them into metadata).
    dropped: tuple[str, ...] = ()
    # Tensors the converter adds from the config (Phi-3's LongRoPE factors): GGUF name -> values.
    extra_tensors: Callable[[dict[str, Any]], dict[str, np.ndarray]] | None = None
    # mlx-lm parameter name -> the checkpoint name the converter hands gguf-py's TensorNameMap
    # (after its own renames); None: the same name
    hf_name: Callable[[str], str] | None = None
    # (config, checkpoint name, float32 values in mlx-lm's layout) -> [(checkpoint name, values as
    # the converter stores them)]: its reorders, reshapes, maps and splits; None: as they are
    convert: Callable[[dict[str, Any], str, Any], list[tuple[str, Any]]] | None = None
    # (config, float32 weights in mlx-lm's layout) -> the weights under the checkpoint's split,
    # where mlx-lm's sanitize split or fused tensors (Gemma 4's fused expert gate_up_proj); None: as they are
    checkpoint: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None
