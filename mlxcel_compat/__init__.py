"""mlxcel_compat: an MLX inference server that is a drop-in replacement for llama-server."""

from mlxcel_compat import zoo as _zoo

__version__ = "0.1.0"

# Before anything imports mlx-lm: its package __init__ imports transformers (zoo.py).
_zoo.install()
