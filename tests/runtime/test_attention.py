"""The CPU attention path agrees with MLX's own attention and is what loaded models run."""

from __future__ import annotations

import sys

import mlx.core as mx
import pytest
from mlx_lm.models import base
from mlx_lm.models.cache import make_prompt_cache

from mlxcel_compat.runtime import attention
from mlxcel_compat.model.loader import load_model
from tests.conftest import tiny_model

RTOL = 1e-5  # float32; the softmax is a power of 2 of log2-unit scores, normalised after V


def qkv(B: int, Hq: int, Hk: int, L: int, S: int, seed: int = 0):
    mx.random.seed(seed)
    return mx.random.normal((B, Hq, L, 64)), mx.random.normal((B, Hk, S, 64)), mx.random.normal((B, Hk, S, 64))


def close(a, b) -> bool:
    return (mx.abs(a - b).max() / mx.abs(b).max()).item() < RTOL


@pytest.mark.parametrize(
    "B,Hq,Hk,L,S,mask",
    [
        (1, 12, 4, 1, 700, None),  # decode, grouped-query
        (3, 8, 8, 1, 300, None),  # batched decode, one KV head per query head
        (1, 12, 4, 74, 2122, "causal"),  # new tokens over a cached prefix
        (1, 12, 4, 128, 128, "causal"),  # a fresh prompt
        (1, 12, 4, 300, 300, "causal"),  # a longer fresh prompt: query blocks, each to its own end
        (2, 12, 4, 257, 700, "causal"),  # a long chunk over a cached prefix, blocks with a tail of 1
        (2, 12, 4, 16, 200, "bool"),  # batch-cache style (B, 1, L, S) boolean mask
        (2, 12, 4, 16, 200, "additive"),  # (B, 1, L, S) additive mask
        (2, 12, 4, 16, 200, "per-head"),  # (B, Hq, L, S) boolean mask
        # Below attention.NUMPY_ATTENTION_MIN scores a prompt chunk stays in MLX, above it (every
        # case with more than one query above) it is computed on NumPy arrays: both paths, every
        # mask kind.
        (1, 4, 2, 8, 8, "causal"),
        (1, 4, 2, 4, 40, "bool"),
        (1, 4, 2, 4, 40, "additive"),
        (1, 4, 2, 4, 40, "per-head"),
    ],
)
def test_matches_mlx_attention(B, Hq, Hk, L, S, mask) -> None:
    q, k, v = qkv(B, Hq, Hk, L, S)
    causal = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    window = causal & (mx.arange(S - L, S)[:, None] - mx.arange(S)[None] < 64)  # sliding window
    if mask == "bool":
        mask = mx.broadcast_to(window, (B, 1, L, S))
    elif mask == "additive":
        mask = mx.where(mx.broadcast_to(window, (B, 1, L, S)), 0.0, -1e9)
    elif mask == "per-head":
        mask = mx.broadcast_to(window, (B, Hq, L, S))
    ours = attention.cpu_attention(q, k, v, 0.125, mask)
    assert ours is not None
    assert close(ours, mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask))


def masks(B: int, Hq: int, L: int, S: int) -> dict:
    causal = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    window = causal & (mx.arange(S - L, S)[:, None] - mx.arange(S)[None] < 64)
    return {
        None: None, "causal": "causal", "bool": mx.broadcast_to(window, (B, 1, L, S)),
        # graded where visible (a position bias), so a mis-scaled addition shows
        "additive": mx.where(mx.broadcast_to(window, (B, 1, L, S)), mx.cos(mx.arange(S) * 0.37), -1e9),
        "per-head": mx.broadcast_to(window, (B, Hq, L, S)),
    }


@pytest.mark.parametrize("kind", [None, "causal", "bool", "additive", "per-head"])
def test_numpy_path_matches_the_mlx_path(kind) -> None:
    """The prompt-chunk path (NumPy arrays, the BLAS called directly) against the lazy MLX path on
    the same inputs, with keys and values laid out as a KV cache hands them over: rows of a larger
    buffer (strided views)."""
    B, Hq, Hk, L, S = 2, 12, 4, 150, 330
    q, kbuf, vbuf = qkv(B, Hq, Hk, L, S + 70, seed=3)
    k, v = kbuf[:, :, :S], vbuf[:, :, :S]
    mask = masks(B, Hq, L, S)[kind]
    ours = attention.attend_numpy(q, k, v, 0.125, mask if mask is None or isinstance(mask, str)
                                  else attention.group_mask(mask, B, Hq, Hk, L, S))
    assert ours is not None
    reference = attention.attend_mlx(q, k, v, 0.125, attention.group_mask(mask, B, Hq, Hk, L, S))
    assert close(ours, reference)
    assert close(ours, mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask))


@pytest.mark.parametrize("case", ["huge logits", "tiny logits"])
def test_numpy_softmax_outside_the_unshifted_range_is_computed_shifted(monkeypatch, case) -> None:
    """The prompt-chunk softmax skips the row-maximum shift only while every row's sum stays in
    [2^-64, 2^64]. Logits past that (one head's queries scaled up: rows whose 2 ** score
    overflows; an additive bias of -200 on every key of some queries: rows that underflow to 0)
    fall back to the shifted form, to the same result as MLX's attention."""
    B, Hq, Hk, L, S = 1, 8, 4, 128, 128
    q, k, v = qkv(B, Hq, Hk, L, S, seed=9)
    mask = "causal"
    if case == "huge logits":
        q = q * mx.array([40.0] + [1.0] * (Hq - 1))[:, None, None]  # head 0: 2 ** score overflows
    else:
        picked = (mx.arange(L)[:, None] % 3 == 0) & (mx.arange(L)[:, None] < 64)  # in the first block
        bias = mx.where(picked, -200.0, 0.0)  # on every key of those queries
        causal = mx.arange(L)[:, None] >= mx.arange(S)[None]
        mask = mx.broadcast_to(mx.where(causal, bias, -mx.inf), (B, 1, L, S))
    fallbacks = []
    weigh = attention.weigh

    def spy(scores, values, weighted, hidden, shifted):
        safe = weigh(scores, values, weighted, hidden, shifted)
        if not shifted:
            fallbacks.append(not safe)
        return safe

    monkeypatch.setattr(attention, "weigh", spy)
    ours = attention.attend_numpy(q, k, v, 0.125, mask if isinstance(mask, str)
                                  else attention.group_mask(mask, B, Hq, Hk, L, S))
    assert any(fallbacks) and not all(fallbacks)  # some blocks fell back, others did not
    reference = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    assert not mx.isnan(ours).any().item()
    assert close(ours, reference)


def test_numpy_path_without_a_loaded_blas_uses_numpy_matmul(monkeypatch) -> None:
    """Where MLX runs on a BLAS this process did not load (``backend.cblas_sgemm()`` is None),
    the products fall back to NumPy's own matmul, to the same result; keys here are a transposed
    (B, S, Hk, D) projection, as without a cache."""
    mx.random.seed(5)
    q = mx.random.normal((1, 12, 96, 64))
    k, v = (mx.random.normal((1, 96, 4, 64)).swapaxes(1, 2) for _ in range(2))
    with_blas = attention.attend_numpy(q, k, v, 0.125, "causal")
    monkeypatch.setattr(attention.backend, "cblas_sgemm", lambda: None)
    without = attention.attend_numpy(q, k, v, 0.125, "causal")
    assert close(with_blas, without)
    assert close(without, mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal"))


def test_unhandled_masks_go_to_mlx_unchanged() -> None:
    q, k, v = qkv(1, 4, 2, 8, 40)
    odd = mx.ones((1, 8, 40), dtype=mx.bool_)  # a 3-D mask: not a shape this path handles
    assert attention.cpu_attention(q, k, v, 0.125, odd) is None
    sdpa = attention.make_attention(base.scaled_dot_product_attention.__dict__.get("original", base.scaled_dot_product_attention))
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=odd)
    assert mx.array_equal(sdpa(q, k, v, cache=None, scale=0.125, mask=odd), expected)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_loaded_models_run_the_cpu_path_with_the_same_logits(family: str) -> None:
    """A 160-token prompt through the model with the CPU path and with mlx-lm's own attention:
    causal masks, and on gemma3_text's sliding layers (a 64-token window) boolean ones."""
    loaded = load_model(str(tiny_model(family)), [])
    module = sys.modules[type(loaded.model).__module__]
    patched = module.scaled_dot_product_attention
    assert patched.original is base.scaled_dot_product_attention.original
    # 160 tokens: the prompt chunk's attention (4 heads x 160 x 160 scores) is computed on NumPy
    # arrays (above attention.NUMPY_ATTENTION_MIN).
    tokens = mx.array([[(37 * i + 5) % 500 for i in range(160)]])
    assert 4 * 160 * 160 >= attention.NUMPY_ATTENTION_MIN
    ours = loaded.model(tokens, cache=make_prompt_cache(loaded.model))
    module.scaled_dot_product_attention = patched.original
    try:
        theirs = loaded.model(tokens, cache=make_prompt_cache(loaded.model))
    finally:
        module.scaled_dot_product_attention = patched
    assert close(ours, theirs)
    assert mx.array_equal(mx.argmax(ours, axis=-1), mx.argmax(theirs, axis=-1))


def test_prompt_chunk_inside_a_compiled_trace_stays_in_mlx() -> None:
    """A prompt chunk goes to NumPy only where it can be evaluated mid-step: traced by mx.compile
    it stays in MLX, to the same result."""
    q, k, v = qkv(1, 12, 4, 128, 300)
    compiled = mx.compile(lambda q, k, v: attention.cpu_attention(q, k, v, 0.125, "causal"))
    assert close(compiled(q, k, v), attention.cpu_attention(q, k, v, 0.125, "causal"))


def test_a_short_chunk_multiplies_on_one_blas_thread_to_the_same_result(monkeypatch) -> None:
    """A chunk of at most SINGLE_THREAD_MAX_QUERIES queries (a cache hit's rest over its cached
    keys) computes its products with OpenBLAS on one thread, and gets what the split products
    give; the thread count is back afterwards, and a longer chunk keeps the split."""
    import ctypes

    from mlxcel_compat.runtime import backend

    info = backend.load_optimized_blas()
    if info.name != "openblas" or info.path is None:
        pytest.skip("needs the loaded OpenBLAS")
    lib = ctypes.CDLL(info.path)
    lib.openblas_get_num_threads.restype = ctypes.c_int
    threads = lib.openblas_get_num_threads()
    seen: list[int] = []
    real = attention.matmul

    def counting(*args, **kwargs):
        seen.append(lib.openblas_get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "matmul", counting)
    q, kbuf, vbuf = qkv(1, 12, 4, 70, 1100, seed=7)
    k, v = kbuf[:, :, :1076], vbuf[:, :, :1076]
    alone = attention.attend_numpy(q, k, v, 0.125, "causal")
    assert seen and set(seen) == {1}
    assert lib.openblas_get_num_threads() == threads
    seen.clear()
    monkeypatch.setattr(attention, "SINGLE_THREAD_MAX_QUERIES", 0)
    split = attention.attend_numpy(q, k, v, 0.125, "causal")
    assert set(seen) == {threads}
    assert close(alone, split)
    assert close(alone, mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal"))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_a_prompt_chunk_over_16_bit_kv_takes_the_numpy_path(monkeypatch, dtype) -> None:
    """-ctk/-ctv f16 or bf16: the chunk's keys and values are widened exactly to float32 for the
    NumPy path, which then agrees with MLX's attention over the same stored values."""
    calls = []
    real = attention.attend_numpy
    monkeypatch.setattr(attention, "attend_numpy", lambda *a: calls.append(a[1].dtype) or real(*a))
    q, k, v = qkv(1, 12, 4, 128, 300, seed=5)
    k, v = k.astype(dtype), v.astype(dtype)
    ours = attention.cpu_attention(q, k, v, 0.125, "causal")
    assert calls == [mx.float32] and ours.dtype == mx.float32
    wide = k.astype(mx.float32), v.astype(mx.float32)
    assert close(ours, mx.fast.scaled_dot_product_attention(q, *wide, scale=0.125, mask="causal"))
