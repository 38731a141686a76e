#!/usr/bin/env python3
"""Weights with their rows grouped at load (``block_weight.group_rows``: Q4_K, Q6_K, Q8_0, Q4_1,
Q5_0, Q5_1) against the same blocks stored apart (Q4_1, Q5_0 and Q5_1: split at load, as the
loader served them before): decode rows against the own kernel (the two-row path and the lanes over
rows stored apart), and prompt chunks against what a weight stored apart takes (ggml's ``mul_mat``
for the K-quants, the lanes over rows stored apart or split for the others).

Why: grouped, the lanes read 16 rows' super-blocks front to back with no transposes, and take
every product of the weight; this measures what that gains, side by side, rounds alternating,
on all of the shim's threads as in a server, minimums of wall-clock milliseconds a
product. Every row of the grouped product is checked to be the same bits as stored apart.

    .venv/bin/python scripts/bench_grouped_rows.py --types Q4_K,Q6_K --shapes 768x2048,2048x768,4096x11008 \
        --rows 1,2,4,8,16 --prompt-rows 16,64,256
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlxcel_compat.runtime import backend  # noqa: E402

backend.load_optimized_blas()  # before NumPy and MLX

import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from mlxcel_compat.runtime import block_weight, ggml_cpu, ggml_repack  # noqa: E402
from benchlib import best_ms  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_K,Q6_K")
    parser.add_argument("--shapes", default="768x2048,2048x768,4096x11008", help="comma list of KxN (inputs x outputs)")
    parser.add_argument("--rows", default="1,2,4,8,16", help="decode rows (activation rows of one call)")
    parser.add_argument("--prompt-rows", default="16,64,256", help="prompt chunk rows")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    lib, kernels = block_weight.library(), ggml_cpu.kernels()
    types = [T[name] for name in args.types.split(",")]
    if isinstance(lib, str) or isinstance(kernels, str) or any(int(t) not in lib.grouped_kinds for t in types):
        print("error: no grouped kernel here for these types (needs AVX-512 VNNI and the shim)", file=sys.stderr)
        return 1
    rng = np.random.default_rng(0)
    print("| type | shape | rows | kind | stored apart (ms) | grouped (ms) | apart / grouped |")
    print("|---|---|---:|---|---:|---:|---:|")
    for qtype, shape in ((t, shape) for t in types for shape in args.shapes.split(",")):
        k, n = (int(v) for v in shape.split("x"))
        blocks = kernels.quantize(int(qtype), rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k))
        apart = block_weight.BlockWeight(blocks.copy(), qtype, n, k, lib)
        block_weight.split_rows(apart)  # the split types as served before grouping
        prompts = block_weight.BlockWeight(blocks.copy(), qtype, n, k, lib)
        by_ggml = ggml_repack.prompt_product(prompts)
        if not by_ggml:
            prompts = apart
        grouped = block_weight.BlockWeight(blocks.copy(), qtype, n, k, lib)
        assert block_weight.group_rows(grouped)
        for rows in (int(r) for r in args.rows.split(",")):
            x = rng.standard_normal((rows, k), dtype=np.float32)
            assert np.array_equal(apart.matmul(x, tiles=False), grouped.matmul(x, tiles=False))
            a = best_ms(lambda: apart.matmul(x, tiles=False), args.reps)
            g = best_ms(lambda: grouped.matmul(x, tiles=False), args.reps)
            print(f"| {qtype.name} | {shape} | {rows} | decode rows (own kernel) | {a:.3f} | {g:.3f} | {a / g:.2f}x |", flush=True)
        for rows in (int(r) for r in args.prompt_rows.split(",")):
            x = rng.standard_normal((rows, k), dtype=np.float32)
            a = best_ms(lambda: prompts.matmul(x, tiles=True), args.reps)
            g = best_ms(lambda: grouped.matmul(x, tiles=True), args.reps)
            what = "ggml's mul_mat" if by_ggml else "the lanes over rows apart"
            print(f"| {qtype.name} | {shape} | {rows} | prompt chunk ({what}) | {a:.3f} | {g:.3f} | {a / g:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
