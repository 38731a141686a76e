"""Read a ``tokenizer.json`` into a ``tokenizers.Tokenizer`` without the Rust parser's detours.

``Tokenizer.from_file`` parses the model section three times over (serde's untagged and
flattened enums buffer it as generic trees before the BPE model is built from them) and builds
the model's vocabulary while those trees are alive, so its freed memory is left in holes between
blocks the vocabulary keeps. On a 262,144-token vocabulary with 515K merges (Gemma 3) that is a
peak of +355 MiB and 94 MiB held after ``malloc_trim``, for ~68 MiB in use.

A BPE model is therefore built here from the parsed JSON instead: the file's other parts
(normalizer, pre-tokenizer, post-processor, decoder, added tokens) through
``Tokenizer.from_str`` with a model that holds only the added tokens' vocabulary entries (so
every added token gets the id it gets from the whole vocabulary), then the BPE model from the
vocabulary and merges with the file's options, put in its place. The result serializes to the
same JSON as ``from_file``'s (``tests/tokenizer/test_json_load.py``): the same tokenizer, held
in ~68 MiB on Gemma 3. The file is parsed by the standard library's ``json``: orjson keeps short
dict keys in a process-wide cache, and those few hundred vocabulary strings pinned ~9 MiB of the
interpreter's arenas that the freed parse had used. Any other file, or a BPE whose added tokens are not all in its vocabulary
at their ids (``from_str`` would number those from the shell's vocabulary size), is read by
``from_file``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import json

import orjson
from tokenizers import Tokenizer, models

# BPE options a tokenizer.json states in its model section, passed to ``models.BPE`` when set.
BPE_OPTIONS = ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", "byte_fallback",
               "ignore_merges")


def read_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer ``path`` (a ``tokenizer.json``) describes, as ``Tokenizer.from_file`` reads it."""
    with open(path, "rb") as f:
        data = json.loads(f.read())
    parts = bpe_parts(data)
    if parts is None:
        del data
        return Tokenizer.from_file(str(path))
    vocab, merges, options = parts
    try:
        shell = Tokenizer.from_str(orjson.dumps(data).decode())
    except Exception:  # the file as it is tells what is wrong with it, or reads after all
        return Tokenizer.from_file(str(path))
    del data
    for i, pair in enumerate(merges):  # in place: the lists go as their tuples come
        merges[i] = tuple(pair)
    model = models.BPE(vocab, merges, **options)
    del vocab, merges
    shell.model = model
    return shell


def bpe_parts(data: dict[str, Any]) -> tuple[dict[str, int], list[Any], dict[str, Any]] | None:
    """Take a BPE model's vocabulary and merges (pairs) out of the parsed ``data``, leaving in it
    a model with only the added tokens' entries; None (``data`` untouched) for anything else."""
    model = data.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE":
        return None
    vocab, merges = model.get("vocab"), model.get("merges")
    if not isinstance(vocab, dict) or not isinstance(merges, list):
        return None
    if not all(isinstance(pair, list) and len(pair) == 2 for pair in merges):  # "a b": the older form
        return None
    added = data.get("added_tokens") or []
    if not all(vocab.get(token.get("content")) == token.get("id") for token in added):
        return None
    options = {name: model[name] for name in BPE_OPTIONS if model.get(name) is not None}
    model["vocab"] = {token["content"]: token["id"] for token in added}
    model["merges"] = []
    return vocab, merges, options


__all__ = ["read_tokenizer"]
