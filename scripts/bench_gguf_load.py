#!/usr/bin/env python3
"""GGUF against the HF directory of the same model, in one run: load time, memory, speed.

For the factory's small model (F32 GGUF written from the same weights as the directory), each
load runs in a fresh process (so page cache is warm for both but no MLX state is shared), through
``model/loader.py``'s ``load_model`` exactly as the server loads. Each process reports:

- load time (``load_model`` call, tokenizer included), wall clock and CPU time (all threads, less
  the memory sampler's own), since on a shared machine the wall clock also counts waiting for a core;
- peak RSS while loading, minus the RSS before the call, against the final weight bytes;
- prefill tokens/s (one 512-token prompt) and decode tokens/s (128 greedy steps, KV cache), the
  median of ``--reps`` runs (``--reps 0`` skips them).

A GGUF converts its tokenizer on the first load and reuses the cached conversion afterwards
(``gguf/tokenizer.py``). The children get a fresh, empty ``XDG_CACHE_HOME``: one first,
cold GGUF load is reported on its own, then ``--rounds`` rounds each load the GGUF and the
directory back to back (the order alternating between rounds). The table shows medians; the
load-time ratio is the median of the per-round GGUF/HF ratios, so a burst of load from other
work hits both sides of a pair. Goals (issue 10): load time <= 1.5x HF, peak <= 1.3x the weight
bytes, same serving speed.

Examples::

    python scripts/bench_gguf_load.py
    python scripts/bench_gguf_load.py --family qwen3 --gguf-type q8_0 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def child(path: str, reps: int) -> dict:
    """Runs in a fresh process: load the model and measure it."""
    import threading

    from mlxcel_compat.runtime.backend import load_optimized_blas

    load_optimized_blas()
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel_compat.model.loader import load_model

    mx.eval(mx.zeros(1))  # MLX's own start-up is not part of the load
    base = _rss_bytes()
    peak = [base]
    sampler_cpu = [0.0]
    stop = threading.Event()

    def sample() -> None:  # ru_maxrss cannot be reset, so poll the current RSS
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.002)
        sampler_cpu[0] = time.thread_time()

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0, c0 = time.perf_counter(), time.process_time()
    loaded = load_model(path, [])
    load_s = time.perf_counter() - t0
    stop.set()
    sampler.join()
    load_cpu_s = time.process_time() - c0 - sampler_cpu[0]
    peak[0] = max(peak[0], _rss_bytes())
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
    model = loaded.model
    prompt = mx.array([list(range(100, 612))])
    prefill, decode = [], []
    for _ in range(reps):
        cache = make_prompt_cache(model)
        t = time.perf_counter()
        logits = model(prompt, cache=cache)
        mx.eval(logits)
        prefill.append(512 / (time.perf_counter() - t))
        token = mx.argmax(logits[:, -1:], axis=-1)
        t = time.perf_counter()
        for _ in range(128):
            token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
            mx.eval(token)
        decode.append(128 / (time.perf_counter() - t))
    speed = {"prefill_tps": statistics.median(prefill), "decode_tps": statistics.median(decode)} if reps else {}
    return {"load_s": load_s, "load_cpu_s": load_cpu_s, "peak_bytes": peak[0] - base, "weight_bytes": weight_bytes,
            **speed}


def run_child(path: Path, reps: int, cache_home: str) -> dict:
    env = {**os.environ, "XDG_CACHE_HOME": cache_home}
    out = subprocess.run([sys.executable, __file__, "--child", str(path), "--reps", str(reps)],
                         capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="llama")
    parser.add_argument("--size", default="small")
    parser.add_argument("--gguf-type", default="f32")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.reps)))
        return

    from mlxcel_compat.testing.gguf_writer import ensure_gguf
    from mlxcel_compat.testing.model_directory import ensure_model

    directory = ensure_model(args.family, args.size)
    gguf_path = ensure_gguf(args.family, args.size, args.gguf_type)
    paths = {"gguf": gguf_path, "hf": directory}
    with tempfile.TemporaryDirectory(prefix="bench-gguf-cache-") as cache_home:
        cold = run_child(gguf_path, 0, cache_home)  # converts and caches the tokenizer
        results: dict[str, list[dict]] = {"gguf": [], "hf": []}
        for i in range(args.rounds):
            for kind in (("gguf", "hf") if i % 2 == 0 else ("hf", "gguf")):
                results[kind].append(run_child(paths[kind], args.reps, cache_home))

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in results[kind])

    def ratios(key: str) -> list[float]:
        return sorted(g[key] / h[key] for g, h in zip(results["gguf"], results["hf"]))

    print(f"model: {args.family}-{args.size}, GGUF type {args.gguf_type} ({gguf_path.stat().st_size / 2**20:.0f} MiB), "
          f"{args.rounds} rounds x {args.reps} reps, medians")
    print(f"{'':32s} {'GGUF':>10s} {'HF dir':>10s} {'GGUF/HF':>8s}")
    rows = [("load time (s)", "load_s", "{:.3f}"), ("load CPU time (s)", "load_cpu_s", "{:.3f}"),
            ("peak RSS while loading (MiB)", "peak_bytes", "{:.0f}")]
    if args.reps:
        rows += [("prefill tok/s (512 tokens)", "prefill_tps", "{:.0f}"),
                 ("decode tok/s (128 steps)", "decode_tps", "{:.1f}")]
    for label, key, fmt in rows:
        g, h = med("gguf", key), med("hf", key)
        scale = 2**20 if key == "peak_bytes" else 1
        ratio = statistics.median(ratios(key)) if key.startswith("load") else g / h
        print(f"{label:32s} {fmt.format(g / scale):>10s} {fmt.format(h / scale):>10s} {ratio:8.2f}")
    for key, label in (("load_s", "load time"), ("load_cpu_s", "load CPU time")):
        print(f"{label} GGUF/HF per round: {', '.join(f'{r:.2f}' for r in ratios(key))} "
              f"(median {statistics.median(ratios(key)):.2f})")
    hf_load = med("hf", "load_s")
    print(f"first GGUF load (tokenizer converted, cache cold): {cold['load_s']:.3f} s, CPU {cold['load_cpu_s']:.3f} s "
          f"({cold['load_s'] / hf_load:.2f}x the median HF load)")
    weights = med("gguf", "weight_bytes")
    print(f"final weight bytes: {weights / 2**20:.0f} MiB; GGUF peak / weights = {med('gguf', 'peak_bytes') / weights:.2f} "
          f"(cold: {cold['peak_bytes'] / weights:.2f}), HF peak / weights = {med('hf', 'peak_bytes') / weights:.2f}")


if __name__ == "__main__":
    main()
