#!/usr/bin/env python3
"""Teacher-forced agreement of q8_0 KV with f16 KV, per position, on this server and llama-server.

Why: ``bench_kv_precision.py`` counts identical greedy continuations (20 prompts, 32 tokens). A
continuation splits at its first near-tie and never rejoins, so the count is dominated by a few
near-ties and says little about how far q8_0 moves the logits. This script asks each server for
the top log-probabilities at *every* position of one fixed path (llama-server f16's greedy
continuation of each prompt, fed as prompt + the first i tokens), so every server is judged at
the same positions, each position counts once, and the positions can be split by how clear the
reference's choice was (the gap between llama-server f16's two best log-probabilities).

For each program (ours, llama-server) it reports, over all positions and over those whose
reference gap exceeds each ``--gaps`` threshold:

- **argmax flips**: positions where its q8_0 run's best token differs from its own f16 run's;
- **|d logprob|**: the mean absolute change of the f16 run's best token's log-probability
  between its f16 and q8_0 runs (how far q8_0 moves the numbers, ties or not);
- the same two between the program's f16 run and llama-server's f16 run (how far apart the two
  programs' arithmetic is to begin with).

    python scripts/bench_kv_margins.py --prompts 20 --tokens 32            # SmolLM2-135M Q4_1
    python scripts/bench_kv_margins.py --configs mlxcel:f16,mlxcel:q8_0     # ours only

All servers are up at once; the requests go to each in turn (the machine's load is shared).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_kv_precision as bkp  # noqa: E402
import bench_quantized as bq  # noqa: E402
import benchlib  # noqa: E402
import httpx  # noqa: E402


def top_probs(client: httpx.Client, proc: benchlib.ServerProcess, prompt: list[int], n_probs: int) -> dict[int, float]:
    """The next token's ``n_probs`` best tokens and their log-probabilities (the KV of the prompt's
    prefix reused from the slot, as a decode step would have it)."""
    body = {"prompt": prompt, "n_predict": 1, "temperature": 0.0, "top_k": 1, "n_probs": n_probs,
            "cache_prompt": True, "return_tokens": True}
    r = client.post(proc.base_url + "/completion", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{proc.name}: /completion answered {r.status_code}: {r.text[:300]}")
    entry = r.json()["completion_probabilities"][0]
    return {int(t["id"]): float(t["logprob"]) for t in entry["top_logprobs"]}


def best(probs: dict[int, float]) -> int:
    return max(probs, key=lambda t: (probs[t], -t))


def gap(probs: dict[int, float]) -> float:
    lps = sorted(probs.values(), reverse=True)
    return lps[0] - lps[1] if len(lps) > 1 else float("inf")


def compare(a: list[dict[int, float]], b: list[dict[int, float]], gaps: list[float], ref_gap: list[float],
            floor: float) -> dict[str, Any]:
    """Argmax flips and mean |d logprob| of a's best token between a and b, at every position and
    at those whose reference gap exceeds each threshold. A token missing from b's top list counts
    at b's lowest listed log-probability (``floor`` where b lists none): a lower bound."""
    out = {}
    for g in [0.0, *gaps]:
        idx = [i for i, r in enumerate(ref_gap) if r > g or g == 0.0]
        flips = sum(best(a[i]) != best(b[i]) for i in idx)
        deltas = []
        for i in idx:
            t = best(a[i])
            lb = b[i].get(t, min(b[i].values(), default=floor))
            deltas.append(abs(a[i][t] - lb))
        out[f"gap>{g}"] = {"positions": len(idx), "flips": flips,
                           "mean_abs_dlogprob": sum(deltas) / max(len(deltas), 1)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="llama:f16,llama:q8_0,mlxcel:f16,mlxcel:q8_0")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--n-probs", type=int, default=8)
    parser.add_argument("--gaps", default="0.1,0.5", help="reference gaps (log-probability) to split by")
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    default_cache = str(Path.home() / ".cache" / "mlxcel_compat" / "bench-quantized")
    parser.add_argument("--cache-dir", default=os.environ.get("MLXCEL_BENCH_CACHE", default_cache))
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", str(bq.LLAMA_BIN / "llama-server")))
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--load-timeout", type=float, default=600.0)
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args()
    configs = [tuple(c.split(":", 1)) for c in args.configs.split(",")]
    gaps = [float(g) for g in args.gaps.split(",") if g]

    from mlxcel_compat.testing.real_model import ensure_real_model

    path = ensure_real_model()
    prompts = bq.prepare(str(path), 0, 1, args.prompts, args.tokens, reference=False)["prompts"][: args.prompts]
    print(f"file {path.name}; {len(prompts)} prompts x {args.tokens} positions; {len(configs)} servers up at once",
          flush=True)
    procs: dict[str, benchlib.ServerProcess] = {}
    probs: dict[str, list[dict[int, float]]] = {}
    try:
        for program, kv_type in configs:
            procs[f"{program}:{kv_type}"] = bkp.start(args, program, kv_type, path)
        labels = list(procs)
        ref_label = "llama:f16" if "llama:f16" in procs else labels[0]
        with httpx.Client(timeout=600) as client:
            paths = [bkp.complete(client, procs[ref_label], p, args.tokens, False)["tokens"] for p in prompts]
            for label in labels:
                probs[label] = [top_probs(client, procs[label], p + path_[:i], args.n_probs)
                                for p, path_ in zip(prompts, paths) for i in range(len(path_))]
                print(f"  {label}: {len(probs[label])} positions", flush=True)
    finally:
        for proc in procs.values():
            proc.stop(grace=30.0)

    ref_gap = [gap(p) for p in probs[ref_label]]
    floor = -30.0
    print(f"\nreference gaps (log-prob, {ref_label}): below 0.1 at {sum(g <= 0.1 for g in ref_gap)}, "
          f"below 0.5 at {sum(g <= 0.5 for g in ref_gap)} of {len(ref_gap)} positions")
    report: dict[str, Any] = {"positions": len(ref_gap), "ref": ref_label}
    pairs = [(f"{p}:f16", f"{p}:q8_0") for p in ("mlxcel", "llama")]
    pairs += [(f"{p}:f16", "llama:f16") for p in ("mlxcel",)]
    for a, b in pairs:
        if a in probs and b in probs:
            report[f"{a} vs {b}"] = r = compare(probs[a], probs[b], gaps, ref_gap, floor)
            for k, v in r.items():
                print(f"{a:12s} vs {b:12s} {k:8s}: {v['flips']:4d} argmax flips of {v['positions']:4d} positions, "
                      f"mean |d logprob| {v['mean_abs_dlogprob']:.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    benchlib.run(main)
