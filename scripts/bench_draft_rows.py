#!/usr/bin/env python3
"""What a speculative draft's verify pass costs against one decode step, on the CPU decode runtime.

Loads FILE as the server does (``load_model``: ggml's blocks, the runtime, ``--kv`` storage for
the KV cache), fills the cache with ``--depth`` positions (MLX's prefill, 512 at a time), then
times, in one process, ``CpuDecoder.step`` (one token) and ``CpuDecoder.step_tokens`` of each
``--rows`` count (a draft of rows - 1 tokens and the pending one, what ``verify_logits`` runs),
the cache trimmed back after each: medians of ``--steps`` calls, best of ``--rounds`` rounds, and
each count over one step. A model whose cache has sliding-window rings (Gemma 3) verifies no
drafts (``can_step_tokens``): only its step is timed.

Why: a verify row's cost over a step's is what n-gram speculation's speed-up comes down to
(docs/benchmarks/quantized.md, "The decode attention's scores and parts").

    python scripts/bench_draft_rows.py FILE --depth 450 --rows 1,2,4,8,16
    python scripts/bench_draft_rows.py FILE --package /tmp/before   # another checkout's package
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", nargs="?", help="a GGUF (default: SmolLM2-135M-Instruct Q4_1, the demo's)")
    parser.add_argument("--depth", type=int, default=450, help="positions in the cache")
    parser.add_argument("--rows", default="1,2,4,8,16", help="comma list of row counts (1: a step)")
    parser.add_argument("--kv", default="f16", help="the KV cache's storage type (-ctk/-ctv)")
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--package", help="import mlxcel_compat from this checkout instead of this one")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(args.package).resolve() if args.package else ROOT))

    from mlxcel_compat.runtime.backend import load_optimized_blas

    load_optimized_blas(args.threads, args.threads)
    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from mlxcel_compat.model.load_options import LoadOptions
    from mlxcel_compat.model.loader import load_model
    from mlxcel_compat.runtime.decode_kv import OwnedCache
    from mlxcel_compat.runtime.kv_precision import KvTypes
    from mlxcel_compat.testing.real_model import ensure_real_model

    path = args.file or str(ensure_real_model())
    loaded = load_model(path, [], options=LoadOptions(kv_types=KvTypes(args.kv, args.kv)))
    model, decoder = loaded.model, loaded.decoder
    if decoder is None:
        print(f"{path}: no CPU decode runtime for this model")
        return 1
    cache, owned = make_prompt_cache(model), OwnedCache()
    tokens = [100 + i % 1000 for i in range(args.depth)]
    for i in range(0, args.depth, 512):
        mx.eval(model(mx.array([tokens[i:i + 512]]), cache=cache))
    counts = [int(r) for r in args.rows.split(",")]
    if not decoder.can_step_tokens(cache, owned):
        counts = [1]
    best: dict[int, float] = {}
    for _ in range(args.rounds):
        for rows in counts:
            fed, times = list(range(200, 200 + rows)), []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                if rows == 1:
                    decoder.step(fed[0], cache, owned)
                else:
                    decoder.step_tokens(fed, cache, owned)
                times.append(time.perf_counter() - t0)
                trim_prompt_cache(cache, rows)
            best[rows] = min(best.get(rows, float("inf")), statistics.median(times))
    print(f"{Path(path).name}: {args.depth} positions of {args.kv} KV, {args.threads} threads, "
          f"package {args.package or ROOT}")
    print("| rows | ms | over one step |\n|---|---|---|")
    one = best.get(1)
    for rows in counts:
        print(f"| {rows} | {best[rows] * 1e3:.2f} | {f'{best[rows] / one:.2f}x' if one else '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
