"""What llama.cpp's converter does differently for one factory family (:class:`GgufTarget`).

The rows are in ``gguf_tensors.py`` (the first families) and in the ``families_*.py`` module of
each kind of architecture, beside the family they convert.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GgufTarget:
    """What llama.cpp's converter does differently for one factory family."""

    arch: str  # general.architecture
    permute_qk: bool  # llama-family Q/K row permutation
    norm_shift: float  # added to every *norm.weight
    pre: str = "gpt-2"  # tokenizer.ggml.pre: the split regex transformers applies to this family
