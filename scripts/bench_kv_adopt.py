#!/usr/bin/env python3
"""Adoption without a tensor copy: the memory and the time to first token of many sequences that
adopt one long cached prefix at once, the prefix's blocks read in place by the CPU decode runtime
(today) against gathered into a copy per sequence (the adoption before, ``kv.gather``).

Issue 54 ("adopting a prefix costs a reference count and a table copy, not a tensor copy"), in
process on a generated model (the engine and its prompt cache, no HTTP): one request stores a
``--prefix-tokens`` prompt (4096), then ``--sessions`` requests (16) that start with it and add
``--own-tokens`` (32) each are submitted at once (``--sessions`` slots, so all of them run
together, batched), each generating ``--n-predict`` tokens (32). Measured while they run: the
process's peak RSS above its value before they were submitted (sampled every 20 ms) and MLX's
peak active memory above it; and each request's time to first token.

Each mode runs in its own process (so that one's freed memory does not hide in the other's RSS),
the two alternating ``--reps`` times; the figures are the medians. "gathered" replaces
``kv.paged`` by ``kv.gather`` inside its process: the adoption as it was (one copy of the prefix
per sequence, which the runtime then copies again into its own buffer). Example::

    python scripts/bench_kv_adopt.py                       # llama:tiny, 16 x (4096 + 32), 3 reps
    python scripts/bench_kv_adopt.py --model llama:small --reps 1
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import benchlib

sys.path.insert(0, str(benchlib.ROOT))


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 8000) for _ in range(n)]


def one_mode(args: argparse.Namespace) -> dict[str, Any]:
    """In this process: the engine, the stored prefix, then the sessions at once."""
    from mlxcel_compat.runtime.backend import load_optimized_blas

    load_optimized_blas()
    import mlx.core as mx

    from mlxcel_compat.cache import kv
    from mlxcel_compat.cache.key import RAW_PROMPT_TEMPLATE_SIG, TEXT_ONLY_MM_DIGEST
    from mlxcel_compat.engine.core import Engine, EngineConfig
    from mlxcel_compat.engine.prefix_cache import PrefixCache
    from mlxcel_compat.engine.prefix_cache_config import PrefixCacheConfig
    from mlxcel_compat.engine.request import CacheContext, ErrorEvent, FinishEvent, GenerationRequest, TokenEvent
    from mlxcel_compat.engine.sampling.params import SamplingParams

    if args.mode == "gathered":
        kv.paged = kv.gather  # the adoption before: one concatenated copy of the prefix per sequence
    model_dir = benchlib.resolve_model(args.model, "tiny")
    config = PrefixCacheConfig(capacity_bytes=1 << 40, max_entries=4096, min_prefix=32)
    per_slot = args.prefix_tokens + args.own_tokens + args.n_predict + 64
    engine = Engine(EngineConfig(model=model_dir, ctx_size=args.sessions * per_slot, n_parallel=args.sessions,
                                 batch_size=args.batch_size),
                    prefix_cache_factory=lambda e: PrefixCache(e, config))
    engine.start()
    if not engine.wait_ready(600):
        raise RuntimeError(f"the engine did not start: {engine.load_error}")
    prefix = tokens(args.prefix_tokens, seed=1)

    def submit(prompt: list[int], n_predict: int, sink: Any) -> None:
        engine.submit(GenerationRequest(
            prompt_tokens=prompt, sampling=SamplingParams(temperature=0.0, seed=1, ignore_eos=True), n_predict=n_predict,
            cache=CacheContext(enabled=True, session_key="", template_sig=RAW_PROMPT_TEMPLATE_SIG,
                               mm_digest=TEXT_ONLY_MM_DIGEST)), sink)

    def wait(events: queue.Queue) -> None:
        while True:
            event = events.get(timeout=1200)
            if isinstance(event, ErrorEvent):
                raise RuntimeError(event.message)
            if isinstance(event, FinishEvent):
                return

    try:
        for seed in (2, 3):  # the stored prefix, then one hit (warms the runtime's paths)
            events: queue.Queue = queue.Queue()
            submit(prefix + tokens(args.own_tokens, seed=seed), 4, events.put)
            wait(events)
        time.sleep(0.5)
        base_rss = rss_bytes()
        mx.reset_peak_memory()
        base_mx = mx.get_active_memory()
        peak = [base_rss]
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss_bytes())
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        firsts: list[float] = []
        finished = queue.Queue()
        t0 = time.perf_counter()

        def sink_for() -> Any:
            seen = [False]

            def sink(event: Any) -> None:
                if isinstance(event, TokenEvent) and not seen[0]:
                    seen[0] = True
                    firsts.append(time.perf_counter() - t0)
                if isinstance(event, (FinishEvent, ErrorEvent)):
                    finished.put(event)

            return sink

        for s in range(args.sessions):
            submit(prefix + tokens(args.own_tokens, seed=100 + s), args.n_predict, sink_for())
        results = [finished.get(timeout=1200) for _ in range(args.sessions)]
        wall = time.perf_counter() - t0
        done.set()
        sampler.join()
        errors = [r.message for r in results if isinstance(r, ErrorEvent)]
        if errors:
            raise RuntimeError(errors[0])
        cached = [r.n_cached for r in results]
        return {"mode": args.mode, "rss_growth": peak[0] - base_rss, "mlx_peak_growth": mx.get_peak_memory() - base_mx,
                "ttft_median_s": statistics.median(firsts), "ttft_max_s": max(firsts), "wall_s": wall,
                "n_cached_min": min(cached)}
    finally:
        engine.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama:tiny", help="a model directory or family[:size] (generated)")
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--own-tokens", type=int, default=32)
    parser.add_argument("--n-predict", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--mode", choices=["paged", "gathered"], help=argparse.SUPPRESS)  # one side, in a child
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(one_mode(args)), flush=True)
        return 0
    runs: dict[str, list[dict[str, Any]]] = {"paged": [], "gathered": []}
    child = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items()
             if name not in ("json", "mode", "reps")]
    for rep in range(args.reps):
        for mode in ("paged", "gathered") if rep % 2 == 0 else ("gathered", "paged"):
            out = subprocess.run([sys.executable, __file__, *child, "--mode", mode], check=True, capture_output=True,
                                 text=True).stdout
            runs[mode].append(json.loads(out.strip().splitlines()[-1]))
            print(f"  rep {rep} {mode}: {runs[mode][-1]}", file=sys.stderr, flush=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in ("rss_growth", "mlx_peak_growth", "ttft_median_s", "wall_s")}
           for m, rs in runs.items()}
    print(f"{args.sessions} sessions adopting a {args.prefix_tokens}-token prefix at once (+{args.own_tokens} own, "
          f"{args.n_predict} generated), {args.model}, medians of {args.reps}:")
    for m in ("paged", "gathered"):
        print(f"  {m:9s} RSS +{med[m]['rss_growth'] / 2**20:7.1f} MiB, MLX peak +{med[m]['mlx_peak_growth'] / 2**20:7.1f} MiB, "
              f"TTFT median {med[m]['ttft_median_s'] * 1000:7.0f} ms, all done in {med[m]['wall_s']:.1f} s")
    ratios = {k: benchlib.ratio(med["paged"][k], med["gathered"][k]) for k in med["paged"]}
    print(f"  paged / gathered: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items() if v is not None))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": runs, "medians": med, "ratios": ratios}, f, indent=2)
    return 0


if __name__ == "__main__":
    benchlib.run(main)
