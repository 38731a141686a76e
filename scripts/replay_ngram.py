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
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import httpx

import bench_speculative as bench
from benchlib import ROOT

sys.path.insert(0, str(ROOT))


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
    args = p.parse_args()
    model = Path(args.model) if args.model else ensure_real_model()
    prompt, answer = plain_answer(model, args.n_predict)
    print(f"edit workload on {model.name}: {len(prompt)} prompt tokens, {len(answer)} answer tokens\n")
    print("| n | cap | per row | modelled speed-up | rounds | drafted | accepted |\n|---|---|---|---|---|---|---|")
    for n in (int(x) for x in args.n.split(",")):
        for cap in (int(x) for x in args.caps.split(",")):
            for per in (float(x) for x in args.per_row.split(",")):
                r = replay(prompt, answer, n, args.m, cap, per)
                print(f"| {n} | {cap} | {per:.2f} | {r['speedup']:.2f}x | {r['rounds']} | {r['drafted']} | {r['accepted']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
