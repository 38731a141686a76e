#!/usr/bin/env python3
"""Replay n-gram drafting over the edit workload's greedy answers: what each ``--spec-type``,
``--spec-ngram-simple-size-n`` and draft cap would give, without timing noise (issues 33, 51).

Greedy output does not depend on speculation, so the plain answers of the edit workload
(``bench_speculative.py``: its ``EDITS``, ``--edits N`` the first N) fix every round: the served
drafting (``Speculator.propose`` and ``verified``, with its cap) is replayed over them, and a round
that verifies ``r`` rows is costed ``1 + per_row * (r - 1)`` steps (``--per-row``: 0.14-0.16 for
SmolLM2 Q4_1's 8-16 rows by ``bench_draft_rows.py``, 0.17-0.20 with float32 weights). The figure
is tokens per step-equivalent, the modelled speed-up over plain decoding, each file's and the
files' together; a measured run (``bench_speculative.py``) stays the verdict.

    scripts/replay_ngram.py [--model FILE.gguf] [--per-row 0.15] [--n 12,4] [--caps 7,15,31]
        [--spec-types ngram-simple --spec-types ngram-simple,ngram-cache]
    scripts/replay_ngram.py --measure --n 4 --caps 15   (the rounds run for real, CPU time, one thread)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--measure" in sys.argv:  # one thread of the BLAS and the shim, loaded before NumPy and MLX
    from mlxcel_compat.runtime import backend

    backend.load_optimized_blas(1, 1)

import httpx  # noqa: E402

import bench_speculative as bench  # noqa: E402


def plain_answers(model: Path, n_predict: int, edits: int) -> list[tuple[str, list[int], list[int]]]:
    """(file, prompt tokens, greedy answer tokens) of the edit workload's first ``edits`` files,
    from our server decoding plainly."""
    cmd, port = bench.ours(model, [])
    server = bench.start("plain", cmd, port)
    try:
        out = []
        for edit in bench.EDITS[:edits]:
            prompt = bench.edit_prompt(server, edit)
            with httpx.Client(base_url=server.base_url, timeout=600) as http:
                tokens = http.post("/tokenize", json={"content": prompt}).json()["tokens"]
                answer = http.post("/completion", json={"prompt": prompt, "n_predict": n_predict, "temperature": 0,
                                                        "cache_prompt": False, "return_tokens": True}).json()
            out.append((edit.name, tokens, answer["tokens"]))
        return out
    finally:
        server.stop()


def speculator(types: str, size_n: int, size_m: int, cap_max: int) -> Any:
    """The server's drafting for these settings, its cap at most ``cap_max`` (the served cap is
    ``speculative.NGRAM_CAP_MAX``, which ``verified`` reads when it doubles the cap)."""
    from mlxcel_compat.engine import speculative

    config = speculative.resolve(speculative.parse_types(types), None, ngram_size_n=size_n, ngram_size_m=size_m)
    speculative.NGRAM_CAP_MAX = cap_max
    table = speculative.NgramModTable(config.mod_n_match) if "ngram-mod" in config.active else None
    drafting = speculative.Speculator(config, None, table)
    drafting.ngram_cap = cap_max
    return drafting


def replay(prompt: list[int], answer: list[int], drafting: Any, per_row: float) -> dict[str, float]:
    context, i, steps, rounds, undrafted, drafted, accepted = list(prompt), 0, 0.0, 0, 0, 0, 0
    while i < len(answer):
        draft = drafting.propose(context, answer[i], len(answer) - i - 1)
        undrafted += not draft
        kept = 0
        while kept < len(draft) and draft[kept] == answer[i + 1 + kept]:
            kept += 1
        steps += 1 + per_row * len(draft)
        rounds, drafted, accepted = rounds + 1, drafted + len(draft), accepted + kept
        if draft:
            drafting.verified(len(draft), kept)
        context += answer[i : i + 1 + kept]
        i += 1 + kept
    return {"tokens": len(answer), "steps": steps, "rounds": rounds, "undrafted": undrafted, "drafted": drafted,
            "accepted": accepted}


def measure(model: Path, prompt: list[int], answer: list[int], make_drafting: Any, reps: int) -> dict[str, float]:
    """The replay run for real: the CPU decode runtime in this process (one thread) decodes the
    answer plainly (a step a token) and as the served rounds verify it (the pending token and its
    draft in one ``step_tokens`` pass, rejected positions trimmed), each ``reps`` times; the
    figure is the ratio of the CPU seconds (best of the reps: other processes disturb CPU time
    far less than wall-clock time). Every verified row's greedy pick is checked against the
    plain answer (speculation must not change the text)."""
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

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
        drafting = make_drafting()
        fed = [prompt[-1], *answer]  # fed[i] is fed to produce answer[i]
        context, i, rounds = list(prompt[:-1]), 0, 0
        t0 = time.process_time()
        while i < len(answer):
            draft = drafting.propose(context, fed[i], len(answer) - i - 1)
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
                drafting.verified(len(draft), kept)
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
    p.add_argument("--edits", type=int, default=len(bench.EDITS), help="the edit workload's first N files")
    p.add_argument("--spec-types", action="append", help="a --spec-type to replay (repeatable; default ngram-simple)")
    p.add_argument("--n", default="12,8,6,5,4,3", help="ngram-simple sizes to replay")
    p.add_argument("--m", type=int, default=48, help="--spec-ngram-simple-size-m")
    p.add_argument("--caps", default=str(NGRAM_CAP_MAX), help=f"draft caps to replay (served: {NGRAM_CAP_MAX})")
    p.add_argument("--per-row", default="0.15", help="cost of a verified row, in steps")
    p.add_argument("--measure", action="store_true", help="also run each setting for real in this process "
                   "(one thread) and give the CPU-time speed-up over plain decoding")
    p.add_argument("--reps", type=int, default=3, help="--measure: runs of each, best taken")
    args = p.parse_args()
    model = Path(args.model) if args.model else ensure_real_model()
    answers = plain_answers(model, args.n_predict, args.edits)
    print(f"edit workload on {model.name}: " + ", ".join(f"{name} {len(prompt)} prompt and {len(answer)} answer tokens"
                                                           for name, prompt, answer in answers) + "\n")
    settings = [(types, n, cap) for types in (args.spec_types or ["ngram-simple"])
                for n in (int(x) for x in args.n.split(",")) for cap in (int(x) for x in args.caps.split(","))]
    if args.measure:
        print("| --spec-type | n | cap | file | measured speed-up (CPU time, 1 thread) | plain s | speculating s | rounds |\n"
              "|---|---|---|---|---|---|---|---|")
        for types, n, cap in settings:
            for name, prompt, answer in answers:
                r = measure(model, prompt, answer, lambda: speculator(types, n, args.m, cap), args.reps)
                print(f"| {types} | {n} | {cap} | {name} | {r['speedup']:.2f}x | {r['plain_s']:.3f} | {r['spec_s']:.3f} | "
                      f"{r['rounds']} |")
        print()
    names = [name for name, _, _ in answers]
    print(f"| --spec-type | n | cap | per row | {' | '.join(names)} | together | rounds (no draft) | drafted | accepted |\n"
          f"|---|---|---|---|{'---|' * len(names)}---|---|---|---|")
    for types, n, cap in settings:
        for per in (float(x) for x in args.per_row.split(",")):
            runs = [replay(prompt, answer, speculator(types, n, args.m, cap), per) for _, prompt, answer in answers]
            each = " | ".join(f"{r['tokens'] / r['steps']:.2f}x" for r in runs)
            total = {k: sum(r[k] for r in runs) for k in runs[0]}
            print(f"| {types} | {n} | {cap} | {per:.2f} | {each} | {total['tokens'] / total['steps']:.2f}x | "
                  f"{total['rounds']} ({total['undrafted']}) | {total['drafted']} | {total['accepted']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
