#!/usr/bin/env python3
"""Every CPU lever, each measured on and off side by side in one run, and which one is active.

Levers (what runs where: docs/architecture.md, "Platform notes"):

1. OpenBLAS kernels chosen from the CPU flags (runtime/backend.py) against OpenBLAS's own choice and
   against Prescott forced; float32 matmul GFLOP/s, each in a fresh process.
2. The matmul route for few-row products (blas_shim.c): one pass over every weight matrix of the
   model, (M, K) @ W^T, through OpenBLAS's sgemm, through cblas_sgemv (M = 1) and through the shim's
   kernel, for M = 1 .. 32; plus cblas_sgemv called directly (no MLX) as the reference bandwidth.
3. Attention (runtime/attention.py): mx.fast.scaled_dot_product_attention against the CPU path, per
   layer, decode and prompt shapes; the CPU path with its query blocks and its compiled exponent
   each switched off (prompt shapes are computed on NumPy arrays: "NumPy attention" in section 5).
4. Element-wise pieces alone (runtime/cpu_fusion.py): SiLU gating (mlx-lm's against the power of 2,
   in NumPy from a prompt chunk's size), RMS norm, RoPE and the MLP plain against compiled, at
   decode and prompt sizes.
5. In the model: a decode step at --context tokens of context and a prefill of --prompt tokens,
   with all levers on and with each one off in turn. With the CPU decode runtime on
   (runtime/cpu_decode.py), a decode step of one sequence runs outside MLX, so the MLX levers
   change only its prefill column; "CPU decode runtime" off measures MLX's step with them.
6. The prefill chunk (``--batch-size``): the same prefill at several chunk sizes.
7. Compile traces (runtime/cpu_fusion.py): the process's RSS after prompts of many new (batch,
   length) shapes, and after the same shapes again; ``mx.compile`` keeps a trace per shape it
   specializes, so this must stay flat (``--size tiny``, whose small rows make most prompt chunks
   "small", is the telling case).
8. The query block size (runtime/attention.py ``QUERY_BLOCK``): the prefill with each block size
   (``--query-blocks``).

Times are medians of --reps repetitions, the variants interleaved (rotating order) so that a noisy
machine hits them alike; the minimum is shown too. Examples::

    .venv/bin/python scripts/bench_cpu_kernels.py
    .venv/bin/python scripts/bench_cpu_kernels.py --reps 9 --sections 2,5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import benchlib  # noqa: E402  (never imports MLX)

MATMUL_CHILD = """
import ctypes, json, os, sys, time
os.environ["MLXCEL_BLAS_SHIM"] = "0"  # plain OpenBLAS sgemm: the kernel choice is measured here
from mlxcel_compat.runtime import backend
if sys.argv[1] == "backend":
    kernels = backend.load_optimized_blas().kernels
else:  # the library loaded directly: OpenBLAS picks its kernels unaided (or as OPENBLAS_CORETYPE says)
    path = next(p for p in backend.blas_candidates() if "openblas" in p)
    kernels = backend.openblas_corename(ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL))
import mlx.core as mx
out = {"kernels": kernels}
for m, k, n in ((128, 768, 2048), (1024, 768, 2048)):
    a, b = mx.random.normal((m, k)), mx.random.normal((k, n))
    mx.eval(a, b, a @ b)
    times = []
    for _ in range(7):
        t = time.perf_counter(); mx.eval(a @ b); times.append(time.perf_counter() - t)
    out[f"{m}x{k}x{n}"] = 2 * m * k * n / sorted(times)[3] / 1e9
print(json.dumps(out))
"""


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def timed(make: Callable[[], Any]) -> Callable[[], float]:
    import mlx.core as mx

    def run() -> float:
        t = benchlib.clock()
        mx.eval(make())
        return benchlib.clock() - t
    return run


def matmul_in_fresh_process(loader: str, coretype: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    if coretype is not None:
        env["OPENBLAS_CORETYPE"] = coretype
    out = subprocess.run([sys.executable, "-c", MATMUL_CHILD, loader], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout)


# --------------------------------------------------------------------------- 1. OpenBLAS kernels


def section_kernels(args: argparse.Namespace) -> None:
    from mlxcel_compat.runtime.backend import cpu_flags, openblas_kernels_for_cpu

    print("## 1. OpenBLAS kernels (fresh process each, plain sgemm)\n")
    if openblas_kernels_for_cpu(cpu_flags()) is None:
        print("(no AVX2/AVX-512 flags: the backend leaves the kernel choice to OpenBLAS)")
    print("| OpenBLAS kernels | how | 128x768x2048 GFLOP/s | 1024x768x2048 GFLOP/s |")
    print("|---|---|---:|---:|")
    runs = (("the backend (from the CPU flags)", "backend", None), ("OpenBLAS unaided", "direct", None), ("forced", "direct", "Prescott"))
    for how, loader, coretype in runs:
        r = matmul_in_fresh_process(loader, coretype)
        print(f"| {r['kernels']} | {how} | {r['128x768x2048']:.0f} | {r['1024x768x2048']:.0f} |", flush=True)


# --------------------------------------------------------------------------- 2. matmul routes


def section_routes(args: argparse.Namespace, env: dict[str, Any]) -> None:
    import ctypes

    import mlx.core as mx
    import numpy as np

    from mlxcel_compat.runtime.native import blas_shim

    shim, weights = env["shim"], env["weights"]
    nbytes = sum(w.nbytes for w in weights)
    print(f"## 2. Matmul routes: one pass over the model's {len(weights)} weight matrices ({nbytes / 1e6:.0f} MB), (M, K) @ W^T\n")
    if shim is None:
        print(f"(no shim in this process: {env['info'].matmul_route})\n")
        return
    blas = ctypes.CDLL(env["info"].path)
    arrays = [np.asarray(w) for w in weights]
    xs = {k: np.ones(k, np.float32) for k in {a.shape[1] for a in arrays}}
    ys = [np.empty(a.shape[0], np.float32) for a in arrays]
    ptr = ctypes.c_void_p

    def direct_gemv() -> float:
        t = benchlib.clock()
        for a, y in zip(arrays, ys):
            n, k = a.shape
            blas.cblas_sgemv(101, 111, n, k, ctypes.c_float(1.0), a.ctypes.data_as(ptr), k, xs[k].ctypes.data_as(ptr), 1,
                             ctypes.c_float(0.0), y.ctypes.data_as(ptr), 1)
        return benchlib.clock() - t

    def through(route: int, m: int) -> Callable[[], float]:
        x = {k: mx.ones((m, k)) for k in xs}

        def run() -> float:
            shim.configure(route=route, small_m_max=64)
            t = benchlib.clock()
            mx.eval([x[w.shape[1]] @ w.T for w in weights])
            return benchlib.clock() - t
        return run

    print("| M | route | ms (median) | min | GB/s | speed-up vs sgemm |")
    print("|---:|---|---:|---:|---:|---:|")
    for m in (1, 2, 4, 8, 16, 32):
        fns = {"sgemm": through(blas_shim.ROUTE_SGEMM, m), "kernel": through(blas_shim.ROUTE_KERNEL, m)}
        if m == 1:
            fns["cblas_sgemv (via the shim)"] = through(blas_shim.ROUTE_GEMV, m)
            fns["cblas_sgemv called directly"] = direct_gemv
        res = benchlib.interleaved(fns, args.reps)
        for name, v in res.items():
            print(f"| {m} | {name} | {med(v) * 1e3:.1f} | {min(v) * 1e3:.1f} | {nbytes / med(v) / 1e9:.1f} | "
                  f"{med(res['sgemm']) / med(v):.2f} |", flush=True)
    shim.configure(route=blas_shim.ROUTE_KERNEL, small_m_max=blas_shim.SMALL_M_MAX)
    print(f"\nActive: kernel up to M = {blas_shim.SMALL_M_MAX} rows (SMALL_M_MAX), sgemm above.")


# --------------------------------------------------------------------------- 3. attention


ATTN_SHAPES = ((1, 1, 1024), (1, 1, 4096), (8, 1, 4096), (1, 74, 2122), (1, 512, 1024), (1, 1023, 1023), (1, 512, 2560))


def section_attention(args: argparse.Namespace, env: dict[str, Any]) -> None:
    import mlx.core as mx

    from mlxcel_compat.runtime.native import blas_shim
    from mlxcel_compat.runtime import attention

    print("## 3. Attention per layer (12 query heads, 4 KV heads, head dim 64)\n")
    compiled_exp = attention.exp2_shifted
    plain_exp = lambda s, m: mx.power(2.0, s - m)  # noqa: E731
    shim = env["shim"]

    def ours(q, k, v, mask, *, blocks: bool = True, compiled: bool = True, route: int = blas_shim.ROUTE_KERNEL):
        def make():
            saved = attention.QUERY_BLOCK
            attention.QUERY_BLOCK = saved if blocks else 1 << 30
            attention.exp2_shifted = compiled_exp if compiled else plain_exp
            if shim is not None:
                shim.configure(route=route)
            try:
                return attention.cpu_attention(q, k, v, 0.125, mask)
            finally:
                attention.QUERY_BLOCK = saved
                attention.exp2_shifted = compiled_exp
        return make

    print("| B | queries | keys | mx.fast ms | CPU path ms | speed-up | no query blocks | plain exponent | matmuls to sgemm | max rel. difference |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for b, length, keys in ATTN_SHAPES:
        q, k, v = mx.random.normal((b, 12, length, 64)), mx.random.normal((b, 4, keys, 64)), mx.random.normal((b, 4, keys, 64))
        mask = "causal" if length > 1 else None
        fast = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)  # noqa: E731
        fns = {"fast": timed(fast), "ours": timed(ours(q, k, v, mask)), "no blocks": timed(ours(q, k, v, mask, blocks=False)),
               "plain exp": timed(ours(q, k, v, mask, compiled=False)), "sgemm": timed(ours(q, k, v, mask, route=blas_shim.ROUTE_SGEMM))}
        res = {name: med(v) * 1e3 for name, v in benchlib.interleaved(fns, args.reps).items()}
        diff = (mx.abs(fast() - ours(q, k, v, mask)()).max() / mx.abs(fast()).max()).item()
        print(f"| {b} | {length} | {keys} | {res['fast']:.2f} | {res['ours']:.2f} | {res['fast'] / res['ours']:.2f} | "
              f"{res['no blocks']:.2f} | {res['plain exp']:.2f} | {res['sgemm']:.2f} | {diff:.1e} |", flush=True)
    if shim is not None:
        shim.configure(route=blas_shim.ROUTE_KERNEL)
    print(f"\nActive: CPU path, query blocks of {attention.QUERY_BLOCK}, compiled exponent.")


# --------------------------------------------------------------------------- 4. element-wise pieces


def section_pieces(args: argparse.Namespace, env: dict[str, Any]) -> None:
    import mlx.core as mx
    from mlx_lm.models import activations

    from mlxcel_compat.runtime import cpu_fusion

    model = env["model"]
    layer = model.model.layers[0]
    attn = layer.self_attn
    print("## 4. Element-wise pieces alone (one layer's worth; times include one mx.eval each)\n")
    print("| piece | tokens | plain µs | lever µs | speed-up | lever |")
    print("|---|---:|---:|---:|---:|---|")
    for tokens in (1, 512):
        x = mx.random.normal((1, tokens, 768))
        g, u = mx.random.normal((1, tokens, 2048)) * 3, mx.random.normal((1, tokens, 2048))
        q = mx.random.normal((1, tokens, 12, 64)).transpose(0, 2, 1, 3)
        mx.eval(x, g, u, q)
        reps = max(1, 200 // tokens)

        def many(fn: Callable[[], Any], enabled: bool) -> Callable[[], float]:
            def run() -> float:
                saved = cpu_fusion.SMALL_ELEMENTS
                cpu_fusion.SMALL_ELEMENTS = saved if enabled else -1
                try:
                    t = benchlib.clock()
                    for _ in range(reps):
                        mx.eval(fn())
                    return (benchlib.clock() - t) / reps
                finally:
                    cpu_fusion.SMALL_ELEMENTS = saved
            return run

        silu = "power of 2 in NumPy" if tokens > 1 and g.size >= cpu_fusion.NUMPY_MIN else "power of 2"
        pieces = {
            "SiLU gating": (lambda: activations.swiglu(g, u), lambda: cpu_fusion.swiglu(g, u), silu),
            "RMS norm": (lambda: layer.input_layernorm(x), lambda: layer.input_layernorm(x), "compiled"),
            "RoPE (queries)": (lambda: attn.rope(q, offset=100), lambda: attn.rope(q, offset=100),
                               "angles shared, rotation compiled" if cpu_fusion.SHARED_ROPE_ANGLES else "compiled"),
            "MLP (gate, up, SiLU, down)": (lambda: layer.mlp(x), lambda: layer.mlp(x), "compiled"),
        }
        for name, (plain, lever, what) in pieces.items():
            res = benchlib.interleaved({"plain": many(plain, False), "lever": many(lever, True)}, args.reps)
            used = x.size <= cpu_fusion.SMALL_ELEMENTS and (name != "RoPE (queries)" or cpu_fusion.rope_compiles(q))
            active = what if what == silu or used else f"{what} (not used at this size)"
            print(f"| {name} | {tokens} | {med(res['plain']) * 1e6:.0f} | {med(res['lever']) * 1e6:.0f} | "
                  f"{med(res['plain']) / med(res['lever']):.2f} | {active} |", flush=True)
    print(f"\nActive: SiLU gating through a power of 2 always; compiled modules up to {cpu_fusion.SMALL_ELEMENTS} input elements (RoPE: one token per row).")


# --------------------------------------------------------------------------- 5. in the model


class Levers:
    """Switch the levers of a loaded model on and off at run time (benchmarks only)."""

    def __init__(self, env: dict[str, Any]) -> None:
        from mlx_lm.models import activations

        from mlxcel_compat.runtime import attention
        from mlxcel_compat.runtime import cpu_fusion

        self.env, self.attention, self.fusion = env, attention, cpu_fusion
        self.defaults = (attention.QUERY_BLOCK, attention.exp2_shifted, cpu_fusion.SMALL_ELEMENTS,
                         attention.NUMPY_ATTENTION_MIN, cpu_fusion.NUMPY_MIN, cpu_fusion.SHARED_ROPE_ANGLES,
                         attention.UNSHIFTED_SOFTMAX)
        self.swiglu_modules = [m for name, m in sys.modules.items() if name.startswith("mlx_lm.models.")
                               and getattr(m, "swiglu", None) is cpu_fusion.swiglu]
        self.mlx_swiglu = activations.swiglu

    def set(self, *off: str) -> None:
        """Everything on except the levers named in ``off`` (names from OFF; "all" = every one)."""
        import mlx.core as mx

        from mlxcel_compat.runtime.native import blas_shim

        if "all" in off:
            off = LEVERS
        block, exp2, small, numpy_attention, numpy_silu, shared_angles, unshifted = self.defaults
        self.attention.UNSHIFTED_SOFTMAX = False if "unshifted softmax" in off else unshifted
        self.fusion.SHARED_ROPE_ANGLES = False if "shared RoPE angles" in off else shared_angles
        self.attention.QUERY_BLOCK = 1 << 30 if "query blocks" in off else block
        self.attention.NUMPY_ATTENTION_MIN = 1 << 62 if "NumPy attention" in off else numpy_attention
        self.fusion.NUMPY_MIN = 1 << 62 if "NumPy SiLU" in off else numpy_silu
        self.attention.exp2_shifted = (lambda s, m: mx.power(2.0, s - m)) if "compiled exponent" in off else exp2
        self.fusion.SMALL_ELEMENTS = -1 if "compiled modules" in off else small
        swiglu = self.mlx_swiglu if "SiLU via power of 2" in off else self.fusion.swiglu
        for module in self.swiglu_modules:
            if module.swiglu is not swiglu:
                module.swiglu = swiglu
                for _, m in self.env["model"].named_modules():  # compiled MLPs captured the old one
                    m.__dict__.pop("_mlxcel_fused", None)
                    m.__dict__.pop("_mlxcel_fused_shapeless", None)
        shim = self.env["shim"]
        if shim is not None:
            shim.configure(route=blas_shim.ROUTE_SGEMM if "matmul shim" in off else blas_shim.ROUTE_KERNEL)
        self.env["use_decoder"] = self.env["decoder"] is not None and "CPU decode runtime" not in off


# The levers of issue 15.
LEVERS = ("CPU decode runtime", "matmul shim", "compiled modules", "SiLU via power of 2", "compiled exponent", "query blocks", "NumPy attention",
          "NumPy SiLU", "shared RoPE angles", "unshifted softmax")
OFF = ("", *LEVERS)


def decode_step(env: dict[str, Any], context: int) -> Callable[[], float]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel_compat.runtime import cpu_decode

    model = env["model"]
    cache = make_prompt_cache(model)
    ids = [(7 * i + 3) % 8000 for i in range(context)]
    for start in range(0, context, 512):
        model(mx.array([ids[start:start + 512]]), cache=cache)
        mx.eval([c.state for c in cache])
    token = mx.array([[11]])
    owned = cpu_decode.OwnedCache()

    def run() -> float:
        t = benchlib.clock()
        if env["use_decoder"]:  # the engine's step for one sequence (runtime/cpu_decode.py)
            mx.eval(mx.argmax(mx.array(env["decoder"].step(11, cache, owned))))
        else:
            mx.eval(mx.argmax(model(token, cache=cache)[0, -1]))
        elapsed = benchlib.clock() - t
        for c in cache:
            c.trim(1)
        return elapsed
    return run


def prefill(env: dict[str, Any], n: int, chunk: int) -> Callable[[], float]:
    """The engine's way: aligned chunks (cache state evaluated after each), then the last token."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel_compat.runtime import cpu_decode

    model = env["model"]
    prompt = [(13 * i + 5) % 8000 for i in range(n)]

    def run() -> float:
        cache = make_prompt_cache(model)
        t = benchlib.clock()
        for start in range(0, n - 1, chunk):
            model(mx.array([prompt[start:min(start + chunk, n - 1)]]), cache=cache)
            mx.eval([c.state for c in cache])
        if env["use_decoder"]:  # the last token as the engine feeds it: the decode runtime's step
            mx.eval(mx.argmax(mx.array(env["decoder"].step(prompt[-1], cache, cpu_decode.OwnedCache()))))
        else:
            mx.eval(mx.argmax(model(mx.array([prompt[-1:]]), cache=cache)[0, -1]))
        return benchlib.clock() - t
    return run


def section_model(args: argparse.Namespace, env: dict[str, Any]) -> None:
    levers = Levers(env)
    print(f"## 5. In the model: each lever off in turn (decode at {args.context} tokens of context; prefill of {args.prompt} tokens in chunks of {args.chunk})\n")
    print("| switched off | decode step ms | × all on | prefill ms | × all on |")
    print("|---|---:|---:|---:|---:|")
    step, fill = decode_step(env, args.context), prefill(env, args.prompt, args.chunk)

    def with_off(fn: Callable[[], float], off: str) -> Callable[[], float]:
        def run() -> float:
            levers.set(off)
            try:
                return fn()
            finally:
                levers.set("")
        return run

    d = benchlib.interleaved({off: with_off(step, off) for off in OFF}, args.reps)
    p = benchlib.interleaved({off: with_off(fill, off) for off in OFF}, max(1, args.reps // 2))
    for off in OFF:
        print(f"| {off or '(nothing: all on)'} | {med(d[off]) * 1e3:.1f} | {med(d[off]) / med(d['']):.2f} | "
              f"{med(p[off]) * 1e3:.0f} | {med(p[off]) / med(p['']):.2f} |", flush=True)


# --------------------------------------------------------------------------- 6. prefill chunk


def section_chunk(args: argparse.Namespace, env: dict[str, Any]) -> None:
    chunks = [int(c) for c in args.chunks.split(",")]
    print("## 6. Prefill chunk (--batch-size): prefill time by chunk size, all levers on\n")
    print("| prompt | " + " | ".join(f"chunk {c} ms" for c in chunks) + " | best |")
    print("|---:|" + "---:|" * len(chunks) + "---|")
    for n in (int(p) for p in args.chunk_prompts.split(",")):
        res = benchlib.interleaved({c: prefill(env, n, c) for c in chunks}, max(1, args.reps // 2))
        best = min(chunks, key=lambda c: med(res[c]))
        print(f"| {n} | " + " | ".join(f"{med(res[c]) * 1e3:.0f}" for c in chunks) + f" | {best} |", flush=True)


# --------------------------------------------------------------------------- 7. compile traces


def section_traces(args: argparse.Namespace, env: dict[str, Any]) -> None:
    import gc

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel_compat.runtime.backend import release_free_memory

    model = env["model"]

    def settled_rss_mib() -> float:
        gc.collect()
        mx.clear_cache()
        release_free_memory()
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    def run(shapes: list[tuple[int, int]]) -> float:
        for rows, length in shapes:  # a prompt chunk of that shape, then one decode step
            cache = make_prompt_cache(model)
            mx.eval(model(mx.array([[7] * length] * rows), cache=cache))
            mx.eval(model(mx.array([[5]] * rows), cache=cache))
        return settled_rss_mib()

    warm = [(rows, length) for rows in (1, 2) for length in range(2, 40)]
    new = [(rows, length) for rows in range(3, 9) for length in range(2, 40)]
    print("## 7. Compile traces: RSS after prompts of new shapes (settled: collection, MLX cache cleared, malloc_trim)\n")
    print("| after | shapes | RSS MiB |")
    print("|---|---:|---:|")
    run(warm)
    print(f"| warm-up, twice | {len(warm)} | {run(warm):.1f} |")
    print(f"| new shapes | {len(new)} | {run(new):.1f} |")
    print(f"| the same shapes again | {len(new)} | {run(new):.1f} |", flush=True)


# --------------------------------------------------------------------------- 8. query blocks


def section_query_blocks(args: argparse.Namespace, env: dict[str, Any]) -> None:
    """The prefill with each query block size (runtime/attention.py: QUERY_BLOCK), interleaved."""
    from mlxcel_compat.runtime import attention

    fill = prefill(env, args.prompt, args.chunk)
    default = attention.QUERY_BLOCK

    def variant(block: int) -> Callable[[], float]:
        def run() -> float:
            attention.QUERY_BLOCK = block
            try:
                return fill()
            finally:
                attention.QUERY_BLOCK = default
        return run

    blocks = sorted({int(b) for b in args.query_blocks.split(",")} | {default})
    res = benchlib.interleaved({b: variant(b) for b in blocks}, args.reps)
    base = med(res[default])
    print(f"## 8. Query blocks: prefill of {args.prompt} tokens in chunks of {args.chunk}, all levers on\n")
    print("| query block | prefill ms | min | × the default |")
    print("|---:|---:|---:|---:|")
    for block, times in res.items():
        mark = " (default)" if block == default else ""
        print(f"| {block}{mark} | {med(times) * 1e3:.0f} | {min(times) * 1e3:.0f} | {med(times) / base:.2f} |", flush=True)


# --------------------------------------------------------------------------- main


def load_env(args: argparse.Namespace) -> dict[str, Any]:
    from mlxcel_compat.runtime import backend

    info = backend.load_optimized_blas()
    import mlx.nn as nn

    from mlxcel_compat.model.loader import load_model

    loaded = load_model(str(Path(args.model) if args.model else benchlib.ensure_model("llama", args.size)), [])
    model = loaded.model
    weights = [m.weight for _, m in model.named_modules() if isinstance(m, nn.Linear)]
    return {"info": info, "shim": backend.matmul_shim(), "model": model, "weights": weights, "decoder": loaded.decoder,
            "use_decoder": loaded.decoder is not None}


def main(argv: list[str] | None = None) -> int:
    from mlxcel_compat.settings import SETTINGS

    default_chunk = min(s.default for s in SETTINGS if s.name in ("batch_size", "ubatch_size"))
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--size", default="small", help="generated llama size (default small: 88M parameters)")
    ap.add_argument("--model", help="a model directory instead of the generated llama")
    ap.add_argument("--sections", default="1,2,3,4,5,6,7,8", help="comma-separated section numbers")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=default_chunk, help="prefill chunk in section 5 (default: the server's)")
    ap.add_argument("--chunks", default="128,256,512,1024,2048")
    ap.add_argument("--chunk-prompts", default="1024,4096")
    ap.add_argument("--query-blocks", default="32,64,128,256", help="query block sizes in section 8")
    ap.add_argument("--single-thread", action="store_true",
                    help="one BLAS/shim thread, process CPU time as the clock: work, not wall time (shared machines)")
    args = ap.parse_args(argv)
    if args.single_thread:
        benchlib.single_thread_cpu_time()
    sections = {int(s) for s in args.sections.split(",")}
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"started {time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs"
          + (", single thread, times are process CPU time" if args.single_thread else ", wall time") + "\n")
    if 1 in sections:
        section_kernels(args)
        print()
    env = load_env(args)
    print(f"Active in this process: BLAS {env['info'].name} ({env['info'].kernels} kernels); float32 matmuls: {env['info'].matmul_route}\n")
    for number, section in ((2, section_routes), (3, section_attention), (4, section_pieces), (5, section_model), (6, section_chunk),
                            (7, section_traces), (8, section_query_blocks)):
        if number in sections:
            section(args, env)
            print()
    print(f"finished {time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    benchlib.run(main)
