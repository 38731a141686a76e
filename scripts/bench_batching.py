#!/usr/bin/env python
"""Concurrent-stream (continuous batching) benchmark: our server against mlx_lm.server, same run.

Both servers are started here as subprocesses, on free ports, from the same generated float32
model directory (never a download):

* ours:   ``python -m mlxcel_compat -m DIR -np max(C) -c CTX -b CHUNK`` (continuous batching on);
* theirs: ``mlx_lm.server --model DIR --decode-concurrency max(C) --prompt-concurrency max(C)
  --prefill-step-size CHUNK`` (its BatchGenerator mode), run through a small wrapper that first
  calls our ``backend.load_optimized_blas()``, so both use the same BLAS and the same OpenBLAS
  kernels.

For each mode, concurrency level C and repetition, one *round* is run on each server (the order
flips every repetition: ours-theirs, theirs-ours, ...), with streaming ``POST /v1/completions``
requests (asyncio + httpx):

* ``burst``: C requests launched at once (the worst case for time to first token: C prompts
  arrive together and all need prefilling before the last first token);
* ``steady``: C closed-loop clients; client i starts at i * D / C (D: one lone request's duration
  on that server, timed in the warm-up) and sends ``--requests-per-client`` requests back to back.
  Arrivals then meet a server that is already decoding, as with real concurrent users.
 Every request in the whole run has its own prompt
(so neither server's prompt cache can help), but the two servers get exactly the same prompts for
the same (C, repetition). Greedy (``temperature`` 0), ``max_tokens`` N. Ours gets
``ignore_eos: true``, so it generates exactly N tokens. mlx_lm.server has no ``ignore_eos`` (its
BatchGenerator always stops on the tokenizer's EOS ids). The only way to force its length is
``logit_bias`` = -1e9 on the EOS ids (``--theirs-eos logit-bias``). But any logits processor
moves its batched decode step onto a per-row slice + concatenate path, which would handicap it.
So by default (``--theirs-eos count``) it gets nothing extra, and the tokens it actually
generated are counted and used. Early stops (finish_reason ``stop``) are reported. The token
count per request is taken from ``usage.completion_tokens`` (``stream_options.include_usage``),
falling back to the number of streamed content chunks. Min/max per request are reported.

Per mode, level and server:

* TTFT p50/p90: request start to the first SSE chunk with non-empty text, pooled over repetitions;
* aggregate decode tok/s: tokens streamed (all requests) while every request of the round was
  decoding, i.e. between the latest first token and the earliest last token, per second; median
  over repetitions (a server that answers one request early while it prefills the others is not
  charged for that head start);
* wall tok/s: total generated tokens / (round start .. latest last token); median over reps;
* per-stream decode tok/s: (n - 1) / (first token .. last token) of each request; median.

Goals (from the issue), evaluated per mode for ours at the largest C (8 by default); throughput
is the aggregate decode tok/s for a burst and the wall tok/s for the closed loop:

* throughput at C >= 3x that at C = 1;
* TTFT p90 at C <= 2 x TTFT p90 at C = 1 + one prefill, where "one prefill" is the median
  server-side ``timings.prompt_ms`` of our single-stream requests (the bound is printed);
* ours ahead of mlx_lm.server (throughput) at every C.

Usage::

    /work/venv/bin/python scripts/bench_batching.py                      # small model, C 1,2,4,8
    /work/venv/bin/python scripts/bench_batching.py --size tiny --concurrency 1,2 \
        --n-predict 16 --reps 1 --json /tmp/batching.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

import benchlib  # noqa: E402
from benchlib import ServerProcess as Server, pct, ratio  # noqa: E402

OURS, THEIRS = "ours", "mlx_lm"

# Plain English words for prompts (the generated tokenizer was trained on English-like text).
WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government "
    "number night point home water room mother area money story fact month lot right study book "
    "eye job word business issue side kind head house service friend father power hour game line "
    "end member law car city community name president team minute idea kid body information back "
    "parent face others level office door health person art war history party result change "
    "morning reason research girl guy moment air teacher force education foot boy age policy "
    "music market sense nation plan college interest death experience effect class control care "
    "field development role effort rate heart drug show leader light voice wife police mind price "
    "report decision son view relationship town road arm difference value building action model "
    "season society tax director position player record paper space ground form event official "
    "matter center couple site project activity star table need court oil situation cost industry "
    "figure street image phone data picture practice piece land product doctor wall patient worker "
    "news test movie north love support technology step baby computer type attention film tree "
    "source organization hair window evidence population site river garden stone bridge winter "
    "summer autumn spring valley mountain forest ocean island desert village harbor castle tower "
    "small large quick slow bright dark green blue red yellow quiet loud warm cold early late "
    "walks runs builds writes reads opens carries finds keeps holds brings makes takes gives sees "
    "under over near across between behind before after during through around without within"
).split()


# ----------------------------------------------------------------------------- prompts

class PromptMaker:
    """Deterministic prompts of about ``target`` tokens (counted with the model's tokenizer when
    the ``tokenizers`` package can read it, else ``target`` words), each starting with a word
    that differs from the previous prompts' first words as long as the word list lasts."""

    def __init__(self, model_dir: Path, target: int, seed: int) -> None:
        self.target = target
        self.rng = random.Random(seed)
        self.serial = 0
        self.counter = None
        try:
            from tokenizers import Tokenizer

            tk = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
            self.counter = lambda s: len(tk.encode(s, add_special_tokens=False).ids)
        except Exception:  # noqa: BLE001 - fall back to words
            self.counter = None
        order = list(range(len(WORDS)))
        random.Random(seed ^ 0x5A5A).shuffle(order)
        self.first_words = [WORDS[i] for i in order]

    def make(self) -> str:
        first = self.first_words[self.serial % len(self.first_words)].capitalize()
        self.serial += 1
        words = [first]
        if self.counter is None:
            words += [self.rng.choice(WORDS) for _ in range(max(0, self.target - 1))]
            return " ".join(words)
        # Grow in steps, then trim back to the target token count.
        while self.counter(" ".join(words)) < self.target:
            words += [self.rng.choice(WORDS) for _ in range(8)]
        while len(words) > 1 and self.counter(" ".join(words[:-1])) >= self.target:
            words.pop()
        return " ".join(words)


# ----------------------------------------------------------------------------- servers

# mlx_lm.server with exactly our BLAS set-up (same library, same OpenBLAS kernel choice).
THEIRS_WRAPPER = (
    "import sys\n"
    "from mlxcel_compat.runtime.backend import load_optimized_blas\n"
    "load_optimized_blas()\n"
    "sys.argv[0] = 'mlx_lm.server'\n"
    "from mlx_lm.server import main\n"
    "main()\n"
)


def model_eos_ids(model_dir: Path) -> list[int]:
    """Every id either loader could treat as EOS: config/generation_config eos_token_id and the
    tokenizer_config's eos_token."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        try:
            v = json.loads((model_dir / name).read_text()).get("eos_token_id")
        except (OSError, ValueError):
            continue
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, list):
            ids.update(int(x) for x in v)
    try:
        eos = json.loads((model_dir / "tokenizer_config.json").read_text()).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        for t in json.loads((model_dir / "tokenizer.json").read_text()).get("added_tokens", []):
            if t.get("content") == eos:
                ids.add(int(t["id"]))
    except (OSError, ValueError):
        pass
    return sorted(ids)


# ----------------------------------------------------------------------------- client

@dataclass
class Req:
    prompt_words: int
    t_start: float = 0.0
    t_first: float | None = None
    t_last: float | None = None
    chunks: int = 0
    times: list[float] = field(default_factory=list)  # arrival of each chunk with text
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    prompt_ms: float | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else self.chunks

    @property
    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_start

    @property
    def stream_tps(self) -> float | None:
        if self.t_first is None or self.t_last is None or self.t_last <= self.t_first or self.tokens < 2:
            return None
        return (self.tokens - 1) / (self.t_last - self.t_first)


def request_body(server: str, prompt: str, args: argparse.Namespace, eos_ids: list[int]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": args.n_predict,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if server == OURS:
        body["ignore_eos"] = True
    elif args.theirs_eos == "logit-bias" and eos_ids:
        body["logit_bias"] = {str(t): -1e9 for t in eos_ids}
    return body


async def one_request(client: httpx.AsyncClient, base: str, body: dict[str, Any], r: Req) -> None:
    r.t_start = time.perf_counter()
    try:
        async with client.stream("POST", base + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, ": keepalive" comments
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.perf_counter()
                try:
                    obj = json.loads(payload)
                except ValueError:
                    continue
                if "error" in obj:
                    r.error = str(obj["error"])[:300]
                    return
                for ch in obj.get("choices") or []:
                    if ch.get("text"):
                        r.chunks += 1
                        r.times.append(now)
                        if r.t_first is None:
                            r.t_first = now
                        r.t_last = now
                    if ch.get("finish_reason"):
                        r.finish_reason = ch["finish_reason"]
                usage = obj.get("usage")
                if isinstance(usage, dict):
                    r.completion_tokens = usage.get("completion_tokens", r.completion_tokens)
                    r.prompt_tokens = usage.get("prompt_tokens", r.prompt_tokens)
                timings = obj.get("timings")
                if isinstance(timings, dict) and timings.get("prompt_ms") is not None:
                    r.prompt_ms = float(timings["prompt_ms"])
    except httpx.HTTPError as exc:
        r.error = f"{type(exc).__name__}: {exc}"


@dataclass
class Round:
    server: str
    concurrency: int
    rep: int
    t0: float
    reqs: list[Req] = field(default_factory=list)
    mode: str = "burst"

    def ok(self) -> list[Req]:
        return [r for r in self.reqs if r.error is None and r.t_first is not None]

    @property
    def total_tokens(self) -> int:
        return sum(r.tokens for r in self.ok())

    @property
    def agg_decode_tps(self) -> float | None:
        """Tokens streamed per second while every request of the round was decoding: from the
        last first token to the first last token. (Counting from the earliest first token would
        charge a server for answering one early request while it prefills the others.)"""
        ok = self.ok()
        if not ok:
            return None
        start = max(r.t_first for r in ok)  # type: ignore[type-var]
        end = min(r.t_last for r in ok)  # type: ignore[type-var]
        if end <= start:
            return None  # no moment where all requests were decoding
        return sum(1 for r in ok for t in r.times if start < t <= end) / (end - start)

    @property
    def wall_tps(self) -> float | None:
        ok = self.ok()
        if not ok:
            return None
        span = max(r.t_last for r in ok) - self.t0  # type: ignore[type-var]
        return self.total_tokens / span if span > 0 else None


async def run_round(server: Server, prompts: list[str], args: argparse.Namespace, eos_ids: list[int],
                    rep: int) -> Round:
    limits = httpx.Limits(max_connections=len(prompts) + 4, max_keepalive_connections=0)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        reqs = [Req(prompt_words=len(p.split())) for p in prompts]
        bodies = [request_body(server.name, p, args, eos_ids) for p in prompts]
        rnd = Round(server.name, len(prompts), rep, time.perf_counter(), reqs)
        await asyncio.gather(*(one_request(client, server.base_url, b, r) for b, r in zip(bodies, reqs)))
    return rnd


async def run_steady_round(server: Server, prompts: list[list[str]], args: argparse.Namespace, eos_ids: list[int],
                           rep: int, duration: float) -> Round:
    """Closed loop: client i starts at i * duration / C (duration: one lone request on this
    server), then sends its prompts one after another, each as soon as the previous one ended."""
    c = len(prompts)
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=0)
    timeout = httpx.Timeout(args.request_timeout, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        rnd = Round(server.name, c, rep, time.perf_counter(), mode="steady")

        async def client_loop(i: int, own: list[str]) -> None:
            await asyncio.sleep(i * duration / c)
            for p in own:
                r = Req(prompt_words=len(p.split()))
                rnd.reqs.append(r)
                await one_request(client, server.base_url, request_body(server.name, p, args, eos_ids), r)

        await asyncio.gather(*(client_loop(i, own) for i, own in enumerate(prompts)))
    return rnd


# ----------------------------------------------------------------------------- stats

def med(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(rounds: list[Round]) -> dict[str, Any]:
    reqs = [r for rnd in rounds for r in rnd.reqs]
    ok = [r for rnd in rounds for r in rnd.ok()]
    toks = [r.tokens for r in ok]
    ttfts = [r.ttft * 1000 for r in ok if r.ttft is not None]
    return {
        "rounds": len(rounds),
        "requests": len(reqs),
        "errors": [r.error for r in reqs if r.error is not None],
        "ttft_p50_ms": pct(ttfts, 50),
        "ttft_p90_ms": pct(ttfts, 90),
        "agg_decode_tps": med([rnd.agg_decode_tps for rnd in rounds]),
        "wall_tps": med([rnd.wall_tps for rnd in rounds]),
        "stream_tps_p50": med([r.stream_tps for r in ok]),
        "tokens_min": min(toks) if toks else None,
        "tokens_max": max(toks) if toks else None,
        "tokens_from_usage": all(r.completion_tokens is not None for r in ok) if ok else None,
        "chunks_min": min((r.chunks for r in ok), default=None),
        "prompt_tokens": sorted({r.prompt_tokens for r in ok if r.prompt_tokens is not None}),
        "server_prompt_ms_p50": med([r.prompt_ms for r in ok]),
        "finish_reasons": sorted({str(r.finish_reason) for r in ok}),
    }


def f1(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def f2(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def tok_range(s: dict[str, Any]) -> str:
    if s["tokens_min"] is None:
        return "-"
    t = str(s["tokens_min"]) if s["tokens_min"] == s["tokens_max"] else f"{s['tokens_min']}-{s['tokens_max']}"
    return t if s["tokens_from_usage"] else t + " (chunks)"


def report(mode: str, rounds: list[Round], servers: list[str], args: argparse.Namespace, model_dir: Path) -> dict[str, Any]:
    """The tables and goal verdicts of one mode's rounds (markdown lines plus the numbers)."""
    summ: dict[str, dict[int, dict[str, Any]]] = {}
    for name in servers:
        summ[name] = {c: summarize([r for r in rounds if r.server == name and r.concurrency == c]) for c in args.levels}
    max_c = max(args.levels)

    lines: list[str] = []
    lines.append("")
    how = ("all C requests sent at once" if mode == "burst" else
           f"closed loop: C clients, {args.requests_per_client} requests each back to back, staggered starts")
    lines.append(f"## Concurrent streams ({mode}: {how}): {model_dir.name}, prompt ~{args.prompt_tokens} tokens, "
                 f"{args.n_predict} generated tokens per request, {args.reps} rep(s)")
    lines.append("")
    lines.append("| C | server | TTFT p50 ms | TTFT p90 ms | agg decode tok/s | wall tok/s | per-stream tok/s p50 "
                 "| tokens/req | prompt tokens | errors |")
    lines.append("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in args.levels:
        for name in servers:
            s = summ[name][c]
            lines.append(f"| {c} | {name} | {f1(s['ttft_p50_ms'])} | {f1(s['ttft_p90_ms'])} | {f1(s['agg_decode_tps'])} "
                         f"| {f1(s['wall_tps'])} | {f1(s['stream_tps_p50'])} | {tok_range(s)} "
                         f"| {','.join(map(str, s['prompt_tokens'])) or '-'} | {len(s['errors'])} |")

    c1 = args.levels[0]
    ours = summ.get(OURS)
    theirs = summ.get(THEIRS)
    prefill_ms = None
    if ours is not None:
        prefill_ms = ours[c1]["server_prompt_ms_p50"]
    lines.append("")
    head = ["C"]
    if ours is not None:
        head += [f"ours agg C/{c1}", f"ours wall C/{c1}"]
    if theirs is not None:
        head += [f"mlx_lm agg C/{c1}"]
    if ours is not None and theirs is not None:
        head += ["ours/mlx_lm agg", "ours/mlx_lm wall", "mlx_lm/ours TTFT p90"]
    if ours is not None:
        head += [f"ours TTFT p90 bound (2·p90@{c1} + prefill) ms", "ours TTFT p90 / bound"]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "|".join("---:" for _ in head) + "|")
    ratios: dict[int, dict[str, Any]] = {}
    bound = None
    if ours is not None and ours[c1]["ttft_p90_ms"] is not None:
        bound = 2 * ours[c1]["ttft_p90_ms"] + (prefill_ms or 0.0)
    for c in args.levels:
        row = [str(c)]
        rr: dict[str, Any] = {}
        if ours is not None:
            rr["ours_scaling_agg"] = ratio(ours[c]["agg_decode_tps"], ours[c1]["agg_decode_tps"])
            rr["ours_scaling_wall"] = ratio(ours[c]["wall_tps"], ours[c1]["wall_tps"])
            row += [f2(rr["ours_scaling_agg"]), f2(rr["ours_scaling_wall"])]
        if theirs is not None:
            rr["theirs_scaling_agg"] = ratio(theirs[c]["agg_decode_tps"], theirs[c1]["agg_decode_tps"])
            row += [f2(rr["theirs_scaling_agg"])]
        if ours is not None and theirs is not None:
            rr["ours_vs_theirs_agg"] = ratio(ours[c]["agg_decode_tps"], theirs[c]["agg_decode_tps"])
            rr["ours_vs_theirs_wall"] = ratio(ours[c]["wall_tps"], theirs[c]["wall_tps"])
            rr["theirs_vs_ours_ttft_p90"] = ratio(theirs[c]["ttft_p90_ms"], ours[c]["ttft_p90_ms"])
            row += [f2(rr["ours_vs_theirs_agg"]), f2(rr["ours_vs_theirs_wall"]), f2(rr["theirs_vs_ours_ttft_p90"])]
        if ours is not None:
            rr["ttft_bound_ms"] = bound
            rr["ttft_p90_over_bound"] = ratio(ours[c]["ttft_p90_ms"], bound)
            row += [f1(bound), f2(rr["ttft_p90_over_bound"])]
        ratios[c] = rr
        lines.append("| " + " | ".join(row) + " |")

    goals: dict[str, Any] = {}
    # A burst is judged on its decode phase; a closed loop on its throughput over the whole run
    # (its requests start and end at different times, so there is no common decode phase).
    metric, metric_name = ("agg", "aggregate decode tok/s") if mode == "burst" else ("wall", "wall tok/s")
    lines.append("")
    if ours is not None:
        cg = 8 if 8 in args.levels else max_c
        note = "" if cg == 8 else f" (8 not measured: using C={cg})"
        sc = ratios[cg][f"ours_scaling_{metric}"]
        goals["scaling"] = {"C": cg, "metric": metric, "value": sc, "target": 3.0, "pass": sc is not None and sc >= 3.0 and c1 == 1}
        lines.append(f"- Goal: {cg} streams >= 3x single-stream {metric_name}{note}: "
                     f"{f2(sc)}x -> {'PASS' if goals['scaling']['pass'] else 'FAIL'}")
        tp = ours[cg]["ttft_p90_ms"]
        ok = tp is not None and bound is not None and tp <= bound
        goals["ttft"] = {"C": cg, "ttft_p90_ms": tp, "bound_ms": bound, "ttft_p90_1_ms": ours[c1]["ttft_p90_ms"],
                         "prefill_ms": prefill_ms, "pass": ok}
        lines.append(f"- Goal: TTFT p90 at {cg} streams <= 2 x TTFT p90 at {c1} ({f1(ours[c1]['ttft_p90_ms'])} ms) "
                     f"+ one prefill ({f1(prefill_ms)} ms, server timings.prompt_ms) = {f1(bound)} ms: "
                     f"{f1(tp)} ms -> {'PASS' if ok else 'FAIL'}")
    if ours is not None and theirs is not None:
        behind = [c for c in args.levels if not ((ratios[c][f"ours_vs_theirs_{metric}"] or 0) > 1.0)]
        goals["vs_mlx_lm"] = {"metric": metric, "behind_at": behind, "pass": not behind}
        lines.append(f"- Goal: ahead of mlx_lm.server ({metric_name}) at every C: "
                     + ("PASS" if not behind else f"FAIL at C={','.join(map(str, behind))}"))
    if theirs is not None:
        fr = sorted({f for c in args.levels for f in theirs[c]["finish_reasons"]})
        lines.append(f"- mlx_lm length forcing: {args.theirs_eos}; finish reasons {fr}; "
                     f"tokens per request {', '.join(f'C={c}: {tok_range(theirs[c])}' for c in args.levels)}")
        short = sum(1 for r in rounds if r.server == THEIRS for q in r.ok() if q.tokens < args.n_predict)
        if short:
            lines.append(f"- WARNING: {short} mlx_lm request(s) stopped on EOS before {args.n_predict} tokens; "
                         "its tok/s use the tokens actually generated (try --theirs-eos logit-bias)")
    errors = {n: {c: summ[n][c]["errors"] for c in args.levels if summ[n][c]["errors"]} for n in servers}
    for n, errs in errors.items():
        for c, e in errs.items():
            lines.append(f"- {n} C={c}: {len(e)} failed request(s), first: {e[0]}")
    return {"lines": lines, "summary": {n: {str(c): v for c, v in d.items()} for n, d in summ.items()},
            "ratios": {str(c): v for c, v in ratios.items()}, "goals": goals}


# ----------------------------------------------------------------------------- main

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="llama")
    ap.add_argument("--size", default="small")
    ap.add_argument("--model", default=None, help="model directory (overrides --family/--size)")
    ap.add_argument("--concurrency", default="1,2,4,8", help="comma-separated levels (default 1,2,4,8)")
    ap.add_argument("--n-predict", type=int, default=64, help="tokens generated per request (default 64)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length, about (default 128)")
    ap.add_argument("--reps", type=int, default=3, help="rounds per level and server (default 3)")
    ap.add_argument("--mode", default="burst,steady",
                    help="comma-separated: burst (all C requests at once), steady (C closed-loop clients with "
                         "staggered starts); default both")
    ap.add_argument("--requests-per-client", type=int, default=3, help="steady mode: requests per client (default 3)")
    who = ap.add_mutually_exclusive_group()
    who.add_argument("--ours-only", action="store_true")
    who.add_argument("--theirs-only", action="store_true")
    ap.add_argument("--json", metavar="PATH", help="also write everything (incl. per-request data) as JSON; '-' = stdout")
    ap.add_argument("--ctx-size", type=int, default=0, help="our -c (default: max(4096, 2*(prompt+n_predict)))")
    ap.add_argument("--prefill-chunk", type=int, default=2048,
                    help="our -b and mlx_lm --prefill-step-size (default 2048, mlx_lm's default)")
    ap.add_argument("--theirs-eos", choices=("count", "logit-bias"), default="count",
                    help="mlx_lm.server cannot ignore EOS: count the tokens it generated (default) or force the "
                         "length with logit_bias -1e9 on the EOS ids (slows its batched decode path)")
    ap.add_argument("--ours-arg", action="append", default=[], help="extra argument for our server (repeatable)")
    ap.add_argument("--theirs-arg", action="append", default=[], help="extra argument for mlx_lm.server (repeatable)")
    ap.add_argument("--no-warmup", action="store_true", help="skip the discarded warm-up rounds")
    ap.add_argument("--seed", type=int, default=1234, help="prompt seed")
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--request-timeout", type=float, default=900.0)
    ap.add_argument("--python", default=sys.executable, help="interpreter for both servers")
    ap.add_argument("--keep-logs", action="store_true", help="keep the server logs (path printed)")
    args = ap.parse_args(argv)
    try:
        args.levels = sorted({int(x) for x in args.concurrency.split(",") if x.strip()})
    except ValueError:
        ap.error("--concurrency: comma-separated integers")
    if not args.levels or args.levels[0] < 1:
        ap.error("--concurrency: levels must be >= 1")
    args.modes = [m for m in ("burst", "steady") if m in {x.strip() for x in args.mode.split(",")}]
    if not args.modes:
        ap.error("--mode: burst and/or steady")
    if args.n_predict < 1 or args.reps < 1 or args.prompt_tokens < 1 or args.requests_per_client < 1:
        ap.error("--n-predict, --reps and --prompt-tokens must be >= 1")
    return args


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command_line = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(["bench_batching.py", *argv])
    if args.model:
        model_dir = Path(args.model).expanduser().resolve()
    else:
        model_dir = benchlib.ensure_model(args.family, args.size)
    max_c = max(args.levels)
    ctx = args.ctx_size or max(4096, 2 * (args.prompt_tokens + args.n_predict))
    eos_ids = model_eos_ids(model_dir)

    log_dir = Path(tempfile.mkdtemp(prefix="bench_batching-"))
    servers: dict[str, Server] = {}
    if not args.theirs_only:
        servers[OURS] = Server.mlxcel(
            model_dir, ["-np", str(max_c), "-c", str(ctx), "-b", str(args.prefill_chunk), "-ub", str(args.prefill_chunk), *args.ours_arg],
            python=args.python, name=OURS, log_path=log_dir / f"{OURS}.log", keep_log=args.keep_logs)
    if not args.ours_only:
        port = benchlib.free_port()
        cmd = [args.python, "-c", THEIRS_WRAPPER, "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
               "--decode-concurrency", str(max_c), "--prompt-concurrency", str(max_c),
               "--prefill-step-size", str(args.prefill_chunk), "--log-level", "WARNING", *args.theirs_arg]
        servers[THEIRS] = Server(cmd, port, name=THEIRS, log_path=log_dir / f"{THEIRS}.log",
                                 keep_log=args.keep_logs)

    versions: dict[str, str] = {}
    try:
        from importlib.metadata import version

        for pkg in ("mlx", "mlx-lm", "httpx"):
            versions[pkg] = version(pkg)
    except Exception:  # noqa: BLE001
        pass

    print(f"command: {command_line}")
    for s in servers.values():
        shown = s.cmd if s.name == OURS else [s.cmd[0], "-c", "<load_optimized_blas() wrapper → mlx_lm.server>", *s.cmd[3:]]
        print(f"{s.name} server: {shlex.join(shown)}")
    print(f"model: {model_dir} | EOS ids {eos_ids} | mlx_lm EOS handling: {args.theirs_eos}")
    print(f"host: {platform.platform()} | cpus {os.cpu_count()} | loadavg {os.getloadavg()} | {versions}")
    sys.stdout.flush()

    prompts = PromptMaker(model_dir, args.prompt_tokens, args.seed)
    rounds: list[Round] = []
    lone_request_s: dict[str, float] = {}  # steady mode: one lone request's duration per server
    load_start = os.getloadavg()
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_healthy(args.startup_timeout)
            log(f"{s.name} ready on {s.base_url}")
        order = list(servers.values())

        async def bench() -> None:
            # Discarded: one single request, then one burst at the largest level, per server
            # (the single request also times a lone request for the steady mode's start offsets).
            for c in sorted({1, max_c}) if not args.no_warmup else [1]:
                ps = [prompts.make() for _ in range(c)]
                for s in order:
                    w = await run_round(s, ps, args, eos_ids, -1)
                    bad = [r.error for r in w.reqs if r.error]
                    if bad:
                        raise RuntimeError(f"{s.name} warm-up failed: {bad[0]}\n{s.tail()}")
                    if c == 1:
                        lone_request_s[s.name] = w.reqs[0].t_last - w.reqs[0].t_start  # type: ignore[operator]
            log("warm-up done")
            for mode in args.modes:
                for c in args.levels:
                    for rep in range(args.reps):
                        seq = order if rep % 2 == 0 else order[::-1]
                        if mode == "burst":
                            ps = [prompts.make() for _ in range(c)]
                        else:
                            own = [[prompts.make() for _ in range(args.requests_per_client)] for _ in range(c)]
                        for s in seq:
                            if mode == "burst":
                                rnd = await run_round(s, ps, args, eos_ids, rep)
                            else:
                                rnd = await run_steady_round(s, own, args, eos_ids, rep, lone_request_s[s.name])
                            rounds.append(rnd)
                            log(f"{mode} C={c} rep={rep} {s.name}: agg {f1(rnd.agg_decode_tps)} tok/s, "
                                f"wall {f1(rnd.wall_tps)} tok/s, tokens {rnd.total_tokens}, "
                                f"errors {sum(r.error is not None for r in rnd.reqs)}")

        asyncio.run(bench())
    finally:
        for s in servers.values():
            s.stop(grace=15.0)
    load_end = os.getloadavg()

    results = {mode: report(mode, [r for r in rounds if r.mode == mode], list(servers), args, model_dir) for mode in args.modes}
    for mode in args.modes:
        print("\n".join(results[mode]["lines"]))
    print(f"\n- load average start {tuple(round(x, 2) for x in load_start)}, end {tuple(round(x, 2) for x in load_end)} "
          f"on {os.cpu_count()} CPUs (noisy if well above 0)")

    if args.keep_logs:
        print(f"server logs: {log_dir}")
    else:  # each server deleted its own log in stop()
        try:
            log_dir.rmdir()
        except OSError:
            pass

    if args.json:
        out = {
            "command": command_line,
            "server_commands": {n: s.cmd for n, s in servers.items()},
            "model": str(model_dir),
            "eos_ids": eos_ids,
            "config": {k: v for k, v in vars(args).items()},
            "versions": versions,
            "cpus": os.cpu_count(),
            "loadavg": {"start": load_start, "end": load_end},
            "lone_request_s": lone_request_s,
            "modes": {mode: {k: v for k, v in res.items() if k != "lines"} for mode, res in results.items()},
            "rounds": [
                {"mode": r.mode, "server": r.server, "concurrency": r.concurrency, "rep": r.rep,
                 "agg_decode_tps": r.agg_decode_tps,
                 "wall_tps": r.wall_tps,
                 "requests": [dict(asdict(q), t_start=q.t_start - r.t0,
                                   t_first=None if q.t_first is None else q.t_first - r.t0,
                                   t_last=None if q.t_last is None else q.t_last - r.t0,
                                   times=[round(t - r.t0, 4) for t in q.times]) for q in r.reqs]}
                for r in rounds
            ],
        }
        text = json.dumps(out, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
            print(f"JSON written to {args.json}")
    failed = any(r.error is not None for rnd in rounds for r in rnd.reqs)
    return 1 if failed else 0


if __name__ == "__main__":
    benchlib.run(main)
