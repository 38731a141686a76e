#!/usr/bin/env python
"""Structured output: what a grammar costs, measured side by side in one run.

Three measurements, all in this process (no HTTP, so only the grammar's cost shows):

1. **Decode tokens/s, constrained against unconstrained**, on the engine with a generated model
   (``--model``, default the small llama, float32), at B = 1 and B = 8 concurrent sequences. The
   constrained run decodes under a JSON schema of 10 properties (``SCHEMA``); the unconstrained run
   decodes the same prompts with the same seeds, ``ignore_eos`` and, per sequence, exactly as many
   tokens as its constrained twin produced, so both do the same work apart from the grammar.
   Rate: all tokens after each sequence's first one, divided by the span from the first first token
   to the last token (the aggregate decode rate of the batch). Each repetition runs C U C (the
   constrained rate is the mean of the two C runs around U, which cancels drift on a shared
   machine); the reported ratio is the median of the per-repetition ratios. Goal: >= 90 % at both B.
2. **Mask time per token on a 150k-token vocabulary**: a byte-level BPE tokenizer of 150,000
   entries (``testing.tokenizer.large_tokenizer_json``), the same schema, and seeded random walks
   through it (each step picks a token among those the mask allows). Timed per token: llguidance's
   mask computation, the unpacking to the boolean row the sampler uses, and the 8 masks of a
   batched step (eight states, as ``compute_masks`` computes them). Goal: p50 <= 0.2 ms, p99 <= 2 ms.
   Also: what the vocabulary holds (tokens a JSON string may hold whole, partial UTF-8 characters,
   tokens with a quote, backslash or control character), its byte trie's nodes per token (the
   walk no slice covers; llguidance's docs put real tokenizers at about 2), and the mask time
   with the engine's slices (``MASK_SLICES``) against llguidance's default ones, interleaved over
   2 rounds of walks.
   ``--tokenizer FILE`` (repeatable) runs the same walks on a real vocabulary as well: a
   ``tokenizer.json``, or a tiktoken BPE file (``*.tiktoken``, converted by transformers'
   ``TikTokenConverter``). No hub is reachable here, but some PyPI packages ship one, e.g. Qwen's
   151,643-token vocabulary in ``dashscope`` (``dashscope/resources/qwen.tiktoken``;
   docs/benchmarks/structured-output.md gives the commands). The factory's invented words make a
   wider byte trie than a real vocabulary's, and the walk behind a slow mask is that trie, so the
   two are reported side by side.
3. **Compile time** of that schema: first request (compilation) against a repeat (the cache), on
   both vocabularies, plus the one-off llguidance tokenizer build.

Usage::

    .venv/bin/python scripts/bench_structured.py                 # small model, 5 repetitions
    .venv/bin/python scripts/bench_structured.py --model llama:tiny --reps 2 --walks 5
    .venv/bin/python scripts/bench_structured.py --tokenizer /tmp/qwen.tiktoken
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlxcel_compat.runtime.backend import load_optimized_blas  # noqa: E402

import benchlib  # noqa: E402

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999999},
        "name": {"type": "string", "maxLength": 16},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "notes": {"anyOf": [{"type": "string", "maxLength": 20}, {"type": "null"}]},
    },
    "required": ["id", "name", "email", "age", "score", "active", "role", "tags", "address", "notes"],
    "additionalProperties": False,
}
PROMPT = "Return the user record as JSON. Record:"


# ---------------------------------------------------------------------- 1. decode throughput


def run_batch(engine: Any, lark: str | None, seeds: list[int], n_predict: list[int]) -> tuple[list[int], float]:
    """Run len(seeds) sequences at once; return their token counts and the aggregate decode rate."""
    from mlxcel_compat.engine.grammar import Constraint
    from mlxcel_compat.engine.request import CacheContext, ErrorEvent, FinishEvent, GenerationRequest, TokenEvent
    from mlxcel_compat.engine.sampling.params import SamplingParams

    prompt = list(engine.loaded.tokenizer.encode(PROMPT))
    sinks: list[queue.Queue] = []
    for seed, n in zip(seeds, n_predict):
        request = GenerationRequest(
            prompt_tokens=prompt,
            sampling=SamplingParams(temperature=1.0, seed=seed, ignore_eos=lark is None),
            n_predict=n,
            cache=CacheContext(enabled=False),
            constraint=Constraint(lark=lark) if lark else None,
        )
        events: queue.Queue = queue.Queue()
        engine.submit(request, lambda e, q=events: q.put((time.perf_counter(), e)))
        sinks.append(events)
    counts, firsts, lasts = [], [], []
    for events in sinks:
        times = []
        while True:
            t, event = events.get(timeout=600)
            if isinstance(event, TokenEvent):
                times.append(t)
            elif isinstance(event, ErrorEvent):
                raise RuntimeError(event.message)
            elif isinstance(event, FinishEvent):
                break
        counts.append(len(times))
        firsts.append(times[0])
        lasts.append(times[-1])
    span = max(lasts) - min(firsts)
    return counts, (sum(counts) - len(counts)) / span


def bench_decode(model_dir: str, batch_sizes: list[int], reps: int) -> list[dict[str, Any]]:
    from mlxcel_compat.engine.core import Engine, EngineConfig
    from mlxcel_compat.engine.grammar import lark_from_json_schema

    engine = Engine(EngineConfig(model=model_dir, ctx_size=4096, n_parallel=max(batch_sizes), batch_size=256))
    engine.start()
    assert engine.wait_ready(300), engine.load_error
    lark = lark_from_json_schema(SCHEMA)
    engine.grammars.compile(lark)
    rows = []
    try:
        for b in batch_sizes:
            run_batch(engine, lark, list(range(b)), [400] * b)  # warm-up
            ratios, constrained, free, tokens = [], [], [], []
            for rep in range(reps):
                # C U C: the free twin needs the constrained token counts, and the two constrained
                # runs around it (same seeds, same tokens) cancel drift on a shared machine.
                seeds = [1000 * rep + i for i in range(b)]
                counts, before = run_batch(engine, lark, seeds, [400] * b)
                _, rate_free = run_batch(engine, None, seeds, counts)
                again, after = run_batch(engine, lark, seeds, [400] * b)
                assert again == counts, "constrained runs must be reproducible"
                rate_constrained = (before + after) / 2
                constrained.append(rate_constrained)
                free.append(rate_free)
                ratios.append(rate_constrained / rate_free)
                tokens.append(sum(counts))
            rows.append(
                {
                    "batch": b,
                    "constrained_tok_s": statistics.median(constrained),
                    "unconstrained_tok_s": statistics.median(free),
                    "ratio_median": statistics.median(ratios),
                    "ratios": ratios,
                    "tokens_per_run": tokens,
                }
            )
    finally:
        engine.stop()
    return rows


# ---------------------------------------------------------------------- 2. and 3. masks, compile


def large_compiler(vocab_size: int) -> tuple[Any, Any, float]:
    from transformers import PreTrainedTokenizerFast

    from mlxcel_compat.engine.grammar import GrammarCompiler
    from mlxcel_compat.testing.tokenizer import ENDOFTEXT, IM_END, large_tokenizer_json

    hf = PreTrainedTokenizerFast(tokenizer_object=__import__("tokenizers").Tokenizer.from_str(large_tokenizer_json(vocab_size)))
    eog = [hf.convert_tokens_to_ids(IM_END), hf.convert_tokens_to_ids(ENDOFTEXT)]
    compiler = GrammarCompiler(hf, vocab_size, eog)
    t0 = time.perf_counter()
    compiler.tokenizer  # noqa: B018 - builds it
    return compiler, hf, time.perf_counter() - t0


def real_compiler(path: Path) -> tuple[Any, Any, float]:
    """A compiler over a real vocabulary from ``path``: a tokenizer.json or a tiktoken BPE file.

    Its end-of-generation ids are the special added tokens named like an end (``<|endoftext|>``,
    ``<｜end▁of▁sentence｜>``); a tiktoken file gets ``<|endoftext|>`` appended, as its models do.
    """
    import tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from mlxcel_compat.engine.grammar import GrammarCompiler

    if path.suffix == ".tiktoken":
        backend = TikTokenConverter(vocab_file=str(path), extra_special_tokens=["<|endoftext|>"]).converted()
    else:
        backend = tokenizers.Tokenizer.from_file(str(path))
    hf = PreTrainedTokenizerFast(tokenizer_object=backend)
    ends = [i for i, t in sorted(hf.added_tokens_decoder.items()) if t.special and "end" in t.content.lower()]
    compiler = GrammarCompiler(hf, len(hf), ends[:2])
    t0 = time.perf_counter()
    compiler.tokenizer  # noqa: B018 - builds it
    return compiler, hf, time.perf_counter() - t0


def bench_masks(compiler: Any, hf: Any, walks: int, seed: int = 7) -> dict[str, Any]:
    import numpy as np

    from mlxcel_compat.engine.grammar import Constraint, lark_from_json_schema, unpack_masks

    lark = lark_from_json_schema(SCHEMA)
    rng = np.random.default_rng(seed)
    eog = set(compiler.eog_ids)
    compute, unpack, batch8 = [], [], []
    bits = np.zeros((8, compiler.mask_words), dtype=np.int32)
    n_tokens = 0
    for _ in range(walks):
        # Eight sequences walking the same document: the first one's mask is timed on its own,
        # then the eight masks of a batched step (each grammar state seen for the first time).
        states = [compiler.new_state(Constraint(lark=lark), hf) for _ in range(8)]
        lead = states[0]
        while not lead.complete:
            t0 = time.perf_counter()
            lead.fill_mask(bits[0])
            compute.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            mask = unpack_masks(bits[:1], compiler.vocab_size)[0]
            unpack.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for row, state in zip(bits[1:], states[1:]):
                state.fill_mask(row)
            unpack_masks(bits, compiler.vocab_size)
            batch8.append(time.perf_counter() - t0 + compute[-1])
            allowed = [t for t in np.flatnonzero(mask) if t not in eog]
            if not allowed:
                break
            token = int(rng.choice(allowed))
            for state in states:
                state.accept(token)
            n_tokens += 1
    ms = lambda xs, p: 1000.0 * benchlib.pct(xs, p)  # noqa: E731
    return {
        "tokens": n_tokens,
        "compute_p50_ms": ms(compute, 50),
        "compute_p99_ms": ms(compute, 99),
        "unpack_p50_ms": ms(unpack, 50),
        "unpack_p99_ms": ms(unpack, 99),
        "batch8_p50_ms": ms(batch8, 50),
        "batch8_p99_ms": ms(batch8, 99),
        "compute_max_ms": 1000.0 * max(compute),
    }


def vocabulary_shape(compiler: Any) -> tuple[dict[str, int], float]:
    """What the vocabulary holds, in one pass over its tokens: how many a JSON string may hold
    whole (llguidance's string slices can cover them), how many are partial UTF-8 characters, and
    how many hold a quote, backslash or control char; and its byte trie's nodes (one per distinct
    token prefix) per token, the size of the walk behind a mask that no slice covers (llguidance's
    docs/optimizations.md: "around 2 * n_vocab nodes" for real tokenizers)."""
    import re

    must_escape = re.compile(r'["\\\x00-\x1f\x7f]')
    kinds = {"json_string": 0, "partial_utf8": 0, "quote_backslash_control_or_empty": 0}
    prefixes: set[bytes] = set()
    tokenizer = compiler.tokenizer
    for token in range(compiler.vocab_size):
        data = tokenizer.decode_bytes([token])
        prefixes.update(data[:i] for i in range(1, len(data) + 1))
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            kinds["partial_utf8"] += 1
            continue
        kinds["quote_backslash_control_or_empty" if not text or must_escape.search(text) else "json_string"] += 1
    return kinds, len(prefixes) / compiler.vocab_size


def compare_slices(compiler: Any, hf: Any, walks: int) -> dict[str, list[float]]:
    """Mask p99 (ms) with the engine's slices against llguidance's defaults, 2 interleaved rounds."""
    import llguidance

    ours = compiler.tokenizer
    variants = {"engine (MASK_SLICES)": ours, "llguidance default": ours.with_slices(llguidance.LLTokenizer.general_slices())}
    p99: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for round_ in range(2):
            for name, tokenizer in variants.items():
                compiler._ll_tokenizer = tokenizer  # benchmark only: the same vocabulary, other slices
                compiler._compiled.clear()
                p99[name].append(bench_masks(compiler, hf, walks, seed=8 + round_)["compute_p99_ms"])
    finally:
        compiler._ll_tokenizer = ours
        compiler._compiled.clear()
    return p99


def bench_compile(compiler: Any) -> dict[str, float]:
    from mlxcel_compat.engine.grammar import lark_from_json_schema

    lark = lark_from_json_schema(SCHEMA)
    t0 = time.perf_counter()
    compiler.compile(lark)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiler.compile(lark)
    repeat = time.perf_counter() - t0
    return {"first_ms": 1000.0 * first, "cached_ms": 1000.0 * repeat}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama:small", help="a model directory or family[:size] (default llama:small)")
    parser.add_argument("--batch", default="1,8", help="concurrent sequences, comma-separated (default 1,8)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--vocab", type=int, default=150_000, help="vocabulary of the mask benchmark")
    parser.add_argument("--walks", type=int, default=20, help="random documents walked through the mask benchmark")
    parser.add_argument("--tokenizer", action="append", default=[], type=Path, metavar="FILE",
                        help="also walk a real vocabulary: a tokenizer.json or a *.tiktoken file (repeatable)")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    load_optimized_blas()

    model_dir = benchlib.resolve_model(args.model, "small")
    results: dict[str, Any] = {"model": args.model, "schema_properties": len(SCHEMA["properties"])}
    results["decode"] = bench_decode(model_dir, [int(b) for b in args.batch.split(",")], args.reps)
    print("\nDecode tok/s, constrained (10-property JSON schema) vs unconstrained, same tokens")
    print(f"{'B':>3} {'constrained':>12} {'free':>10} {'ratio':>7}  per-rep ratios")
    for row in results["decode"]:
        reps = " ".join(f"{r:.3f}" for r in row["ratios"])
        print(f"{row['batch']:>3} {row['constrained_tok_s']:>12.1f} {row['unconstrained_tok_s']:>10.1f} {row['ratio_median']:>7.3f}  {reps}")

    compiler, hf, build_s = large_compiler(args.vocab)
    kinds, nodes_per_token = vocabulary_shape(compiler)
    results["large_vocab"] = {"vocab": args.vocab, "tokenizer_build_s": build_s, "compile": bench_compile(compiler), "masks": bench_masks(compiler, hf, args.walks),
                              "kinds": kinds, "trie_nodes_per_token": nodes_per_token, "slices_p99_ms": compare_slices(compiler, hf, args.walks)}
    from transformers import AutoTokenizer

    from mlxcel_compat.engine.grammar import GrammarCompiler

    small_hf = AutoTokenizer.from_pretrained(model_dir)
    small = GrammarCompiler(small_hf, len(small_hf), sorted({small_hf.eos_token_id}))
    small.tokenizer  # noqa: B018 - built before timing the compile
    results["model_vocab"] = {"vocab": len(small_hf), "compile": bench_compile(small)}

    lv = results["large_vocab"]
    m = lv["masks"]
    print(f"\nMask per token, {args.vocab}-token vocabulary, {m['tokens']} tokens over {args.walks} documents")
    print(f"  llguidance mask:            p50 {m['compute_p50_ms']:.3f} ms   p99 {m['compute_p99_ms']:.3f} ms   max {m['compute_max_ms']:.3f} ms")
    print(f"  unpack to a boolean row:    p50 {m['unpack_p50_ms']:.3f} ms   p99 {m['unpack_p99_ms']:.3f} ms")
    print(f"  8 masks of a batched step:  p50 {m['batch8_p50_ms']:.3f} ms   p99 {m['batch8_p99_ms']:.3f} ms")
    print("  vocabulary: " + ", ".join(f"{n:,} {kind.replace('_', ' ')}" for kind, n in lv["kinds"].items())
          + f"; its byte trie has {lv['trie_nodes_per_token']:.2f} nodes per token")
    for name, values in lv["slices_p99_ms"].items():
        print(f"  mask p99 with {name} slices, 2 rounds (seeds 8, 9): " + " / ".join(f"{v:.3f}" for v in values) + " ms")
    results["real_vocabularies"] = []
    for path in args.tokenizer:
        real, real_hf, real_build_s = real_compiler(path)
        real_kinds, real_nodes = vocabulary_shape(real)
        rounds = [bench_masks(real, real_hf, args.walks, seed=seed) for seed in (7, 8)]
        results["real_vocabularies"].append({"file": str(path), "vocab": real.vocab_size, "tokenizer_build_s": real_build_s,
                                             "kinds": real_kinds, "trie_nodes_per_token": real_nodes, "masks": rounds})
        print(f"\nMask per token, real vocabulary {path.name} ({real.vocab_size:,} tokens, {real_nodes:.2f} trie nodes per token), "
              f"2 rounds of {args.walks} documents (seeds 7, 8):")
        for m in rounds:
            print(f"  {m['tokens']} tokens: p50 {m['compute_p50_ms']:.3f} ms   p99 {m['compute_p99_ms']:.3f} ms   max {m['compute_max_ms']:.3f} ms")
    print(f"\nllguidance tokenizer build ({args.vocab} tokens): {lv['tokenizer_build_s']:.2f} s")
    for name in ("large_vocab", "model_vocab"):
        c = results[name]["compile"]
        print(f"Schema compile, {results[name]['vocab']}-token vocabulary: first {c['first_ms']:.2f} ms, cached repeat {c['cached_ms']:.4f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    benchlib.run(main)
