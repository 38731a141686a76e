"""``--override-kv`` parsing (llama.cpp's syntax, stricter numbers) and the mapping flags."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest

from mlxcel_compat.gguf.overrides import (KvOverride, apply_kv_overrides, overrides_from_json, overrides_json,
                                          parse_kv_override, parse_kv_overrides)
from mlxcel_compat.gguf.reader import map_file


@pytest.mark.parametrize("text, expected", [
    ("tokenizer.ggml.eos_token_id=int:2", KvOverride("tokenizer.ggml.eos_token_id", "int", 2)),
    ("llama.rope.freq_base=float:5e5", KvOverride("llama.rope.freq_base", "float", 500000.0)),
    ("tokenizer.ggml.add_bos_token=bool:false", KvOverride("tokenizer.ggml.add_bos_token", "bool", False)),
    ("general.name=str:a=b:c", KvOverride("general.name", "str", "a=b:c")),
])
def test_items_parse_as_llama_cpp_reads_them(text: str, expected: KvOverride) -> None:
    assert parse_kv_override(text) == expected


@pytest.mark.parametrize("text, why", [
    ("no-equals", "malformed"), ("=int:1", "malformed"), ("k=long:1", "invalid type"),
    ("k=int:two", "invalid int"), ("k=bool:yes", "invalid bool"), ("k=str:" + "x" * 128, "invalid str"),
    ("k" * 128 + "=int:1", "malformed"),
])
def test_bad_items_are_refused_with_a_reason(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_kv_override(text)


def test_the_last_value_of_a_key_wins_and_round_trips_for_the_tokenizer_child() -> None:
    overrides = parse_kv_overrides(["a=int:1", "b=bool:true", "a=int:3"])
    assert apply_kv_overrides({"a": 0, "c": "kept"}, overrides) == {"a": 3, "b": True, "c": "kept"}
    assert overrides_from_json(overrides_json(overrides)) == overrides


def test_map_file_maps_reads_and_locks(tmp_path: Path) -> None:
    path = tmp_path / "blob.bin"
    data = os.urandom(3 * mmap.PAGESIZE + 5)
    path.write_bytes(data)
    mapped = map_file(path)
    read = map_file(path, use_mmap=False, mlock=True)
    assert bytes(mapped) == bytes(read) == data
    assert isinstance(mapped.base.obj if isinstance(mapped.base, memoryview) else mapped.base, mmap.mmap)
    assert isinstance(read.base, np.ndarray) or read.base is None  # the process's own memory
    assert not read.flags.writeable
