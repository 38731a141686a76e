#!/usr/bin/env python3
"""GGUF against the HF directory of the same model, in one run: load time, memory, speed.

For the factory's small model (F32 GGUF written from the same weights as the directory), each
load runs in a fresh process (so page cache is warm for both but no MLX state is shared), through
``model/loader.py``'s ``load_model`` exactly as the server loads. Each process reports:

- load time (``load_model`` call, tokenizer included);
- peak RSS while loading, minus the RSS before the call, against the final weight bytes;
- prefill tokens/s (one 512-token prompt) and decode tokens/s (128 greedy steps, KV cache), the
  median of ``--reps`` runs.

Processes alternate GGUF / HF ``--rounds`` times; the table shows medians and GGUF/HF ratios.
Goals (issue 10): load time <= 1.5x HF, peak <= 1.3x the weight bytes, same serving speed.

Examples::

    python scripts/bench_gguf_load.py
    python scripts/bench_gguf_load.py --family qwen3 --gguf-type q8_0 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
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

    from mlxcel_compat.backend import load_optimized_blas

    load_optimized_blas()
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel_compat.model.loader import load_model

    mx.eval(mx.zeros(1))  # MLX's own start-up is not part of the load
    base = _rss_bytes()
    peak = [base]
    stop = threading.Event()

    def sample() -> None:  # ru_maxrss cannot be reset, so poll the current RSS
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_bytes())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    loaded = load_model(path, [])
    load_s = time.perf_counter() - t0
    stop.set()
    sampler.join()
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
    return {"load_s": load_s, "peak_bytes": peak[0] - base, "weight_bytes": weight_bytes,
            "prefill_tps": statistics.median(prefill), "decode_tps": statistics.median(decode)}


def run_child(path: Path, reps: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", str(path), "--reps", str(reps)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="llama")
    parser.add_argument("--size", default="small")
    parser.add_argument("--gguf-type", default="f32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.reps)))
        return

    from mlxcel_compat.testing.gguf_writer import ensure_gguf
    from mlxcel_compat.testing.models import ensure_model

    directory = ensure_model(args.family, args.size)
    gguf_path = ensure_gguf(args.family, args.size, args.gguf_type)
    results: dict[str, list[dict]] = {"gguf": [], "hf": []}
    for _ in range(args.rounds):
        results["gguf"].append(run_child(gguf_path, args.reps))
        results["hf"].append(run_child(directory, args.reps))

    def med(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in results[kind])

    print(f"model: {args.family}-{args.size}, GGUF type {args.gguf_type} ({gguf_path.stat().st_size / 2**20:.0f} MiB), "
          f"{args.rounds} rounds x {args.reps} reps, medians")
    print(f"{'':28s} {'GGUF':>10s} {'HF dir':>10s} {'GGUF/HF':>8s}")
    rows = [("load time (s)", "load_s", "{:.3f}"), ("peak RSS while loading (MiB)", "peak_bytes", "{:.0f}"),
            ("prefill tok/s (512 tokens)", "prefill_tps", "{:.0f}"), ("decode tok/s (128 steps)", "decode_tps", "{:.1f}")]
    for label, key, fmt in rows:
        g, h = med("gguf", key), med("hf", key)
        scale = 2**20 if key == "peak_bytes" else 1
        print(f"{label:28s} {fmt.format(g / scale):>10s} {fmt.format(h / scale):>10s} {g / h:8.2f}")
    weights = med("gguf", "weight_bytes")
    print(f"final weight bytes: {weights / 2**20:.0f} MiB; GGUF peak / weights = {med('gguf', 'peak_bytes') / weights:.2f}, "
          f"HF peak / weights = {med('hf', 'peak_bytes') / weights:.2f}")


if __name__ == "__main__":
    main()
