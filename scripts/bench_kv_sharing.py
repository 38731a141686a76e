#!/usr/bin/env python3
"""Shared KV blocks against whole-entry storage: what the prompt cache holds for many sessions
that share a long system prompt, and whether a budget that fits the unique KV keeps them all.

Issue 54's sharing check, in process on a generated model (the engine and its prompt cache, no
HTTP): ``--sessions`` sessions (64) each send the same ``--system-tokens`` system prompt (4096)
plus ``--own-tokens`` of their own (1024), one after another, greedy, ``--n-predict`` tokens each.

1. **Bytes.** The store's ``bytes`` after the sessions, against the KV of (system + sessions x own)
   tokens (goal: <= 1.1x), and against the same run with every entry stored whole
   (``PrefixCacheConfig.kv_block_tokens = 0``, the store as it was: about sessions x whole prompts).
2. **Budget.** ``--budget-factor`` (2) x the unique bytes, which is well below ``sessions`` whole
   copies: both stores run the sessions under that budget, then every session sends its next turn
   (its history plus ``--turn-tokens`` new ones). The hit fraction (adopted / prompt tokens of the
   second turns) against the ideal (every session's whole history adopted).

Both modes run in the same process, one after the other, on the same model. Example::

    python scripts/bench_kv_sharing.py                        # llama:tiny, 64 x (4096 + 1024)
    python scripts/bench_kv_sharing.py --model llama:small --sessions 16
"""

from __future__ import annotations

import argparse
import json
import queue
import random
import sys
import time
from dataclasses import dataclass
from typing import Any

import benchlib

sys.path.insert(0, str(benchlib.ROOT))

from mlxcel_compat.runtime.backend import load_optimized_blas  # noqa: E402

# The server's BLAS, loaded before MLX is: without it the prompt chunks run on the reference BLAS
# and NumPy's own, and a 1K-token chunk at 4K depth took ~5 s on a busy 2-core machine (the full
# 64 x (4096 + 1024) run did not finish).
load_optimized_blas()

from mlxcel_compat.cache.block_pool import KV_BLOCK_TOKENS  # noqa: E402
from mlxcel_compat.cache.key import RAW_PROMPT_TEMPLATE_SIG, TEXT_ONLY_MM_DIGEST  # noqa: E402
from mlxcel_compat.engine.core import Engine, EngineConfig  # noqa: E402
from mlxcel_compat.engine.prefix_cache import PrefixCache  # noqa: E402
from mlxcel_compat.engine.prefix_cache_config import PrefixCacheConfig  # noqa: E402
from mlxcel_compat.engine.request import CacheContext, ErrorEvent, FinishEvent, GenerationRequest, TokenEvent  # noqa: E402
from mlxcel_compat.engine.sampling.params import SamplingParams  # noqa: E402


@dataclass
class Turn:
    prompt: list[int]
    generated: list[int]
    n_cached: int


class Bench:
    """One engine with its prompt cache, driven one request at a time."""

    def __init__(self, model_dir: str, block_tokens: int, capacity: int, ctx: int, batch: int) -> None:
        config = PrefixCacheConfig(capacity_bytes=capacity, max_entries=4096, min_prefix=32, kv_block_tokens=block_tokens)
        self.engine = Engine(
            EngineConfig(model=model_dir, ctx_size=ctx, n_parallel=1, batch_size=batch),
            prefix_cache_factory=lambda engine: PrefixCache(engine, config),
        )
        self.engine.start()
        if not self.engine.wait_ready(600):
            raise RuntimeError(f"the engine did not start: {self.engine.load_error}")

    def run(self, prompt: list[int], session: str, n_predict: int) -> Turn:
        events: queue.Queue = queue.Queue()
        request = GenerationRequest(
            prompt_tokens=list(prompt),
            sampling=SamplingParams(temperature=0.0, seed=1234, ignore_eos=True),
            n_predict=n_predict,
            cache=CacheContext(enabled=True, session_key=session, template_sig=RAW_PROMPT_TEMPLATE_SIG,
                               mm_digest=TEXT_ONLY_MM_DIGEST),
        )
        self.engine.submit(request, events.put)
        generated: list[int] = []
        while True:
            event = events.get(timeout=600)
            if isinstance(event, TokenEvent):
                generated.append(event.token)
            elif isinstance(event, FinishEvent):
                return Turn(list(prompt), generated, event.n_cached)
            elif isinstance(event, ErrorEvent):
                raise RuntimeError(event.message)

    def stats(self) -> dict[str, Any]:
        return self.engine.call(self.engine.prefix_cache.stats).result(timeout=60)

    def set_capacity(self, capacity: int) -> None:
        def apply() -> None:
            self.engine.prefix_cache.store.capacity_bytes = capacity

        self.engine.call(apply).result(timeout=60)

    def close(self) -> None:
        self.engine.stop()


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 8000) for _ in range(n)]


def first_turns(bench: Bench, args: argparse.Namespace) -> list[Turn]:
    system = tokens(args.system_tokens, seed=1)
    return [bench.run(system + tokens(args.own_tokens, seed=100 + s), f"session-{s}", args.n_predict)
            for s in range(args.sessions)]


def second_turns(bench: Bench, turns: list[Turn], args: argparse.Namespace) -> dict[str, float]:
    """Every session's next turn: history (prompt + reply) + new tokens. Ideal: the entry of the
    first turn (prompt + the reply's tokens fed back: all but the last) adopted whole."""
    cached = ideal = prompt_tokens = 0
    for s, turn in enumerate(turns):
        prompt = turn.prompt + turn.generated + tokens(args.turn_tokens, seed=900 + s)
        second = bench.run(prompt, f"session-{s}", args.n_predict)
        cached += second.n_cached
        ideal += len(turn.prompt) + len(turn.generated) - 1
        prompt_tokens += len(prompt)
    return {"hit_fraction": cached / prompt_tokens, "ideal_hit_fraction": ideal / prompt_tokens,
            "sessions_fully_hit": cached == ideal}


def mode(model_dir: str, block_tokens: int, capacity: int | None, args: argparse.Namespace) -> dict[str, Any]:
    """Phase 1 under a large budget (the bytes), then, under ``capacity`` (None: ``--budget-factor``
    x this run's bytes), phase 1 again from an empty cache and every session's second turn."""
    ctx = args.system_tokens + args.own_tokens + 2 * args.n_predict + args.turn_tokens + 64
    bench = Bench(model_dir, block_tokens, 1 << 40, ctx, args.batch_size)
    try:
        t0 = time.perf_counter()
        first_turns(bench, args)
        stats = bench.stats()
        out: dict[str, Any] = {
            "kv_block_tokens": block_tokens, "first_turns_s": round(time.perf_counter() - t0, 1),
            "bytes": stats["bytes"], "kv_block_bytes": stats["kv_block_bytes"], "logical_bytes": stats["logical_bytes"], "logical_tokens": stats["logical_tokens"],
            "entries": stats["entries"], "sharing_ratio": stats["sharing_ratio"],
        }
        # entries keep their prompt's final logits (engine/prefix_cache.py: FINAL_LOGITS_MAX_SHARE), outside the KV
        out["logits_bytes"] = bench.engine.call(
            lambda: sum(e.nbytes - e.payload_nbytes for e in bench.engine.prefix_cache.store.entries())).result(timeout=60)
        out["bytes_per_token"] = (stats["logical_bytes"] - out["logits_bytes"]) / stats["logical_tokens"]
        if capacity is None:
            capacity = int(args.budget_factor * stats["bytes"])
        print(f"  [kv_block_tokens {block_tokens}] first turns: {out['first_turns_s']} s, {out['bytes']} bytes", file=sys.stderr, flush=True)
        bench.engine.call(lambda: bench.engine.prefix_cache.reset()).result(timeout=60)
        bench.set_capacity(capacity)
        turns = first_turns(bench, args)
        out.update(budget=capacity, **second_turns(bench, turns, args))
        out["evictions_lru"] = bench.stats()["evictions"]["lru"]
        return out
    finally:
        bench.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama:tiny", help="a model directory or family[:size] (generated)")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--system-tokens", type=int, default=4096)
    parser.add_argument("--own-tokens", type=int, default=1024)
    parser.add_argument("--turn-tokens", type=int, default=64)
    parser.add_argument("--n-predict", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--budget-factor", type=float, default=2.0, help="budget = this x the unique bytes")
    parser.add_argument("--block-tokens", type=int, default=KV_BLOCK_TOKENS)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    model_dir = benchlib.resolve_model(args.model, "tiny")

    shared = mode(model_dir, args.block_tokens, None, args)
    per_token = shared["bytes_per_token"]
    unique_tokens = args.system_tokens + args.sessions * args.own_tokens
    budget = shared["budget"]
    whole_copies = args.sessions * (args.system_tokens + args.own_tokens) * per_token
    assert shared["bytes"] < budget < whole_copies, "the budget must lie between the unique KV and the whole copies"
    whole = mode(model_dir, 0, budget, args)
    result = {
        "model": args.model, "sessions": args.sessions, "system_tokens": args.system_tokens, "own_tokens": args.own_tokens,
        "unique_kv_bytes": int(unique_tokens * per_token), "shared": shared, "whole": whole,
        "shared_vs_unique": shared["bytes"] / (unique_tokens * per_token),
        "whole_vs_unique": whole["bytes"] / (unique_tokens * per_token),
    }
    print(f"{args.sessions} sessions x ({args.system_tokens} shared + {args.own_tokens} own) tokens, "
          f"{args.n_predict} generated each; {per_token:.0f} KV bytes a token ({args.model})")
    print(f"  KV of (system + sessions x own) tokens: {result['unique_kv_bytes'] / 2**20:9.1f} MiB")
    for name, m in (("shared blocks", shared), ("whole entries", whole)):
        ratio = m["bytes"] / result["unique_kv_bytes"]
        kv_bytes = m["kv_block_bytes"] if m["kv_block_tokens"] else m["bytes"] - m["logits_bytes"]
        print(f"  {name:14s} store bytes {m['bytes'] / 2**20:9.1f} MiB = {ratio:5.2f}x unique (KV alone "
              f"{kv_bytes / result['unique_kv_bytes']:5.2f}x; the rest: kept final logits), sharing ratio "
              f"{m['sharing_ratio']:.2f}; budget {budget / 2**20:.1f} MiB: second-turn hit fraction "
              f"{m['hit_fraction']:.4f} (ideal {m['ideal_hit_fraction']:.4f}, all sessions whole: "
              f"{m['sessions_fully_hit']}), {m['evictions_lru']} LRU evictions")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["shared_vs_unique"] <= 1.1 and shared["sessions_fully_hit"] else 1


if __name__ == "__main__":
    benchlib.run(main)
