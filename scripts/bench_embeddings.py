#!/usr/bin/env python3
"""Embeddings (issue 32): 64 short texts in one request against 64 single requests, on the CPU.

A real server (``python -m mlxcel_compat --embeddings --pooling last``) on loopback, the factory's
``qwen3`` model (``--size``, ``small`` by default: 768 hidden, 12 layers). The texts are 64
different short sentences (6-15 tokens). Measured side by side, interleaved
(``benchlib.interleaved``), over HTTP with one keep-alive client:

- **batched**: one ``POST /v1/embeddings`` with all 64 texts as ``input`` (the engine runs them in
  as few padded forward passes as ``--ubatch-size`` allows: one, here);
- **sequential**: 64 requests of one text each, one after the other;
- **concurrent**: the same 64 single requests in flight at once (8 client threads): each is still
  its own forward pass, since an embedding request runs as one engine call.

Reported: milliseconds per round (64 embeddings), medians over ``--reps`` [min-max], and the
speed-up of the batched request (goal: at least 3x over the sequential single requests). The
vectors of both sides are compared too (largest difference; they must agree to float rounding).

    python scripts/bench_embeddings.py [--size small] [--reps 5]
    python scripts/bench_embeddings.py --model bert-small   # the factory's BERT encoder, bge-small's shape
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchlib  # noqa: E402

WORDS = ("river stone market window garden silver quiet morning engine paper north winter orange "
         "bridge candle forest letter mountain harbor music").split()


def texts(n: int = 64) -> list[str]:
    """n different short sentences, 6-15 tokens with the factory vocabulary."""
    out = []
    for i in range(n):
        k = 3 + i % 6
        out.append("The " + " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(k)) + f" number {i}.")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--model", default="", help="a model directory or GGUF instead of the factory qwen3 "
                        "(or a factory encoder: bert, bert-small, xlm-roberta, nomic-bert)")
    parser.add_argument("--pooling", default="", help="--pooling for the server (default: last for the factory "
                        "qwen3, the model's own for --model)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--n", type=int, default=64)
    args = parser.parse_args()
    model = args.model or benchlib.resolve_model(f"qwen3:{args.size}", args.size)
    if args.model in ("bert", "bert-small", "xlm-roberta", "nomic-bert"):
        from mlxcel_compat.testing.encoders import ensure_encoder

        model = str(ensure_encoder(args.model))
    pooling = args.pooling or ("" if args.model else "last")
    ctx = [] if args.model else ["-c", "4096"]  # an encoder's context is its position table
    server = benchlib.ServerProcess.mlxcel(model, ["--embeddings", *(["--pooling", pooling] if pooling else []),
                                                   "-np", "8", *ctx], name="embeddings")
    server.start()
    try:
        server.wait_healthy(300)
        inputs = texts(args.n)
        with httpx.Client(base_url=server.base_url, timeout=300) as c:
            n_tokens = c.post("/v1/embeddings", json={"input": inputs}).json()["usage"]["prompt_tokens"]
            pool = concurrent.futures.ThreadPoolExecutor(8)

            def one(text: str) -> list[float]:
                r = c.post("/v1/embeddings", json={"input": text})
                r.raise_for_status()
                return r.json()["data"][0]["embedding"]

            def batched() -> float:
                t0 = time.perf_counter()
                r = c.post("/v1/embeddings", json={"input": inputs})
                r.raise_for_status()
                return (time.perf_counter() - t0) * 1000

            def sequential() -> float:
                t0 = time.perf_counter()
                for text in inputs:
                    one(text)
                return (time.perf_counter() - t0) * 1000

            def concurrent_() -> float:
                t0 = time.perf_counter()
                list(pool.map(one, inputs))
                return (time.perf_counter() - t0) * 1000

            runs = benchlib.interleaved({"batched": batched, "sequential": sequential, "concurrent": concurrent_}, args.reps)
            together = c.post("/v1/embeddings", json={"input": inputs}).json()["data"]
            alone = [one(t) for t in inputs]
            pool.shutdown()
        diff = max(abs(a - b) for x, y in zip(together, alone) for a, b in zip(x["embedding"], y))
        print(f"model {Path(model).name}: {args.n} texts, {n_tokens} tokens in all; ms per round of {args.n} embeddings, "
              f"median over {args.reps} [min-max]")
        med = {name: statistics.median(values) for name, values in runs.items()}
        for name, values in runs.items():
            print(f"  {name:<11} {med[name]:8.1f} ms  [{min(values):.1f}-{max(values):.1f}]  "
                  f"{args.n / med[name] * 1000:7.1f} embeddings/s")
        print(f"batched request: {med['sequential'] / med['batched']:.2f}x faster than sequential single requests "
              f"(goal >= 3x), {med['concurrent'] / med['batched']:.2f}x than concurrent ones")
        print(f"largest difference between batched and single vectors: {diff:.2e}")
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    benchlib.run(main)
