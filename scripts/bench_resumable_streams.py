#!/usr/bin/env python
"""Resumable streams under a storm: 200 streams with ``X-Conversation-Id``, 30 % of the clients
hang up after a random number of chunks, then every hung-up stream is read to its end again.

One server is started here on the generated model (greedy sampling, so a stream's bytes are a
function of its prompt), with ``--stream-buffer-bytes`` set (small by default: a long answer's
oldest bytes are dropped, so the bound is exercised). While the storm runs, a sampler asks
``POST /v1/streams/lookup`` about every conversation id of the storm. Reported:

* resumed: hung-up streams whose rest was read from ``GET /v1/stream?from=<bytes received>`` and
  whose received + resumed bytes equal a replay from the first byte still held, and end with
  ``[DONE]`` (goal: all of them; a stream whose received offset was dropped is counted apart);
* equal to an uninterrupted run: the resumed answer's events (ids, timestamps and timings left
  out) against the same prompt run again without hanging up (goal: all of them, when the buffer
  held the whole stream);
* buffered bytes: the largest of one session and the sum over sessions at any sample, against
  the bound (goal: never above ``--stream-buffer-bytes`` for one session);
* slots idle after the storm, ``/health`` answering throughout.

Usage::

    .venv/bin/python scripts/bench_resumable_streams.py
    .venv/bin/python scripts/bench_resumable_streams.py --streams 200 --buffer-bytes 4194304 --json /tmp/streams.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

import benchlib

WORDS = "apple river stone cloud garden lamp window silver road music table winter paper bridge candle forest".split()
VOLATILE = ("id", "created", "timings")


@dataclass
class Stream:
    conv: str
    body: dict[str, Any]
    hang_up_after: int | None  # data lines read before hanging up (None: read to the end)
    received: bytes = b""
    resumed: bytes | None = None
    replay: bytes | None = None
    reference: bytes | None = None
    error: str | None = None


def events(raw: bytes) -> list[Any]:
    out = []
    for line in raw.decode(errors="replace").split("\n"):
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else {k: v for k, v in json.loads(payload).items() if k not in VOLATILE})
    return out


async def start(client: httpx.AsyncClient, s: Stream) -> None:
    try:
        async with client.stream("POST", "/v1/chat/completions", json=s.body, headers={"X-Conversation-Id": s.conv}) as response:
            if response.status_code != 200:
                s.error = f"HTTP {response.status_code}"
                return
            async for piece in response.aiter_raw():
                s.received += piece
                if s.hang_up_after is not None and s.received.count(b"\ndata: ") + s.received.startswith(b"data: ") >= s.hang_up_after:
                    return  # leaving the context closes the connection
    except httpx.HTTPError as exc:
        s.error = type(exc).__name__


async def sample(client: httpx.AsyncClient, convs: list[str], stop: asyncio.Event, out: dict[str, Any]) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        health = await client.get("/health")
        out["health_ms"].append((time.perf_counter() - t0) * 1000)
        out["health_ok"] &= health.status_code == 200
        found = (await client.post("/v1/streams/lookup", json={"conversation_ids": convs})).json()
        if found:
            out["max_session"] = max(out["max_session"], max(f["buffered_bytes"] for f in found))
            out["max_total"] = max(out["max_total"], sum(f["buffered_bytes"] for f in found))
            out["max_sessions"] = max(out["max_sessions"], len(found))
        await asyncio.sleep(0.1)


async def wait_done(client: httpx.AsyncClient, conv: str, timeout: float = 600) -> dict[str, Any] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = (await client.post("/v1/streams/lookup", json={"conversation_ids": [conv]})).json()
        if found and found[0]["is_done"]:
            return found[0]
        await asyncio.sleep(0.1)
    return None


async def storm(base: str, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    streams = []
    for i in range(args.streams):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": args.n_predict, "temperature": 0,
                "ignore_eos": True, "stream": True}
        hang_up = rng.randint(1, max(1, args.n_predict // 2)) if rng.random() < args.disconnect else None
        streams.append(Stream(conv=f"storm-{args.seed}-{i}", body=body, hang_up_after=hang_up))
    limits = httpx.Limits(max_connections=args.streams + 16, max_keepalive_connections=args.streams + 16)
    samples: dict[str, Any] = {"health_ms": [], "health_ok": True, "max_session": 0, "max_total": 0, "max_sessions": 0}
    async with httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600, connect=60), limits=limits) as client:
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample(client, [s.conv for s in streams], stop, samples))
        t0 = time.monotonic()
        await asyncio.gather(*(start(client, s) for s in streams))
        hung = [s for s in streams if s.hang_up_after is not None and not s.error]
        statuses = await asyncio.gather(*(wait_done(client, s.conv) for s in hung))
        storm_s = time.monotonic() - t0
        stop.set()
        await sampler
        lost_offset = 0
        for s, status in zip(hung, statuses):
            if status is None:
                s.error = "never finished"
                continue
            rest = await client.get("/v1/stream", params={"conv_id": s.conv, "from": len(s.received)})
            if rest.status_code == 400:
                lost_offset += 1  # the bound dropped bytes this client had not read
                continue
            s.resumed = s.received + rest.content
            first = status["total_bytes"] - status["buffered_bytes"]
            s.replay = (await client.get("/v1/stream", params={"conv_id": s.conv, "from": first})).content
        # The same prompts again, without hanging up: the answers a resumed stream must equal.
        for s in hung:
            if s.resumed is not None:
                s.reference = (await client.post("/v1/chat/completions", json=s.body)).content
    resumed = [s for s in hung if s.resumed is not None]
    whole = [s for s in resumed if len(s.replay or b"") == len(s.resumed)]  # the buffer still held every byte
    return {
        "streams": len(streams),
        "hung_up": len(hung),
        "errors": sum(s.error is not None for s in streams),
        "storm_s": storm_s,
        "resumed": len(resumed),
        "offset_lost": lost_offset,
        "resumed_end_with_done": sum(events(s.resumed)[-1:] == ["[DONE]"] for s in resumed),
        "resumed_tail_equals_replay": sum(s.resumed.endswith(s.replay) for s in resumed),
        "whole_in_buffer": len(whole),
        "equal_to_uninterrupted": sum(events(s.resumed) == events(s.reference) for s in whole),
        "max_session_buffered_bytes": samples["max_session"],
        "max_total_buffered_bytes": samples["max_total"],
        "max_sessions": samples["max_sessions"],
        "health_ok": samples["health_ok"],
        "health_p99_ms": benchlib.pct(samples["health_ms"], 99),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama:tiny", help="a model directory or family[:size] (generated)")
    parser.add_argument("--parallel", type=int, default=8, help="server slots (-np)")
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--disconnect", type=float, default=0.3)
    parser.add_argument("--n-predict", type=int, default=128)
    parser.add_argument("--buffer-bytes", type=int, default=32 * 1024, help="--stream-buffer-bytes (small: the bound bites)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()

    model = benchlib.resolve_model(args.model, "tiny")
    extra = ["-np", str(args.parallel), "-c", str(1024 * args.parallel), "--stream-buffer-bytes", str(args.buffer_bytes)]
    server = benchlib.ServerProcess.mlxcel(model, extra, name="streams")
    server.start()
    try:
        server.wait_healthy(300)
        results = asyncio.run(storm(server.base_url, args))
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            deadline = time.monotonic() + 30
            while any(s["is_processing"] for s in client.get("/slots").json()) and time.monotonic() < deadline:
                time.sleep(0.1)
            results["idle_after"] = not any(s["is_processing"] for s in client.get("/slots").json())
    finally:
        server.stop()
    results["args"] = vars(args)
    print(json.dumps(results, indent=2))
    checks = {
        "no errors": results["errors"] == 0,
        "every hung-up stream resumed or told its offset was dropped": results["resumed"] + results["offset_lost"] == results["hung_up"],
        "resumed streams end with [DONE]": results["resumed_end_with_done"] == results["resumed"],
        "resumed bytes equal the replay": results["resumed_tail_equals_replay"] == results["resumed"],
        "resumed answers equal uninterrupted runs": results["equal_to_uninterrupted"] == results["whole_in_buffer"],
        "one session within the bound": results["max_session_buffered_bytes"] <= args.buffer_bytes,
        "health answered throughout": results["health_ok"],
        "slots idle afterwards": results["idle_after"],
    }
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**results, "checks": checks}, f, indent=2)
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    benchlib.run(main)
