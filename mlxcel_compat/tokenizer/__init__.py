"""The served tokenizer (no transformers in the serving process), its conversion cache, FIM tokens and byte-level BPE's byte table."""
