"""A factory GGUF whose vocabulary has 150K entries or more, for the memory bound of large vocabularies.

Real models with large vocabularies (Qwen's 152K, Gemma 3's 262K) cost memory wherever a server
builds something per vocabulary entry: the tokenizer's own tables, a table of every token's text,
the whole tokenizer definition parsed into Python objects, logits of every entry for every row of
a prompt chunk. The factory's families share an 8K vocabulary, which hides all of that; this file
does not. It is a one-layer llama (hidden size 64) whose token embedding, tied to the output head,
is Q8_0 like the real files' (the CPU serves it from its blocks), with a byte-level BPE vocabulary
of ``LARGE_VOCAB`` entries and their merges (``tokenizer.large_tokenizer_json``: the factory's
trained 8K vocabulary grown by merges of its pieces), its ChatML tokens at the last ids as in real
checkpoints, and the factory's chat template. Random weights from a fixed seed.

Building the vocabulary takes tens of seconds, so the file is cached like every factory output
(``cache_dir.default_cache_dir``, or the caller's), written beside its target and renamed into place.
``python -m mlxcel_compat.testing.large_vocab [--out FILE]`` builds it and prints its path.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from .cache_dir import default_cache_dir
from .chatml import chat_template

LARGE_VOCAB = 152_064  # Qwen2's vocabulary size
FORMAT_VERSION = 1
SEED = 151
DIMS = {"hidden": 64, "ffn": 128, "heads": 4, "kv_heads": 2, "context": 2048}


def ensure_large_vocab_gguf(cache_dir: str | Path | None = None, vocab_size: int = LARGE_VOCAB) -> Path:
    """The large-vocabulary GGUF in ``cache_dir`` (default: the factory's cache), built on first use."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"llama-vocab{vocab_size}-v{FORMAT_VERSION}-q8_0.gguf"
    if target.is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=root)
    os.close(fd)
    try:
        write_large_vocab_gguf(Path(tmp_name), vocab_size)
        os.chmod(tmp_name, 0o644)
        os.replace(tmp_name, target)
    finally:
        Path(tmp_name).unlink(missing_ok=True)
    return target


def write_large_vocab_gguf(path: Path, vocab_size: int = LARGE_VOCAB) -> None:
    """Write the file (see the module's docstring) to ``path``."""
    import gguf
    from gguf import GGMLQuantizationType as T

    from .tokenizer import ENDOFTEXT, IM_END, IM_START, large_tokenizer_json

    spec = json.loads(large_tokenizer_json(vocab_size))
    vocab: dict[str, int] = spec["model"]["vocab"]
    tokens = [""] * vocab_size
    types = [int(gguf.TokenType.NORMAL)] * vocab_size
    for text, index in vocab.items():
        tokens[index] = text
    ids = {}
    for added in spec["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = int(gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED)
        ids[added["content"]] = added["id"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    del spec, vocab

    d = DIMS
    head_dim = d["hidden"] // d["heads"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("factory llama, large vocabulary")
    writer.add_context_length(d["context"])
    writer.add_embedding_length(d["hidden"])
    writer.add_block_count(1)
    writer.add_feed_forward_length(d["ffn"])
    writer.add_head_count(d["heads"])
    writer.add_head_count_kv(d["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(ids[IM_END])
    writer.add_pad_token_id(ids[ENDOFTEXT])
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template(thinking=False))
    assert IM_START in ids

    rng = np.random.default_rng(SEED)

    def q8_0(shape: tuple[int, int], scale: float) -> tuple[np.ndarray, T]:
        values = (scale * rng.standard_normal(shape)).astype(np.float32)
        return gguf.quants.quantize(values, T.Q8_0), T.Q8_0

    def add(name: str, data: np.ndarray, kind: T | None = None) -> None:
        writer.add_tensor(name, data, raw_dtype=kind)

    h, f, kv = d["hidden"], d["ffn"], d["kv_heads"] * head_dim
    add("token_embd.weight", *q8_0((vocab_size, h), 1.0))  # tied: no output.weight, as Gemma's and Qwen's small files
    add("output_norm.weight", np.ones(h, np.float32))
    add("blk.0.attn_norm.weight", np.ones(h, np.float32))
    add("blk.0.ffn_norm.weight", np.ones(h, np.float32))
    for name, shape in (("attn_q", (h, h)), ("attn_k", (kv, h)), ("attn_v", (kv, h)), ("attn_output", (h, h)),
                        ("ffn_gate", (f, h)), ("ffn_up", (f, h)), ("ffn_down", (h, f))):
        add(f"blk.0.{name}.weight", *q8_0(shape, 0.2))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build the factory's large-vocabulary GGUF.")
    parser.add_argument("--out", help="write it here instead of the factory's cache")
    parser.add_argument("--vocab", type=int, default=LARGE_VOCAB)
    args = parser.parse_args(argv)
    if args.out:
        write_large_vocab_gguf(Path(args.out), args.vocab)
        print(args.out)
    else:
        print(ensure_large_vocab_gguf(vocab_size=args.vocab))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
