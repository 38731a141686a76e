"""Router mode against llama-server's router, side by side on the same GGUF files (issue 50).

Both servers start as routers over one ``--models-dir`` (``--models-max 1 -c CTX -np 1``) and are
measured the same way, one after the other:

1. **Cold start**: a streamed ``/completion`` for a model that is not loaded, timed from the
   request to its first token (the load included). ``--repeats`` times, each after the model was
   unloaded (``POST /models/unload``) and the other model was loaded (so the one measured is cold).
2. **Prompt cache across an unload**: a ``--prompt-tokens`` prompt (token ids, the same for both)
   is sent cold to a loaded model, then the model is unloaded and loaded again and the same prompt
   sent again. Reported: both first-token times, their ratio, and ``timings.cache_n`` of the
   second (llama-server's router loses a model's cache with its child process).
3. **Memory after an unload**: the server's resident memory (the router process and its
   children) at start, with no model loaded (after the runs above), with one loaded and used
   (one short request reads every weight: mapped GGUF pages count once touched), and after
   unloading it.

Usage (the factory's small GGUFs by default; llama-server from the peer tree when present):

    python scripts/bench_router.py
    python scripts/bench_router.py --models llama:small:q8_0 qwen3:small:q8_0 --repeats 5 \\
        --peer-llama-server ~/.cache/llama-peer/llama.cpp/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

import benchlib

PEER = Path("~/.cache/llama-peer/llama.cpp/build/bin/llama-server").expanduser()


def gguf(spec: str) -> Path:
    """``family:size:type`` as a factory GGUF file (or a path as given)."""
    if spec.endswith(".gguf") and os.path.isfile(spec):
        return Path(spec)
    if str(benchlib.ROOT) not in sys.path:
        sys.path.insert(0, str(benchlib.ROOT))
    from mlxcel_compat.testing.gguf_writer import ensure_gguf

    family, size, kind = (spec.split(":") + ["small", "q8_0"])[:3]
    return ensure_gguf(family, size, kind)


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and all its descendants (llama-server's router has a child per model)."""
    total = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            total += next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        total += sum(rss_bytes(int(child)) for child in children)
    return total


def status(c: httpx.Client, name: str) -> str:
    for m in c.get("/models").json()["data"]:
        if m["id"] == name:
            return m["status"]["value"]
    raise KeyError(name)


def wait_status(c: httpx.Client, name: str, wanted: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while status(c, name) != wanted:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name} never became {wanted}")
        time.sleep(0.05)


def unload(c: httpx.Client, name: str) -> None:
    if status(c, name) == "loaded":
        c.post("/models/unload", json={"model": name})
    wait_status(c, name, "unloaded")


def load(c: httpx.Client, name: str) -> None:
    if status(c, name) != "loaded":
        c.post("/models/load", json={"model": name})
    wait_status(c, name, "loaded")


def first_token(c: httpx.Client, name: str, prompt: Any, n_predict: int = 1) -> tuple[float, dict[str, Any]]:
    """Seconds from sending a streamed /completion to its first token, and the last event."""
    body = {"model": name, "prompt": prompt, "n_predict": n_predict, "stream": True, "cache_prompt": True,
            "temperature": 0}
    t0 = time.perf_counter()
    ttft = None
    last: dict[str, Any] = {}
    with c.stream("POST", "/completion", json=body, timeout=600) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{name}: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if ttft is None and (event.get("content") or event.get("tokens")):
                ttft = time.perf_counter() - t0
            last = event
    return (ttft if ttft is not None else time.perf_counter() - t0), last


def measure(label: str, cmd: list[str], port: int, names: list[str], prompt: list[int], repeats: int,
            timeout: float) -> dict[str, Any]:
    server = benchlib.ServerProcess(cmd, port, name=label)
    server.start()
    try:
        server.wait_healthy(timeout)
        assert server.proc is not None
        rss_start = rss_bytes(server.proc.pid)
        with httpx.Client(base_url=server.base_url, timeout=600) as c:
            a, b = names[0], names[1]
            cold = []
            for _ in range(repeats):
                load(c, b)  # --models-max 1: a is unloaded by now
                wait_status(c, a, "unloaded")
                cold.append(first_token(c, a, "Hello")[0])
            unload(c, a)
            unload(c, b)
            time.sleep(1.0)
            rss_before = rss_bytes(server.proc.pid)
            load(c, a)
            first_token(c, a, "Hello", n_predict=8)  # every weight read once (mapped files count when touched)
            time.sleep(1.0)
            rss_loaded = rss_bytes(server.proc.pid)
            unload(c, a)
            time.sleep(1.0)
            rss_after = rss_bytes(server.proc.pid)
            load(c, a)
            fresh, _ = first_token(c, a, prompt)
            unload(c, a)
            load(c, a)
            again, last = first_token(c, a, prompt)
            cache_n = (last.get("timings") or {}).get("cache_n")
    finally:
        server.stop()
    return {
        "server": label,
        "cold_ttft_s": cold,
        "cold_ttft_p50_s": benchlib.pct(cold, 50),
        "prompt_tokens": len(prompt),
        "prompt_cold_ttft_s": fresh,
        "prompt_after_reload_ttft_s": again,
        "after_reload_over_cold": again / fresh if fresh else None,
        "after_reload_cache_n": cache_n,
        "rss_at_start_mib": rss_start / 2**20,
        "rss_no_model_mib": rss_before / 2**20,
        "rss_loaded_mib": rss_loaded / 2**20,
        "rss_after_unload_mib": rss_after / 2**20,
        "rss_after_unload_over_before": rss_after / rss_before if rss_before else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs=2, default=["llama:small:q8_0", "qwen3:small:q8_0"],
                        help="two GGUFs (family:size:type of the factory, or paths); the first is measured")
    parser.add_argument("--peer-llama-server", default=str(PEER) if PEER.exists() else "",
                        help="llama-server binary for the side-by-side run ('' to skip it)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()

    files = [gguf(spec) for spec in args.models]
    root = Path(tempfile.mkdtemp(prefix="bench_router_"))
    names = []
    for i, path in enumerate(files):
        name = f"m{i}-{path.stem}"
        (root / f"{name}.gguf").symlink_to(path)
        names.append(name)
    rng = random.Random(0)
    prompt = [rng.randrange(300, 4000) for _ in range(args.prompt_tokens)]  # plain vocabulary ids of both files
    common = ["--models-dir", str(root), "--models-max", "1", "-c", str(args.ctx), "-np", "1", "--host", "127.0.0.1"]
    runs = []
    port = benchlib.free_port()
    runs.append(measure("mlxcel", [sys.executable, "-m", "mlxcel_compat", *common, "--port", str(port)], port,
                        names, prompt, args.repeats, args.timeout))
    if args.peer_llama_server:
        port = benchlib.free_port()
        runs.append(measure("llama-server", [args.peer_llama_server, *common, "--port", str(port)], port,
                            names, prompt, args.repeats, args.timeout))
    for run in runs:
        print(f"{run['server']:>12}: cold load to first token p50 {run['cold_ttft_p50_s']:.2f} s "
              f"({', '.join(f'{t:.2f}' for t in run['cold_ttft_s'])}); "
              f"{run['prompt_tokens']}-token prompt after unload+reload {run['prompt_after_reload_ttft_s']:.3f} s "
              f"vs cold {run['prompt_cold_ttft_s']:.3f} s ({run['after_reload_over_cold']:.2f}x, cache_n "
              f"{run['after_reload_cache_n']}); RSS at start {run['rss_at_start_mib']:.0f} MiB, before a load "
              f"{run['rss_no_model_mib']:.0f} MiB -> loaded and used "
              f"{run['rss_loaded_mib']:.0f} -> unloaded {run['rss_after_unload_mib']:.0f} "
              f"({run['rss_after_unload_over_before']:.2f}x of before)")
    if len(runs) == 2:
        ratio = runs[0]["cold_ttft_p50_s"] / runs[1]["cold_ttft_p50_s"]
        print(f"cold load to first token, mlxcel / llama-server: {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2))
    return 0


if __name__ == "__main__":
    benchlib.run(main)
