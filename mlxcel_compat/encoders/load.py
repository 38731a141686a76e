"""Load a BERT-family encoder (``encoders/bert.py``): a Hugging Face directory or a ``bert`` GGUF.

An encoder is served for embeddings and reranking only (``LoadedModel.kind == "encoder"``): it
has no causal mask, no KV cache and no output head over the vocabulary, so the engine builds no
decode runtime, prompt cache or slot state for it.

- a directory: ``config.json`` with ``model_type`` bert, xlm-roberta or nomic_bert,
  ``*.safetensors``, and a tokenizer ``tokenizer/served.py`` reads (``tokenizer.json``);
- a GGUF with ``general.architecture`` ``bert`` (llama.cpp writes BERT, RoBERTa and XLM-R as
  that) or ``nomic-bert``: hyperparameters from ``<arch>.*``, tensors under llama.cpp's names
  (dequantized to float32), the vocabulary rebuilt by ``encoder_vocab.py`` through
  ``gguf_tokenizer.py``.

The returned config is config.json-shaped with ``max_position_embeddings`` set to the positions
the model takes (XLM-R's offset rows dropped), which is llama.cpp's ``n_ctx_train``.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from mlxcel_compat.encoders import bert

ENCODER_ARCHS = ("bert", "nomic-bert")


def is_encoder_path(path: Path) -> bool:
    """Whether ``path`` (a resolved model directory or GGUF file) holds a BERT-family encoder."""
    if path.is_file():
        from mlxcel_compat.gguf.reader import open_gguf

        return open_gguf(path).architecture in ENCODER_ARCHS
    try:
        return bert.is_encoder_config(json.loads((path / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return False


def has_classifier(path: Path) -> bool:
    """A cross-encoder: a ``*ForSequenceClassification`` directory, or a GGUF with ``cls.output``."""
    if path.is_file():
        from mlxcel_compat.gguf.reader import open_gguf

        return "cls.output.weight" in open_gguf(path).tensors
    try:
        return bert.is_classifier(json.loads((path / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return False


def _served_config(raw: dict[str, Any], config: bert.EncoderConfig) -> dict[str, Any]:
    return {**raw, "max_position_embeddings": config.n_positions, "vocab_size": config.vocab_size,
            "hidden_size": config.hidden_size}


def load_directory(path: Path) -> tuple[Any, Any, dict[str, Any]]:
    """``(model, tokenizer, config)`` of a Hugging Face encoder directory."""
    from mlxcel_compat.tokenizer.cache import load_directory as load_tokenizer

    model, raw = bert.load_directory(path)
    tokenizer = load_tokenizer(path)
    return model, tokenizer, _served_config(raw, model.config)


def gguf_config(file: Any) -> bert.EncoderConfig:
    """The encoder's shape from a ``bert`` GGUF's header and tensor table."""
    def need(key: str) -> Any:
        value = file.arch_value(key)
        if value is None:
            raise ValueError(f"'{file.path}' lacks {file.architecture}.{key}")
        return value

    tensors = file.tensors
    tokens = file.metadata.get("tokenizer.ggml.tokens") or []
    nomic = file.architecture == "nomic-bert"
    cls_out = tensors.get("cls.output.weight")
    types = tensors.get("token_types.weight")
    xlmr = file.metadata.get("tokenizer.ggml.model") == "t5"
    return bert.EncoderConfig(
        model_type="nomic_bert" if nomic else "xlm-roberta" if xlmr else "bert",
        vocab_size=int(file.arch_value("vocab_size") or len(tokens)),
        hidden_size=int(need("embedding_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=int(need("attention.head_count")),
        intermediate_size=int(need("feed_forward_length")),
        n_positions=int(tensors["position_embd.weight"].shape[0]) if "position_embd.weight" in tensors
        else int(need("context_length")),
        type_vocab_size=int(types.shape[0]) if types is not None else 0,
        layer_norm_eps=float(file.arch_value("attention.layer_norm_epsilon", 1e-12)),
        num_labels=int(cls_out.shape[0]) if cls_out is not None else 0,
        head_dense="cls.weight" in tensors,
        rotary=nomic,
        rope_theta=float(file.arch_value("rope.freq_base", 1000.0)),
        gated="blk.0.ffn_gate.weight" in tensors,
        bias=any(f"blk.0.{t}.bias" in tensors for t in ("attn_q", "attn_qkv", "attn_output")),
    )


def load_gguf(path: Path) -> tuple[Any, Any, dict[str, Any], Any]:
    """``(model, tokenizer, config, summary)`` of a ``bert`` GGUF; ``summary`` is a
    ``gguf_load.GGUFSummary`` (every weight is float32 here)."""
    from mlxcel_compat.gguf import quants as gguf_quants
    from mlxcel_compat.gguf.reader import open_gguf, read_tensor
    from mlxcel_compat.gguf.load import GGUFSummary
    from mlxcel_compat.gguf.tokenizer import load_tokenizer

    t0 = time.perf_counter()
    file = open_gguf(path)
    if file.architecture not in ENCODER_ARCHS:
        raise ValueError(f"'{path}' is a {file.architecture!r} GGUF, not a BERT-family encoder")
    for info in file.tensors.values():
        gguf_quants.check_supported(info.name, info.ggml_type)
    config = gguf_config(file)
    tokenizer, specials = load_tokenizer(file)
    arrays = {name: gguf_quants.dequantize(read_tensor(info), info.ggml_type, info.n_values).reshape(info.shape)
              for name, info in file.tensors.items()}
    weights = bert.gguf_weights(arrays)
    if config.type_vocab_size == 0:  # a file without token types: type 0 adds nothing
        config = replace(config, type_vocab_size=1)
        weights["embed.types.weight"] = np.zeros((1, config.hidden_size), dtype=np.float32)
    model = bert.build_encoder(config)
    n_bytes = sum(v.nbytes for v in weights.values())
    bert.load_weights(model, weights)
    n_float = sum(1 for name in file.tensors if bert.gguf_target(name) is not None)
    summary = GGUFSummary(
        path=str(file.path), parts=len(file.parts), architecture=file.architecture, file_type=file.file_type,
        type_counts=file.type_counts(), n_params=file.n_params, file_bytes=file.size_bytes, compute_dtype="float32",
        precision={"float32": n_float}, specials=specials, weight_bytes={"float32": n_bytes},
    )
    summary.load_seconds = time.perf_counter() - t0
    raw = {
        "model_type": config.model_type,
        "architectures": ["NomicBertModel" if config.rotary else
                          "BertForSequenceClassification" if config.num_labels else "BertModel"],
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "intermediate_size": config.intermediate_size,
        "max_position_embeddings": config.n_positions,
    }
    return model, tokenizer, raw, summary
