"""Context shift (``--context-shift``, engine/context_shift.py): llama-server's arithmetic, the
KV after a shift against a cold prefill, and generation past the context in the engine."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model

from mlxcel_compat.engine.context_shift import ShiftPlan, key_rotation, plan_shift, shift_cache
from tests.conftest import tiny_model
from tests.engine.harness import EngineHarness


@pytest.mark.parametrize("n_tokens,n_ctx,n_prompt,n_keep,n_discard,add_bos,expected", [
    (255, 256, 226, 0, 0, False, ShiftPlan(0, 127)),     # llama-server's default: half of everything
    (255, 256, 226, 0, 0, True, ShiftPlan(1, 127)),      # ... the BOS token kept on top
    (255, 256, 20, -1, 0, True, ShiftPlan(21, 117)),     # n_keep -1: the whole prompt (and BOS)
    (255, 256, 226, -1, 0, False, ShiftPlan(226, 14)),
    (255, 256, 250, -1, 0, False, ShiftPlan(250, 2)),    # at most n_ctx - 4 kept ...
    (255, 256, 254, -1, 0, False, ShiftPlan(252, 1)),    # ... and fewer than all of the rest dropped
    (255, 256, 10, 4, 50, False, ShiftPlan(4, 50)),      # an explicit n_discard
    (255, 256, 10, 4, 400, False, ShiftPlan(4, 250)),    # clamped to n_left - 1
])
def test_plan_follows_llama_server(n_tokens, n_ctx, n_prompt, n_keep, n_discard, add_bos, expected):
    assert plan_shift(n_tokens, n_ctx, n_prompt, n_keep, n_discard, add_bos) == expected


@pytest.fixture(scope="module")
def llama():
    model, _ = load_model(tiny_model("llama"))
    return model


def _prefill(model, tokens):
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([(c.keys, c.values) for c in cache])
    return cache


def test_shifted_keys_are_the_keys_at_their_new_positions(llama):
    """Layer 0's keys and values depend only on a token and its position: after a shift they must
    equal a cold prefill's of the kept and moved tokens, which fails without the re-rotation."""
    tokens = [(7 * i + 3) % 500 + 10 for i in range(40)]
    rotation, reason = key_rotation(llama, make_prompt_cache(llama), add_bos=False)
    assert rotation is not None, reason
    cache = _prefill(llama, tokens)
    kept_before = [(c.keys[..., :8, :], c.values[..., :8, :]) for c in cache]
    shift_cache(cache, rotation, ShiftPlan(8, 12))
    cold = _prefill(llama, tokens[:8] + tokens[20:])
    assert all(c.offset == 28 for c in cache)
    first, reference = cache[0], cold[0]
    assert mx.allclose(first.keys[..., :28, :], reference.keys[..., :28, :], atol=1e-5).item()
    assert mx.allclose(first.values[..., :28, :], reference.values[..., :28, :], atol=1e-5).item()
    # Unrotated moved keys differ: the comparison above can fail.
    assert not mx.allclose(_prefill(llama, tokens)[0].keys[..., 20:40, :], reference.keys[..., 8:28, :], atol=1e-3).item()
    for c, (k, v) in zip(cache, kept_before):  # every layer keeps its first n_keep positions as they were
        assert mx.array_equal(c.keys[..., :8, :], k).item() and mx.array_equal(c.values[..., :8, :], v).item()



def test_shifted_block_keys_are_the_keys_at_their_new_positions():
    """-ctk q8_0: the stored keys are ggml's blocks; a shift dequantizes, rotates and quantizes them
    again (llama.cpp's K shift does the same), so layer 0's moved keys are a cold prefill's at
    their new positions to the blocks' rounding, and the values move as they are."""
    from mlxcel_compat.runtime import kv_blocks, kv_precision
    from mlxcel_compat.runtime.kv_precision import KvTypes

    model, _ = load_model(tiny_model("mistral"))  # head size 32: one block a row
    kv_precision.install(model, KvTypes("q8_0", "q8_0"))
    tokens = [(7 * i + 3) % 500 + 10 for i in range(40)]
    rotation, reason = key_rotation(model, make_prompt_cache(model), add_bos=False)
    assert rotation is not None and rotation.blocks == "q8_0", reason
    cache = _prefill(model, tokens)
    assert cache[0].keys.dtype == mx.uint8
    shift_cache(cache, rotation, ShiftPlan(8, 12))
    cold = _prefill(model, tokens[:8] + tokens[20:])
    keys, reference = (kv_blocks.dequantize(c[0].keys[..., :28, :], "q8_0") for c in (cache, cold))
    top = mx.abs(reference).max().item()
    assert mx.abs(keys - reference).max().item() <= 0.02 * top
    moved = kv_blocks.dequantize(_prefill(model, tokens)[0].keys[..., 20:40, :], "q8_0")
    assert mx.abs(moved - reference[..., 8:28, :]).max().item() > 0.1 * top  # unrotated: far off
    assert mx.array_equal(cache[0].values[..., 8:28, :], _prefill(model, tokens)[0].values[..., 20:40, :]).item()

def test_recurrent_models_cannot_shift():
    model, _ = load_model(tiny_model("lfm2"))
    rotation, reason = key_rotation(model, make_prompt_cache(model), add_bos=False)
    assert rotation is None and "ArraysCache" in reason


@pytest.fixture(scope="module")
def shifting():
    harness = EngineHarness(tiny_model("llama"), batch_size=16, n_parallel=2, ctx_size=512, context_shift=True)
    yield harness
    harness.close()


def test_generation_goes_past_the_context(shifting):
    """256 tokens a slot (the context is padded to 256 as llama.cpp pads it): a 20-token prompt
    generates 400 tokens through several shifts; only the kept prefix is donated to the prompt cache."""
    prompt = [(11 * i + 5) % 400 + 20 for i in range(20)]
    shifting.reset()
    run = shifting.run(prompt, n_predict=400, ignore_eos=True, n_keep=10)
    assert len(run.tokens) == 400
    assert run.finish.truncated and run.finish.stop_type == "limit"
    assert run.finish.n_prompt == 20
    assert shifting.stats()["entries"] == 1
    entry_tokens = shifting.on_engine(lambda: [list(e.tokens) for e in shifting.engine.prefix_cache.store.entries()])
    kept = 10 + shifting.engine.key_rotation.add_bos  # llama-server keeps the BOS on top of n_keep
    assert entry_tokens == [prompt[:kept]]


def test_concurrent_rows_shift_out_of_the_batch(shifting):
    """Two sequences decoding in one batch each shift when full and go on (rows leave the batch,
    shift their own caches and join again); each generates what it generates alone."""
    import queue
    from tests.engine.harness import collect

    prompts = [[(13 * i + k) % 300 + 30 for i in range(18)] for k in (1, 2)]
    alone = [shifting.run(p, n_predict=280, ignore_eos=True, cache=False).tokens for p in prompts]
    sinks = [queue.Queue(), queue.Queue()]
    for p, sink in zip(prompts, sinks):
        shifting.submit(p, sink.put, n_predict=280, ignore_eos=True, cache=False)
    together = [collect(sink) for sink in sinks]
    assert [len(r.tokens) for r in together] == [280, 280]
    assert all(r.finish.truncated for r in together)
    assert [r.tokens for r in together] == alone


def test_without_context_shift_generation_stops_at_the_context():
    harness = EngineHarness(tiny_model("llama"), batch_size=16, n_parallel=2, ctx_size=512)
    try:
        run = harness.run([(11 * i + 5) % 400 + 20 for i in range(20)], n_predict=300, ignore_eos=True)
    finally:
        harness.close()
    assert len(run.tokens) == 256 - 20 and run.finish.truncated
