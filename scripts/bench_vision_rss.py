#!/usr/bin/env python3
"""Resident memory of a real-sized GGUF vision pair (``-m text --mmproj mmproj``) against
llama-server's on the same files, after one image request (issue 52: RSS <= 1.2x llama-server's).

The tiny factory pairs of ``scripts/check_mmproj.py`` weigh a few MiB, so their RSS is each
runtime's own (Python, MLX, mlx-vlm against a C++ binary). This pair has real-sized parts:

- **text**: Gemma-3-4B-shaped (width 2560, 8 query / 4 KV heads of 256, MLP 10240, five sliding
  layers to one global) with ``--layers`` of its 34 layers (12 by default: two periods), Q4_K_M,
  written by ``testing/gguf_random.py`` (valid random blocks, llama-quantize's Q4_K_M mix); its
  vocabulary is the factory's 8K tokenizer with Gemma 3's image tokens (from the tiny Gemma 3
  vision directory), not Gemma's 262K: the real model's ~0.5 GiB embedding table is left out;
- **projector**: the full SigLIP-So400m tower of Gemma 3 (27 blocks of width 1152, MLP 4304, 16
  heads, 896-pixel images in 14-pixel patches) and its 256-token projection to 2560, random
  normal weights, written as the converter writes it in F16 (``testing/vision_gguf.py``).

Each server in turn (never both at once: the machine is small) serves the pair with ``-c 4096
-np 1``; one ``/completion`` with an 896x896 image (256 image tokens) and 4 greedy tokens; then
``VmRSS``, ``RssAnon``, ``RssFile`` and the peak ``VmHWM`` of its process. Prints a Markdown table.

    .venv/bin/python scripts/bench_vision_rss.py [--layers 12] [--work /tmp/vision-rss]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

PEER = Path(os.environ.get("LLAMA_PEER", Path.home() / ".cache/llama-peer/llama.cpp"))
# Gemma 3 4B's text layer and the SigLIP-So400m tower of its vision config.
GEMMA3_4B_TEXT = dict(hidden_size=2560, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                      intermediate_size=10240, query_pre_attn_scalar=256, sliding_window=1024)
SIGLIP_SO400M = dict(model_type="siglip_vision_model", num_hidden_layers=27, hidden_size=1152, intermediate_size=4304,
                     num_attention_heads=16, patch_size=14, image_size=896, num_channels=3, layer_norm_eps=1e-6)
MARKER = "<__media__>"


def text_gguf(out: Path, layers: int) -> Path:
    from mlxcel_compat.testing import vision
    from mlxcel_compat.testing.gguf_random import write_random_gguf

    if out.is_file():
        return out
    directory = vision.ensure_vision_model(out.parent / "models", "gemma3")  # its tokenizer holds the image tokens
    types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    dims = dict(GEMMA3_4B_TEXT, num_hidden_layers=layers, layer_types=types, vocab_size=vision.vocab_size("gemma3"))
    tmp = out.with_suffix(".tmp")
    write_random_gguf(tmp, "gemma3_text", dims, "q4_k_m", model_dir=directory)
    tmp.replace(out)
    return out


def mmproj_gguf(out: Path, text_width: int) -> Path:
    """The So400m tower and Gemma 3's projector, F16, as the converter writes them."""
    from mlxcel_compat.testing import vision
    from mlxcel_compat.testing.vision_gguf import write_mmproj_gguf

    if out.is_file():
        return out
    source = vision.ensure_vision_model(out.parent / "models", "gemma3")
    directory = out.parent / "so400m-config"
    directory.mkdir(exist_ok=True)
    config = dict(json.loads((source / "config.json").read_text()), vision_config=SIGLIP_SO400M, hidden_size=text_width,
                  mm_tokens_per_image=256)
    config["text_config"] = dict(config["text_config"], hidden_size=text_width, mm_tokens_per_image=256)
    (directory / "config.json").write_text(json.dumps(config))
    processor = dict(json.loads((source / "preprocessor_config.json").read_text()), image_seq_length=256,
                     size={"height": 896, "width": 896})
    (directory / "preprocessor_config.json").write_text(json.dumps(processor))
    weights = so400m_weights(SIGLIP_SO400M, text_width)
    tmp = out.with_suffix(".tmp")
    write_mmproj_gguf("gemma3", directory, weights, tmp, "f16")
    tmp.replace(out)
    return out


def so400m_weights(vision: dict, text_width: int) -> dict[str, np.ndarray]:
    """mlx-vlm's Gemma 3 tower and projector parameters at these sizes: normal, 1/sqrt(fan-in)."""
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args

    text = {"model_type": "gemma3_text", "hidden_size": text_width, "num_hidden_layers": 1, "intermediate_size": 8,
            "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 8, "vocab_size": 8,
            "mm_tokens_per_image": 256}
    config = {"model_type": "gemma3", "text_config": text, "vision_config": vision, "mm_tokens_per_image": 256,
              "hidden_size": text_width}
    module, _ = get_model_and_args(config)
    model_config = module.ModelConfig.from_dict(config)
    model_config.vision_config = module.VisionConfig.from_dict(vision)
    model_config.text_config = module.TextConfig.from_dict(text)
    model = module.Model(model_config)  # its arrays are lazy: only their shapes are read
    shapes = {k: tuple(v.shape) for k, v in tree_flatten(model.parameters()) if not k.startswith("language_model.")}
    rng = np.random.default_rng(52)
    out = {}
    for name, shape in sorted(shapes.items()):
        if len(shape) == 1:
            out[name] = np.zeros(shape, np.float32) if name.endswith("bias") else np.ones(shape, np.float32)
        else:
            fan_in = int(np.prod(shape[1:])) if "patch_embedding" in name else shape[-1]
            out[name] = rng.standard_normal(shape, dtype=np.float32) * np.float32(fan_in ** -0.5)
    return out


def image_b64() -> str:
    from PIL import Image

    pixels = np.random.default_rng(7).integers(0, 255, (896, 896, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return base64.b64encode(out.getvalue()).decode()


def status(pid: int) -> dict[str, int]:
    """``/proc/PID/status`` memory lines, MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) // 1024
    return out


def measure(command: list[str], env: dict[str, str], prompt: str) -> dict[str, float]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([*command, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        start = time.time()
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited: {(proc.stderr.read() if proc.stderr else '')[-600:]}")
                if time.time() - start > 3600:  # the load's warm-up runs the 400M tower once
                    raise RuntimeError("server did not become healthy")
                time.sleep(0.5)
        loaded = time.time() - start
        at_health = status(proc.pid)
        body = {"prompt": {"prompt_string": prompt, "multimodal_data": [image_b64()]}, "n_predict": 4,
                "temperature": 0, "cache_prompt": False}
        request = urllib.request.Request(base + "/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        t0 = time.time()
        with urllib.request.urlopen(request, timeout=1800) as r:
            reply = json.loads(r.read())
        after = status(proc.pid)
        return dict(load_s=loaded, request_s=time.time() - t0, health=at_health["VmRSS"], **after,
                    prompt_tokens=reply.get("tokens_evaluated") or reply.get("timings", {}).get("prompt_n", 0))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12, help="text layers kept of Gemma 3 4B's 34")
    parser.add_argument("--work", default="/tmp/vision-rss", help="where the pair is written (kept for re-runs)")
    parser.add_argument("--servers", default="llama-server,ours")
    parser.add_argument("--root", default=str(ROOT), help="the checkout whose package 'ours' runs (an older one: before)")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    text = text_gguf(work / f"gemma3-4b-shaped-{args.layers}l-Q4_K_M.gguf", args.layers)
    mmproj = mmproj_gguf(work / "mmproj-gemma3-so400m-F16.gguf", GEMMA3_4B_TEXT["hidden_size"])
    sizes = f"text {text.stat().st_size / 2**20:.0f} MiB + projector {mmproj.stat().st_size / 2**20:.0f} MiB"
    common = ["-m", str(text), "--mmproj", str(mmproj), "-c", "4096", "-np", "1"]
    commands = {"llama-server": ([str(PEER / "build/bin/llama-server"), *common, "--no-warmup"],
                                 {**os.environ, "LLAMA_MEDIA_MARKER": MARKER}),
                "ours": ([sys.executable, "-m", "mlxcel_compat", *common], {**os.environ, "PYTHONPATH": args.root})}
    results = {}
    for name in args.servers.split(","):
        command, env = commands[name]
        prompt = f"Picture:\n\n{MARKER}\n\nCaption:" if name == "llama-server" else "Picture:<__media__>Caption:"
        if name == "ours":
            prompt = prompt.replace("<__media__>", MARKER)
        results[name] = measure(command, env, prompt)
        print(f"{name}: {results[name]}", flush=True)
    print(f"pair: {sizes} ({args.layers} text layers)")
    print("| server | RSS after one image request | anonymous | file-backed | peak (VmHWM) | RSS at /health | load | request |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['VmRSS']} MiB | {r['RssAnon']} MiB | {r['RssFile']} MiB | {r['VmHWM']} MiB | "
              f"{r['health']} MiB | {r['load_s']:.1f} s | {r['request_s']:.1f} s |")
    if {"ours", "llama-server"} <= results.keys():
        ratio = results["ours"]["VmRSS"] / results["llama-server"]["VmRSS"]
        peak = results["ours"]["VmHWM"] / results["llama-server"]["VmHWM"]
        print(f"\nRSS ours / llama-server's: **{ratio:.2f}x** (peak {peak:.2f}x); goal <= 1.2x: {'met' if ratio <= 1.2 else 'not met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
