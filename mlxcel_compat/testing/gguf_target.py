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
    # Writes every ``{arch}.*`` key the converter writes for the family, from (writer, config,
    # weights), instead of ``gguf_metadata.add_hparams``'s shared ones (families_dense.py).
    hparams: Callable[[Any, dict[str, Any], dict[str, Any]], None] | None = None
    # Name suffixes of weights the converter does not store as tensors (it moves them into metadata).
    dropped: tuple[str, ...] = ()
    # Tensors the converter adds from the config (Phi-3's LongRoPE factors): GGUF name -> values.
    extra_tensors: Callable[[dict[str, Any]], dict[str, np.ndarray]] | None = None
