"""The CPU decode runtime on the Mamba-2 hybrids (runtime/decode_mamba.py, runtime/native/mamba2.c):
Granite 4.0-H (``granitemoehybrid``: Mamba-2 layers between attention layers without RoPE,
granite's multipliers, experts beside a shared MLP) and Nemotron-H (``nemotron_h``: Mamba-2,
attention and squared-ReLU MLP blocks, paired into layers by runtime/decode_nemotron.py).

- Float32 weights: Nemotron-H's directory, and Granite 4.0-H in its dense mode (mlx-lm's
  ``use_moe`` off: the factory's tiny config without experts, its seeded weights): 40
  teacher-forced steps within 1e-4 of the largest logit of MLX's step (measured 1.2e-6 and
  5e-7), the same greedy token at every decided step, the states as MLX's.
- The factories' Q8_0 files: 40 teacher-forced steps agree with MLX's step on the same model
  within ``Q8_RTOL`` of the largest logit, the same greedy token wherever MLX's choice is decided,
  and the Mamba-2 states (conv state, SSM state) and the KV cache as MLX's step leaves them.
- Rows stepped together are bit-identical to each row alone (each row its own state).
- A cold prompt fed as one chunk on the runtime (the conv and the SSM recurrence token by token in
  C) leaves MLX's state, and chunks of two sequences prefilled together leave what each leaves alone.
- The state is updated in place only in the sequence's own arrays: a snapshot's copy keeps it.
- The engine on the file uses the runtime, and a second turn restored from the first's session
  snapshot gives the tokens and log-probabilities of a cold run.

Why Granite 4.0-H only as Q8_0 here: the factory's float32 Granite 4.0-H (float32 experts) is
test_cpu_decode_moe_f32.py's; Q8_0's blocks are what this file checks. Its products run through
the same ggml kernels as MLX's step, but their activations
are quantized to 8 bits, so the mixer's float32 rounding differences (another summation order over
d_state; the token-by-token recurrence where MLX's prompt uses the chunked SSD form) can move a
block's rounding: measured 1.4e-3 of the largest logit over 40 steps (Nemotron-H's Q8_0: 0, every
step bit-identical), the states within 1e-6.
"""

from __future__ import annotations

import random
from typing import Callable

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load_model as mlx_lm_load_model

from mlxcel_compat.cache import kv
from mlxcel_compat.model.loader import load_model
from mlxcel_compat.runtime import backend, cpu_decode, decode_kv
from mlxcel_compat.testing.families import model_config
from mlxcel_compat.testing.weights import instantiate, seeded_weights
from tests.conftest import tiny_model
from tests.engine.harness import EngineHarness
from tests.runtime.step_checks import (assert_recurrent_caches_close, assert_rows_together_equal_rows_alone,
                                       assert_tail_rows_equal_single_steps, chunks_together_and_alone, close,
                                       cold_chunk_beside_mlx, each_step_on_the_runtime, follow_mlx_teacher_forced,
                                       ids, mlx_logits, prefilled)

MODEL = "granitemoehybrid:q8_0"
Q8_RTOL = 5e-3  # of the largest logit; measured 1.4e-3 (the module's docstring says why not float32's)
GRANITE_DENSE = "granitemoehybrid-dense"
FLOAT_RTOL = 1e-4  # float32 weights: another summation order only (measured 1.2e-6)
STATE_RTOL = 1e-5  # the Mamba-2 states and the KV: float32 rounding only

pytestmark = pytest.mark.skipif(backend.matmul_shim() is None, reason="the BLAS shim is not built on this machine")


@pytest.fixture(scope="module")
def loaded() -> Callable[[str], tuple]:
    """The tiny model of a spec and its decoder, loaded once for the module: a GGUF by the
    server's loader, a float32 directory as mlx-lm loads it (the model alone) with its decoder built."""
    models: dict[str, tuple] = {}

    def get(spec: str) -> tuple:
        if spec not in models:
            if spec == GRANITE_DENSE:  # mlx-lm's dense Granite 4.0-H: the tiny config without experts
                config = dict(model_config("granitemoehybrid", "tiny"), num_local_experts=None, num_experts_per_tok=None)
                model = instantiate(config)
                model.load_weights(list(seeded_weights("granitemoehybrid", "tiny", config).items()))
                mx.eval(model.parameters())
                decoder = cpu_decode.build(model, backend.matmul_shim())
            elif ":" in spec:
                served = load_model(str(tiny_model(spec)), [])
                model, decoder = served.model, served.decoder
            else:
                model, _ = mlx_lm_load_model(tiny_model(spec))
                decoder = cpu_decode.build(model, backend.matmul_shim())
            assert isinstance(decoder, cpu_decode.CpuDecoder), cpu_decode.unsupported(model)
            models[spec] = model, decoder
        return models[spec]

    return get


@pytest.fixture(scope="module")
def granite(loaded: Callable) -> tuple:
    return loaded(MODEL)


@pytest.mark.parametrize("spec,rtol", [("nemotron_h", FLOAT_RTOL), ("nemotron_h:q8_0", Q8_RTOL),
                                       (GRANITE_DENSE, FLOAT_RTOL)])
def test_float32_and_nemotron_h_follow_mlx_step_for_step(loaded: Callable, spec: str, rtol: float) -> None:
    """40 teacher-forced steps after an MLX prefill: logits within ``rtol`` of MLX's step, the same
    greedy token wherever MLX's top two are further apart than either side may move, the states and
    KV as MLX's. Nemotron-H's blocks M - M * - M - pair into four layers, the second without an
    MLP; the dense Granite's layers are Mamba-2, Mamba-2, attention, Mamba-2 with SwiGLU MLPs."""
    model, decoder = loaded(spec)
    assert decoder.delta_layers == [0, 1, 3] and decoder.attn_layers == [2]
    if spec == GRANITE_DENSE:
        assert decoder.act == "swiglu" and all(layer.moe is None and layer.gate is not None for layer in decoder.layers)
    else:
        assert decoder.act == "relu2" and [layer.up is not None for layer in decoder.layers] == [True, False, True, True]
    assert [layer.mamba is not None for layer in decoder.layers] == [True, True, False, True]
    ours = prefilled(model, 30)
    theirs, _, decided = follow_mlx_teacher_forced(model, decoder, ours, 40, rtol)
    assert decided >= 30
    assert_recurrent_caches_close(decoder, ours, theirs, STATE_RTOL)


def test_granite_hybrid_follows_mlx_step_for_step(granite: tuple) -> None:
    """40 teacher-forced steps after an MLX prefill: logits within Q8_RTOL of MLX's step, the same
    token where MLX's top two are further apart than either side may move, the states and KV as MLX's."""
    model, decoder = granite
    assert decoder.delta_layers == [0, 1, 3] and decoder.attn_layers == [2]  # Mamba-2, Mamba-2, attention, Mamba-2
    assert all(layer.mamba is not None for layer in (decoder.layers[i] for i in decoder.delta_layers))
    assert decoder.layers[2].mamba is None and decoder.layers[2].q is not None
    assert all(layer.moe is not None and layer.moe.shared_gate is not None for layer in decoder.layers)
    assert decoder.residual_scale == pytest.approx(0.22) and decoder.logit_transform.divisor == 6.0
    ours = prefilled(model, 30)
    theirs, _, decided = follow_mlx_teacher_forced(model, decoder, ours, 40, Q8_RTOL, each_step_on_the_runtime(decoder))
    assert decided >= 30  # the greedy check ran on most steps
    assert_recurrent_caches_close(decoder, ours, theirs, STATE_RTOL)


@pytest.mark.parametrize("spec", [MODEL, "nemotron_h:q8_0"])
def test_rows_stepped_together_are_bit_identical_to_rows_alone(loaded: Callable, spec: str) -> None:
    model, decoder = loaded(spec)
    together = [prefilled(model, n, seed) for n, seed in ((12, 0), (30, 1), (45, 2))]
    assert_rows_together_equal_rows_alone(decoder, together, 4)
    assert [decoder.offset(c) for c in together] == [16, 34, 49]


@pytest.mark.parametrize("spec", [MODEL, "nemotron_h:q8_0"])
def test_a_prompt_tail_as_rows_equals_its_single_steps(loaded: Callable, spec: str) -> None:
    """A prompt's short rest as one pass's rows: the Mamba-2 mixers take them one after another
    on the sequence's own state, exactly as single steps (``assert_tail_rows_equal_single_steps``)."""
    assert_tail_rows_equal_single_steps(*loaded(spec))


@pytest.mark.parametrize("spec,rtol", [(MODEL, Q8_RTOL), ("nemotron_h", FLOAT_RTOL)])
def test_a_prompt_chunk_on_the_runtime_leaves_mlx_s_state(loaded: Callable, spec: str, rtol: float) -> None:
    """A cold 40-token prompt fed by ``prefill`` (the conv and the SSM recurrence token by token in
    C) leaves the states and KV MLX's chunked SSD leaves, and the next step agrees with MLX's."""
    model, decoder = loaded(spec)
    ours, theirs, owned = cold_chunk_beside_mlx(model, decoder, ids(40, seed=31))
    assert_recurrent_caches_close(decoder, ours, theirs, STATE_RTOL)
    got, want = decoder.step(5, ours, owned).copy(), mlx_logits(model, 5, theirs)
    assert close(got, want, rtol)


def test_granite_prompt_chunks_prefilled_together_equal_chunks_alone(granite: tuple) -> None:
    model, decoder = granite
    for ours, alone in chunks_together_and_alone(model, decoder, [ids(24, seed=5), ids(33, seed=6)]):
        for i in decoder.delta_layers:
            assert all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(ours[i].cache, alone[i].cache))


def test_a_copy_of_the_granite_cache_keeps_the_state_it_was_taken_with(granite: tuple) -> None:
    """A snapshot's copy (``cache/kv.py``) taken between steps keeps the Mamba-2 state of its
    time after more steps, and continuing from it gives what continuing from that point gave."""
    model, decoder = granite
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


def test_layouts_it_does_not_take_say_why() -> None:
    """The float32 Granite 4.0-H runs (its float32 experts: test_cpu_decode_moe_f32.py) but not cast
    to bfloat16; a Nemotron-H whose blocks do not pair (an MLP block after another) or that has
    experts keeps MLX's step; each says why (the model alone, as mlx-lm loads it: the tokenizer's
    conversion is not what this checks)."""
    granite, _ = mlx_lm_load_model(tiny_model("granitemoehybrid"))
    assert cpu_decode.unsupported(granite) is None
    granite.set_dtype(mx.bfloat16)
    assert cpu_decode.unsupported(granite) == "Mamba-2 layers (granitemoehybrid): Mamba-2 parameters other than float32"
    nemotron, _ = mlx_lm_load_model(tiny_model("nemotron_h"))
    assert cpu_decode.unsupported(nemotron) is None
    blocks = nemotron.backbone.layers
    blocks[0].block_type, blocks[1].block_type = "-", "M"  # an MLP block first: nothing to pair it with
    blocks[0].mixer, blocks[1].mixer = blocks[1].mixer, blocks[0].mixer
    assert cpu_decode.unsupported(nemotron) == "Nemotron-H: an MLP block after no Mamba-2 or attention block"
    blocks[0].block_type = "E"
    assert cpu_decode.unsupported(nemotron) == "Nemotron-H: blocks of kind 'E' (experts) run in MLX's step"


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8000) for _ in range(n)]


@pytest.mark.parametrize("spec", [MODEL, "nemotron_h:q8_0"])
def test_the_engine_on_the_gguf_uses_the_runtime_and_a_restored_snapshot_equals_a_cold_run(spec: str) -> None:
    """The engine serves the Q8_0 file's steps on the runtime; a second turn restored from the
    session snapshot (the Mamba-2 state and the KV as the first turn left them) gives exactly the
    tokens and log-probabilities of a cold run split at the same boundary."""
    harness = EngineHarness(tiny_model(spec), batch_size=32, n_parallel=2, min_prefix=8)
    try:
        decoder = harness.engine.loaded.decoder
        assert isinstance(decoder, cpu_decode.CpuDecoder)
        assert harness.stats()["snapshot_family"] is True
        history = random_tokens(70, seed=2)
        first, second = history + random_tokens(12, seed=3), history + random_tokens(15, seed=4)
        steps = decoder.steps
        harness.run(first, n_predict=4, boundary=len(history), session="x")
        assert decoder.steps > steps  # the decode steps ran on the runtime
        assert harness.stats()["snapshot_entries"] >= 1
        warm = harness.run(second, n_predict=8, n_probs=4, boundary=len(history), session="x")
        assert warm.finish.n_cached == len(history)
        cold = harness.run(second, n_predict=8, n_probs=4, boundary=len(history), session="fresh")
        assert cold.finish.n_cached == 0
        assert warm.tokens == cold.tokens and warm.logprobs == cold.logprobs
    finally:
        harness.close()
