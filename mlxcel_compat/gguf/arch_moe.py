"""Mixture-of-experts architectures: qwen3moe, qwen2moe, olmoe, granitemoe, glm4moe, ernie4_5-moe, gpt-oss, deepseek2 (MLA), lfm2moe.

Each row (:data:`SPECS`) names the mlx-lm model that serves the architecture; its config builder
and the undo steps for what llama.cpp's converter changed sit beside it in this module.
"""

from __future__ import annotations

from mlxcel_compat.gguf.arch_spec import ArchSpec

SPECS: tuple[ArchSpec, ...] = ()
