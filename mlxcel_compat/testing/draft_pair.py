"""A target/draft model pair that agree often, for speculative decoding's tests and benchmarks.

Two random-weight models agree on nothing, so the pair is derived from one factory model: the
draft is its first ``draft_layers`` layers (with its embedding, final norm and head), and the
target is the whole model with the branch of every deeper layer (the attention output and MLP
down projections) scaled by ``damping``. The deeper layers then only nudge the residual stream
the draft computes: the target's greedy token is the draft's most of the time (how often is set
by ``damping``), while the target still costs all its layers a step. Acceptance rates in tests and
benchmarks are therefore meaningful, and measured, not assumed.

Both are written as model directories (same tokenizer and templates as the factory family) and,
for llama-server, as GGUF files of the same weights.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from mlxcel_compat.testing.cache_dir import default_cache_dir
from mlxcel_compat.testing.model_directory import is_complete, write_model_directory
from mlxcel_compat.testing.weights import random_weights

PAIR_VERSION = 1
DAMPED = ("self_attn.o_proj.weight", "mlp.down_proj.weight")


def pair_weights(family: str, size: str, draft_layers: int, damping: float) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(target weights, target config, draft weights, draft config)``."""
    weights, config = random_weights(family, size)
    n_layers = int(config["num_hidden_layers"])
    if not 1 <= draft_layers < n_layers:
        raise ValueError(f"draft_layers must be in 1..{n_layers - 1}")
    target: dict[str, Any] = {}
    draft: dict[str, Any] = {}
    for name, value in weights.items():
        layer = _layer_of(name)
        if layer is not None and layer >= draft_layers and name.endswith(DAMPED):
            value = value * damping
        target[name] = value
        if layer is None or layer < draft_layers:
            draft[name] = value
    return target, config, draft, dict(config, num_hidden_layers=draft_layers)


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    if "layers" in parts:
        return int(parts[parts.index("layers") + 1])
    return None


def pair_name(family: str, size: str, draft_layers: int, damping: float) -> str:
    return f"{family}-{size}-pair-d{draft_layers}-x{damping:g}-v{PAIR_VERSION}"


def ensure_pair(family: str = "llama", size: str = "small", draft_layers: int = 2, damping: float = 0.02,
                cache_dir: str | Path | None = None) -> tuple[Path, Path]:
    """``(target directory, draft directory)``, built once into the factory's cache."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    base = root.absolute() / pair_name(family, size, draft_layers, damping)
    target_dir, draft_dir = base / "target", base / "draft"
    if is_complete(target_dir) and is_complete(draft_dir):
        return target_dir, draft_dir
    target, t_config, draft, d_config = pair_weights(family, size, draft_layers, damping)
    base.mkdir(parents=True, exist_ok=True)
    derived = {"from": f"{family}-{size}", "draft_layers": draft_layers, "damping": damping}
    for out, weights, config, role in ((target_dir, target, t_config, "target"), (draft_dir, draft, d_config, "draft")):
        tmp = Path(tempfile.mkdtemp(prefix=f".{role}.tmp-", dir=base))
        try:
            write_model_directory(tmp, family, size, weights, config, derived=dict(derived, role=role))
            if out.exists():
                shutil.rmtree(out, ignore_errors=True)
            os.rename(tmp, out)
        except OSError:
            if not is_complete(out):
                raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target_dir, draft_dir


def ensure_pair_gguf(family: str = "llama", size: str = "small", draft_layers: int = 2, damping: float = 0.02,
                     gguf_type: str = "f32", cache_dir: str | Path | None = None) -> tuple[Path, Path]:
    """The same pair as GGUF files (for llama-server side by side), built once."""
    from mlxcel_compat.testing.gguf_writer import write_gguf

    target_dir, draft_dir = ensure_pair(family, size, draft_layers, damping, cache_dir)
    target, t_config, draft, d_config = None, None, None, None
    paths = []
    for directory, role in ((target_dir, "target"), (draft_dir, "draft")):
        out = directory.parent / f"{role}-{gguf_type}.gguf"
        if not out.exists():
            if target is None:
                target, t_config, draft, d_config = pair_weights(family, size, draft_layers, damping)
            weights, config = (target, t_config) if role == "target" else (draft, d_config)
            tmp = out.with_suffix(".tmp.gguf")
            write_gguf(family, size, tmp, gguf_type, model_dir=directory, weights=weights, config=config)
            os.replace(tmp, out)
        paths.append(out)
    return paths[0], paths[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the speculative-decoding target/draft pair; print their paths.")
    parser.add_argument("--family", default="llama")
    parser.add_argument("--size", default="small")
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--damping", type=float, default=0.02)
    parser.add_argument("--gguf", metavar="TYPE", help="also write GGUF files of this type (f32, q8_0, ...)")
    args = parser.parse_args(argv)
    target, draft = ensure_pair(args.family, args.size, args.draft_layers, args.damping)
    print(target)
    print(draft)
    if args.gguf:
        for path in ensure_pair_gguf(args.family, args.size, args.draft_layers, args.damping, args.gguf):
            print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
