#!/usr/bin/env python3
"""One decode pass of the CPU decode runtime over a model file, by its row count: what a pass of
N rows costs against one row, where the weights stream from memory as in serving.

Why: ``bench_quant_rows.py`` times one weight's product, read from the caches again and again;
a pass reads every weight of the model once, and the kernel that wins there can lose here (the
Q4_K/Q6_K two-row path against the lanes on short weight rows: docs/benchmarks/quantized.md).

Two kinds of rows (``--mode``):
- ``batch``: N sequences stepped together (``CpuDecoder.step_rows``: batched decode, N streams);
- ``tail``: N consecutive tokens of one sequence with the head on the last row only
  (``step_tokens(..., last_only=True)``: a prompt's short rest; on a hybrid its recurrent layers
  take the rows in order); with ``--all-logits`` every row's logits (a speculative draft's
  verification).

Each sequence first gets a ``--context``-token prompt chunk, made afresh every round (a tail
pass advances its sequence by its row count: the depth stays within context + passes x rows).
Rounds alternate the row counts
(the shared machine's load falls on all of them alike); the figure is the median over rounds of
each round's mean pass time, in milliseconds, and its ratio to one row's.

    .venv/bin/python scripts/bench_pass_rows.py ~/.cache/mlxcel_compat/bench-quantized/qwen35-0.8b-8l-shaped-v4-q4_k_m.gguf \
        --mode tail --rows 1,2,3,4 --passes 20 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlxcel_compat.runtime import backend  # noqa: E402

backend.load_optimized_blas()  # before NumPy and MLX

from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from mlxcel_compat.model.loader import load_model  # noqa: E402
from mlxcel_compat.runtime.decode_kv import OwnedCache  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a GGUF file (or a model directory) the CPU decode runtime takes")
    parser.add_argument("--mode", choices=("batch", "tail"), default="batch")
    parser.add_argument("--rows", default="1,2,3,4,8")
    parser.add_argument("--passes", type=int, default=20, help="passes a round, each row count")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--context", type=int, default=256, help="prompt tokens each sequence holds first")
    parser.add_argument("--all-logits", action="store_true", help="tail mode: every row's logits (a draft's verification)")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()

    served = load_model(args.model, [])
    model, decoder = served.model, served.decoder
    if decoder is None:
        sys.exit(f"{args.model}: the CPU decode runtime does not take this model")
    counts = [int(n) for n in args.rows.split(",")]
    tokens = [(37 * i + 11) % 4000 + 100 for i in range(args.context + (args.passes + 1) * max(counts))]

    def sequence() -> tuple[list, OwnedCache]:
        cache, owned = make_prompt_cache(model), OwnedCache()
        decoder.prefill(tokens[:args.context], cache, owned, logits=False)
        return cache, owned

    # Each round makes each row count's sequences afresh, so every pass sees about the same depth
    # (a tail pass of n rows advances its sequence by n positions, a batch pass by one).
    sequences: dict[int, list] = {}
    position: dict[int, int] = {}

    def fresh(n: int) -> None:
        sequences[n] = [sequence() for _ in range(n if args.mode == "batch" else 1)]
        position[n] = args.context

    def one_pass(n: int) -> None:
        at = position[n]
        if args.mode == "batch":
            caches = [c for c, _ in sequences[n]]
            decoder.step_rows(tokens[at:at + n], caches, [o for _, o in sequences[n]])
            position[n] = at + 1
        else:
            cache, owned = sequences[n][0]
            decoder.step_tokens(tokens[at:at + n], cache, owned, last_only=not args.all_logits)
            position[n] = at + n

    for n in counts:  # the first pass of each count makes its buffers
        fresh(n)
        one_pass(n)
    times: dict[int, list[float]] = {n: [] for n in counts}
    for r in range(args.rounds):
        for n in (counts if r % 2 == 0 else counts[::-1]):
            fresh(n)
            start = time.perf_counter()
            for _ in range(args.passes):
                one_pass(n)
            times[n].append((time.perf_counter() - start) * 1000 / args.passes)
    one = statistics.median(times[counts[0]])
    what = f"mode {args.mode}" + (", every row's logits" if args.all_logits else "")
    print(f"{Path(args.model).name}, {what}, {args.context} positions first: median over {args.rounds} rounds of {args.passes} passes")
    print("| rows | ms a pass | vs first |")
    print("|---:|---:|---:|")
    result = {}
    for n in counts:
        ms = statistics.median(times[n])
        result[n] = ms
        print(f"| {n} | {ms:.2f} | {ms / one:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "mode": args.mode, "ms": result}, indent=1))


if __name__ == "__main__":
    main()
