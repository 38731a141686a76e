"""What differs between the factory's families besides their config numbers (:class:`Family`).

A row of the family table (``families.py``, and the ``families_*.py`` module of each kind of
architecture) is one :class:`Family`; its config builder sits beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Family:
    """What differs between families besides the config numbers."""

    name: str
    architecture: str
    thinking: bool  # the chat template handles <think> (Qwen3 style)
    add_bos: bool  # the tokenizer prepends <|begin_of_text|> (Llama 3 style)
    norm_one: float  # stored RMSNorm weight meaning a gain of 1 (Gemma uses 1 + w)
    model_type: str = ""  # mlx-lm's model_type when it is not the name
    fim: bool = False  # the tokenizer has fill-in-the-middle tokens (tokenizer.FIM_TOKENS)
    # mlx-lm parameters -> the Hugging Face checkpoint's tensors, where they differ (a directory is
    # what transformers and llama.cpp's converter read; mlx-lm's ``sanitize`` maps it back)
    # (``hf_layouts.py``; the config says how many layers, for a NextN layer a checkpoint adds)
    hf_layout: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]] | None = None

    @property
    def kind(self) -> str:
        return self.model_type or self.name
