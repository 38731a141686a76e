"""mlx-lm caches through a disk file and back (cache/kv_io.py + cache/disk_format.py), for every family.

Dense KV (llama, qwen3), sliding windows that wrapped (gemma3_text's RotatingKVCache) and
recurrent-hybrid state (qwen3_next's ArraysCache + KVCache) must come back bit-identical: the next
forward pass gives the same logits as the cache that was written.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load

from mlxcel_compat.cache import kv, kv_io
from mlxcel_compat.cache.disk_directory import entry_name
from mlxcel_compat.cache.disk_format import Compat, DiskReject, EntryHeader, read_header
from mlxcel_compat.cache.disk_write import commit, write_temp
from mlxcel_compat.cache.key import RAW_PROMPT_TEMPLATE_SIG, TEXT_ONLY_MM_DIGEST, Bucket
from mlxcel_compat.runtime import kv_precision
from mlxcel_compat.runtime.kv_precision import KvTypes
from tests.conftest import tiny_model

pytestmark = pytest.mark.engine

BUCKET = Bucket("tiny", "", RAW_PROMPT_TEMPLATE_SIG, None, TEXT_ONLY_MM_DIGEST)


def write_cache(directory: Path, model: object, n_tokens: int) -> tuple[Path, list, Compat]:
    cache = make_prompt_cache(model)
    tokens = list(range(7, 7 + n_tokens))
    model(mx.array(tokens)[None], cache=cache)
    payload = kv.snapshot(cache)
    compat = Compat("fp", kv_io.runtime_tag(model, kv_precision.of_model(model).tag))
    layout, tensors = kv_io.encode(payload)
    header = EntryHeader("kv", compat, BUCKET, "s", tuple(tokens), "completion", kv.can_truncate(payload), kv.nbytes(payload), layout)
    path = directory / entry_name("kv", header.digest)
    commit(write_temp(path, header, tensors), path)
    return path, payload, compat


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text", "qwen3_next"])
def test_a_cache_comes_back_bit_identical(tmp_path, family) -> None:
    model, _ = load(str(tiny_model(family)))
    path, payload, compat = write_cache(tmp_path, model, 300)  # gemma3's tiny window wraps at this length
    header, _ = read_header(path, compat)
    restored = kv_io.decode(header.layout, kv_io.load_arrays(path, header))
    assert kv.layer_kinds(restored) == kv.layer_kinds(payload)
    assert kv.nbytes(restored) == kv.nbytes(payload) == header.nbytes
    arrays = [(a, b) for a, b in zip(tree_flatten([c.state for c in restored]), tree_flatten([c.state for c in payload]))]
    assert arrays and all(ka == kb for (ka, _), (kb, _) in arrays)
    for (_, a), (_, b) in arrays:
        if isinstance(a, mx.array):
            assert a.dtype == b.dtype and mx.array_equal(a, b).item()
        else:
            assert a == b
    step = mx.array([[11, 12]])
    want = model(step, cache=kv.copy_cache(payload))
    got = model(step, cache=restored)
    assert mx.array_equal(want, got).item()


def test_a_file_of_another_model_is_refused(tmp_path) -> None:
    model, _ = load(str(tiny_model("llama")))
    path, _, compat = write_cache(tmp_path, model, 40)
    with pytest.raises(DiskReject) as info:
        read_header(path, Compat("another model", compat.runtime))
    assert info.value.reason == "foreign_model"


def test_runtime_tag_names_versions_device_dtype_and_kv_types() -> None:
    model, _ = load(str(tiny_model("llama")))
    tag = kv_io.runtime_tag(model)
    assert tag.startswith(f"mlx {mx.__version__}; mlx-lm ") and tag.endswith("; float32; kv f32/f32")
    assert kv_io.runtime_tag(model, "f16/bf16").endswith("; float32; kv f16/bf16")


@pytest.mark.parametrize("name", ["f16", pytest.param("bf16", marks=pytest.mark.slow)])
def test_a_cache_stored_at_a_precision_comes_back_bit_identical_in_half_the_bytes(tmp_path, name) -> None:
    """-ctk/-ctv: a disk entry holds the KV in its storage type (half float32's bytes at 16 bits)
    and comes back as it was; a server storing another type refuses it, saying why."""
    model, _ = load(str(tiny_model("llama")))
    (tmp_path / "f32").mkdir()
    f32_path, f32_payload, f32_compat = write_cache(tmp_path / "f32", model, 64)
    kv_precision.install(model, KvTypes(name, name))
    path, payload, compat = write_cache(tmp_path, model, 64)
    assert compat.runtime.endswith(f"; kv {name}/{name}")
    header, _ = read_header(path, compat)
    restored = kv_io.decode(header.layout, kv_io.load_arrays(path, header))
    assert {c.keys.dtype for c in restored} == {c.values.dtype for c in restored} == {kv_precision.DTYPES[name]}
    assert all(mx.array_equal(a.keys, b.keys).item() and mx.array_equal(a.values, b.values).item()
               for a, b in zip(restored, payload))
    assert kv.nbytes(restored) == kv.nbytes(f32_payload) // 2
    assert path.stat().st_size < 0.6 * f32_path.stat().st_size
    step = mx.array([[11, 12]])
    assert mx.array_equal(model(step, cache=kv.copy_cache(payload)), model(step, cache=restored)).item()
    for theirs, ours in ((path, f32_compat), (f32_path, compat)):
        with pytest.raises(DiskReject) as info:
            read_header(theirs, ours)
        assert info.value.reason == "kv_precision"
        assert "-ctk/-ctv" in str(info.value) and f"{name}/{name}" in str(info.value)



@pytest.mark.parametrize("name", ["q8_0", pytest.param("q4_0", marks=pytest.mark.slow)])
def test_a_cache_of_blocks_comes_back_bit_identical(tmp_path, name) -> None:
    """-ctk/-ctv q8_0 or q4_0: a disk entry holds ggml's blocks (uint8 rows, 34 or 18 bytes per
    32 values) and comes back as it was; the f16 server refuses it, saying why."""
    model, _ = load(str(tiny_model("mistral")))  # head size 32: one block a row
    (tmp_path / "f16").mkdir()
    kv_precision.install(model, KvTypes("f16", "f16"))
    f16_path, f16_payload, f16_compat = write_cache(tmp_path / "f16", model, 64)
    kv_precision.install(model, KvTypes(name, name))
    path, payload, compat = write_cache(tmp_path, model, 64)
    header, _ = read_header(path, compat)
    restored = kv_io.decode(header.layout, kv_io.load_arrays(path, header))
    assert {c.keys.dtype for c in restored} == {c.values.dtype for c in restored} == {mx.uint8}
    assert all(mx.array_equal(a.keys, b.keys).item() and mx.array_equal(a.values, b.values).item()
               for a, b in zip(restored, payload))
    assert kv.nbytes(restored) * 64 == kv.nbytes(f16_payload) * {"q8_0": 34, "q4_0": 18}[name]
    step = mx.array([[11, 12]])
    assert mx.array_equal(model(step, cache=kv.copy_cache(payload)), model(step, cache=restored)).item()
    for theirs, ours in ((path, f16_compat), (f16_path, compat)):
        with pytest.raises(DiskReject) as info:
            read_header(theirs, ours)
        assert info.value.reason == "kv_precision" and f"{name}/{name}" in str(info.value)

def test_a_cache_of_mixed_types_comes_back_bit_identical(tmp_path) -> None:
    """-ctk q8_0 -ctv f16: keys as blocks, values as f16, each side back in its type and bits; a
    file of the same blocks both ways (q8_0/q8_0) and this one refuse each other, naming the pairs."""
    model, _ = load(str(tiny_model("mistral")))
    (tmp_path / "q8").mkdir()
    kv_precision.install(model, KvTypes("q8_0", "q8_0"))
    q8_path, _, q8_compat = write_cache(tmp_path / "q8", model, 64)
    kv_precision.install(model, KvTypes("q8_0", "f16"))
    path, payload, compat = write_cache(tmp_path, model, 64)
    header, _ = read_header(path, compat)
    restored = kv_io.decode(header.layout, kv_io.load_arrays(path, header))
    assert {c.keys.dtype for c in restored} == {mx.uint8} and {c.values.dtype for c in restored} == {mx.float16}
    assert all(mx.array_equal(a.keys, b.keys).item() and mx.array_equal(a.values, b.values).item()
               for a, b in zip(restored, payload))
    step = mx.array([[11, 12]])
    assert mx.array_equal(model(step, cache=kv.copy_cache(payload)), model(step, cache=restored)).item()
    for theirs, ours, named in ((path, q8_compat, "q8_0/f16"), (q8_path, compat, "q8_0/q8_0")):
        with pytest.raises(DiskReject) as info:
            read_header(theirs, ours)
        assert info.value.reason == "kv_precision" and named in str(info.value)


def test_a_layout_naming_anything_but_an_mlx_lm_cache_class_is_refused() -> None:
    with pytest.raises(DiskReject) as info:
        kv_io.decode({"version": 1, "layers": [{"class": "Path", "state": {"v": None}}]}, {})
    assert info.value.reason == "bad_payload"
