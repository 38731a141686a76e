"""A factory model as a Hugging Face directory: written, checked, cached, quantized.

A directory holds ``model.safetensors`` (``weights.py``'s seeded weights), ``config.json``, the
tokenizer files (``tokenizer.py``'s vocabulary, ``chatml.py``'s template) and a manifest written
last, so a directory with a manifest is complete (:func:`is_complete`). :func:`ensure_model`
finds or builds one in the cache, :func:`build_model` at a given path. A quantized directory
(:class:`Quantization`) is what ``mlx_lm.convert -q`` makes of the directory: mlx-lm's own
conversion (cast to bfloat16, as from a bfloat16 checkpoint, then ``quantize_model``) and save
path, so tests load a real mlx-community-style directory offline.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from typing import Any

from . import chatml
from . import tokenizer as tok
from .cache_dir import default_cache_dir
from .families import EOS_IDS, MAX_POSITION_EMBEDDINGS, Family, family_spec
from .weights import random_weights

# Bump when the bytes of any output change, so cached directories are rebuilt.
FORMAT_VERSION = 4
MANIFEST_NAME = "mlxcel_testing.json"


def _json_text(data: Any) -> str:
    return json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _tokenizer_files(spec: Family) -> dict[str, str]:
    """tokenizer.json, tokenizer_config.json and special_tokens_map.json texts."""
    bos = tok.BEGIN_OF_TEXT if spec.add_bos else None
    added = {
        str(tok.token_id(t.content)): {
            "content": t.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": t.special,
        }
        for t in tok.ADDED_TOKENS
    }
    fim = list(tok.FIM_TOKENS) if spec.fim else []
    added.update({str(tok.fim_token_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                             "single_word": False, "special": True} for t in fim})
    tokenizer_config = {
        "add_bos_token": spec.add_bos,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [tok.IM_START, tok.IM_END, *fim],
        "bos_token": bos,
        "chat_template": chatml.chat_template(spec.thinking),
        "clean_up_tokenization_spaces": False,
        "eos_token": tok.IM_END,
        "errors": "replace",
        "model_max_length": MAX_POSITION_EMBEDDINGS,
        "pad_token": tok.ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    special_tokens_map = {
        "additional_special_tokens": [tok.IM_START, tok.IM_END, *fim],
        "eos_token": tok.IM_END,
        "pad_token": tok.ENDOFTEXT,
    }
    if bos is not None:
        special_tokens_map["bos_token"] = bos
    return {
        "tokenizer.json": tok.tokenizer_json_for(spec.add_bos, fim=spec.fim),
        "tokenizer_config.json": _json_text(tokenizer_config),
        "special_tokens_map.json": _json_text(special_tokens_map),
    }


def _write_model_files(family: str, size: str, directory: Path) -> None:
    """Write every file of the model into an existing empty ``directory``."""
    weights, config = random_weights(family, size)
    write_model_directory(directory, family, size, weights, config)


def write_model_directory(directory: Path, family: str, size: str, weights: dict[str, Any], config: dict[str, Any],
                          derived: dict[str, Any] | None = None) -> None:
    """Write ``weights`` and ``config`` as a model directory of ``family`` (its tokenizer and
    templates) into an existing empty ``directory``, the manifest last; ``derived`` says how the
    weights were derived from the (family, size) model, if they were (``draft_pair.py``)."""
    import mlx.core as mx

    spec = family_spec(family, size)
    if spec.hf_layout is None:
        stored = weights
    else:  # the layouts work on NumPy arrays
        numpy_weights = {name: np.array(value) for name, value in weights.items()}
        stored = {name: mx.array(value) for name, value in spec.hf_layout(numpy_weights, config).items()}
    mx.save_safetensors(str(directory / "model.safetensors"), stored, metadata={"format": "mlx"})
    texts = _tokenizer_files(spec)
    texts["config.json"] = _json_text(config)
    generation_config = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": EOS_IDS,
        "pad_token_id": config["pad_token_id"],
    }
    texts["generation_config.json"] = _json_text(generation_config)
    for name, text in texts.items():
        (directory / name).write_text(text, encoding="utf-8")

    files = {}
    for path in sorted(directory.iterdir()):
        files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    manifest = {
        "family": family,
        "size": size,
        "format_version": FORMAT_VERSION,
        "num_parameters": int(sum(v.size for v in weights.values())),
        "files": files,
    }
    if derived is not None:
        manifest["derived"] = derived
    # Written last: a directory with a manifest is complete.
    (directory / MANIFEST_NAME).write_text(_json_text(manifest), encoding="utf-8")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def is_complete(directory: str | Path) -> bool:
    """True when ``directory`` holds a finished build (manifest present, sizes match)."""
    directory = Path(directory)
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_text(encoding="utf-8"))
        return manifest.get("format_version") == FORMAT_VERSION and all(
            (directory / name).stat().st_size == entry["bytes"]
            for name, entry in manifest["files"].items()
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def build_model(family: str, size: str, out_dir: str | Path, quantization: Quantization | None = None) -> Path:
    """Build the (family, size) model into ``out_dir`` and return its path; ``quantization``:
    its MLX quantized conversion instead (the float directory is built in the default cache).

    The files are written into a temporary directory beside ``out_dir`` and
    renamed into place, so readers never see a half-written model. An existing
    ``out_dir`` is replaced only if it is empty or a previous build; anything
    else raises ``FileExistsError`` rather than deleting someone's files.
    """
    family_spec(family, size)
    out_dir = Path(out_dir).absolute()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / MANIFEST_NAME).exists():
        raise FileExistsError(f"{out_dir} exists and is not a model built by this tool")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        if quantization is not None:
            _write_quantized_files(family, size, tmp, quantization, None)
        else:
            _write_model_files(family, size, tmp)
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
            os.replace(out_dir, old / "model")
            os.rename(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


@dataclass(frozen=True)
class Quantization:
    """How ``mlx_lm.convert -q`` quantizes a factory directory: ``--q-bits``, ``--q-group-size``,
    ``--q-mode`` and ``--dtype`` (the float dtype the weights are cast to first, which is the
    dtype of the scales and biases: bfloat16, as for most mlx-community directories)."""

    bits: int = 4
    group_size: int = 64
    mode: str = "affine"
    dtype: str = "bfloat16"

    @property
    def suffix(self) -> str:
        """The cache directory's suffix, e.g. ``q4-g64`` (mode and dtype only when not the default)."""
        parts = [f"q{self.bits}", f"g{self.group_size}"]
        if self.mode != "affine":
            parts.append(self.mode)
        if self.dtype != "bfloat16":
            parts.append(self.dtype)
        return "-".join(parts)


def _write_quantized_files(family: str, size: str, directory: Path, quantization: Quantization,
                           cache_dir: str | Path | None) -> None:
    """Write the quantized conversion of the (family, size) directory into ``directory``."""
    import contextlib
    import io

    from mlx_lm.convert import convert

    source = ensure_model(family, size, cache_dir)
    staging = directory / "convert"
    with contextlib.redirect_stdout(io.StringIO()):  # convert prints its progress
        convert(str(source), str(staging), quantize=True, q_group_size=quantization.group_size,
                q_bits=quantization.bits, q_mode=quantization.mode, dtype=quantization.dtype)
    for path in staging.iterdir():
        os.replace(path, directory / path.name)
    staging.rmdir()
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    if "quantization" not in config:
        raise RuntimeError(f"mlx_lm.convert quantized nothing of {family}-{size} with {quantization}")
    files = {}
    for path in sorted(directory.iterdir()):
        files[path.name] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    manifest = {
        "family": family,
        "size": size,
        "format_version": FORMAT_VERSION,
        "quantization": {"bits": quantization.bits, "group_size": quantization.group_size,
                         "mode": quantization.mode, "dtype": quantization.dtype},
        "files": files,
    }
    (directory / MANIFEST_NAME).write_text(_json_text(manifest), encoding="utf-8")


def ensure_model(family: str = "llama", size: str = "tiny",
                 cache_dir: str | Path | None = None, quantization: Quantization | None = None) -> Path:
    """Return ``<cache_dir>/<family>-<size>-v<N>``, building it on first use; with
    ``quantization``, ``<family>-<size>-v<N>-<suffix>``: its MLX quantized conversion.

    Safe with concurrent callers: each builds into its own temporary directory
    and renames it into place; a loser of the race discards its copy and uses
    the winner's (identical) one.
    """
    family_spec(family, size)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    name = f"{family}-{size}-v{FORMAT_VERSION}" + (f"-{quantization.suffix}" if quantization is not None else "")
    target = root.absolute() / name
    if is_complete(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    if target.exists():
        # An incomplete leftover (files deleted by hand): move it out of the way.
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
        try:
            os.replace(target, stale / "model")
        except FileNotFoundError:
            pass
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        if quantization is not None:
            _write_quantized_files(family, size, tmp, quantization, root)
        else:
            _write_model_files(family, size, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_complete(target):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
