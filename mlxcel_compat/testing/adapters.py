"""Deterministic LoRA adapters for the factory's models (tests, benchmarks, the demo).

The same random factors are written in three formats, each with its own conventions, so a test
can check the loader against the math (``lora/adapters.py`` reads them back):

- ``gguf``: what llama.cpp's ``convert_lora_to_gguf.py`` writes: ``general.type = adapter``,
  ``adapter.type = lora``, ``adapter.lora.alpha``; tensors ``<gguf weight name>.lora_a`` (NumPy
  ``(r, in)``) and ``.lora_b`` (``(out, r)``), llama's Q/K rows of B permuted like the weights;
  any of the GGUF writer's types (rows that are not whole blocks fall back as for weights);
- ``mlx``: an ``mlx_lm.lora`` directory (``adapter_config.json`` + ``adapters.safetensors``,
  ``lora_a`` ``(in, r)``, ``lora_b`` ``(r, out)``, ``lora_parameters.scale``);
- ``peft``: a PEFT directory (``adapter_model.safetensors``, ``lora_A.weight`` ``(r, in)``,
  ``lora_B.weight`` ``(out, r)``, ``lora_alpha`` / ``r``).

Every format carries the same product: ``multiplier * B @ A`` with ``multiplier = alpha / r``
(:func:`adapter_factors` returns A, B and the multiplier in the model's own row order).

Command line::

    python -m mlxcel_compat.testing.adapters --family llama --size tiny --format gguf --out FILE.gguf
    python -m mlxcel_compat.testing.adapters --family qwen3 --format mlx --rank 16 --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

FORMATS = ("gguf", "mlx", "peft")
ADAPTER_SEED = 20250917
DEFAULT_RANK = 8
DEFAULT_ALPHA = 16.0  # multiplier alpha / r = 2 at the default rank: the file's factor matters
TARGETS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
DELTA_GAIN = 0.5  # the product's entries relative to the weights' (std 1/sqrt(in) each)


def _linear_shapes(family: str, size: str) -> tuple[dict[str, tuple[int, int]], dict[str, Any]]:
    """(out, in) of every adapted module path, and the model config."""
    from mlx.utils import tree_flatten

    from .families import model_config
    from .weights import instantiate

    config = model_config(family, size)
    model = instantiate(config)
    shapes = {}
    for name, p in tree_flatten(model.parameters()):
        path = name.removesuffix(".weight")
        if name.endswith(".weight") and path.split(".layers.")[-1].split(".", 1)[-1] in TARGETS:
            shapes[path] = tuple(p.shape)
    return shapes, config


def adapter_factors(family: str, size: str = "tiny", rank: int = DEFAULT_RANK, alpha: float = DEFAULT_ALPHA,
                    seed: int = ADAPTER_SEED) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], float]:
    """Module path -> (A (r, in), B (out, r)) float32, generated in sorted path order, and the
    multiplier ``alpha / rank``. ``multiplier * B @ A`` has entries about ``DELTA_GAIN`` times
    the weights' (std ``1 / sqrt(in)``), so an adapter visibly changes the output."""
    shapes, _ = _linear_shapes(family, size)
    rng = np.random.default_rng(seed)
    multiplier = alpha / rank
    out = {}
    for path in sorted(shapes):
        n, k = shapes[path]
        a = rng.standard_normal((rank, k), dtype=np.float32) * np.float32(1.0 / math.sqrt(k))
        b = rng.standard_normal((n, rank), dtype=np.float32) * np.float32(DELTA_GAIN / (math.sqrt(rank) * multiplier))
        out[path] = (a, b)
    return out, multiplier


def write_gguf_adapter(family: str, out: str | Path, size: str = "tiny", rank: int = DEFAULT_RANK,
                       alpha: float = DEFAULT_ALPHA, gguf_type: str = "f32", seed: int = ADAPTER_SEED) -> Path:
    import gguf

    from .gguf_tensors import GGUF_TARGETS, encode_tensor, permute_rows

    target = GGUF_TARGETS[family]
    factors, _ = adapter_factors(family, size, rank, alpha, seed)
    _, config = _linear_shapes(family, size)
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == target.arch)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(out), target.arch)
    writer.add_string("general.type", "adapter")
    writer.add_name(f"mlxcel-{family}-{size}-lora-r{rank}")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(alpha))
    for path, (a, b) in factors.items():
        checkpoint_name = target.hf_name(path + ".weight") if target.hf_name else path + ".weight"
        weight = names.get_name(checkpoint_name, try_suffixes=(".weight",))
        if target.permute_qk and path.endswith("self_attn.q_proj"):
            b = permute_rows(b, config["num_attention_heads"])
        elif target.permute_qk and path.endswith("self_attn.k_proj"):
            b = permute_rows(b, config["num_key_value_heads"])
        for suffix, data in ((".lora_a", a), (".lora_b", b)):
            stored, raw_type = encode_tensor(weight + suffix, np.ascontiguousarray(data), gguf_type)
            writer.add_tensor(weight + suffix, stored, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def write_directory_adapter(family: str, out: str | Path, size: str = "tiny", fmt: str = "mlx",
                            rank: int = DEFAULT_RANK, alpha: float = DEFAULT_ALPHA, seed: int = ADAPTER_SEED) -> Path:
    """An mlx-lm (``fmt="mlx"``) or PEFT (``"peft"``) adapter directory."""
    import mlx.core as mx

    factors, multiplier = adapter_factors(family, size, rank, alpha, seed)
    _, config = _linear_shapes(family, size)
    out = Path(out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    if fmt == "mlx":
        tensors = {}
        for path, (a, b) in factors.items():
            tensors[path + ".lora_a"] = mx.array(np.ascontiguousarray(a.T))
            tensors[path + ".lora_b"] = mx.array(np.ascontiguousarray(b.T))
        mx.save_safetensors(str(out / "adapters.safetensors"), tensors, metadata={"format": "mlx"})
        adapter_config = {"fine_tune_type": "lora", "num_layers": config["num_hidden_layers"],
                          "lora_parameters": {"rank": rank, "scale": multiplier, "dropout": 0.0,
                                              "keys": list(TARGETS)}}
    elif fmt == "peft":
        tensors = {}
        for path, (a, b) in factors.items():
            tensors[f"base_model.model.{path}.lora_A.weight"] = mx.array(a)
            tensors[f"base_model.model.{path}.lora_B.weight"] = mx.array(b)
        mx.save_safetensors(str(out / "adapter_model.safetensors"), tensors, metadata={"format": "pt"})
        adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "use_rslora": False,
                          "target_modules": sorted({t.split(".")[-1] for t in TARGETS}), "task_type": "CAUSAL_LM"}
    else:
        raise ValueError(f"unknown adapter directory format {fmt!r}; choose mlx or peft")
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return out


def ensure_adapter(family: str = "llama", size: str = "tiny", fmt: str = "gguf", cache_dir: str | Path | None = None,
                   rank: int = DEFAULT_RANK, alpha: float = DEFAULT_ALPHA, gguf_type: str = "f32",
                   seed: int = ADAPTER_SEED) -> Path:
    """``<cache>/lora-<family>-<size>-r<rank>-a<alpha>-s<seed>[-<type>].gguf`` (or a directory),
    written on first use into a temporary path and renamed into place."""
    import os
    import shutil
    import tempfile

    from .cache_dir import default_cache_dir
    from .model_directory import FORMAT_VERSION

    if fmt not in FORMATS:
        raise ValueError(f"unknown adapter format {fmt!r}; choose one of {', '.join(FORMATS)}")
    root = (Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()).absolute()
    root.mkdir(parents=True, exist_ok=True)
    stem = f"lora-{family}-{size}-v{FORMAT_VERSION}-r{rank}-a{alpha:g}-s{seed}"
    target = root / (f"{stem}-{gguf_type}.gguf" if fmt == "gguf" else f"{stem}-{fmt}")
    if target.exists():
        return target
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=root))
    try:
        if fmt == "gguf":
            written = write_gguf_adapter(family, tmp / "adapter.gguf", size, rank, alpha, gguf_type, seed)
        else:
            written = write_directory_adapter(family, tmp / "adapter", size, fmt, rank, alpha, seed)
        try:
            os.rename(written, target)
        except OSError:
            if not target.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a deterministic LoRA adapter for a factory model.")
    parser.add_argument("--family", default="llama")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--format", choices=FORMATS, default="gguf")
    parser.add_argument("--rank", type=int, default=DEFAULT_RANK)
    parser.add_argument("--alpha", type=float, default=DEFAULT_ALPHA)
    parser.add_argument("--gguf-type", default="f32")
    parser.add_argument("--seed", type=int, default=ADAPTER_SEED)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.format == "gguf":
        path = write_gguf_adapter(args.family, args.out, args.size, args.rank, args.alpha, args.gguf_type, args.seed)
    else:
        path = write_directory_adapter(args.family, args.out, args.size, args.format, args.rank, args.alpha, args.seed)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
