"""Tests for streaming detokenization with llama-server stop-string semantics.

A small byte-level BPE is trained in a fixture, so every byte has its own token
(multi-byte characters can be split across tokens) and a few words are merged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mlxcel_compat.engine.textstream import (
    StreamPiece,
    TextStream,
    complete_utf8_length,
    token_bytes,
    token_piece,
)

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "STOP here and there. Hello again, world.",
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from mlx_lm.tokenizer_utils import load
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    path: Path = tmp_path_factory.mktemp("bpe")
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return load(path)


def tid(tokenizer, piece: str) -> int:
    """Id of a single vocabulary entry (byte-level spelling, e.g. 'Ġworld')."""
    token_id = tokenizer.convert_tokens_to_ids(piece)
    assert token_id is not None and token_id != tokenizer.unk_token_id
    return token_id


def byte_ids(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte, so characters can be split across tokens."""
    from mlx_lm.tokenizer_utils import _byte_decoder

    to_char = {b: ch for ch, b in _byte_decoder().items()}
    return [tid(tokenizer, to_char[b]) for b in text.encode("utf-8")]


def push_all(stream: TextStream, ids: list[int]) -> list[StreamPiece]:
    return [stream.push(i) for i in ids]


def test_token_helpers(tokenizer):
    eos = tid(tokenizer, "<|endoftext|>")
    assert token_bytes(tokenizer, tid(tokenizer, "Ġworld")) == b" world"
    assert token_bytes(tokenizer, eos) == b"<|endoftext|>"
    assert token_bytes(tokenizer, eos, special=False) == b""
    assert token_piece(tokenizer, eos, special=False) == ""
    first_emoji_byte = byte_ids(tokenizer, "😀")[0]
    assert token_bytes(tokenizer, first_emoji_byte) == b"\xf0"
    assert token_piece(tokenizer, first_emoji_byte) == ""  # incomplete char cut off
    assert token_bytes(tokenizer, 10**6) == b""  # padded vocab id
    assert complete_utf8_length(b"ab\xe4\xb8") == 2
    assert complete_utf8_length("ab中".encode()) == 5


def test_no_stop_strings_streams_exact_text(tokenizer):
    text = " Hello world! 😀 中文 and  two  spaces"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = TextStream(tokenizer, [])
    pieces = push_all(stream, ids)
    # llama.cpp keeps the leading space and sends lone spaces at once
    assert "".join(p.text for p in pieces) + stream.finish() == text
    assert stream.text == text
    assert all("\ufffd" not in p.text for p in pieces)


def test_stop_string_across_two_tokens(tokenizer):
    stream = TextStream(tokenizer, ["lo wor"])
    first = stream.push(tid(tokenizer, "Hello"))
    assert first.text == "" and not first.stopped  # "lo" may start the stop string
    second = stream.push(tid(tokenizer, "Ġworld"))
    assert second == StreamPiece("Hel", stopped=True, stopping_word="lo wor")
    assert stream.text == "Hel" and stream.stopped
    assert stream.push(tid(tokenizer, "!")).text == ""  # nothing after a stop
    assert stream.finish() == ""


def test_stop_string_across_three_tokens(tokenizer):
    stream = TextStream(tokenizer, ["TOP"])
    pieces = push_all(stream, byte_ids(tokenizer, "abcSTOPdef"))
    assert [p.text for p in pieces[:6]] == ["a", "b", "c", "S", "", ""]
    assert pieces[6] == StreamPiece("", stopped=True, stopping_word="TOP")
    assert stream.text == "abcS"


def test_stop_at_the_very_start(tokenizer):
    stream = TextStream(tokenizer, ["Hello"])
    piece = stream.push(tid(tokenizer, "Hello"))
    assert piece == StreamPiece("", stopped=True, stopping_word="Hello")
    assert stream.text == ""


def test_partial_prefix_is_held_then_released(tokenizer):
    stream = TextStream(tokenizer, ["world!"])
    ids = [tid(tokenizer, "Hello"), tid(tokenizer, "Ġworld"), *byte_ids(tokenizer, "?")]
    pieces = push_all(stream, ids)
    assert [p.text for p in pieces] == ["Hello", "", " world?"]
    assert not any(p.stopped for p in pieces)


def test_earliest_stop_string_wins(tokenizer):
    # both match once "d" arrives; "lo world" starts earlier although listed second
    stream = TextStream(tokenizer, ["world", "lo world"])
    pieces = push_all(stream, byte_ids(tokenizer, "Hello world"))
    assert pieces[-1].stopped and pieces[-1].stopping_word == "lo world"
    assert stream.text == "Hel"


def test_multibyte_characters_are_never_split(tokenizer):
    stream = TextStream(tokenizer, [])
    pieces = push_all(stream, byte_ids(tokenizer, "a😀中"))
    assert [p.text for p in pieces] == ["a", "", "", "", "😀", "", "", "中"]
    assert [p.incomplete for p in pieces] == [False, True, True, True, False, True, True, False]
    assert stream.text == "a😀中"


def test_stop_string_with_multibyte_characters(tokenizer):
    stream = TextStream(tokenizer, ["中文"])
    pieces = push_all(stream, byte_ids(tokenizer, "x中文y"))
    assert "".join(p.text for p in pieces) == "x"
    assert pieces[6].stopped and pieces[6].stopping_word == "中文"


def test_finish_flushes_held_text(tokenizer):
    stream = TextStream(tokenizer, ["world!"])
    pieces = push_all(stream, [tid(tokenizer, "Hello"), tid(tokenizer, "Ġworld")])
    assert [p.text for p in pieces] == ["Hello", ""]
    assert stream.held_text == " world"
    assert stream.finish() == " world"
    assert stream.text == "Hello world"
    assert stream.finish() == ""


def test_end_of_generation_token_flushes_held_text(tokenizer):
    eos = tid(tokenizer, "<|endoftext|>")
    stream = TextStream(tokenizer, ["world!"])
    pieces = push_all(stream, [tid(tokenizer, "Hello"), tid(tokenizer, "Ġworld"), eos])
    assert [p.text for p in pieces] == ["Hello", "", " world"]
    special = TextStream(tokenizer, [], special=True)
    assert special.push(eos).text == "<|endoftext|>"


def test_held_text_stays_small_on_long_outputs(tokenizer):
    stream = TextStream(tokenizer, ["zzz"])
    ids = tokenizer.encode(" ".join(CORPUS * 50), add_special_tokens=False)
    for token_id in ids:
        stream.push(token_id)
        assert len(stream.held_text) <= 16
    assert stream.text + stream.finish() == " ".join(CORPUS * 50)
