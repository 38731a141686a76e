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
- Cold prompt chunks (split inside the window, across it, into short and long chunks) leave the
  KV MLX's prefill of the same chunks leaves (the sharing layers attend over their source's ring
  layout), the last row's logits MLX's, and steps follow from there; several sequences' chunks in
  one pass leave what each leaves alone (to float32 rounding: the GEMM's blocking follows the rows).
- Through the engine on each GGUF: the runtime steps, and a prompt-cache (session snapshot) hit
  gives the tokens and log-probabilities of a cold run.
- f16 KV (slow): a cold chunk and steps over f16 caches follow MLX.
- f16 KV (slow row): a cold chunk and steps over f16 caches follow MLX's.
- What it does not take says why: the MoE directory's float32 experts, odd caches.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import mlx.core as mx
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from mlxcel_compat.model.loader import load_model
from mlxcel_compat.runtime import backend, cpu_decode, decode_kv
from mlxcel_compat.runtime.decode_gemma4 import Gemma4Decoder
from mlxcel_compat.testing.gguf_writer import ensure_gguf
from tests.conftest import MODEL_CACHE, tiny_model
from tests.engine.harness import EngineHarness
from tests.runtime.step_checks import (assert_mlx_continues, assert_rows_together_equal_rows_alone, assert_same_cache, close,
                                       follow_mlx, follow_mlx_teacher_forced, ids, mlx_logits, prefilled)

LOGITS_RTOL = 1e-4  # float32 weights: measured 6e-6 (summation order, the polynomial 2 ** x)
BLOCK_RTOL = 0.06  # blocks, a step where one activation rounds to the next 8-bit step (test_cpu_decode.py)

pytestmark = pytest.mark.skipif(backend.matmul_shim() is None, reason="the BLAS shim is not built on this machine")


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
    theirs, token = follow_mlx(model, decoder, ours, 40, LOGITS_RTOL,
                               after_step=lambda ours, theirs: assert_same_cache(ours, theirs, LOGITS_RTOL))
    assert ours[0].offset == 80 > decoder.window and decoder.steps >= 40
    assert_mlx_continues(model, ours, theirs, token, LOGITS_RTOL)


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
        same = follow_mlx_teacher_forced(model, decoder, prefilled(model, n, seed), 20, BLOCK_RTOL,
                                         after_step=lambda ours, theirs: assert_same_cache(ours, theirs, BLOCK_RTOL)).exact
        exact, total = exact + same, total + 20
    print(f"{family} {gguf_type}: {exact} of {total} steps bit-identical to MLX's")
    assert exact >= total - 2  # measured 59-60 of 60 over 30 steps; a runtime that multiplied differently has none


@pytest.mark.parametrize("family", [None, "gemma4_text_moe"])
def test_rows_stepped_together_are_bit_identical_to_rows_alone(family: str | None, dense: tuple) -> None:
    """Three sequences at different positions (one ring still growing, two wrapped), stepped
    together for 6 steps: each row's logits exactly as stepped alone."""
    model, decoder = dense if family is None else _gguf(family)
    together = [prefilled(model, n) for n in (20, 70, 100)]
    assert_rows_together_equal_rows_alone(decoder, together, 6)
    assert [c[0].offset for c in together] == [26, 76, 106]


@pytest.mark.slow
def test_the_moe_directory_runs_and_cast_to_bfloat16_keeps_mlx_and_says_why() -> None:
    """Its float32 experts (mlx-lm's SwitchGLU) run in the pass (test_cpu_decode_moe_f32.py follows
    MLX's step); cast to bfloat16, its other weights are not float32."""
    moe_dir = load_model(str(tiny_model("gemma4_text_moe")), [])
    assert moe_dir.decoder is not None
    moe_dir.model.set_dtype(mx.bfloat16)
    assert cpu_decode.unsupported(moe_dir.model) == "weights are neither float32 nor in ggml's blocks"


def test_caches_it_does_not_take(dense: tuple) -> None:
    model, decoder = dense
    owned = decode_kv.OwnedCache()
    cache = prefilled(model, 10)
    assert decoder.can_run(cache, owned)
    assert not decoder.can_run(cache[:2], owned)  # not the model's cache
    assert not decoder.can_run([KVCache() for _ in cache], owned)  # empty: MLX prefills
    assert not decoder.can_step_tokens(cache, owned)  # rings take one token a step
    assert not decoder.can_prefill(cache[:2], owned)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decoder.step(10 ** 7, cache, owned)
    assert cache[0].offset == 10


@pytest.mark.parametrize("family", ["gemma4_text", pytest.param("gemma4_text_moe", marks=pytest.mark.slow)])
def test_engine_steps_on_the_runtime_and_a_cache_hit_equals_a_cold_run(family: str) -> None:
    """The q8_0 file through the engine: a session snapshot's hit (the prompt's first 100 tokens)
    and a cold run give the same greedy tokens and top log-probabilities, both prefilled and
    stepped here."""
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
        assert decoder.prefilled >= len(second)  # the prompts' chunks went through the runtime too
    finally:
        h.close()
    assert len(warm.tokens) == 24 and warm.tokens == cold.tokens
    for a, b in zip(warm.logprobs, cold.logprobs):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


def _newest(c: object) -> tuple[np.ndarray, np.ndarray]:
    """A layer's keys and values in position order: a ring's newest (as many as both rings hold)."""
    if isinstance(c, RotatingKVCache):
        return np.array(c._temporal_order(c.keys)), np.array(c._temporal_order(c.values))
    return np.array(c.keys[..., :c.offset, :]), np.array(c.values[..., :c.offset, :])


# Block weights: positions of a layer's KV past BLOCK_RTOL, at most (a rounding tie's flip), and
# how far. Both sides quantize each product's activations to 8 bits, so where one value sits on a
# rounding tie, a float32 rounding apart upstream (RoPE, attention) moves it by a whole step at
# that position: on the MoE file, one position of 138 in the chunks [64, 64, 10] (that token's
# layer 1 by 0.008, then through two layers of experts to 0.09-0.11 at layer 3; every other
# position within 0.015).
TIE_POSITIONS = 1
TIE_RTOL = 0.25


def _assert_same_kv(ours: list, theirs: list, rtol: float) -> None:
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert type(a) is type(b) and a.offset == b.offset, i
        for x, y in zip(_newest(a), _newest(b)):
            n = min(x.shape[2], y.shape[2], a.offset)  # MLX's chunk leaves a ring window - 1 + rows long
            assert n == min(a.offset, a.max_size if isinstance(a, RotatingKVCache) else a.offset)
            x, y = x[:, :, x.shape[2] - n:], y[:, :, y.shape[2] - n:]
            if rtol < BLOCK_RTOL:
                assert close(x, y, rtol), i
                continue
            off = np.abs(x - y).max(axis=(0, 1, 3)) / np.abs(y).max()  # per position
            assert (off > rtol).sum() <= TIE_POSITIONS and off.max() <= TIE_RTOL, (i, off.max())


@pytest.mark.parametrize("family,splits", [
    (None, [40, 30]), (None, [20, 100, 7, 90]), ("gemma4_text_moe", [64, 64, 10]),
    *(pytest.param(family, splits, marks=pytest.mark.slow) for family, splits in (
        (None, [70]), (None, [64, 64, 10]), ("gemma4_text_moe", [70]), ("gemma4_text_moe", [40, 30]),
        ("gemma4_text_moe", [20, 100, 7, 90])))])
def test_cold_prompt_chunks_leave_mlx_s_kv_and_steps_follow(family: str | None, splits: list[int], dense: tuple) -> None:
    model, decoder = dense if family is None else _gguf(family)
    rtol = LOGITS_RTOL if family is None else BLOCK_RTOL
    tokens = ids(sum(splits))
    ours, theirs = make_prompt_cache(model), make_prompt_cache(model)
    owned = decode_kv.OwnedCache()
    first = 0
    before = decoder.prefilled
    for n in splits:
        assert decoder.can_prefill(ours, owned)
        got = decoder.prefill(tokens[first:first + n], ours, owned).copy()
        want = np.array(model(mx.array([tokens[first:first + n]]), cache=theirs)[0, -1])
        assert close(got, want, rtol), n
        first += n
    assert decoder.prefilled - before == sum(n for n in splits if n > 1)
    _assert_same_kv(ours, theirs, rtol)
    token = 11
    for step in range(5):
        got, want = decoder.step(token, ours, owned).copy(), mlx_logits(model, token, theirs)
        assert close(got, want, rtol), step
        token = int(want.argmax())


def test_chunks_of_several_sequences_in_one_pass_equal_each_alone(dense: tuple) -> None:
    model, decoder = dense
    chunks = [ids(30, seed) for seed in range(3)]
    together = [make_prompt_cache(model)] + [prefilled(model, n) for n in (20, 90)]  # cold, inside the window, past it
    alone = copy.deepcopy(together)
    decoder.prefill_rows(chunks, together, [decode_kv.OwnedCache() for _ in together])
    for chunk, cache in zip(chunks, alone):
        decoder.prefill(chunk, cache, decode_kv.OwnedCache(), logits=False)
    assert [c[0].offset for c in together] == [30, 50, 120]
    for a, b in zip(together, alone):  # float32 GEMMs block by the row count: to float32 rounding
        _assert_same_kv(a, b, LOGITS_RTOL)


@pytest.mark.slow
def test_f16_kv_chunks_and_steps_follow_mlx() -> None:
    """-ctk/-ctv f16: the caches hold f16 rows (a KV-sharing layer's rewrite of its source's rows
    rounds them the same), a cold chunk and 20 steps within F16_RTOL of MLX's over the same f16
    caches (measured 5e-4: each side rounds its own float32 rows to f16)."""
    from mlxcel_compat.model.load_options import LoadOptions
    from mlxcel_compat.runtime.kv_precision import KvTypes

    f16_rtol = 5e-3
    loaded = load_model(str(tiny_model("gemma4_text")), [], options=LoadOptions(kv_types=KvTypes("f16", "f16")))
    model, decoder = loaded.model, loaded.decoder
    assert isinstance(decoder, Gemma4Decoder) and decoder.kv.codes == (1, 1)
    ours, theirs = make_prompt_cache(model), make_prompt_cache(model)
    owned = decode_kv.OwnedCache()
    tokens = ids(70)
    got = decoder.prefill(tokens, ours, owned).copy()
    assert close(got, np.array(model(mx.array([tokens]), cache=theirs)[0, -1]), f16_rtol)
    assert all(c.keys.dtype == mx.float16 for c in ours)
    token = 11
    for step in range(20):
        assert decoder.can_run(ours, owned)
        got, want = decoder.step(token, ours, owned).copy(), mlx_logits(model, token, theirs)
        assert close(got, want, f16_rtol), step
        token = int(want.argmax())
