#!/usr/bin/env python3
"""Disk tier of the prompt cache (``--prompt-cache-dir``): what a restart costs, start-up, decode.

Three parts, each measuring its sides in the same run (``--parts``, all by default):

* ``ttft``: a ``--prefix-tokens`` (2K) prefix on the small model. Server A warms ``--reps``
  prefixes, stops cleanly (RAM is written to disk), the files are evicted from the page cache
  (``--drop-caches``: ``fadvise`` evicts just these files with POSIX_FADV_DONTNEED, ``global``
  writes ``/proc/sys/vm/drop_caches`` and falls back to ``fadvise`` when that is not permitted,
  ``none``), then server B starts on the same directory and, per prefix: a **disk hit** (the first
  request after the restart), a **RAM hit** (the same prefix again, now in RAM) and a **cold
  prefill** (``cache_prompt: false``), RAM and cold in alternating order. TTFT is client-side
  (streaming ``/completion``, first chunk with a token). Goals: disk <= 3 x RAM, disk <= 0.1 x cold.
* ``startup``: time from process start to ``/health`` 200 with an empty cache directory and with
  ``--startup-gb`` GB of valid entry files (written directly with the disk module: the index reads
  only headers, so synthetic payloads cost start-up the same as real ones), alternating, ``--reps``
  times each. Goal: <= 1 s more than empty.
* ``decode``: decode tokens/s of one ``--decode-tokens`` stream while other requests keep pushing
  2K-token entries out of RAM (every ``--spill-every`` seconds), on one server with the disk tier:
  runs in which every evicted entry is written (~50 MB each on the small model) alternate with runs
  of the same requests under one session key, whose new entries replace their identical
  predecessors, so nothing is written. Goal: >= 95%.

Example::

    python scripts/bench_disk_cache.py --size small
    python scripts/bench_disk_cache.py --size tiny --prefix-tokens 512 --reps 2 --startup-gb 0.2 --json out.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime as _dt
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import httpx

from benchlib import ROOT, ServerProcess, ratio, resolve_model

WORDS = (
    "the harbour lantern gull tide anchor rope sail compass storm island keeper beacon reef current "
    "morning evening river mountain forest valley ocean village market garden bridge road station "
    "library museum school letter book story journey traveler merchant farmer teacher student"
).split()


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def server(model: str, *extra: str) -> ServerProcess:
    s = ServerProcess.mlxcel(model, ["-np", "2", "-c", "8192", "-b", "512", "--metrics", *extra], name="mlxcel")
    s.start()
    s.wait_healthy(180)
    return s


def prefix_of(c: httpx.Client, seed: int, tokens: int) -> str:
    """Filler text of about ``tokens`` tokens (calibrated with the server's tokenizer)."""
    n = tokens
    for _ in range(6):
        text = words(seed, n)
        have = len(c.post("/tokenize", json={"content": text}).json()["tokens"])
        if abs(have - tokens) <= 8:
            return text
        n = max(1, int(n * tokens / have))
    return text


def stream(c: httpx.Client, prompt: str, **extra: Any) -> dict[str, Any]:
    """One streamed ``/completion``: client TTFT, server timings and the final chunk."""
    body = {"prompt": prompt, "stream": True, "temperature": 0, "n_predict": 1, **extra}
    t0 = time.perf_counter()
    ttft = None
    final: dict[str, Any] = {}
    with c.stream("POST", "/completion", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and (chunk.get("content") or chunk.get("tokens") or chunk.get("stop")):
                ttft = (time.perf_counter() - t0) * 1000
            if chunk.get("stop"):
                final = chunk
    return {"ttft_ms": ttft, "total_ms": (time.perf_counter() - t0) * 1000, "final": final}


def warm_up(c: httpx.Client, tokens: int) -> None:
    """A first request pays one-off costs (MLX kernels for new shapes, imports): pay them on an
    unrelated prompt, cold then as a RAM hit, before anything is measured."""
    text = words(99, tokens // 2)
    stream(c, text)
    stream(c, text + " again")


def disk_stats(c: httpx.Client) -> dict[str, Any]:
    return c.get("/v1/cache/stats").json()["tiers"]["disk"]


def settle(c: httpx.Client, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while disk_stats(c)["write_queue_entries"] and time.monotonic() < deadline:
        time.sleep(0.1)


def evict_page_cache(directory: Path, mode: str) -> str:
    """Push the cache files out of the page cache; return what was done (for the report)."""
    if mode == "none":
        return "page cache not dropped"
    if mode == "global":
        try:
            subprocess.run(["sync"], check=True)
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            return "global drop_caches"
        except OSError as exc:
            note = f"/proc/sys/vm/drop_caches not permitted ({exc.strerror}); "
    else:
        note = ""
    for p in directory.rglob("*.safetensors"):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    resident = resident_fraction(directory)
    return note + f"POSIX_FADV_DONTNEED on each file ({resident} of the files' pages still resident, by fincore)"


def resident_fraction(directory: Path) -> str:
    files = [str(p) for p in directory.rglob("*.safetensors")]
    if not files or shutil.which("fincore") is None:
        return "unknown"
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "-o", "RES,SIZE", *files], capture_output=True, text=True)
    res = size = 0
    for line in out.stdout.split("\n"):
        parts = line.split()
        if len(parts) == 2:
            res, size = res + int(parts[0]), size + int(parts[1])
    return f"{100 * res / size:.1f}%" if size else "unknown"


# ---------------------------------------------------------------------------- parts


def part_ttft(model: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    directory = work / "ttft"
    flags = ("--prompt-cache-dir", str(directory), "--prompt-cache-disk-capacity-bytes", str(8 << 30))
    a = server(model, *flags)
    try:
        with httpx.Client(base_url=a.base_url, timeout=600) as c:
            prefixes = [prefix_of(c, 1000 + i, args.prefix_tokens) for i in range(args.reps)]
            n_tokens = [len(c.post("/tokenize", json={"content": p}).json()["tokens"]) for p in prefixes]
            for p in prefixes:
                stream(c, p + " Where is the harbour?")
    finally:
        a.stop()
    files = sorted(directory.rglob("*.safetensors"))
    dropped = evict_page_cache(directory, args.drop_caches)
    b = server(model, *flags)
    rows: dict[str, list[dict[str, Any]]] = {"disk": [], "ram": [], "cold": []}
    try:
        with httpx.Client(base_url=b.base_url, timeout=600) as c:
            warm_up(c, args.prefix_tokens)
            for i, p in enumerate(prefixes):
                rows["disk"].append(stream(c, p + f" Who keeps lantern {i}?"))
                order = ["ram", "cold"] if i % 2 == 0 else ["cold", "ram"]
                for kind in order:
                    extra = {"cache_prompt": False} if kind == "cold" else {}
                    rows[kind].append(stream(c, p + f" When does tide {i} turn as {kind}?", **extra))
            disk = disk_stats(c)
    finally:
        b.stop()
    for r in rows["disk"] + rows["ram"]:
        assert r["final"]["timings"]["cache_n"] > 0, "expected a cache hit"
    assert disk["hits"] == len(prefixes), disk
    p50 = {k: median(r["ttft_ms"] for r in v) for k, v in rows.items()}
    prompt_ms = {k: median(r["final"]["timings"]["prompt_ms"] for r in v) for k, v in rows.items()}
    return {
        "prefix_tokens": median(n_tokens),
        "file_bytes": median(p.stat().st_size for p in files),
        "page_cache": dropped,
        "ttft_p50_ms": p50,
        "server_prompt_ms_p50": prompt_ms,
        "disk_load_ms_avg": disk["load_ms_avg"],
        "disk_over_ram": ratio(p50["disk"], p50["ram"]),
        "disk_over_cold": ratio(p50["disk"], p50["cold"]),
        "samples": {k: [round(r["ttft_ms"], 1) for r in v] for k, v in rows.items()},
    }


def write_synthetic_entries(model: str, directory: Path, gigabytes: float) -> tuple[int, int]:
    """Valid disk-tier files of this model's KV shape (2K tokens each): ``(files, bytes)``."""
    sys.path.insert(0, str(ROOT))
    from mlxcel_compat.runtime.backend import load_optimized_blas

    load_optimized_blas()
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from mlxcel_compat.cache import kv, kv_io
    from mlxcel_compat.cache.disk_directory import entry_name
    from mlxcel_compat.cache.disk_format import Compat, EntryHeader
    from mlxcel_compat.cache.disk_write import commit, write_temp
    from mlxcel_compat.cache.key import ANON_SESSION, RAW_PROMPT_TEMPLATE_SIG, TEXT_ONLY_MM_DIGEST, Bucket
    from mlxcel_compat.model.loader import load_model

    loaded = load_model(model, [])
    compat = Compat(loaded.fingerprint, kv_io.runtime_tag(loaded.model))
    sub = directory / compat.directory_key
    sub.mkdir(parents=True, exist_ok=True)
    cache = make_prompt_cache(loaded.model)
    n = 2048
    rng = random.Random(7)
    for layer in cache:
        kv_heads, head_dim = loaded.config["num_key_value_heads"], loaded.config.get("head_dim") or loaded.config["hidden_size"] // loaded.config["num_attention_heads"]
        layer.keys = mx.random.normal((1, kv_heads, n, head_dim))
        layer.values = mx.random.normal((1, kv_heads, n, head_dim))
        layer.offset = n
    mx.eval([layer.state for layer in cache])
    layout, tensors = kv_io.encode(cache)
    bucket = Bucket(loaded.model_id, "", RAW_PROMPT_TEMPLATE_SIG, None, TEXT_ONLY_MM_DIGEST)
    total = files = 0
    while total < gigabytes * 1e9:
        tokens = tuple(rng.randrange(1, 8000) for _ in range(n))
        header = EntryHeader("kv", compat, bucket, ANON_SESSION, tokens, "completion", True, kv.nbytes(cache), layout)
        path = sub / entry_name("kv", header.digest)
        temp = write_temp(path, header, tensors)
        commit(temp, path)
        total += temp.size
        files += 1
    return files, total


def time_start(model: str, directory: Path, drop: str) -> tuple[float, float]:
    """Seconds from process start to a healthy server, and the index rebuild's own ms."""
    evict_page_cache(directory, "fadvise" if drop != "none" else "none")
    t0 = time.perf_counter()
    s = server(model, "--prompt-cache-dir", str(directory), "--prompt-cache-disk-capacity-bytes", str(8 << 30))
    wall = time.perf_counter() - t0
    try:
        with httpx.Client(base_url=s.base_url, timeout=60) as c:
            d = disk_stats(c)
    finally:
        s.stop()
    return wall, d["startup_ms"]


def part_startup(model: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    empty, full = work / "empty", work / "full"
    empty.mkdir()
    files, nbytes = write_synthetic_entries(model, full, args.startup_gb)
    times: dict[str, list[tuple[float, float]]] = {"empty": [], "full": []}
    for i in range(args.reps):
        for name in (["empty", "full"] if i % 2 == 0 else ["full", "empty"]):
            times[name].append(time_start(model, empty if name == "empty" else full, args.drop_caches))
    wall = {k: median(t[0] for t in v) for k, v in times.items()}
    index = {k: median(t[1] for t in v) for k, v in times.items()}
    return {
        "files": files,
        "bytes": nbytes,
        "wall_s_p50": wall,
        "index_ms_p50": index,
        "extra_s": wall["full"] - wall["empty"],
        "samples": {k: [round(t[0], 3) for t in v] for k, v in times.items()},
    }


def part_decode(model: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Decode tok/s of one stream while evicted entries are written, against the same server while
    nothing is written, alternating. One process: two identical servers differed by up to 11 % in
    decode speed here (an A/A test, docs/benchmarks/disk-tier.md), more than the effect measured.

    The RAM budget holds five 2K-token entries. Every ``--spill-every`` seconds of a stream, an
    exact repeat of a cached 2K prefix arrives: a one-token prefill that donates a new entry. In
    **spill** runs each comes under a new session key, so its entry evicts the oldest one, which
    is written (~50 MB). In **quiet** runs they all come under one key, so each new entry replaces
    its identical predecessor (a duplicate): the same adoption, prefill and 50 MB freed, nothing
    written. Two unmeasured requests of the run's kind come first, and the writer's queue is empty
    before each run.
    """
    s = None
    try:
        probe = server(model)
        with httpx.Client(base_url=probe.base_url, timeout=600) as c:
            prefix = prefix_of(c, 2000, args.prefix_tokens)
            stream(c, prefix)
            entry_bytes = c.get("/v1/cache/stats").json()["bytes"]
        probe.stop()
        ram = str(int(entry_bytes * 5.4))
        s = server(model, "--prompt-cache-capacity-bytes", ram, "--prompt-cache-dir", str(work / "decode"),
                   "--prompt-cache-disk-capacity-bytes", str(8 << 30))
        fresh = iter(range(1 << 30))

        def evict(c: httpx.Client, kind: str) -> dict[str, Any]:
            key = "quiet" if kind == "quiet" else f"spill-{next(fresh)}"
            return stream(c, prefix, prompt_cache_key=key)["final"]["timings"]

        rates: dict[str, list[float]] = {"spill": [], "quiet": []}
        writes: dict[str, list[int]] = {"spill": [], "quiet": []}
        misses = dict.fromkeys(rates, 0)
        with httpx.Client(base_url=s.base_url, timeout=600) as c:
            stream(c, prefix)
            for _ in range(6):  # RAM full
                evict(c, "spill")
            for rep in range(args.reps):
                for kind in (("spill", "quiet") if rep % 2 == 0 else ("quiet", "spill")):
                    for _ in range(2):
                        evict(c, kind)
                    settle(c)
                    before = disk_stats(c)["writes"]
                    with concurrent.futures.ThreadPoolExecutor(1) as pool:
                        job = pool.submit(stream, c, "Tell me a long story about the sea.", n_predict=args.decode_tokens, ignore_eos=True)
                        while not job.done():
                            time.sleep(args.spill_every)
                            if job.done():
                                break
                            misses[kind] += evict(c, kind)["cache_n"] == 0
                        final = job.result()["final"]
                    rates[kind].append(final["timings"]["predicted_per_second"])
                    settle(c)
                    writes[kind].append(disk_stats(c)["writes"] - before)
            stats = disk_stats(c)
    finally:
        if s is not None:
            s.stop()
    med = {k: median(v) for k, v in rates.items()}
    return {
        "entry_bytes": entry_bytes,
        "decode_tok_s_p50": med,
        "spill_over_quiet": ratio(med["spill"], med["quiet"]),
        "per_rep_ratio": [round(r, 3) for r in (ratio(a, b) for a, b in zip(rates["spill"], rates["quiet"])) if r is not None],
        "writes_per_run": writes,  # quiet runs must write nothing
        "evicting_requests_missed": misses,  # must be 0: every evicting request finds its prefix in RAM
        "writes_dropped": stats["writes_dropped"],
        "write_paced_ms_total": stats.get("write_paced_ms_total"),
        "samples": {k: [round(x, 2) for x in v] for k, v in rates.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small", help="generated llama size (tiny, small) or a model directory")
    ap.add_argument("--parts", default="ttft,startup,decode")
    ap.add_argument("--prefix-tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--startup-gb", type=float, default=2.0)
    ap.add_argument("--decode-tokens", type=int, default=160)
    ap.add_argument("--spill-every", type=float, default=0.5, help="seconds between entry-evicting requests")
    ap.add_argument("--drop-caches", choices=("fadvise", "global", "none"), default="fadvise")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    model = args.size if os.path.isdir(args.size) else resolve_model(f"llama:{args.size}", "small")
    results: dict[str, Any] = {"date": _dt.datetime.now().isoformat(timespec="minutes"), "model": model, "load": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="bench_disk_") as tmp:
        work = Path(tmp)
        for part in args.parts.split(","):
            t0 = time.perf_counter()
            results[part] = {"ttft": part_ttft, "startup": part_startup, "decode": part_decode}[part](model, args, work)
            results[part]["seconds"] = round(time.perf_counter() - t0, 1)
            print(json.dumps({part: results[part]}, indent=1), flush=True)
    results["load_after"] = os.getloadavg()
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def report(r: dict[str, Any]) -> None:
    print(f"\n# disk tier, {r['date']}, load {r['load'][0]:.1f} -> {r['load_after'][0]:.1f}")
    if "ttft" in r:
        t = r["ttft"]
        p = t["ttft_p50_ms"]
        print(f"TTFT p50 ms at {t['prefix_tokens']} prefix tokens ({t['file_bytes'] / 1e6:.1f} MB files; {t['page_cache']}):")
        print(f"  RAM hit {p['ram']:.0f} | disk hit after restart {p['disk']:.0f} (load {t['disk_load_ms_avg']:.0f}) | cold {p['cold']:.0f}")
        print(f"  disk / RAM = {t['disk_over_ram']:.2f} (goal <= 3) | disk / cold = {t['disk_over_cold']:.3f} (goal <= 0.1)")
    if "startup" in r:
        s = r["startup"]
        print(f"start-up to healthy, p50: empty {s['wall_s_p50']['empty']:.2f} s, {s['bytes'] / 1e9:.2f} GB in {s['files']} files "
              f"{s['wall_s_p50']['full']:.2f} s (index {s['index_ms_p50']['full']:.0f} ms): +{s['extra_s']:.2f} s (goal <= 1 s)")
    if "decode" in r:
        d = r["decode"]
        m = d["decode_tok_s_p50"]
        print(f"decode tok/s p50 while evicted entries are written {m['spill']:.1f}, while nothing is written {m['quiet']:.1f}: "
              f"{100 * d['spill_over_quiet']:.1f}% (goal >= 95%); per rep {d['per_rep_ratio']}; files written per run {d['writes_per_run']}; "
              f"evicting requests that missed RAM {d['evicting_requests_missed']}; writes dropped {d['writes_dropped']}; "
              f"writer paused {d['write_paced_ms_total']} ms")


if __name__ == "__main__":
    sys.exit(main())
