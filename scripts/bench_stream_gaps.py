#!/usr/bin/env python
"""Streamed tokens as a client sees them: the gaps between SSE chunks of a greedy completion.

A server that decodes at 400 tokens/s but sends them in bursts serves a chat UI worse than its
timings say. This starts our server and llama-server (``../shared/peers/build-llama-server.sh``)
on the same GGUF file, one at a time (``-np 1 -c 4096``, the same threads), and streams
``--reps`` greedy completions of ``--n-predict`` tokens (``ignore_eos``) from each with
``"stream": true``. Per server: the gaps between consecutive data chunks (median, p99, max, over
all repetitions) and tokens/s as received (chunks / first-to-last seconds).

The gaps come from the engine thread and the event loop sharing the GIL: a small model's decode
step that keeps it (``blas_shim.holding_the_gil``) leaves the loop waiting, so tokens pile up and
leave together; while a response is streamed the steps release it (``blas_shim.StreamedConsumers``).

    .venv/bin/python scripts/bench_stream_gaps.py --model ~/.cache/mlxcel_compat/bench-quantized/llama-small-v1-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

import benchlib

ROOT = Path(__file__).resolve().parents[1]
LLAMA_SERVER = Path.home() / ".cache" / "llama-peer" / "llama.cpp" / "build" / "bin" / "llama-server"  # the peer script's


def stream_gaps(base_url: str, n_predict: int, reps: int) -> tuple[list[float], list[float]]:
    """All chunk gaps (seconds) over ``reps`` streamed completions, and each one's tokens/s."""
    gaps, rates = [], []
    for rep in range(reps + 1):  # the first warms up, unrecorded
        body = {"prompt": [1, 2, 3, 4, 5, 6, 7, 8 + rep], "n_predict": n_predict, "temperature": 0, "top_k": 1,
                "ignore_eos": True, "stream": True, "cache_prompt": False}
        times = []
        # a connection a request: llama-server closes one after a streamed response
        with httpx.Client(base_url=base_url, timeout=300) as client, \
                client.stream("POST", "/completion", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: "):
                    times.append(time.perf_counter())
        if rep and len(times) > 2:
            gaps += [b - a for a, b in zip(times, times[1:])]
            rates.append((len(times) - 1) / (times[-1] - times[0]))
    return gaps, rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a GGUF file both servers load")
    parser.add_argument("--n-predict", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER", str(LLAMA_SERVER)))
    args = parser.parse_args()
    common = ["-m", args.model, "-np", "1", "-c", "4096", "-t", str(args.threads)]
    servers = {"mlxcel": lambda port: [sys.executable, "-m", "mlxcel_compat", *common, "--host", "127.0.0.1",
                                       "--port", str(port)]}
    if os.access(args.llama_server, os.X_OK):
        servers["llama-server"] = lambda port: [args.llama_server, *common, "-tb", str(args.threads),
                                                "--host", "127.0.0.1", "--port", str(port)]
    else:
        print(f"no llama-server at {args.llama_server}: ours only", file=sys.stderr)
    print(f"{'server':14s} {'gap p50 ms':>10s} {'p99 ms':>8s} {'max ms':>8s} {'tok/s received':>15s}")
    for name, cmd in servers.items():
        port = benchlib.free_port()
        proc = benchlib.ServerProcess(cmd(port), port, name=name, cwd=ROOT)
        proc.start()
        try:
            proc.wait_healthy(300)
            gaps, rates = stream_gaps(proc.base_url, args.n_predict, args.reps)
        finally:
            proc.stop()
        gaps.sort()
        p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
        print(f"{name:14s} {statistics.median(gaps) * 1e3:10.2f} {p99 * 1e3:8.2f} {gaps[-1] * 1e3:8.2f} "
              f"{statistics.median(rates):15.1f}")
    return 0


if __name__ == "__main__":
    benchlib.run(main)
