"""Dense decoder architectures beyond the core ones: phi3, gemma2, granite, smollm3, olmo2, exaone4, cohere2, starcoder2, seed_oss, ernie4_5, apertus, mistral3, glm4.

Each row (:data:`SPECS`) names the mlx-lm model that serves the architecture; its config builder
and the undo steps for what llama.cpp's converter changed sit beside it in this module.
"""

from __future__ import annotations

from mlxcel_compat.gguf.arch_spec import ArchSpec

SPECS: tuple[ArchSpec, ...] = ()
