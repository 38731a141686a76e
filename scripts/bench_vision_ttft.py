#!/usr/bin/env python3
"""Time to first token of a second turn about the same image against the first turn's (issue 31).

Starts a real server on a vision-language model directory (default: the factory's small
Qwen2.5-VL, ~45M parameters, whose 448x448 image is 256 image tokens, built on first use;
``--factory-size tiny`` for the tests' model, whose processor shrinks every image to at most 16
tokens, so its first turn costs little more than its HTTP round trip), then for each of ``--pairs`` fresh random images sends a first
turn (system text, a question and the image) and a second turn about the same image (the first
turn, its reply and a short new question), both streamed, and reads the time from sending the
request to the first content chunk. The second turn adopts the first turn's KV, image included,
so it prefills only the new message and never runs the vision tower; the image's decoding and
preprocessing are skipped too when the same bytes come again (``server/media.py``'s memo). Prints the
median TTFT of each and their ratio (goal: second <= 0.2 x first).

Examples::

    python scripts/bench_vision_ttft.py                          # small factory VLM, 10 pairs, 448x448 images
    python scripts/bench_vision_ttft.py --model ~/models/Qwen2.5-VL-3B-Instruct --pairs 5 --size 672
    python scripts/bench_vision_ttft.py --gguf q8_0                # the small factory VLM as a GGUF pair (--mmproj)
    python scripts/bench_vision_ttft.py --model text.gguf --mmproj mmproj-text-f16.gguf
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import benchlib  # noqa: E402
import httpx  # noqa: E402
import numpy as np  # noqa: E402

SYSTEM = "You are a careful assistant. Describe pictures in plain words, one short sentence at a time."


def image_uri(seed: int, size: int) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def ttft(client: httpx.Client, messages: list[dict]) -> tuple[float, str]:
    """(seconds to the first content chunk, the whole reply) of a streamed greedy chat."""
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, "stream": True}
    t0, first, text = time.perf_counter(), None, []
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
            if delta:
                first = first or time.perf_counter() - t0
                text.append(delta)
    return first or time.perf_counter() - t0, "".join(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a vision-language model directory (default: the factory's Qwen2.5-VL)")
    ap.add_argument("--factory-size", default="small", choices=("tiny", "small"), help="the factory model's size (default small)")
    ap.add_argument("--pairs", type=int, default=10)
    ap.add_argument("--size", type=int, default=448, help="image side in pixels (default 448)")
    ap.add_argument("--mmproj", help="a projector GGUF served with --model (a text GGUF): llama-server's pair")
    ap.add_argument("--gguf", metavar="TYPE", help="serve the factory model's GGUF pair instead of its directory "
                    "(the text GGUF in TYPE: f32, q8_0, q4_k_m, ...; the projector F32)")
    args = ap.parse_args(argv)
    from mlxcel_compat.testing.vision import ensure_vision_gguf, ensure_vision_model

    extra = ["--mmproj", args.mmproj] if args.mmproj else []
    if args.gguf and not args.model:
        text, mmproj = ensure_vision_gguf(family="qwen2_5_vl", size=args.factory_size, gguf_type=args.gguf)
        model, extra = str(text), ["--mmproj", str(mmproj)]
    else:
        model = args.model or str(ensure_vision_model(family="qwen2_5_vl", size=args.factory_size))
    server = benchlib.ServerProcess.mlxcel(model, ["-np", "1", "--prompt-cache-min-prefix", "8", *extra], name="vision")
    server.start()
    try:
        server.wait_healthy(180)
        firsts, seconds = [], []
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            ttft(client, [{"role": "user", "content": "warm up"}])
            for i in range(args.pairs):
                turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": [
                    {"type": "text", "text": "What is in this picture?"},
                    {"type": "image_url", "image_url": {"url": image_uri(1000 + i, args.size)}}]}]
                t1, reply = ttft(client, turn)
                turn2 = turn + [{"role": "assistant", "content": reply}, {"role": "user", "content": "And the colours?"}]
                t2, _ = ttft(client, turn2)
                firsts.append(t1)
                seconds.append(t2)
        f, s = statistics.median(firsts), statistics.median(seconds)
        print(f"model {model}{' + ' + extra[1] if extra else ''}, {args.pairs} pairs, {args.size}x{args.size} images")
        print(f"TTFT first turn  median {f * 1000:.1f} ms")
        print(f"TTFT second turn median {s * 1000:.1f} ms")
        print(f"ratio {s / f:.3f} (goal <= 0.2): {'met' if s <= 0.2 * f else 'not met'}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    benchlib.run(main)
