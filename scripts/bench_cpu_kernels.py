#!/usr/bin/env python3
"""The two CPU kernel fixes, measured: OpenBLAS's kernel choice and the attention path.

1. float32 matmul GFLOP/s with the OpenBLAS kernels the backend picks from the CPU flags,
   against the kernels OpenBLAS picks unaided (library loaded directly, ``OPENBLAS_CORETYPE``
   unset) and against ``Prescott`` (SSE3) forced, each in a fresh process (the choice is made when
   the library loads).
2. Attention per layer of the small llama (12 query heads, 4 KV heads, head dim 64):
   ``mx.fast.scaled_dot_product_attention`` against ``model/attention.py``'s CPU path, for decode
   and prompt shapes; median of ``--reps`` timings, alternating.

Examples::

    python scripts/bench_cpu_kernels.py
    python scripts/bench_cpu_kernels.py --reps 15
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MATMUL_CHILD = """
import ctypes, json, sys, time
from mlxcel_compat import backend
if sys.argv[1] == "backend":
    kernels = backend.load_optimized_blas().kernels
else:  # the library loaded directly: OpenBLAS picks its kernels unaided (or as OPENBLAS_CORETYPE says)
    path = next(p for p in backend._candidates() if "openblas" in p)
    kernels = backend._openblas_corename(ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL))
import mlx.core as mx
out = {"kernels": kernels}
for m, k, n in ((128, 768, 2048), (1024, 768, 2048)):
    a, b = mx.random.normal((m, k)), mx.random.normal((k, n))
    mx.eval(a, b, a @ b)
    times = []
    for _ in range(7):
        t = time.perf_counter(); mx.eval(a @ b); times.append(time.perf_counter() - t)
    out[f"{m}x{k}x{n}"] = 2 * m * k * n / sorted(times)[3] / 1e9
print(json.dumps(out))
"""

SHAPES = ((1, 1, 4096), (8, 1, 4096), (1, 74, 2122), (1, 128, 128), (1, 512, 2560))  # (B, L queries, S keys)


def matmul_in_fresh_process(loader: str, coretype: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    if coretype is not None:
        env["OPENBLAS_CORETYPE"] = coretype
    cmd = [sys.executable, "-c", MATMUL_CHILD, loader]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    args = ap.parse_args(argv)
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}\n")

    from mlxcel_compat.backend import _cpu_flags, openblas_kernels_for_cpu

    if openblas_kernels_for_cpu(_cpu_flags()) is None:
        print("(no AVX2/AVX-512 flags: the backend leaves the kernel choice to OpenBLAS)")
    print("| OpenBLAS kernels | how | 128x768x2048 GFLOP/s | 1024x768x2048 GFLOP/s |")
    print("|---|---|---:|---:|")
    runs = (("the backend (from the CPU flags)", "backend", None), ("OpenBLAS unaided", "direct", None), ("forced", "direct", "Prescott"))
    for how, loader, coretype in runs:
        r = matmul_in_fresh_process(loader, coretype)
        print(f"| {r['kernels']} | {how} | {r['128x768x2048']:.0f} | {r['1024x768x2048']:.0f} |", flush=True)

    from mlxcel_compat.backend import load_optimized_blas

    load_optimized_blas()
    import mlx.core as mx

    from mlxcel_compat.model.attention import cpu_attention

    def timed(fn) -> float:
        mx.eval(fn())
        t = time.perf_counter()
        mx.eval(fn())
        return time.perf_counter() - t

    print("\n| B | queries | keys | mx.fast ms | CPU path ms | speed-up | max rel. difference |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for b, length, keys in SHAPES:
        q, k, v = mx.random.normal((b, 12, length, 64)), mx.random.normal((b, 4, keys, 64)), mx.random.normal((b, 4, keys, 64))
        mask = "causal" if length > 1 else None
        fast = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)  # noqa: E731
        ours = lambda: cpu_attention(q, k, v, 0.125, mask)  # noqa: E731
        a, o = [], []
        for _ in range(args.reps):
            a.append(timed(fast))
            o.append(timed(ours))
        ta, to = statistics.median(a) * 1000, statistics.median(o) * 1000
        diff = (mx.abs(fast() - ours()).max() / mx.abs(fast()).max()).item()
        print(f"| {b} | {length} | {keys} | {ta:.2f} | {to:.2f} | {ta / to:.2f} | {diff:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
