#!/usr/bin/env python3
"""Work that grows with the vocabulary or the disk cache's directory, timed in one process.

No request may hold the engine thread (or a worker thread) for long (docs/architecture.md). Three
kinds of work still scan something whole, and this script times each on a factory tokenizer
(``--vocab`` tokens, default 150,000) or a temporary cache directory (``--files`` entries):

* ``dry``: mapping DRY sequence breakers to token sequences (``dry_sequence_breakers``, a worker
  thread, cached per breaker list): llama.cpp's default four, and 32 random 40-character breakers
  (what a hostile client may send); plus the one-off byte table it searches (``VocabText``).
* ``infill``: the infill sampler's prefix merge over the whole vocabulary (no top-k before it),
  once per generated token on the engine thread; plus the one-off piece index.
* ``refresh``: the disk index's look at a directory another server changed
  (``DiskIndex.refresh``, engine thread, before a disk lookup): relisting ``--files`` known files,
  and the one ``stat`` when nothing changed.

Medians of ``--reps``. Example::

    .venv/bin/python scripts/bench_scans.py
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from benchlib import ROOT

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def median_ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1000.0


def once_ms(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000.0


def vocabulary_parts(args: argparse.Namespace) -> None:
    import numpy as np
    import tokenizers
    from transformers import PreTrainedTokenizerFast

    from mlxcel_compat.engine.sampling import dry
    from mlxcel_compat.engine.sampling.candidates import softmax_np
    from mlxcel_compat.engine.sampling.infill_pieces import merge_prefix_pieces, piece_index
    from mlxcel_compat.engine.textstream import derived, vocab_table
    from mlxcel_compat.testing.tokenizer import large_tokenizer_json

    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizers.Tokenizer.from_str(large_tokenizer_json(args.vocab)))
    print(f"vocabulary: {len(tok)} tokens (factory); byte table set-up (token strings) {once_ms(lambda: vocab_table(tok).raw(0)):.0f} ms")
    if "dry" in args.parts:
        rng = random.Random(1)
        hostile = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz ,.:\n\"*é→") for _ in range(40)) for _ in range(32)]
        print(f"dry: byte search table (once per tokenizer) {once_ms(lambda: derived(tok, 'vocab text', dry.VocabText.of)):.0f} ms")
        for label, breakers in (("llama.cpp's default 4", ["\n", ":", '"', "*"]), ("32 random, 40 characters", hostile)):
            def run(breakers=breakers) -> None:
                dry.breakers_by_tokenizer.clear()  # time the mapping, not the cache
                dry.dry_sequence_breakers(tok, breakers)
            print(f"dry: {label}: {median_ms(run, args.reps):.0f} ms")
    if "infill" in args.parts:
        print(f"infill: piece index (once per tokenizer) {once_ms(lambda: piece_index(tok)):.0f} ms")
        index = piece_index(tok)
        rng = np.random.default_rng(0)
        ids = np.argsort(-rng.normal(size=len(tok)), kind="stable")
        probs = np.sort(softmax_np(rng.normal(size=len(tok)) * 3))[::-1].copy()
        logits = np.log(probs)
        ms = median_ms(lambda: merge_prefix_pieces(index, ids, logits.copy(), probs.copy()), args.reps)
        print(f"infill: prefix merge over the whole vocabulary, a step: {ms:.0f} ms")


def refresh_part(args: argparse.Namespace) -> None:
    import os

    from mlxcel_compat.cache.disk_directory import entry_name
    from mlxcel_compat.cache.disk_format import Compat, EntryHeader
    from mlxcel_compat.cache.disk_index import DiskIndex
    from mlxcel_compat.cache.disk_write import commit, write_temp
    from mlxcel_compat.cache.key import RAW_PROMPT_TEMPLATE_SIG, TEXT_ONLY_MM_DIGEST, Bucket

    compat = Compat(model="m" * 64, runtime="bench")
    bucket = Bucket(model_id="bench", lora_id="", template_sig=RAW_PROMPT_TEMPLATE_SIG, rope_regime=None,
                    mm_digest=TEXT_ONLY_MM_DIGEST, namespace="")
    root = Path(tempfile.mkdtemp(prefix="bench_scans_"))
    writer = DiskIndex(root, compat, 1 << 40, min_prefix=4, apc=None)
    writer.open()
    for i in range(args.files):
        h = EntryHeader(kind="kv", compat=compat, bucket=bucket, session_key=f"s{i}",
                        tokens=tuple(range(i, i + 40)), origin="completion", trimmable=True, nbytes=0, layout={})
        path = writer.directory / entry_name("kv", h.digest)
        commit(write_temp(path, h, []), path)
    reader = DiskIndex(root, compat, 1 << 40, min_prefix=4, apc=None)
    reader.open()
    old = time.time_ns() - 10**10
    os.utime(reader.directory, ns=(old, old))

    def relist() -> None:
        reader.listed_mtime_ns = None  # as if another server had changed the directory
        reader.refresh()

    print(f"refresh: {reader.entries} files indexed; relisting them {median_ms(relist, args.reps):.1f} ms, "
          f"unchanged directory {median_ms(reader.refresh, args.reps * 100) * 1000:.1f} us")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="dry,infill,refresh", help="subset of dry, infill, refresh")
    p.add_argument("--vocab", type=int, default=150_000)
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    args.parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    if args.parts & {"dry", "infill"}:
        vocabulary_parts(args)
    if "refresh" in args.parts:
        refresh_part(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
