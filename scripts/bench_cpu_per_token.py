#!/usr/bin/env python3
"""CPU time per decoded token of llama-server and this server on one GGUF file, one thread each
(``-t 1 -tb 1``): a figure a busy machine does not skew (issue 56).

Why: on the shared 2-core machine, wall-clock decode rates swing with the other processes (at a
load average of 15-20 llama-server's spinning barriers collapse, and a process with more threads
takes more of the CPU's time slices). The CPU seconds a process spends for a token do not
depend on how long it waited for a core: at one compute thread (no spinning) they are the work a
token costs, and on a quiet machine a one-thread server decodes at about 1 / that rate.

Each server is started alone, warmed up (4 tokens), then asked for 1 and for ``N`` greedy tokens
from the same 8-token prompt (``cache_prompt: false``); (CPU of the N-token request - CPU of the
1-token request) / (N - 1) is its decode CPU per token; then one token after a 1024-token prompt,
whose CPU less the 1-token request's, per extra prompt token, is its prefill CPU per token (``utime + stime`` of the whole process
from ``/proc/PID/stat``, HTTP and every thread included). Then this server again with
``MLXCEL_CPU_DECODE=0`` (MLX's step), for the CPU decode runtime's share.

    python scripts/bench_cpu_per_token.py FILE.gguf [N=64] [ROUNDS=1]

A model directory in place of FILE.gguf (mlx-lm's safetensors, which llama-server does not read)
measures this server with and without the CPU decode runtime only.

The servers listen on ``BENCH_PORT`` and the two ports after it (default 18771), so runs beside
each other on one machine can keep apart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_SERVER = os.environ.get("LLAMA_SERVER", os.path.expanduser("~/.cache/llama-peer/llama.cpp/build/bin/llama-server"))
TICK = os.sysconf("SC_CLK_TCK")
PROMPT = [10, 11, 12, 13, 14, 15, 16, 17]
PREFILL = [(37 * i) % 8000 + 10 for i in range(1024)]  # a 1K prompt of ids every file's vocabulary holds


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process, every thread included."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def complete(port: int, n_predict: int, prompt: list[int] = PROMPT) -> dict[str, Any]:
    body = dict(prompt=prompt, n_predict=n_predict, temperature=0, top_k=1, ignore_eos=True, cache_prompt=False)
    request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(request, timeout=3600).read())


def wait_healthy(port: int, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"no /health on port {port}")


def measure(name: str, cmd: list[str], port: int, n: int, env: dict[str, str] | None = None) -> tuple[float, float]:
    """Decode CPU milliseconds per token of the server ``cmd`` starts, and prefill CPU
    milliseconds per token of a 1K prompt (printed and returned)."""
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        wait_healthy(port)
        complete(port, 4)  # warm-up
        spent = {}
        for count in (1, n):
            before = cpu_seconds(server.pid)
            complete(port, count)
            spent[count] = cpu_seconds(server.pid) - before
        per_token = (spent[n] - spent[1]) / (n - 1) * 1e3
        before = cpu_seconds(server.pid)
        complete(port, 1, PREFILL)
        prefill = (cpu_seconds(server.pid) - before - spent[1]) / (len(PREFILL) - len(PROMPT)) * 1e3
        print(f"{name}: {per_token:.1f} CPU ms per decoded token ({spent[n]:.2f} s for {n} tokens, "
              f"{spent[1]:.2f} s for 1); {prefill:.2f} CPU ms per prompt token of a 1K prompt", flush=True)
        return per_token, prefill
    finally:
        server.terminate()
        server.wait()


def main() -> int:
    path = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    common = ["-m", path, "-np", "1", "-c", "4096", "-t", "1", "-tb", "1", "--port"]
    port = int(os.environ.get("BENCH_PORT", "18771"))
    ours = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONPATH=ROOT)
    for _ in range(rounds):
        llama = [LLAMA_SERVER, *common, str(port)]
        theirs = None if os.path.isdir(path) else measure("llama-server", llama, port, n)
        mine = measure("mlxcel", [sys.executable, "-m", "mlxcel_compat", *common, str(port + 1)], port + 1, n, ours)
        mlx = measure("mlxcel, MLX's step", [sys.executable, "-m", "mlxcel_compat", *common, str(port + 2)], port + 2, n,
                      dict(ours, MLXCEL_CPU_DECODE="0"))
        print(f"MLX's step / CPU decode runtime CPU per token: decode {mlx[0] / mine[0]:.2f}x", flush=True)
        if theirs is None:
            continue
        print(f"llama-server / mlxcel CPU per token: decode {theirs[0] / mine[0]:.2f}x, "
              f"prefill {theirs[1] / mine[1]:.2f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
