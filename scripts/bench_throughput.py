#!/usr/bin/env python
"""Single-stream throughput: the server over HTTP against raw in-process mlx-lm, side by side.

What it measures, on one generated random-weight model (never a download), in ONE run:

* decode tokens/s
  - server, from ``/completion`` ``timings.predicted_n / predicted_ms`` (llama.cpp's convention:
    ``n`` tokens over the time after the first one) against raw mlx-lm ``generate_step``
    measured the same way (``n`` / time from the first yielded token to the last);
  - server, client side, streaming: inter-token rate from SSE arrival times,
    ``(n - 1) / (t_last - t_first)``, against raw ``(n - 1) / (t_last - t_first)``;
  - end-to-end request wall time (non-streaming, short prompt + ``n`` tokens) seen by the client,
    against raw mlx-lm from the call to the last token (tokens are given as ids on both sides).
* prefill tokens/s at each prompt length, from ``timings.prompt_n / prompt_ms`` (``n_predict`` 1,
  ``cache_prompt: false``) against raw mlx-lm: prompt length / time until the first token.
  The client-side wall time of that request is reported as well.

Both sides use the same token ids, greedy sampling (``temperature`` 0), ``ignore_eos``, float32
weights and the same prefill chunk (server ``-b`` = mlx-lm ``prefill_step_size``).

Fairness on a noisy shared machine: the server runs as a subprocess and raw mlx-lm in this process;
they never run at the same time. Every measurement is a pair (server, raw) taken back to back, the
order of the pair flips on every repetition (A B, B A, ...), one warm-up pair of each kind is
discarded, and the reported ratio is the median of the per-repetition ratios (each ratio is
"server throughput / raw throughput", so >= 0.95 meets the goal for every row, including the
wall-time rows, where it is raw_ms / server_ms).

Usage::

    /work/venv/bin/python scripts/bench_throughput.py --size small --reps 5
    /work/venv/bin/python scripts/bench_throughput.py --size tiny --reps 3 --prompt-lengths 128,1024 \
        --server-arg=--parallel --server-arg=1 --json /tmp/bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The optimized BLAS must be loaded before anything imports mlx.core.
from mlxcel_compat.runtime.backend import load_optimized_blas  # noqa: E402

BLAS = load_optimized_blas()

import httpx  # noqa: E402
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import load as mlx_load  # noqa: E402

import benchlib  # noqa: E402

GOAL = 0.95

_WORDS = (
    "the of and to in is was for on that with as by at from his her an were are which this be or "
    "had not but have one they their all there been has when who will more no if out so said what "
    "up its about into than them can only other new some time could these two may then do first "
    "any my now such like our over man me even most made after also did many before must through "
    "back years where much your way well down should because each just those people how too little "
    "state good very make world still own see men work long get here between both life being under "
    "never day same another know while last might us great old year off come since against go came "
    "right used take three river mountain garden window letter engine market silver harbor winter "
    "music number system question morning evening forest village kitchen doctor teacher station"
).split()


# --------------------------------------------------------------------------- helpers


def make_text(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    out: list[str] = []
    sentence = 0
    for _ in range(n_words):
        w = rng.choice(_WORDS)
        if sentence == 0:
            w = w.capitalize()
        sentence += 1
        if sentence >= rng.randint(6, 16):
            w += rng.choice((".", ".", ",", ";", "?"))
            sentence = 0 if w[-1] in ".?" else sentence
        out.append(w)
    return " ".join(out)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


@dataclass
class Row:
    """One comparison: server and raw values (higher is better) per repetition."""

    key: str
    label: str
    unit: str
    server: list[float] = field(default_factory=list)
    raw: list[float] = field(default_factory=list)
    # Wall-time rows store milliseconds and compare raw_ms / server_ms.
    lower_is_better: bool = False

    def add(self, server: float, raw: float) -> None:
        self.server.append(server)
        self.raw.append(raw)

    @property
    def ratios(self) -> list[float]:
        if self.lower_is_better:
            return [r / s for s, r in zip(self.server, self.raw)]
        return [s / r for s, r in zip(self.server, self.raw)]

    def summary(self) -> dict[str, Any]:
        ratios = self.ratios
        return {
            "label": self.label,
            "unit": self.unit,
            "server": self.server,
            "raw": self.raw,
            "ratios": ratios,
            "server_median": median(self.server),
            "raw_median": median(self.raw),
            "ratio_median": median(ratios),
            "ratio_min": min(ratios) if ratios else None,
            "ratio_max": max(ratios) if ratios else None,
            "lower_is_better": self.lower_is_better,
        }


# --------------------------------------------------------------------------- server side


class Server(benchlib.ServerProcess):
    """Our server on a free port, started and healthy on construction, with an HTTP client."""

    def __init__(self, model_dir: Path, chunk: int, extra: list[str], log_path: Path, timeout: float) -> None:
        port = benchlib.free_port()
        super().__init__(benchlib.mlxcel_cmd(model_dir, port, ["-b", str(chunk), "-ub", str(chunk), *extra]), port,
                         cwd=ROOT, log_path=log_path, keep_log=True)
        self.url = self.base_url
        self.client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(600.0, connect=5.0))
        self.start()
        self.wait_healthy(timeout)

    def tokenize(self, text: str) -> list[int]:
        r = self.client.post("/tokenize", json={"content": text, "add_special": True})
        r.raise_for_status()
        return [int(t) for t in r.json()["tokens"]]

    def _body(self, tokens: list[int], n_predict: int, stream: bool) -> dict[str, Any]:
        return {
            "prompt": tokens,
            "n_predict": n_predict,
            "temperature": 0,
            "ignore_eos": True,
            "cache_prompt": False,
            "stream": stream,
            "return_tokens": True,
        }

    def complete(self, tokens: list[int], n_predict: int) -> tuple[dict[str, Any], float]:
        t0 = time.perf_counter()
        r = self.client.post("/completion", json=self._body(tokens, n_predict, False))
        wall = time.perf_counter() - t0
        r.raise_for_status()
        return r.json(), wall

    def stream(self, tokens: list[int], n_predict: int) -> tuple[dict[str, Any], list[float], list[int], float]:
        """Return (final chunk, arrival time of each token chunk, token ids, t_send)."""
        arrivals: list[float] = []
        ids: list[int] = []
        final: dict[str, Any] = {}
        t_send = time.perf_counter()
        with self.client.stream("POST", "/completion", json=self._body(tokens, n_predict, True)) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                now = time.perf_counter()
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"server error: {chunk['error']}")
                if chunk.get("stop"):
                    final = chunk
                    break
                if "prompt_progress" in chunk or not chunk.get("tokens"):
                    continue  # progress or held-back text flush: not a new token
                arrivals.append(now)
                ids.extend(int(t) for t in chunk["tokens"])
        return final, arrivals, ids, t_send

    def stop(self) -> None:  # type: ignore[override]
        self.client.close()
        super().stop(grace=15.0, interrupt_first=True)


# --------------------------------------------------------------------------- raw side


class Raw:
    def __init__(self, model_dir: Path, chunk: int) -> None:
        self.model, self.tokenizer = mlx_load(str(model_dir))
        self.chunk = chunk
        dtypes = {str(v.dtype) for _, v in _flat_params(self.model.parameters())}
        self.dtypes = sorted(dtypes)
        mx.eval(self.model(mx.array([[0, 1]]), cache=make_prompt_cache(self.model)))

    def run(self, tokens: list[int], n_predict: int) -> dict[str, Any]:
        """Greedy generation with mlx-lm's generate_step; the time of each token as it is yielded."""
        prompt = mx.array(tokens)
        t0 = time.perf_counter()
        times: list[float] = []
        ids: list[int] = []
        for token, _logprobs in generate_step(
            prompt, self.model, max_tokens=n_predict, prefill_step_size=self.chunk
        ):
            times.append(time.perf_counter())
            ids.append(int(token))
        mx.clear_cache()
        return {"t0": t0, "times": times, "ids": ids}

    def prefill(self, tokens: list[int]) -> float:
        """Seconds from the call until the first token is computed (prefill + one sampled token).

        ``generate_step`` launches the graph of token 2 before it yields token 1, and on MLX's CPU
        backend ``async_eval`` blocks until most of that step has run, so the first yield would
        also pay for most of a decode step the server never runs (about 5% of a 128-token
        prefill). With ``max_tokens=0`` the generator evaluates the first token and stops.
        """
        prompt = mx.array(tokens)
        t0 = time.perf_counter()
        for _ in generate_step(prompt, self.model, max_tokens=0, prefill_step_size=self.chunk):
            pass
        elapsed = time.perf_counter() - t0
        mx.clear_cache()
        return elapsed


def _flat_params(tree: Any, prefix: str = ""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat_params(v, f"{prefix}.{k}" if prefix else k)
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _flat_params(v, f"{prefix}.{i}")
    else:
        yield prefix, tree


# --------------------------------------------------------------------------- benchmark


def build_prompts(server: Server, raw: Raw, lengths: list[int], n_sets: int) -> dict[int, list[list[int]]]:
    """``n_sets`` distinct prompts of each exact length (ids from the server's /tokenize)."""
    out: dict[int, list[list[int]]] = {}
    longest = max(lengths)
    for s in range(n_sets):
        n_words = longest
        while True:
            text = make_text(1000 + s, n_words)
            ids = server.tokenize(text)
            if len(ids) >= longest:
                break
            n_words *= 2
        local = list(raw.tokenizer.encode(text))
        if local != ids:
            print("warning: /tokenize and the in-process tokenizer disagree", file=sys.stderr)
        for n in lengths:
            out.setdefault(n, []).append(ids[:n])
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = Path(args.model) if args.model else benchlib.ensure_model(args.family, args.size, cache_dir=args.cache_dir)
    lengths = sorted(set(args.prompt_lengths))
    n = args.n_predict
    reps = args.reps
    sets = reps + 1  # one warm-up set

    log_path = Path(tempfile.mkstemp(prefix="bench_throughput_server_", suffix=".log")[1])
    print(f"model: {model_dir}", flush=True)
    print(f"BLAS in this process: {BLAS.name} ({BLAS.path})", flush=True)
    t_start = time.perf_counter()
    server = Server(model_dir, args.chunk, args.server_arg, log_path, args.startup_timeout)
    print(f"server up in {time.perf_counter() - t_start:.1f} s: {shlex.join(server.cmd)} (log {log_path})", flush=True)
    try:
        raw = Raw(model_dir, args.chunk)
        prompts = build_prompts(server, raw, sorted(set(lengths + [args.decode_prompt_len])), sets)

        rows: dict[str, Row] = {}

        def row(key: str, label: str, unit: str, lower: bool = False) -> Row:
            if key not in rows:
                rows[key] = Row(key, label, unit, lower_is_better=lower)
            return rows[key]

        checks: dict[str, Any] = {"greedy_agreement": [], "cache_n": [], "prompt_n_mismatch": []}

        def pair(server_fn, raw_fn, rep: int) -> tuple[Any, Any]:
            if rep % 2 == 0:
                s = server_fn()
                r = raw_fn()
            else:
                r = raw_fn()
                s = server_fn()
            return s, r

        for rep in range(sets):
            warm = rep == 0
            tag = "warm-up" if warm else f"rep {rep}/{reps}"

            # -- decode, streaming (server timings + client inter-token times) vs raw
            toks = prompts[args.decode_prompt_len][rep]
            (final, arrivals, s_ids, _t_send), r = pair(
                lambda: server.stream(toks, n), lambda: raw.run(toks, n), rep
            )
            tm = final.get("timings", {})
            rt = r["times"]
            raw_timing_style = len(rt) / (rt[-1] - rt[0]) if len(rt) > 1 else float("nan")
            raw_inter = (len(rt) - 1) / (rt[-1] - rt[0]) if len(rt) > 1 else float("nan")
            srv_timings = tm["predicted_n"] / tm["predicted_ms"] * 1000.0
            srv_inter = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 1 else float("nan")
            checks["greedy_agreement"].append(len(os.path.commonprefix([s_ids, r["ids"]])))
            if tm.get("predicted_n") != n or len(s_ids) != n:
                print(f"warning: server produced {tm.get('predicted_n')} tokens ({len(s_ids)} streamed), expected {n}", file=sys.stderr)
            if not warm:
                row("decode_timings", f"decode tok/s, server `timings` vs raw (n_predict {n})", "tok/s").add(srv_timings, raw_timing_style)
                row("decode_stream", "decode tok/s, client-side streaming inter-token", "tok/s").add(srv_inter, raw_inter)
            print(f"[{tag}] decode: server timings {srv_timings:.1f} tok/s, stream {srv_inter:.1f} tok/s | raw {raw_timing_style:.1f} / {raw_inter:.1f} tok/s", flush=True)

            # -- end-to-end request wall time, non-streaming
            (body, wall), r = pair(lambda: server.complete(toks, n), lambda: raw.run(toks, n), rep)
            raw_wall = r["times"][-1] - r["t0"]
            if not warm:
                row("e2e", f"request wall ms (prompt {args.decode_prompt_len} + {n} tokens, non-stream)", "ms", lower=True).add(wall * 1000.0, raw_wall * 1000.0)
            tmn = body["timings"]
            print(f"[{tag}] e2e: server {wall * 1000:.0f} ms (timings decode {tmn['predicted_per_second']:.1f} tok/s) | raw {raw_wall * 1000:.0f} ms", flush=True)

            # -- prefill at each length
            for length in lengths:
                toks_l = prompts[length][rep]
                (body, wall), raw_ttft = pair(lambda: server.complete(toks_l, 1), lambda: raw.prefill(toks_l), rep)
                tm = body["timings"]
                srv_pp = tm["prompt_n"] / tm["prompt_ms"] * 1000.0
                raw_pp = length / raw_ttft
                checks["cache_n"].append(tm.get("cache_n", 0))
                if tm["prompt_n"] != length:
                    checks["prompt_n_mismatch"].append((length, tm["prompt_n"]))
                if not warm:
                    row(f"prefill_{length}", f"prefill tok/s, {length}-token prompt (`timings`)", "tok/s").add(srv_pp, raw_pp)
                    row(f"prefill_wall_{length}", f"prefill request wall ms, {length} tokens + 1 new (client)", "ms", lower=True).add(wall * 1000.0, raw_ttft * 1000.0)
                print(f"[{tag}] prefill {length}: server {srv_pp:.1f} tok/s ({tm['prompt_ms']:.0f} ms, wall {wall * 1000:.0f} ms) | raw {raw_pp:.1f} tok/s ({raw_ttft * 1000:.0f} ms)", flush=True)
    finally:
        server.stop()

    import mlx_lm

    result = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "server_command": shlex.join(server.cmd),
        "model": str(model_dir),
        "family": args.family,
        "size": args.size,
        "n_predict": n,
        "prompt_lengths": lengths,
        "decode_prompt_len": args.decode_prompt_len,
        "chunk": args.chunk,
        "reps": reps,
        "raw_dtypes": raw.dtypes,
        "blas": {"name": BLAS.name, "path": BLAS.path},
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "elapsed_s": time.perf_counter() - t_start,
        "checks": checks,
        "rows": {k: v.summary() for k, v in rows.items()},
        "goal": GOAL,
    }
    return result


def _verdict(row: dict[str, Any], goal: float) -> str:
    """yes: every repetition met the goal; no: none did; otherwise the noise decides nothing."""
    if row["ratio_min"] >= goal:
        return "yes"
    if row["ratio_max"] < goal:
        return "**no**"
    return "unclear (median " + ("≥" if row["ratio_median"] >= goal else "<") + " 95%)"


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"Model: generated `{result['family']}-{result['size']}` ({', '.join(result['raw_dtypes'])}), "
        f"chunk {result['chunk']}, {result['reps']} repetitions (medians; ratio = median of per-repetition "
        f"server/raw throughput ratios, min–max in brackets), mlx {result['mlx']}, mlx-lm {result['mlx_lm']}, "
        f"BLAS {result['blas']['name']}, {result['cpus']} CPUs, load average at the end "
        f"{result['loadavg'][0]:.1f} / {result['loadavg'][1]:.1f} / {result['loadavg'][2]:.1f}.",
        "",
        "| measurement | server | raw mlx-lm | server/raw | ≥ 95% in every rep? |",
        "|---|---:|---:|---:|:-:|",
    ]
    for r in result["rows"].values():
        fmt = "{:.0f}" if r["unit"] == "ms" else "{:.1f}"
        ratio = r["ratio_median"]
        lines.append(
            f"| {r['label']} | {fmt.format(r['server_median'])} {r['unit']} | {fmt.format(r['raw_median'])} {r['unit']} "
            f"| {ratio:.1%} [{r['ratio_min']:.0%}–{r['ratio_max']:.0%}] | {_verdict(r, result['goal'])} |"
        )
    if result["cpus"] and result["loadavg"][1] > 0.75 * result["cpus"]:
        lines[1:1] = [
            "",
            f"**Busy machine** (5-minute load {result['loadavg'][1]:.1f} on {result['cpus']} CPUs): absolute "
            "numbers are depressed and per-repetition ratios scatter; trust the ratio only when its "
            "min–max range is narrow, otherwise rerun with more --reps.",
        ]
    agree = result["checks"]["greedy_agreement"]
    lines += [
        "",
        f"Greedy tokens identical between server and raw for the first {min(agree) if agree else 0} tokens "
        f"in every decode pair (of {result['n_predict']}); server `cache_n` always "
        f"{'0' if not any(result['checks']['cache_n']) else 'NOT 0'}.",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Server: `{result['server_command']}`",
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="llama", help="generated model family (default llama)")
    p.add_argument("--size", default="small", help="generated model size: tiny or small (default small)")
    p.add_argument("--model", default=None, help="use this model directory instead of a generated one")
    p.add_argument("--cache-dir", default=None, help="where generated models live (default: $MLXCEL_CACHE_DIR or ~/.cache)")
    p.add_argument("--n-predict", type=int, default=128, help="tokens generated per decode measurement (default 128)")
    p.add_argument("--prompt-lengths", default="128,1024",
                   type=lambda s: [int(x) for x in s.split(",") if x.strip()],
                   help="comma-separated prefill prompt lengths in tokens (default 128,1024)")
    p.add_argument("--decode-prompt-len", type=int, default=32, help="prompt length for the decode runs (default 32)")
    p.add_argument("--reps", type=int, default=5, help="measured repetitions after one warm-up (default 5)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk: server -b and mlx-lm prefill_step_size (default 512)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra server flag, repeatable; use the = form for dashes: --server-arg=--parallel --server-arg=1")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for /health (default 300)")
    p.add_argument("--json", default=None, help="also write the full results (every repetition) to this file")
    args = p.parse_args(argv)
    if args.reps < 1 or args.n_predict < 2 or not args.prompt_lengths or min(args.prompt_lengths) < 2:
        p.error("need --reps >= 1, --n-predict >= 2 and prompt lengths >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    table = markdown(result)
    print()
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    benchlib.run(main)
