"""The CPU decode runtime's attention over ggml's q8_0 and q4_0 KV blocks (-ctk/-ctv q8_0, q4_0).

- A written row is quantized as ggml's reference quantizers do, bit for bit against a NumPy
  transcription of ``quantize_row_q8_0_ref`` / ``quantize_row_q4_0_ref`` (ties of x / scale at
  .5 included: q8_0 rounds them away from zero, q4_0 truncates x / scale + 8.5).
- A decode step: float32 queries against each dequantized key row, V rows dequantized and summed:
  against float64 over the dequantized rows; the same step over a
  cache it may not write gives the same bits; rows together (several query heads of a group, an
  apart row) as rows alone.
- A prompt chunk over the dequantized rows, against float64; apart and in place, the same bits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from mlxcel_compat.runtime import backend, cpu_decode
from tests.runtime.step_checks import address, attention_lib, attention_reference, ids, mlx_logits

KERNEL_RTOL = 1e-5
CODES = {"q8_0": 3, "q4_0": 4}
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}

pytestmark = pytest.mark.skipif(backend.matmul_shim() is None, reason="the BLAS shim is not built on this machine")


# ------------------------------------------------------------------ ggml's reference, in NumPy

def quantize(x: np.ndarray, kind: str) -> np.ndarray:
    """Rows of float32 ``x`` (..., d) as ggml's blocks (..., d / 32 * block bytes), uint8."""
    lead, d = x.shape[:-1], x.shape[-1]
    b = x.astype(np.float32).reshape(-1, 32)
    if kind == "q8_0":
        amax = np.abs(b).max(axis=1)
        scale = (amax / np.float32(127)).astype(np.float32)
        inv = np.where(scale != 0, np.float32(1) / np.where(scale != 0, scale, 1), 0).astype(np.float32)
        x0 = (b * inv[:, None]).astype(np.float32)
        t = np.trunc(x0)
        q = (t + np.sign(x0) * (np.abs(x0 - t) >= 0.5)).astype(np.int8)  # roundf: half away from zero
        body = q.view(np.uint8)
    else:
        top = b[np.arange(len(b)), np.abs(b).argmax(axis=1)]  # the first value of largest magnitude
        scale = (top / np.float32(-8)).astype(np.float32)
        inv = np.where(scale != 0, np.float32(1) / np.where(scale != 0, scale, 1), 0).astype(np.float32)
        x0 = (b * inv[:, None]).astype(np.float32)
        q = np.minimum(15, np.trunc((x0 + np.float32(8.5)).astype(np.float32))).astype(np.uint8)
        body = q[:, :16] | (q[:, 16:] << 4)
    head = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return np.concatenate([head, body], axis=1).reshape(*lead, d // 32 * BLOCK_BYTES[kind])


def dequantize(blocks: np.ndarray, kind: str) -> np.ndarray:
    """ggml's blocks (..., bytes) as float64 values (..., d)."""
    lead, width = blocks.shape[:-1], blocks.shape[-1]
    b = blocks.reshape(-1, BLOCK_BYTES[kind])
    scale = b[:, :2].copy().view(np.float16).astype(np.float64)
    if kind == "q8_0":
        q = b[:, 2:].view(np.int8).astype(np.float64)
    else:
        q = np.concatenate([b[:, 2:] & 15, b[:, 2:] >> 4], axis=1).astype(np.float64) - 8
    return (q * scale).reshape(*lead, width // BLOCK_BYTES[kind] * 32)


def _awkward(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Normal values, with blocks whose values land on ties of x / scale: multiples of 0.5 under
    a largest magnitude of 127 (q8_0) and of 8 (q4_0), a block of zeros, a negative maximum."""
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    flat[:32] = np.arange(32) * 0.5 - 8  # q8_0 ties at scale 8/127 ... and q4_0's largest is -8
    flat[32:64] = 0.0
    flat[64:96] = np.linspace(-3, 3, 32, dtype=np.float32)
    flat[64] = -127.0
    flat[65:70] = [0.5, 1.5, -2.5, 126.5, -0.5]
    return x


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_rows_are_quantized_as_ggml_s_reference(kind: str) -> None:
    """A chunk writes its keys and values as the NumPy transcription of ggml's reference
    quantizers gives them, bit for bit, and touches no other slot."""
    rng = np.random.default_rng(3)
    kv_heads, group, d, rows = 2, 1, 64, 40
    width, lib = d // 32 * BLOCK_BYTES[kind], attention_lib()
    keys = np.zeros((kv_heads, rows + 4, width), np.uint8)
    values = np.zeros_like(keys)
    k_new = _awkward((rows, kv_heads * d), rng)
    v_new = (rng.standard_normal((rows, kv_heads * d)) * 40).astype(np.float32)
    q = rng.standard_normal((rows, kv_heads * group * d)).astype(np.float32)
    out = np.empty_like(q)
    assert lib.mlxcel_chunk_attention(address(q), address(k_new), address(v_new), address(keys), address(values), address(out), rows, kv_heads,
                                      group, d, 0, rows + 4, 0.125, CODES[kind], CODES[kind]) == 0
    want_k = quantize(k_new.reshape(rows, kv_heads, d).transpose(1, 0, 2), kind)
    want_v = quantize(v_new.reshape(rows, kv_heads, d).transpose(1, 0, 2), kind)
    assert np.array_equal(keys[:, :rows], want_k) and np.array_equal(values[:, :rows], want_v)
    assert not keys[:, rows:].any() and not values[:, rows:].any()


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
@pytest.mark.parametrize("d,n", [(64, 1), (64, 300), (128, 37)])
def test_a_decode_step_over_blocks(kind: str, d: int, n: int) -> None:
    """The new key and value quantized at slot n - 1; the output is attention of the float32 query
    over the dequantized rows (float64 reference); over a cache it may not write, the same bits
    with the new rows apart; a group's query heads alone give the bits they give together."""
    rng = np.random.default_rng(11)
    kv_heads, group, capacity, pos = 2, 3, n + 20, n - 1
    width, code, lib = d // 32 * BLOCK_BYTES[kind], CODES[kind], attention_lib()
    keys = quantize(rng.standard_normal((kv_heads, capacity, d)).astype(np.float32), kind)
    values = quantize(rng.standard_normal((kv_heads, capacity, d)).astype(np.float32), kind)
    before_k, before_v = keys.copy(), values.copy()
    q = (rng.standard_normal(kv_heads * group * d) * 2).astype(np.float32)
    k_new, v_new = _awkward((kv_heads * d,), rng), rng.standard_normal(kv_heads * d).astype(np.float32)
    out = np.empty(kv_heads * group * d, np.float32)
    scale = d ** -0.5
    if n > 1:
        k_out, v_out = (np.empty((kv_heads, width), np.uint8) for _ in range(2))
        apart = np.empty_like(out)
        assert lib.mlxcel_decode_attention_apart(address(q), address(k_new), address(v_new), address(keys), address(values), address(apart),
                                                 address(k_out), address(v_out), kv_heads, group, d, pos, capacity,
                                                 scale * cpu_decode.LOG2E, code, code) == 0
        assert np.array_equal(keys, before_k) and np.array_equal(values, before_v)
    assert lib.mlxcel_decode_attention_at(address(q), address(k_new), address(v_new), address(keys), address(values), address(out), kv_heads,
                                          group, d, pos, n, capacity, scale * cpu_decode.LOG2E, code, code) == 0
    want_k, want_v = quantize(k_new.reshape(kv_heads, d), kind), quantize(v_new.reshape(kv_heads, d), kind)
    assert np.array_equal(keys[:, pos], want_k) and np.array_equal(values[:, pos], want_v)
    untouched = np.ones(capacity, bool)
    untouched[pos] = False
    assert np.array_equal(keys[:, untouched], before_k[:, untouched])
    ref = attention_reference(q.reshape(kv_heads, group, d).astype(np.float64), dequantize(keys[:, :n], kind),
                              dequantize(values[:, :n], kind), scale).reshape(-1)
    assert np.abs(out - ref).max() <= KERNEL_RTOL * np.abs(ref).max()
    if n > 1:
        assert np.array_equal(apart, out)
        assert np.array_equal(k_out, want_k) and np.array_equal(v_out, want_v)
    # rows alone: each query head as a group of one (its KV head's cache alone) gives the same bits
    for h in range(kv_heads):
        for g in range(group):
            one = np.empty(d, np.float32)
            head_k, head_v = np.ascontiguousarray(keys[h:h + 1]), np.ascontiguousarray(values[h:h + 1])
            qi = np.ascontiguousarray(q.reshape(kv_heads, group, d)[h, g])
            ki, vi = k_new[h * d:(h + 1) * d].copy(), v_new[h * d:(h + 1) * d].copy()
            lib.mlxcel_decode_attention_at(address(qi), address(ki), address(vi), address(head_k), address(head_v), address(one), 1, 1, d, pos, n, capacity,
                                           scale * cpu_decode.LOG2E, code, code)
            assert np.array_equal(one, out.reshape(kv_heads, group, d)[h, g])


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_a_prompt_chunk_over_blocks(kind: str) -> None:
    """A chunk's rows quantized at [pos, pos + rows), row r attending [0, pos + r] over the
    dequantized rows; the same chunk over a cache it may not write gives the same bits."""
    rng = np.random.default_rng(12)
    kv_heads, group, d, pos, rows = 2, 2, 64, 150, 37
    capacity = pos + rows + 11
    width, code, lib = d // 32 * BLOCK_BYTES[kind], CODES[kind], attention_lib()
    keys = quantize(rng.standard_normal((kv_heads, capacity, d)).astype(np.float32), kind)
    values = quantize(rng.standard_normal((kv_heads, capacity, d)).astype(np.float32), kind)
    before_k, before_v = keys.copy(), values.copy()
    q = (rng.standard_normal((rows, kv_heads * group * d)) * 2).astype(np.float32)
    k_new = rng.standard_normal((rows, kv_heads * d)).astype(np.float32)
    v_new = rng.standard_normal((rows, kv_heads * d)).astype(np.float32)
    out, apart = (np.empty((rows, kv_heads * group * d), np.float32) for _ in range(2))
    k_out, v_out = (np.empty((kv_heads, rows, width), np.uint8) for _ in range(2))
    scale = d ** -0.5
    assert lib.mlxcel_chunk_attention_apart(address(q), address(k_new), address(v_new), address(keys), address(values), address(apart), address(k_out),
                                            address(v_out), rows, kv_heads, group, d, pos, capacity,
                                            scale * cpu_decode.LOG2E, code, code) == 0
    assert np.array_equal(keys, before_k) and np.array_equal(values, before_v)
    assert lib.mlxcel_chunk_attention(address(q), address(k_new), address(v_new), address(keys), address(values), address(out), rows, kv_heads,
                                      group, d, pos, capacity, scale * cpu_decode.LOG2E, code, code) == 0
    span = slice(pos, pos + rows)
    want_k = quantize(k_new.reshape(rows, kv_heads, d).transpose(1, 0, 2), kind)
    want_v = quantize(v_new.reshape(rows, kv_heads, d).transpose(1, 0, 2), kind)
    assert np.array_equal(keys[:, span], want_k) and np.array_equal(values[:, span], want_v)
    assert np.array_equal(k_out, want_k) and np.array_equal(v_out, want_v)
    n = pos + rows
    k64, v64 = dequantize(keys[:, :n], kind), dequantize(values[:, :n], kind)
    s = np.einsum("rhgd,htd->rhgt", q.reshape(rows, kv_heads, group, d).astype(np.float64), k64) * scale
    s = np.where((np.arange(n)[None, :] > (pos + np.arange(rows))[:, None])[:, None, None, :], -np.inf, s)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    ref = np.einsum("rhgt,htd->rhgd", w / w.sum(axis=-1, keepdims=True), v64).reshape(rows, -1)
    assert np.abs(out - ref).max() <= KERNEL_RTOL * np.abs(ref).max()
    assert np.array_equal(apart, out)


# ---------------------------------------------------------------------------------- the decoder

STEP_RTOL = 3e-2  # the step's query is quantized to q8_0 (as ggml's); MLX's attends with float queries


def _loaded(kind: str) -> tuple[Any, cpu_decode.CpuDecoder]:
    """The tiny mistral (llama's shape with a head size of 32: one block a row) with ``kind`` KV."""
    from mlxcel_compat.model.load_options import LoadOptions
    from mlxcel_compat.model.loader import load_model
    from mlxcel_compat.runtime.kv_precision import KvTypes
    from tests.conftest import tiny_model

    loaded = load_model(str(tiny_model("mistral")), [], options=LoadOptions(kv_types=KvTypes(kind, kind)))
    assert isinstance(loaded.decoder, cpu_decode.CpuDecoder)
    assert loaded.decoder.kv.codes == (CODES[kind],) * 2 and loaded.decoder.kv.widths == (BLOCK_BYTES[kind],) * 2
    return loaded.model, loaded.decoder


def _prefill(model: Any, n: int) -> list[Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)  # stamped: the wrapper quantizes what MLX's prefill writes
    model(mx.array([ids(n)]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _blocks(c: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.array(c.keys[..., :n, :]), np.array(c.values[..., :n, :])


@pytest.mark.parametrize("kind", ["q8_0", pytest.param("q4_0", marks=pytest.mark.slow)])
def test_the_decoder_over_blocks_follows_mlx_s_steps_and_prefill(kind: str) -> None:
    """A cold prompt fed to the runtime as one chunk stores the very blocks MLX's prefill stores
    (both quantize as ggml's reference) with the last row's logits at float32 rounding; then six
    steps, each within the q8_0 query's error of MLX's step over its own copy of the blocks."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlxcel_compat.runtime import decode_kv

    model, decoder = _loaded(kind)
    tokens = ids(90)
    ours, theirs = make_prompt_cache(model), make_prompt_cache(model)
    owned = decode_kv.OwnedCache()
    assert decoder.can_prefill(ours, owned)
    got, want = decoder.prefill(tokens, ours, owned).copy(), mlx_logits(model, tokens, theirs)
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    for a, b in zip(ours, theirs):
        assert a.keys.dtype == b.keys.dtype and str(a.keys.dtype) == "mlx.core.uint8"
        assert all(np.array_equal(x, y) for x, y in zip(_blocks(a, 90), _blocks(b, 90)))
    token = 11
    for step in range(6):
        assert decoder.can_run(ours, owned)
        got, want = decoder.step(token, ours, owned).copy(), mlx_logits(model, [token], theirs)
        assert np.abs(got - want).max() <= STEP_RTOL * np.abs(want).max(), step
        token = int(want.argmax())
    assert ours[0].offset == 96 and all(np.array_equal(x, y) for x, y in zip(_blocks(ours[0], 96), _blocks(theirs[0], 96)))


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_a_step_on_a_hit_s_blocks_equals_a_step_on_its_own_copy(kind: str) -> None:
    """A hit's first step reads the shared blocks in place and keeps its rows apart: its logits
    and the next steps equal the decoder's on its own copy bit for bit; the shared arrays are
    unchanged."""
    import copy

    from mlxcel_compat.runtime import decode_kv

    model, decoder = _loaded(kind)
    shared = _prefill(model, 65)
    before = [_blocks(c, c.keys.shape[2]) for c in shared]
    hit, own = [copy.copy(c) for c in shared], _prefill(model, 65)
    owned_hit, owned_own = decode_kv.OwnedCache(), decode_kv.OwnedCache()
    decoder.kv.own(own, owned_own, 65)
    got, want = decoder.step(11, hit, owned_hit).copy(), decoder.step(11, own, owned_own).copy()
    assert np.array_equal(got, want) and owned_hit.apart is not None
    for a, b in zip(hit, own):
        assert all(np.array_equal(x, y) for x, y in zip(_blocks(a, 66), _blocks(b, 66)))
    token = int(want.argmax())
    for _ in range(3):
        got, want = decoder.step(token, hit, owned_hit).copy(), decoder.step(token, own, owned_own).copy()
        assert np.array_equal(got, want)
        token = int(want.argmax())
    assert owned_hit.holds(hit)
    for c, (keys, values) in zip(shared, before):
        assert np.array_equal(np.array(c.keys), keys) and np.array_equal(np.array(c.values), values)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_mlx_s_blocks_are_ggml_s_reference_blocks(kind: str) -> None:
    """``kv_blocks.quantize`` (MLX's path, any device) gives the reference's bytes, ties included,
    and ``dequantize`` their values."""
    import mlx.core as mx

    from mlxcel_compat.runtime import kv_blocks

    x = _awkward((3, 5, 64), np.random.default_rng(5)) * 3
    blocks = np.array(kv_blocks.quantize(mx.array(x), kind))
    assert np.array_equal(blocks, quantize(x, kind))
    assert np.array_equal(np.array(kv_blocks.dequantize(mx.array(blocks), kind)), dequantize(blocks, kind))


def test_a_head_size_blocks_cannot_hold_is_refused_at_load() -> None:
    """The tiny llama's head size is 16: q8_0 KV is refused when the model loads, saying why."""
    from mlxcel_compat.model.load_options import LoadOptions
    from mlxcel_compat.model.loader import load_model
    from mlxcel_compat.runtime.kv_precision import KvTypes
    from tests.conftest import tiny_model

    with pytest.raises(ValueError, match="q8_0 KV needs a head size that is a multiple of 32"):
        load_model(str(tiny_model("llama")), [], options=LoadOptions(kv_types=KvTypes("q8_0", "q8_0")))


@pytest.mark.parametrize("kind", ["q8_0", pytest.param("q4_0", marks=pytest.mark.slow)])
def test_rows_stepped_together_over_blocks_equal_rows_alone(kind: str) -> None:
    """Three sequences at different positions stepped together over block KV give exactly the
    logits each gives stepped alone from a copy."""
    from tests.runtime.step_checks import assert_rows_together_equal_rows_alone

    model, decoder = _loaded(kind)
    together = [_prefill(model, n) for n in (20, 70, 130)]
    assert_rows_together_equal_rows_alone(decoder, together, 4)
    assert [c[0].offset for c in together] == [24, 74, 134]
