#!/usr/bin/env python3
"""This checkout's own decode-row kernels against another checkout's, in one process, calls alternating.

Why: on the shared machine two benchmark runs minutes apart differ by tens of percent (the
neighbours' load and memory traffic), more than a kernel change moves a one-row product. Here
both checkouts' compiled libraries are loaded side by side (the other one built by its own
``blas_shim.py``, loaded locally: this process's shim stays the one its products see) and their
``mlxcel_rows_kernel`` for a type is called on the same weight and the same activations, rounds
alternating which goes first, on the calling thread (one thread: no pool), timed by the
process's CPU clock (minimum over ``--reps``), so the neighbours fall on both alike.

The weight is ggml's blocks of random values (``ggml_cpu.quantize``); a type whose rows the
loader splits (``block_weight.split_rows``: Q4_1, Q5_0, Q5_1) is split by this checkout, and the
other checkout's kernel reads the same split bytes, so both must agree on that layout: each
product is checked against this checkout's (relative 1e-5 of the largest value) before it is
timed. The activations are ggml's blocks of the type's ``vec_dot_type`` (its ``from_float``).
Columns: microseconds a product for each side and other / this (above 1: this checkout is faster).

    .venv/bin/python scripts/bench_rows_against.py /work/main --types Q5_0,Q5_1,Q4_1 \
        --shapes 4096x11008,11008x4096 --rows 1,8 --reps 10
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlxcel_compat.runtime import backend  # noqa: E402

backend.load_optimized_blas(threads=1)  # before NumPy and MLX

import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from mlxcel_compat.runtime import block_weight, ggml_cpu  # noqa: E402
from mlxcel_compat.runtime.native import blas_shim  # noqa: E402

ROWS_FN = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p,
                           ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t)
QUANTIZE_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)


def rows_kernels(library: Path) -> ctypes.CDLL:
    """A compiled shim loaded locally, its ``mlxcel_rows_kernel`` typed."""
    lib = ctypes.CDLL(str(library))
    lib.mlxcel_rows_kernel.restype, lib.mlxcel_rows_kernel.argtypes = ctypes.c_void_p, [ctypes.c_int]
    return lib


def checkout_library(root: Path) -> Path:
    """The other checkout's shim, built by its own ``blas_shim.py`` (from its sources)."""
    spec = importlib.util.spec_from_file_location("other_blas_shim", root / "mlxcel_compat/runtime/native/blas_shim.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    built = module.build()
    if built.path is None:
        raise SystemExit(f"error: {root}'s shim: {built.reason}")
    return built.path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("other", type=Path, help="the other checkout's root (e.g. /work/main)")
    parser.add_argument("--types", default="Q5_0,Q5_1,Q4_1")
    parser.add_argument("--shapes", default="4096x11008,11008x4096", help="comma list of KxN (inputs x outputs)")
    parser.add_argument("--rows", default="1,8", help="activation rows")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    lib, kernels = block_weight.library(), ggml_cpu.kernels()
    for missing in (lib, kernels):
        if isinstance(missing, str):
            print(f"error: {missing}", file=sys.stderr)
            return 1
    this_build = blas_shim.build()
    other_build = checkout_library(args.other)
    sides = {"this": rows_kernels(this_build.path), "other": rows_kernels(other_build)}
    rng = np.random.default_rng(0)
    print(f"this: {this_build.path.name}; other ({args.other}): {other_build.name}; "
          f"minimums of CPU microseconds a product over {args.reps} rounds, one thread")
    print(f"{'type':6s} {'k x n':>12s} {'rows':>4s} {'this':>9s} {'other':>9s} {'other/this':>10s}")
    for name in args.types.split(","):
        ggml_type = int(T[name])
        split = ggml_type in lib.split_kinds
        code = block_weight.SPLIT_TYPE_BASE + ggml_type if split else ggml_type
        fns = {side: lib_.mlxcel_rows_kernel(code) for side, lib_ in sides.items()}
        if not all(fns.values()):
            print(f"{name}: no own kernel in {', '.join(side for side, fn in fns.items() if not fn)}")
            continue
        fns = {side: ROWS_FN(fn) for side, fn in fns.items()}
        kind = kernels.block_type(ggml_type)
        quantize = QUANTIZE_FN(kind.quantize)
        for shape in args.shapes.split(","):
            k, n = (int(v) for v in shape.split("x"))
            values = rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)
            weight = block_weight.BlockWeight(kernels.quantize(ggml_type, values), ggml_type, n, k, lib)
            if split:
                assert block_weight.split_rows(weight)
            data = np.ascontiguousarray(weight.data)
            row_bytes = data.nbytes // n
            for rows in (int(r) for r in args.rows.split(",")):
                x = rng.standard_normal((rows, k), dtype=np.float32)
                act_bytes = k // kind.act_block * kind.act_block_bytes
                act = np.empty((rows, act_bytes), np.uint8)
                for i in range(rows):
                    quantize(x[i].ctypes.data, act[i].ctypes.data, k)
                outs = {side: np.empty((rows, n), np.float32) for side in fns}

                def call(side: str) -> None:
                    fns[side](k, data.ctypes.data, row_bytes, n, act.ctypes.data, act_bytes, rows,
                              outs[side].ctypes.data, n)

                times: dict[str, list[float]] = {side: [] for side in fns}
                order = list(fns)
                for rep in range(args.reps + 1):  # the first round warms up, unrecorded
                    for side in order[rep % 2:] + order[:rep % 2]:
                        start = time.process_time()
                        call(side)
                        if rep:
                            times[side].append(time.process_time() - start)
                scale = np.abs(outs["this"]).max()
                if np.abs(outs["other"] - outs["this"]).max() > 1e-5 * scale:
                    print(f"error: {name} {shape}: the other checkout's product differs (another split layout?)")
                    return 1
                us = {side: min(t) * 1e6 for side, t in times.items()}
                print(f"{name:6s} {shape:>12s} {rows:4d} {us['this']:9.1f} {us['other']:9.1f} "
                      f"{us['other'] / us['this']:9.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
