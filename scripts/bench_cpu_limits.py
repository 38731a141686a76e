#!/usr/bin/env python
"""CPU throughput against the machine's own limits, all measured in one run (issue 15).

1. **Decode step vs the streaming limit**: the time per token of greedy decoding at ``--context``
   tokens of context, as the engine decodes one sequence (the CPU decode runtime,
   ``runtime/cpu_decode.py``), and as MLX decodes it (pipelined, the levers on, and all off),
   against the weight bytes of one step divided by the best matrix-vector bandwidth this run
   measures on the same weight matrices (OpenBLAS ``cblas_sgemv`` called directly, and the
   shim's kernel through MLX and called directly). Goal: step <= 1.3 x the limit.
   Also batched decode (``--batch-rows``): B sequences of ``--batch-context`` tokens each, one
   step for all of them, the runtime's rows (each on its own cache) against MLX's pass over the
   merged batch cache, tokens per second.
2. **Prefill vs the compute limit**: a ``--prompt``-token prompt prefilled the way the engine does
   it (aligned chunks of the chunk size, then the last token), against the step's FLOPs (weights
   and causal attention) divided by the SGEMM rate this run measures on the model's own weight
   shapes at the chunk size (OpenBLAS ``cblas_sgemm`` through MLX). Goal: <= 1.6 x the limit.
   Both with the levers on (the server's defaults) and all off (every matmul to ``cblas_sgemm``,
   mlx-lm's SiLU, unfused modules, whole-chunk attention, as before issue 15), interleaved.
3. **Servers, before and after**: decode tokens/s and the full-hit TTFT of a ``--prompt``-token
   prompt from the server as it was before issue 15 (``--before-ref``, exported from git, its
   defaults) and as it is now (its defaults), requests alternating between the two; and the same
   figures from
   ``mlx_lm.generate``'s ``stream_generate`` on the same model, in a child process that loads the
   same OpenBLAS with the same kernels but gets none of the levers (no shim, mlx-lm's attention;
   its "TTFT" is a cold prefill: it has no prompt cache).

The machine may be shared: every comparison is measured side by side, interleaved, repeated, and
reported as medians with ratios. One command::

    .venv/bin/python scripts/bench_cpu_limits.py --size small --reps 5
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import benchlib  # noqa: E402  (never imports MLX)

# "Before" for the servers: the project's code before issue 15 (main at 640377d), exported from
# git into a temporary directory and run with the same Python environment.
BEFORE_REF = "640377d"
STEPS = 16  # decode steps per measurement (context --context .. --context + STEPS)


def median(xs: list[float]) -> float:
    return statistics.median(xs)


# --------------------------------------------------------------------------- in-process limits


def limits(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    from bench_cpu_kernels import Levers

    from mlxcel_compat.runtime import backend
    from mlxcel_compat.runtime.native import blas_shim

    info = backend.load_optimized_blas()
    shim = backend.matmul_shim()
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel_compat.runtime import cpu_decode
    from mlxcel_compat.model.loader import load_model

    loaded = load_model(str(model_dir), [])
    model = loaded.model
    levers = Levers({"model": model, "shim": shim, "decoder": loaded.decoder})
    named = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    head = [m.weight for name, m in named if name.endswith("lm_head")]  # computed for the last token only
    layer_weights = [m.weight for name, m in named if not name.endswith("lm_head")]
    weights = layer_weights + head
    step_bytes = sum(w.nbytes for w in weights)
    blas = ctypes.CDLL(info.path)
    sgemv = blas.cblas_sgemv
    f32p = ctypes.c_void_p

    def set_route(route: int) -> None:
        if shim is not None:
            shim.configure(route=route)

    def all_levers(on: bool) -> None:
        levers.set() if on else levers.set("all")

    # -- streaming limit: y = W x for every weight matrix, OpenBLAS sgemv called directly
    arrays = [np.asarray(w) for w in weights]  # the same memory as the model's weights
    xs = {k: np.ones(k, np.float32) for k in {a.shape[1] for a in arrays}}
    ys = [np.empty(a.shape[0], np.float32) for a in arrays]

    def gemv_pass() -> float:
        t = benchlib.clock()
        for a, y in zip(arrays, ys):
            n, k = a.shape
            sgemv(101, 111, n, k, ctypes.c_float(1.0), a.ctypes.data_as(f32p), k, xs[k].ctypes.data_as(f32p), 1,
                  ctypes.c_float(0.0), y.ctypes.data_as(f32p), 1)
        return benchlib.clock() - t

    decoder = loaded.decoder  # the engine's decode step for one sequence (runtime/cpu_decode.py), or None
    kernel = decoder.k.sgemm if decoder is not None else None  # the shim's cblas_sgemm, called directly

    def kernel_pass() -> float:
        t = benchlib.clock()
        for a, y in zip(arrays, ys):
            n, k = a.shape
            kernel(101, 111, 112, 1, n, k, 1.0, xs[k].ctypes.data, k, a.ctypes.data, k, 0.0, y.ctypes.data, n)
        return benchlib.clock() - t

    mx_x = {k: mx.ones((1, k)) for k in xs}

    def mlx_pass(route: int) -> Callable[[], float]:
        def run() -> float:
            all_levers(True)
            set_route(route)
            t = benchlib.clock()
            mx.eval([mx_x[w.shape[1]] @ w.T for w in weights])
            return benchlib.clock() - t
        return run

    # -- decode step at --context tokens of context (the cache rewound after each step)
    def prefilled(ids: list[int]) -> list[Any]:
        cache = make_prompt_cache(model)
        for start in range(0, len(ids), 512):
            model(mx.array([ids[start:start + 512]]), cache=cache)
            mx.eval([c.state for c in cache])
        return cache

    cache = prefilled([(7 * i + 3) % 8000 for i in range(args.context)])
    token = mx.array([[11]])

    def runtime_steps(caches: list[list[Any]]) -> Callable[[], float]:
        """Time per step over STEPS greedy steps of these sequences as the engine decodes them on
        the CPU: the decode runtime's step (all rows at once), its logits handed to MLX for
        sampling (greedy here). The caches are rewound after."""
        owned = [cpu_decode.OwnedCache() for _ in caches]

        def run() -> float:
            all_levers(True)
            # MLX's own step (measured in turn) replaces the caches' arrays: the runtime takes them
            # over again (a copy, which the engine makes once per sequence) before the clock starts.
            decoder.step_rows([11] * len(caches), caches, owned)
            for c in caches:
                for layer in c:
                    layer.trim(1)
            t = benchlib.clock()
            tokens = [11] * len(caches)
            for _ in range(STEPS):
                tokens = mx.argmax(mx.array(decoder.step_rows(tokens, caches, owned)), axis=-1).tolist()
            elapsed = (benchlib.clock() - t) / STEPS
            for c in caches:
                for layer in c:
                    layer.trim(STEPS)
            return elapsed
        return run

    def decode_step(on: bool) -> Callable[[], float]:
        """Time per token over STEPS greedy steps decoded by MLX as the engine does without the
        decode runtime (a batch; a model it does not take): the graph of token n+1 is queued with
        async_eval before token n is read back. The cache is rewound after."""
        def run() -> float:
            all_levers(on)
            t = benchlib.clock()
            pending = mx.argmax(model(token, cache=cache)[0, -1]).astype(mx.int32)
            mx.async_eval(pending)
            for _ in range(STEPS - 1):
                following = mx.argmax(model(pending.reshape(1, 1), cache=cache)[0, -1]).astype(mx.int32)
                mx.async_eval(following)
                pending.item()
                pending = following
            pending.item()
            elapsed = (benchlib.clock() - t) / STEPS
            for c in cache:
                c.trim(STEPS)
            return elapsed
        return run

    fns: dict[str, Callable[[], float]] = {"sgemv (OpenBLAS, direct)": gemv_pass}
    if shim is not None:
        fns["kernel (shim, via MLX)"] = mlx_pass(blas_shim.ROUTE_KERNEL)
    if kernel is not None:
        fns["kernel (shim, direct)"] = kernel_pass
    fns["sgemm (OpenBLAS, via MLX)"] = mlx_pass(blas_shim.ROUTE_SGEMM)
    if decoder is not None:
        fns["step, decode runtime"] = runtime_steps([cache])
    fns["step, MLX, levers on"] = decode_step(True)
    fns["step, MLX, levers off"] = decode_step(False)
    decode = benchlib.interleaved(fns, args.reps)

    # -- batched decode: B sequences of --batch-context tokens each, one step for all of them
    batched: dict[int, dict[str, list[float]]] = {}
    rows = [int(b) for b in args.batch_rows.split(",") if b] if decoder is not None else []
    if rows:
        from mlx_lm.models.cache import KVCache

        seqs = [prefilled([(11 * j + 5 * i + 3) % 8000 for j in range(args.batch_context)]) for i in range(max(rows))]

        def mlx_rows(b: int) -> Callable[[], float]:
            def run() -> float:
                all_levers(True)
                merged = [KVCache.merge([c[i] for c in seqs[:b]]) for i in range(len(seqs[0]))]
                mx.eval([layer.state for layer in merged])
                t = benchlib.clock()
                pending = mx.argmax(model(mx.array([[11]] * b), cache=merged)[:, -1], axis=-1).astype(mx.int32)
                mx.async_eval(pending)
                for _ in range(STEPS - 1):
                    following = mx.argmax(model(pending.reshape(b, 1), cache=merged)[:, -1], axis=-1).astype(mx.int32)
                    mx.async_eval(following)
                    pending.tolist()
                    pending = following
                pending.tolist()
                return (benchlib.clock() - t) / STEPS
            return run

        for b in rows:
            batched[b] = benchlib.interleaved({"runtime": runtime_steps(seqs[:b]), "mlx": mlx_rows(b)}, args.reps)

    # -- prefill of --prompt tokens vs the SGEMM rate on the model's shapes at the chunk size
    chunk = min(args.chunk, args.prompt)
    mx_chunk = {k: mx.ones((chunk, k)) for k in xs}
    mx.eval(list(mx_chunk.values()))

    def sgemm_chunk() -> float:
        all_levers(True)
        set_route(blas_shim.ROUTE_SGEMM)
        t = benchlib.clock()
        mx.eval([mx_chunk[w.shape[1]] @ w.T for w in layer_weights])
        return benchlib.clock() - t

    prompt = [(13 * i + 5) % 8000 for i in range(args.prompt)]

    def prefill(on: bool) -> Callable[[], float]:
        def run() -> float:
            all_levers(on)
            c = make_prompt_cache(model)
            t = benchlib.clock()
            for start in range(0, len(prompt) - 1, chunk):
                model(mx.array([prompt[start:min(start + chunk, len(prompt) - 1)]]), cache=c)
                mx.eval([layer.state for layer in c])
            mx.eval(mx.argmax(model(mx.array([prompt[-1:]]), cache=c)[0, -1]))
            return benchlib.clock() - t
        return run

    pre = benchlib.interleaved({"sgemm rate": sgemm_chunk, "prefill, levers on": prefill(True),
                       "prefill, levers off": prefill(False)}, args.reps)
    all_levers(True)

    cfg = loaded.config
    layers, hq = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // hq
    layer_macs = sum(w.size for w in layer_weights)
    weight_flops = 2 * (args.prompt * layer_macs + sum(w.size for w in head))
    pairs = args.prompt * (args.prompt + 1) // 2  # causal (query, key) pairs
    attention_flops = layers * 2 * 2 * hq * head_dim * pairs  # QK^T and PV
    sgemm_rate = 2 * chunk * layer_macs / median(pre["sgemm rate"])
    return {
        "blas": f"{info.name} ({info.kernels} kernels)", "matmul_route": info.matmul_route,
        "step_bytes": step_bytes, "context": args.context, "prompt": args.prompt, "chunk": chunk,
        "decode": decode, "prefill": pre, "sgemm_rate": sgemm_rate,
        "prefill_flops": weight_flops + attention_flops, "attention_flops": attention_flops,
        "batched": batched, "batch_context": args.batch_context,
    }


def report_limits(r: dict[str, Any]) -> list[str]:
    d, p = r["decode"], r["prefill"]
    gb = r["step_bytes"] / 1e9
    passes = {k: v for k, v in d.items() if not k.startswith("step")}
    best = min(median(v) for k, v in passes.items() if not k.startswith("sgemm"))
    out = [f"BLAS {r['blas']}; float32 matmuls: {r['matmul_route']}", "",
           f"Weights streamed per decode step: {r['step_bytes'] / 1e6:.0f} MB. Context {r['context']} tokens.", "",
           "| one pass over every weight matrix, (1, K) @ W^T | ms (median) | min | GB/s |",
           "|---|---:|---:|---:|"]
    for name, v in passes.items():
        out.append(f"| {name} | {median(v) * 1e3:.1f} | {min(v) * 1e3:.1f} | {gb / median(v):.1f} |")
    out += ["", f"Streaming limit (weight bytes / best GEMV bandwidth): **{best * 1e3:.1f} ms**", "",
            "| decode step | ms (median) | min | × streaming limit (median) | goal |", "|---|---:|---:|---:|---:|"]
    for name in ("step, decode runtime", "step, MLX, levers on", "step, MLX, levers off"):
        if name not in d:
            continue
        v = d[name]
        out.append(f"| {name} | {median(v) * 1e3:.1f} | {min(v) * 1e3:.1f} | {median(v) / best:.2f} | ≤ 1.3 |")
    if r["batched"]:
        out += ["", f"Batched decode: B sequences of {r['batch_context']} tokens each, one step for all of them "
                "(the runtime's rows on their own caches, against MLX's pass over the merged batch cache, pipelined).", "",
                "| B | runtime ms/step | MLX ms/step | runtime tok/s | MLX tok/s | runtime × MLX | runtime step × streaming limit |",
                "|---:|---:|---:|---:|---:|---:|---:|"]
        for b, v in r["batched"].items():
            rt, ml = median(v["runtime"]), median(v["mlx"])
            out.append(f"| {b} | {rt * 1e3:.1f} | {ml * 1e3:.1f} | {b / rt:.0f} | {b / ml:.0f} | {ml / rt:.2f} | {rt / best:.2f} |")
    limit = r["prefill_flops"] / r["sgemm_rate"]
    out += ["", f"Prefill of {r['prompt']} tokens in chunks of {r['chunk']}: {r['prefill_flops'] / 1e9:.1f} GFLOP "
            f"({r['attention_flops'] / 1e9:.1f} of them causal attention). SGEMM rate on the model's weight shapes "
            f"at {r['chunk']} rows: {r['sgemm_rate'] / 1e9:.0f} GFLOP/s, so the compute limit is **{limit * 1e3:.0f} ms**.", "",
            "| prefill | ms (median) | min | × compute limit (median) | goal |", "|---|---:|---:|---:|---:|"]
    for name in ("prefill, levers on", "prefill, levers off"):
        v = p[name]
        out.append(f"| {name} | {median(v) * 1e3:.0f} | {min(v) * 1e3:.0f} | {median(v) / limit:.2f} | ≤ 1.6 |")
    return out


# --------------------------------------------------------------------------- servers and mlx_lm


class Server(benchlib.ServerProcess):
    """``python -m mlxcel_compat`` run from ``code`` (its directory comes first on sys.path)."""

    def __init__(self, name: str, model_dir: Path, code: Path, timeout: float) -> None:
        port = benchlib.free_port()
        cmd = benchlib.mlxcel_cmd(model_dir, port, ["-np", "1", "-c", "8192"])
        super().__init__(cmd, port, name=name, cwd=code)
        self.start()
        self.wait_healthy(timeout)
        import httpx

        self.client = httpx.Client(base_url=self.base_url, timeout=600.0)

    def ttft(self, tokens: list[int]) -> dict[str, float]:
        """Stream one token; client-side time to the first token, and the server's timings."""
        body = {"prompt": tokens, "n_predict": 1, "temperature": 0, "cache_prompt": True, "stream": True}
        t0 = time.perf_counter()
        first = None
        final: dict[str, Any] = {}
        with self.client.stream("POST", "/completion", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                if first is None and chunk.get("content") is not None and "prompt_progress" not in chunk:
                    first = time.perf_counter() - t0
                if chunk.get("stop"):
                    final = chunk
                    break
        tm = final["timings"]
        return {"ttft": first if first is not None else time.perf_counter() - t0, "prompt_ms": tm["prompt_ms"],
                "cache_n": tm.get("cache_n", 0)}

    def decode(self, tokens: list[int], n: int) -> float:
        body = {"prompt": tokens, "n_predict": n, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
        r = self.client.post("/completion", json=body)
        r.raise_for_status()
        tm = r.json()["timings"]
        return tm["predicted_n"] / tm["predicted_ms"] * 1000.0

    def stop(self) -> None:  # type: ignore[override]
        self.client.close()
        super().stop(grace=15.0, interrupt_first=True)


MLX_LM_CHILD = r"""
import json, os, sys, time
os.environ["MLXCEL_BLAS_SHIM"] = "0"  # none of the levers: MLX calls OpenBLAS's sgemm directly
sys.path.insert(0, sys.argv[1])
from mlxcel_compat.runtime.backend import load_optimized_blas
load_optimized_blas()  # the same OpenBLAS and kernels as the server (without it: the reference BLAS)
import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import stream_generate
model, tokenizer = load(sys.argv[2])
model.set_dtype(mx.float32)
args = json.loads(sys.argv[3])
out = {"ttft": [], "decode": []}
for rep in range(args["reps"] + 1):
    prompt = args["prompts"][rep % len(args["prompts"])]
    t0 = time.perf_counter()
    for response in stream_generate(model, tokenizer, prompt, max_tokens=1):
        first = time.perf_counter() - t0
        break
    last = None
    for last in stream_generate(model, tokenizer, args["decode_prompt"], max_tokens=args["n"]):
        pass
    if rep:
        out["ttft"].append(first)
        out["decode"].append(last.generation_tps)
print(json.dumps(out))
"""


def export_code(ref: str, into: Path) -> Path:
    """The package as it was at git ``ref``, in ``into``."""
    archive = subprocess.run(["git", "archive", ref, "mlxcel_compat"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def servers(args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    import tempfile

    prompts = [[(17 * i + 31 * s + 3) % 8000 for i in range(args.prompt)] for s in range(args.reps + 1)]
    decode_prompt = prompts[0]  # decode after a --prompt-token prompt
    old_code = export_code(args.before_ref, Path(tempfile.mkdtemp(prefix="bench_before_")))
    before = Server("before", model_dir, old_code, args.startup_timeout)
    after = Server("after", model_dir, ROOT, args.startup_timeout)
    result: dict[str, dict[str, list[float]]] = {"before": {}, "after": {}}
    try:
        for rep in range(args.reps + 1):
            order = (before, after) if rep % 2 == 0 else (after, before)
            for server in order:
                cold = server.ttft(prompts[rep])  # fills the prompt cache
                hit = server.ttft(prompts[rep])  # the same prompt again: a full hit
                tps = server.decode(decode_prompt, args.n_predict)
                if hit["cache_n"] < args.prompt - 1:
                    print(f"warning: {server.name}: expected a full hit, cache_n = {hit['cache_n']}", file=sys.stderr)
                print(f"[rep {rep}{' warm-up' if rep == 0 else ''}] {server.name}: cold TTFT {cold['ttft'] * 1e3:.0f} ms, "
                      f"full-hit TTFT {hit['ttft'] * 1e3:.0f} ms (prompt_ms {hit['prompt_ms']:.1f}), decode {tps:.1f} tok/s", flush=True)
                if rep:
                    row = result[server.name]
                    row.setdefault("cold_ttft", []).append(cold["ttft"])
                    row.setdefault("hit_ttft", []).append(hit["ttft"])
                    row.setdefault("hit_prompt_ms", []).append(hit["prompt_ms"] / 1e3)
                    row.setdefault("decode", []).append(tps)
    finally:
        before.stop()
        after.stop()
    child_args = json.dumps({"reps": args.reps, "prompts": prompts[:2], "decode_prompt": decode_prompt, "n": args.n_predict})
    out = subprocess.run([sys.executable, "-c", MLX_LM_CHILD, str(ROOT), str(model_dir), child_args],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    result["mlx_lm"] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def report_servers(r: dict[str, Any], args: argparse.Namespace) -> list[str]:
    b, a, m = r["before"], r["after"], r["mlx_lm"]
    ms = lambda v: f"{median(v) * 1e3:.0f}"  # noqa: E731
    return [
        f"Before: the code at {args.before_ref}, its defaults; after: this code, its defaults. Both `-np 1 -c 8192`.", "",
        f"| measurement ({args.prompt}-token prompt; decode: n_predict {args.n_predict} after it) | before | after | after/before | mlx_lm.generate | after vs mlx_lm |",
        "|---|---:|---:|---:|---:|---:|",
        f"| decode tok/s | {median(b['decode']):.1f} | {median(a['decode']):.1f} | {median(a['decode']) / median(b['decode']):.2f}× | "
        f"{median(m['decode']):.1f} | {median(a['decode']) / median(m['decode']):.2f}× |",
        f"| full-hit TTFT ms (client) | {ms(b['hit_ttft'])} | {ms(a['hit_ttft'])} | {median(b['hit_ttft']) / median(a['hit_ttft']):.2f}× faster | "
        f"{ms(m['ttft'])} (cold, no cache) | {median(m['ttft']) / median(a['hit_ttft']):.1f}× faster |",
        f"| cold TTFT ms (client) | {ms(b['cold_ttft'])} | {ms(a['cold_ttft'])} | {median(b['cold_ttft']) / median(a['cold_ttft']):.2f}× faster | "
        f"{ms(m['ttft'])} | {median(m['ttft']) / median(a['cold_ttft']):.2f}× faster |",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small", help="generated llama size (default small: 88M parameters)")
    ap.add_argument("--model", help="a model directory instead of the generated llama")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--context", type=int, default=1024, help="context of the decode step")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt length for prefill and TTFT")
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: the server's, min(-b, -ub))")
    ap.add_argument("--n-predict", type=int, default=128)
    ap.add_argument("--batch-rows", default="1,2,4,8", help="batched decode: rows per step (empty: skip)")
    ap.add_argument("--batch-context", type=int, default=512, help="batched decode: context of each row")
    ap.add_argument("--skip-servers", action="store_true", help="only the in-process limits")
    ap.add_argument("--before-ref", default=BEFORE_REF, help="git ref of the 'before' server (default: main before issue 15)")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--single-thread", action="store_true",
                    help="in-process parts with one BLAS/shim thread and process CPU time as the clock (work, not "
                         "wall time: for shared machines); implies --skip-servers")
    args = ap.parse_args(argv)
    if args.single_thread:
        benchlib.single_thread_cpu_time()
        args.skip_servers = True
    if args.chunk is None:
        from mlxcel_compat.settings import SETTINGS

        args.chunk = min(s.default for s in SETTINGS if s.name in ("batch_size", "ubatch_size"))
    model_dir = Path(args.model) if args.model else benchlib.ensure_model("llama", args.size)
    started = time.strftime("%Y-%m-%d %H:%M")
    print(f"command: {shlex.join([Path(sys.executable).name, *sys.argv])}")
    print(f"started {started}, load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs, {platform.machine()}"
          + (", single thread, times are process CPU time" if args.single_thread else ", wall time"), flush=True)
    lines = report_limits(limits(args, model_dir))
    print("\n" + "\n".join(lines), flush=True)
    if not args.skip_servers:
        lines = report_servers(servers(args, model_dir), args)
        print("\n" + "\n".join(lines))
    print(f"\nfinished {time.strftime('%Y-%m-%d %H:%M')}, load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    benchlib.run(main)
