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

The pieces: ``families.py`` (the family table and configs), ``weights.py`` (the seeded weights),
``model_directory.py`` (a directory written, cached and quantized: ``ensure_model``,
``build_model``), ``gguf_writer.py`` (GGUF files). This module is their command line, and
:func:`describe`.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

from .families import FAMILY_SPECS, SIZES, family_spec, model_config
from .model_directory import Quantization, build_model
from .weights import instantiate, stored_shapes


def describe(family: str, size: str) -> dict[str, Any]:
    """A summary of the pair without building it: config, parameter count, cache layout."""
    spec = family_spec(family, size)
    config = model_config(family, size)
    model = instantiate(config)
    shapes = stored_shapes(model, config)
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
    parser.add_argument("--family", help=f"one of: {', '.join(FAMILY_SPECS)}")
    parser.add_argument("--size", default="tiny", help=f"one of: {', '.join(SIZES)} (default tiny)")
    parser.add_argument("--out", help="output directory (replaced if it holds a previous build), or the .gguf file")
    parser.add_argument("--format", choices=("hf", "gguf"), default="hf",
                        help="hf: a Hugging Face directory (default); gguf: one GGUF file")
    parser.add_argument("--gguf-type", default="f32",
                        help="matrix type of a GGUF (default f32): f32, f16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, "
                             "q3_k, q4_k, q5_k, q6_k, mxfp4, iq4_nl, iq4_xs, iq3_s, iq3_xxs, iq2_s, iq2_xs, "
                             "iq2_xxs, iq1_m, iq1_s, or llama-quantize's q4_k_m / q5_k_m mixes")
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
        print("\n".join(FAMILY_SPECS))
        return 0
    if args.family is None or args.out is None:
        parser.error("--family and --out are required (or use --list)")
    try:
        family_spec(args.family, args.size)
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
