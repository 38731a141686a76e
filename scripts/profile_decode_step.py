#!/usr/bin/env python3
"""Where one decode step's time goes, for a GGUF served through mlx-lm's model (a hybrid's step).

Loads FILE as the server does (``load_optimized_blas``, the CPU device, ``load_gguf`` with ggml's
blocks), prefills a short prompt into mlx-lm's cache, then measures decode steps of one token:

- **step**: ``model(token, cache)`` then ``mx.eval`` of the last row's logits and the cache's
  state (what the engine's step evaluates): the Python time that builds MLX's lazy graph
  ("build") and the time of the evaluation ("eval"), medians over ``--steps``;
- **CPU decode runtime step**: ``CpuDecoder.step`` (one C pass: the server's step where the
  runtime takes the model, the hybrids' delta-net layers included), median over ``--steps``;
- **per module**: the same step taken apart, each part evaluated before the next (its output and
  any cache state it wrote), so each part's time is its own (plus one evaluation's overhead, which
  the difference "sum of parts - step" shows): every layer's mixer (gated delta-net or attention,
  after its input norm) and MLP (after its norm), the final norm and the output head;
- **weight products alone**: every block-format weight's ggml product on one random row
  (``BlockWeight.matmul``, what ``BlockLinear`` runs after evaluating its input), summed by
  layer kind: step - products = MLX's glue (convolution, the recurrence, norms, gates, reshapes),
  its evaluations (one before every product: ``block_layers.py``) and Python;
- **prefill memory**: the prompt's prefill (``--prompt-tokens``, one chunk) as MLX's peak and
  the process's RSS before and after (``--prompt-tokens 512``: the server's chunk);
- **cProfile** of ``--steps`` whole steps: the Python functions with the most own time (MLX's
  ``mx.eval`` is not a function cProfile sees: its time is counted in its caller's own time,
  ``block_layers._product``).

Example::

    python scripts/profile_decode_step.py /tmp/q/qwen35-0.8b-8l-shaped-v4-q4_k_m.gguf --steps 20
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _state(cache: Any) -> list[Any]:
    """The arrays a cache entry holds now (a KV cache's keys/values, an ArraysCache's states)."""
    return [a for a in getattr(cache, "state", []) if a is not None]


def _vm_rss() -> int:
    """This process's resident bytes (``VmRSS``)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def timed(fn: Callable[[], Any], evaluate: Callable[[Any], list[Any]]) -> tuple[Any, float]:
    import mlx.core as mx

    t0 = time.perf_counter()
    out = fn()
    mx.eval(*evaluate(out))
    return out, time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()

    from mlxcel_compat.runtime.backend import load_optimized_blas

    load_optimized_blas(args.threads, args.threads)
    import mlx.core as mx

    mx.set_default_device(mx.cpu)
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel_compat.gguf.load import load_gguf

    model, _, config, _ = load_gguf(args.file)
    inner = model.language_model.model if hasattr(model, "language_model") else model.model
    head = getattr(model, "language_model", model)
    cache = make_prompt_cache(model)
    rss_loaded = _vm_rss()
    mx.reset_peak_memory()
    mx.eval(model(mx.array([list(range(3, 3 + args.prompt_tokens))]), cache=cache))
    print(f"prefill of {args.prompt_tokens} tokens in one chunk: MLX peak {mx.get_peak_memory() / 2**20:.0f} MiB, "
          f"RSS {rss_loaded / 2**20:.0f} -> {_vm_rss() / 2**20:.0f} MiB (MLX's buffer cache "
          f"{mx.get_cache_memory() / 2**20:.0f} MiB)")
    token = mx.array([[7]])

    def states() -> list[Any]:
        return [a for c in cache for a in _state(c)]

    # Whole steps: build vs eval.
    builds, evals, totals = [], [], []
    for _ in range(args.steps + 2):
        t0 = time.perf_counter()
        logits = model(token, cache=cache)[0, -1, :]
        t1 = time.perf_counter()
        mx.eval(logits, *states())
        t2 = time.perf_counter()
        builds.append(t1 - t0)
        evals.append(t2 - t1)
        totals.append(t2 - t0)
    builds, evals, totals = builds[2:], evals[2:], totals[2:]
    med = statistics.median
    print(f"file: {args.file}; layers: {len(inner.layers)}; steps: {args.steps}")
    print(f"step: {med(totals) * 1e3:.2f} ms ({1 / med(totals):.1f} tok/s): graph build (Python) "
          f"{med(builds) * 1e3:.2f} ms, eval {med(evals) * 1e3:.2f} ms")

    # The CPU decode runtime's step (what the server runs where cpu_decode.build takes the model):
    # one C pass a token, on a copy of the cache.
    import copy

    from mlxcel_compat.runtime import backend, cpu_decode
    from mlxcel_compat.runtime.decode_kv import OwnedCache

    decoder = cpu_decode.build(model, backend.matmul_shim())
    if isinstance(decoder, str):
        print(f"CPU decode runtime: not used ({decoder})")
    else:
        ours, owned, runtime = copy.deepcopy(cache), OwnedCache(), []
        for _ in range(args.steps + 2):
            t0 = time.perf_counter()
            decoder.step(7, ours, owned)
            runtime.append(time.perf_counter() - t0)
        runtime = runtime[2:]
        print(f"CPU decode runtime step (the server's): {med(runtime) * 1e3:.2f} ms ({1 / med(runtime):.1f} tok/s), "
              f"{med(totals) / med(runtime):.2f}x MLX's step's speed")

    # Per module, each evaluated before the next.
    parts: dict[str, list[float]] = defaultdict(list)
    sums: list[float] = []
    for _ in range(args.steps):
        total = 0.0
        h, dt = timed(lambda: inner.embed_tokens(token), lambda o: [o])
        parts["embedding"].append(dt)
        total += dt
        for i, (layer, c) in enumerate(zip(inner.layers, cache)):
            kind = "delta-net" if layer.is_linear else "attention"
            mixer = layer.linear_attn if layer.is_linear else layer.self_attn
            x = h
            r, dt = timed(lambda: mixer(layer.input_layernorm(x), None, c), lambda o: [o, *_state(c)])
            parts[f"{i:2d} {kind} mixer"].append(dt)
            total += dt
            h2 = x + r
            h, dt = timed(lambda: h2 + layer.mlp(layer.post_attention_layernorm(h2)), lambda o: [o])
            parts[f"{i:2d} {kind} mlp"].append(dt)
            total += dt
        y, dt = timed(lambda: inner.norm(h), lambda o: [o])
        parts["final norm"].append(dt)
        total += dt
        out_head = head.lm_head if hasattr(head, "lm_head") else inner.embed_tokens.as_linear
        _, dt = timed(lambda: out_head(y)[0, -1, :], lambda o: [o])
        parts["output head"].append(dt)
        total += dt
        sums.append(total)
    print(f"\nper module (each evaluated alone; sum {med(sums) * 1e3:.2f} ms vs the step's {med(totals) * 1e3:.2f}):")
    by_kind: dict[str, float] = defaultdict(float)
    for name, values in parts.items():
        print(f"  {name:28s} {med(values) * 1e3:7.3f} ms")
        key = " ".join(name.split()[1:]) if name[:2].strip().isdigit() else name
        by_kind[key] += med(values)
    print("by kind (sum over layers):")
    for key, value in by_kind.items():
        print(f"  {key:28s} {value * 1e3:7.3f} ms  ({value / med(sums) * 100:4.1f} %)")

    # The weight products alone: every block-format weight the step multiplies, one random row
    # through its own ggml product (BlockWeight.matmul, what BlockLinear calls after evaluating
    # its input), grouped by what it is.
    import numpy as np

    rng = np.random.default_rng(0)
    groups: dict[str, float] = defaultdict(float)
    n_products = 0
    for name, module in model.named_modules():
        block = getattr(module, "block", None)
        if block is None or not hasattr(block, "matmul") or name.endswith("embed_tokens"):
            continue
        row = rng.standard_normal((1, block.k), dtype=np.float32)
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            block.matmul(row, tiles=False)
            times.append(time.perf_counter() - t0)
        parts_of = name.split(".")
        index = next((int(p) for p in parts_of if p.isdigit()), None)
        kind = "output head" if index is None else ("delta-net" if inner.layers[index].is_linear else "attention")
        where = "mlp" if ".mlp." in name else ("" if index is None else "mixer")
        groups[f"{kind} {where}".strip()] += med(times)
        n_products += 1
    product_total = sum(groups.values())
    print(f"\nweight products alone ({n_products} block-format products a step, ggml's vec_dot on one row; "
          f"each is one evaluation of MLX's pending graph in the step):")
    for key, value in groups.items():
        print(f"  {key:28s} {value * 1e3:7.3f} ms")
    print(f"  {'all products':28s} {product_total * 1e3:7.3f} ms = {product_total / med(totals) * 100:4.1f} % of "
          f"the step; the other {(med(totals) - product_total) * 1e3:.2f} ms are MLX's glue ops, its "
          f"{n_products + 2} evaluations a step and Python")

    # Python's share: cProfile over whole steps.
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(args.steps):
        logits = model(token, cache=cache)[0, -1, :]
        mx.eval(logits, *states())
    profile.disable()
    print(f"\ncProfile over {args.steps} whole steps (own time):")
    pstats.Stats(profile).sort_stats("tottime").print_stats(14)
    return 0


if __name__ == "__main__":
    sys.exit(main())
