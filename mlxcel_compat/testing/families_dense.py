"""Dense decoder families beyond the first ones: the factory's rows for them, their configs and their GGUF conversion.

Each family is named by its mlx-lm ``model_type`` and built at small sizes with its real model's
config structure; :data:`GGUF_TARGETS` says what llama.cpp's converter does to it.
"""

from __future__ import annotations

from typing import Any, Callable

from .family import Family
from .gguf_target import GgufTarget

FAMILIES: tuple[Family, ...] = ()
CONFIGS: dict[str, Callable[[str], dict[str, Any]]] = {}
GGUF_TARGETS: dict[str, GgufTarget] = {}
