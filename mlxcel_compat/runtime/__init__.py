"""The CPU runtime: the decode runtime, attention, fusion, block weights and layers, ggml glue and the
backend choice. Its C sources and their build live in ``runtime/native``."""
