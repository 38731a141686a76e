"""llama.cpp-compatible token sampling on MLX (being split into modules: see ``chain.py``)."""
