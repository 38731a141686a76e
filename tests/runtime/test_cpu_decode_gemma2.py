"""Gemma 2 on the CPU decode runtime (runtime/decode_gemma2.py): attention logit soft-capping in the
attention kernels (``mlxcel_decode_attention_capped``, ``mlxcel_chunk_attention_capped``), Gemma 3's
layer without the per-head q/k norms, the embedding times ``sqrt(hidden)`` in float32 and the
final soft-capping (``decode_families.LogitTransform``).

- The capped kernels against a float64 reference (``tanh(s / cap) * cap`` before the mask and the
  softmax) over float32, f16, bf16, q8_0 and q4_0 KV, decode steps and prompt chunks (causal, and
  within a sliding window); the cap is small enough to move the output far from uncapped
  attention. Over a cache it may not write (rows apart) and over shared blocks (paged spans), the
  same bits as in place.
- The tiny gemma2 (caps 2.0 and 1.5: load-bearing) follows MLX's step for 40 greedy steps from a
  230-token prompt (the cache grows past 256 positions), within 1e-4 of the largest logit, the same
  token, the cache as MLX leaves it; the same model in MLX without its attention cap is far off.
  mlx-lm's ``gemma2.py`` keeps a full cache in every layer (no rings), so there is no window to pass.
- Rows together = rows alone; a cold prompt in chunks and a hit's rest leave MLX's KV.
- f16 and q8_0 KV; the quantized GGUFs teacher-forced against MLX's step on the same blocks; the
  engine on a GGUF uses the runtime and a prompt-cache hit equals the cold run.
"""

from __future__ import annotations

import copy
import ctypes
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxcel_compat.model.load_options import LoadOptions
from mlxcel_compat.model.loader import load_model
from mlxcel_compat.runtime import backend, cpu_decode, decode_kv
from mlxcel_compat.runtime.kv_precision import KvTypes
from mlxcel_compat.testing.gguf_writer import ensure_gguf
from tests.conftest import MODEL_CACHE, tiny_model
from tests.runtime.step_checks import address, assert_rows_together_equal_rows_alone, ids, mlx_logits, prefilled
from tests.runtime.test_cpu_decode_kvq import dequantize, quantize

LOGITS_RTOL = 1e-4  # of the largest logit (float32 summation order, 2 ** x, tanhf against MLX's tanh)
KERNEL_RTOL = 1e-5
BLOCK_RTOL = 0.06  # as test_cpu_decode.py: ggml's vec_dot quantizes the activations (see there)
STEP_RTOL = 1e-4  # q8_0 KV: float32 queries against the dequantized rows, as MLX
CAP = 1.5
CODES = {"f32": 0, "f16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4}

pytestmark = pytest.mark.skipif(backend.matmul_shim() is None, reason="the BLAS shim is not built on this machine")


# ---------------------------------------------------------------------------------- the kernels

def _lib() -> Any:
    lib = backend.matmul_shim().lib
    p, i, f, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    lib.mlxcel_decode_attention_capped.argtypes = [p, p, p, p, p, p, p, p, i, i, i, i, i, L, f, i, i, p, p, i, i, f]
    lib.mlxcel_chunk_attention_capped.argtypes = [p, p, p, p, p, p, p, p, i, i, i, i, i, L, f, i, i, i, p, p, i, i, f]
    lib.mlxcel_decode_attention_capped.restype = lib.mlxcel_chunk_attention_capped.restype = ctypes.c_int
    return lib


def _stored(x: np.ndarray, kind: str) -> np.ndarray:
    """Rows (..., d) as the cache stores them."""
    if kind == "f32":
        return x.astype(np.float32)
    if kind == "f16":
        return x.astype(np.float16).view(np.uint16)
    if kind == "bf16":
        return np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))
    return quantize(x, kind)


def _widened(rows: np.ndarray, kind: str) -> np.ndarray:
    if kind == "f32":
        return rows.astype(np.float64)
    if kind == "f16":
        return rows.view(np.float16).astype(np.float64)
    if kind == "bf16":
        return (rows.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return dequantize(rows, kind)


def _capped_reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray, scale: float, cap: float | None,
                      hidden: np.ndarray | None = None) -> np.ndarray:
    """softmax(cap tanh(scale q K^T / cap)) V, float64: q (Hk, g, m, d), keys/values (Hk, n, d);
    ``hidden`` (m, n) True where a row may not look; cap None: no cap."""
    s = np.einsum("hgmd,htd->hgmt", q, keys) * scale
    if cap is not None:
        s = np.tanh(s / cap) * cap
    if hidden is not None:
        s = np.where(hidden, -np.inf, s)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("hgmt,htd->hgmd", w / w.sum(axis=-1, keepdims=True), values)


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "q8_0", "q4_0"])
def test_a_capped_decode_step_matches_the_reference_apart_and_over_blocks(kind: str) -> None:
    """A step's scores soft-capped before the softmax (queries large enough that the cap moves
    the output far from uncapped attention); the same step over a cache it may not write, and
    (16-bit and float32 rows) over shared blocks of 16 positions, gives the same bits."""
    rng = np.random.default_rng(3)
    kv_heads, group, d, n = 2, 3, 64, 70
    capacity, pos, code, lib = n + 10, n - 1, CODES[kind], _lib()
    keys = _stored(rng.standard_normal((kv_heads, capacity, d)).astype(np.float32), kind)
    values = _stored(rng.standard_normal((kv_heads, capacity, d)).astype(np.float32), kind)
    before = keys.copy(), values.copy()
    q = (rng.standard_normal(kv_heads * group * d) * 4).astype(np.float32)
    k_new, v_new = (rng.standard_normal(kv_heads * d).astype(np.float32) for _ in range(2))
    scale = d ** -0.5
    out, apart = np.empty(kv_heads * group * d, np.float32), np.empty(kv_heads * group * d, np.float32)
    k_out, v_out = np.empty_like(keys[:, 0]), np.empty_like(values[:, 0])
    args = (address(q), address(k_new), address(v_new), address(keys), address(values))
    assert lib.mlxcel_decode_attention_capped(*args, address(apart), address(k_out), address(v_out), kv_heads, group, d,
                                              pos, 0, capacity, scale, code, code, None, None, 0, 1, CAP) == 0
    assert np.array_equal(keys, before[0]) and np.array_equal(values, before[1])
    assert lib.mlxcel_decode_attention_capped(*args, address(out), None, None, kv_heads, group, d, pos, n, capacity,
                                              scale, code, code, None, None, 0, 1, CAP) == 0
    assert np.array_equal(out, apart) and np.array_equal(keys[:, pos], k_out) and np.array_equal(values[:, pos], v_out)
    qr = q.reshape(kv_heads, group, 1, d).astype(np.float64)
    k64, v64 = _widened(keys[:, :n], kind), _widened(values[:, :n], kind)
    ref = _capped_reference(qr, k64, v64, scale, CAP).reshape(-1)
    assert np.abs(out - ref).max() <= KERNEL_RTOL * np.abs(ref).max()
    uncapped = _capped_reference(qr, k64, v64, scale, None).reshape(-1)
    assert np.abs(uncapped - ref).max() > 100 * KERNEL_RTOL * np.abs(ref).max()  # the cap is load-bearing
    if kind in ("q8_0", "q4_0"):
        return  # paged spans are of element types (decode_kv.paged_fits)
    bt, nb = 16, 48  # shared blocks of 16 positions for [0, 48), the own buffer holding the rest
    blocks = [np.ascontiguousarray(before[w][:, b * bt:(b + 1) * bt]) for w in (0, 1) for b in range(nb // bt)]
    table = (ctypes.c_void_p * len(blocks))(*(address(b) for b in blocks))
    own_k, own_v = (np.ascontiguousarray(before[w][:, nb:]) for w in (0, 1))
    paged = np.empty_like(out)
    assert lib.mlxcel_decode_attention_capped(address(q), address(k_new), address(v_new), address(own_k), address(own_v),
                                              address(paged), None, None, kv_heads, group, d, pos, 0, capacity - nb,
                                              scale, code, code, None, table, nb, bt, CAP) == 0
    assert np.array_equal(paged, out)


@pytest.mark.parametrize("kind,window", [("f32", 0), ("f16", 24), ("bf16", 0), ("q8_0", 0), ("q4_0", 24)])
def test_a_capped_prompt_chunk_matches_the_reference_apart_and_over_blocks(kind: str, window: int) -> None:
    """A chunk's rows causal (and within a sliding window: the rings' kernel), each score capped
    before the mask and the softmax; apart (and over shared blocks, element types) the same bits."""
    rng = np.random.default_rng(4)
    kv_heads, group, d, pos, rows = 2, 2, 64, 40, 37
    capacity, code, lib, n = pos + rows + 5, CODES[kind], _lib(), pos + rows
    keys = _stored(rng.standard_normal((kv_heads, capacity, d)).astype(np.float32), kind)
    values = _stored(rng.standard_normal((kv_heads, capacity, d)).astype(np.float32), kind)
    before = keys.copy(), values.copy()
    q = (rng.standard_normal((rows, kv_heads * group * d)) * 4).astype(np.float32)
    k_new, v_new = (rng.standard_normal((rows, kv_heads * d)).astype(np.float32) for _ in range(2))
    scale = d ** -0.5
    out, apart = (np.empty((rows, kv_heads * group * d), np.float32) for _ in range(2))
    k_out = np.empty((kv_heads, rows) + keys.shape[2:], keys.dtype)
    v_out = np.empty((kv_heads, rows) + values.shape[2:], values.dtype)
    args = (address(q), address(k_new), address(v_new), address(keys), address(values))
    assert lib.mlxcel_chunk_attention_capped(*args, address(apart), address(k_out), address(v_out), rows, kv_heads, group,
                                             d, pos, capacity, scale, code, code, window, None, None, 0, 1, CAP) == 0
    assert np.array_equal(keys, before[0]) and np.array_equal(values, before[1])
    assert lib.mlxcel_chunk_attention_capped(*args, address(out), None, None, rows, kv_heads, group, d, pos, capacity,
                                             scale, code, code, window, None, None, 0, 1, CAP) == 0
    assert np.array_equal(out, apart) and np.array_equal(keys[:, pos:n], k_out)
    at = pos + np.arange(rows)[:, None]
    hidden = (np.arange(n)[None, :] > at) | ((np.arange(n)[None, :] <= at - window) if window else False)
    qr = q.reshape(rows, kv_heads, group, d).transpose(1, 2, 0, 3).astype(np.float64)
    k64, v64 = _widened(keys[:, :n], kind), _widened(values[:, :n], kind)
    ref = _capped_reference(qr, k64, v64, scale, CAP, hidden).transpose(2, 0, 1, 3).reshape(rows, -1)
    assert np.abs(out - ref).max() <= KERNEL_RTOL * np.abs(ref).max()
    uncapped = _capped_reference(qr, k64, v64, scale, None, hidden).transpose(2, 0, 1, 3).reshape(rows, -1)
    assert np.abs(uncapped - ref).max() > 100 * KERNEL_RTOL * np.abs(ref).max()
    if kind in ("q8_0", "q4_0"):
        return
    bt, nb = 8, 32
    blocks = [np.ascontiguousarray(before[w][:, b * bt:(b + 1) * bt]) for w in (0, 1) for b in range(nb // bt)]
    table = (ctypes.c_void_p * len(blocks))(*(address(b) for b in blocks))
    own_k, own_v = (np.ascontiguousarray(before[w][:, nb:]) for w in (0, 1))
    paged = np.empty_like(out)
    assert lib.mlxcel_chunk_attention_capped(address(q), address(k_new), address(v_new), address(own_k), address(own_v),
                                             address(paged), None, None, rows, kv_heads, group, d, pos, capacity - nb,
                                             scale, code, code, window, None, table, nb, bt, CAP) == 0
    assert np.array_equal(paged, out)


def test_the_capped_kernels_refuse_what_does_not_fit() -> None:
    """Slots outside the capacity, a cache apart at position 0, blocks not whole: -1, nothing written."""
    lib, d = _lib(), 32
    q, kn, vn = np.ones(2 * d, np.float32), np.ones(d, np.float32), np.ones(d, np.float32)
    keys, values, out = np.zeros((1, 8, d), np.float32), np.zeros((1, 8, d), np.float32), np.zeros(2 * d, np.float32)
    args = (address(q), address(kn), address(vn), address(keys), address(values), address(out))
    step = lib.mlxcel_decode_attention_capped
    assert step(*args, None, None, 1, 2, d, 8, 9, 8, 0.2, 0, 0, None, None, 0, 1, CAP) == -1
    assert step(*args, address(kn), address(vn), 1, 2, d, 0, 0, 8, 0.2, 0, 0, None, None, 0, 1, CAP) == -1
    assert step(*args, None, None, 1, 2, d, 9, 0, 8, 0.2, 0, 0, None, None, 6, 4, CAP) == -1
    chunk = lib.mlxcel_chunk_attention_capped
    assert chunk(*args, None, None, 2, 1, 2, d, 7, 8, 0.2, 0, 0, 0, None, None, 0, 1, CAP) == -1
    assert chunk(*args, None, None, 1, 1, 2, d, 0, 8, 0.2, 0, 0, -1, None, None, 0, 1, CAP) == -1
    assert not keys.any() and not out.any()


# ---------------------------------------------------------------------------------- the decoder

@pytest.fixture(scope="module")
def gemma2() -> Any:
    loaded = load_model(str(tiny_model("gemma2:f32")), [])
    assert isinstance(loaded.decoder, cpu_decode.CpuDecoder), cpu_decode.unsupported(loaded.model)
    return loaded


def _close(got: np.ndarray, want: np.ndarray, rtol: float) -> bool:
    return bool(np.abs(got - want).max() <= rtol * np.abs(want).max())


def _assert_same_cache(ours: list, theirs: list, n: int, rtol: float = LOGITS_RTOL) -> None:
    for a, b in zip(ours, theirs):
        assert a.offset == b.offset == n
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            x, y = np.array(x[..., :n, :].astype(mx.float32)), np.array(y[..., :n, :].astype(mx.float32))
            assert np.abs(x - y).max() <= rtol * np.abs(y).max()


def test_the_decoder_follows_mlx_step_for_step(gemma2: Any) -> None:
    """40 greedy steps from a 230-token prompt (past a 256-position block of angles and the
    cache's growth): within LOGITS_RTOL of MLX's step, the same token, the cache as MLX leaves it,
    and MLX continues the decoder's cache. Without the attention cap MLX's logits are far off the
    decoder's: the cap is applied, and needed to pass."""
    model, decoder = gemma2.model, gemma2.decoder
    assert decoder.attn_softcap == 2.0 and decoder.logit_transform.softcap == 1.5 and not decoder.kv.rings
    ours = prefilled(model, 230)
    theirs, uncapped = copy.deepcopy(ours), copy.deepcopy(ours)
    owned, token = decode_kv.OwnedCache(), 11
    for step in range(40):
        assert decoder.can_run(ours, owned)
        got, want = decoder.step(token, ours, owned).copy(), mlx_logits(model, token, theirs)
        assert _close(got, want, LOGITS_RTOL), step
        assert int(got.argmax()) == int(want.argmax()), step
        if step == 0:
            for layer in model.layers:
                layer.self_attn.attn_logit_softcapping = 1e9
            try:
                assert not _close(got, mlx_logits(model, token, uncapped), 100 * LOGITS_RTOL)
            finally:
                for layer in model.layers:
                    layer.self_attn.attn_logit_softcapping = 2.0
        token = int(want.argmax())
    _assert_same_cache(ours, theirs, 270)
    for _ in range(2):
        got, want = mlx_logits(model, token, ours), mlx_logits(model, token, theirs)
        assert _close(got, want, LOGITS_RTOL)
        token = int(want.argmax())


def test_rows_together_equal_rows_alone(gemma2: Any) -> None:
    together = [prefilled(gemma2.model, n) for n in (20, 250, 300)]
    assert_rows_together_equal_rows_alone(gemma2.decoder, together, 4)
    assert [c[0].offset for c in together] == [24, 254, 304]


def test_prompt_chunks_leave_mlx_s_kv_cold_and_after_a_hit(gemma2: Any) -> None:
    """A cold 70-token prompt in one chunk and in two leaves MLX's keys and values; a hit's
    40-token rest (the adopted arrays read in place, rows apart) gives MLX's last-row logits (the
    final cap applied: ``LogitTransform``) and KV; the next step agrees too."""
    model, decoder = gemma2.model, gemma2.decoder
    prompt = ids(70, seed=31)
    theirs = make_prompt_cache(model)
    model(mx.array([prompt]), cache=theirs)
    mx.eval([c.state for c in theirs])
    for split in (70, 40):
        ours, owned = make_prompt_cache(model), decode_kv.OwnedCache()
        assert decoder.can_prefill(ours, owned)
        assert decoder.prefill(prompt[:split], ours, owned, logits=False) is None
        if split < 70:
            decoder.prefill(prompt[split:], ours, owned, logits=False)
        _assert_same_cache(ours, theirs, 70)
    shared = prefilled(model, 69)
    hit, theirs = [copy.copy(c) for c in shared], copy.deepcopy(shared)
    before = [np.array(c.keys) for c in shared]
    rest, owned = ids(40, seed=3), decode_kv.OwnedCache()
    got = decoder.prefill(rest, hit, owned).copy()
    want = np.array(model(mx.array([rest]), cache=theirs)[0, -1])
    assert _close(got, want, LOGITS_RTOL) and owned.apart is not None
    assert np.abs(want).max() <= 1.5  # the final cap bounds MLX's logits, and so the decoder's
    _assert_same_cache(hit, theirs, 109)
    got, want = decoder.step(int(want.argmax()), hit, owned), mlx_logits(model, int(want.argmax()), theirs)
    assert _close(got, want, LOGITS_RTOL)
    assert all(np.array_equal(np.array(c.keys), k) for c, k in zip(shared, before))


@pytest.mark.parametrize("kind,rtol", [("f16", LOGITS_RTOL), ("q8_0", STEP_RTOL)])
def test_16_bit_and_q8_0_kv(kind: str, rtol: float) -> None:
    """With -ctk/-ctv f16 and q8_0: a cold 90-token prompt as one chunk stores MLX's KV (q8_0: the
    very blocks) with the last row's logits to float32 rounding; then 8 steps within ``rtol`` of
    MLX's over its own copy (q8_0: the query quantized as ggml's), the same token where decided."""
    loaded = load_model(str(tiny_model("gemma2:f32")), [], options=LoadOptions(kv_types=KvTypes(kind, kind)))
    model, decoder = loaded.model, loaded.decoder
    assert isinstance(decoder, cpu_decode.CpuDecoder) and decoder.kv.codes == (CODES[kind],) * 2
    prompt = ids(90)
    ours, theirs, owned = make_prompt_cache(model), make_prompt_cache(model), decode_kv.OwnedCache()
    got = decoder.prefill(prompt, ours, owned).copy()
    want = np.array(model(mx.array([prompt]), cache=theirs)[0, -1])
    assert _close(got, want, LOGITS_RTOL)
    for a, b in zip(ours, theirs):
        x, y = np.array(a.keys[..., :90, :]), np.array(b.keys[..., :90, :])
        assert np.array_equal(x, y) if kind == "q8_0" else np.abs(x.astype(np.float32) - y.astype(np.float32)).max() <= 2 ** -7 * np.abs(y).max()
    token = 11
    for step in range(8):
        got, want = decoder.step(token, ours, owned).copy(), mlx_logits(model, token, theirs)
        assert _close(got, want, rtol), step
        first, second = np.sort(want)[-2:][::-1]
        if first - second > 2 * rtol * np.abs(want).max():
            assert int(got.argmax()) == int(want.argmax()), step
        token = int(want.argmax())


@pytest.mark.parametrize("gguf_type", ["q8_0", pytest.param("q4_0", marks=pytest.mark.slow)])
def test_the_quantized_gguf_follows_mlx_step_for_step(gguf_type: str) -> None:
    """The tiny gemma2's GGUF (every projection and the tied embedding in blocks): 12 teacher-forced
    steps from each of two prompts within BLOCK_RTOL of MLX's step on the same block model, the
    same token where decided. Most steps are bit-identical but for the final cap's tanh: the same
    ggml products on the same activations (the attention's cap is libm's tanhf, which gives MLX's
    tanh's bits), and the final cap NumPy's vectorized tanh, within 2 float32 steps of MLX's at
    the cap's magnitude (2.4e-7 at 1.5; MLX's scalar tanh took 16 ms over a 256K vocabulary, NumPy's
    0.4 ms). A step whose activations rounded differently anywhere is ~1e-3 off."""
    loaded = load_model(str(ensure_gguf("gemma2", "tiny", gguf_type, cache_dir=MODEL_CACHE)), [])
    model, decoder = loaded.model, loaded.decoder
    assert isinstance(decoder, cpu_decode.CpuDecoder), cpu_decode.unsupported(model)
    assert isinstance(decoder.embed, cpu_decode.BlockWeight) and all(
        lin.block is not None for layer in decoder.layers for lin in (layer.q, layer.k, layer.v, layer.o, layer.down))
    exact = total = 0
    for n, seed in ((40, 0), (150, 1)):
        ours = prefilled(model, n, seed)
        theirs, owned, token = copy.deepcopy(ours), decode_kv.OwnedCache(), 11
        for step in range(12):
            got, want = decoder.step(token, ours, owned).copy(), mlx_logits(model, token, theirs)
            assert _close(got, want, BLOCK_RTOL), (n, step)
            first, second = np.sort(want)[-2:][::-1]
            if first - second > 2 * BLOCK_RTOL * np.abs(want).max():
                assert int(got.argmax()) == int(want.argmax()), (n, step)
            exact += bool(np.abs(got - want).max() <= 2 * np.spacing(np.float32(1.5)))
            total += 1
            token = int(want.argmax())
    print(f"gemma2 {gguf_type}: {exact} of {total} steps bit-identical to MLX's but for the final tanh")
    assert exact >= total // 2  # measured: 24 of 24 (q8_0 and q4_0; and 40 of 40 over 20 steps a prompt)


def test_the_engine_runs_the_gguf_on_the_runtime_and_a_hit_equals_the_cold_run() -> None:
    """Through the engine on the Q8_0 GGUF: the runtime takes the steps and a hit's longer rest, and
    a prompt-cache hit gives the cold run's tokens and log-probabilities; a short rest MLX prefills
    too (the final cap applied by ``forward.last_row_logits``)."""
    from tests.engine.harness import EngineHarness

    h = EngineHarness(ensure_gguf("gemma2", "tiny", "q8_0", cache_dir=MODEL_CACHE), batch_size=32)
    try:
        decoder = h.engine.loaded.decoder
        assert isinstance(decoder, cpu_decode.CpuDecoder)
        shared = ids(64, seed=21)
        h.run(shared + ids(9, seed=22), n_predict=4)
        steps = decoder.steps
        second = shared + ids(27, seed=23)
        warm = h.run(second, n_predict=10, n_probs=3)
        assert warm.finish.n_cached >= 32 and decoder.steps > steps
        cold = h.run(second, n_predict=10, n_probs=3, cache=False)
        assert warm.tokens == cold.tokens
        assert warm.logprobs == cold.logprobs  # bit-identical: the hit's rest and the steps on the runtime
        # A short rest (5 tokens) MLX prefills: its last row's logits through forward.last_row_logits,
        # the final cap included (MLX's tanh there, NumPy's in the cold run: the last bits only).
        short = shared + ids(5, seed=24)
        warm, cold = h.run(short, n_predict=6, n_probs=3), h.run(short, n_predict=6, n_probs=3, cache=False)
        assert warm.finish.n_cached >= 32 and warm.tokens == cold.tokens
        assert all(w.keys() == c.keys() and all(abs(w[t] - c[t]) <= 1e-5 for t in w)
                   for w, c in zip(warm.logprobs, cold.logprobs))
    finally:
        h.close()
