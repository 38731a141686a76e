#!/usr/bin/env python3
"""Which path multiplies a quantized weight by a prompt chunk fastest: measured on the same blocks.

A prompt chunk of a weight in ggml's blocks can go three ways (``runtime/block_weight.py``):
float32 tiles expanded by ggml's ``to_float`` and multiplied by the BLAS's sgemm (``tiles``),
ggml's own ``mul_mat`` on the stored blocks (``ggml``: ``ggml_repack.PromptProduct``, ggml 0.25's
tiled int8 kernels for the K-quants), or ggml's repacked copy and its GEMM (``repacked``, where
ggml has a layout for the type), and where the shim's lane kernels take the type's prompt chunks
on a CPU with AVX-512 VNNI (``own``: ``BlockLibrary.lane_prompts``, what the server runs there:
Q8_0's over its blocks, Q4_1, Q5_0, Q5_1 and MXFP4's over the rows split at load). This runs them on one weight per type,
side by side, ``--reps`` rounds in rotating order, and prints medians, the ratio tiles / ggml
(above 1: ggml's mul_mat is faster), which is how ``ggml_repack.PROMPT_TYPES`` was chosen, and
ggml / own.

    .venv/bin/python scripts/bench_prompt_products.py
    .venv/bin/python scripts/bench_prompt_products.py --n 11008 --k 4096 --rows 512 --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlxcel_compat.runtime import backend  # noqa: E402

backend.load_optimized_blas()  # before NumPy's first product and MLX

import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from mlxcel_compat.runtime import block_weight, ggml_cpu, ggml_repack  # noqa: E402

TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0", "Q4_0", "Q4_1", "MXFP4", "IQ4_NL", "IQ4_XS",
         "IQ3_S", "IQ3_XXS", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--n", type=int, default=2048, help="weight rows (outputs)")
    parser.add_argument("--k", type=int, default=768, help="weight columns (inputs)")
    parser.add_argument("--rows", type=int, default=1024, help="activation rows (the prompt chunk)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    lib, kernels, repack_lib = block_weight.library(), ggml_cpu.kernels(), ggml_repack.library()
    for missing in (lib, kernels, repack_lib):
        if isinstance(missing, str):
            print(f"error: {missing}", file=sys.stderr)
            return 1
    rng = np.random.default_rng(0)
    values = rng.standard_normal((args.n, args.k), dtype=np.float32) / np.sqrt(args.k)
    x = rng.standard_normal((args.rows, args.k), dtype=np.float32)
    print(f"ggml {kernels.version} ({kernels.directory}); weight {args.n} x {args.k}, {args.rows} rows, "
          f"{args.reps} rounds, medians in ms")
    print(f"{'type':6s} {'tiles':>8s} {'ggml':>8s} {'repacked':>9s} {'own':>8s} {'tiles/ggml':>11s} {'ggml/own':>9s}")
    for name in args.types.split(","):
        ggml_type = int(T[name])
        # A uniform importance matrix where ggml's quantizer needs one (as the test factory's files)
        importance = np.ones(args.k, dtype=np.float32) if kernels.needs_importance(ggml_type) else None
        blocks = kernels.quantize(ggml_type, values, importance)
        weights = {"tiles": block_weight.BlockWeight(blocks, ggml_type, args.n, args.k, lib),
                   "ggml": block_weight.BlockWeight(blocks, ggml_type, args.n, args.k, lib)}
        weights["ggml"].prompt = ggml_repack.PromptProduct(
            repack_lib.plain_new(ggml_type, blocks.ctypes.data, args.n, args.k), blocks, repack_lib)
        repacked = ggml_repack.repack(blocks, ggml_type, args.n, args.k)
        if repacked is not None:
            weights["repacked"] = block_weight.BlockWeight(blocks, ggml_type, args.n, args.k, lib, repacked=repacked)
        if ggml_type in lib.lane_prompts:  # the plain weight's prompt path; "tiles" is forced below
            weights["own"] = block_weight.BlockWeight(blocks, ggml_type, args.n, args.k, lib)
        elif block_weight.SPLIT_TYPE_BASE + ggml_type in lib.lane_prompts:  # the rows split at load, their lanes
            weights["own"] = block_weight.BlockWeight(blocks.copy(), ggml_type, args.n, args.k, lib)
            block_weight.split_rows(weights["own"])
        kind = lib.block_type(ggml_type)
        times: dict[str, list[float]] = {key: [] for key in weights}
        order = list(weights)
        for rep in range(args.reps + 1):  # the first round warms up, unrecorded
            for key in order[rep % len(order):] + order[:rep % len(order)]:
                kind.own_kernel = -1 if key == "tiles" else (ggml_type if ggml_type in lib.own_kernels else -1)
                start = time.perf_counter()
                weights[key].matmul(x, tiles=True)
                if rep:
                    times[key].append(time.perf_counter() - start)
        kind.own_kernel = ggml_type if ggml_type in lib.own_kernels else -1
        ms = {key: statistics.median(t) * 1e3 for key, t in times.items()}
        packed = f"{ms['repacked']:9.1f}" if "repacked" in ms else f"{'-':>9s}"
        own = f"{ms['own']:8.1f}" if "own" in ms else f"{'-':>8s}"
        own_ratio = f"{ms['ggml'] / ms['own']:8.2f}x" if "own" in ms else f"{'-':>9s}"
        print(f"{name:6s} {ms['tiles']:8.1f} {ms['ggml']:8.1f} {packed} {own} {ms['tiles'] / ms['ggml']:10.2f}x {own_ratio}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
