#!/usr/bin/env python
"""Session-snapshot benchmark: multi-turn chat on the hybrid and sliding-window families.

Models whose state cannot be cut to a prefix (``qwen3_next`` and ``qwen3_5``: recurrent
hybrids, ``gemma3_text``: sliding window) reuse a session's previous turn only through session snapshots (see
docs/prompt-cache.md and the spec, "Session snapshots"). This script measures what each mechanism
contributes, in one run, with four servers per family started side by side (free ports, generated
models from ``mlxcel_compat.testing.models``, never a download):

* ``on``        everything on (boundary snapshots + background warm-up + completion snapshots);
* ``boundary``  ``MLXCEL_DISABLE_CACHE_WARMUP=1`` (boundary + completion snapshots);
* ``off``       ``MLXCEL_DISABLE_CACHE_WARMUP=1 MLXCEL_DISABLE_BOUNDARY_SNAPSHOT=1`` (the two
                snapshot mechanisms off; the completion snapshot taken at the end of each request
                has no kill switch and stays);
* ``cold``      ``--no-cache-prompt``: no reuse at all, the baseline.

Workload: S sessions x T turns, round-robin (turn 1 of every session, then turn 2, ...). Every
conversation starts with the same ~``--system-tokens`` system prompt; each session asks its own
questions (deterministic text from a fixed word list and a seeded RNG). Requests are streaming
``POST /v1/chat/completions`` with ``prompt_cache_key`` = the session, ``temperature`` 0,
``max_tokens`` N and ``stream_options.include_usage``. Each server keeps its own conversation
(the assistant reply it returned goes into its next turn's history), so the user messages are
the same for every configuration.

Machine noise is shared: for every (turn, session) step the same user message goes to each
configuration's server, one after the other, in an order that rotates by step. After every reply
the client "thinks" ``--think-ms`` before the next request (to any server); that idle time is when
the background warm-up runs.

Per request: TTFT (request start to the first streamed chunk with generated text, or to the
final chunk if the reply is empty), server-side ``timings.prompt_ms``, ``prompt_tokens``,
``cached_tokens`` and prefilled = prompt_tokens - cached_tokens (checked against
``timings.prompt_n``), and ``new`` = the tokens the turn adds after the conversation rendered as
closed history (``/apply-template`` with ``add_generation_prompt=false`` + ``/tokenize``, not
timed): the least any reuse can leave to prefill (the warm-up's goal from turn 2 on).

Report, per family: per turn index, TTFT p50/p90 across sessions, prefill ms p50, prefilled mean,
new-tokens mean, cached fraction; per configuration totals with ratios against ``cold`` and
``off``; and the snapshot counters of ``GET /v1/cache/stats`` (the difference over the run, after
one untimed start-up request per server; entries and bytes as held at the end).

Usage::

    /work/venv/bin/python scripts/bench_snapshots.py              # 10 sessions x 6 turns, small models
    /work/venv/bin/python scripts/bench_snapshots.py --size tiny --sessions 2 --turns 3 \\
        --json /tmp/snapshots.json
    /work/venv/bin/python scripts/bench_snapshots.py --families qwen3_next --configs on,off,cold
    /work/venv/bin/python scripts/bench_snapshots.py --families qwen3_5 --configs on,cold \
        --model /tmp/q/qwen35-0.8b-8l-shaped-v4-q4_k_m.gguf     # a file instead of the factory's model

``--model`` serves one file or directory (a GGUF such as ``bench_quantized.py``'s Qwen3.5-shaped
Q4_K_M) in place of the factory's model; the one ``--families`` entry is then its label.

``--server-arg`` values starting with ``-`` need the ``=`` form (``--server-arg=--parallel=2``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

import benchlib
from benchlib import ServerProcess, mean, pct, ratio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FAMILIES = ("qwen3_next", "qwen3_5", "gemma3_text")

# name -> (environment additions, extra server arguments, description)
CONFIGS: dict[str, tuple[dict[str, str], list[str], str]] = {
    "on": ({}, [], "boundary snapshots + warm-up + completion snapshots"),
    "boundary": ({"MLXCEL_DISABLE_CACHE_WARMUP": "1"}, [], "MLXCEL_DISABLE_CACHE_WARMUP=1"),
    "off": (
        {"MLXCEL_DISABLE_CACHE_WARMUP": "1", "MLXCEL_DISABLE_BOUNDARY_SNAPSHOT": "1"},
        [],
        "both kill switches (completion snapshots remain)",
    ),
    "cold": ({}, ["--no-cache-prompt"], "--no-cache-prompt (no reuse)"),
}
# Variables that would change what a configuration means if inherited from the caller.
CONTROLLED_ENV = ("MLXCEL_DISABLE_CACHE_WARMUP", "MLXCEL_DISABLE_BOUNDARY_SNAPSHOT", "MLXCEL_PROMPT_CACHE_ENABLED",
                  "LLAMA_ARG_CACHE_PROMPT", "LLAMA_ARG_NO_CACHE_PROMPT", "LLAMA_ARG_CACHE_REUSE")

VOCAB = tuple(
    """
    harbor lantern meadow orchard quarry ribbon saddle timber valley willow anchor basket candle
    ferry garden hammer island jacket kettle ladder marble needle oyster pepper quilt rocket
    silver tunnel umbrella violet wagon yellow zebra archive ballot cabinet diagram engine fabric
    gallery horizon insect journal kitchen library machine network object planet question record
    signal theatre uniform vessel window account balance channel deposit estimate forecast gather
    handle invoice journey keeper ledger measure notice option parcel quarter remark schedule
    target update vendor warrant yield bright calm distant early faint gentle heavy honest narrow
    patient quiet rapid steady tender vivid warm careful simple formal local modern plain public
    rural single spare strict usual whole arrange borrow collect deliver explain follow improve
    inspect listen mention observe prepare receive repair report return select travel verify
    visit the a of and to in on for with from by about under over after before during between
    each every some many several other which that this those these its their our your
    """.split()
)
OPENERS = ("How", "Why", "When", "Where", "Which", "Could you explain how", "What happens if", "Is it true that")


# ---------------------------------------------------------------------------------------------
# Deterministic text


def word_run(rng: random.Random, n: int) -> str:
    """``n`` words in sentences of 6-14 words."""
    words: list[str] = []
    left = rng.randint(6, 14)
    cap = True
    for _ in range(n):
        w = rng.choice(VOCAB)
        if cap:
            w, cap = w.capitalize(), False
        left -= 1
        if left == 0:
            w, cap, left = w + ".", True, rng.randint(6, 14)
        words.append(w)
    text = " ".join(words)
    return text if text.endswith(".") else text + "."


def system_prompt(seed: int, target_tokens: int, count: Any) -> str:
    """A system prompt of about ``target_tokens`` tokens (calibrated with the server's /tokenize)."""
    head = "You are the assistant of a regional logistics office. Answer briefly and precisely. Reference notes follow. "

    def make(n_words: int) -> str:
        return head + word_run(random.Random(f"{seed}:system"), n_words)

    lo, hi = 1, max(8, target_tokens * 2)
    while count(make(hi)) < target_tokens and hi < 100_000:
        hi *= 2
    while lo < hi:  # smallest word count reaching the target
        mid = (lo + hi) // 2
        if count(make(mid)) >= target_tokens:
            hi = mid
        else:
            lo = mid + 1
    return make(lo)


def question(seed: int, session: int, turn: int) -> str:
    rng = random.Random(f"{seed}:q:{session}:{turn}")
    body = word_run(rng, rng.randint(14, 30)).rstrip(".").lower()
    return f"{rng.choice(OPENERS)} {body}? (case {session + 1}-{turn + 1})"


# ---------------------------------------------------------------------------------------------
# Servers


def make_server(family: str, config: str, model_dir: str, args: argparse.Namespace) -> ServerProcess:
    """The server of one configuration (not started); controlled variables are not inherited."""
    env_add, extra, _ = CONFIGS[config]
    cmd_extra = ["-b", str(args.chunk), "-ub", str(args.chunk), "-c", str(args.ctx)]
    if args.parallel is not None:
        cmd_extra += ["-np", str(args.parallel)]
    for item in args.server_arg:
        cmd_extra += shlex.split(item)
    cmd_extra += extra
    env: dict[str, str | None] = {k: None for k in CONTROLLED_ENV}
    env.update(env_add)
    pythonpath = os.environ.get("PYTHONPATH")
    env["PYTHONPATH"] = ROOT + (os.pathsep + pythonpath if pythonpath else "")
    log_path = None
    if args.server_log_dir:
        os.makedirs(args.server_log_dir, exist_ok=True)
        log_path = os.path.join(args.server_log_dir, f"{family}-{config}.log")
    return ServerProcess.mlxcel(model_dir, cmd_extra, python=args.python, name=f"{family}/{config}", env=env,
                                cwd=ROOT, log_path=log_path, keep_log=log_path is not None)


def describe(config: str, server: ServerProcess) -> str:
    """The server's command line, preceded by the configuration's environment additions."""
    env = " ".join(f"{k}={v}" for k, v in CONFIGS[config][0].items())
    return (env + " " if env else "") + shlex.join(server.cmd)


# ---------------------------------------------------------------------------------------------
# Requests


@dataclass
class Turn:
    family: str
    config: str
    session: int
    turn: int  # 1-based
    step: int  # global (turn, session) step
    position: int  # 0-based position of this configuration in the step's rotating order
    ok: bool = False
    error: str | None = None
    ttft_ms: float | None = None
    ttft_source: str = ""  # "content" | "final"
    total_ms: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    prefilled: int | None = None
    prompt_n: int | None = None  # timings.prompt_n (should equal prefilled)
    prompt_ms: float | None = None
    completion_tokens: int | None = None
    history_tokens: int | None = None  # conversation so far rendered as closed history
    new_tokens: int | None = None  # prompt_tokens - history_tokens
    reply: str = ""
    reasoning: str = ""
    finish_reason: str | None = None


def count_tokens(http: httpx.Client, base: str, text: str) -> int:
    r = http.post(base + "/tokenize", json={"content": text, "add_special": False})
    r.raise_for_status()
    return len(r.json()["tokens"])


def history_tokens(http: httpx.Client, base: str, messages: list[dict[str, Any]]) -> int | None:
    try:
        r = http.post(base + "/apply-template", json={"messages": messages, "add_generation_prompt": False})
        r.raise_for_status()
        r2 = http.post(base + "/tokenize", json={"content": r.json()["prompt"], "add_special": True})
        r2.raise_for_status()
        return len(r2.json()["tokens"])
    except (httpx.HTTPError, KeyError, ValueError):
        return None


def chat_stream(http: httpx.Client, base: str, body: dict[str, Any], rec: Turn) -> None:
    """One streaming chat request; fills ``rec`` (timing, usage, reply)."""
    content: list[str] = []
    reasoning: list[str] = []
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    t0 = time.perf_counter()
    try:
        with http.stream("POST", base + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                rec.error = f"HTTP {r.status_code}: {r.text[:300]}"
                return
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    rec.error = json.dumps(chunk["error"])[:300]
                    return
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    text = delta.get("content") or ""
                    think = delta.get("reasoning_content") or ""
                    if (text or think) and rec.ttft_ms is None:
                        rec.ttft_ms = (time.perf_counter() - t0) * 1000
                        rec.ttft_source = "content"
                    content.append(text)
                    reasoning.append(think)
                    if choice.get("finish_reason"):
                        rec.finish_reason = choice["finish_reason"]
                        if rec.ttft_ms is None:
                            rec.ttft_ms = (time.perf_counter() - t0) * 1000
                            rec.ttft_source = "final"
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("timings"):
                    timings = chunk["timings"]
    except (httpx.HTTPError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"
        return
    rec.total_ms = (time.perf_counter() - t0) * 1000
    rec.reply, rec.reasoning = "".join(content), "".join(reasoning)
    if usage is None:
        rec.error = "no usage chunk"
        return
    rec.prompt_tokens = usage.get("prompt_tokens")
    rec.completion_tokens = usage.get("completion_tokens")
    rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    if rec.prompt_tokens is not None and rec.cached_tokens is not None:
        rec.prefilled = rec.prompt_tokens - rec.cached_tokens
    if timings:
        rec.prompt_n = timings.get("prompt_n")
        rec.prompt_ms = timings.get("prompt_ms")
    rec.ok = True


def get_stats(http: httpx.Client, base: str) -> dict[str, Any]:
    r = http.get(base + "/v1/cache/stats")
    r.raise_for_status()
    return r.json()


GAUGES = {"snapshot_entries", "snapshot_bytes", "snapshot_capacity_bytes", "snapshot_max_entries",
          "snapshot_ttl_seconds", "snapshot_hit_rate", "snapshot_last_reject", "snapshot_enabled",
          "entries", "bytes", "capacity_bytes", "max_entries", "ttl_seconds", "enabled", "hit_rate"}


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Counters as the difference over the run; gauges and non-numbers as at the end."""
    out: dict[str, Any] = {}
    for k, v in after.items():
        b = before.get(k)
        if k in GAUGES or isinstance(v, bool):
            out[k] = v
        elif isinstance(v, (int, float)) and isinstance(b, (int, float)):
            out[k] = v - b
        elif isinstance(v, dict) and isinstance(b, dict) and all(isinstance(x, (int, float)) for x in v.values()):
            out[k] = {kk: vv - b.get(kk, 0) for kk, vv in v.items()}
        else:
            out[k] = v
    return out


# ---------------------------------------------------------------------------------------------
# Statistics and formatting


def f0(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def f1(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def fpct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def fratio(a: float | None, b: float | None) -> str:
    r = ratio(a, b)
    return "-" if r is None else f"{r:.2f}x"


def table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def summarize(recs: list[Turn]) -> dict[str, Any]:
    ok = [r for r in recs if r.ok]
    later = [r for r in ok if r.turn > 1]
    prompt = sum(r.prompt_tokens or 0 for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    return {
        "requests": len(recs),
        "errors": len(recs) - len(ok),
        "ttft_p50": pct([r.ttft_ms for r in ok], 50),
        "ttft_p90": pct([r.ttft_ms for r in ok], 90),
        "ttft_mean": mean([r.ttft_ms for r in ok]),
        "ttft_p50_later": pct([r.ttft_ms for r in later], 50),
        "ttft_p90_later": pct([r.ttft_ms for r in later], 90),
        "ttft_mean_later": mean([r.ttft_ms for r in later]),
        "prompt_ms_total": sum(r.prompt_ms or 0 for r in ok),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefilled": sum(r.prefilled or 0 for r in ok),
        "prefilled_later": sum(r.prefilled or 0 for r in later),
        "new_later": sum(r.new_tokens or 0 for r in later),
        # Later turns that prefilled no more than the new user message (+1 token of slack): the
        # previous reply was already covered (the warm-up's goal).
        "at_floor_later": sum(1 for r in later if r.new_tokens is not None and (r.prefilled or 0) <= r.new_tokens + 1),
        "later": len(later),
        "cached_fraction": cached / prompt if prompt else None,
        "prompt_n_mismatches": sum(1 for r in ok if r.prompt_n is not None and r.prompt_n != r.prefilled),
        "empty_replies": sum(1 for r in ok if r.ttft_source == "final"),
    }


def per_turn(recs: list[Turn], turn: int) -> dict[str, Any]:
    rs = [r for r in recs if r.ok and r.turn == turn]
    prompt = sum(r.prompt_tokens or 0 for r in rs)
    return {
        "n": len(rs),
        "ttft_p50": pct([r.ttft_ms for r in rs], 50),
        "ttft_p90": pct([r.ttft_ms for r in rs], 90),
        "prompt_ms_p50": pct([r.prompt_ms for r in rs], 50),
        "prompt_mean": mean([r.prompt_tokens for r in rs]),
        "prefilled_mean": mean([r.prefilled for r in rs]),
        "new_mean": mean([r.new_tokens for r in rs]),
        "cached_fraction": sum(r.cached_tokens or 0 for r in rs) / prompt if prompt else None,
    }


def report_family(family: str, model_dir: str, configs: list[str], recs: list[Turn], turns: int,
                  stats: dict[str, dict[str, Any]], servers: dict[str, str]) -> tuple[str, dict[str, Any]]:
    by_cfg = {c: [r for r in recs if r.config == c] for c in configs}
    lines = [f"## {family}", "", f"Model: `{model_dir}`", ""]
    lines += ["Servers:", ""] + [f"- `{c}`: `{servers[c]}`" for c in configs] + [""]

    rows = []
    turn_data: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for t in range(1, turns + 1):
        for c in configs:
            d = per_turn(by_cfg[c], t)
            turn_data[c].append(d)
            rows.append([str(t), c, f0(d["ttft_p50"]), f0(d["ttft_p90"]), f0(d["prompt_ms_p50"]), f0(d["prompt_mean"]),
                         f1(d["prefilled_mean"]), f1(d["new_mean"]), fpct(d["cached_fraction"])])
    lines += ["### Per turn (across sessions)", "",
              table(["turn", "config", "TTFT p50 ms", "TTFT p90 ms", "prefill ms p50", "prompt tok", "prefilled mean",
                     "new tok mean", "cached"], rows), ""]

    summ = {c: summarize(by_cfg[c]) for c in configs}
    rows = []
    for c in configs:
        s = summ[c]
        row = [c, f0(s["ttft_p50"]), f0(s["ttft_p50_later"]), f0(s["ttft_p90_later"]), f0(s["ttft_mean_later"]),
               str(s["prefilled"]), str(s["prefilled_later"]), str(s["new_later"]), f"{s['at_floor_later']}/{s['later']}",
               fpct(s["cached_fraction"]),
               f0(s["prompt_ms_total"])]
        for base in ("cold", "off"):
            b = summ.get(base)
            if b is None:
                row += ["-", "-"]
            else:
                row += [fratio(s["prefilled_later"], b["prefilled_later"]), fratio(s["ttft_p50_later"], b["ttft_p50_later"])]
        rows.append(row)
    lines += ["### Totals (turns 2.. = turns that can reuse their session)", "",
              table(["config", "TTFT p50 all", "TTFT p50 2..", "TTFT p90 2..", "TTFT mean 2..", "prefilled all",
                     "prefilled 2..", "new tok 2..", "at floor 2..", "cached", "prefill ms sum", "prefilled 2.. vs cold",
                     "TTFT p50 2.. vs cold", "prefilled 2.. vs off", "TTFT p50 2.. vs off"], rows), ""]

    rows = []
    for c in configs:
        s = stats.get(c) or {}

        def kv(d: Any) -> str:
            if not isinstance(d, dict):
                return "-"
            items = [f"{k}={v}" for k, v in sorted(d.items()) if v]
            return ", ".join(items) if items else "0"

        rows.append([c, str(s.get("snapshot_warmups_run", "-")), str(s.get("snapshot_warmups_skipped", "-")),
                     str(s.get("snapshot_lookups", "-")), str(s.get("snapshot_hits", "-")),
                     kv(s.get("snapshot_hits_by_origin")), kv(s.get("snapshot_inserts_by_origin")),
                     str(s.get("snapshot_supersedes", "-")), kv(s.get("snapshot_rejections")),
                     str(s.get("snapshot_entries", "-")), f"{(s.get('snapshot_bytes') or 0) / 2**20:.1f}",
                     str((s.get("snapshot_evictions_lru") or 0) + (s.get("snapshot_evictions_ttl") or 0))])
    lines += ["### Snapshot stats (`GET /v1/cache/stats`, counters over the run)", "",
              table(["config", "warm-ups run", "skipped", "lookups", "hits", "hits by origin", "inserts by origin",
                     "supersedes", "rejections", "entries", "MiB held", "evictions"], rows), ""]

    notes = []
    for c in configs:
        s = summ[c]
        if s["errors"]:
            errs = sorted({r.error for r in by_cfg[c] if not r.ok and r.error})
            notes.append(f"- `{c}`: {s['errors']} failed request(s): {'; '.join(errs)[:400]}")
        if s["prompt_n_mismatches"]:
            notes.append(f"- `{c}`: timings.prompt_n != prompt_tokens - cached_tokens in "
                         f"{s['prompt_n_mismatches']} request(s)")
        if s["empty_replies"]:
            notes.append(f"- `{c}`: {s['empty_replies']} empty repl(ies) (TTFT taken at the final chunk)")
    # Greedy decoding: every configuration should give the same reply, as long as its history is the same.
    if "cold" in by_cfg:
        ref = {(r.session, r.turn): r.reply for r in by_cfg["cold"] if r.ok}
        for c in configs:
            if c == "cold":
                continue
            diff = sorted((r.session, r.turn) for r in by_cfg[c] if r.ok and (r.session, r.turn) in ref
                          and r.reply != ref[(r.session, r.turn)])
            if diff:
                first = diff[0]
                notes.append(f"- `{c}`: {len(diff)} repl(ies) differ from `cold` (first: session {first[0] + 1}, "
                             f"turn {first[1]}); later turns of those sessions have different histories")
    for c in configs:
        last = (stats.get(c) or {}).get("snapshot_last_reject")
        if last and last.get("reason") != "no_candidate":
            notes.append(f"- `{c}`: last snapshot rejection: `{json.dumps(last)}`")
    if notes:
        lines += ["Notes:", ""] + notes + [""]
    return "\n".join(lines), {"per_turn": turn_data, "summary": summ}


# ---------------------------------------------------------------------------------------------
# Run


def run_family(family: str, args: argparse.Namespace, out_json: dict[str, Any]) -> str:
    model_dir = args.model or str(benchlib.ensure_model(family, args.size))
    servers = {c: make_server(family, c, model_dir, args) for c in args.configs}
    http = httpx.Client(timeout=httpx.Timeout(args.timeout, connect=10.0))
    recs: list[Turn] = []
    stats: dict[str, dict[str, Any]] = {}
    raw_stats: dict[str, dict[str, Any]] = {}
    try:
        for s in servers.values():
            s.start()
        for s in servers.values():
            s.wait_healthy(args.startup_timeout)
        first = next(iter(servers.values()))
        system = system_prompt(args.seed, args.system_tokens, lambda text: count_tokens(http, first.base_url, text))
        system_n = count_tokens(http, first.base_url, system)
        # One untimed request per server (its own text, cache off for it) so that first-use costs
        # do not land on turn 1; counters are measured from here.
        baseline: dict[str, dict[str, Any]] = {}
        for c, s in servers.items():
            body = {"messages": [{"role": "user", "content": "Start-up check, " + word_run(random.Random(c), 40)}],
                    "max_tokens": args.max_tokens, "temperature": 0, "stream": True, "cache_prompt": False,
                    "stream_options": {"include_usage": True}, "prompt_cache_key": f"bench-startup-{c}"}
            chat_stream(http, s.base_url, body, Turn(family, c, -1, 0, -1, 0))
            http.post(s.base_url + "/v1/cache/reset")
            baseline[c] = get_stats(http, s.base_url)
        print(f"[{family}] servers up ({', '.join(f'{c}:{s.port}' for c, s in servers.items())}); "
              f"system prompt {system_n} tokens", file=sys.stderr)

        convs = {c: [[{"role": "system", "content": system}] for _ in range(args.sessions)] for c in args.configs}
        step = 0
        think = args.think_ms / 1000
        t_start = time.monotonic()
        for t in range(args.turns):
            for sess in range(args.sessions):
                q = question(args.seed, sess, t)
                k = step % len(args.configs)
                order = args.configs[k:] + args.configs[:k]
                for pos, c in enumerate(order):
                    s = servers[c]
                    msgs = convs[c][sess]
                    rec = Turn(family, c, sess, t + 1, step, pos)
                    rec.history_tokens = history_tokens(http, s.base_url, msgs)
                    msgs.append({"role": "user", "content": q})
                    body = {"messages": msgs, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}, "prompt_cache_key": f"bench-session-{sess}"}
                    chat_stream(http, s.base_url, body, rec)
                    if rec.prompt_tokens is not None and rec.history_tokens is not None:
                        rec.new_tokens = rec.prompt_tokens - rec.history_tokens
                    reply: dict[str, Any] = {"role": "assistant", "content": rec.reply}
                    if rec.reasoning:
                        reply["reasoning_content"] = rec.reasoning
                    msgs.append(reply)
                    recs.append(rec)
                    if args.verbose:
                        print(f"  [{family}/{c}] s{sess + 1} t{t + 1}: ttft {f0(rec.ttft_ms)} ms, prompt "
                              f"{rec.prompt_tokens}, cached {rec.cached_tokens}, new {rec.new_tokens}"
                              + (f", ERROR {rec.error}" if rec.error else ""), file=sys.stderr)
                    if think > 0:
                        time.sleep(think)
                step += 1
            done = [r for r in recs if r.turn == t + 1]
            print(f"[{family}] turn {t + 1}/{args.turns} done ({len(done)} requests, "
                  f"{time.monotonic() - t_start:.0f}s)", file=sys.stderr)
        time.sleep(max(think, 0.5))  # let the last warm-ups finish before reading the counters
        for c, s in servers.items():
            raw_stats[c] = get_stats(http, s.base_url)
            stats[c] = stats_delta(baseline[c], raw_stats[c])
    finally:
        http.close()
        for c, s in servers.items():
            if (kept := s.stop()) is not None:
                print(f"server log ({family}/{c}): {kept}", file=sys.stderr)

    text, data = report_family(family, model_dir, args.configs, recs, args.turns, stats,
                               {c: describe(c, s) for c, s in servers.items()})
    out_json[family] = {
        "model_dir": model_dir,
        "system_tokens": system_n,
        "servers": {c: {"cmd": s.cmd, "env": CONFIGS[c][0]} for c, s in servers.items()},
        "requests": [asdict(r) for r in recs],
        "stats_delta": stats,
        "stats_final": raw_stats,
        **data,
    }
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(FAMILIES), help="comma list (default: %(default)s)")
    p.add_argument("--size", default="small", choices=("tiny", "small"))
    p.add_argument("--model", default=None, metavar="PATH",
                   help="serve this GGUF file or model directory instead of the factory's (one --families entry: "
                        "its label)")
    p.add_argument("--sessions", type=int, default=10)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--think-ms", type=float, default=200.0, help="client pause after every reply (default: %(default)s)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="subset of " + ",".join(CONFIGS))
    p.add_argument("--chunk", type=int, default=256, help="server -b (default: %(default)s)")
    p.add_argument("--ctx", type=int, default=8192, help="server -c (default: %(default)s)")
    p.add_argument("--parallel", type=int, default=None, help="server -np (default: the server's own)")
    p.add_argument("--system-tokens", type=int, default=300)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--server-arg", action="append", default=[], help="extra server arguments (shell words), repeatable")
    p.add_argument("--server-log-dir", default=None, help="keep server logs here (default: temporary, removed)")
    p.add_argument("--python", default=sys.executable, help="interpreter for the servers")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout, seconds")
    p.add_argument("--json", default=None, metavar="PATH", help="write raw data (every request, stats) here")
    p.add_argument("-v", "--verbose", action="store_true", help="one line per request on stderr")
    args = p.parse_args(argv)
    args.families = [f.strip() for f in args.families.split(",") if f.strip()]
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in args.configs if c not in CONFIGS]
    if bad or not args.configs:
        p.error(f"--configs: unknown {bad}; choose from {','.join(CONFIGS)}")
    if len(set(args.configs)) != len(args.configs):
        p.error("--configs: duplicates")
    if args.model and len(args.families) != 1:
        p.error("--model: give exactly one --families entry (the model's label)")
    if args.sessions < 1 or args.turns < 1 or args.max_tokens < 1:
        p.error("--sessions, --turns and --max-tokens must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(["bench_snapshots.py", *argv])
    out_json: dict[str, Any] = {}
    sections = []
    for family in args.families:
        sections.append(run_family(family, args, out_json))
    header = [
        "# Session-snapshot benchmark",
        "",
        f"Command: `{command}`",
        "",
        f"{args.sessions} sessions x {args.turns} turns, round-robin; ~{args.system_tokens}-token shared system prompt; "
        f"max_tokens {args.max_tokens}, temperature 0, streaming; think time {args.think_ms:g} ms after every reply; "
        f"server -b {args.chunk} -c {args.ctx}; size {args.size}; {platform.platform()}, {os.cpu_count()} CPUs.",
        "",
        "Configurations: " + "; ".join(f"`{c}` = {CONFIGS[c][2]}" for c in args.configs) + ".",
        "",
        "TTFT: client-side, request start to the first streamed generated text. prefilled = prompt_tokens - "
        "cached_tokens. new tok = tokens after the conversation rendered as closed history (the floor for "
        "turns 2..); at floor = turns 2.. that prefilled at most new tok + 1. cached = cached_tokens / "
        "prompt_tokens. Ratios: this configuration / the baseline.",
        "",
    ]
    print("\n".join(header + sections))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": command, "args": vars(args), "families": out_json}, f, indent=1)
        print(f"raw data: {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    benchlib.run(main)
