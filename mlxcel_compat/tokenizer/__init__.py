"""The served tokenizer (no transformers in the serving process), its conversion cache and FIM tokens."""
