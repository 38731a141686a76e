#!/usr/bin/env python3
"""Scale-out benchmark: the prompt-cache benchmark's multi-turn and agent workloads through
vllm-router in front of N replicas (``scripts/cluster.sh``), per routing policy.

For every policy (``--policies``, default consistent_hash and round_robin as the control) and every
replica count (``--replicas``, default 1,2,4) the script starts ``scripts/cluster.sh --replicas N
--port P --policy POLICY`` with the model, empties every replica's prompt cache through the
router's ``/flush_cache`` before each workload, and runs the workload with concurrent clients:

* ``multi-turn``: ``--sessions`` conversations x ``--rounds`` rounds through
  ``/v1/chat/completions``: a shared ``--system-tokens`` system prompt plus each session's own
  growing history (the reply as returned, then a new question), as in
  ``bench_prompt_cache.py --workloads multi-turn``.
* ``agent`` (the dual-API agent loop): a ``--agent-system-tokens`` system prompt plus the coding
  agent's tool schemas, each turn adding the reply and a tool result; even sessions speak OpenAI
  chat, odd ones the Anthropic ``/v1/messages`` API, interleaved, as ``bench_prompt_cache.py
  --workloads agent`` runs them one API after the other.

``--tiers`` picks the cache set-ups: ``ram`` (each replica's RAM cache alone, the default) and
``shared-disk`` (plus one ``--prompt-cache-dir`` for all replicas of a cluster, with
``--prompt-cache-write-through``, so each replica finds what the others stored while running).

Every request carries its session in ``X-Session-ID`` (the header vllm-router hashes first; its
chat route ignores the body's ``prompt_cache_key``). ``--concurrency`` client threads share the
sessions (session u belongs to thread u mod C); each thread sends its sessions' turns round by
round, so the load is steady. Decoding is greedy and the text deterministic (seeded word lists).

Reported per workload, policy and N: hit fraction (reused prompt tokens / prompt tokens, from
``cached_tokens``; and for turns after the first), the ratio to the single-replica figure, TTFT
p50/p90 (client-side, streaming), aggregate throughput (requests/s and generated tokens/s over the
workload's wall time, also per core of this machine) and how the requests spread over the replicas
(read from each replica's ``/v1/cache/stats``). All replicas share this machine's cores.

Examples::

    python scripts/bench_cluster.py --model llama:tiny --tiers ram,shared-disk
    python scripts/bench_cluster.py --model llama:small --replicas 1,2 --policies consistent_hash \\
        --workloads multi-turn --sessions 4 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shlex
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench_prompt_cache import AGENT_TOOLS, Api, Msg, TextMaker
from benchlib import ROOT, free_port, pct, ratio, resolve_model

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from mlxcel_compat.testing.cluster import ClusterProcess  # noqa: E402

WORKLOADS = ("multi-turn", "agent")
TIERS = ("ram", "shared-disk")  # shared-disk: every replica gets --prompt-cache-dir DIR (one DIR) --prompt-cache-write-through
SESSION_HEADER = "X-Session-ID"


class Texts:
    """Every prompt text of a run, made up front (TextMaker calibrates through /tokenize; the
    client threads then only read)."""

    def __init__(self, api: Api, args: argparse.Namespace) -> None:
        maker = TextMaker(args.seed, api.count_tokens, args.tokens_per_word)
        intro = "You are a careful assistant. Follow the rules and the style guide below. "
        self.system = intro + maker.text("system", max(1, args.system_tokens - (api.count_tokens(intro) or 16)))
        self.agent_system = ("You are a coding agent working in a Python repository. "
                             + maker.text("agent-system", args.agent_system_tokens))
        self.questions = {
            (kind, u, r): maker.text(f"{kind}-q{u}-{r}", args.question_tokens).rstrip(".") + "?"
            for kind in WORKLOADS for u in range(args.sessions) for r in range(args.rounds)
        }
        self.calibrated = maker.calibrated


def replica_stats(cluster: ClusterProcess) -> list[dict[str, Any]]:
    return [httpx.get(url + "/v1/cache/stats", timeout=30).json() for url in cluster.replica_urls]


def run_workload(cluster: ClusterProcess, kind: str, args: argparse.Namespace, texts: Texts, model_id: str | None) -> dict[str, Any]:
    records: list[dict[str, Any]] = []
    lock = threading.Lock()

    def client(thread_index: int) -> None:
        apis: dict[str, Api] = {}
        for flavour in ("openai", "anthropic"):
            api = Api(cluster.url, flavour, args.n_predict, args.seed, None, None, args.timeout)
            api.session_header = SESSION_HEADER
            api.model_id = model_id
            apis[flavour] = api
        mine = [u for u in range(args.sessions) if u % args.concurrency == thread_index]
        history: dict[int, list[Msg]] = {u: [] for u in mine}
        try:
            for r in range(args.rounds):
                for u in mine:
                    question = texts.questions[(kind, u, r)]
                    if kind == "multi-turn":
                        flavour, system, tools = "openai", texts.system, None
                        q = Msg("user", question)
                    else:
                        flavour, system, tools = ("openai" if u % 2 == 0 else "anthropic"), texts.agent_system, AGENT_TOOLS
                        q = Msg("user", ("Tool result: " if r else "Task: ") + question)
                    msgs = [Msg("system", system), *history[u], q]
                    out = apis[flavour].send(msgs, True, f"{kind}-{u}", tools)
                    with lock:
                        records.append({"session": u, "round": r, "flavour": flavour, "ok": out.ok, "error": out.error,
                                        "ttft_ms": out.ttft_ms, "total_ms": out.total_ms, "prompt_tokens": out.prompt_tokens,
                                        "cached_tokens": out.cached_tokens, "predicted_n": out.predicted_n})
                    history[u] += [q, Msg("assistant", out.content or "ok")]
        finally:
            for api in apis.values():
                api.close()

    flushed = httpx.post(cluster.url + "/flush_cache", timeout=60)
    if flushed.status_code != 200:
        raise RuntimeError(f"/flush_cache through the router failed: {flushed.status_code} {flushed.text[:200]}")
    before = replica_stats(cluster)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(min(args.concurrency, args.sessions))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = replica_stats(cluster)
    return summarize(records, wall, before, after)


def summarize(records: list[dict[str, Any]], wall: float, before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in records if r["ok"]]
    later = [r for r in ok if r["round"] > 0]

    def hit(rs: list[dict[str, Any]]) -> float | None:
        prompt = sum(r["prompt_tokens"] or 0 for r in rs)
        return ratio(sum(r["cached_tokens"] or 0 for r in rs), prompt)

    generated = sum(r["predicted_n"] or 0 for r in ok)
    cores = os.cpu_count() or 1
    per_replica = [a["lookups"] - b["lookups"] for a, b in zip(after, before)]
    return {
        "requests": len(records), "errors": len(records) - len(ok),
        "error_samples": sorted({r["error"] for r in records if r["error"]})[:3],
        "hit_fraction": hit(ok), "hit_fraction_later_turns": hit(later),
        "ttft_p50_ms": pct([r["ttft_ms"] for r in ok], 50), "ttft_p90_ms": pct([r["ttft_ms"] for r in ok], 90),
        "wall_s": wall, "requests_per_s": len(ok) / wall if wall else None,
        "generated_tok_per_s": generated / wall if wall else None,
        "prompt_tok_per_s": sum(r["prompt_tokens"] or 0 for r in ok) / wall if wall else None,
        "cores": cores, "requests_per_s_per_core": len(ok) / wall / cores if wall else None,
        "requests_per_replica": per_replica,
        "replica_hits": [a["hits"] - b["hits"] for a, b in zip(after, before)],
        # Hits served from a file of the shared disk tier (--prompt-cache-dir), e.g. another replica's.
        "disk_hits": sum(a["tiers"]["disk"]["hits"] - b["tiers"]["disk"]["hits"] for a, b in zip(after, before)),
        "records": records,
    }


def session_part_hit(results: list[dict[str, Any]]) -> dict[str, int]:
    """Add ``hit_fraction_session_part``: reuse beyond the prefix every session shares.

    The shared prefix (system prompt, tool schemas) is cached on every replica after its first
    request, whatever the policy; what only affinity keeps is the rest: each session's own history.
    Its length per workload is the longest reuse any first turn saw (a first turn can reuse only
    the shared prefix). Turns after the first count.
    """
    shared: dict[str, int] = {}
    for r in results:
        firsts = [x["cached_tokens"] or 0 for x in r["summary"]["records"] if x["ok"] and x["round"] == 0]
        shared[r["workload"]] = max([shared.get(r["workload"], 0), *firsts])
    for r in results:
        s = shared[r["workload"]]
        later = [x for x in r["summary"]["records"] if x["ok"] and x["round"] > 0 and (x["prompt_tokens"] or 0) > s]
        own = sum(max(0, (x["cached_tokens"] or 0) - s) for x in later)
        r["summary"]["shared_prefix_tokens"] = s
        r["summary"]["hit_fraction_session_part"] = ratio(own, sum(x["prompt_tokens"] - s for x in later))
    return shared


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def render(results: list[dict[str, Any]], args: argparse.Namespace, command: str, info: dict[str, Any]) -> str:
    cores = os.cpu_count() or 1
    L = [f"## Scale-out through vllm-router ({_dt.date.today().isoformat()})", "",
         f"Command: `{command}`", "",
         f"Model `{args.model}` (served as `{info.get('model')}`); {args.sessions} sessions x {args.rounds} rounds per workload, "
         f"{min(args.concurrency, args.sessions)} concurrent clients, {args.n_predict} tokens per reply, greedy; "
         f"multi-turn system prompt {args.system_tokens} tokens, agent system prompt {args.agent_system_tokens} tokens "
         f"+ {len(AGENT_TOOLS)} tool schemas; every request carries `{SESSION_HEADER}`. All replicas and the router "
         f"share this machine's {cores} cores. vllm-router {info.get('router_version', '?')}.", ""]
    shared = session_part_hit(results)
    # The single-replica figure: the mean of the N=1 runs (every policy routes alike with one replica).
    base: dict[tuple[str, str], dict[str, Any]] = {}
    for w in WORKLOADS:
        for t in TIERS:
            ones = [r["summary"] for r in results if r["workload"] == w and r["tier"] == t and r["replicas"] == 1]
            if ones:
                base[w, t] = {k: sum(o[k] or 0 for o in ones) / len(ones) for k in ("hit_fraction", "requests_per_s")}
    hdr = ["workload", "cache", "policy", "N", "requests", "hit frac", "vs N=1", "hit frac turns 2+", "own-history hit frac", "TTFT p50 ms",
           "TTFT p90 ms", "req/s", "req/s vs N=1", f"req/s per core ({cores})", "gen tok/s", "requests per replica", "disk hits", "errors"]
    L += ["| " + " | ".join(hdr) + " |", "|" + "|".join("---" for _ in hdr) + "|"]
    for r in sorted(results, key=lambda r: (WORKLOADS.index(r["workload"]), TIERS.index(r["tier"]), r["policy"], r["replicas"])):
        s, b = r["summary"], base.get((r["workload"], r["tier"]), {})
        L.append("| " + " | ".join([
            r["workload"], r["tier"], r["policy"], str(r["replicas"]), str(s["requests"]), fmt(s["hit_fraction"], ".1%"),
            fmt(ratio(s["hit_fraction"], b.get("hit_fraction")), ".3f"), fmt(s["hit_fraction_later_turns"], ".1%"),
            fmt(s["hit_fraction_session_part"], ".1%"), fmt(s["ttft_p50_ms"]), fmt(s["ttft_p90_ms"]), fmt(s["requests_per_s"], ".2f"),
            fmt(ratio(s["requests_per_s"], b.get("requests_per_s")), ".2f"), fmt(s["requests_per_s_per_core"], ".2f"),
            fmt(s["generated_tok_per_s"]), "/".join(str(n) for n in s["requests_per_replica"]), str(s["disk_hits"]), str(s["errors"]),
        ]) + " |")
    L.append("")
    L.append("cache: ram = each replica's RAM cache alone; shared-disk = plus one --prompt-cache-dir for all replicas, with "
             "--prompt-cache-write-through. "
             "hit frac: reused / prompt tokens over all requests; vs N=1: against the mean of the one-replica runs of the same cache set-up; "
             "own-history hit frac: turns 2+, reuse beyond the prefix all sessions share ("
             + ", ".join(f"{w}: {n} tokens" for w, n in shared.items()) + "), i.e. what only affinity can keep "
             "without a shared disk tier; disk hits: requests served from a file of the disk tier (0 without --prompt-cache-dir).")
    for r in results:
        if r["summary"]["errors"]:
            L.append(f"Errors ({r['workload']}, {r['tier']}, {r['policy']}, N={r['replicas']}): {r['summary']['error_samples']}")
    return "\n".join(L)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama:tiny", help="model directory or FAMILY[:SIZE] (default llama:tiny)")
    p.add_argument("--replicas", default="1,2,4", help="replica counts (default 1,2,4)")
    p.add_argument("--policies", default="consistent_hash,round_robin", help="vllm-router policies (default consistent_hash,round_robin)")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help=f"subset of {', '.join(WORKLOADS)} (default both)")
    p.add_argument("--tiers", default="ram", help=f"cache set-ups, subset of {', '.join(TIERS)} (default ram): ram is each "
                   "replica's RAM cache alone; shared-disk adds one disk tier for all replicas, with write-through")
    p.add_argument("--server-arg", action="append", default=[], metavar="ARGS",
                   help="extra replica arguments (repeatable; the = form: --server-arg=--ctx-size=8192)")
    # 15 sessions: a session's turns are about 15 requests apart, which round_robin over 2 or 4
    # replicas never maps back onto the same replica (16 would make the control sticky by accident).
    p.add_argument("--sessions", type=int, default=15, help="sessions per workload (default 15)")
    p.add_argument("--rounds", type=int, default=5, help="turns per session (default 5)")
    p.add_argument("--concurrency", type=int, default=4, help="client threads (default 4)")
    p.add_argument("--n-predict", type=int, default=16, help="tokens per reply (default 16)")
    p.add_argument("--system-tokens", type=int, default=256, help="multi-turn system prompt (default 256)")
    p.add_argument("--agent-system-tokens", type=int, default=512, help="agent system prompt (default 512)")
    p.add_argument("--question-tokens", type=int, default=48, help="tokens per question / tool result (default 48)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--tokens-per-word", type=float, default=1.3)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request read timeout, seconds")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", help="keep every cluster's logs under this directory (default: a temporary one)")
    p.add_argument("--json", metavar="FILE", help="write every request's record to FILE")
    args = p.parse_args(argv)
    args.replica_list = [int(x) for x in args.replicas.split(",") if x.strip()]
    args.policy_list = [x.strip() for x in args.policies.split(",") if x.strip()]
    args.workload_list = [x.strip() for x in args.workloads.split(",") if x.strip()]
    if any(w not in WORKLOADS for w in args.workload_list):
        p.error(f"--workloads: choose from {', '.join(WORKLOADS)}")
    args.tier_list = [x.strip() for x in args.tiers.split(",") if x.strip()]
    if not args.tier_list or any(t not in TIERS for t in args.tier_list):
        p.error(f"--tiers: choose from {', '.join(TIERS)}")
    if not args.replica_list or min(args.replica_list) < 1 or args.concurrency < 1 or args.sessions < 1:
        p.error("--replicas, --concurrency and --sessions must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = shlex.join(["python", "scripts/bench_cluster.py", *(sys.argv[1:] if argv is None else argv)])
    model_dir = resolve_model(args.model, "tiny")
    server_args = [x for a in args.server_arg for x in shlex.split(a)]
    log_root = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="bench_cluster_"))
    results: list[dict[str, Any]] = []
    info: dict[str, Any] = {"model": args.model}
    try:
        from importlib.metadata import version

        info["router_version"] = version("vllm-router")
    except Exception:
        pass
    texts: Texts | None = None
    for tier, policy, n in [(t, p, n) for t in args.tier_list for p in args.policy_list for n in args.replica_list]:
        log_dir = log_root / f"{tier}-{policy}-{n}"
        print(f"== {tier}, {policy}, {n} replica(s): starting (logs {log_dir})", file=sys.stderr, flush=True)
        tier_args = ["--prompt-cache-dir", str(log_dir / "disk"), "--prompt-cache-write-through"] if tier == "shared-disk" else []
        cluster = ClusterProcess(n, free_port(), log_dir, ["-m", model_dir, *server_args, *tier_args], policy=policy,
                                 timeout=args.startup_timeout)
        try:
            probe = Api(cluster.url, "openai", args.n_predict, args.seed, None, None, args.timeout)
            info.update(probe.probe())
            if texts is None:
                texts = Texts(probe, args)
            for url in cluster.replica_urls:  # each replica's first request pays MLX's set-up
                httpx.post(url + "/completion", json={"prompt": "warm up", "n_predict": 2, "cache_prompt": False}, timeout=120)
            probe.close()
            for kind in args.workload_list:
                summary = run_workload(cluster, kind, args, texts, info.get("model"))
                results.append({"workload": kind, "tier": tier, "policy": policy, "replicas": n, "summary": summary})
                print(f"   {kind}: hit {fmt(summary['hit_fraction'], '.1%')}, TTFT p50 {fmt(summary['ttft_p50_ms'])} ms, "
                      f"{fmt(summary['requests_per_s'], '.2f')} req/s, per replica {summary['requests_per_replica']}, "
                      f"errors {summary['errors']}", file=sys.stderr, flush=True)
        finally:
            cluster.stop()
    print(render(results, args, command, info))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"command": command, "info": info, "config": {k: v for k, v in vars(args).items()},
                       "results": results}, f, indent=2)
        print(f"raw results: {args.json}", file=sys.stderr)
    if texts is not None and not texts.calibrated:
        print("warning: no /tokenize through the router; text lengths are estimates", file=sys.stderr)
    return 1 if any(r["summary"]["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
