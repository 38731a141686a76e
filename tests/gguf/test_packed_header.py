"""A GGUF header's vocabulary-sized arrays stay packed (``gguf/reader.py: PackedStrings``,
``PackedNumbers``): no Python string or float per token is made while loading, yet every reader
sees the values a list would hold (gguf-py's reader is the reference), and what is derived from
them (special tokens, the converted tokenizer's cache key) is what lists give."""

from __future__ import annotations

import gguf
import pytest

from mlxcel_compat.gguf.reader import PACKED_MIN, GGUFModelFile, PackedNumbers, PackedStrings, open_gguf, unpacked
from mlxcel_compat.gguf.tokenizer import cache_key, special_tokens
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def file() -> GGUFModelFile:
    return open_gguf(tiny_model("qwen3:q8_0"))


def reference_field(path, key: str) -> list:
    """gguf-py's reading of a metadata array."""
    field = gguf.GGUFReader(path).fields[key]
    if field.types[-1] == gguf.GGUFValueType.STRING:
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    return [field.parts[i].tolist()[0] for i in field.data]


def test_vocabulary_arrays_are_packed_and_read_like_lists(file: GGUFModelFile) -> None:
    tokens, types = file.metadata["tokenizer.ggml.tokens"], file.metadata["tokenizer.ggml.token_type"]
    assert isinstance(tokens, PackedStrings) and isinstance(types, PackedNumbers) and len(tokens) >= PACKED_MIN
    expected_tokens = reference_field(file.path, "tokenizer.ggml.tokens")
    expected_types = reference_field(file.path, "tokenizer.ggml.token_type")
    assert list(tokens) == expected_tokens and tokens == expected_tokens and tokens.tolist() == expected_tokens
    assert [tokens[i] for i in (0, 5, -1)] == [expected_tokens[i] for i in (0, 5, -1)]
    assert tokens[3:9] == expected_tokens[3:9] and len(tokens) == len(expected_tokens)
    assert list(types) == expected_types and types == expected_types and types[-1] == expected_types[-1]
    assert all(type(t) is int for t in types[:4])  # Python numbers, as a list's
    merges = file.metadata.get("tokenizer.ggml.merges")
    if merges is not None:
        assert list(merges) == reference_field(file.path, "tokenizer.ggml.merges")
    assert file.metadata["tokenizer.ggml.model"] == "gpt2"  # short values are unchanged


def test_derived_values_are_those_of_lists(file: GGUFModelFile) -> None:
    as_lists = GGUFModelFile(file.path, file.parts, {k: unpacked(v) for k, v in file.metadata.items()},
                             file.tensors, file.header_bytes)
    assert isinstance(as_lists.metadata["tokenizer.ggml.tokens"], list)
    assert special_tokens(file) == special_tokens(as_lists)
    assert cache_key(file) == cache_key(as_lists)  # a cached conversion stays valid
