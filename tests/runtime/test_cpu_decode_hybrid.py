"""The CPU decode runtime on the Qwen3.5 hybrids (runtime/decode_delta.py, runtime/native/delta_net.c):
gated delta-net layers between attention layers with an output gate and a partial RoPE.

- Per family (qwen3_5 float32 and Q8_0, qwen3_5_moe Q8_0 with its experts and shared expert on the
  blocks, qwen3_next Q8_0 with its fused in-projections interleaved per key head): teacher-forced
  steps agree with MLX's step on the same model (float32: to float32 rounding; blocks: within
  BLOCK_RTOL, as the other block families), the same greedy token
  wherever MLX's choice is decided, and the recurrent state (conv and delta state) and the KV
  cache as MLX's step leaves them.
- Rows stepped together are bit-identical to each row alone (each row its own state).
- A cold prompt fed as one chunk on the runtime (its tokens in a C loop) leaves MLX's state, and
  chunks of two sequences prefilled together leave what each leaves alone.
- The state is updated in place only in the sequence's own arrays: a copy of the cache (what
  snapshots and prompt-cache entries take) keeps the state it was taken with.
(A hybrid's float32 directory, its experts float32: test_cpu_decode_moe_f32.py; cast to bfloat16
it keeps MLX's step and says why: test_cpu_decode.py's ``test_other_families_keep_mlx_and_say_why``.)
"""

from __future__ import annotations

from typing import Callable

import mlx.nn as nn
import numpy as np
import pytest

from mlxcel_compat.cache import kv
from mlxcel_compat.runtime import backend, cpu_decode, decode_kv
from tests.conftest import tiny_model
from tests.runtime.step_checks import (assert_recurrent_caches_close, assert_rows_together_equal_rows_alone,
                                       assert_tail_rows_equal_single_steps, chunks_together_and_alone, close,
                                       cold_chunk_beside_mlx, each_step_on_the_runtime, follow_mlx_teacher_forced,
                                       ids, mlx_logits, prefilled, served_decoders)

BLOCK_RTOL = 0.06  # as test_cpu_decode_moe.py: activations quantized to the blocks' vec_dot_type
FLOAT_RTOL = 1e-5  # float32 weights: another summation order only

pytestmark = pytest.mark.skipif(backend.matmul_shim() is None, reason="the BLAS shim is not built on this machine")


@pytest.fixture(scope="module")
def hybrid_decoder() -> Callable[[str], tuple[nn.Module, cpu_decode.CpuDecoder]]:
    """The tiny model of a spec and its decoder (every layer on the runtime), loaded once for the module."""
    return served_decoders(tiny_model)


@pytest.mark.parametrize("spec", ["qwen3_5:q8_0", pytest.param("qwen3_5", marks=pytest.mark.slow),
                                  pytest.param("qwen3_5_moe:q8_0", marks=pytest.mark.slow),
                                  pytest.param("qwen3_next:q8_0", marks=pytest.mark.slow)])
def test_hybrid_models_follow_mlx_step_for_step(hybrid_decoder: Callable, spec: str) -> None:
    """8 teacher-forced steps after an MLX prefill: logits within the tolerance of MLX's step, the
    same token where MLX's top two are further apart than either side may move, the delta-net
    states and the KV cache as MLX's."""
    model, decoder = hybrid_decoder(spec)
    assert decoder.delta_layers == [0, 1, 2] and decoder.attn_layers == [3]  # 3 delta-net layers : 1 attention
    assert decoder.rope_dims == decoder.head_dim // 4 and decoder.layers[3].gated_q  # partial RoPE, gated queries
    moe = spec.split(":")[0] in ("qwen3_5_moe", "qwen3_next")
    assert all((layer.moe is not None) == moe for layer in decoder.layers)
    # qwen3_next's fused in-projections, their columns gathered into the mixer's layout
    assert all((layer.delta.in_order is not None) == spec.startswith("qwen3_next") for layer in decoder.layers[:3])
    rtol = FLOAT_RTOL if ":" not in spec else BLOCK_RTOL
    steps = decoder.steps
    follow_mlx_teacher_forced(model, decoder, prefilled(model, 30), 8, rtol, each_step_on_the_runtime(
        decoder, lambda ours, theirs: assert_recurrent_caches_close(decoder, ours, theirs, rtol)))
    assert decoder.steps == steps + 8


def test_hybrid_rows_stepped_together_are_bit_identical_to_rows_alone(hybrid_decoder: Callable) -> None:
    """Three sequences stepped together, each on its own recurrent state, give exactly the logits
    each gives alone, step after step."""
    model, decoder = hybrid_decoder("qwen3_5:q8_0")
    together = [prefilled(model, n, seed) for n, seed in ((12, 0), (30, 1), (45, 2))]
    assert_rows_together_equal_rows_alone(decoder, together, 4)
    assert [decoder.offset(c) for c in together] == [16, 34, 49]


def test_a_hybrid_prompt_tail_as_rows_equals_its_single_steps(hybrid_decoder: Callable) -> None:
    """A prompt's short rest as one pass's rows: the delta-net layers take them one after another
    on the sequence's own state, exactly as single steps (``assert_tail_rows_equal_single_steps``)."""
    assert_tail_rows_equal_single_steps(*hybrid_decoder("qwen3_5:q8_0"))


def test_a_hybrid_prompt_chunk_on_the_runtime_leaves_mlx_s_state(hybrid_decoder: Callable) -> None:
    """A cold 40-token prompt fed by ``prefill`` (the conv and the delta rule token by token in C,
    the products as prompt tiles) leaves the states and KV MLX's chunk leaves, and the next step
    agrees with MLX's."""
    model, decoder = hybrid_decoder("qwen3_5:q8_0")
    ours, theirs, owned = cold_chunk_beside_mlx(model, decoder, ids(40, seed=31))
    assert_recurrent_caches_close(decoder, ours, theirs, BLOCK_RTOL)
    got, want = decoder.step(5, ours, owned).copy(), mlx_logits(model, 5, theirs)
    assert close(got, want, BLOCK_RTOL)


def test_hybrid_prompt_chunks_prefilled_together_equal_chunks_alone(hybrid_decoder: Callable) -> None:
    """Two sequences' prompt chunks in one pass (``prefill_rows``: one product a weight for both,
    each chunk's tokens through its own states) leave exactly the states each leaves alone."""
    model, decoder = hybrid_decoder("qwen3_5:q8_0")
    for ours, alone in chunks_together_and_alone(model, decoder, [ids(24, seed=5), ids(33, seed=6)]):
        for i in decoder.delta_layers:
            assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(ours[i].cache, alone[i].cache))


def test_a_copy_of_the_cache_keeps_the_state_it_was_taken_with(hybrid_decoder: Callable) -> None:
    """The runtime updates its own state arrays in place; a snapshot's copy (``cache/kv.py``) taken
    between steps still holds the state of its time after more steps, and continuing from it
    gives what continuing from that point gave."""
    model, decoder = hybrid_decoder("qwen3_5:q8_0")
    cache, owned = prefilled(model, 20), decode_kv.OwnedCache()
    decoder.step(11, cache, owned)
    taken = kv.snapshot(cache)
    kept = [np.array(a) for i in decoder.delta_layers for a in taken[i].cache]
    after = decoder.step(12, cache, owned).copy()
    decoder.step(13, cache, owned)
    assert all(np.array_equal(np.array(a), b)
               for a, b in zip((a for i in decoder.delta_layers for a in taken[i].cache), kept))
    assert not np.array_equal(np.array(cache[0].cache[1]), kept[1])  # the live state did move on
    again = decoder.step(12, taken, decode_kv.OwnedCache())
    assert np.array_equal(again, after)


def test_a_restored_cache_shares_the_entrys_state_and_never_writes_it(hybrid_decoder: Callable) -> None:
    """``kv.restore`` (a session-snapshot hit) shares the stored entry's recurrent arrays instead
    of copying them; the runtime's steps on the restored cache copy them into buffers of their
    own first, and MLX's pass makes new arrays, so the entry keeps the state it was taken with
    and a second restore continues exactly as the first."""
    model, decoder = hybrid_decoder("qwen3_5:q8_0")
    cache, owned = prefilled(model, 20), decode_kv.OwnedCache()
    decoder.step(11, cache, owned)
    taken = kv.snapshot(cache)
    state = [a for i in decoder.delta_layers for a in taken[i].cache]
    kept = [np.array(a) for a in state]
    first = kv.restore(taken)
    assert all(a is b for a, b in zip((a for i in decoder.delta_layers for a in first[i].cache), state))
    mlx_logits(model, 12, kv.restore(taken))
    owned_first = decode_kv.OwnedCache()
    got = [decoder.step(t, first, owned_first).copy() for t in (12, 13, 14)]
    assert all(np.array_equal(np.array(a), b) for a, b in zip(state, kept))
    second, owned_second = kv.restore(taken), decode_kv.OwnedCache()
    assert all(np.array_equal(decoder.step(t, second, owned_second), g) for t, g in zip((12, 13, 14), got))
