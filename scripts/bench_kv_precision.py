#!/usr/bin/env python3
"""KV precision (-ctk/-ctv, issue 54) at long context: this server against llama-server, all up at once.

The file (``--model``) is ``scripts/bench_quantized.py``'s ``small-q4_k_m`` (the factory's small
llama, 88M parameters, quantized by ``llama-quantize``; made on first use under ``--cache-dir``),
or ``smollm2``: SmolLM2-135M-Instruct Q4_1 from the package registry (trained weights, so greedy
continuations are not dominated by the near-ties of random weights;
``mlxcel_compat/testing/real_model.py``). Every
server is started from it with ``-np 1 -c CTX`` (``--ctx``, default 32768) and its own
``-ctk T -ctv T`` (llama-server also ``-fa on``: its quantized V cache needs flash attention); by
default llama-server and this server each at ``f16`` and ``q8_0`` (``--configs``; ggml's blocks
here: docs/prompt-cache.md, KV precision). All of them are up for the whole run, and each
measurement runs on every server before the next starts (the order rotates), so a busy
machine's drift falls on all alike.

What it measures, per server:

- **prefill**: a ``--depth``-token prompt (default 16384, the file's tokenizer; the same ids for
  every server) and one new token, ``cache_prompt`` on: ``timings.prompt_per_second``;
- **decode at depth**: the same prompt again with ``--n-predict`` new tokens: the slot holds the
  prompt, so one token is prefilled and the rest decode over ``depth`` positions of KV:
  ``timings.predicted_per_second``;
- **RSS**: ``VmRSS`` at ``/health`` and after the decode (the slot then holds ``depth`` tokens of
  KV in its storage type); ``VmHWM`` at the end;
- **agreement**: greedy ``--accuracy-tokens``-token continuations of ``--accuracy-prompts`` short
  prompts (``cache_prompt`` off); reported per server pair of the same program: how many
  continuations are identical and the mean index of the first differing token (llama-server
  q8_0 against llama-server f16; ours q8_0 against ours f16; ours f16 against ours f32). The
  issue's accuracy goal: ours q8_0 agrees with ours f16 at least as often as llama-server's q8_0
  with its f16 (the verdict line).
- **ratios**: ours over llama-server's at the same type (RSS at depth: lower is better; prefill
  and decode: higher is better), printed last.

Example (the figures in docs/benchmarks/kv-precision.md)::

    python scripts/bench_kv_precision.py --model smollm2 --depth 0 --accuracy-prompts 12   # accuracy
    python scripts/bench_kv_precision.py --depth 16384 --json /tmp/kvprec.json             # long context
    python scripts/bench_kv_precision.py --depth 4096 --ctx 8192 --n-predict 16            # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

import bench_quantized as bq  # noqa: E402
import benchlib  # noqa: E402
import httpx  # noqa: E402

MIB = 2**20
PROGRAMS = {"llama": "llama-server", "mlxcel": "mlxcel"}


def start(args: argparse.Namespace, program: str, kv_type: str, path: Path) -> benchlib.ServerProcess:
    """One server on ``path`` with ``-ctk kv_type -ctv kv_type``, healthy."""
    port = benchlib.free_port()
    common = ["-m", str(path), "-np", "1", "-c", str(args.ctx), "--host", "127.0.0.1", "--port", str(port),
              "-t", str(args.threads), "-tb", str(args.threads), "-ctk", kv_type, "-ctv", kv_type]
    env = {"OPENBLAS_NUM_THREADS": str(args.threads)}
    if program == "llama":
        cmd = [args.llama_server, *common, "-fa", "on"]
    else:
        cmd = [args.python, "-m", "mlxcel_compat", *common]
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    log_dir = Path(args.cache_dir) / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    proc = benchlib.ServerProcess(cmd, port, name=f"{program} {kv_type}", env=env, cwd=ROOT,
                                  log_path=log_dir / f"kvprec-{program}-{kv_type}.log", keep_log=True)
    proc.start()
    deadline = time.monotonic() + args.load_timeout
    with httpx.Client(timeout=2.0) as client:
        while True:
            assert proc.proc is not None
            if proc.proc.poll() is not None:
                raise RuntimeError(f"{proc.name} exited ({proc.proc.returncode}); log {proc.log_path}:\n{proc.tail()}")
            try:
                if client.get(proc.base_url + "/health").status_code == 200:
                    return proc
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{proc.name} not healthy after {args.load_timeout:.0f} s; log {proc.log_path}")
            time.sleep(0.1)


def complete(client: httpx.Client, proc: benchlib.ServerProcess, prompt: list[int], n_predict: int,
             cache_prompt: bool) -> dict[str, Any]:
    body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
            "cache_prompt": cache_prompt, "return_tokens": True}
    r = client.post(proc.base_url + "/completion", json=body)
    if r.status_code != 200:
        raise RuntimeError(f"{proc.name}: /completion answered {r.status_code}: {r.text[:300]}")
    return r.json()


def agreement(a: list[list[int]], b: list[list[int]], n: int) -> tuple[int, float]:
    """Identical continuations, and the mean index of the first differing token (n when equal)."""
    firsts = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), n) for p, q in zip(a, b)]
    return sum(f == n for f in firsts), sum(firsts) / max(len(firsts), 1)


def report_agreement(results: dict[str, dict[str, Any]], n_prompts: int, n_tokens: int) -> dict[str, Any]:
    """Print and return the agreement of each pair of servers that ran (q8_0 against f16 of the
    same program, our f16 against our f32 and against llama-server's f16)."""
    pairs = [("llama:q8_0", "llama:f16"), ("mlxcel:q8_0", "mlxcel:f16"), ("mlxcel:f16", "mlxcel:f32"),
             ("mlxcel:f16", "llama:f16")]
    out: dict[str, Any] = {}
    if n_prompts == 0:  # --accuracy-prompts 0: speed and memory only
        return out
    for a, b in pairs:
        if a in results and b in results:
            same, first = agreement(results[a]["continuations"], results[b]["continuations"], n_tokens)
            out[f"{a} vs {b}"] = {"identical": same, "mean_first_difference": first}
            print(f"agreement {a} vs {b}: {same}/{n_prompts} identical, mean first difference at {first:.1f}", flush=True)
    ours, theirs = out.get("mlxcel:q8_0 vs mlxcel:f16"), out.get("llama:q8_0 vs llama:f16")
    if ours and theirs:
        met = (ours["identical"], ours["mean_first_difference"]) >= (theirs["identical"], theirs["mean_first_difference"])
        print(f"verdict: q8_0 agreement with f16, ours {ours['identical']}/{n_prompts} against llama-server's "
              f"{theirs['identical']}/{n_prompts}: {'met' if met else 'missed'}", flush=True)
    return out


def report_ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Ours over llama-server's, per KV type both ran: RSS at depth, prefill and decode."""
    out: dict[str, dict[str, float]] = {}
    for label in results:
        program, kv_type = label.split(":", 1)
        theirs = results.get(f"llama:{kv_type}")
        if program != "mlxcel" or theirs is None:
            continue
        ours = results[label]
        ratios = {key: ours[key] / theirs[key] for key in ("rss_depth_mib", "prefill_tps", "decode_tps")
                  if ours.get(key) and theirs.get(key)}
        out[kv_type] = ratios
        print(f"ours / llama-server at {kv_type}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()), flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="llama:f16,llama:q8_0,mlxcel:f16,mlxcel:q8_0",
                        help="comma list of PROGRAM:TYPE (PROGRAM: llama or mlxcel)")
    parser.add_argument("--model", choices=("small-q4_k_m", "smollm2"), default="small-q4_k_m")
    parser.add_argument("--depth", type=int, default=16384, help="tokens in the slot (0: agreement and RSS at /health only)")
    parser.add_argument("--ctx", type=int, default=32768)
    parser.add_argument("--n-predict", type=int, default=32)
    parser.add_argument("--accuracy-prompts", type=int, default=10)
    parser.add_argument("--accuracy-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    default_cache = str(Path.home() / ".cache" / "mlxcel_compat" / "bench-quantized")
    parser.add_argument("--cache-dir", default=os.environ.get("MLXCEL_BENCH_CACHE", default_cache))
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", str(bq.LLAMA_BIN / "llama-server")))
    parser.add_argument("--llama-quantize", default=os.environ.get("LLAMA_QUANTIZE", str(bq.LLAMA_BIN / "llama-quantize")))
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--load-timeout", type=float, default=600.0)
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args()
    configs = [tuple(c.split(":", 1)) for c in args.configs.split(",")]
    if any(p not in PROGRAMS for p, _ in configs):
        raise SystemExit(f"--configs: programs are {', '.join(PROGRAMS)}")

    if args.model == "smollm2":
        from mlxcel_compat.testing.real_model import ensure_real_model

        path = ensure_real_model()
    else:
        path = bq.small_quantized("Q4_K_M")(args)
    prep = bq.prepare(str(path), args.depth, 1, args.accuracy_prompts, args.accuracy_tokens, reference=False)
    long_prompt, prompts = prep["prefill"][0] if args.depth else [], prep["prompts"][: args.accuracy_prompts]
    print(f"file {path.name}; depth {len(long_prompt)} tokens; -c {args.ctx}; {len(configs)} servers up at once",
          flush=True)

    procs: dict[str, benchlib.ServerProcess] = {}
    results: dict[str, dict[str, Any]] = {}
    try:
        for program, kv_type in configs:
            label = f"{program}:{kv_type}"
            procs[label] = start(args, program, kv_type, path)
            assert procs[label].proc is not None
            results[label] = {"rss_health_mib": bq.proc_status(procs[label].proc.pid)["VmRSS"] / MIB}
        labels = list(procs)
        with httpx.Client(timeout=7200) as client:
            for label in labels:  # agreement first (short prompts, the slot's cache off)
                results[label]["continuations"] = [
                    complete(client, procs[label], p, args.accuracy_tokens, False)["tokens"] for p in prompts]
            agreements = report_agreement(results, len(prompts), args.accuracy_tokens)
            phases = (("prefill", 1), ("decode", args.n_predict)) if args.depth else ()
            for step, (what, n_predict) in enumerate(phases):
                for label in labels[step % len(labels):] + labels[: step % len(labels)]:
                    answer = complete(client, procs[label], long_prompt, n_predict, True)
                    t = answer["timings"]
                    if what == "prefill":
                        results[label]["prefill_tps"] = t["prompt_per_second"]
                        results[label]["prefill_n"] = t["prompt_n"]
                    else:
                        results[label]["decode_tps"] = t["predicted_per_second"]
                        results[label]["decode_prompt_n"] = t["prompt_n"]
                        status = bq.proc_status(procs[label].proc.pid)
                        results[label]["rss_depth_mib"] = status["VmRSS"] / MIB
                    print(f"  {label:12s} {what}: {t['prompt_per_second' if what == 'prefill' else 'predicted_per_second']:.1f} t/s",
                          flush=True)
        for label in labels:
            results[label]["peak_rss_mib"] = bq.proc_status(procs[label].proc.pid)["VmHWM"] / MIB
    finally:
        for proc in procs.values():
            proc.stop(grace=30.0)

    print(f"\n{'server':14s} {'RSS /health':>12s} {'RSS at depth':>13s} {'peak':>8s} {'prefill t/s':>12s} {'decode t/s':>11s}")
    for label, r in results.items():
        print(f"{label:14s} {r['rss_health_mib']:10.0f} M {r.get('rss_depth_mib', 0):11.0f} M {r['peak_rss_mib']:6.0f} M "
              f"{r.get('prefill_tps', 0):12.1f} {r.get('decode_tps', 0):11.2f}")
    ratios = report_ratios(results)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "agreement": agreements, "ratios": ratios,
                                               "depth": len(long_prompt), "ctx": args.ctx}, indent=1))
    return 0


if __name__ == "__main__":
    benchlib.run(main)
