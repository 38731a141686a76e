"""What llama.cpp's converter does differently for one factory family (:class:`GgufTarget`).

The rows are in ``gguf_tensors.py`` (the first families) and in the ``families_*.py`` module of
each kind of architecture, beside the family they convert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class GgufTarget:
    """What llama.cpp's converter does differently for one factory family."""

    arch: str  # general.architecture
    permute_qk: bool  # llama-family Q/K row permutation
    norm_shift: float  # added to every *norm.weight
    pre: str = "gpt-2"  # tokenizer.ggml.pre: the split regex transformers applies to this family
    # mlx-lm parameter name -> the checkpoint name the converter hands gguf-py's TensorNameMap
    # (after its own renames); None: the same name
    hf_name: Callable[[str], str] | None = None
    # (config, checkpoint name, float32 values in mlx-lm's layout) -> [(checkpoint name, values as
    # the converter stores them)]: its reorders, reshapes, maps and splits; None: as they are
    convert: Callable[[dict[str, Any], str, Any], list[tuple[str, Any]]] | None = None
    # (config, float32 weights in mlx-lm's layout) -> the weights under the checkpoint's split,
    # where mlx-lm's sanitize split or fused tensors (Gemma 4's fused expert gate_up_proj); None: as they are
    checkpoint: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None
    # config -> {GGUF name: values}: tensors the converter generates (its generate_extra_tensors)
    extra_tensors: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # (gguf writer, config): the {arch}.* keys, written instead of gguf_metadata.add_hparams's
    hparams: Callable[[Any, dict[str, Any]], None] | None = None
