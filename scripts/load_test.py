#!/usr/bin/env python
"""Load test: a storm of streams with disconnects, then steady load; nothing may be lost or leak.

One server (``python -m mlxcel_compat``) is started here on the generated model, with a small
prompt-cache budget so that eviction runs all the time. Then:

1. warm-up: the same storm once (other prompts), a cache reset, then the RSS baseline;
2. storm: ``--streams`` (200) streams at once, native ``/completion`` and OpenAI
   ``/v1/chat/completions`` mixed; ``--disconnect`` (30 %) of them hang up after a random number
   of chunks; half the prompts start with one of a few shared system prompts (prompt-cache hits;
   each spans more than two KV blocks, so the hits share blocks and hold leases on them), half
   are unique (misses);
3. steady load: ``--clients`` closed-loop clients send the same mix back to back for
   ``--steady-seconds`` (the issue asks for 10 minutes: ``--steady-seconds 600``);
4. ``POST /v1/cache/reset``, then the RSS and the block pool again.

A separate process samples, every ``--sample-every`` seconds: ``/health`` latency, the prompt
cache's bytes against its capacity and who holds the KV blocks (``/v1/cache/stats``), and the
server's RSS. Reported, with issue 54's goals ("No block leaks"):

* lost completions: streams not hung up on purpose that did not end with their final event
  (``stop: true`` / ``[DONE]``), or ended with an error (goal 0);
* slots: all idle within a few seconds after each phase (goal: yes);
* prompt-cache bytes <= capacity at every sample, and LRU evictions all along (goal: yes);
* no stray block reference at any sample (``kv_block_stray_refs``: a reference on a shared KV
  block held by no stored entry and no running sequence) (goal: yes);
* after the reset, the pool holds no block and no lease (goal: yes);
* RSS after the reset within 10 % of the post-warm-up baseline (goal: yes);
* ``/health`` p50/p99/max during the run, and prompt-cache hits.

``tests/e2e/test_load.py`` runs the same phases for a few seconds in the default suite.

Usage::

    .venv/bin/python scripts/load_test.py                                  # 60 s of steady load
    .venv/bin/python scripts/load_test.py --steady-seconds 600 --json /tmp/load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

import benchlib

HEADS = [
    "You are a helpful assistant for a bicycle shop. Customers ask about repairs, parts and opening hours. "
    "Answer briefly and politely, and say so when you do not know. ",
    "System: you summarise support tickets for an internet provider. Each ticket has a customer, a product, "
    "a problem description and a priority. Write one sentence per ticket. ",
    "The following is a transcript of a cooking class. The teacher explains each step of a recipe for bread, "
    "from mixing the dough to baking, and answers questions from the students. ",
    "Context: a library catalogue search tool. Users type titles, authors or subjects; the tool returns "
    "matching books with their shelf location and availability. ",
]
WORDS = "apple river stone cloud garden lamp window silver road music table winter paper bridge candle forest".split()
RULE_WORDS = 240  # a system prompt's rules: ~640 tokens with its head (the tiny llama's tokenizer), 2 KV blocks and a part


def system_prompts() -> list[str]:
    """The shared system prompts: each head, then numbered rules, long enough to span two whole
    KV blocks (256 positions each): sessions that adopt one lease its blocks and share them."""
    out = []
    for i, head in enumerate(HEADS):
        rng = random.Random(i)
        words = [rng.choice(WORDS) for _ in range(RULE_WORDS)]
        rules = " ".join(f"Rule {n + 1}: {' '.join(words[n * 8:(n + 1) * 8])}." for n in range(RULE_WORDS // 8))
        out.append(head + rules + " ")
    return out


SYSTEM_PROMPTS = system_prompts()


@dataclass
class Outcome:
    kind: str
    hung_up: bool = False
    finished: bool = False
    error: str | None = None
    chunks: int = 0
    cached: int = 0


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)

    def lost(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.hung_up and (not o.finished or o.error)]

    def summary(self) -> dict[str, Any]:
        return {
            "requests": len(self.outcomes),
            "hung_up": sum(o.hung_up for o in self.outcomes),
            "completed": sum(o.finished and not o.error for o in self.outcomes),
            "lost": len(self.lost()),
            "errors": sorted({o.error for o in self.outcomes if o.error}),
            "hits": sum(o.cached > 0 for o in self.outcomes),
        }


def make_prompt(rng: random.Random, shared: bool) -> tuple[str, str]:
    """(system prompt, user text): a shared system prompt, or a unique short one (a miss)."""
    tail = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
    return (rng.choice(SYSTEM_PROMPTS) if shared else f"[{rng.random():.12f}] "), tail


async def sse_lines(response: httpx.Response):
    """Lines split on LF only, as SSE defines them (httpx's aiter_lines also splits on U+2028,
    U+0085 and the like, which generated text may hold inside a JSON string)."""
    buffer = ""
    async for text in response.aiter_text():
        buffer += text
        *lines, buffer = buffer.split("\n")
        for line in lines:
            yield line.rstrip("\r")
    if buffer:
        yield buffer


async def one_stream(client: httpx.AsyncClient, rng: random.Random, disconnect: float, n_predict: int) -> Outcome:
    chat = rng.random() < 0.5
    system, user = make_prompt(rng, shared=rng.random() < 0.5)
    hang_up_after = rng.randint(1, n_predict) if rng.random() < disconnect else None
    outcome = Outcome(kind="chat" if chat else "native")
    if chat:
        path = "/v1/chat/completions"
        messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        body: dict[str, Any] = {"messages": messages, "max_tokens": n_predict, "stream": True,
                                "stream_options": {"include_usage": True}}
    else:
        path = "/completion"
        body = {"prompt": system + user, "n_predict": n_predict, "stream": True}
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                outcome.error = f"HTTP {response.status_code}"
                return outcome
            async for line in sse_lines(response):
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                outcome.chunks += 1
                if data == "[DONE]":
                    outcome.finished = True
                    break
                event = json.loads(data)
                if "error" in event:
                    outcome.error = f"{event['error'].get('code')} {event['error'].get('type')}"
                    break
                if not chat and event.get("stop"):
                    outcome.finished = True
                    outcome.cached = event.get("timings", {}).get("cache_n", 0)
                    break
                if chat and event.get("usage"):
                    outcome.cached = event["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
                if hang_up_after is not None and outcome.chunks >= hang_up_after:
                    outcome.hung_up = True
                    break
    except httpx.HTTPError as exc:
        outcome.error = type(exc).__name__
    return outcome


async def storm(base_url: str, n: int, disconnect: float, n_predict: int, seed: int) -> Tally:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600, connect=60), limits=limits) as client:
        outcomes = await asyncio.gather(*(one_stream(client, random.Random(rng.random()), disconnect, n_predict) for _ in range(n)))
    return Tally(list(outcomes))


async def steady(base_url: str, clients: int, seconds: float, disconnect: float, n_predict: int, seed: int) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + seconds

    async def loop(i: int, client: httpx.AsyncClient) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() < deadline:
            tally.outcomes.append(await one_stream(client, rng, disconnect, n_predict))

    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600, connect=60)) as client:
        await asyncio.gather(*(loop(i, client) for i in range(clients)))
    return tally


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def sampler(base_url: str, pid: int, every: float, stop: Any, out: Any) -> None:
    """A process of its own: the load generator never delays a /health measurement."""
    health, over, rss, cached, stray, samples = [], [], [], [], [], 0
    with httpx.Client(base_url=base_url, timeout=30) as client:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                client.get("/health")
                health.append((time.perf_counter() - t) * 1000.0)
                stats = client.get("/v1/cache/stats").json()
            except httpx.HTTPError:
                break  # the server is gone: the main process reports why
            samples += 1
            cached.append(stats["bytes"])
            if stats["bytes"] > stats["capacity_bytes"] or stats["snapshot_bytes"] > stats["snapshot_capacity_bytes"]:
                over.append({"bytes": stats["bytes"], "capacity": stats["capacity_bytes"]})
            if stats["kv_block_stray_refs"]:
                stray.append(stats["kv_block_stray_refs"])
            rss.append(rss_bytes(pid))
            stop.wait(every)
    out.put({"health_ms": health, "over_capacity": over, "rss": rss, "samples": samples, "peak_cache_bytes": max(cached, default=0),
             "stray_refs": stray})


POOL_FIELDS = ("kv_blocks", "kv_block_bytes", "kv_blocks_stored", "kv_block_leases", "kv_blocks_leased", "kv_block_stray_refs")


def pool_after_reset(base_url: str) -> dict[str, int]:
    """``POST /v1/cache/reset`` (the slots idle), then who still holds KV blocks: all zero unless
    a path leaked a reference (``/v1/cache/stats``, docs/prompt-cache.md)."""
    with httpx.Client(base_url=base_url, timeout=60) as client:
        client.post("/v1/cache/reset").raise_for_status()
        stats = client.get("/v1/cache/stats").json()
    return {k: stats[k] for k in POOL_FIELDS}


def wait_idle(base_url: str, timeout: float = 30.0) -> float | None:
    """Seconds until every slot is idle, or None if they are still busy after ``timeout``."""
    start = time.monotonic()
    with httpx.Client(base_url=base_url, timeout=30) as client:
        while time.monotonic() - start < timeout:
            if not any(slot["is_processing"] for slot in client.get("/slots").json()):
                return time.monotonic() - start
            time.sleep(0.1)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama:tiny", help="a model directory or family[:size] (generated)")
    parser.add_argument("--parallel", type=int, default=8, help="server slots (-np)")
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--disconnect", type=float, default=0.3)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--steady-seconds", type=float, default=60.0)
    parser.add_argument("--n-predict", type=int, default=32)
    parser.add_argument("--cache-bytes", type=int, default=4 << 20, help="--prompt-cache-capacity-bytes (small: eviction runs)")
    parser.add_argument("--sample-every", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()

    model = benchlib.resolve_model(args.model, "tiny")
    # 2048 positions a slot: a shared system prompt (~640 tokens) and its tail fit
    extra = ["-np", str(args.parallel), "-c", str(2048 * args.parallel), "--prompt-cache-capacity-bytes", str(args.cache_bytes), "--metrics"]
    server = benchlib.ServerProcess.mlxcel(model, extra, name="load")
    server.start()
    results: dict[str, Any] = {"args": vars(args)}
    try:
        server.wait_healthy(300)
        base, pid = server.base_url, server.proc.pid
        # Warm-up: the same storm once (other prompts), so that buffers, arenas and pools reach their
        # working size; then an empty cache. RSS growth beyond this is what the run leaves behind.
        asyncio.run(storm(base, args.streams, args.disconnect, args.n_predict, seed=args.seed + 1))
        wait_idle(base)
        httpx.post(base + "/v1/cache/reset", timeout=60).raise_for_status()
        time.sleep(2.0)
        baseline = rss_bytes(pid)
        stop, out = multiprocessing.Event(), multiprocessing.Queue()
        watcher = multiprocessing.Process(target=sampler, args=(base, pid, args.sample_every, stop, out))
        watcher.start()
        t0 = time.monotonic()
        storm_tally = asyncio.run(storm(base, args.streams, args.disconnect, args.n_predict, args.seed))
        results["storm"] = {**storm_tally.summary(), "seconds": time.monotonic() - t0, "idle_after_s": wait_idle(base)}
        t0 = time.monotonic()
        steady_tally = asyncio.run(steady(base, args.clients, args.steady_seconds, args.disconnect, args.n_predict, args.seed))
        results["steady"] = {**steady_tally.summary(), "seconds": time.monotonic() - t0, "idle_after_s": wait_idle(base)}
        stop.set()
        watch = out.get(timeout=120)
        watcher.join(60)
        before_reset = rss_bytes(pid)
        evicting = httpx.get(base + "/v1/cache/stats").json()
        pool = pool_after_reset(base)
        time.sleep(2.0)
        after_reset = rss_bytes(pid)
        stats = httpx.get(base + "/v1/cache/stats").json()
    finally:
        server.stop()

    health = watch["health_ms"]
    results.update(
        rss={"baseline": baseline, "peak": max(watch["rss"]), "before_reset": before_reset, "after_reset": after_reset,
             "series_mib": [round(v / (1 << 20)) for v in watch["rss"][:: max(1, len(watch["rss"]) // 40)]],
             "after_reset_vs_baseline": after_reset / baseline},
        cache={"samples": watch["samples"], "over_capacity": watch["over_capacity"], "peak_bytes": watch["peak_cache_bytes"],
               "capacity_bytes": stats["capacity_bytes"], "evictions": stats["evictions"], "hits": stats["hits"], "lookups": stats["lookups"],
               "sharing_ratio_before_reset": evicting["sharing_ratio"], "kv_blocks_before_reset": evicting["kv_blocks"]},
        pool={"after_reset": pool, "stray_ref_samples": watch["stray_refs"]},
        health={"n": len(health), "p50_ms": benchlib.pct(health, 50), "p99_ms": benchlib.pct(health, 99), "max_ms": max(health)},
    )
    mib = 1 << 20
    print(f"model {args.model}, -np {args.parallel}, storm {args.streams} streams ({args.disconnect:.0%} hang up), "
          f"steady {args.clients} clients x {args.steady_seconds:.0f} s, n_predict {args.n_predict}")
    for phase in ("storm", "steady"):
        r = results[phase]
        print(f"{phase:>6}: {r['requests']} requests in {r['seconds']:.0f} s, {r['completed']} completed, {r['hung_up']} hung up, "
              f"{r['lost']} lost, {r['hits']} prompt-cache hits, errors {r['errors'] or 'none'}, slots idle after "
              f"{'%.1f s' % r['idle_after_s'] if r['idle_after_s'] is not None else 'NOT within 30 s'}")
    c = results["cache"]
    print(f" cache: {c['samples']} samples, peak {c['peak_bytes'] / mib:.1f} MiB, over capacity {len(c['over_capacity'])} times (capacity {c['capacity_bytes'] / mib:.1f} MiB), "
          f"{c['lookups']} lookups, {c['hits']} hits, evictions {c['evictions']}; before the reset {c['kv_blocks_before_reset']} KV blocks, "
          f"sharing ratio {c['sharing_ratio_before_reset']}")
    p = results["pool"]
    print(f"  pool: after the reset {p['after_reset']}; samples with stray block references: {len(p['stray_ref_samples'])}")
    r = results["rss"]
    print(f"   RSS: baseline {r['baseline'] / mib:.0f} MiB, peak {r['peak'] / mib:.0f} MiB, before reset {r['before_reset'] / mib:.0f} MiB, "
          f"after reset {r['after_reset'] / mib:.0f} MiB ({r['after_reset_vs_baseline']:.2f}x baseline)")
    print(f"   RSS over the run (MiB): {' '.join(map(str, r['series_mib']))}")
    h = results["health"]
    print(f"health: {h['n']} samples, p50 {h['p50_ms']:.1f} ms, p99 {h['p99_ms']:.1f} ms, max {h['max_ms']:.1f} ms")
    goals = {
        "no lost completions": results["storm"]["lost"] == 0 and results["steady"]["lost"] == 0,
        "slots idle afterwards": results["storm"]["idle_after_s"] is not None and results["steady"]["idle_after_s"] is not None,
        "cache bytes <= capacity": not c["over_capacity"],
        "the cache evicted all along": c["evictions"]["lru"] > 0,
        "no stray block reference at any sample": not p["stray_ref_samples"],
        "no block or lease left after the reset": not any(p["after_reset"].values()),
        "RSS after reset within 10% of baseline": r["after_reset_vs_baseline"] <= 1.10,
    }
    for goal, met in goals.items():
        print(f"  {'met' if met else 'NOT met'}: {goal}")
    results["goals"] = goals
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if all(goals.values()) else 1


if __name__ == "__main__":
    benchlib.run(main)
