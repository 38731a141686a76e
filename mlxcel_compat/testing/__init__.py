"""Deterministic tiny models for tests, benchmarks and the server's demo mode.

``model_directory.ensure_model("llama", "tiny")`` returns a cached model directory that
``mlx_lm.utils.load`` accepts; see ``families.py`` for the families and sizes,
``gguf_writer.py`` for GGUF files and ``models.py`` for the command line.
Importing this package does not import MLX.
"""
