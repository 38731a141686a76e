#!/usr/bin/env python3
"""LoRA adapters served unfused (issue 30): decode cost of one adapter, and the cost of a scale change.

Decode: the factory's ``llama`` model (``--size``, ``small`` by default: 768 hidden, 12 layers)
with one rank-``--rank`` adapter (16 by default) on every attention and MLP projection (7 a
layer), written by ``mlxcel_compat.testing.adapters``. One process loads the model twice (without
the adapter, and with it) and times greedy decode steps of each side by side, interleaved
(``benchlib.interleaved``: the order rotates each repetition, so a busy machine's noise hits both
alike), after a shared prompt:

- **CPU decode runtime** (``runtime/cpu_decode.py``, what the engine runs for one sequence):
  ``--steps`` steps per measurement, each ``CpuDecoder.step`` + argmax; the adapter adds two
  small products per projection (``A x`` then ``B (A x)``, the shim's kernel);
- **MLX step** (``MLXCEL_CPU_DECODE=0``'s path): a (1, 1) forward pass through the mlx-lm model,
  evaluated; the adapted MLPs run uncompiled (``cpu_fusion`` cannot trace a layer that reads its
  scales at call time), so this is the path where a fused fast path is given up;
- the same two with the adapter installed but its scale 0 (the base model's arithmetic: must cost
  nothing).

Reported: milliseconds per token, medians over ``--reps`` [min-max], and the ratio adapter / base
(goal: at most 1.15 on the CPU runtime).

Scale change: a real server (``python -m mlxcel_compat --lora FILE``) on loopback; ``--changes``
times ``POST /lora-adapters`` round trips (HTTP included) with alternating scales, and the time
from a change to the first token of the next request vs. without a change. Goal: a change under
10 ms.

    python scripts/bench_lora.py [--size small] [--rank 16] [--steps 32] [--reps 7]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

sys.path.insert(0, str(benchlib.ROOT))


def _decode_runs(model, decoder, prompt, steps, scales):
    """Closures timing ``steps`` greedy steps: the CPU runtime and MLX's (1, 1) pass."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel_compat.runtime import cpu_decode
    from mlxcel_compat.runtime import lora_rows

    rows = None if scales is None else [scales]

    def fresh_cache():
        cache = make_prompt_cache(model)
        with lora_rows.applied(rows):
            model(mx.array([prompt]), cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    def runtime() -> float:
        cache, owned, token = fresh_cache(), cpu_decode.OwnedCache(), prompt[-1]
        t0 = benchlib.clock()
        for _ in range(steps):
            token = int(np.argmax(decoder.step(token, cache, owned, scales)))
        return (benchlib.clock() - t0) * 1000.0 / steps

    def mlx_step() -> float:
        cache, token = fresh_cache(), mx.array([[prompt[-1]]])
        t0 = benchlib.clock()
        for _ in range(steps):
            with lora_rows.applied(rows):
                logits = model(token, cache=cache)
            token = mx.argmax(logits[:, -1, :], axis=-1).reshape(1, 1)
            mx.eval(token)
        return (benchlib.clock() - t0) * 1000.0 / steps

    return runtime, mlx_step


def bench_decode(args) -> dict:
    from mlxcel_compat.runtime.backend import load_optimized_blas

    load_optimized_blas()
    from mlxcel_compat.model.loader import load_model
    from mlxcel_compat.lora.adapters import AdapterSet, AdapterSpec
    from mlxcel_compat.testing.adapters import ensure_adapter

    model_dir = benchlib.ensure_model("llama", args.size)
    adapter = ensure_adapter("llama", args.size, "gguf", rank=args.rank, alpha=2.0 * args.rank)
    base = load_model(str(model_dir), [])
    adapted = load_model(str(model_dir), [], adapters=AdapterSet.from_specs([AdapterSpec(str(adapter))]).adapters)
    assert base.decoder is not None and adapted.decoder is not None, "the CPU decode runtime is not available"
    prompt = list(range(10, 10 + args.prompt))
    fns = {}
    for label, loaded, scales in (("base", base, None), ("adapter", adapted, (1.0,)), ("adapter at scale 0", adapted, (0.0,))):
        runtime, mlx_step = _decode_runs(loaded.model, loaded.decoder, prompt, args.steps, scales)
        fns[f"runtime/{label}"] = runtime
        fns[f"mlx/{label}"] = mlx_step
    values = benchlib.interleaved(fns, args.reps)
    med = {k: benchlib.pct(v, 50) for k, v in values.items()}
    out = {"model": f"llama-{args.size}", "rank": args.rank, "adapted_modules": adapted.n_adapted,
           "adapter_bytes": os.path.getsize(adapter), "steps": args.steps, "reps": args.reps,
           "ms_per_token": {k: {"median": med[k], "min": min(v), "max": max(v)} for k, v in values.items()}}
    for path in ("runtime", "mlx"):
        out[f"{path}_ratio"] = benchlib.ratio(med[f"{path}/adapter"], med[f"{path}/base"])
        out[f"{path}_ratio_scale0"] = benchlib.ratio(med[f"{path}/adapter at scale 0"], med[f"{path}/base"])
    return out


def bench_scale_change(args) -> dict:
    import httpx

    from mlxcel_compat.lora.adapters import AdapterSet, AdapterSpec
    from mlxcel_compat.testing.adapters import ensure_adapter

    adapter = ensure_adapter("llama", "tiny", "gguf", rank=args.rank, alpha=2.0 * args.rank)
    # What the server does for a change (the handler's work, without HTTP): parse the entries,
    # replace the tuple, compute the next request's lora_id.
    aset = AdapterSet.from_specs([AdapterSpec(str(adapter))])
    n = 2000
    t0 = time.perf_counter()
    for i in range(n):
        aset.scales = aset.from_entries([{"id": 0, "scale": 0.5 if i % 2 else 1.0}])
        aset.lora_id(aset.scales)
    in_process_us = (time.perf_counter() - t0) * 1e6 / n
    port = benchlib.free_port()
    cmd = benchlib.mlxcel_cmd(benchlib.ensure_model("llama", "tiny"), port, ["--lora", str(adapter), "-np", "1"])
    server = benchlib.ServerProcess(cmd, port, name="mlxcel-lora")
    server.start()
    server.wait_healthy(300)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            body = {"prompt": "Once upon a time", "n_predict": 1, "temperature": 0, "cache_prompt": False}
            c.post("/completion", json=body).raise_for_status()
            changes = []
            for i in range(args.changes):
                t0 = time.perf_counter()
                c.post("/lora-adapters", json=[{"id": 0, "scale": 0.5 if i % 2 else 1.0}]).raise_for_status()
                changes.append((time.perf_counter() - t0) * 1000.0)

            def request(change: bool) -> float:
                t0 = time.perf_counter()
                if change:
                    c.post("/lora-adapters", json=[{"id": 0, "scale": 0.25 + (time.perf_counter() % 1)}]).raise_for_status()
                c.post("/completion", json=body).raise_for_status()
                return (time.perf_counter() - t0) * 1000.0

            first = benchlib.interleaved({"request": lambda: request(False), "change + request": lambda: request(True)},
                                         args.reps * 3)
    finally:
        server.stop()
    return {"in_process_us": in_process_us, "post_lora_adapters_ms": {"median": benchlib.pct(changes, 50), "p90": benchlib.pct(changes, 90),
                                      "max": max(changes), "n": len(changes)},
            "one_token_request_ms": {k: benchlib.pct(v, 50) for k, v in first.items()}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens before the timed steps")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--changes", type=int, default=50)
    parser.add_argument("--json", action="store_true", help="print the results as JSON only")
    args = parser.parse_args()
    results = {"decode": bench_decode(args), "scale_change": bench_scale_change(args)}
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    d = results["decode"]
    print(f"llama-{args.size}, one rank-{args.rank} adapter on {d['adapted_modules']} modules "
          f"({d['adapter_bytes'] / 2**20:.1f} MiB), {args.steps} steps x {args.reps} reps, ms/token median [min-max]:")
    for name, v in d["ms_per_token"].items():
        print(f"  {name:28s} {v['median']:7.2f} [{v['min']:.2f}-{v['max']:.2f}]")
    for path in ("runtime", "mlx"):
        print(f"  {path}: adapter / base = {d[f'{path}_ratio']:.3f}; at scale 0: {d[f'{path}_ratio_scale0']:.3f}")
    s = results["scale_change"]
    p = s["post_lora_adapters_ms"]
    print(f"scale change in process (parse, set, next lora_id): {s['in_process_us']:.1f} us")
    print(f"POST /lora-adapters: median {p['median']:.2f} ms, p90 {p['p90']:.2f} ms, max {p['max']:.2f} ms ({p['n']} changes)")
    print("one-token request, ms (median): " + ", ".join(f"{k} {v:.1f}" for k, v in s["one_token_request_ms"].items()))
    return 0


if __name__ == "__main__":
    benchlib.run(main)
