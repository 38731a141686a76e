#!/usr/bin/env python3
"""Decode rows of a quantized weight: this project's own kernels (mlxcel_rows_kernel) against ggml's vec_dot.

A decode step multiplies each weight by one activation row per sequence (``block_matmul.c``'s
few-rows path, on the shim's threads). For Q4_K and Q6_K the shim has its own AVX-512 kernels
(``block_weight.BlockLibrary.own_kernels``); with ``own_kernel`` cleared the same call runs ggml's
``vec_dot`` per pair of rows, which ``MLXCEL_OWN_KERNELS=0`` gives a server. This runs both on the
same blocks, side by side, ``--reps`` rounds in alternating order, for each type, shape and row
count, and prints medians (microseconds a product) and the ratio ggml / own (above 1: the own
kernel is faster). Where ggml has a repacked layout for the type (Q4_K: llama-server's decode
path, its 8-row GEMV), that runs too, one product per activation row as the runtime would call
it, and its ratio to the own kernel is printed. Q4_1, Q5_0 and Q5_1 have own kernels over rows
the loader rearranges: those run over the copy the loader serves a linear weight from (rows
grouped, ``block_weight.group_rows``, where the weight is whole groups of 16 rows, else split,
``block_weight.split_rows``), against ggml's vec_dot over the blocks as stored; Q4_K's, Q6_K's
and Q8_0's own kernels run over rows grouped as the loader groups them
(``scripts/bench_grouped_rows.py`` compares grouped rows with rows stored apart). So does MXFP4 (gpt-oss's experts), which ggml also repacks
(llama-server's decode path): its repacked GEMV runs too; IQ4_NL has no own kernel: its repacked GEMV runs against vec_dot. Every shape runs
on all of the shim's threads, as in a server (``--threads`` sets their count).

The last column, ``own/1``, is the own kernel's time at this row count over its time for one
row of the same shape: what several sequences (batched decode, speculative drafts) pay for
sharing one read and one unpacking of the weight. On a machine busy with other work, wall-clock
medians swing with the neighbours; ``--clock cpu --threads 1`` times the CPU seconds of the
process instead (minimum over the rounds), which the neighbours disturb far less.

``--floor`` adds the column ``mul/1``: the time this core needs for the rows' integer multiplies
alone (k x n x rows products, 64 a 512-bit ``vpdpbusd``, at the rate a loop of independent
``vpdpbusd`` measures on this core first) over the own kernel's one-row time. That is a lower
bound on ``own/1`` that no kernel on 8-bit products can pass: a 4-bit weight times an 8-bit
activation is one lane of ``vpdpbusd``, the densest integer multiply of an AVX-512 VNNI core, and
each activation row needs all of its products (each row's own scales and sums come on top). One
row of a quantized weight streams from memory, so its time is the weight's bytes over the memory
rate, while the multiplies grow with the rows: where ``mul/1`` at 8 rows is near 2.0, issue 51's
"8 rows at most 2x one row" leaves nothing for unpacking, scales and sums.

    .venv/bin/python scripts/bench_quant_rows.py
    .venv/bin/python scripts/bench_quant_rows.py --shapes 4096x11008,11008x4096 --rows 1,4 --reps 20
    .venv/bin/python scripts/bench_quant_rows.py --types Q4_K,Q6_K,Q8_0,Q4_1,Q5_0,Q5_1 \
        --shapes 4096x11008,11008x4096 --rows 1,2,4,8,16 --reps 10 --clock cpu --threads 1
    .venv/bin/python scripts/bench_quant_rows.py --types Q4_K,Q4_1 --shapes 4096x11008 --rows 1,4,8 \
        --reps 10 --clock cpu --threads 1 --floor
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlxcel_compat.runtime import backend  # noqa: E402


def early_flag(name: str) -> str | None:
    """A flag's value read before argparse runs: the BLAS loads before NumPy's first product."""
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv[:-1] else None


backend.load_optimized_blas(threads=int(early_flag("--threads") or 0) or None)  # before NumPy and MLX

import numpy as np  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from mlxcel_compat.runtime import block_weight, ggml_cpu, ggml_repack  # noqa: E402
from mlxcel_compat.runtime.native import blas_shim  # noqa: E402

# (inputs k, outputs n): the small llama's q/o and gate/up and down projections, Llama-2-7B's
# q/o, gate/up and down.
SHAPES = "768x768,768x2048,2048x768,4096x4096,4096x11008,11008x4096"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_K,Q6_K,Q8_0,Q4_1,Q5_0,Q5_1,MXFP4,IQ4_NL")
    parser.add_argument("--shapes", default=SHAPES, help="comma list of KxN (inputs x outputs)")
    parser.add_argument("--rows", default="1,4", help="activation rows (sequences decoding together)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="the shim's threads (default: as a server)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: medians of wall-clock time; cpu: minimums of the process's CPU time")
    parser.add_argument("--floor", action="store_true",
                        help="add mul/1: the rows' 8-bit multiplies alone at this core's vpdpbusd rate, over one row")
    args = parser.parse_args()
    global clock, summary, multiplies_per_us
    clock, summary = (time.perf_counter, statistics.median) if args.clock == "wall" else (time.process_time, min)
    if args.floor:
        rate = vpdpbusd_rate()
        if isinstance(rate, str):
            print(f"error: --floor: {rate}", file=sys.stderr)
            return 1
        multiplies_per_us = rate * 64 / 1e6
        print(f"this core: {rate / 1e9:.2f} G 512-bit vpdpbusd a second ({multiplies_per_us / 1e3:.0f} K 8-bit products a µs)")
    lib, kernels = block_weight.library(), ggml_cpu.kernels()
    for missing in (lib, kernels):
        if isinstance(missing, str):
            print(f"error: {missing}", file=sys.stderr)
            return 1
    rng = np.random.default_rng(0)
    print(f"ggml {kernels.version}; own kernels for {', '.join(T(t).name for t in sorted(lib.own_kernels)) or 'none'}; "
          f"{args.reps} rounds, {'medians of wall' if args.clock == 'wall' else 'minimums of CPU'} "
          f"microseconds a product")
    print(f"{'type':6s} {'k x n':>12s} {'rows':>4s} {'ggml':>9s} {'own':>9s} {'ggml/own':>9s} {'repacked':>9s} {'rep/own':>8s} {'own/1':>6s}"
          + (f" {'mul/1':>6s}" if args.floor else ""))
    for name in args.types.split(","):
        ggml_type = int(T[name])
        if ggml_type in lib.split_kinds:
            split_rows_against_ggml(lib, kernels, name, ggml_type, args, rng)
            continue
        if ggml_type not in lib.own_kernels:
            if ggml_type in ggml_repack.REPACKED_TYPES:
                repacked_against_ggml(lib, kernels, name, ggml_type, args, rng)
            else:
                print(f"{name}: no own kernel on this CPU")
            continue
        kind = lib.block_type(ggml_type)
        for shape in args.shapes.split(","):
            k, n = (int(v) for v in shape.split("x"))
            values = rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)
            blocks = kernels.quantize(ggml_type, values)
            plain = block_weight.BlockWeight(blocks, ggml_type, n, k, lib)  # ggml's vec_dot reads it
            weight = block_weight.BlockWeight(blocks.copy(), ggml_type, n, k, lib)
            block_weight.group_rows(weight)  # as the loader serves a linear weight (Q4_K, Q6_K, Q8_0)
            packed = ggml_repack.repack(blocks, ggml_type, n, k) if ggml_type in ggml_repack.REPACKED_TYPES else None
            repacked = block_weight.BlockWeight(blocks, ggml_type, n, k, lib, repacked=packed) if packed else None
            one_row = None
            for rows in (int(r) for r in args.rows.split(",")):
                x = rng.standard_normal((rows, k), dtype=np.float32)
                out = np.empty((rows, n), np.float32)
                times: dict[int, list[float]] = {ggml_type: [], -1: [], -2: []}
                ways = [ggml_type, -1] + ([-2] if repacked is not None else [])
                for rep in range(args.reps + 1):  # the first round warms up, unrecorded
                    for way in ways[rep % len(ways):] + ways[:rep % len(ways)]:
                        kind.own_kernel = ggml_type if way == -2 else way
                        start = clock()
                        (repacked if way == -2 else plain if way == -1 else weight).matmul(x, out=out, tiles=False)
                        if rep:
                            times[way].append(clock() - start)
                kind.own_kernel = ggml_type
                us = {key: summary(t) * 1e6 for key, t in times.items() if t}
                rep_text = f"{us[-2]:9.1f} {us[-2] / us[ggml_type]:7.2f}x" if -2 in us else f"{'-':>9s} {'-':>8s}"
                one_row = us[ggml_type] if rows == 1 else one_row
                print(f"{name:6s} {shape:>12s} {rows:4d} {us[-1]:9.1f} {us[ggml_type]:9.1f} {us[-1] / us[ggml_type]:8.2f}x "
                      f"{rep_text} {per_row(us[ggml_type], one_row)}{floor(k * n * rows, one_row)}")
    return 0


clock, summary = time.perf_counter, statistics.median  # --clock
multiplies_per_us = 0.0  # --floor: this core's 8-bit products a microsecond, by vpdpbusd


def per_row(us: float, one_row: float | None) -> str:
    """The own kernel's time over its one-row time (the own/1 column), where one row was timed."""
    return f"{us / one_row:5.2f}x" if one_row else f"{'-':>6s}"


def floor(products: int, one_row: float | None) -> str:
    """The mul/1 column (--floor): ``products`` 8-bit multiplies at this core's rate, over the
    own kernel's one-row time."""
    if not multiplies_per_us:
        return ""
    return f" {products / multiplies_per_us / one_row:5.2f}x" if one_row else f" {'-':>6s}"


# Ten independent chains of vpdpbusd on registers (its latency is several cycles, one chain would
# time that instead), timed in the thread's CPU time; the best of five runs.
RATE_SOURCE = r"""
#include <immintrin.h>
#include <time.h>
#define STEP(a) a = _mm512_dpbusd_epi32(a, x, y)
volatile int kept; /* the chains' sum: the loop is not optimized away */
double vpdpbusd_per_second(long n) {
    __m512i x = _mm512_set1_epi32(0x01010101), y = _mm512_set1_epi32(0x02020202);
    __m512i a0 = _mm512_set1_epi32(0), a1 = _mm512_set1_epi32(1), a2 = _mm512_set1_epi32(2), a3 = _mm512_set1_epi32(3),
            a4 = _mm512_set1_epi32(4), a5 = _mm512_set1_epi32(5), a6 = _mm512_set1_epi32(6), a7 = _mm512_set1_epi32(7),
            a8 = _mm512_set1_epi32(8), a9 = _mm512_set1_epi32(9);
    double best = 0;
    for (int run = 0; run < 5; run++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t0);
        for (long i = 0; i < n; i++) {
            STEP(a0); STEP(a1); STEP(a2); STEP(a3); STEP(a4); STEP(a5); STEP(a6); STEP(a7); STEP(a8); STEP(a9);
        }
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t1);
        double rate = 10.0 * n / ((t1.tv_sec - t0.tv_sec) + 1e-9 * (t1.tv_nsec - t0.tv_nsec));
        best = rate > best ? rate : best;
    }
    __m512i sum = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                                   _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
    sum = _mm512_add_epi32(sum, _mm512_add_epi32(a8, a9));
    kept = _mm512_reduce_add_epi32(sum);
    return best;
}
"""


def vpdpbusd_rate() -> float | str:
    """This core's 512-bit vpdpbusd a second, or why it could not be measured."""
    compiler = blas_shim.find_compiler()
    if compiler is None:
        return "no C compiler"
    with tempfile.TemporaryDirectory() as tmp:
        source, library = Path(tmp) / "rate.c", Path(tmp) / "rate.so"
        source.write_text(RATE_SOURCE)
        built = subprocess.run([compiler, "-O2", "-march=native", "-shared", "-fPIC", "-o", str(library), str(source)],
                               capture_output=True, text=True)
        if built.returncode:
            return f"this CPU or compiler has no AVX-512 VNNI ({built.stderr.strip().splitlines()[-1:]})"
        measure = ctypes.CDLL(str(library)).vpdpbusd_per_second
        measure.restype, measure.argtypes = ctypes.c_double, [ctypes.c_long]
        return measure(20_000_000)


def repacked_against_ggml(lib, kernels, name: str, ggml_type: int, args: argparse.Namespace,
                          rng: np.random.Generator) -> None:
    """A type with no own kernel that ggml repacks (MXFP4, IQ4_NL): ggml's repacked GEMV, one
    product per activation row as the runtime calls it, against its vec_dot over the blocks as
    stored, rounds alternating; the ratio is vec_dot / repacked (above 1: repacking pays)."""
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        values = rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)
        importance = np.ones(k, dtype=np.float32) if kernels.needs_importance(ggml_type) else None
        blocks = kernels.quantize(ggml_type, values, importance)
        plain = block_weight.BlockWeight(blocks, ggml_type, n, k, lib)
        repacked = block_weight.BlockWeight(blocks, ggml_type, n, k, lib, repacked=ggml_repack.repack(blocks, ggml_type, n, k))
        if repacked.repacked is None:
            print(f"{name}: ggml has no repacked layout for {shape} here")
            continue
        for rows in (int(r) for r in args.rows.split(",")):
            x = rng.standard_normal((rows, k), dtype=np.float32)
            out = np.empty((rows, n), np.float32)
            times: dict[str, list[float]] = {"ggml": [], "repacked": []}
            for rep in range(args.reps + 1):
                pairs = (("ggml", plain), ("repacked", repacked))
                for key, weight in (pairs if rep % 2 else pairs[::-1]):
                    start = clock()
                    weight.matmul(x, out=out, tiles=False)
                    if rep:
                        times[key].append(clock() - start)
            us = {key: summary(t) * 1e6 for key, t in times.items()}
            print(f"{name:6s} {shape:>12s} {rows:4d} {us['ggml']:9.1f} {'-':>9s} {'-':>9s} {us['repacked']:9.1f} "
                  f"{us['ggml'] / us['repacked']:7.2f}x (ggml / repacked)")


def split_rows_against_ggml(lib, kernels, name: str, ggml_type: int, args: argparse.Namespace,
                            rng: np.random.Generator) -> None:
    """A type whose rows the loader groups or splits (``block_weight.group_rows``, ``split_rows``):
    the own kernel over the rearranged copy against ggml's vec_dot over the same blocks as stored,
    rounds alternating, and against ggml's repacked GEMV where ggml repacks the type (MXFP4:
    llama-server's decode path)."""
    for shape in args.shapes.split(","):
        k, n = (int(v) for v in shape.split("x"))
        values = rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)
        blocks = kernels.quantize(ggml_type, values)
        plain = block_weight.BlockWeight(blocks, ggml_type, n, k, lib)
        split = block_weight.BlockWeight(blocks.copy(), ggml_type, n, k, lib)
        block_weight.group_rows(split) or block_weight.split_rows(split)  # as the loader serves a linear weight
        packed = ggml_repack.repack(blocks, ggml_type, n, k) if ggml_type in ggml_repack.REPACKED_TYPES else None
        ways = [("ggml", plain), ("own", split)]
        if packed:
            ways.append(("repacked", block_weight.BlockWeight(blocks, ggml_type, n, k, lib, repacked=packed)))
        one_row = None
        for rows in (int(r) for r in args.rows.split(",")):
            x = rng.standard_normal((rows, k), dtype=np.float32)
            out = np.empty((rows, n), np.float32)
            times: dict[str, list[float]] = {key: [] for key, _ in ways}
            for rep in range(args.reps + 1):  # the first round warms up, unrecorded
                for key, weight in ways[rep % len(ways):] + ways[:rep % len(ways)]:
                    start = clock()
                    weight.matmul(x, out=out, tiles=False)
                    if rep:
                        times[key].append(clock() - start)
            us = {key: summary(t) * 1e6 for key, t in times.items()}
            one_row = us["own"] if rows == 1 else one_row
            rep_text = (f"{us['repacked']:9.1f} {us['repacked'] / us['own']:7.2f}x" if "repacked" in us
                        else f"{'(grouped rows)' if split.grouped else '(split rows)':>18s}")
            print(f"{name:6s} {shape:>12s} {rows:4d} {us['ggml']:9.1f} {us['own']:9.1f} {us['ggml'] / us['own']:8.2f}x "
                  f"{rep_text} {per_row(us['own'], one_row)}{floor(k * n * rows, one_row)}")


if __name__ == "__main__":
    raise SystemExit(main())
