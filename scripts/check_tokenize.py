#!/usr/bin/env python
"""Side by side: ``/tokenize`` of llama-server and of this server on the same GGUF.

Both servers start on the file (the peer build ``~/.cache/llama-peer/llama.cpp/build/bin/llama-server``
and ``python -m mlxcel_compat``), each gets every text of ``TEXTS`` (whitespace runs, newlines, code
indentation, special tokens of the common chat formats, emoji and other multi-byte text) with
``add_special`` false and true, and the token ids are compared. A mismatch prints both servers'
tokens as ``id:piece``. Exit status 0 when every text gave the same ids.

Usage::

    .venv/bin/python scripts/check_tokenize.py FILE.gguf [FILE.gguf ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchlib import ROOT, ServerProcess, free_port  # noqa: E402

LLAMA_SERVER = Path.home() / ".cache/llama-peer/llama.cpp/build/bin/llama-server"
SERVER_ARGS = ["-c", "512", "-np", "1"]

TEXTS: list[str] = [
    "Hello world", " Hello", "  two leading spaces", "trailing spaces   ", " ", "  ", "   ", "\t", "\t\t x",
    "\n", "\n\n", "\n\n\n", "\n\n\n\n\n\n", "a\nb", "a\n\nb", "a\n\n\nb", " \n \n", "\r\n", "\r\n\r\n", "x \n\n y",
    "def f(x):\n    if x:\n        return 1\n\n    return 2\n",
    "class A:\n\tdef g(self):\n\t\tpass\n\n\n# end\n",
    "{\n  \"a\": [1, 2],\n  \"b\": {\"c\": null}\n}",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi\n\nthere<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<|endoftext|>",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "<bos><eos><pad> plain", "<think>\nhmm\n</think>\n\nanswer",
    "emoji 🚀🙂👍🏽👨‍👩‍👧 done", "café naïve Ŵ ☃ 𝔘", "你好，世界。\n\n日本語のテキスト", "Привет мир", "مرحبا بالعالم",
    "12345 3.14159 1,000,000", "!!!??? ... --- ***", "\u00a0non-breaking\u2003em-space", "tab\there\tand\tthere",
    "mixed   \t \n\n\t  whitespace\n\n\n\n  end",
]


def tokenize(client: httpx.Client, url: str, text: str, add_special: bool) -> list[tuple[int, Any]] | str:
    """``[(id, piece)]`` from ``/tokenize``, or the error text."""
    response = client.post(url + "/tokenize", json={"content": text, "add_special": add_special, "with_pieces": True})
    if response.status_code != 200:
        return f"{response.status_code}: {response.text[:200]}"
    return [(token["id"], token["piece"]) for token in response.json()["tokens"]]


def check(model: Path, python: str) -> int:
    """Start both servers on ``model``, compare every text; the number of mismatches."""
    port = free_port()
    peer = ServerProcess([str(LLAMA_SERVER), "--host", "127.0.0.1", "--port", str(port), "-m", str(model), *SERVER_ARGS],
                         port, name="llama-server")
    ours = ServerProcess.mlxcel(model, SERVER_ARGS, python=python, name="mlxcel", cwd=ROOT)
    mismatches = 0
    try:
        for server in (peer, ours):
            server.start()
        for server in (peer, ours):
            try:
                server.wait_healthy(300)
            except RuntimeError as exc:
                print(f"{model.name}: {server.name} did not start: {str(exc).splitlines()[0]}\n{server.tail(5)}")
                return 1
        with httpx.Client(timeout=60) as client:
            for text in TEXTS:
                for add_special in (False, True):
                    theirs = tokenize(client, peer.base_url, text, add_special)
                    mine = tokenize(client, ours.base_url, text, add_special)
                    ids = [[i for i, _ in side] if isinstance(side, list) else side for side in (theirs, mine)]
                    if ids[0] != ids[1]:
                        mismatches += 1
                        print(f"MISMATCH {text!r} add_special={add_special}\n  llama-server: {theirs}\n  mlxcel:       {mine}")
    finally:
        for server in (peer, ours):
            server.stop(grace=5)
    total = 2 * len(TEXTS)
    print(f"{model.name}: {total - mismatches} of {total} tokenizations the same")
    return mismatches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("models", nargs="+", type=Path, help="GGUF files")
    parser.add_argument("--python", default=sys.executable, help="the Python that runs this server")
    args = parser.parse_args(argv)
    if not LLAMA_SERVER.exists():
        print(f"llama-server not found at {LLAMA_SERVER}", file=sys.stderr)
        return 2
    failed = sum(check(model.resolve(), args.python) for model in args.models)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
