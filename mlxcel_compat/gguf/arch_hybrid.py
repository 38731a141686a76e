"""Hybrid and recurrent architectures (state kept in session snapshots): qwen35, qwen35moe, qwen3next, granitehybrid, nemotron_h, gemma4.

Each row (:data:`SPECS`) names the mlx-lm model that serves the architecture; its config builder
and the undo steps for what llama.cpp's converter changed sit beside it in this module.
"""

from __future__ import annotations

from mlxcel_compat.gguf.arch_spec import ArchSpec

SPECS: tuple[ArchSpec, ...] = ()
