"""Keys and values of different storage types (``-ctk q8_0 -ctv f16`` and the like, as llama-server
allows): each side keeps its own type through mlx-lm's batch caches (merge, extend, extract), and
the CPU decode runtime stores what MLX's prefill stores for each side (the same blocks; float rows
to one rounding step) and follows MLX's steps; a step on a hit's shared arrays equals a step on its own copy bit for bit."""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import BatchKVCache, KVCache

from mlxcel_compat.runtime import backend, cpu_decode, kv_blocks, kv_precision
from mlxcel_compat.runtime.kv_precision import KvTypes
from tests.runtime.step_checks import ids, mlx_logits

H, D = 2, 32  # one block a row
PAIRS = [("q8_0", "f16"), ("f16", "q4_0"), ("bf16", "q8_0"), ("f32", "bf16")]
STEP_RTOL = 1e-4  # a step over block keys: float32 queries against the dequantized rows, as MLX


def stored(name: str) -> Any:
    return mx.uint8 if name in kv_blocks.BLOCK_BYTES else kv_precision.DTYPES[name]


def bits(a: mx.array) -> np.ndarray:
    """An array's stored bits as NumPy sees them (bfloat16 as uint16: NumPy has no bfloat16)."""
    return np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def rows(n: int, seed: int) -> tuple[mx.array, mx.array]:
    mx.random.seed(seed)
    return mx.random.normal((1, H, n, D)), mx.random.normal((1, H, n, D))


def filled(types: KvTypes, n: int, seed: int) -> KVCache:
    layer = kv_precision.stamp([KVCache()], types)[0]
    layer.update_and_fetch(*rows(n, seed))
    mx.eval(layer.keys, layer.values)
    return layer


@pytest.mark.parametrize("k,v", PAIRS)
def test_a_batch_keeps_each_side_s_type_and_bytes(k: str, v: str) -> None:
    """mlx-lm's merge allocates the values in the keys' dtype and its extend pads an empty side's
    values so: the wrappers keep the values' own type, and every row extracts to its own bytes."""
    kv_precision.patch_caches()
    types = KvTypes(k, v)
    a, b = filled(types, 5, 1), filled(types, 9, 2)
    want = [(bits(c.keys[..., : c.offset, :]), bits(c.values[..., : c.offset, :])) for c in (a, b)]
    batch = BatchKVCache.merge([a, b])
    assert (batch.keys.dtype, batch.values.dtype) == (stored(k), stored(v))
    out_k, out_v = batch.update_and_fetch(*(mx.concatenate([x, x]) for x in rows(1, 3)))
    assert out_k.shape[-1] == out_v.shape[-1] == D  # block rows handed to attention dequantized
    assert (batch.keys.dtype, batch.values.dtype) == (stored(k), stored(v))
    for i, (keys, values) in enumerate(want):
        row = batch.extract(i)
        n = keys.shape[2]
        assert np.array_equal(bits(row.keys[..., :n, :]), keys) and np.array_equal(bits(row.values[..., :n, :]), values)

    empty = BatchKVCache([0])  # a batch with no KV yet, extended by a row that has some
    empty.extend(BatchKVCache.merge([copy.copy(b)]))
    assert (empty.keys.dtype, empty.values.dtype) == (stored(k), stored(v))
    assert np.array_equal(bits(empty.extract(1).values), want[1][1])
    grown = BatchKVCache.merge([copy.copy(a)])
    grown.extend(BatchKVCache.merge([copy.copy(b)]))
    assert (grown.keys.dtype, grown.values.dtype) == (stored(k), stored(v))
    assert np.array_equal(bits(grown.extract(1).values), want[1][1])


def test_install_refuses_mixed_types_where_llama_cpp_does() -> None:
    """llama.cpp computes MLA models' attention on one latent cache and refuses -ctk != -ctv there."""

    class Model:
        args = {"model_type": "deepseek_v2"}
        layers = [object()]

    with pytest.raises(ValueError, match=r"does not support different K \(q8_0\) and V \(f16\) cache types"):
        kv_precision.install(Model(), KvTypes("q8_0", "f16"))
    kv_precision.install(Model(), KvTypes("q8_0", "q8_0"))


# ------------------------------------------------------------------ the CPU decode runtime

needs_shim = pytest.mark.skipif(backend.matmul_shim() is None, reason="the BLAS shim is not built on this machine")


def _loaded(k: str, v: str) -> tuple[Any, cpu_decode.CpuDecoder]:
    """The tiny mistral (head size 32: one block a row) with ``k`` keys and ``v`` values."""
    from mlxcel_compat.model.load_options import LoadOptions
    from mlxcel_compat.model.loader import load_model
    from tests.conftest import tiny_model

    loaded = load_model(str(tiny_model("mistral")), [], options=LoadOptions(kv_types=KvTypes(k, v)))
    assert isinstance(loaded.decoder, cpu_decode.CpuDecoder)
    return loaded.model, loaded.decoder


def _rows(c: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    return bits(c.keys[..., :n, :]), bits(c.values[..., :n, :])


# one rounding step of each float type: the runtime's projections and MLX's agree to float32
# rounding, which now and then moves a value across a 16-bit rounding boundary
ONE_STEP = {"f32": 1e-5, "f16": 2.0**-10, "bf16": 2.0**-7}


def assert_same_rows(a: Any, b: Any, n: int, types: tuple[str, str]) -> None:
    """Block rows byte for byte (ggml's quantizer absorbs float32 rounding: the same blocks here);
    float rows to one rounding step of their type."""
    for x, y, name in zip((a.keys, a.values), (b.keys, b.values), types):
        x, y = x[..., :n, :], y[..., :n, :]
        if name in kv_blocks.BLOCK_BYTES:
            assert np.array_equal(bits(x), bits(y)), name
        else:
            x, y = np.array(x.astype(mx.float32)), np.array(y.astype(mx.float32))
            assert np.all(np.abs(x - y) <= ONE_STEP[name] * np.abs(y) + 1e-6), name


@needs_shim
@pytest.mark.parametrize("k,v", [PAIRS[0], pytest.param(*PAIRS[1], marks=pytest.mark.slow),
                                 pytest.param(*PAIRS[2], marks=pytest.mark.slow)])
def test_the_decoder_stores_mlx_s_bytes_and_follows_its_steps(k: str, v: str) -> None:
    """A cold prompt as one runtime chunk stores, side by side, what MLX's prefill stores
    (each side in its own type and row width: blocks byte for byte, float rows to a rounding step), the last row's logits at float32 rounding; then
    steps within the q8_0 query's error of MLX's; then a hit's step on the shared arrays (rows kept
    apart), and on shared prompt-cache blocks read in place, equals the step on a copy bit for bit."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlxcel_compat.runtime import decode_kv

    model, decoder = _loaded(k, v)
    widths = tuple(kv_blocks.row_width(t, 32) if t in kv_blocks.BLOCK_BYTES else 32 for t in (k, v))
    assert decoder.kv.widths == widths and decoder.kv.codes[0] != decoder.kv.codes[1]
    tokens = ids(70)
    ours, theirs = make_prompt_cache(model), make_prompt_cache(model)
    owned = decode_kv.OwnedCache()
    assert decoder.can_prefill(ours, owned)
    got, want = decoder.prefill(tokens, ours, owned).copy(), mlx_logits(model, tokens, theirs)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    for a, b in zip(ours, theirs):
        assert (a.keys.dtype, a.values.dtype) == (stored(k), stored(v)) == (b.keys.dtype, b.values.dtype)
        assert (a.keys.shape[-1], a.values.shape[-1]) == widths
        assert_same_rows(a, b, 70, (k, v))
    token = 11
    for step in range(4):
        assert decoder.can_run(ours, owned)
        got, want = decoder.step(token, ours, owned).copy(), mlx_logits(model, [token], theirs)
        assert np.abs(got - want).max() <= STEP_RTOL * np.abs(want).max(), step
        token = int(want.argmax())
    assert [c.offset for c in ours] == [74] * len(ours)

    shared = theirs  # a hit: MLX's arrays, which the runtime may not write
    before = [_rows(c, 74) for c in shared]
    hit, own = [copy.copy(c) for c in shared], [copy.copy(c) for c in shared]
    owned_hit, owned_own = decode_kv.OwnedCache(), decode_kv.OwnedCache()
    decoder.kv.own(own, owned_own, 74)
    got, want = decoder.step(token, hit, owned_hit).copy(), decoder.step(token, own, owned_own).copy()
    assert np.array_equal(got, want) and owned_hit.apart is not None
    token = int(want.argmax())
    got, want = decoder.step(token, hit, owned_hit).copy(), decoder.step(token, own, owned_own).copy()
    assert np.array_equal(got, want) and owned_hit.holds(hit)
    assert all(np.array_equal(x, y) for c, rows_ in zip(shared, before) for x, y in zip(_rows(c, 74), rows_))

    # a hit on shared prompt-cache blocks (cache/kv.py's PagedKVCache) is read in place at these
    # types too (each side's row width), and its step equals the step on a copy of the same rows
    from mlxcel_compat.cache.kv import PagedKVCache

    bt = 16
    paged = [PagedKVCache(tuple((mx.contiguous(c.keys[..., i:i + bt, :]), mx.contiguous(c.values[..., i:i + bt, :]))
                                for i in range(0, 64, bt)), bt, None, None, 64) for c in shared]
    copied = [copy.copy(c) for c in shared]
    for c in copied:
        c.offset = 64
    owned_paged, owned_copied = decode_kv.OwnedCache(), decode_kv.OwnedCache()
    assert decoder.can_run(paged, owned_paged)
    got, want = decoder.step(token, paged, owned_paged).copy(), decoder.step(token, copied, owned_copied).copy()
    assert np.array_equal(got, want) and all(type(c) is PagedKVCache for c in paged)


@pytest.mark.parametrize("k,v", [PAIRS[0], pytest.param(*PAIRS[1], marks=pytest.mark.slow)])
def test_a_batched_step_on_mlx_s_merged_caches_is_each_row_s_own(k: str, v: str) -> None:
    """Two prompts of different lengths prefilled on MLX's path, their caches merged as the engine's
    batch merges them (``KVCache.merge``: left-padded ``BatchKVCache``s) and stepped together: each
    row's logits are its lone step's to float32 rounding, and the merged values kept their type
    (without the merge wrapper the f16 values would sit in the keys' uint8, or the blocks in f16)."""
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = _loaded(k, v)
    caches = [make_prompt_cache(model) for _ in range(2)]
    for cache, n in zip(caches, (40, 23)):
        mlx_logits(model, ids(n), cache)
    merged = [type(layers[0]).merge(list(layers)) for layers in zip(*caches)]
    assert all((m.keys.dtype, m.values.dtype) == (stored(k), stored(v)) for m in merged)
    together = model(mx.array([[11], [12]]), cache=merged)[:, -1]
    mx.eval(together)
    for row, (cache, token) in enumerate(zip(caches, (11, 12))):
        alone = mlx_logits(model, [token], cache)
        got = np.array(together[row])
        assert np.abs(got - alone).max() <= 1e-4 * np.abs(alone).max(), row
