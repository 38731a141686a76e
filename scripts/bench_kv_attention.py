#!/usr/bin/env python3
"""One layer's decode-step attention by KV storage type (-ctk/-ctv): the shim's kernel on the same
positions, side by side.

``mlxcel_decode_attention_at`` (``runtime/native/attention.c``) over a cache of ``--depth``
positions stored as float32, f16, q8_0 and q4_0, the types rotating every round, minimum
milliseconds of ``--reps`` rounds, and each type's time over f16's (llama-server's default). The
rows hold random bytes of the type: the kernel's work does not depend on the values. Why: the q8_0
and q4_0 steps' scores (``kv_rows.h: kv_block_scores``) are a choice of arithmetic and of kernel,
and long-context decode is where their cost shows.

    .venv/bin/python scripts/bench_kv_attention.py
    .venv/bin/python scripts/bench_kv_attention.py --depth 4096 --kv-heads 8 --group 4 --head-dim 128
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlxcel_compat.runtime import backend  # noqa: E402

backend.load_optimized_blas()

from tests.runtime.step_checks import address, attention_lib  # noqa: E402

# name -> (the kernel's type code, bytes a row of d values takes)
TYPES = {
    "f32": (0, lambda d: d * 4),
    "f16": (1, lambda d: d * 2),
    "q8_0": (3, lambda d: d // 32 * 34),
    "q4_0": (4, lambda d: d // 32 * 18),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depth", type=int, default=16384, help="positions in the cache")
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--group", type=int, default=3, help="query heads per KV head")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    lib = attention_lib()
    h, g, d, n = args.kv_heads, args.group, args.head_dim, args.depth
    rng = np.random.default_rng(0)
    q = rng.standard_normal(h * g * d).astype(np.float32)
    k_new = rng.standard_normal(h * d).astype(np.float32)
    v_new = rng.standard_normal(h * d).astype(np.float32)
    out = np.empty(h * g * d, np.float32)
    caches = {}
    for name, (code, width) in TYPES.items():
        # bytes below 0x60 keep every f16/f32 pattern finite and every block scale small
        keys = rng.integers(0, 0x60, (h, n + 1, width(d)), dtype=np.uint8)
        caches[name] = (code, keys, rng.integers(0, 0x60, keys.shape, dtype=np.uint8))
    best = {name: float("inf") for name in TYPES}
    names = list(TYPES)
    for rep in range(args.reps):
        for name in names[rep % len(names):] + names[: rep % len(names)]:
            code, keys, values = caches[name]
            t = time.perf_counter()
            lib.mlxcel_decode_attention_at(address(q), address(k_new), address(v_new), address(keys), address(values),
                                           address(out), h, g, d, n - 1, n, n + 1, 0.18, code, code)
            best[name] = min(best[name], time.perf_counter() - t)
    print(f"one layer's step: {h} KV heads x {g} queries, head size {d}, {n} positions; minimum of {args.reps}")
    print("| type | ms | over f16 |")
    print("|---|---|---|")
    for name in TYPES:
        print(f"| {name} | {best[name] * 1e3:.2f} | {best[name] / best['f16']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
