"""The CPU decode runtime on LFM2 and LFM2-MoE (runtime/decode_conv.py, runtime/native/short_conv.c):
short-convolution layers (a state of the last ``L_cache - 1`` values of B * x in mlx-lm's
``ArraysCache``) between attention layers with per-head q/k norms; lfm2_moe's MoE layers (sigmoid
scores chosen with the expert bias, renormalised by their sum + 1e-6) after its dense first layer.

- The float32 directory (lfm2) follows MLX's step for 40 greedy steps within 1e-4 of the largest
  logit, the same tokens, the conv states and KV as MLX's; the Q8_0 files (lfm2, lfm2_moe) follow
  it bit for bit: logits, conv states and values (the same ggml products on the same activations,
  and the layer's float32 arithmetic rounding as MLX's on these files); keys within one ulp (RoPE).
- The lfm2_moe directory (float32 experts) runs on the runtime (test_cpu_decode_moe_f32.py); cast
  to bfloat16 it keeps MLX's step and says why (a row of test_cpu_decode.py's
  ``test_other_families_keep_mlx_and_say_why``); so does a convolution with biases.
- Rows stepped together are bit-identical to each row alone (each row its own conv states).
- A cold prompt fed as one chunk on the runtime leaves MLX's conv states and KV, and chunks of two
  sequences prefilled together leave exactly what each leaves alone.
- The state is updated in place only in the sequence's own arrays: a snapshot's copy keeps the
  state it was taken with.
- Through the engine on the Q8_0 file: the runtime runs the steps, and a second turn restored from
  the first's session snapshot gives what a cold run gives.
"""

from __future__ import annotations

import copy
import logging
import random
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlxcel_compat.cache import kv
from mlxcel_compat.runtime import backend, cpu_decode, decode_kv
from tests.conftest import tiny_model
from tests.engine.harness import EngineHarness
from tests.runtime.step_checks import (assert_rows_together_equal_rows_alone, assert_tail_rows_equal_single_steps,
                                       chunks_together_and_alone, close, cold_chunk_beside_mlx, ids, mlx_logits,
                                       prefilled, served_decoders)

LOGITS_RTOL = 1e-4  # float32 weights: of the largest logit (another summation order only; measured ~1e-6)
# A prompt chunk's products go through ggml's tiled kernels (the blocks) or the BLAS's GEMM (float32),
# which sum in another order than a step's: a chunk's state agrees to that rounding (measured below 1e-5
# of the largest value on these files), and 8-bit activations can move one quantum (test_cpu_decode.py's
# BLOCK_RTOL for the blocks).
CHUNK_RTOL = {None: 1e-5, "q8_0": 0.06}
# The runtime's RoPE rounds in its own order: a key can be one float32 ulp from MLX's (measured 4e-8 of
# the largest), too little to move the softmax's 8-bit-free sums off MLX's logits on these files.
KEY_RTOL = 1e-6

pytestmark = pytest.mark.skipif(backend.matmul_shim() is None, reason="the BLAS shim is not built on this machine")


def assert_caches_match(decoder: cpu_decode.CpuDecoder, ours: list, theirs: list, rtol: float | None) -> None:
    """Every short-convolution layer's state and every attention layer's keys and values: equal
    bit for bit (``rtol`` None; the keys within KEY_RTOL), or within ``rtol`` of the largest value."""
    def same(a: mx.array, b: mx.array, keys: bool = False) -> bool:
        a, b = np.array(a), np.array(b)
        if rtol is None and keys:
            return a.shape == b.shape and close(a, b, KEY_RTOL)
        return a.shape == b.shape and (np.array_equal(a, b) if rtol is None else close(a, b, rtol))

    for i, (a, b) in enumerate(zip(ours, theirs)):
        if i in decoder.delta_layers:
            assert len(a.cache) == len(b.cache) == 1 and same(a.cache[0], b.cache[0]), i
        else:
            assert a.offset == b.offset
            n = a.offset
            assert same(a.keys[..., :n, :], b.keys[..., :n, :], keys=True), i
            assert same(a.values[..., :n, :], b.values[..., :n, :]), i


@pytest.fixture(scope="module")
def lfm2_decoder() -> Callable[[str], tuple[nn.Module, cpu_decode.CpuDecoder]]:
    """The tiny model of a spec and its decoder (every layer on the runtime), loaded once for the module."""
    return served_decoders(tiny_model)


@pytest.mark.parametrize("spec", ["lfm2", "lfm2:q8_0", "lfm2_moe:q8_0",
                                  *(pytest.param(s, marks=pytest.mark.slow)
                                    for s in ("lfm2:q4_0", "lfm2:q4_k_m", "lfm2_moe:q4_k_m"))])
def test_lfm2_follows_mlx_step_for_step(lfm2_decoder: Callable, spec: str) -> None:
    """40 greedy steps after MLX's prefill of a 230-token prompt (the attention cache grows past
    256 positions): the float32 directory within LOGITS_RTOL of MLX's step with its tokens, the
    quantized files (Q8_0; with --slow Q4_0 and Q4_K_M too) bit-identical (logits, conv states,
    values; keys within KEY_RTOL); then MLX continues the decoder's cache."""
    model, decoder = lfm2_decoder(spec)
    assert decoder.delta_layers == [0, 1, 3] and decoder.attn_layers == [2]  # the factory's conv, conv, attention, conv
    assert all(decoder.layers[i].conv is not None and decoder.layers[i].conv.kernel == 3 for i in decoder.delta_layers)
    assert decoder.layers[2].q_norm is not None and decoder.rope_dims == 0  # per-head q/k norms, the whole head rotated
    moe = [layer.moe is not None for layer in decoder.layers]
    assert moe == ([False, True, True, True] if spec.startswith("lfm2_moe") else [False] * 4)  # lfm2_moe: 1 dense layer
    if spec.startswith("lfm2_moe"):
        assert all(layer.moe.gating == "sigmoid_bias_eps" and layer.moe.norm_topk for layer in decoder.layers[1:])
    blocks = ":" in spec
    ours = prefilled(model, 230)
    theirs = copy.deepcopy(ours)
    owned = decode_kv.OwnedCache()
    token = 11
    for step in range(40):
        assert decoder.can_run(ours, owned)
        steps = decoder.steps
        got = decoder.step(token, ours, owned).copy()
        assert decoder.steps == steps + 1
        want = mlx_logits(model, token, theirs)
        if blocks:
            assert np.array_equal(got, want), (step, np.abs(got - want).max() / np.abs(want).max())
        else:
            assert close(got, want, LOGITS_RTOL), (step, np.abs(got - want).max() / np.abs(want).max())
            assert int(got.argmax()) == int(want.argmax()), step
        assert_caches_match(decoder, ours, theirs, None if blocks else LOGITS_RTOL)
        token = int(want.argmax())
    assert decoder.offset(ours) == 270
    for _ in range(3):  # MLX reads and extends the state and KV the decoder wrote
        got, want = mlx_logits(model, token, ours), mlx_logits(model, token, theirs)
        assert close(got, want, 0 if blocks else LOGITS_RTOL)
        token = int(want.argmax())


def test_a_convolution_the_runtime_does_not_compute_keeps_mlx(lfm2_decoder: Callable) -> None:
    """A short convolution with biases (LFM2's checkpoints have none) is named in the reason."""
    model, _ = lfm2_decoder("lfm2")
    assert cpu_decode.unsupported(model) is None
    conv = model.model.layers[0].conv
    conv.bias = True
    try:
        assert cpu_decode.unsupported(model) == (
            "short-convolution layers (lfm2): a short convolution with biases (LFM2's checkpoints have none)")
    finally:
        conv.bias = False


@pytest.mark.parametrize("spec", ["lfm2:q8_0", "lfm2_moe:q8_0"])
def test_lfm2_rows_stepped_together_are_bit_identical_to_rows_alone(lfm2_decoder: Callable, spec: str) -> None:
    """Three sequences stepped together, each on its own conv states (lfm2_moe: pairs grouped by
    expert across the rows), give exactly the logits each gives alone, step after step."""
    model, decoder = lfm2_decoder(spec)
    together = [prefilled(model, n, seed) for n, seed in ((12, 0), (30, 1), (45, 2))]
    assert_rows_together_equal_rows_alone(decoder, together, 4)
    assert [decoder.offset(c) for c in together] == [16, 34, 49]


@pytest.mark.parametrize("spec", ["lfm2:q8_0", "lfm2_moe:q8_0"])
def test_an_lfm2_prompt_tail_as_rows_equals_its_single_steps(lfm2_decoder: Callable, spec: str) -> None:
    """A prompt's short rest as one pass's rows: the short convolutions roll their state row
    after row, exactly as single steps (``assert_tail_rows_equal_single_steps``)."""
    assert_tail_rows_equal_single_steps(*lfm2_decoder(spec))


@pytest.mark.parametrize("spec,rows", [("lfm2", 40), ("lfm2:q8_0", 40), ("lfm2:q8_0", 9), ("lfm2_moe:q8_0", 40)])
def test_an_lfm2_prompt_chunk_on_the_runtime_leaves_mlx_s_state(lfm2_decoder: Callable, spec: str, rows: int) -> None:
    """A cold prompt fed by ``prefill`` (the convolutions token by token in C; 40 rows through the
    prompt products, 9 through the decode rows' kernels) leaves the conv states and KV MLX's chunk
    leaves, and the next step agrees with MLX's."""
    model, decoder = lfm2_decoder(spec)
    rtol = CHUNK_RTOL[spec.split(":")[1] if ":" in spec else None]
    ours, theirs, owned = cold_chunk_beside_mlx(model, decoder, ids(rows, seed=31))
    assert_caches_match(decoder, ours, theirs, rtol)
    got, want = decoder.step(5, ours, owned).copy(), mlx_logits(model, 5, theirs)
    assert close(got, want, rtol)


def test_lfm2_prompt_chunks_prefilled_together_equal_chunks_alone(lfm2_decoder: Callable) -> None:
    """Two sequences' prompt chunks in one pass (one product a weight for both, each chunk's tokens
    through its own conv states) leave exactly the states and KV each leaves alone."""
    model, decoder = lfm2_decoder("lfm2:q8_0")
    for ours, alone in chunks_together_and_alone(model, decoder, [ids(24, seed=5), ids(33, seed=6)]):
        assert_caches_match(decoder, ours, alone, None)


def test_a_copy_of_the_lfm2_cache_keeps_the_state_it_was_taken_with(lfm2_decoder: Callable) -> None:
    """The runtime updates its own state arrays in place; a snapshot's copy (``cache/kv.py``) taken
    between steps still holds the state of its time after more steps, and continuing from it
    gives what continuing from that point gave."""
    model, decoder = lfm2_decoder("lfm2:q8_0")
    cache, owned = prefilled(model, 20), decode_kv.OwnedCache()
    decoder.step(11, cache, owned)
    taken = kv.snapshot(cache)
    kept = [np.array(taken[i].cache[0]) for i in decoder.delta_layers]
    after = decoder.step(12, cache, owned).copy()
    decoder.step(13, cache, owned)
    assert all(np.array_equal(np.array(taken[i].cache[0]), k) for i, k in zip(decoder.delta_layers, kept))
    assert not np.array_equal(np.array(cache[0].cache[0]), kept[0])  # the live state did move on
    again = decoder.step(12, taken, decode_kv.OwnedCache())
    assert np.array_equal(again, after)


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8000) for _ in range(n)]


def test_the_engine_runs_lfm2_on_the_runtime_and_a_restored_snapshot_continues_like_a_cold_run(
        caplog: pytest.LogCaptureFixture) -> None:
    """The Q8_0 file through the engine: the start-up log names the runtime, the decoder runs the
    steps and the prompt chunks; a second turn restored from the first's session snapshot gives the
    tokens and log-probabilities of a cold run split at the same boundary."""
    with caplog.at_level(logging.INFO, logger="mlxcel_compat"):
        harness = EngineHarness(tiny_model("lfm2:q8_0"), batch_size=32, n_parallel=2, min_prefix=8)
    try:
        assert "decode step: CPU decode runtime" in caplog.text
        decoder = harness.engine.loaded.decoder
        assert isinstance(decoder, cpu_decode.CpuDecoder)
        assert harness.stats()["snapshot_family"] is True
        history = random_tokens(70, seed=2)  # the boundary off the chunk grid: 70 = 2 * 32 + 6
        first, second = history + random_tokens(12, seed=3), history + random_tokens(15, seed=4)
        steps, chunks = decoder.steps, decoder.prefilled
        harness.run(first, n_predict=4, boundary=len(history), session="x")
        assert decoder.steps > steps and decoder.prefilled > chunks
        warm = harness.run(second, n_predict=10, n_probs=8, boundary=len(history), session="x")
        assert warm.finish.n_cached == len(history)
        cold = harness.run(second, n_predict=10, n_probs=8, boundary=len(history), session="fresh")
        assert cold.finish.n_cached == 0
        assert warm.tokens == cold.tokens and warm.logprobs == cold.logprobs
    finally:
        harness.close()
