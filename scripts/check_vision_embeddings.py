"""Image embeddings: llama-server and this server on the same factory GGUF pair, for the same prompts.

Both servers serve the factory's pair (``python -m mlxcel_compat.testing.vision --format gguf``;
Gemma 3 by default, the ``ggml-org/tinygemma3-GGUF`` stand-in of
``scripts/run_llama_cpp_server_tests.py``) with ``--embeddings --pooling P`` for each pooling of
``--poolings`` (F32 KV, no flash attention on llama-server, as ``scripts/check_mmproj.py`` runs
it). Each prompt, a text around one seeded image (``multimodal_data``, 32x32 PNGs like the tests'
pictures) or a text alone, is embedded by both through ``/embeddings``; the script prints, per
pooling and prompt, the cosine similarity of the two pooled vectors (pooling ``none``: of each
returned row, the lowest shown) and the rows each returned, and the smallest cosine over all.

Both servers pool what follows the prompt's last image (llama-server's last batch: the image is
decoded in batches of its own, not output). llama.cpp wraps a Gemma 3 image as
``<start_of_image>`` ... ``<end_of_image>``, Gemma3Processor (and this server) as
``\\n\\n<start_of_image>`` ... ``<end_of_image>\\n\\n``: llama-server's prompt carries the two
``\\n\\n`` as text (``WRAP``), so both sides embed the same tokens. Exits non-zero when a cosine
is below ``--min-cosine``.

    .venv/bin/python scripts/check_vision_embeddings.py [--family gemma3] [--poolings mean,last,none]
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from scripts.benchlib import ServerProcess, free_port, mlxcel_cmd  # noqa: E402

PEER = Path(os.environ.get("LLAMA_PEER", Path.home() / ".cache/llama-peer/llama.cpp"))
MARKER = "<__media__>"
WRAP = {"gemma3": ("\n\n", "\n\n")}  # what llama-server's prompt adds around the marker (see above)
PROMPTS = (("What is this: <__media__>Caption:", 1), ("What is this: <__media__>Caption:", 2),
           ("<__media__>A picture of", 3), ("Describe <__media__>in one word.", 4), ("What is this: \n", None))


def png(seed: int) -> str:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return base64.b64encode(out.getvalue()).decode()


def body(text: str, seed: int | None, wrap: tuple[str, str]) -> dict:
    if seed is None:
        return {"prompt_string": text}
    return {"prompt_string": text.replace(MARKER, wrap[0] + MARKER + wrap[1]), "multimodal_data": [png(seed)]}


def embed(base_url: str, text: str, seed: int | None, wrap: tuple[str, str]) -> np.ndarray:
    r = httpx.post(base_url + "/embeddings", json={"content": [body(text, seed, wrap)]}, timeout=300)
    r.raise_for_status()
    return np.asarray(r.json()[0]["embedding"], dtype=np.float64)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="gemma3")
    ap.add_argument("--gguf-type", default="q8_0")
    ap.add_argument("--poolings", default="mean,last,none")
    ap.add_argument("--min-cosine", type=float, default=0.99)
    ap.add_argument("--cache", default=os.environ.get("MLXCEL_TEST_MODEL_CACHE", str(Path(tempfile.gettempdir()) / "mlxcel-models")))
    ap.add_argument("--start-timeout", type=float, default=300.0)
    args = ap.parse_args()
    from mlxcel_compat.testing.vision import ensure_vision_gguf

    text, mmproj = ensure_vision_gguf(args.cache, args.family, gguf_type=args.gguf_type)
    wrap = WRAP.get(args.family, ("", ""))
    worst = 1.0
    print(f"pair: {text.name} + {mmproj.name}")
    print("| pooling | prompt | image | rows (llama-server / ours) | cosine |\n|---|---|---|---|---|")
    for pooling in args.poolings.split(","):
        flags = ["--embeddings", "--pooling", pooling, "-c", "2048", "-np", "1", "-b", "512", "-ub", "512"]
        peer_port = free_port()
        peer = ServerProcess([str(PEER / "build/bin/llama-server"), "-m", str(text), "--mmproj", str(mmproj), *flags,
                              "--no-warmup", "-ctk", "f32", "-ctv", "f32", "-fa", "off", "--port", str(peer_port)],
                             peer_port, name="llama-server", env={"LLAMA_MEDIA_MARKER": MARKER})
        our_port = free_port()
        ours = ServerProcess(mlxcel_cmd(text, our_port, ["--mmproj", str(mmproj), *flags]), our_port, name="mlxcel")
        try:
            for server in (peer, ours):
                server.start()
            for server in (peer, ours):
                server.wait_healthy(args.start_timeout)
            for prompt, seed in PROMPTS:
                theirs, mine = embed(peer.base_url, prompt, seed, wrap), embed(ours.base_url, prompt, seed, ("", ""))
                if theirs.shape != mine.shape:
                    print(f"| {pooling} | {prompt!r} | {seed} | {theirs.shape[0]} / {mine.shape[0]} | rows differ |")
                    worst = -1.0
                    continue
                value = min(cosine(a, b) for a, b in zip(theirs, mine))
                worst = min(worst, value)
                print(f"| {pooling} | {prompt!r} | {seed if seed is not None else '-'} | {theirs.shape[0]} / {mine.shape[0]} | {value:.6f} |")
        finally:
            for server in (peer, ours):
                server.stop()
    print(f"\nsmallest cosine: {worst:.6f} (threshold {args.min_cosine})")
    return 0 if worst >= args.min_cosine else 1


if __name__ == "__main__":
    sys.exit(main())
