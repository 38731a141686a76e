"""The engine's features on a mixture-of-experts model: the factory's qwen3_moe as a Q8_0 GGUF
(attention and the stacked experts in the file's blocks), stepped by the CPU decode runtime
(``runtime/decode_moe.py``; the harness's model has a decoder, checked below).

The same rules as on the dense families: a prompt-cache hit whose adopted prefix ends on a prefill
chunk boundary the cold run also uses reproduces the cold run exactly (tokens and log-probabilities
bit for bit), from RAM or from the disk tier; concurrent requests decode in one batch and each
agrees with its lone run wherever the lone run's choice was decided; LoRA on the attention
projections equals the model with the adapter fused into its weights.
"""

from __future__ import annotations

import random
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxcel_compat.lora.adapters import AdapterSet, AdapterSpec
from mlxcel_compat.model.loader import load_model
from mlxcel_compat.runtime import lora_rows
from mlxcel_compat.runtime.block_layers import module_at
from mlxcel_compat.testing import adapters as factory
from tests.conftest import MODEL_CACHE, tiny_model
from tests.engine.harness import EngineHarness
from tests.engine.test_batching import agree_where_decided, run_concurrently

pytestmark = pytest.mark.engine

MOE = "qwen3_moe:q8_0"
CHUNK = 16
N_PROBS = 4


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8000) for _ in range(n)]


@pytest.fixture(scope="module")
def harness():
    h = EngineHarness(tiny_model(MOE), batch_size=CHUNK, n_parallel=4)
    yield h
    h.close()


def test_an_aligned_prompt_cache_hit_is_the_cold_run(harness: EngineHarness) -> None:
    harness.reset()
    decoder = harness.engine.loaded.decoder
    steps = decoder.steps
    shared = tokens(2 * CHUNK, seed=1)
    second = shared + tokens(27, seed=3)
    harness.run(shared + tokens(9, seed=2), n_predict=4)  # donates its prompt and tokens
    warm = harness.run(second, n_predict=12, n_probs=N_PROBS, ignore_eos=True)
    cold = harness.run(second, n_predict=12, n_probs=N_PROBS, ignore_eos=True, cache=False)
    assert decoder.steps >= steps + 2 * 11  # the runtime's steps, MoE layers included
    assert warm.finish.n_cached == 2 * CHUNK and cold.finish.n_cached == 0
    assert warm.tokens == cold.tokens
    assert warm.logprobs == cold.logprobs
    assert harness.stats()["hits"] >= 1


def test_concurrent_requests_decode_in_one_batch_and_agree_with_lone_runs(harness: EngineHarness) -> None:
    prompts = [tokens(n, seed=n) for n in (20, 45, 33)]
    batched = run_concurrently(harness, prompts, n_predict=12, n_probs=2, ignore_eos=True, cache=False)
    alone = [harness.run(p, n_predict=12, n_probs=2, ignore_eos=True, cache=False) for p in prompts]
    for b, a in zip(batched, alone):
        assert len(b.tokens) == 12
        agree_where_decided(b, a)
    assert harness.engine.metrics.n_busy_slots_total / harness.engine.metrics.n_decode_total > 1.0


def test_a_disk_tier_hit_is_the_cold_run(tmp_path: Path) -> None:
    """RAM holds one entry; the first prompt's is pushed to disk by the second and read back."""
    h = EngineHarness(tiny_model(MOE), batch_size=CHUNK, capacity_bytes=60_000, disk_dir=str(tmp_path),
                      disk_capacity_bytes=1 << 28)
    try:
        a, b = tokens(4 * CHUNK + 1, seed=11), tokens(4 * CHUNK + 1, seed=12)
        cold = h.run(a, n_predict=8, n_probs=N_PROBS, ignore_eos=True, cache=False)
        h.run(a, n_predict=8)
        h.run(b, n_predict=8)  # pushes a's entry out of RAM
        assert h.on_engine(lambda: h.engine.prefix_cache.disk.wait_written(30))
        again = h.run(a, n_predict=8, n_probs=N_PROBS, ignore_eos=True)
        assert again.finish.n_cached == len(a) - 1
        assert h.stats()["tiers"]["disk"]["hits"] == 1
        assert again.tokens == cold.tokens and again.logprobs == cold.logprobs
    finally:
        h.close()


def test_lora_on_the_attention_projections_equals_the_fused_model() -> None:
    """A GGUF LoRA for qwen3_moe adapts q/k/v/o (the factory's targets; the MoE layer has no
    dense gate/up/down): served unfused, it equals the weights with the adapter fused in."""
    base = tiny_model("qwen3_moe:f32")
    adapter = factory.ensure_adapter("qwen3_moe", "tiny", "gguf", cache_dir=MODEL_CACHE)
    loaded = load_model(str(base), [], adapters=AdapterSet.from_specs([AdapterSpec(str(adapter), 1.0)]).adapters)
    assert loaded.n_adapted == 4 * loaded.config["num_hidden_layers"]
    reference = load_model(str(base), []).model
    factors, multiplier = factory.adapter_factors("qwen3_moe", "tiny")
    assert sorted({p.rsplit(".", 1)[-1] for p in factors}) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    scale = 0.75
    for path, (a, b) in factors.items():
        module = module_at(reference, path)
        module.weight = module.weight + np.float32(scale * multiplier) * (mx.array(b) @ mx.array(a))
    prompt = tokens(24, seed=21)

    def logits(model, scales=None) -> np.ndarray:
        with lora_rows.applied(scales):
            return np.array(model(mx.array([prompt]), cache=make_prompt_cache(model))[0])

    ours, theirs = logits(loaded.model, [(scale,)]), logits(reference)
    assert np.max(np.abs(ours - theirs)) <= 2e-5 * np.max(np.abs(theirs))  # float32 summation order
    plain = logits(load_model(str(base), []).model)
    assert np.max(np.abs(plain - theirs)) > 0.5  # the adapter matters
    assert np.array_equal(logits(loaded.model, [(0.0,)]), plain)


def test_gpt_oss_on_the_runtime_a_hit_is_the_cold_run_and_batches_agree() -> None:
    """gpt-oss (MXFP4 experts with biases, sinks, sliding-window rings beside full layers) as
    the engine serves it: prompt chunks and steps on the CPU decode runtime; its rings cannot be
    cut to a prefix, so reuse is the session snapshot's, and a restored snapshot reproduces the
    cold run split at the same boundary (tokens and log-probabilities); concurrent requests
    agree with their lone runs where decided."""
    h = EngineHarness(tiny_model("gpt_oss:mxfp4"), batch_size=CHUNK, n_parallel=3, min_prefix=8)
    try:
        decoder = h.engine.loaded.decoder
        assert decoder is not None and decoder.kv.rings
        assert h.stats()["snapshot_family"] is True
        steps, fed = decoder.steps, decoder.prefilled
        history = tokens(50, seed=1)  # past the window of 16, off the chunk grid (50 = 3 * 16 + 2)
        second = history + tokens(15, seed=4)
        h.run(history + tokens(12, seed=3), n_predict=4, boundary=len(history), session="x")
        warm = h.run(second, n_predict=12, n_probs=N_PROBS, ignore_eos=True, boundary=len(history), session="x")
        cold = h.run(second, n_predict=12, n_probs=N_PROBS, ignore_eos=True, boundary=len(history), session="fresh")
        assert warm.finish.n_cached == len(history) and cold.finish.n_cached == 0
        assert decoder.steps >= steps + 2 * 11 and decoder.prefilled >= fed + len(second)  # the runtime ran both
        assert warm.tokens == cold.tokens
        assert warm.logprobs == cold.logprobs
        prompts = [tokens(n, seed=n) for n in (20, 45, 33)]
        batched = run_concurrently(h, prompts, n_predict=8, n_probs=2, ignore_eos=True, cache=False)
        alone = [h.run(p, n_predict=8, n_probs=2, ignore_eos=True, cache=False) for p in prompts]
        for b, a in zip(batched, alone):
            agree_where_decided(b, a)
    finally:
        h.close()
