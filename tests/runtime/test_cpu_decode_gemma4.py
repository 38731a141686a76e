"""Gemma 4 on the CPU decode runtime (runtime/decode_gemma4.py, runtime/native/gemma4_pass.c).

- The factory's ``gemma4_text`` directory (per-layer embeddings, the last three of six layers
  sharing the KV of the last earlier layer of their kind, sliding layers with 16-wide heads and a
  64-position window, full layers with 32-wide heads and a proportional RoPE, double-wide MLPs in
  the sharing layers, soft-capped logits): 40 greedy steps past the window, each step's logits
  within LOGITS_RTOL of MLX's step on its own copy of the cache, the same token, the caches as
  MLX's update leaves them; MLX then continues the decoder's cache to its own logits.
- The quantized GGUFs, dense and the MoE layout (``gemma4_text_moe``: experts beside the MLP,
  ``attention_k_eq_v``, full layers with fewer KV heads): teacher-forced steps bit-identical to
  MLX's step on the same block model (the same ggml products on the same 8-bit activations; the
  soft-capping by MLX's tanh), except a step where the pass's other summation order (norms,
  attention, the experts' weighted sum: ~1e-7) moves an activation across a rounding boundary of
  that quantization: then up to BLOCK_RTOL, as for every block family (test_cpu_decode.py).
- Rows stepped together are bit-identical to each row stepped alone (both layouts).
- Through the engine on each GGUF: the runtime steps, and a prompt-cache (session snapshot) hit
  gives the tokens and log-probabilities of a cold run.
- What it does not take says why: the MoE directory's float32 experts, paged and odd caches.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from mlxcel_compat.model.loader import load_model
from mlxcel_compat.runtime import backend, cpu_decode, decode_kv
from mlxcel_compat.runtime.decode_gemma4 import Gemma4Decoder
from mlxcel_compat.testing.gguf_writer import ensure_gguf
from tests.conftest import MODEL_CACHE, tiny_model
from tests.engine.harness import EngineHarness
from tests.runtime.step_checks import assert_rows_together_equal_rows_alone, mlx_logits, prefilled

LOGITS_RTOL = 1e-4  # float32 weights: measured 6e-6 (summation order, the polynomial 2 ** x)
BLOCK_RTOL = 0.06  # blocks, a step where one activation rounds to the next 8-bit step (test_cpu_decode.py)

pytestmark = pytest.mark.skipif(backend.matmul_shim() is None, reason="the BLAS shim is not built on this machine")


def _close(got: np.ndarray, want: np.ndarray, rtol: float) -> bool:
    return bool(np.abs(got - want).max() <= rtol * np.abs(want).max())


def _assert_same_cache(ours: list, theirs: list, rtol: float) -> None:
    """Every layer with a cache (the KV-sharing ones have none) as MLX's update leaves it."""
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert type(a) is type(b) and a.offset == b.offset, i
        if isinstance(b, RotatingKVCache):
            assert a.keys.shape == b.keys.shape and a._idx == b._idx, i
            pairs = [(a.keys, b.keys), (a.values, b.values)]
        else:
            n = b.offset
            pairs = [(a.keys[..., :n, :], b.keys[..., :n, :]), (a.values[..., :n, :], b.values[..., :n, :])]
        for x, y in pairs:
            assert _close(np.array(x), np.array(y), rtol), i


def _gguf(family: str, gguf_type: str = "q8_0") -> tuple:
    loaded = load_model(str(ensure_gguf(family, "tiny", gguf_type, cache_dir=MODEL_CACHE)), [])
    assert isinstance(loaded.decoder, Gemma4Decoder), cpu_decode.unsupported(loaded.model)
    return loaded.model, loaded.decoder


@pytest.fixture(scope="module")
def dense() -> tuple:
    loaded = load_model(str(tiny_model("gemma4_text")), [])
    assert isinstance(loaded.decoder, Gemma4Decoder), cpu_decode.unsupported(loaded.model)
    return loaded.model, loaded.decoder


def test_the_directory_follows_mlx_step_for_step_past_the_window(dense: tuple) -> None:
    model, decoder = dense
    assert decoder.n_cached == 3 and [layer.source for layer in decoder.layers] == [0, 1, 2, 1, 1, 2]
    assert {layer.head_dim for layer in decoder.layers} == {16, 32} and decoder.ple is not None
    ours = prefilled(model, 40)
    theirs = copy.deepcopy(ours)
    owned = decode_kv.OwnedCache()
    token = 11
    for step in range(40):
        assert decoder.can_run(ours, owned)
        got = decoder.step(token, ours, owned).copy()
        want = mlx_logits(model, token, theirs)
        assert _close(got, want, LOGITS_RTOL), step
        assert int(got.argmax()) == int(want.argmax()), step
        _assert_same_cache(ours, theirs, LOGITS_RTOL)
        token = int(want.argmax())
    assert ours[0].offset == 80 > decoder.window and decoder.steps >= 40
    for _ in range(3):  # MLX reads and extends the cache the decoder wrote
        got, want = mlx_logits(model, token, ours), mlx_logits(model, token, theirs)
        assert _close(got, want, LOGITS_RTOL)
        token = int(want.argmax())


@pytest.mark.parametrize("family,gguf_type", [("gemma4_text", "q8_0"), ("gemma4_text_moe", "q8_0"),
                                              pytest.param("gemma4_text", "q4_0", marks=pytest.mark.slow),
                                              pytest.param("gemma4_text_moe", "q4_0", marks=pytest.mark.slow)])
def test_block_files_follow_mlx_teacher_forced(family: str, gguf_type: str) -> None:
    model, decoder = _gguf(family, gguf_type)
    if family == "gemma4_text_moe":
        assert all(layer.experts is not None for layer in decoder.layers)
        assert any(layer.v is None and layer.k is not None for layer in decoder.layers)  # attention_k_eq_v
        assert len({layer.kv_heads for layer in decoder.layers}) == 2
    exact = total = 0
    for n, seed in ((40, 0), (90, 1)):
        ours = prefilled(model, n, seed)
        theirs = copy.deepcopy(ours)
        owned = decode_kv.OwnedCache()
        token = 11
        for step in range(30):
            assert decoder.can_run(ours, owned)
            got = decoder.step(token, ours, owned).copy()
            want = mlx_logits(model, token, theirs)
            top = np.abs(want).max()
            assert _close(got, want, BLOCK_RTOL), (n, step)
            first, second = np.sort(want)[-2:][::-1]
            if first - second > 2 * BLOCK_RTOL * top:
                assert int(got.argmax()) == int(want.argmax()), (n, step)
            _assert_same_cache(ours, theirs, BLOCK_RTOL)
            exact += bool(np.array_equal(got, want))
            total += 1
            token = int(want.argmax())
    print(f"{family} {gguf_type}: {exact} of {total} steps bit-identical to MLX's")
    assert exact >= total - 3  # measured 59-60 of 60; a runtime that multiplied differently would have none


@pytest.mark.parametrize("family", [None, "gemma4_text_moe"])
def test_rows_stepped_together_are_bit_identical_to_rows_alone(family: str | None, dense: tuple) -> None:
    """Three sequences at different positions (one ring still growing, two wrapped), stepped
    together for 6 steps: each row's logits exactly as stepped alone."""
    model, decoder = dense if family is None else _gguf(family)
    together = [prefilled(model, n) for n in (20, 70, 100)]
    assert_rows_together_equal_rows_alone(decoder, together, 6)
    assert [c[0].offset for c in together] == [26, 76, 106]


def test_what_it_does_not_take_says_why(dense: tuple) -> None:
    moe_dir = load_model(str(tiny_model("gemma4_text_moe")), [])
    assert moe_dir.decoder is None
    assert "experts not in ggml's blocks" in cpu_decode.unsupported(moe_dir.model)
    model, decoder = dense
    owned = decode_kv.OwnedCache()
    cache = prefilled(model, 10)
    assert decoder.can_run(cache, owned)
    assert not decoder.can_run(cache[:2], owned)  # not the model's cache
    assert not decoder.can_run([KVCache() for _ in cache], owned)  # empty: MLX prefills
    assert not decoder.can_prefill(make_prompt_cache(model), owned) and not decoder.can_step_tokens(cache, owned)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decoder.step(10 ** 7, cache, owned)
    assert cache[0].offset == 10


@pytest.mark.parametrize("family", ["gemma4_text", pytest.param("gemma4_text_moe", marks=pytest.mark.slow)])
def test_engine_steps_on_the_runtime_and_a_cache_hit_equals_a_cold_run(family: str) -> None:
    """The q8_0 file through the engine: a session snapshot's hit (the prompt's first 100 tokens)
    and a cold run give the same greedy tokens and top log-probabilities, both stepped here."""
    rng = random.Random(7)
    history = [rng.randrange(8000) for _ in range(100)]
    first, second = history + [rng.randrange(8000) for _ in range(12)], history + [rng.randrange(8000) for _ in range(15)]
    h = EngineHarness(ensure_gguf(family, "tiny", "q8_0", cache_dir=MODEL_CACHE), batch_size=32, min_prefix=8)
    try:
        decoder = h.engine.loaded.decoder
        assert isinstance(decoder, Gemma4Decoder)
        h.run(first, n_predict=4, boundary=len(history), session="x")
        warm = h.run(second, n_predict=24, n_probs=2, ignore_eos=True, boundary=len(history), session="x")
        assert warm.finish.n_cached == len(history)
        before = decoder.steps
        cold = h.run(second, n_predict=24, n_probs=2, ignore_eos=True, cache=False)
        assert decoder.steps - before == 24  # the prompt's last token (its tail), then every token but the last
    finally:
        h.close()
    assert len(warm.tokens) == 24 and warm.tokens == cold.tokens
    for a, b in zip(warm.logprobs, cold.logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
