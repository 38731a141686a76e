#!/usr/bin/env python3
"""Replay n-gram drafting over one greedy answer: what each ``--spec-ngram-simple-size-n`` and
draft cap would give, without timing noise (issue 33).

Greedy output does not depend on speculation, so one plain answer of the edit workload
(``bench_speculative.py``) fixes every round: the rule (``speculative.ngram_simple_draft``, the
cap of ``Speculator.verified``) is replayed over it, and a round that verifies ``r`` rows is costed
``1 + per_row * (r - 1)`` steps (``--per-row``: measured 0.17-0.20 with float32 weights on these
cores, about 0.5 with ggml blocks). The figure is tokens per step-equivalent, the modelled
speed-up over plain decoding; a measured run (``bench_speculative.py``) stays the verdict.

    scripts/replay_ngram.py [--model FILE.gguf] [--per-row 0.17,0.2] [--n 12,6,4,3] [--caps 7,15,31]
    scripts/replay_ngram.py --measure --n 4 --caps 15   (the rounds run for real, CPU time, one thread)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--measure" in sys.argv:  # one thread of the BLAS and the shim, loaded before NumPy and MLX
    from mlxcel_compat.runtime import backend

    backend.load_optimized_blas(1, 1)

import httpx  # noqa: E402

import bench_speculative as bench  # noqa: E402


def plain_answer(model: Path, n_predict: int) -> tuple[list[int], list[int]]:
    """(prompt tokens, greedy answer tokens) of the edit workload from our server, plain."""
    cmd, port = bench.ours(model, [])
    server = bench.start("plain", cmd, port)
    try:
        prompt = bench.edit_prompt(server)
        with httpx.Client(base_url=server.base_url, timeout=600) as http:
            tokens = http.post("/tokenize", json={"content": prompt}).json()["tokens"]
            out = http.post("/completion", json={"prompt": prompt, "n_predict": n_predict, "temperature": 0,
                                                 "cache_prompt": False, "return_tokens": True}).json()
        return tokens, out["tokens"]
    finally:
        server.stop()


def replay(prompt: list[int], answer: list[int], size_n: int, size_m: int, cap_max: int, per_row: float) -> dict[str, float]:
    from mlxcel_compat.engine.speculative import NGRAM_CAP_MIN, ngram_simple_draft

    context, i, steps, rounds, drafted, accepted, cap = list(prompt), 0, 0.0, 0, 0, 0, cap_max
    while i < len(answer):
        draft = ngram_simple_draft(context, answer[i], size_n, size_m)[:cap][: len(answer) - i - 1]
        kept = 0
        while kept < len(draft) and draft[kept] == answer[i + 1 + kept]:
            kept += 1
        steps += 1 + per_row * len(draft)
        rounds, drafted, accepted = rounds + 1, drafted + len(draft), accepted + kept
        if draft:  # Speculator.verified's cap
            cap = min(2 * cap, cap_max) if kept == len(draft) else max(NGRAM_CAP_MIN, 2 * (kept + 1))
        context += answer[i : i + 1 + kept]
        i += 1 + kept
    return {"speedup": len(answer) / steps, "rounds": rounds, "drafted": drafted, "accepted": accepted}


def measure(model: Path, prompt: list[int], answer: list[int], size_n: int, size_m: int, cap_max: int,
            reps: int) -> dict[str, float]:
    """The replay run for real: the CPU decode runtime in this process (one thread) decodes the
    answer plainly (a step a token) and as the served rounds verify it (the pending token and its
    draft in one ``step_tokens`` pass, rejected positions trimmed), each ``reps`` times; the
    figure is the ratio of the CPU seconds (best of the reps: other processes disturb CPU time
    far less than wall-clock time). Every verified row's greedy pick is checked against the
    plain answer (speculation must not change the text)."""
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

    from mlxcel_compat.engine.speculative import NGRAM_CAP_MIN, ngram_simple_draft
    from mlxcel_compat.model.loader import load_model
    from mlxcel_compat.runtime.decode_kv import OwnedCache

    loaded = load_model(str(model), [])
    dec = loaded.decoder
    if dec is None:
        raise SystemExit("the CPU decode runtime does not run this model")

    def fresh() -> tuple[list, OwnedCache]:
        cache, owned = make_prompt_cache(loaded.model), OwnedCache()
        dec.prefill(prompt[:-1], cache, owned, logits=False)
        return cache, owned

    def plain() -> float:
        cache, owned = fresh()
        t0 = time.process_time()
        for token in [prompt[-1], *answer[:-1]]:
            int(np.argmax(dec.step(token, cache, owned)))
        return time.process_time() - t0

    def speculating() -> tuple[float, int]:
        cache, owned = fresh()
        fed = [prompt[-1], *answer]  # fed[i] is fed to produce answer[i]
        context, i, cap, rounds = list(prompt[:-1]), 0, cap_max, 0
        t0 = time.process_time()
        while i < len(answer):
            draft = ngram_simple_draft(context, fed[i], size_n, size_m)[:cap][: len(answer) - i - 1]
            rows = dec.step_tokens([fed[i], *draft], cache, owned)
            picks = [int(np.argmax(row)) for row in rows]
            kept = 0
            while kept < len(draft) and picks[kept] == draft[kept]:
                kept += 1
            if picks[: kept + 1] != answer[i: i + kept + 1]:
                raise SystemExit(f"verified rows at {i} disagree with the plain answer")
            if len(draft) > kept:
                trim_prompt_cache(cache, len(draft) - kept)
            if draft:
                cap = min(2 * cap, cap_max) if kept == len(draft) else max(NGRAM_CAP_MIN, 2 * (kept + 1))
            context += fed[i: i + kept + 1]
            i += kept + 1
            rounds += 1
        return time.process_time() - t0, rounds

    t_plain = min(plain() for _ in range(reps))
    spec = [speculating() for _ in range(reps)]
    t_spec = min(t for t, _ in spec)
    return {"plain_s": t_plain, "spec_s": t_spec, "speedup": t_plain / t_spec, "rounds": spec[0][1]}


def main() -> int:
    from mlxcel_compat.engine.speculative import NGRAM_CAP_MAX
    from mlxcel_compat.testing.real_model import ensure_real_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="GGUF of the edit workload (default: SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--n-predict", type=int, default=256)
    p.add_argument("--n", default="12,8,6,5,4,3", help="n-gram sizes to replay")
    p.add_argument("--m", type=int, default=48, help="--spec-ngram-simple-size-m")
    p.add_argument("--caps", default=str(NGRAM_CAP_MAX), help=f"draft caps to replay (served: {NGRAM_CAP_MAX})")
    p.add_argument("--per-row", default="0.17,0.2", help="cost of a verified row, in steps")
    p.add_argument("--measure", action="store_true", help="also run each n and cap for real in this process "
                   "(one thread) and give the CPU-time speed-up over plain decoding")
    p.add_argument("--reps", type=int, default=3, help="--measure: runs of each, best taken")
    args = p.parse_args()
    model = Path(args.model) if args.model else ensure_real_model()
    prompt, answer = plain_answer(model, args.n_predict)
    print(f"edit workload on {model.name}: {len(prompt)} prompt tokens, {len(answer)} answer tokens\n")
    if args.measure:
        print("| n | cap | measured speed-up (CPU time, 1 thread) | plain s | speculating s | rounds |\n|---|---|---|---|---|---|")
        for n in (int(x) for x in args.n.split(",")):
            for cap in (int(x) for x in args.caps.split(",")):
                r = measure(model, prompt, answer, n, args.m, cap, args.reps)
                print(f"| {n} | {cap} | {r['speedup']:.2f}x | {r['plain_s']:.3f} | {r['spec_s']:.3f} | {r['rounds']} |")
        print()
    print("| n | cap | per row | modelled speed-up | rounds | drafted | accepted |\n|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.n.split(",")):
        for cap in (int(x) for x in args.caps.split(",")):
            for per in (float(x) for x in args.per_row.split(",")):
                r = replay(prompt, answer, n, args.m, cap, per)
                print(f"| {n} | {cap} | {per:.2f} | {r['speedup']:.2f}x | {r['rounds']} | {r['drafted']} | {r['accepted']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
