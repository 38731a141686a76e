"""The CPU decode runtime over 16-bit KV (-ctk/-ctv f16 and bf16: runtime/kv_precision.py).

- The attention kernels write new rows rounded to the storage type (ties to even, the bits
  NumPy's float16 and MLX's bfloat16 casts give, subnormals, overflow and tails past the
  vector width included) and attend over the widened rows: a decode step across several
  tiles of keys, and a prompt chunk, against float64 NumPy on the stored values; the same step
  or chunk over a cache it may not write (its rows kept apart) gives the same bits.
- The decoder on a model stamped f16 or bf16: its buffers and the caches it leaves hold that
  type, every step within float32 rounding of MLX's step over the same 16-bit cache with the
  same greedy token, a prompt chunk's KV as MLX's prefill leaves it, and a step on a hit's
  shared 16-bit arrays bit-identical to the step on its own copy.
- Attention sinks (gpt-oss) over 16-bit KV: a decode step and a windowed chunk against float64
  NumPy; gpt-oss at f16: prompt chunks on sliding rings leave f16 caches as MLX's, steps follow.
"""

from __future__ import annotations

import copy
import ctypes
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxcel_compat.model.load_options import LoadOptions
from mlxcel_compat.model.loader import load_model
from mlxcel_compat.runtime import backend, cpu_decode, decode_kv
from mlxcel_compat.runtime.kv_precision import DTYPES, KvTypes
from tests.conftest import tiny_model
from tests.runtime.step_checks import address, attention_lib, attention_reference, ids, mlx_logits

LOGITS_RTOL = 1e-4  # as tests/runtime/test_cpu_decode.py: summation order and the polynomial 2 ** x
KERNEL_RTOL = 1e-5
CODES = {"f16": 1, "bf16": 2}

pytestmark = pytest.mark.skipif(backend.matmul_shim() is None, reason="the BLAS shim is not built on this machine")


def stored(x: np.ndarray, kind: str) -> np.ndarray:
    """``x`` (float32) rounded to ``kind``, as its 16-bit patterns: NumPy's float16 cast, MLX's
    bfloat16 cast (both round to nearest, ties to even)."""
    if kind == "f16":
        return x.astype(np.float16).view(np.uint16)
    return np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))


def widened(bits: np.ndarray, kind: str) -> np.ndarray:
    if kind == "f16":
        return bits.view(np.float16).astype(np.float64)
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# Values rounding finds hard: ties (f16's and bf16's), f16 subnormals and their ties, the largest
# value that rounds down to f16's maximum, signed zeros, a float32 subnormal.
AWKWARD = [1 + 2.0**-11, 1 + 3 * 2.0**-11, -(1 + 2.0**-11), 2.0**-20, -3e-6, 6e-8, 2.0**-25, 3 * 2.0**-25, 65519.0,
           -0.0, 0.0, 1 + 2.0**-8, 1 + 3 * 2.0**-8, 1e-40, 3.0, 2.0**-14 - 2.0**-26]
OVERFLOW = [65520.0, -1e6, np.inf, 3.4e38]  # f16: inf (bf16: finite, or inf)


def _awkward(n: int, rng: np.random.Generator) -> np.ndarray:
    """Normal values, the first ones AWKWARD's."""
    x = rng.standard_normal(n).astype(np.float32)
    special = np.array(AWKWARD, np.float32)
    x[: min(n, special.size)] = special[: min(n, special.size)]
    return x


@pytest.mark.parametrize("kind", ["f16", "bf16"])
@pytest.mark.parametrize("d,n", [(64, 1), (64, 300), (20, 129)])
def test_a_decode_step_over_16_bit_kv(kind: str, d: int, n: int) -> None:
    """The new key and value are written rounded to the type at slot n - 1 (nothing else
    touched); the output is attention over the stored values widened (d = 20: a scalar tail after
    the vectors, in the rounding and in the products); the same step over a cache it may not
    write gives the same bits, the new rows apart."""
    rng = np.random.default_rng(7)
    kv_heads, group, capacity, pos = 2, 3, n + 20, n - 1
    keys = stored(rng.standard_normal((kv_heads, capacity, d)).astype(np.float32), kind)
    values = stored(rng.standard_normal((kv_heads, capacity, d)).astype(np.float32), kind)
    before_k, before_v = keys.copy(), values.copy()
    q = (rng.standard_normal(kv_heads * group * d) * 2).astype(np.float32)
    k_new, v_new = _awkward(kv_heads * d, rng), rng.standard_normal(kv_heads * d).astype(np.float32)
    k_new[-1] = 1 + 2.0**-11  # a tie past the last whole vector of 8 (the scalar conversion's)
    out = np.empty(kv_heads * group * d, np.float32)
    scale, code, lib = d ** -0.5, CODES[kind], attention_lib()
    if n > 1:  # the shared cache's step first: the prompt's slots are all it may read
        k_out, v_out = np.empty((kv_heads, d), np.uint16), np.empty((kv_heads, d), np.uint16)
        apart = np.empty_like(out)
        assert lib.mlxcel_decode_attention_apart(address(q), address(k_new), address(v_new), address(keys), address(values), address(apart),
                                                 address(k_out), address(v_out), kv_heads, group, d, pos, capacity,
                                                 scale * cpu_decode.LOG2E, code, code) == 0
        assert np.array_equal(keys, before_k) and np.array_equal(values, before_v)
    assert lib.mlxcel_decode_attention_at(address(q), address(k_new), address(v_new), address(keys), address(values), address(out), kv_heads,
                                          group, d, pos, n, capacity, scale * cpu_decode.LOG2E, code, code) == 0
    want_k, want_v = stored(k_new, kind).reshape(kv_heads, d), stored(v_new, kind).reshape(kv_heads, d)
    assert np.array_equal(keys[:, pos], want_k) and np.array_equal(values[:, pos], want_v)
    untouched = np.ones(capacity, bool)
    untouched[pos] = False
    assert np.array_equal(keys[:, untouched], before_k[:, untouched])
    assert np.array_equal(values[:, untouched], before_v[:, untouched])
    ref = attention_reference(q.reshape(kv_heads, group, d).astype(np.float64), widened(keys[:, :n], kind),
                     widened(values[:, :n], kind), scale).reshape(-1)
    assert np.abs(out - ref).max() <= KERNEL_RTOL * np.abs(ref).max()
    if n > 1:
        assert np.array_equal(apart, out)
        assert np.array_equal(k_out, want_k) and np.array_equal(v_out, want_v)
    k_new[: len(OVERFLOW)] = OVERFLOW  # written as the casts write them (the output is no longer finite)
    lib.mlxcel_decode_attention_at(address(q), address(k_new), address(v_new), address(keys), address(values), address(out), kv_heads, group, d,
                                   pos, n, capacity, scale * cpu_decode.LOG2E, code, code)
    with np.errstate(over="ignore"):
        assert np.array_equal(keys[:, pos], stored(k_new, kind).reshape(kv_heads, d))


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_a_prompt_chunk_over_16_bit_kv(kind: str) -> None:
    """A prompt chunk's rows written rounded at [pos, pos + rows), row r attending [0, pos + r]
    over the widened stored values; the same chunk over a cache it may not write, the same bits."""
    rng = np.random.default_rng(8)
    kv_heads, group, d, pos, rows = 2, 2, 64, 150, 37
    capacity = pos + rows + 11
    keys = stored(rng.standard_normal((kv_heads, capacity, d)).astype(np.float32), kind)
    values = stored(rng.standard_normal((kv_heads, capacity, d)).astype(np.float32), kind)
    before_k, before_v = keys.copy(), values.copy()
    q = (rng.standard_normal((rows, kv_heads * group * d)) * 2).astype(np.float32)
    k_new = _awkward(rows * kv_heads * d, rng).reshape(rows, kv_heads * d)
    v_new = rng.standard_normal((rows, kv_heads * d)).astype(np.float32)
    out, apart = (np.empty((rows, kv_heads * group * d), np.float32) for _ in range(2))
    k_out, v_out = (np.empty((kv_heads, rows, d), np.uint16) for _ in range(2))
    scale, code, lib = d ** -0.5, CODES[kind], attention_lib()
    assert lib.mlxcel_chunk_attention_apart(address(q), address(k_new), address(v_new), address(keys), address(values), address(apart), address(k_out),
                                            address(v_out), rows, kv_heads, group, d, pos, capacity,
                                            scale * cpu_decode.LOG2E, code, code) == 0
    assert np.array_equal(keys, before_k) and np.array_equal(values, before_v)
    assert lib.mlxcel_chunk_attention(address(q), address(k_new), address(v_new), address(keys), address(values), address(out), rows, kv_heads,
                                      group, d, pos, capacity, scale * cpu_decode.LOG2E, code, code) == 0
    span = slice(pos, pos + rows)
    want_k = stored(k_new, kind).reshape(rows, kv_heads, d).transpose(1, 0, 2)
    want_v = stored(v_new, kind).reshape(rows, kv_heads, d).transpose(1, 0, 2)
    assert np.array_equal(keys[:, span], want_k) and np.array_equal(values[:, span], want_v)
    assert np.array_equal(k_out, want_k) and np.array_equal(v_out, want_v)
    untouched = np.ones(capacity, bool)
    untouched[span] = False
    assert np.array_equal(keys[:, untouched], before_k[:, untouched])
    n = pos + rows
    k64, v64 = widened(keys[:, :n], kind), widened(values[:, :n], kind)
    s = np.einsum("rhgd,htd->rhgt", q.reshape(rows, kv_heads, group, d).astype(np.float64), k64) * scale
    s = np.where((np.arange(n)[None, :] > (pos + np.arange(rows))[:, None])[:, None, None, :], -np.inf, s)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    ref = np.einsum("rhgt,htd->rhgd", w / w.sum(axis=-1, keepdims=True), v64).reshape(rows, -1)
    assert np.abs(out - ref).max() <= KERNEL_RTOL * np.abs(ref).max()
    assert np.array_equal(apart, out)


# ---------------------------------------------------------------------------------- the decoder

def _loaded(family: str, kind: str) -> tuple[nn.Module, cpu_decode.CpuDecoder]:
    loaded = load_model(str(tiny_model(family)), [], options=LoadOptions(kv_types=KvTypes(kind, kind)))
    assert isinstance(loaded.decoder, cpu_decode.CpuDecoder)
    assert loaded.decoder.kv.dtypes == (DTYPES[kind], DTYPES[kind])
    return loaded.model, loaded.decoder


def _prefill(model: nn.Module, n: int) -> list[Any]:
    cache = make_prompt_cache(model)  # the model's make_cache stamps the storage type
    model(mx.array([ids(n)]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _assert_close_caches(ours: list[Any], theirs: list[Any], dtype: Any) -> None:
    """Both caches of ``dtype``, at the same offset, their stored rows equal to float32 rounding
    of the rows they were computed from (one 16-bit step apart where that moved a rounding)."""
    for a, b in zip(ours, theirs):
        assert a.keys.dtype == a.values.dtype == b.keys.dtype == dtype and a.offset == b.offset
        span = slice(0, min(a.offset, a.keys.shape[2]))  # a full ring: every slot
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            x, y = (np.array(z[..., span, :].astype(mx.float32)) for z in (x, y))
            assert np.abs(x - y).max() <= 2 ** -7 * np.abs(y).max()


@pytest.mark.parametrize("family,kind", [
    ("llama", "f16"),
    pytest.param("qwen3", "bf16", marks=pytest.mark.slow),
    pytest.param("gemma3_text", "f16", marks=pytest.mark.slow),
])
def test_the_decoder_follows_mlx_s_16_bit_steps(family: str, kind: str) -> None:
    """12 greedy steps from a 120-token prompt (gemma3's 64-slot rings wrap):
    each step's logits within float32 rounding of MLX's step over its own copy of the 16-bit
    cache, the same token, both caches still of the type; then MLX continues the decoder's."""
    model, decoder = _loaded(family, kind)
    ours, theirs = _prefill(model, 120), _prefill(model, 120)
    owned = decode_kv.OwnedCache()
    token = 11
    for step in range(12):
        assert decoder.can_run(ours, owned)
        got = decoder.step(token, ours, owned).copy()
        want = mlx_logits(model, [token], theirs)
        assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max(), step
        assert int(got.argmax()) == int(want.argmax()), step
        token = int(want.argmax())
    _assert_close_caches(ours, theirs, DTYPES[kind])
    got, want = mlx_logits(model, [token], ours), mlx_logits(model, [token], theirs)
    assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max()


def test_a_cold_prompt_chunk_at_f16_leaves_mlx_s_kv() -> None:
    """A cold prompt fed to the runtime as one chunk (the engine's path at f16) stores f16 KV
    within a rounding step of MLX's prefill, and the last row's logits agree to float32 rounding."""
    model, decoder = _loaded("llama", "f16")
    tokens = ids(90)
    ours, theirs = make_prompt_cache(model), make_prompt_cache(model)
    owned = decode_kv.OwnedCache()
    assert decoder.can_prefill(ours, owned)
    got = decoder.prefill(tokens, ours, owned).copy()
    want = mlx_logits(model, tokens, theirs)
    assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max()
    _assert_close_caches(ours, theirs, mx.float16)


@pytest.mark.parametrize("kind", ["f16", pytest.param("bf16", marks=pytest.mark.slow)])
def test_a_step_on_a_hit_s_16_bit_arrays_equals_a_step_on_its_own_copy(kind: str) -> None:
    """A hit's first step reads the shared 16-bit arrays in place and keeps its rows apart: its
    logits, the cache as others read it, and the next steps equal the decoder's on its own copy
    bit for bit; the shared arrays are unchanged."""
    model, decoder = _loaded("llama", kind)
    shared = _prefill(model, 65)
    before = [(np.array(c.keys.astype(mx.float32)), np.array(c.values.astype(mx.float32))) for c in shared]
    hit, own = [copy.copy(c) for c in shared], _prefill(model, 65)  # adoption: new cache objects, the same arrays
    owned_hit, owned_own = decode_kv.OwnedCache(), decode_kv.OwnedCache()
    decoder.kv.own(own, owned_own, 65)
    got, want = decoder.step(11, hit, owned_hit).copy(), decoder.step(11, own, owned_own).copy()
    assert np.array_equal(got, want) and owned_hit.apart is not None
    for a, b in zip(hit, own):
        assert a.keys.dtype == DTYPES[kind]
        assert np.array_equal(np.array(a.keys[..., :66, :].astype(mx.float32)), np.array(b.keys[..., :66, :].astype(mx.float32)))
        assert np.array_equal(np.array(a.values[..., :66, :].astype(mx.float32)), np.array(b.values[..., :66, :].astype(mx.float32)))
    token = int(want.argmax())
    for _ in range(3):
        got, want = decoder.step(token, hit, owned_hit).copy(), decoder.step(token, own, owned_own).copy()
        assert np.array_equal(got, want)
        token = int(want.argmax())
    assert owned_hit.holds(hit) and hit[0].keys.dtype == DTYPES[kind]
    for c, (keys, values) in zip(shared, before):
        assert np.array_equal(np.array(c.keys.astype(mx.float32)), keys)
        assert np.array_equal(np.array(c.values.astype(mx.float32)), values)


def _sinkattention_reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float, sinks: np.ndarray,
                    visible: np.ndarray) -> np.ndarray:
    """softmax over the visible keys and a sink logit per query head (one more term of the
    denominator, no value), float64: q (Hk, g, d) per row, ``visible`` (n,) the mask."""
    s = np.einsum("hgd,htd->hgt", q, keys) * scale
    s = np.where(visible[None, None], s, -np.inf)
    sink = sinks.reshape(q.shape[0], q.shape[1], 1).astype(np.float64)
    top = np.maximum(s.max(axis=-1, keepdims=True), sink)
    w = np.exp(s - top)
    return np.einsum("hgt,htd->hgd", w / (w.sum(axis=-1, keepdims=True) + np.exp(sink - top)), values)


@pytest.mark.parametrize("kind", ["f16", "bf16"])
def test_attention_sinks_over_16_bit_kv(kind: str) -> None:
    """gpt-oss's sinks on a 16-bit cache (the default): a decode step (written and apart) and a
    windowed prompt chunk, each against float64 NumPy over the stored values widened with the sink
    logit in the denominator; large sinks, so that a kernel dropping them misses by far."""
    lib, code = backend.matmul_shim().lib, CODES[kind]
    p, i, f, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    step = lib.mlxcel_decode_attention_sinks
    step.argtypes, step.restype = [p, p, p, p, p, p, p, p, i, i, i, i, i, L, f, p, i, i], ctypes.c_int
    chunk = lib.mlxcel_chunk_attention_window
    chunk.argtypes, chunk.restype = [p, p, p, p, p, p, i, i, i, i, i, L, f, i, i, i, p], ctypes.c_int
    rng = np.random.default_rng(11)
    hk, group, d, n, cap = 2, 4, 64, 40, 64
    scale = d ** -0.5
    sinks = np.array([4.0, -3.0, 0.5, 9.0, 0.0, 2.0, -1.0, 6.0], np.float32)
    sinks2 = (sinks * np.float32(cpu_decode.LOG2E)).astype(np.float32)
    for apart in (False, True):
        keys = stored(rng.standard_normal((hk, cap, d)).astype(np.float32), kind)
        values = stored(rng.standard_normal((hk, cap, d)).astype(np.float32), kind)
        q = rng.standard_normal(hk * group * d).astype(np.float32)
        k_new, v_new = (rng.standard_normal(hk * d).astype(np.float32) for _ in range(2))
        k_out, v_out = np.empty((hk, d), np.uint16), np.empty((hk, d), np.uint16)
        out = np.empty(hk * group * d, np.float32)
        assert step(address(q), address(k_new), address(v_new), address(keys), address(values), address(out), address(k_out) if apart else None,
                    address(v_out) if apart else None, hk, group, d, n - 1, n, cap, scale * cpu_decode.LOG2E,
                    address(sinks2), code, code) == 0
        if apart:
            keys[:, n - 1], values[:, n - 1] = k_out, v_out
        assert np.array_equal(keys[:, n - 1], stored(k_new, kind).reshape(hk, d))
        ref = _sinkattention_reference(q.reshape(hk, group, d).astype(np.float64), widened(keys[:, :n], kind),
                              widened(values[:, :n], kind), scale, sinks, np.ones(n, bool)).reshape(-1)
        assert np.abs(out - ref).max() <= KERNEL_RTOL * np.abs(ref).max(), apart
    pos, rows, window = 10, 30, 16
    keys = stored(rng.standard_normal((hk, pos + rows, d)).astype(np.float32), kind)
    values = stored(rng.standard_normal((hk, pos + rows, d)).astype(np.float32), kind)
    q = rng.standard_normal((rows, hk * group * d)).astype(np.float32)
    k_new, v_new = (rng.standard_normal((rows, hk * d)).astype(np.float32) for _ in range(2))
    out = np.empty((rows, hk * group * d), np.float32)
    assert chunk(address(q), address(k_new), address(v_new), address(keys), address(values), address(out), rows, hk, group, d, pos, pos + rows,
                 scale * cpu_decode.LOG2E, code, code, window, address(sinks2)) == 0
    kw, vw = widened(keys, kind), widened(values, kind)
    for r in range(rows):
        at = np.arange(pos + rows)
        visible = (at <= pos + r) & (at > pos + r - window)
        ref = _sinkattention_reference(q[r].reshape(hk, group, d).astype(np.float64), kw, vw, scale, sinks, visible).reshape(-1)
        assert np.abs(out[r] - ref).max() <= KERNEL_RTOL * np.abs(ref).max(), r


def test_gpt_oss_prompt_chunks_and_steps_at_f16() -> None:
    """gpt-oss at f16 (sinks, alternating sliding rings): prompt chunks on the runtime (a cold
    one, one after it, past the window of 16) leave every layer's cache f16, within a rounding step
    of MLX's own chunks' (rings: their newest ``min(offset, window)`` slots in order), the last
    row's logits within float32 rounding of MLX's; then greedy steps follow MLX's."""
    model, decoder = _loaded("gpt_oss:mxfp4", "f16")
    assert decoder.kv.rings
    ours, theirs, owned = make_prompt_cache(model), make_prompt_cache(model), decode_kv.OwnedCache()
    prompt, at, fed = ids(70), 0, decoder.prefilled
    for n in (40, 30):
        part, at = prompt[at:at + n], at + n
        assert decoder.can_prefill(ours, owned)
        got = decoder.prefill(part, ours, owned).copy()
        want = mlx_logits(model, part, theirs)
        assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max(), n
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert a.keys.dtype == a.values.dtype == b.keys.dtype == mx.float16 and a.offset == b.offset == at
            held = min(at, decoder.window) if i in decoder.kv.rings else at
            for x, y in zip(_newest(a, held), _newest(b, held)):
                assert np.abs(x - y).max() <= 2 ** -7 * np.abs(y).max(), (n, i)
    assert decoder.prefilled == fed + 70
    token = 5
    for step in range(8):
        assert decoder.can_run(ours, owned)
        got = decoder.step(token, ours, owned).copy()
        want = mlx_logits(model, [token], theirs)
        assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max(), step
        token = int(want.argmax())


def _newest(c: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    """A cache's newest ``n`` positions in order as float32 (a ring: mlx-lm's ``_temporal_order``)."""
    keys, values = (np.array(a.astype(mx.float32)) for a in (c.keys, c.values))
    cap, idx = keys.shape[2], getattr(c, "_idx", None)
    if idx is None:
        order = list(range(c.offset))
    else:
        order = (list(range(cap)) if idx == cap else list(range(idx, cap)) + list(range(idx))
                 if idx < c.offset else list(range(idx)))
    return keys[:, :, order[-n:]], values[:, :, order[-n:]]


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "q8_0", "q4_0"])
def test_a_sequence_s_rows_in_one_pass_equal_its_single_steps(kind: str) -> None:
    """A speculative draft's or a prompt tail's rows (``step_tokens``: one sequence, consecutive
    positions) share one attention call a layer, each KV head's keys read once for all of them
    (``mlxcel_decode_attention_rows``): every row's logits and the KV they leave are its single
    step's, bit for bit, at every storage type (grouped queries: the tiny mistral's heads share KV
    heads, 32 values each: one q8_0/q4_0 block a row)."""
    loaded = load_model(str(tiny_model("mistral")), [], options=LoadOptions(kv_types=KvTypes(kind, kind)))
    model, decoder = loaded.model, loaded.decoder
    assert decoder.n_heads > decoder.n_kv_heads
    tokens = ids(16, seed=3)
    stepped, rows = _prefill(model, 70), _prefill(model, 70)
    owned_s, owned_r = decode_kv.OwnedCache(), decode_kv.OwnedCache()
    want = np.stack([decoder.step(t, stepped, owned_s).copy() for t in tokens])
    got = decoder.step_tokens(tokens, rows, owned_r)
    assert np.array_equal(got, want)
    for a, b in zip(rows, stepped):
        n = a.offset
        assert n == b.offset == 86
        bits = mx.uint16 if a.keys.dtype == mx.bfloat16 else a.keys.dtype  # NumPy has no bfloat16
        assert all(np.array_equal(np.array(x[..., :n, :].view(bits)), np.array(y[..., :n, :].view(bits)))
                   for x, y in zip((a.keys, a.values), (b.keys, b.values)))
