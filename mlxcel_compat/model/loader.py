"""Find and load the served model: a local Hugging Face directory or a hub id.

Resolution happens before MLX is touched so that a missing model fails fast with a message a user
can act on (the hub is often unreachable on servers). Loading itself is mlx-lm's
``mlx_lm.utils.load``; on the CPU backend the weights are cast to float32, because float16 and
bfloat16 matmuls are ~40x slower there.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# What mlx-lm needs from a hub snapshot (weights, config, tokenizer, templates).
_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


class ModelNotFoundError(RuntimeError):
    """The model could not be found locally nor fetched; the message says what to do."""


@dataclass
class LoadedModel:
    """Everything the engine and the HTTP layer need to know about the served model."""

    model: Any  # mlx.nn.Module; owned by the engine thread
    tokenizer: Any  # mlx_lm TokenizerWrapper (pure Python; safe to use from handlers)
    config: dict[str, Any]
    path: Path
    model_id: str  # the display id: first alias, else the directory name
    aliases: list[str] = field(default_factory=list)
    n_params: int = 0
    size_bytes: int = 0


def resolve_model_path(model: str, offline: bool = False) -> Path:
    """Return a local directory for ``model`` (a path or a hub id), downloading only if allowed."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"'{model}' is a directory but has no config.json: not a Hugging Face model directory")
        return path
    if path.exists():
        raise ModelNotFoundError(
            f"'{model}' is a file; mlxcel-server loads Hugging Face model directories (config.json + safetensors), not GGUF files"
        )
    if model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise ModelNotFoundError(f"model '{model}' not found: no such directory, and it is not a hub id of the form 'org/name'")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(model, allow_patterns=_ALLOW_PATTERNS, local_files_only=offline))
    except Exception as exc:  # hub errors come in many classes; the message is what matters
        where = "the local Hugging Face cache (--offline)" if offline else "the local cache, and the hub could not be reached"
        raise ModelNotFoundError(
            f"model '{model}' is not in {where}: {type(exc).__name__}: {exc}. "
            "Download it on a machine with network access (huggingface-cli download), or pass -m with a local directory."
        ) from exc


def model_display_id(model_arg: str, aliases: list[str]) -> str:
    """llama-server picks the alphabetically first alias; else the directory name, or the hub id."""
    if aliases:
        return sorted(aliases)[0]
    path = Path(model_arg.rstrip("/")).expanduser()
    if path.exists():
        return path.name or model_arg
    return model_arg


def read_config(path: Path) -> dict[str, Any]:
    with open(path / "config.json", encoding="utf-8") as f:
        return json.load(f)


def load_model(model_arg: str, aliases: list[str], offline: bool = False) -> LoadedModel:
    """Load weights and tokenizer with mlx-lm. Must run on the engine thread (it creates MLX state)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load

    path = resolve_model_path(model_arg, offline=offline)
    model, tokenizer, config = load(str(path), return_config=True)
    if mx.default_device() == mx.cpu:
        from mlxcel_compat.model import attention

        # Quantized (integer) weights stay as they are; only half-precision floats are widened.
        model.set_dtype(mx.float32, predicate=lambda dt: dt in (mx.float16, mx.bfloat16))
        attention.install()  # the model's module is imported now: switch its attention
    params = tree_flatten(model.parameters())
    n_params = sum(v.size for _, v in params)
    size_bytes = sum(v.nbytes for _, v in params)
    mx.eval(model.parameters())
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        config=config,
        path=path,
        model_id=model_display_id(model_arg, aliases),
        aliases=sorted(aliases),
        n_params=n_params,
        size_bytes=size_bytes,
    )
