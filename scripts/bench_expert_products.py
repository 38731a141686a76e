#!/usr/bin/env python3
"""An MoE layer's expert products on ggml's blocks, by path (issue 56).

One stack of experts of valid random blocks (default: Qwen3-30B-A3B's gate projection, 128
experts of 768 x 2048 Q4_K), the chosen experts of ``--tokens`` tokens (top-``--top-k``, random),
multiplied:

- ``grouped``: ``ExpertStack.grouped_matmul`` (``mlxcel_expert_matmul_shared``) on rows gathered
  beforehand, one per (token, expert) pair: the pairs sorted by expert, one native call, each
  chosen expert's rows once for its group of rows, each pair's row quantized (the path before
  issue 56's steps; the NumPy sort and gather timed apart as ``sort+gather``);
- ``by-source``: the same call on the tokens' own rows, each pair pointing at its token's row, so
  each token's row is quantized once for all its experts (what ``BlockSwitchLinear`` does now);
- ``gate+up x2``: two ``by-source`` calls, as a ``SwitchGLU``'s gate and up took before;
- ``gate+up``: both stacks in one call (``grouped_matmuls``: one sort, one quantization, one pool
  job; what ``BlockSwitchGLU`` does); its GMAC/s count both products;
- ``layer (mlx-lm)`` and ``layer``: a whole expert MLP (gate, up and down stacks of the type,
  SwiGLU) on MLX input, by mlx-lm's ``SwitchGLU`` call over ``BlockSwitchLinear`` projections
  (each projection evaluates its input and sorts its pairs; 64 pairs or more sorted by MLX first:
  the path before issue 56's steps) and by ``BlockSwitchGLU`` (one sort, gate and up in one call,
  down on the sorted rows, two MLX evaluations); the glue around the products counts here;
- ``per-expert``: one ``BlockWeight.matmul`` call per chosen expert on its group's rows (the
  same decode kernels, one pool start per expert);
- ``tiles``: the same per-expert calls by the prompt path of dense layers (float32 tiles and the
  BLAS's sgemm).

With ``--gguf FILE``, instead: decode steps of that MoE file's model (``load_model``, one token a
step after a 4-token prompt, ``--steps`` of them), their median and best milliseconds by MLX's
step (and the ``mx.eval`` calls it makes) and by the CPU decode runtime, alternating.

Reported: milliseconds (best of ``--reps``) and GMAC/s; the paths run in turn, so a machine's
drift falls on all of them. On a shared machine only the best of several short runs means much.

Examples::

    python scripts/bench_expert_products.py
    python scripts/bench_expert_products.py --gguf /tmp/bench-moe/qwen3_moe-8l-shaped-v1-q4_k_m.gguf --steps 100
    python scripts/bench_expert_products.py --tokens 1,8,512 --type mxfp4 --experts 32 --rows 2880 --k 2880 --top-k 4
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlxcel_compat.runtime import backend  # noqa: E402

backend.load_optimized_blas()  # before NumPy's first product and MLX

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx_lm.models.switch_layers import SwitchGLU  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402

from mlxcel_compat.runtime import block_experts  # noqa: E402
from mlxcel_compat.runtime.block_experts import ExpertStack, grouped_matmuls  # noqa: E402
from mlxcel_compat.runtime.block_weight import GROUP_ROWS, BlockWeight, group_rows, library, split_rows  # noqa: E402
from mlxcel_compat.testing.gguf_random import random_blocks  # noqa: E402
from benchlib import best_ms  # noqa: E402


def decode_steps(path: str, steps: int) -> None:
    """Median and best decode step of a GGUF file's model by MLX's step (with its ``mx.eval``
    calls a step) and by the CPU decode runtime (``loaded.decoder``, MoE layers in
    ``decode_pass.c``), the two alternating step by step on their own caches, so the machine's
    drift falls on both."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel_compat.model.loader import load_model
    from mlxcel_compat.runtime import decode_kv

    loaded = load_model(path, [])
    model, decoder = loaded.model, loaded.decoder
    caches = [make_prompt_cache(model), make_prompt_cache(model)]
    for cache in caches:
        mx.eval(model(mx.array([[5, 6, 7, 8]]), cache=cache))
    owned = decode_kv.OwnedCache()
    evaluate, calls = mx.eval, [0]

    def counted(*arrays) -> None:
        calls[0] += 1
        evaluate(*arrays)

    times: dict[str, list[float]] = {"MLX step": [], "CPU decode runtime": []}
    for step in range(steps):
        token = 10 + step % 100
        mx.eval = counted
        t0 = time.perf_counter()
        evaluate(model(mx.array([[token]]), cache=caches[0]))
        times["MLX step"].append(time.perf_counter() - t0)
        mx.eval = evaluate
        if decoder is not None:
            t0 = time.perf_counter()
            decoder.step(token, caches[1], owned)
            times["CPU decode runtime"].append(time.perf_counter() - t0)
    print(f"{path}: {steps} decode steps ({calls[0] / steps:.1f} mx.eval calls an MLX step)")
    for name, ts in times.items():
        if ts:
            ts.sort()
            print(f"  {name}: median {ts[len(ts) // 2] * 1e3:.1f} ms ({1 / ts[len(ts) // 2]:.1f} tok/s), "
                  f"best {ts[0] * 1e3:.1f} ms")
    if decoder is None:
        print("  no CPU decode runtime for this model")


def served(weight: BlockWeight, rows: int) -> BlockWeight:
    """The weight as the loader keeps an expert stack of ``rows`` rows an expert
    (``gguf/load.py: _expert_stack``): grouped where each expert is whole groups of 16 rows and
    the shim has the type's grouped kernel, else split where its own kernel reads them so."""
    if rows % GROUP_ROWS == 0:
        group_rows(weight)
    split_rows(weight)
    return weight


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--type", default="q4_k", help="block type (gguf_random's names: q4_k, q8_0, mxfp4, ...)")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--rows", type=int, default=768, help="rows of one expert's matrix")
    parser.add_argument("--k", type=int, default=2048, help="inputs of one expert's matrix")
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", default="1,4,64,512", help="comma list of token counts")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--gguf", help="time decode steps of this MoE GGUF file's model instead")
    parser.add_argument("--steps", type=int, default=100, help="decode steps with --gguf")
    args = parser.parse_args()
    if args.gguf:
        decode_steps(args.gguf, args.steps)
        return 0

    lib = library()
    if isinstance(lib, str):
        print(f"no block kernels here: {lib}")
        return 1
    qtype = GGMLQuantizationType[args.type.upper()]
    rng = np.random.default_rng(0)
    raw = random_blocks(rng, args.type, args.experts * args.rows, args.k)
    stack = ExpertStack(served(BlockWeight(raw, qtype, args.experts * args.rows, args.k, lib), args.rows), args.experts)
    up_raw = random_blocks(rng, args.type, args.experts * args.rows, args.k)
    up = ExpertStack(served(BlockWeight(up_raw, qtype, args.experts * args.rows, args.k, lib), args.rows), args.experts)
    down_raw = random_blocks(rng, args.type, args.experts * args.k, args.rows)
    down = ExpertStack(served(BlockWeight(down_raw, qtype, args.experts * args.k, args.rows, lib), args.k), args.experts)
    glu = SwitchGLU(args.k, args.rows, args.experts)
    for name, layer_stack in (("gate_proj", stack), ("up_proj", up), ("down_proj", down)):
        block_experts.install(glu, name, layer_stack)
    print(f"{args.experts} experts of {args.rows} x {args.k} {args.type.upper()}, top-{args.top_k}")
    print(f"{'tokens':>6} {'groups':>6} {'path':>14} {'ms':>9} {'GMAC/s':>7}")
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = rng.standard_normal((tokens, args.k)).astype(np.float32)
        chosen = np.stack([rng.choice(args.experts, args.top_k, replace=False) for _ in range(tokens)])
        flat = chosen.reshape(-1).astype(np.int32)
        order = np.argsort(flat, kind="stable")
        experts, counts = np.unique(flat[order], return_counts=True)
        starts = np.zeros(experts.size + 1, dtype=np.int32)
        np.cumsum(counts, out=starts[1:])
        source = (order // args.top_k).astype(np.int32)
        rows = np.ascontiguousarray(x[source])
        alone = [served(BlockWeight(raw[e * args.rows:(e + 1) * args.rows], qtype, args.rows, args.k, lib), args.rows)
                 for e in experts]

        def per_expert(tiles: bool) -> None:
            for i, weight in enumerate(alone):
                weight.matmul(rows[starts[i]:starts[i + 1]], tiles=tiles)

        x_mx, chosen_mx = mx.array(x[None]), mx.array(chosen[None].astype(np.int32))

        def layer(call) -> None:
            mx.eval(call(glu, x_mx, chosen_mx))

        paths = {
            "sort+gather": lambda: np.ascontiguousarray(x[np.argsort(flat, kind="stable") // args.top_k]),
            "grouped": lambda: stack.grouped_matmul(rows, experts, starts),
            "by-source": lambda: stack.grouped_matmul(x, experts, starts, source),
            "gate+up x2": lambda: [s.grouped_matmul(x, experts, starts, source) for s in (stack, up)],
            "gate+up": lambda: grouped_matmuls([stack, up], x, experts, starts, source),
            "layer (mlx-lm)": lambda: layer(SwitchGLU.__call__),
            "layer": lambda: layer(block_experts.BlockSwitchGLU.__call__),
            "per-expert": lambda: per_expert(False),
            "tiles": lambda: per_expert(True),
        }
        macs = tokens * args.top_k * args.rows * args.k
        for name, fn in paths.items():
            ms = best_ms(fn, args.reps)
            pair = 2 if name.startswith("gate+up") else 3 if name.startswith("layer") else 1
            rate = "" if name == "sort+gather" else f"{pair * macs / ms / 1e6:7.1f}"
            print(f"{tokens:>6} {experts.size:>6} {name:>14} {ms:9.2f} {rate:>7}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
