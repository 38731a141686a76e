"""Which pooling a model's embeddings use by default, read as llama.cpp reads it (pure Python).

llama-server takes ``--pooling`` when given, else the model's own type: a GGUF's
``<arch>.pooling_type`` (llama.h's enum: 0 none, 1 mean, 2 cls, 3 last, 4 rank), which
llama.cpp's converter writes from the sentence-transformers ``1_Pooling/config.json`` of the
checkpoint. A directory is read the same way here, from that file (through ``modules.json``).
A model that says nothing pools ``none``: one vector per token.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

POOLING_TYPES: tuple[str, ...] = ("none", "mean", "cls", "last", "rank")
GGUF_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
# sentence-transformers' Pooling options, in the order its converter tests them in llama.cpp.
_ST_MODES = (("pooling_mode_mean_tokens", "mean"), ("pooling_mode_cls_token", "cls"), ("pooling_mode_lasttoken", "last"))
_ST_POOLING_MODULE = "sentence_transformers.models.Pooling"


def model_pooling(path: str | Path) -> str:
    """The pooling the model declares (``none`` when it declares none).

    Args:
        path: a GGUF file or a Hugging Face model directory.
    """
    path = Path(path)
    if path.is_file():
        from mlxcel_compat.gguf.reader import open_gguf

        value = open_gguf(path).arch_value("pooling_type")
        return GGUF_POOLING.get(int(value), "none") if value is not None else "none"
    from mlxcel_compat.encoders.rerank import is_reranker_directory

    if is_reranker_directory(path):
        return "rank"  # what llama.cpp's converter writes for a Qwen3-Reranker checkpoint
    from mlxcel_compat.encoders import bert

    config = _read_json(path / "config.json")
    if isinstance(config, dict) and bert.is_encoder_config(config) and bert.is_classifier(config):
        return "rank"  # a cross-encoder: scores are what it computes (llama-server needs --rerank for its GGUF)
    return _sentence_transformers_pooling(path) or "none"


def _sentence_transformers_pooling(directory: Path) -> str | None:
    pooling_dir = directory / "1_Pooling"
    modules = _read_json(directory / "modules.json")
    if isinstance(modules, list):
        for module in modules:
            if isinstance(module, dict) and module.get("type") == _ST_POOLING_MODULE:
                pooling_dir = directory / str(module.get("path", "1_Pooling"))
    config = _read_json(pooling_dir / "config.json")
    if not isinstance(config, dict):
        return None
    if isinstance(config.get("pooling_mode"), str):  # newer sentence-transformers spell it once
        mode = {"mean": "mean", "cls": "cls", "lasttoken": "last"}.get(config["pooling_mode"])
        if mode:
            return mode
    for key, mode in _ST_MODES:
        if config.get(key) is True:
            return mode
    return None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
