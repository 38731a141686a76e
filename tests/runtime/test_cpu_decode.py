"""The CPU decode runtime (runtime/cpu_decode.py) and its kernels in the shim's library.

- Each kernel against a float64 NumPy reference (RMS norm, Gemma's norm of a branch added to the
  residual, RoPE in both layouts against ``mx.fast.rope``, SiLU and GELU-tanh gating with the
  polynomial ``2 ** x`` over extreme inputs, the decode attention for grouped heads at several
  lengths, and at a ring's slot).
- Per supported family (llama, mistral, qwen2, qwen3, gemma3): the decoder's logits against MLX's
  step on a copy of the same cache, step after step across the cache's 256-position growth (and
  gemma3's sliding-window rings wrapping), within LOGITS_RTOL, with the same greedy token, the
  cache left as MLX's update leaves it; a cache the decoder wrote continues in MLX (steps,
  prompt chunks, a trim, a merged batch) to the same logits.
- The same for weights in ggml's blocks (GGUF files of several types), within BLOCK_RTOL.
- Rows stepped together are bit-identical to the rows stepped alone (float32 and blocks).
- The arrays others hold (a prompt-cache entry, a sibling's prefix) are never written.
- The models and caches it does not take say why, and ``MLXCEL_CPU_DECODE=0`` turns it off.
- Through the engine: greedy tokens with the runtime equal those without it.
"""

from __future__ import annotations

import copy
import ctypes
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from mlxcel_compat.engine.request import TokenEvent
from mlxcel_compat.model.loader import load_model
from mlxcel_compat.runtime import backend, cpu_decode, decode_kv
from mlxcel_compat.runtime.native import blas_shim
from mlxcel_compat.runtime.rope_angles import RopeAngles
from mlxcel_compat.testing.gguf_writer import ensure_gguf
from tests.conftest import MODEL_CACHE, tiny_model
from tests.engine.harness import EngineHarness
from tests.runtime.step_checks import (assert_mlx_continues, assert_rows_together_equal_rows_alone, assert_same_cache,
                                       follow_mlx, follow_mlx_teacher_forced, mlx_logits)

LOGITS_RTOL = 1e-4  # of the largest logit: measured 1e-6 to 4e-6 (summation order, 2 ** x)
KERNEL_RTOL = 2e-6
# Block weights: both steps multiply by ggml's vec_dot, which first quantizes the activations as
# llama.cpp does (Q8_0 / Q8_K blocks of 8-bit values, F16 for F16 weights). A step's logits are
# then either bit-identical to MLX's (no activation rounded differently: most steps) or, where
# the ~1e-7 differences elsewhere (attention, norms) move an activation across a rounding
# boundary of that quantization, one quantum apart there. On the tiny random models that moves
# the logits by up to 3 % of the largest (measured on these files), and MLX's own step against
# itself with its embedding scaled by 1 + 2^-22 moves them as much (up to 3.5 %, against 1e-6
# for float32 weights): the sensitivity is llama.cpp's, not the runtime's. A wrong bias, norm,
# scale or row order moves them by tens of percent.
BLOCK_RTOL = 0.06

pytestmark = pytest.mark.skipif(backend.matmul_shim() is None, reason="the BLAS shim is not built on this machine")


class _Kernels:
    """The shim's decode-step kernels with ctypes argument types, for testing each on its own
    (the runtime calls them from ``decode_pass.c``)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i, f, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
        self.sgemm = self._fn(lib.cblas_sgemm, [i, i, i, i, i, i, f, p, i, p, i, f, p, i])
        self.rms_norm = self._fn(lib.mlxcel_rms_norm, [p, p, p, i, i, f])
        self.rope = self._fn(lib.mlxcel_rope, [p, i, i, p, p, i])
        self.rms_norm_add = self._fn(lib.mlxcel_rms_norm_add, [p, p, p, i, i, f])
        self.swiglu = self._fn(lib.mlxcel_swiglu, [p, p, i])
        self.gelu_tanh_gate = self._fn(lib.mlxcel_gelu_tanh_gate, [p, p, i])
        # the attention kernels end with the keys' and values' storage types (0: float32, 1: f16, 2: bf16)
        self.attention = self._fn(lib.mlxcel_decode_attention, [p, p, p, p, p, p, i, i, i, i, L, f, i, i])
        self.attention_at = self._fn(lib.mlxcel_decode_attention_at, [p, p, p, p, p, p, i, i, i, i, i, L, f, i, i],
                                     ctypes.c_int)
        self.attention_apart = self._fn(lib.mlxcel_decode_attention_apart,
                                        [p, p, p, p, p, p, p, p, i, i, i, i, L, f, i, i], ctypes.c_int)
        self.chunk_attention = self._fn(lib.mlxcel_chunk_attention, [p, p, p, p, p, p, i, i, i, i, i, L, f, i, i],
                                        ctypes.c_int)
        self.chunk_attention_apart = self._fn(lib.mlxcel_chunk_attention_apart,
                                              [p, p, p, p, p, p, p, p, i, i, i, i, i, L, f, i, i], ctypes.c_int)
        self.rope_rows = self._fn(lib.mlxcel_rope_rows, [p, i, i, i, p, p, i])

    @staticmethod
    def _fn(fn: Any, argtypes: list[Any], restype: Any = None) -> Any:
        fn.restype = restype
        fn.argtypes = argtypes
        return fn


def _kernels() -> _Kernels:
    return _Kernels(backend.matmul_shim().lib)


def _p(a: np.ndarray) -> int:
    return a.ctypes.data


def test_rms_norm_matches_numpy() -> None:
    rng = np.random.default_rng(0)
    for rows, n in [(1, 768), (12, 64), (3, 37)]:
        x = rng.standard_normal((rows, n)).astype(np.float32) * 3
        w = rng.standard_normal(n).astype(np.float32)
        out = np.empty_like(x)
        _kernels().rms_norm(_p(x), _p(w), _p(out), rows, n, 1e-5)
        x64 = x.astype(np.float64)
        ref = x64 / np.sqrt((x64 ** 2).mean(axis=1, keepdims=True) + 1e-5) * w
        assert np.abs(out - ref).max() <= KERNEL_RTOL * np.abs(ref).max()


def test_rms_norm_is_mlx_s_bit_for_bit() -> None:
    """The runtime's norms round as mx.fast.rms_norm does, bit for bit (widths a multiple of the
    vector or not, a power of 2 or not): the products after them quantize the rows to 8 bits,
    where an ulp across a rounding tie moves a result by a quantum (a prompt chunk's keys by
    0.4 % on the q4_k_m model: test_a_cold_prompt_chunk_on_the_runtime_leaves_mlx_s_kv). Also on
    a grid of ties: a coarse embedding's values under a gain of ones."""
    rng = np.random.default_rng(5)
    grid = (rng.integers(-15, 16, size=(8, 64)) * 0.1289005).astype(np.float32)
    cases = [(rng.standard_normal((r, n)) * 3, rng.standard_normal(n)) for r, n in [(1, 768), (12, 64), (3, 37), (4, 2560)]]
    for x, w in [*cases, (grid, np.ones(64))]:
        x, w = x.astype(np.float32), w.astype(np.float32)
        out = np.empty_like(x)
        _kernels().rms_norm(_p(x), _p(w), _p(out), x.shape[0], x.shape[1], 1e-5)
        want = np.array(mx.fast.rms_norm(mx.array(x), mx.array(w), 1e-5))
        assert np.array_equal(out, want), (x.shape, np.abs(out - want).max())


@pytest.mark.parametrize("traditional", [False, True])
def test_rope_matches_mx_fast_rope(traditional: bool) -> None:
    """Rotating by the (cos, sin) the decoder takes from the RoPE module itself gives exactly
    what the module gives."""
    rope = nn.RoPE(64, traditional=traditional, base=500000.0)
    angles = RopeAngles([rope], 64)
    x = np.random.default_rng(1).standard_normal((1, 6, 1, 64)).astype(np.float32)
    for pos in (0, 5, 255, 256, 1000):
        cos, sin = angles.row(pos)  # addresses
        ours = x.copy()
        _kernels().rope(_p(ours), 6, 64, cos, sin, traditional)
        theirs = np.array(rope(mx.array(x), offset=pos))
        assert np.abs(ours - theirs).max() <= 1e-6 * np.abs(theirs).max(), pos


def test_swiglu_matches_the_formula_over_extremes() -> None:
    rng = np.random.default_rng(2)
    special = np.array([0.0, -0.0, 1e-30, -1e-30, 80.0, -80.0, 120.0, -120.0, 200.0, -200.0, 1e6, -1e6], np.float32)
    gate = np.concatenate([rng.standard_normal(4093).astype(np.float32) * 8, special])
    up = rng.standard_normal(gate.size).astype(np.float32)
    ours = gate.copy()
    _kernels().swiglu(_p(ours), _p(up), gate.size)
    g64 = gate.astype(np.float64)
    with np.errstate(over="ignore"):
        ref = g64 / (1.0 + np.exp(-g64)) * up
    assert np.isfinite(ours).all()
    # float32 rounding of -gate log2 e before the power: up to ~1.5e-6 relative at |gate| ~ 30;
    # below gate ~ -87 the power is clamped at 2 ** 126 (a result under 1e-36 |gate up| off zero).
    scale = np.maximum(np.abs(ref), np.abs(g64 * up) * 1e-30 + 1e-30)
    assert (np.abs(ours - ref) / scale).max() < 4e-6


def test_rms_norm_add_matches_numpy() -> None:
    """x += RMSNorm(branch) * w (Gemma's post-attention and post-MLP norms), the rest of x kept."""
    rng = np.random.default_rng(4)
    for rows, n in [(1, 768), (5, 64), (2, 37)]:
        branch = rng.standard_normal((rows, n)).astype(np.float32) * 5
        w = rng.standard_normal(n).astype(np.float32)
        x = rng.standard_normal((rows, n)).astype(np.float32)
        out = x.copy()
        _kernels().rms_norm_add(_p(branch), _p(w), _p(out), rows, n, 1e-6)
        b64 = branch.astype(np.float64)
        ref = x + b64 / np.sqrt((b64 ** 2).mean(axis=1, keepdims=True) + 1e-6) * w
        assert np.abs(out - ref).max() <= KERNEL_RTOL * np.abs(ref).max()


def test_gelu_tanh_gating_matches_the_formula_and_mlx() -> None:
    """gelu_tanh(gate) * up against mlx-lm's expression in float64 (0.5 x (1 + tanh(...))), and
    against MLX's own nn.gelu_approx, over the range a model's gates take and extremes."""
    rng = np.random.default_rng(5)
    special = np.array([0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, 10.0, -10.0, 80.0, -80.0, 1e6, -1e6, 1e13, -1e13],
                       np.float32)
    gate = np.concatenate([rng.standard_normal(4093).astype(np.float32) * 4, special])
    up = rng.standard_normal(gate.size).astype(np.float32)
    ours = gate.copy()
    _kernels().gelu_tanh_gate(_p(ours), _p(up), gate.size)
    assert np.isfinite(ours).all()
    g = gate.astype(np.float64)
    u = np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)
    # 0.5 (1 + tanh u) is exactly 1 / (1 + e^(-2u)): the float64 reference in the form that does
    # not cancel to 0 where tanh u rounds to -1 (u < -19 even in float64)
    with np.errstate(over="ignore"):
        ref = g / (1.0 + np.exp(-2.0 * u)) * up
    # float32 rounding of the exponent's argument (|arg| up to ~60 where the result is not
    # negligible) and the polynomial 2 ** x: a few 1e-6 relative; where gelu is below 1e-30 of
    # |gate up| (gate < -12), the result is within that of zero.
    scale = np.maximum(np.abs(ref), np.abs(g * up) * 1e-30 + 1e-30)
    assert (np.abs(ours - ref) / scale).max() < 8e-6
    theirs = np.array(nn.gelu_approx(mx.array(gate)) * mx.array(up))
    # MLX rounds 1 + tanh(u) to float32 where tanh is near -1 (gate below about -3): there its
    # result is off by up to 2^-24 |gate up|, absolute; elsewhere the two agree to float32 rounding.
    assert (np.abs(ours - theirs) <= 4e-6 * np.abs(ref) + 2 ** -23 * np.abs(g * up)).all()


@pytest.mark.parametrize("kv_heads,group,n,peak", [(4, 3, 1, 1), (4, 3, 300, 1), (2, 1, 17, 1), (1, 8, 1025, 1), (4, 3, 300, 60)])
def test_decode_attention_matches_a_reference(kv_heads: int, group: int, n: int, peak: float) -> None:
    """Scores, a softmax and the product by the values per KV head, the new key and value
    written at position n - 1 first; the rest of the cache is left as it was. ``peak`` scales
    the queries: at 60 most weights are below 2 ** -64 of the largest (set to zero)."""
    rng = np.random.default_rng(3)
    d, capacity, pos = 64, n + 40, n - 1
    keys = rng.standard_normal((kv_heads, capacity, d)).astype(np.float32)
    values = rng.standard_normal((kv_heads, capacity, d)).astype(np.float32)
    before_k, before_v = keys.copy(), values.copy()
    q = (rng.standard_normal(kv_heads * group * d) * 2 * peak).astype(np.float32)
    k_new = rng.standard_normal(kv_heads * d).astype(np.float32)
    v_new = rng.standard_normal(kv_heads * d).astype(np.float32)
    out = np.empty(kv_heads * group * d, np.float32)
    scale = d ** -0.5
    _kernels().attention(_p(q), _p(k_new), _p(v_new), _p(keys), _p(values), _p(out), kv_heads, group, d, pos,
                         capacity, scale * cpu_decode.LOG2E, 0, 0)
    assert np.array_equal(keys[:, pos], k_new.reshape(kv_heads, d)) and np.array_equal(values[:, pos], v_new.reshape(kv_heads, d))
    untouched = np.ones(capacity, bool)
    untouched[pos] = False
    assert np.array_equal(keys[:, untouched], before_k[:, untouched]) and np.array_equal(values[:, untouched], before_v[:, untouched])
    k64, v64 = keys[:, :n].astype(np.float64), values[:, :n].astype(np.float64)
    qs = q.reshape(kv_heads, group, d).astype(np.float64)
    s = np.einsum("hgd,htd->hgt", qs, k64) * scale
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    ref = np.einsum("hgt,htd->hgd", w / w.sum(axis=-1, keepdims=True), v64).reshape(-1)
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()


def test_decode_attention_at_a_ring_slot() -> None:
    """A full sliding window's ring: the new key and value go over slot ``write`` (its oldest),
    and the queries see every slot, whatever their order; a slot or a length outside the
    capacity is refused (-1) and nothing is written."""
    rng = np.random.default_rng(6)
    kv_heads, group, d, capacity = 2, 2, 16, 64
    keys = rng.standard_normal((kv_heads, capacity, d)).astype(np.float32)
    values = rng.standard_normal((kv_heads, capacity, d)).astype(np.float32)
    q = rng.standard_normal(kv_heads * group * d).astype(np.float32)
    k_new = rng.standard_normal(kv_heads * d).astype(np.float32)
    v_new = rng.standard_normal(kv_heads * d).astype(np.float32)
    out = np.empty(kv_heads * group * d, np.float32)
    scale = d ** -0.5
    kernels = _kernels()
    before = keys.copy(), values.copy()
    for write, n in [(-1, 64), (64, 64), (3, 0), (3, 65)]:
        assert kernels.attention_at(_p(q), _p(k_new), _p(v_new), _p(keys), _p(values), _p(out), kv_heads, group, d,
                                    write, n, capacity, scale * cpu_decode.LOG2E, 0, 0) == -1
    assert np.array_equal(keys, before[0]) and np.array_equal(values, before[1])
    for write, n in [(17, 64), (0, 64), (63, 64), (5, 6)]:
        assert kernels.attention_at(_p(q), _p(k_new), _p(v_new), _p(keys), _p(values), _p(out), kv_heads, group, d,
                                    write, n, capacity, scale * cpu_decode.LOG2E, 0, 0) == 0
        assert np.array_equal(keys[:, write], k_new.reshape(kv_heads, d))
        assert np.array_equal(values[:, write], v_new.reshape(kv_heads, d))
        k64, v64 = keys[:, :n].astype(np.float64), values[:, :n].astype(np.float64)
        s = np.einsum("hgd,htd->hgt", q.reshape(kv_heads, group, d).astype(np.float64), k64) * scale
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        ref = np.einsum("hgt,htd->hgd", w / w.sum(axis=-1, keepdims=True), v64).reshape(-1)
        assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()
        k_new, v_new = k_new + 1, v_new - 1


def _ids(n: int, seed: int = 0) -> list[int]:
    return [(7 * i + 3 + 13 * seed) % 500 + 10 for i in range(n)]


def _prefill(model: nn.Module, n: int, chunk: int | None = None, seed: int = 0) -> list[KVCache]:
    """A cache after an ``n``-token prompt, fed in chunks of ``chunk`` tokens (default: at once)."""
    cache = make_prompt_cache(model)
    ids = _ids(n, seed)
    chunk = chunk or n
    for start in range(0, n, chunk):
        model(mx.array([ids[start:start + chunk]]), cache=cache)
        mx.eval([c.state for c in cache])
    return cache


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2", "mistral", "gemma3_text", "granite", "seed_oss", "ernie4_5",
                                    "smollm3", "olmo2", "olmo3", "phi3", "glm4", "exaone4", "ministral3",
                                    "starcoder2", "cohere2", "apertus",
                                    pytest.param("exaone", marks=pytest.mark.slow)])  # by default: its Q8_0 row below
def test_decoder_follows_mlx_step_for_step(family: str) -> None:
    """40 greedy steps from a 230-token prompt (the cache grows past 256 positions on the way;
    gemma3's sliding layers, a 64-position window, wrap): each step's logits within LOGITS_RTOL
    of MLX's on its own copy of the cache, the same token, the cache as MLX's update leaves it;
    then MLX continues the decoder's cache to the same logits as its own."""
    loaded = load_model(str(tiny_model(family)), [])
    model, decoder = loaded.model, loaded.decoder
    assert isinstance(decoder, cpu_decode.CpuDecoder)
    ours = _prefill(model, 230)
    theirs, token = follow_mlx(model, decoder, ours, 40, LOGITS_RTOL,
                               after_step=lambda ours, theirs: assert_same_cache(ours, theirs, LOGITS_RTOL))
    assert ours[0].offset == theirs[0].offset == 270
    assert all(c.keys.shape[2] >= 271 for c in ours if type(c) is KVCache)
    assert_mlx_continues(model, ours, theirs, token, LOGITS_RTOL)


def _chunk_logits(model: nn.Module, tokens: list[int], cache: list) -> np.ndarray:
    out = model(mx.array([tokens]), cache=cache)[0, -1]
    mx.eval(out)
    return np.array(out)


@pytest.mark.parametrize("prompt,chunk", [(20, None), (100, None), (100, 50), (63, None), (64, None)])
def test_gemma3_rings_are_left_as_mlx_leaves_them(prompt: int, chunk: int | None) -> None:
    """gemma3's sliding layers from every kind of prompt (shorter than the 64-position window, so
    the ring first grows to it; longer, fed at once or in chunks, so the first step trims it; at
    and next to the window's size): 70 steps, each within LOGITS_RTOL of MLX's, the rings in
    MLX's state (shape, ``_idx``, every slot) after each, wrapping on the way. Then MLX goes on
    from the decoder's cache as from its own: a prompt chunk (its concatenation puts the ring in
    temporal order), a merged batch of one (BatchRotatingKVCache), and, before the ring wraps, a
    trim (the prompt cache's truncation)."""
    from mlx_lm.models.cache import BatchKVCache, BatchRotatingKVCache

    loaded = load_model(str(tiny_model("gemma3_text")), [])
    model, decoder = loaded.model, loaded.decoder
    ours = _prefill(model, prompt, chunk)
    assert any(type(c) is RotatingKVCache for c in ours) and any(type(c) is KVCache for c in ours)
    theirs = copy.deepcopy(ours)
    owned = decode_kv.OwnedCache()
    token = 11
    for step in range(70):
        if prompt + step == 30:  # a trim, while the ring has not wrapped (is_trimmable): both sides
            for c in ours + theirs:
                assert c.is_trimmable()
                c.trim(3)
            token = 17
        got = decoder.step(token, ours, owned).copy()
        want = mlx_logits(model, token, theirs)
        assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max(), step
        assert_same_cache(ours, theirs, LOGITS_RTOL)
        token = int(want.argmax())
    assert any(c._idx < c.offset for c in ours if type(c) is RotatingKVCache)  # wrapped
    merged = [(BatchRotatingKVCache if type(c) is RotatingKVCache else BatchKVCache).merge([c]) for c in copy.deepcopy(ours)]
    batch_theirs = [(BatchRotatingKVCache if type(c) is RotatingKVCache else BatchKVCache).merge([c]) for c in copy.deepcopy(theirs)]
    got, want = mlx_logits(model, token, merged), mlx_logits(model, token, batch_theirs)
    assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max()
    chunk_tokens = [token, 40, 41, 42, 43, 44]
    got, want = _chunk_logits(model, chunk_tokens, ours), _chunk_logits(model, chunk_tokens, theirs)
    assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max()
    token = int(want.argmax())
    for _ in range(3):  # and the decoder takes the cache MLX's chunk left (copied once: MLX replaced it)
        got = decoder.step(token, ours, owned).copy()
        want = mlx_logits(model, token, theirs)
        assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max()
        assert_same_cache(ours, theirs, LOGITS_RTOL)
        token = int(want.argmax())


def _block_model(family: str, gguf_type: str, size: str = "tiny") -> tuple[nn.Module, cpu_decode.CpuDecoder]:
    """A GGUF of the factory's model loaded as the server loads it (weights in the file's
    blocks on the CPU), and its decoder; every projection, and the embedding, in blocks."""
    loaded = load_model(str(ensure_gguf(family, size, gguf_type, cache_dir=MODEL_CACHE)), [])
    decoder = loaded.decoder
    assert isinstance(decoder, cpu_decode.CpuDecoder), cpu_decode.unsupported(loaded.model)
    projections = [getattr(layer, n) for layer in decoder.layers
                   for n in ("q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up")]
    assert all(lin.block is not None for lin in projections if lin is not None) and isinstance(decoder.embed, cpu_decode.BlockWeight)
    return loaded.model, decoder


def _follow_blocks(model: nn.Module, decoder: cpu_decode.CpuDecoder, prompts: list[tuple[int, int]], steps: int) -> tuple[int, int]:
    """Teacher-forced steps (both sides fed MLX's greedy token) from each (length, seed) prompt:
    every step within BLOCK_RTOL of MLX's, the same token wherever MLX's top two are further
    apart than the tolerance allows either side to move, the caches in MLX's state. Returns
    (bit-identical steps, steps)."""
    exact = total = 0
    for n, seed in prompts:
        same = follow_mlx_teacher_forced(model, decoder, _prefill(model, n, seed=seed), steps, BLOCK_RTOL,
                                         after_step=lambda ours, theirs: assert_same_cache(ours, theirs, BLOCK_RTOL)).exact
        exact, total = exact + same, total + steps
    return exact, total


@pytest.mark.parametrize("family,gguf_type", [
    ("llama", "q4_0"), ("mistral", "q4_1"), ("qwen2", "q5_1"), ("qwen2", "q8_0"), ("qwen3", "q8_0"),
    ("qwen3", "q4_k_m"), ("gemma3_text", "q8_0"), ("gemma3_text", "q4_0"), ("gemma3_text", "q4_k_m"),
    ("gemma3_text", "f16"), ("llama", "mxfp4"), ("qwen3", "iq4_nl"), ("granite", "q8_0"), ("seed_oss", "q4_0"),
    ("ernie4_5", "q8_0"), ("smollm3", "q4_k_m"),
    ("olmo2", "q8_0"), ("olmo3", "q4_0"), ("phi3", "q8_0"), ("glm4", "q4_k_m"),
    ("exaone4", "q8_0"), ("ministral3", "q4_0"), ("starcoder2", "q8_0"), ("cohere2", "q8_0"), ("apertus", "q8_0"),
    ("exaone", "q8_0"),
])
def test_block_models_follow_mlx_step_for_step(family: str, gguf_type: str) -> None:
    """Weights in ggml's blocks (tiny files: K-quant types fall back to Q5_0/Q8_0 mixes, as
    llama-quantize does for 64-value rows; qwen2 keeps its q/k/v biases as float32 next to its
    blocks; gemma3's tied head is its block embedding): 30 teacher-forced steps from each of
    two prompts (gemma3's rings wrap), within BLOCK_RTOL of MLX's step on the same block model.
    Some steps are bit-identical (the same ggml products on the same activations): a runtime
    that multiplied differently (a float32 expansion, another kernel) would have none."""
    model, decoder = _block_model(family, gguf_type)
    exact, total = _follow_blocks(model, decoder, [(40, 0), (150, 1)], 30)
    print(f"{family} {gguf_type}: {exact} of {total} steps bit-identical to MLX's")
    assert exact >= 1


def test_k_quant_gemma3_follows_mlx_step_for_step() -> None:
    """The small gemma3 in Q4_K_M (rows of 768: real Q4_K and Q6_K blocks, the head Q6_K as
    llama-quantize writes it): 8 teacher-forced steps within BLOCK_RTOL of MLX's."""
    model, decoder = _block_model("gemma3_text", "q4_k_m", size="small")
    types = {lin.block.ggml_type for layer in decoder.layers for lin in (layer.q, layer.down)}
    assert {12, 14} <= types  # GGML_TYPE_Q4_K, GGML_TYPE_Q6_K
    exact, total = _follow_blocks(model, decoder, [(100, 0)], 8)
    print(f"gemma3_text small q4_k_m: {exact} of {total} steps bit-identical to MLX's")


@pytest.mark.parametrize("family,gguf_type", [("llama", None), ("qwen3", None), ("gemma3_text", None),
                                               ("qwen2", "q5_1"), ("gemma3_text", "q4_0"), ("mistral", "q8_0"),
                                               ("llama", "q4_1"), ("olmo3", None), ("smollm3", "q8_0"),
                                               ("phi3", "q8_0"), ("glm4", None), ("ministral3", "q8_0")])
def test_rows_stepped_together_are_bit_identical_to_rows_alone(family: str, gguf_type: str | None) -> None:
    """Three sequences at different positions (one past a 256-position block of angles; gemma3's
    rings in different states), stepped together for 6 steps, give exactly the logits each gives
    stepped alone from a copy: float32 weights, and weights in ggml's blocks."""
    if gguf_type is None:
        loaded = load_model(str(tiny_model(family)), [])
        model, decoder = loaded.model, loaded.decoder
    else:
        model, decoder = _block_model(family, gguf_type)
    together = [_prefill(model, n) for n in (20, 250, 300)]
    assert_rows_together_equal_rows_alone(decoder, together, 6)
    assert [c[0].offset for c in together] == [26, 256, 306]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("prompt", [63, 64, 65, 66, 255])
def test_a_step_on_shared_arrays_is_bit_identical_and_writes_nothing_shared(family: str, prompt: int) -> None:
    """A prompt-cache hit's first step reads the adopted arrays in place (no copy) and keeps its
    new key and value apart: its logits, the cache as anyone evaluates it then, and every later
    step equal exactly those of the decoder on its own copy; the shared arrays are unchanged.
    Prompts cover each remainder of the attended length by the kernel's 4-key blocks."""
    loaded = load_model(str(tiny_model(family)), [])
    model, decoder = loaded.model, loaded.decoder
    shared = _prefill(model, prompt)
    before = [(np.array(c.keys), np.array(c.values)) for c in shared]
    hit = [copy.copy(c) for c in shared]  # what adoption does: new cache objects, the same arrays
    own = copy.deepcopy(shared)
    owned_hit, owned_own = decode_kv.OwnedCache(), decode_kv.OwnedCache()
    decoder.kv.own(own, owned_own, prompt)  # the usual path: the decoder's own copy first
    got, want = decoder.step(11, hit, owned_hit).copy(), decoder.step(11, own, owned_own).copy()
    assert np.array_equal(got, want)
    assert owned_hit.apart is not None and owned_hit.arrays == []  # nothing was copied
    for a, b in zip(hit, own):  # the cache as donation or MLX would read it now
        assert a.offset == b.offset == prompt + 1
        assert np.array_equal(np.array(a.keys[..., : a.offset, :]), np.array(b.keys[..., : b.offset, :]))
        assert np.array_equal(np.array(a.values[..., : a.offset, :]), np.array(b.values[..., : b.offset, :]))
    token = int(want.argmax())
    for _ in range(3):  # the next step makes the decoder's own buffers from the shared ones
        got, want = decoder.step(token, hit, owned_hit).copy(), decoder.step(token, own, owned_own).copy()
        assert np.array_equal(got, want)
        token = int(want.argmax())
    assert owned_hit.apart is None and owned_hit.holds(hit)
    for c, (keys, values) in zip(shared, before):
        assert np.array_equal(np.array(c.keys), keys) and np.array_equal(np.array(c.values), values)


def test_a_step_on_shared_arrays_then_someone_elses_step_stays_right() -> None:
    """After a step kept apart, MLX's own step (or a batch) extends the cache: it reads the lazy
    concatenation, and the decoder, seeing arrays it did not make, copies them as usual."""
    loaded = load_model(str(tiny_model("llama")), [])
    model, decoder = loaded.model, loaded.decoder
    shared = _prefill(model, 40)
    hit, theirs = [copy.copy(c) for c in shared], copy.deepcopy(shared)
    owned = decode_kv.OwnedCache()
    decoder.step(11, hit, owned)
    mlx_logits(model, 11, theirs)
    got, want = mlx_logits(model, 12, hit), mlx_logits(model, 12, theirs)
    assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max()
    got, want = decoder.step(13, hit, owned).copy(), mlx_logits(model, 13, theirs)
    assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max() and hit[0].offset == 43


def test_a_failed_step_advances_no_cache() -> None:
    loaded = load_model(str(tiny_model("llama")), [])
    caches = [_prefill(loaded.model, n) for n in (10, 12)]
    owned = [decode_kv.OwnedCache() for _ in caches]
    with pytest.raises(ValueError):
        loaded.decoder.step_rows([5, 10**9], caches, owned)
    assert [c[0].offset for c in caches] == [10, 12]


def test_arrays_held_elsewhere_are_never_written() -> None:
    """A prompt-cache entry or a sibling holds the cache's arrays (here: views of them): the
    decoder copies each layer into its own buffer once and writes only there."""
    loaded = load_model(str(tiny_model("llama")), [])
    cache = _prefill(loaded.model, 64)
    held = [(c.keys, c.values, c.keys[..., :64, :]) for c in cache]
    saved = [tuple(np.array(a) for a in arrays) for arrays in held]
    owned = decode_kv.OwnedCache()
    for token in (5, 6, 7):
        loaded.decoder.step(token, cache, owned)
    for c, arrays, copies in zip(cache, held, saved):
        assert c.keys is not arrays[0] and c.values is not arrays[1]
        for a, b in zip(arrays, copies):
            assert np.array_equal(np.array(a), b)
    first = [a for a, _ in owned.arrays]
    loaded.decoder.step(8, cache, owned)
    assert all(c.keys is a for c, a in zip(cache, first))
    cache[0].keys = cache[0].keys + 0  # replaced by someone else (MLX's own step): copied again
    assert loaded.decoder.can_run(cache, owned)
    replaced = cache[0].keys
    loaded.decoder.step(9, cache, owned)
    assert cache[0].keys is not replaced and cache[0].offset == 69


def test_a_token_outside_the_vocabulary_is_an_error_and_changes_nothing() -> None:
    loaded = load_model(str(tiny_model("llama")), [])
    cache = _prefill(loaded.model, 16)
    owned = decode_kv.OwnedCache()
    for bad in (-1, loaded.decoder.embed.shape[0]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            loaded.decoder.step(bad, cache, owned)
    assert cache[0].offset == 16 and not owned.arrays


def test_caches_it_does_not_take() -> None:
    loaded = load_model(str(tiny_model("llama")), [])
    owned = decode_kv.OwnedCache()
    assert not loaded.decoder.can_run([RotatingKVCache(max_size=64) for _ in loaded.model.layers], owned)
    batch = _prefill(loaded.model, 8)
    for c in batch:
        c.keys, c.values = mx.concatenate([c.keys] * 2), mx.concatenate([c.values] * 2)
    assert not loaded.decoder.can_run(batch, owned)
    assert not loaded.decoder.can_run(_prefill(loaded.model, 8)[:-1], owned)  # a layer short


def test_gemma3_caches_it_does_not_take() -> None:
    """Each layer must hold the cache mlx-lm's make_cache gives it (a ring of the model's window
    for a sliding layer), in a state mlx-lm's update could write one token into; otherwise the
    sequence keeps MLX's step, and a step asked anyway raises before changing anything."""
    loaded = load_model(str(tiny_model("gemma3_text")), [])
    model, decoder = loaded.model, loaded.decoder
    owned = decode_kv.OwnedCache()
    good = _prefill(model, 30)
    mlx_logits(model, 5, good)  # a step: the rings grow to the window (64 slots, 31 used, _idx 31)
    assert decoder.can_run(good, owned)
    sliding = [i for i, c in enumerate(good) if type(c) is RotatingKVCache]
    assert sliding == [i for i, layer in enumerate(model.layers) if layer.self_attn.is_sliding] and sliding

    def changed(fn: object) -> list:
        cache = copy.deepcopy(good)
        fn(cache)  # type: ignore[operator]
        return cache

    def plain_layer(cache: list) -> None:  # a KVCache where the model has a ring
        kv = KVCache()
        kv.update_and_fetch(cache[sliding[0]].keys, cache[sliding[0]].values)
        cache[sliding[0]] = kv

    def wider(cache: list) -> None:
        cache[sliding[0]].max_size = 128

    def keep(cache: list) -> None:
        cache[sliding[0]].keep = 4

    def lost(cache: list) -> None:  # a slot outside the buffer (a trim past the written slots)
        cache[sliding[0]]._idx = -2

    for fn in (plain_layer, wider, keep, lost):
        cache = changed(fn)
        assert not decoder.can_run(cache, owned), fn.__name__
    cache = changed(lost)
    offsets = [c.offset for c in cache]
    with pytest.raises(RuntimeError, match="sliding-window cache"):
        decoder.step(5, cache, decode_kv.OwnedCache())
    assert [c.offset for c in cache] == offsets and cache[sliding[0]]._idx == -2


@pytest.mark.parametrize("family,reason", [
    # the float32 directories run (their experts: test_cpu_decode_moe_f32.py); cast to bfloat16 they do not
    ("qwen3_next", "gated delta-net layers (qwen3_next): delta-net parameters other than float32"),
    ("lfm2_moe", "short-convolution layers (lfm2_moe): a short convolution of unexpected shape or type"),
])
def test_other_families_keep_mlx_and_say_why(family: str, reason: str) -> None:
    loaded = load_model(str(tiny_model(family)), [])
    assert loaded.decoder is not None
    loaded.model.set_dtype(mx.bfloat16)
    assert (cpu_decode.unsupported(loaded.model) or "").startswith(reason)


def test_a_gguf_family_it_does_not_take_keeps_mlx_and_the_log_says_why(caplog: pytest.LogCaptureFixture,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantized GGUF of a family the runtime does not know loads with block weights and keeps
    MLX's step; the start-up log names the reason. (Every factory family's GGUF runs on the
    runtime now, so one is taken off its table: the generic path's EXAONE 3.5.)"""
    import logging

    from mlxcel_compat.runtime import decode_families

    monkeypatch.setattr(decode_families, "MODEL_TYPES", tuple(t for t in decode_families.MODEL_TYPES if t != "exaone"))
    with caplog.at_level(logging.INFO, logger="mlxcel_compat"):
        loaded = load_model(str(ensure_gguf("exaone", "tiny", "q8_0", cache_dir=MODEL_CACHE)), [])
    assert loaded.decoder is None
    assert any(type(m).__name__ == "BlockLinear" for _, m in loaded.model.named_modules())
    assert "decode step: MLX (CPU decode runtime not used: model type 'exaone'" in caplog.text


def test_layouts_it_does_not_take_say_why() -> None:
    """A gemma3 whose norm is not Gemma's (1 + w), and a llama with sliding-window layers (mlx-lm's
    llama supports them; the runtime does not): MLX's step, with the reason."""
    gemma = load_model(str(tiny_model("gemma3_text")), []).model
    assert cpu_decode.unsupported(gemma) is None
    gemma.model.layers[1].pre_feedforward_layernorm = nn.RMSNorm(gemma.args.hidden_size)
    assert cpu_decode.unsupported(gemma) == "norms other than Gemma's RMSNorm"
    llama = load_model(str(tiny_model("llama")), []).model
    llama.args.sliding_window, llama.args.layer_types = 32, ["sliding_attention", "full_attention"]
    assert cpu_decode.unsupported(llama) == "sliding-window layers"


def test_quantized_weights_and_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = load_model(str(tiny_model("llama")), [])
    monkeypatch.setenv("MLXCEL_CPU_DECODE", "0")
    assert cpu_decode.build(loaded.model, backend.matmul_shim()) == "off (MLXCEL_CPU_DECODE=0)"
    monkeypatch.delenv("MLXCEL_CPU_DECODE")
    assert cpu_decode.build(loaded.model, None) == "the BLAS shim's kernels are not loaded"
    nn.quantize(loaded.model, group_size=32, bits=8)
    assert cpu_decode.unsupported(loaded.model) == "quantized weights"


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_engine_batches_through_the_runtime_exactly_like_lone_runs(family: str) -> None:
    """Three requests admitted together decode in runtime passes of several rows, and each
    gives exactly the tokens it gives alone (rows are bit-identical to lone steps)."""
    import queue

    from tests.engine.test_batching import run_logged

    h = EngineHarness(tiny_model(family), n_parallel=4)
    try:
        prompts = [[(17 * i + 31 * r) % 900 + 20 for i in range(40 + 7 * r)] for r in range(3)]
        requests = [h.request(p, n_predict=24, ignore_eos=True, cache=False) for p in prompts]
        log, events = run_logged(h, requests, [queue.Queue() for _ in requests])
        assert any(rows > 1 and n == 1 for rows, n in log.shapes)
        for prompt, seen in zip(prompts, events):
            tokens = [e.token for e in seen if isinstance(e, TokenEvent)]
            assert len(tokens) == 24
            assert tokens == h.run(prompt, n_predict=24, ignore_eos=True, cache=False).tokens
    finally:
        h.close()


def test_a_row_the_runtime_cannot_take_turns_the_batch_back_into_a_merged_one() -> None:
    """Every cache of a model the runtime takes is a plain KVCache, so this is the fallback for
    what should not happen: a row whose layers are another cache class joins a runtime batch.
    The rows already in it move into one merged batch cache, and every row decodes on, in
    MLX's batched pass, like a lone run wherever that run's choice was decided."""
    from mlxcel_compat.engine.batch import DecodeBatch
    from mlxcel_compat.engine.factory import make_sequence
    from tests.engine.harness import Run
    from tests.engine.test_batching import agree_where_decided

    class OtherKV(KVCache):
        pass

    h = EngineHarness(tiny_model("llama"), n_parallel=4)
    try:
        prompts = [[(13 * i + 7 * r) % 900 + 20 for i in range(30 + 9 * r)] for r in range(2)]
        lone = [h.run(p, n_predict=8, n_probs=2, ignore_eos=True, cache=False) for p in prompts]
        events: list = []

        def on_engine() -> dict:
            engine = h.engine
            seqs = [make_sequence(engine, h.request(p, n_predict=8, ignore_eos=True, cache=False), events.append, i)
                    for i, p in enumerate(prompts)]
            for seq in seqs:
                while not seq.prompt_ready:
                    seq.prefill_step()
            others = []
            for c in seqs[1].cache:
                other = OtherKV()
                # copies: the runtime's own buffers (its prefill made them) would be taken by identity
                other.keys, other.values, other.offset = mx.array(np.array(c.keys)), mx.array(np.array(c.values)), c.offset
                others.append(other)
            seqs[1].cache = others
            batch = DecodeBatch(engine.loaded.model, engine.loaded.decoder)
            batch.add(seqs[0])
            runtime_then = batch.decoder is not None and seqs[0].cache != []
            batch.add(seqs[1])
            merged = batch.decoder is None and batch.cache is not None and seqs[0].cache == []
            while len(batch):
                _, failed = batch.step()
                assert not failed
            return {"runtime_then": runtime_then, "merged": merged,
                    "tokens": {seq.request.task_id: list(seq.generated) for seq in seqs}, "ids": [s.request.task_id for s in seqs]}

        out = h.on_engine(on_engine)
        assert out["runtime_then"] and out["merged"]
        for task_id, alone in zip(out["ids"], lone):
            tokens = out["tokens"][task_id]
            assert len(tokens) == 8
            agree_where_decided(Run(tokens=tokens), alone)
    finally:
        h.close()


def test_engine_tokens_equal_with_and_without_the_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy generation through the engine (prefill, the pipelined loop, the prompt cache)
    gives the same tokens with the runtime as with MLX's step, and a prompt-cache hit gives
    the same tokens as the cold run."""
    prompt = [(11 * i + 7) % 900 + 20 for i in range(300)]
    runs = {}
    for on in (True, False):
        monkeypatch.setenv("MLXCEL_CPU_DECODE", "1" if on else "0")
        h = EngineHarness(tiny_model("llama"))
        try:
            assert (h.engine.loaded.decoder is not None) == on
            cold = h.run(prompt, n_predict=48, ignore_eos=True)
            hit = h.run(prompt, n_predict=48, ignore_eos=True)
            assert hit.finish.n_cached == len(prompt) - 1
            assert hit.tokens == cold.tokens
            if on:  # every row of both runs: the cold run's prompt tail past its last chunk
                # (300 - 288 = 12 tokens, rows of one step) or the hit's last prompt token, then
                # each token fed back
                assert h.engine.loaded.decoder.steps == (12 + 47) + (1 + 47)
                # and the cold run's chunks before that tail, one prefill each (no output head)
                assert h.engine.loaded.decoder.prefilled == 288
            runs[on] = cold.tokens
        finally:
            h.close()
    assert len(runs[True]) == 48 and runs[True] == runs[False]


def test_engine_gemma3_tokens_equal_with_and_without_the_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """gemma3 through the engine: its sliding-window rings wrap in the prompt and while decoding,
    its prompt cache is the session snapshot store (a sliding window cannot be cut back). A
    cold run and one restored from a boundary snapshot give the same greedy tokens and top
    log-probabilities (within 1e-4) with the runtime as with MLX's step."""
    import random

    rng = random.Random(7)
    history = [rng.randrange(8000) for _ in range(100)]
    first, second = history + [rng.randrange(8000) for _ in range(12)], history + [rng.randrange(8000) for _ in range(15)]
    runs = {}
    for on in (True, False):
        monkeypatch.setenv("MLXCEL_CPU_DECODE", "1" if on else "0")
        h = EngineHarness(tiny_model("gemma3_text"), batch_size=32, min_prefix=8)
        try:
            assert (h.engine.loaded.decoder is not None) == on
            h.run(first, n_predict=4, boundary=len(history), session="x")
            warm = h.run(second, n_predict=40, n_probs=2, ignore_eos=True, boundary=len(history), session="x")
            assert warm.finish.n_cached == len(history)
            cold = h.run(second, n_predict=40, n_probs=2, ignore_eos=True, cache=False)
            if on:
                # The first two runs restart at the boundary (100, off the chunk grid): their
                # rest takes the last prompt token along (Sequence.prompt_tail), one step fewer.
                assert h.engine.loaded.decoder.steps == 3 + 39 + 40
            runs[on] = (warm, cold)
        finally:
            h.close()
    for with_runtime, without in zip(runs[True], runs[False]):
        assert len(with_runtime.tokens) == 40 and with_runtime.tokens == without.tokens
        for a, b in zip(with_runtime.logprobs, without.logprobs):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
    print("gemma3 tokens:", runs[True][1].tokens)


def test_engine_sends_each_token_before_the_next_step() -> None:
    """With the runtime, a decode step returns finished, so pipelining cannot hide it: each token
    is sent before the step that feeds it back runs. On a full prompt-cache hit the first token
    then leaves after one step (the last prompt token), not two; the tokens are the cold run's."""
    import queue

    from tests.engine.harness import collect

    prompt = [(13 * i + 5) % 900 + 20 for i in range(200)]
    h = EngineHarness(tiny_model("llama"))
    try:
        decoder = h.engine.loaded.decoder
        assert decoder is not None
        cold = h.run(prompt, n_predict=6, ignore_eos=True)
        before = decoder.steps
        events: queue.Queue = queue.Queue()
        steps_at_token: list[int] = []

        def sink(event: object) -> None:  # called on the engine thread, as the event is sent
            if isinstance(event, TokenEvent):
                steps_at_token.append(decoder.steps - before)
            events.put(event)

        h.submit(prompt, sink, n_predict=6, ignore_eos=True)
        hit = collect(events)
        assert hit.finish.n_cached == len(prompt) - 1
        assert hit.tokens == cold.tokens
        assert steps_at_token == [1, 2, 3, 4, 5, 6]  # token k is sent after k steps, never k + 1
        assert decoder.steps - before == 6  # the last token is never fed back
    finally:
        h.close()


@pytest.mark.parametrize("kv_heads,group,pos,rows", [(4, 3, 1007, 65), (2, 1, 0, 17), (1, 8, 1020, 4), (4, 3, 1, 1), (4, 3, 200, 64)])
def test_chunk_attention_matches_a_causal_reference(kv_heads: int, group: int, pos: int, rows: int) -> None:
    """A prompt chunk's attention (``mlxcel_chunk_attention``): the rows' keys and values written
    at positions pos .. pos + rows - 1 first (nothing else in the cache touched), row r attending
    positions [0, pos + r]; against float64 NumPy. Lengths cross the kernel's 16-query blocks,
    its vector widths and the padding of its transposed keys; too many rows are refused."""
    rng = np.random.default_rng(4)
    d, capacity = 64, pos + rows + 30
    keys = rng.standard_normal((kv_heads, capacity, d)).astype(np.float32)
    values = rng.standard_normal((kv_heads, capacity, d)).astype(np.float32)
    before_k, before_v = keys.copy(), values.copy()
    q = (rng.standard_normal((rows, kv_heads * group * d)) * 2).astype(np.float32)
    k_new = rng.standard_normal((rows, kv_heads * d)).astype(np.float32)
    v_new = rng.standard_normal((rows, kv_heads * d)).astype(np.float32)
    out = np.empty((rows, kv_heads * group * d), np.float32)
    scale, k = d ** -0.5, _kernels()
    assert k.chunk_attention(_p(q), _p(k_new), _p(v_new), _p(keys), _p(values), _p(out), rows, kv_heads, group, d,
                             pos, capacity, scale * cpu_decode.LOG2E, 0, 0) == 0
    span = slice(pos, pos + rows)
    assert np.array_equal(keys[:, span], k_new.reshape(rows, kv_heads, d).transpose(1, 0, 2))
    assert np.array_equal(values[:, span], v_new.reshape(rows, kv_heads, d).transpose(1, 0, 2))
    untouched = np.ones(capacity, bool)
    untouched[span] = False
    assert np.array_equal(keys[:, untouched], before_k[:, untouched]) and np.array_equal(values[:, untouched], before_v[:, untouched])
    n = pos + rows
    s = np.einsum("rhgd,htd->rhgt", q.reshape(rows, kv_heads, group, d).astype(np.float64), keys[:, :n].astype(np.float64)) * scale
    s = np.where((np.arange(n)[None, :] > (pos + np.arange(rows))[:, None])[:, None, None, :], -np.inf, s)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    ref = np.einsum("rhgt,htd->rhgd", w / w.sum(axis=-1, keepdims=True), values[:, :n].astype(np.float64)).reshape(rows, -1)
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()
    assert k.chunk_attention(_p(q), _p(k_new), _p(v_new), _p(keys), _p(values), _p(out), rows, kv_heads, group, d,
                             capacity - rows + 1, capacity, scale, 0, 0) == -1


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("prompt,rest", [(69, 30), (250, 40), (40, 2), (300, 130)])
def test_prefill_of_a_hits_rest_matches_mlx_and_writes_nothing_shared(family: str, prompt: int, rest: int) -> None:
    """A hit's rest fed by ``prefill`` (one chunk: the GEMM, the chunk attention, the head on the
    last row) against MLX's pass over the same rest on a copy of the cache: the last row's
    logits within LOGITS_RTOL, the cache's keys and values too, and then steps continue from
    either to the same logits. The adopted arrays are read in place and never written (the rows
    kept apart, the copy made once by the next step); on the decoder's own buffers the same rest
    gives the same logits bit for bit. Rests cross a 256-position block of RoPE angles and the
    capacity's growth."""
    loaded = load_model(str(tiny_model(family)), [])
    model, decoder = loaded.model, loaded.decoder
    shared = _prefill(model, prompt)
    before = [(np.array(c.keys), np.array(c.values)) for c in shared]
    hit, theirs = [copy.copy(c) for c in shared], copy.deepcopy(shared)
    ids = _ids(rest, seed=3)
    owned = decode_kv.OwnedCache()
    steps, fed = decoder.steps, decoder.prefilled
    got = first = decoder.prefill(ids, hit, owned).copy()
    assert decoder.steps == steps and decoder.prefilled == fed + rest
    want = np.array(model(mx.array([ids]), cache=theirs)[0, -1])
    assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max()
    assert_same_cache(hit, theirs, LOGITS_RTOL)
    assert owned.apart is not None and owned.arrays == []  # read in place: nothing copied yet
    token = int(want.argmax())
    for step in range(3):  # the first step makes the decoder's own buffers, the next ones keep them
        got, want = decoder.step(token, hit, owned).copy(), mlx_logits(model, token, theirs)
        assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max()
        token = int(want.argmax())
        if step == 0:
            buffers = [a for a, _ in owned.arrays]
    assert owned.holds(hit) and all(c.keys is a for c, a in zip(hit, buffers))
    # The same rest on the decoder's own copy of the cache: bit-identical logits (the kernel
    # reads the rows apart in the same order as from its own buffers).
    own = copy.deepcopy(shared)
    owned_own = decode_kv.OwnedCache()
    decoder.kv.own(own, owned_own, prompt)
    again = decoder.prefill(ids, own, owned_own).copy()
    assert owned_own.apart is None and np.array_equal(again, first)
    for c, (keys, values) in zip(shared, before):
        assert np.array_equal(np.array(c.keys), keys) and np.array_equal(np.array(c.values), values)


def test_steps_hold_the_gil_and_prompt_chunks_release_it() -> None:
    """A decode step of up to GIL_HELD_ROWS_MAX rows on a small model is one call made holding
    the GIL (``blas_shim.holding_the_gil``: no other thread's Python can delay its return); a
    prompt chunk, however short, releases it (the HTTP thread keeps running during its long
    products), as a step of a big model does (``GIL_HELD_WEIGHT_BYTES_MAX``) and every step
    while a response is streamed (``blas_shim.StreamedConsumers``)."""
    loaded = load_model(str(tiny_model("llama")), [])
    model, decoder = loaded.model, loaded.decoder
    native = decoder.native
    pythonapi = ctypes._FUNCFLAG_PYTHONAPI
    assert native.run_held._flags_ & pythonapi and not native.run_released._flags_ & pythonapi
    assert native.hold_gil
    calls: list[str] = []

    def counted(name: str, fn: Any) -> Any:
        def call(*args: Any) -> int:
            calls.append(name)
            return fn(*args)
        return call

    native.run_held, native.run_released = counted("held", native.run_held), counted("released", native.run_released)
    cache, owned = _prefill(model, 40), decode_kv.OwnedCache()
    decoder.prefill(_ids(blas_shim.GIL_HELD_ROWS_MAX + 1, seed=5), cache, owned)
    decoder.step(7, cache, owned)
    decoder.prefill(_ids(2, seed=6), cache, owned)
    decoder.step_rows([8, 9], [cache, _prefill(model, 12)], [owned, decode_kv.OwnedCache()])
    assert calls == ["released", "held", "released", "held"]
    blas_shim.StreamedConsumers.started()  # a streamed response: the event loop runs between tokens
    try:
        decoder.step(10, cache, owned)
    finally:
        blas_shim.StreamedConsumers.ended()
    decoder.step(11, cache, owned)
    assert calls[-2:] == ["released", "held"]
    native.hold_gil = False  # a big model's
    decoder.step(12, cache, owned)
    assert calls[-1] == "released"


@pytest.mark.parametrize("family,gguf_type", [("llama", None), ("qwen3", None), ("llama", "q8_0"), ("llama", "q4_k_m"),
                                               ("granite", None), ("smollm3", None), ("olmo2", None),
                                               ("ernie4_5", "q8_0"), ("phi3", None), ("glm4", "q8_0"),
                                               ("ministral3", None)])
def test_a_cold_prompt_chunk_on_the_runtime_leaves_mlx_s_kv(family: str, gguf_type: str | None) -> None:
    """``prefill(..., logits=False)`` on an empty cache (``can_prefill``; gemma3's rings too):
    its own buffers, the keys and values MLX's chunk leaves to LOGITS_RTOL (the same
    products: float32 GEMM, or for blocks the chunks' path, tiles or ggml's prompt products), in
    two chunks as in one, and the next step's logits too; no logits computed."""
    if gguf_type is None:
        loaded = load_model(str(tiny_model(family)), [])
        model, decoder = loaded.model, loaded.decoder
    else:
        model, decoder = _block_model(family, gguf_type)
    ids = _ids(70, seed=31)
    theirs = make_prompt_cache(model)
    model(mx.array([ids]), cache=theirs)
    mx.eval([c.state for c in theirs])
    for split in (70, 40):
        ours, owned = make_prompt_cache(model), decode_kv.OwnedCache()
        assert decoder.can_prefill(ours, owned) and not decoder.can_step_tokens(ours, owned)
        fed = decoder.prefilled
        assert decoder.prefill(ids[:split], ours, owned, logits=False) is None
        if split < 70:
            decoder.prefill(ids[split:], ours, owned, logits=False)
        assert decoder.prefilled == fed + 70 and owned.holds(ours) and all(c.offset == 70 for c in ours)
        assert_same_cache(ours, theirs, LOGITS_RTOL)
        got, want = decoder.step(5, ours, owned).copy(), mlx_logits(model, 5, copy.deepcopy(theirs))
        assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max()
    gemma = load_model(str(tiny_model("gemma3_text")), [])  # sliding-window rings (and OLMo 3's): tests/runtime/test_ring_chunks.py
    assert gemma.decoder.can_prefill(make_prompt_cache(gemma.model), decode_kv.OwnedCache())


@pytest.mark.parametrize("family,gguf_type", [("llama", None), ("llama", "q4_k_m")])
def test_prompt_chunks_of_several_sequences_in_one_pass_equal_each_alone(family: str, gguf_type: str | None) -> None:
    """``prefill_rows``: chunks of three sequences (an empty cache, one holding its own prefix,
    and a hit's adopted arrays, which stay unwritten) in one pass leave each cache as its own
    ``prefill`` does: bit for bit where the products of a row do not depend on the others (ggml's
    prompt products of K-quant blocks: the small model, whose rows fill whole K-quant blocks),
    to float32 rounding for float32 GEMMs, whose blocking follows the row count; each cache
    advanced by its own chunk, and the next steps agree too."""
    if gguf_type is None:
        loaded = load_model(str(tiny_model(family)), [])
        model, decoder = loaded.model, loaded.decoder
    else:
        model, decoder = _block_model(family, gguf_type, size="small")
    exact = gguf_type is not None

    def start() -> tuple[list[list], list[decode_kv.OwnedCache]]:
        caches, owned = [make_prompt_cache(model), make_prompt_cache(model), _prefill(model, 20, seed=41)], []
        for _ in range(3):
            owned.append(decode_kv.OwnedCache())
        decoder.prefill(_ids(12, seed=42), caches[1], owned[1], logits=False)  # its own buffers now
        return caches, owned

    chunks = [_ids(30, seed=43), _ids(9, seed=44), _ids(17, seed=45)]
    together, owned_together = start()
    shared = [(np.array(c.keys), np.array(c.values)) for c in together[2]]
    fed = decoder.prefilled
    assert decoder.prefill_rows(chunks, together, owned_together) is None
    assert decoder.prefilled == fed + 56
    assert [c[0].offset for c in together] == [30, 21, 37]
    for c, (keys, values) in zip(together[2], shared):  # the hit's arrays were read in place
        assert np.array_equal(np.array(c.keys)[:, :, :20], keys[:, :, :20])
    alone, owned_alone = start()
    for chunk, cache, owned in zip(chunks, alone, owned_alone):
        decoder.prefill(chunk, cache, owned, logits=False)
    for cache_t, owned_t, cache_a, owned_a in zip(together, owned_together, alone, owned_alone):
        n = cache_t[0].offset
        for a, b in zip(cache_t, cache_a):
            ka, kb = np.array(a.keys)[:, :, :n], np.array(b.keys)[:, :, :n]
            va, vb = np.array(a.values)[:, :, :n], np.array(b.values)[:, :, :n]
            if exact:
                assert np.array_equal(ka, kb) and np.array_equal(va, vb)
            else:
                assert np.abs(ka - kb).max() <= LOGITS_RTOL * np.abs(kb).max()
                assert np.abs(va - vb).max() <= LOGITS_RTOL * np.abs(vb).max()
        got, want = decoder.step(5, cache_t, owned_t).copy(), decoder.step(5, cache_a, owned_a).copy()
        if exact:
            assert np.array_equal(got, want)
        else:
            assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max()
    with pytest.raises(ValueError):
        decoder.prefill_rows([[5, 6], [7, 8]], [together[0], together[0]], [owned_together[0]] * 2)


def test_a_bounded_sequence_s_buffers_are_allocated_once_and_unbounded_ones_grow_by_a_fraction() -> None:
    """``OwnedCache.reserve`` (the sequence's prompt and n_predict, engine/sequence.py): the
    decoder's buffers hold all of it from the prompt's first chunk on, in whole KV_STEPs, and
    steps up to it never copy the cache; without a bound they get KV_HEADROOM positions more
    than needed, and outgrown, at least an eighth more than before."""
    loaded = load_model(str(tiny_model("llama")), [])
    model, decoder = loaded.model, loaded.decoder
    cache, owned = make_prompt_cache(model), decode_kv.OwnedCache(reserve=45)
    decoder.prefill(_ids(20, seed=51), cache, owned, logits=False)
    buffers = [a for a, _ in owned.arrays]
    assert all(a.shape[2] == 48 for a in buffers)
    for token in range(25):  # positions 20 .. 44: the reserve
        decoder.step(token + 10, cache, owned)
    assert all(c.keys is a for c, a in zip(cache, buffers)) and cache[0].offset == 45
    assert decode_kv.buffer_capacity(19) == 96  # 20 + 64 headroom, to 16s
    assert decode_kv.buffer_capacity(999, current=960) == 1088  # 960 + 960 / 8 = 1080, to 16s
    assert decode_kv.buffer_capacity(999, current=64) == 1072  # 1000 + 64 headroom, to 16s


@pytest.mark.parametrize("family", ["granite", "phi3", "olmo2", "exaone4", "cohere2"])
def test_a_rest_s_last_row_logits_are_the_model_s(family: str) -> None:
    """``forward.last_row_logits`` (a hit's rest that MLX prefills for a family the runtime takes)
    computes the head on the last row only: the model's own last row's logits, granite's
    ``logits_scaling`` divisor and cohere2's ``logit_scale`` included."""
    from mlxcel_compat.engine.forward import last_row_logits

    model = load_model(str(tiny_model(family)), []).model
    ids = mx.array([_ids(20, seed=3)])
    ours = last_row_logits(model, ids, make_prompt_cache(model))
    want = model(ids, cache=make_prompt_cache(model))[0, -1]
    assert np.abs(np.array(ours) - np.array(want)).max() <= LOGITS_RTOL * np.abs(np.array(want)).max()


def test_ministral3_below_its_original_context_follows_mlx() -> None:
    """Below Llama 4's original context (the tiny model's: 16 positions) every query factor is 1
    (the runtime skips computing them); a 5-token prompt's steps up to position 15 and then past it
    follow MLX's step, where the factors start to differ from 1."""
    loaded = load_model(str(tiny_model("ministral3")), [])
    model, decoder = loaded.model, loaded.decoder
    assert isinstance(decoder, cpu_decode.CpuDecoder)
    ours = _prefill(model, 5)
    theirs = copy.deepcopy(ours)
    owned = decode_kv.OwnedCache()
    token = 11
    for step in range(16):  # positions 5 .. 20
        got = decoder.step(token, ours, owned).copy()
        want = mlx_logits(model, token, theirs)
        assert np.abs(got - want).max() <= LOGITS_RTOL * np.abs(want).max(), step
        token = int(want.argmax())
