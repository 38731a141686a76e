#!/usr/bin/env python3
"""What batching buys for prompt processing on this machine: one (B, L) forward pass against B
passes of (1, L), on the generated model, in-process (no server).

Continuous batching pays off when a batched pass costs much less than its rows run one by one:
true for decode (L = 1, memory-bound: every pass reads all the weights) and on GPUs for prefill
too, but on a CPU a prompt chunk is compute-bound, so batching several prompts' chunks saves
little. This measures it, so the scheduler's choices rest on numbers: for each L and B, the two
ways are timed alternately (``--reps`` times each, fresh caches, median), and the ratio
``B x (1, L) / (B, L)`` is printed (1.0: batching saves nothing; B: a batch costs one row).

Examples::

    python scripts/bench_prefill_batching.py                    # small llama, L 1,16,128, B 1,2,4,8
    python scripts/bench_prefill_batching.py --lengths 1,32 --batches 1,8 --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import benchlib  # noqa: E402
from mlxcel_compat.runtime.backend import load_optimized_blas  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama", help="model directory, or family[:size] to generate (default llama:small)")
    ap.add_argument("--lengths", default="1,16,128", help="tokens per row (default 1,16,128)")
    ap.add_argument("--batches", default="1,2,4,8", help="rows (default 1,2,4,8)")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]

    load_optimized_blas()
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel_compat.model.loader import load_model

    model_dir = benchlib.resolve_model(args.model, "small")
    model = load_model(model_dir, []).model

    def forward(rows: int, length: int) -> float:
        tokens = mx.random.randint(10, 8000, (rows, length))
        mx.eval(tokens)
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        mx.eval(model(tokens, cache=cache))
        return time.perf_counter() - t0

    forward(1, 8)  # MLX's one-off set-up cost
    print(f"model: {model_dir}")
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}\n")
    print("| L | B | one (B, L) pass ms | B passes of (1, L) ms | ratio (B passes / one pass) |")
    print("|---:|---:|---:|---:|---:|")
    for length in lengths:
        for rows in batches:
            batched, separate = [], []
            for _ in range(args.reps):
                batched.append(forward(rows, length))
                separate.append(sum(forward(1, length) for _ in range(rows)))
            b, s = statistics.median(batched) * 1000, statistics.median(separate) * 1000
            print(f"| {length} | {rows} | {b:.0f} | {s:.0f} | {s / b:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    benchlib.run(main)
