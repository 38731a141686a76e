#!/usr/bin/env python3
"""Cross-check ``-lcs`` files against llama.cpp's own writer (``--spec-type ngram-cache``).

llama.cpp's ``llama-lookup-create`` (examples/lookup, compiled here from the peer tree that
``../shared/peers/build-llama-server.sh`` unpacks, against its built libraries) writes a static
lookup cache of a text: the bigram counts of its tokens. This script has it write one for the
edit workload's files (``bench_speculative.EDITS``), reads it with ``engine.ngram_cache.load``,
and compares the counts with those of the same text tokenized by our server (``/tokenize``,
special tokens added as llama.cpp's tool adds them). Then it serves the file
(``--spec-type ngram-cache -lcs FILE``) and asks for the first file back: the answer must be
plain decoding's, with drafts.

    scripts/check_lookup_cache.py [--llama-cpp DIR] [--model FILE.gguf]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_speculative as bench  # noqa: E402

PEER = Path(os.environ.get("LLAMA_PEER", Path.home() / ".cache/llama-peer/llama.cpp"))


def lookup_create(tree: Path, out: Path) -> Path:
    """llama.cpp's lookup-create, compiled once against the peer build's libraries."""
    if out.exists():
        return out
    libs = tree / "build" / "bin"
    subprocess.run(["g++", "-O1", "-std=c++17", "-I", str(tree / "include"), "-I", str(tree / "common"),
                    "-I", str(tree / "ggml" / "include"), "-I", str(tree / "vendor"),
                    str(tree / "examples" / "lookup" / "lookup-create.cpp"), "-o", str(out), "-L", str(libs),
                    "-lllama-common", "-lllama", "-lggml", "-lggml-base", f"-Wl,-rpath,{libs}"], check=True)
    return out


def main() -> int:
    from mlxcel_compat.engine.ngram_cache import load
    from mlxcel_compat.testing.real_model import ensure_real_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", default=str(PEER), help="the llama.cpp tree with build/bin (the peer build)")
    parser.add_argument("--model", help="GGUF (default: SmolLM2-135M-Instruct Q4_1)")
    args = parser.parse_args()
    tree, model = Path(args.llama_cpp), Path(args.model) if args.model else ensure_real_model()
    work = Path(tempfile.mkdtemp(prefix="lookup-cache-"))
    tool = lookup_create(tree, work / "llama-lookup-create")
    text = "".join(edit.text for edit in bench.EDITS)
    (work / "corpus.txt").write_text(text)
    static = work / "static.bin"
    # --no-escape: llama.cpp's tools turn a prompt's "\\n" into a newline by default (the files hold "\\n")
    subprocess.run([str(tool), "-m", str(model), "-f", str(work / "corpus.txt"), "--no-escape", "-lcs", str(static)],
                   check=True, capture_output=True)
    cache = load(static)
    cmd, port = bench.ours(model, [])
    server = bench.start("plain", cmd, port)
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as http:
            # -f drops one trailing newline from what it reads
            read = text[:-1] if text.endswith("\n") else text
            body = {"content": read, "add_special": True, "parse_special": True}
            tokens = http.post("/tokenize", json=body).json()["tokens"]
    finally:
        server.stop()
    expected: dict[tuple[int, ...], Counter] = {}
    for i in range(2, len(tokens)):
        expected.setdefault(tuple(tokens[i - 2:i]), Counter())[tokens[i]] += 1
    got = {key: Counter(part.counts) for key, part in cache.items()}
    same = got == expected
    print(f"{static.stat().st_size} bytes, {len(cache)} bigrams read; the counts of our tokenization "
          f"({len(tokens)} tokens): {'equal' if same else 'DIFFERENT'}")
    answers = {}
    for name, extra in (("plain", []), ("ngram-cache -lcs", ["--spec-type", "ngram-cache", "-lcs", str(static)])):
        cmd, port = bench.ours(model, extra)
        server = bench.start(name, cmd, port)
        try:
            prompt = bench.edit_prompt(server, bench.EDITS[0])
            answers[name] = bench.completion(server, {"prompt": prompt, "n_predict": 128, "temperature": 0,
                                                      "cache_prompt": False})
        finally:
            server.stop()
    timings = answers["ngram-cache -lcs"]["timings"]
    same_text = answers["plain"]["content"] == answers["ngram-cache -lcs"]["content"]
    print(f"served with -lcs: drafted {timings.get('draft_n', 0)}, accepted {timings.get('draft_n_accepted', 0)}; "
          f"text equal to plain decoding's: {same_text}")
    return 0 if same and same_text and timings.get("draft_n", 0) > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
