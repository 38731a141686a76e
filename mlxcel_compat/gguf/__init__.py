"""GGUF files: the reader, tensor types, the architecture table, the loader, the GGUF tokenizer and the
precision policy."""
