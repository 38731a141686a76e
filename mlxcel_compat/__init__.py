"""mlxcel_compat: an MLX inference server that is a drop-in replacement for llama-server."""

__version__ = "0.1.0"
