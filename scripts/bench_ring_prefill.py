#!/usr/bin/env python3
"""A prompt's prefill on a model with sliding-window layers (gemma3), MLX's chunks against the
CPU decode runtime's (``runtime/ring_chunks.py``), in one process, alternating (issue 51).

Loads FILE as the server does (``load_model``: weights in their GGUF blocks, the CPU runtime),
then feeds ``--tokens`` random prompt tokens in chunks of ``--chunk`` (the server's
``--batch-size`` default, 512) into a fresh cache, ``--reps`` times each way, the two ways
alternating so that the machine's drift falls on both:

- **mlx**: mlx-lm's model over the chunk, no output head (``logits_unused``), the cache evaluated:
  the path gemma3's prompts took before;
- **runtime**: ``CpuDecoder.prefill(..., logits=False)``: one native pass a chunk.

Printed: each way's median tok/s and the ratio, and the largest difference between the two
paths' keys in the first global layer (the same products in another order, and the split rows'
8-bit activations: ~1e-3 of the largest).

Example::

    python scripts/bench_ring_prefill.py ~/.cache/mlxcel_compat/bench-quantized/gemma-3-270m-q4_k_m.gguf --reps 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    from mlxcel_compat.runtime.backend import load_optimized_blas

    load_optimized_blas(args.threads, args.threads)
    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel_compat.model.loader import load_model
    from mlxcel_compat.runtime import decode_kv
    from mlxcel_compat.runtime.block_layers import logits_unused

    loaded = load_model(str(Path(args.file).expanduser()), [])
    model, decoder = loaded.model, loaded.decoder
    if decoder is None or not decoder.kv.rings:
        print("this model has no sliding-window layers on the CPU decode runtime")
        return 1
    rng = np.random.default_rng(0)
    vocab = decoder.embed.shape[0]
    spans = [(s, min(s + args.chunk, args.tokens)) for s in range(0, args.tokens, args.chunk)]

    def mlx_way(ids: list[int]) -> list:
        cache = make_prompt_cache(model)
        for a, b in spans:
            with logits_unused():
                model(mx.array(ids[a:b])[None], cache=cache)
            mx.eval([c.state for c in cache])
        return cache

    def runtime_way(ids: list[int]) -> list:
        cache, owned = make_prompt_cache(model), decode_kv.OwnedCache()
        for a, b in spans:
            decoder.prefill(ids[a:b], cache, owned, logits=False)
        return cache

    rates: dict[str, list[float]] = {"mlx": [], "runtime": []}
    diff = 0.0
    for rep in range(args.reps + 1):  # the first round warms both up and is not counted
        ids = rng.integers(10, vocab, args.tokens).tolist()
        caches = {}
        for name, way in (("mlx", mlx_way), ("runtime", runtime_way))[:: 1 if rep % 2 else -1]:
            t0 = time.perf_counter()
            caches[name] = way(ids)
            if rep:
                rates[name].append(args.tokens / (time.perf_counter() - t0))
        layer = decoder.kv.plain[0]  # a global layer: both paths leave its positions in order
        a, b = (np.array(caches[n][layer].keys)[..., : caches[n][layer].offset, :] for n in ("mlx", "runtime"))
        diff = max(diff, float(np.abs(a - b).max() / np.abs(a).max()))
    med = {n: statistics.median(r) for n, r in rates.items()}
    print(f"{Path(args.file).name}: {args.tokens} tokens in chunks of {args.chunk}, {args.reps} reps each way")
    for n, r in rates.items():
        print(f"  {n:8s} {med[n]:7.1f} tok/s  [{min(r):.1f}-{max(r):.1f}]")
    print(f"  runtime / mlx: {med['runtime'] / med['mlx']:.2f}x; the first global layer's keys differ by at most "
          f"{diff:.1e} of the largest")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
