"""Deterministic random-weight models for tests, benchmarks and the demo mode.

Each (family, size) pair maps to one mlx-lm architecture and one config. The
weights come from a fixed NumPy PCG64 seed and the tokenizer from a fixed
generated corpus, so every build of a pair produces the same bytes on every
machine (for a given ``tokenizers`` version). Directories load with
``mlx_lm.utils.load`` like any converted Hugging Face checkpoint.

Command line (a stable contract for scripts)::

    python -m mlxcel_compat.testing.models --family llama --size tiny --out DIR
    python -m mlxcel_compat.testing.models --family F --size S --format gguf [--gguf-type TYPE] --out FILE.gguf
    python -m mlxcel_compat.testing.models --family F --quantize 4|8 [--q-group-size 32|64|128] --out DIR
    python -m mlxcel_compat.testing.models --list

A GGUF is written from the same weights, tokenizer and chat template as the directory, with
llama.cpp's converter conventions (``gguf_writer.py``). A quantized directory (``--quantize``,
:class:`Quantization`) is what ``mlx_lm.convert -q`` makes of the directory: mlx-lm's own
conversion (cast to bfloat16, as from a bfloat16 checkpoint, then ``quantize_model``) and save
path, so tests load a real mlx-community-style directory offline.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import chatml
from . import tokenizer as tok

# Bump when the bytes of any output change, so cached directories are rebuilt.
FORMAT_VERSION = 1
WEIGHT_SEED = 20240229
MANIFEST_NAME = "mlxcel_testing.json"
SIZES: tuple[str, ...] = ("tiny", "small")
MAX_POSITION_EMBEDDINGS = 32768

_EOS_IDS = [tok.token_id(tok.IM_END), tok.token_id(tok.ENDOFTEXT)]


@dataclass(frozen=True)
class Family:
    """What differs between families besides the config numbers."""

    name: str
    architecture: str
    thinking: bool  # the chat template handles <think> (Qwen3 style)
    add_bos: bool  # the tokenizer prepends <|begin_of_text|> (Llama 3 style)
    norm_one: float  # stored RMSNorm weight meaning a gain of 1 (Gemma uses 1 + w)
    model_type: str = ""  # mlx-lm's model_type when it is not the name
    fim: bool = False  # the tokenizer has fill-in-the-middle tokens (tokenizer.FIM_TOKENS)

    @property
    def kind(self) -> str:
        return self.model_type or self.name


_FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", "LlamaForCausalLM", thinking=False, add_bos=True, norm_one=1.0),
        Family("qwen3", "Qwen3ForCausalLM", thinking=True, add_bos=False, norm_one=1.0),
        Family("gemma3_text", "Gemma3ForCausalLM", thinking=False, add_bos=False, norm_one=0.0),
        Family("qwen3_next", "Qwen3NextForCausalLM", thinking=True, add_bos=False, norm_one=1.0),
        Family("qwen2", "Qwen2ForCausalLM", thinking=False, add_bos=False, norm_one=1.0),
        Family("mistral", "MistralForCausalLM", thinking=False, add_bos=True, norm_one=1.0),
        Family("lfm2", "Lfm2ForCausalLM", thinking=False, add_bos=False, norm_one=1.0),
        # Qwen2.5-Coder's shape: qwen2 with the FIM tokens (<|fim_prefix|>, ..., <|file_sep|>) added.
        Family("qwen2_coder", "Qwen2ForCausalLM", thinking=False, add_bos=False, norm_one=1.0, model_type="qwen2", fim=True),
    )
}

# The families every family-wide test runs on; the FIM ones are served by /infill's tests.
FIM_FAMILIES: tuple[str, ...] = tuple(name for name, f in _FAMILIES.items() if f.fim)
FAMILIES: tuple[str, ...] = tuple(name for name in _FAMILIES if name not in FIM_FAMILIES)


def _llama_config(size: str) -> dict[str, Any]:
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=192)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    num_key_value_heads=4, head_dim=64, intermediate_size=2048)
    return dict(dims, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                attention_bias=False, mlp_bias=False, hidden_act="silu")


def _qwen3_config(size: str) -> dict[str, Any]:
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=192)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    num_key_value_heads=4, head_dim=64, intermediate_size=2304)
    return dict(dims, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                attention_bias=False, hidden_act="silu")


def _gemma3_text_config(size: str) -> dict[str, Any]:
    # The tiny sliding window is small so tests can make the RotatingKVCache wrap.
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=192,
                    sliding_window=64, sliding_window_pattern=2)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    num_key_value_heads=4, head_dim=64, intermediate_size=2304,
                    sliding_window=512, sliding_window_pattern=6)
    pattern = dims["sliding_window_pattern"]
    layer_types = [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(dims["num_hidden_layers"])
    ]
    return dict(dims, layer_types=layer_types, query_pre_attn_scalar=dims["head_dim"],
                rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh")


def _qwen3_next_config(size: str) -> dict[str, Any]:
    # Dense MLPs (num_experts = 0): the point is the hybrid cache, not the MoE.
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, intermediate_size=192,
                    linear_num_key_heads=2, linear_num_value_heads=4,
                    linear_key_head_dim=16, linear_value_head_dim=16)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    num_key_value_heads=4, head_dim=64, intermediate_size=2048,
                    linear_num_key_heads=4, linear_num_value_heads=8,
                    linear_key_head_dim=64, linear_value_head_dim=64)
    return dict(dims, full_attention_interval=4, linear_conv_kernel_dim=4,
                partial_rotary_factor=0.25, num_experts=0, num_experts_per_tok=0,
                decoder_sparse_step=1, moe_intermediate_size=0,
                shared_expert_intermediate_size=0, mlp_only_layers=[], norm_topk_prob=True,
                rms_norm_eps=1e-6, rope_theta=10000000.0, tie_word_embeddings=False,
                attention_bias=False, hidden_act="silu")


def _qwen2_config(size: str) -> dict[str, Any]:
    # Qwen2 has biases on the q/k/v projections and head_dim = hidden / heads.
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=192)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    num_key_value_heads=4, intermediate_size=2304)
    return dict(dims, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                hidden_act="silu")


def _mistral_config(size: str) -> dict[str, Any]:
    # Llama's shape, Mistral-Nemo style: head_dim is not hidden / heads, so GGUF files carry key_length.
    config = _llama_config(size)
    if size == "tiny":
        config.update(head_dim=32)
    else:
        config.update(num_attention_heads=8, head_dim=128)
    config.update(rope_theta=1000000.0, sliding_window=None)
    return config


def _lfm2_config(size: str) -> dict[str, Any]:
    # A hybrid: short-convolution layers (ArraysCache) with a few attention layers (KVCache).
    if size == "tiny":
        dims = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                    num_key_value_heads=2, block_ff_dim=192)
        attention = (2,)
    else:
        dims = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                    num_key_value_heads=4, block_ff_dim=2304)
        attention = (2, 5, 8, 10)
    layer_types = ["full_attention" if i in attention else "conv"
                   for i in range(dims["num_hidden_layers"])]
    return dict(dims, layer_types=layer_types, block_dim=dims["hidden_size"],
                intermediate_size=dims["block_ff_dim"], block_auto_adjust_ff_dim=False,
                block_multiple_of=256, block_ffn_dim_multiplier=1.0, conv_L_cache=3,
                conv_bias=False, norm_eps=1e-5, rope_theta=1000000.0, tie_embedding=True)


_CONFIGS = {
    "llama": _llama_config,
    "qwen3": _qwen3_config,
    "gemma3_text": _gemma3_text_config,
    "qwen3_next": _qwen3_next_config,
    "qwen2": _qwen2_config,
    "mistral": _mistral_config,
    "lfm2": _lfm2_config,
}


def _check(family: str, size: str) -> Family:
    if family not in _FAMILIES:
        raise ValueError(f"unknown model family {family!r}; choose one of: {', '.join(_FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; choose one of: {', '.join(SIZES)}")
    return _FAMILIES[family]


def model_config(family: str, size: str) -> dict[str, Any]:
    """The ``config.json`` content for a pair (keys sorted when written)."""
    spec = _check(family, size)
    config = _CONFIGS[spec.kind](size)
    config.update(
        model_type=spec.kind,
        architectures=[spec.architecture],
        vocab_size=tok.VOCAB_SIZE + (len(tok.FIM_TOKENS) if spec.fim else 0),
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        bos_token_id=tok.token_id(tok.BEGIN_OF_TEXT) if spec.add_bos else None,
        eos_token_id=_EOS_IDS,
        pad_token_id=tok.token_id(tok.ENDOFTEXT),
        torch_dtype="float32",
    )
    return config


def _instantiate(config: dict[str, Any]) -> Any:
    """The mlx-lm model for ``config``; its arrays stay lazy, so this is cheap."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config))


def _stored_shapes(model: Any, config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the tensors written to ``model.safetensors``.

    Tied families omit ``lm_head.weight`` (gemma3_text's ``sanitize`` then drops
    the head module when loading).
    """
    from mlx.utils import tree_flatten

    shapes = {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}
    if config.get("tie_word_embeddings"):
        shapes.pop("lm_head.weight", None)
    return shapes


def _init_tensor(rng: np.random.Generator, name: str, shape: tuple[int, ...],
                 spec: Family) -> np.ndarray:
    """One seeded float32 tensor.

    Matrices are normal with std 1/sqrt(fan_in) (unit gain), which keeps the
    logits' spread near 1 so greedy decoding is not decided by near-ties.
    Only exact IEEE operations are used (no log/exp), so the bits do not depend
    on the machine's math library.
    """
    leaf = name.rsplit(".", 1)[-1]
    if len(shape) == 1:
        if leaf == "A_log":
            # Decay rates of the gated delta net: like log(U(1, 16)).
            return rng.random(shape, dtype=np.float32) * np.float32(2.75)
        if leaf == "dt_bias":
            return np.ones(shape, dtype=np.float32)
        if leaf == "bias":
            return np.zeros(shape, dtype=np.float32)
        if "norm" in name:
            return np.full(shape, spec.norm_one, dtype=np.float32)
        raise ValueError(f"no initializer for the 1-D parameter {name}")
    if name.endswith("embed_tokens.weight"):
        fan_in = shape[1]  # as the tied output head, the hidden size is the fan-in
    else:
        fan_in = math.prod(shape[1:])
    std = np.float32(1.0 / math.sqrt(fan_in))
    return rng.standard_normal(shape, dtype=np.float32) * std


def _random_weights(family: str, size: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The config and its weights as MLX arrays, generated in sorted name order."""
    import mlx.core as mx

    spec = _check(family, size)
    config = model_config(family, size)
    model = _instantiate(config)
    shapes = _stored_shapes(model, config)
    rng = np.random.default_rng(WEIGHT_SEED)
    weights = {
        name: mx.array(_init_tensor(rng, name, shapes[name], spec)) for name in sorted(shapes)
    }
    _check_loadable(model, weights)
    return weights, config


def _check_loadable(model: Any, arrays: dict[str, Any]) -> None:
    """Fail the build, not the later load, if mlx-lm would reject these weights."""
    from mlx.utils import tree_flatten

    if hasattr(model, "sanitize"):
        sanitized = model.sanitize(dict(arrays))
        changed = [k for k in arrays if sanitized.get(k) is not arrays[k]]
        if changed or len(sanitized) != len(arrays):
            raise RuntimeError(f"sanitize would rewrite stored tensors: {changed[:5]}")
    expected = {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}
    actual = {name: tuple(a.shape) for name, a in arrays.items()}
    if expected != actual:
        raise RuntimeError(f"weights do not match the model: {sorted(set(expected) ^ set(actual))}")


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
    weights, config = _random_weights(family, size)
    write_model_directory(directory, family, size, weights, config)


def write_model_directory(directory: Path, family: str, size: str, weights: dict[str, Any], config: dict[str, Any],
                          derived: dict[str, Any] | None = None) -> None:
    """Write ``weights`` and ``config`` as a model directory of ``family`` (its tokenizer and
    templates) into an existing empty ``directory``, the manifest last; ``derived`` says how the
    weights were derived from the (family, size) model, if they were (``draft_pair.py``)."""
    import mlx.core as mx

    spec = _check(family, size)
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    texts = _tokenizer_files(spec)
    texts["config.json"] = _json_text(config)
    generation_config = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": _EOS_IDS,
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
    _check(family, size)
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


def default_cache_dir() -> Path:
    """``$MLXCEL_CACHE_DIR`` if set, else ``~/.cache/mlxcel_compat/models``."""
    env = os.environ.get("MLXCEL_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "mlxcel_compat" / "models"


def ensure_model(family: str = "llama", size: str = "tiny",
                 cache_dir: str | Path | None = None, quantization: Quantization | None = None) -> Path:
    """Return ``<cache_dir>/<family>-<size>-v<N>``, building it on first use; with
    ``quantization``, ``<family>-<size>-v<N>-<suffix>``: its MLX quantized conversion.

    Safe with concurrent callers: each builds into its own temporary directory
    and renames it into place; a loser of the race discards its copy and uses
    the winner's (identical) one.
    """
    _check(family, size)
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


def build_directory(target: Path, marker: str, write: Callable[[Path], None]) -> Path:
    """``target``, written by ``write(tmp)`` into a temporary directory beside it and renamed into
    place on first use; complete once its ``marker`` file exists (written last). Concurrent callers
    never see half a directory: a loser of the race discards its copy and uses the winner's."""
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        write(tmp)
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)  # an incomplete leftover
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / marker).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def describe(family: str, size: str) -> dict[str, Any]:
    """A summary of the pair without building it: config, parameter count, cache layout."""
    spec = _check(family, size)
    config = model_config(family, size)
    model = _instantiate(config)
    shapes = _stored_shapes(model, config)
    return {
        "family": family,
        "size": size,
        "architecture": spec.architecture,
        "num_parameters": int(sum(math.prod(s) for s in shapes.values())),
        "cache_types": [type(c).__name__ for c in model.make_cache()]
        if hasattr(model, "make_cache")
        else ["KVCache"] * config["num_hidden_layers"],
        "thinking": spec.thinking,
        "add_bos": spec.add_bos,
        "config": config,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mlxcel_compat.testing.models",
        description="Write a deterministic random-weight model directory loadable by mlx_lm.",
    )
    parser.add_argument("--list", action="store_true", help="print the families, one per line")
    parser.add_argument("--family", help=f"one of: {', '.join(_FAMILIES)}")
    parser.add_argument("--size", default="tiny", help=f"one of: {', '.join(SIZES)} (default tiny)")
    parser.add_argument("--out", help="output directory (replaced if it holds a previous build), or the .gguf file")
    parser.add_argument("--format", choices=("hf", "gguf"), default="hf",
                        help="hf: a Hugging Face directory (default); gguf: one GGUF file")
    parser.add_argument("--gguf-type", default="f32",
                        help="matrix type of a GGUF (default f32): f32, f16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, "
                             "q3_k, q4_k, q5_k, q6_k, or llama-quantize's q4_k_m / q5_k_m mixes")
    parser.add_argument("--quantize", type=int, metavar="BITS",
                        help="write the directory's MLX quantized conversion (mlx_lm.convert -q) with BITS-bit "
                             "integers: 4 or 8 (also 2, 3, 5, 6)")
    parser.add_argument("--q-group-size", type=int, default=64, help="quantization group size: 32, 64 or 128 "
                        "(default 64)")
    parser.add_argument("--q-mode", default="affine", help="quantization mode (default affine; mlx-lm also "
                        "has mxfp4, nvfp4, mxfp8)")
    parser.add_argument("--q-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="float dtype of the quantized directory, and of its scales (default bfloat16)")
    args = parser.parse_args(argv)

    if args.list:
        print("\n".join(_FAMILIES))
        return 0
    if args.family is None or args.out is None:
        parser.error("--family and --out are required (or use --list)")
    try:
        _check(args.family, args.size)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.format == "gguf":
        from .gguf_writer import write_gguf

        try:
            paths = write_gguf(args.family, args.size, args.out, args.gguf_type)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print("\n".join(str(p) for p in paths))
        return 0
    quantization = None
    if args.quantize is not None:
        if args.format != "hf":
            parser.error("--quantize writes a directory (--format hf)")
        quantization = Quantization(args.quantize, args.q_group_size, args.q_mode, args.q_dtype)
    try:
        path = build_model(args.family, args.size, args.out, quantization)
    except (ValueError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except FileExistsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
