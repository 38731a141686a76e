"""``tokenizer/json_load.py``: a BPE ``tokenizer.json`` built from its parsed parts is the very
tokenizer ``Tokenizer.from_file`` reads: its whole state (vocabulary, merges by rank, added
tokens and their ids, options, normalizer, pre-tokenizer, post-processor, decoder) serializes to
the same JSON, and it encodes and decodes alike. Files the lean path does not take (no BPE,
added tokens outside the vocabulary, merges as "a b" strings) are read by ``from_file``."""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from mlxcel_compat.tokenizer.json_load import bpe_parts, read_tokenizer

TEXTS = ["Hello world", "  two  spaces\n\nand lines", "<start_of_turn>user\nhi<end_of_turn>", "naïve café 東京 🙂",
         "<unused1>x<unused0>", ""]


def sentencepiece_like(added_in_vocab: bool = True) -> Tokenizer:
    """A Gemma-shaped BPE (byte fallback, "▁" spaces, control tokens in the vocabulary)."""
    base = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<unused0>", "<unused1>"]
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    letters = sorted(set("Helowrdtspacnix\nuyïéf東京"))
    vocab = {text: i for i, text in enumerate(base + bytes_ + ["▁"] + letters)}
    merges = []
    for a, b in [("H", "e"), ("l", "l"), ("He", "ll"), ("Hell", "o"), ("▁", "w"), ("o", "r"), ("▁w", "or"),
                 ("l", "d"), ("▁wor", "ld"), ("\n", "\n"), ("▁", "▁"), ("t", "w"), ("tw", "o"), ("▁", "s")]:
        vocab.setdefault(a + b, len(vocab))
        merges.append((a, b))
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    specials = base if added_in_vocab else [*base, "<extra_outside>"]
    tok.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in specials])
    return tok


def saved(tok: Tokenizer, path: Path) -> Path:
    tok.save(str(path))
    return path


def assert_same(path: Path) -> None:
    lean, reference = read_tokenizer(path), Tokenizer.from_file(str(path))
    assert lean.to_str() == reference.to_str()
    for text in TEXTS:
        ids = reference.encode(text).ids
        assert lean.encode(text).ids == ids
        assert lean.decode(ids, skip_special_tokens=False) == reference.decode(ids, skip_special_tokens=False)
    assert lean.get_added_tokens_decoder().keys() == reference.get_added_tokens_decoder().keys()


def test_bpe_is_built_from_parts_and_equals_from_file(tmp_path: Path) -> None:
    path = saved(sentencepiece_like(), tmp_path / "tokenizer.json")
    data = orjson.loads(path.read_bytes())
    parts = bpe_parts(data)
    assert parts is not None  # the lean path is taken
    vocab, merges, options = parts
    assert len(vocab) > 280 and len(merges) == 14 and options["byte_fallback"] is True
    assert set(data["model"]["vocab"]) == {t["content"] for t in data["added_tokens"]} and data["model"]["merges"] == []
    assert_same(path)


@pytest.mark.parametrize("case", ["added outside the vocabulary", "merges as strings", "not BPE"])
def test_other_files_are_read_as_they_are(tmp_path: Path, case: str) -> None:
    path = tmp_path / "tokenizer.json"
    if case == "added outside the vocabulary":
        saved(sentencepiece_like(added_in_vocab=False), path)
    elif case == "merges as strings":
        data = json.loads(saved(sentencepiece_like(), path).read_text())
        data["model"]["merges"] = [f"{a} {b}" for a, b in data["model"]["merges"]]
        path.write_text(json.dumps(data, ensure_ascii=False))
    else:
        tok = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "world": 2}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        saved(tok, path)
    assert bpe_parts(orjson.loads(path.read_bytes())) is None
    assert_same(path)
