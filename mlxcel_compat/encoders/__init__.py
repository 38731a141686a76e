"""BERT-family encoders (embeddings, cross-encoders), pooling and rerank heads."""
