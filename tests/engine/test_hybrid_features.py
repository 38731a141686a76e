"""The engine's features on a hybrid model served from GGUF: the factory's Qwen3.5 (gated delta-net
layers with recurrent state, and attention layers), its Q8_0 file (matrices in ggml's blocks).

- the prompt cache: the model goes to the session-snapshot store (its state cannot be cut), and a
  restored snapshot continues exactly like a cold run whose prefill is split at the same boundary
  (tokens and log-probabilities identical);
- batching: concurrent sequences agree with their sequential runs wherever those are decided;
- the disk tier: a snapshot that left RAM comes back from disk and continues like the RAM hit;
- LoRA on the attention projections (and MLPs) of the F32 file, from a GGUF adapter: the adapted
  logits equal the model with the product fused into its weights, to float32 summation order.

Slot files are tested through the server (tests/e2e/test_hybrid.py).
"""

from __future__ import annotations

import queue
import random
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxcel_compat.gguf.load import load_gguf
from mlxcel_compat.lora.adapters import AdapterSet, AdapterSpec
from mlxcel_compat.model.loader import load_model
from mlxcel_compat.runtime import lora_rows
from mlxcel_compat.runtime.block_layers import module_at
from mlxcel_compat.testing import adapters as factory_adapters
from tests.conftest import MODEL_CACHE, tiny_model
from tests.engine.harness import EngineHarness, Run, collect

MODEL = "qwen3_5:q8_0"
CHUNK = 32
MARGIN = 1e-3  # batched rows compute with other matrix shapes: compare where the top-2 gap is wider


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8000) for _ in range(n)]


@pytest.fixture(scope="module")
def harness():
    h = EngineHarness(tiny_model(MODEL), batch_size=CHUNK, n_parallel=4, min_prefix=8)
    yield h
    h.close()


def test_a_restored_snapshot_continues_exactly_like_a_cold_run(harness: EngineHarness) -> None:
    harness.reset()
    stats = harness.stats()
    assert stats["snapshot_family"] is True and stats["apc_enabled"] is False
    history = random_tokens(100, seed=2)  # the boundary is not on a chunk multiple: 100 = 3 * 32 + 4
    first = history + random_tokens(12, seed=3)
    second = history + random_tokens(15, seed=4)
    harness.run(first, n_predict=4, boundary=len(history), session="x")
    assert harness.stats()["snapshot_entries"] >= 1 and harness.stats()["entries"] == 0  # not the KV store
    warm = harness.run(second, n_predict=10, n_probs=8, boundary=len(history), session="x")
    assert warm.finish.n_cached == len(history)
    cold = harness.run(second, n_predict=10, n_probs=8, boundary=len(history), session="fresh")
    assert cold.finish.n_cached == 0
    assert warm.tokens == cold.tokens and warm.logprobs == cold.logprobs
    # The next turn of a conversation: the completion snapshot (prompt + reply) is restored.
    follow_up = second + warm.tokens[:-1] + random_tokens(9, seed=5)
    turn = harness.run(follow_up, n_predict=4, session="x")
    assert turn.finish.n_cached == len(second) + len(warm.tokens) - 1


def test_concurrent_sequences_agree_with_sequential_runs(harness: EngineHarness) -> None:
    harness.reset()
    prompts = [random_tokens(n, seed=n) for n in (20, 45, 33, 70)]
    sinks = [queue.Queue() for _ in prompts]
    for prompt, sink in zip(prompts, sinks):
        harness.submit(prompt, sink.put, n_predict=16, n_probs=2, ignore_eos=True, cache=False)
    batched = [collect(sink) for sink in sinks]
    alone = [harness.run(p, n_predict=16, n_probs=2, ignore_eos=True, cache=False) for p in prompts]
    for b, a in zip(batched, alone):
        assert len(b.tokens) == 16
        for pos, (x, y) in enumerate(zip(b.tokens, a.tokens)):
            if x != y:
                top = sorted(a.logprobs[pos].values(), reverse=True)
                assert top[0] - top[1] < MARGIN, f"position {pos} differs although decided"
                break
    assert sum(b.tokens == a.tokens for b, a in zip(batched, alone)) >= 3
    metrics = harness.engine.metrics
    assert metrics.n_busy_slots_total / metrics.n_decode_total > 1.0  # decode steps were shared


def _settled_disk(h: EngineHarness) -> dict:
    """Wait for the disk tier's writer, then return its stats."""
    assert h.on_engine(lambda: h.engine.prefix_cache.disk.wait_written(30))
    return h.stats()["tiers"]["disk"]


def test_a_snapshot_from_disk_continues_like_the_ram_hit(tmp_path: Path) -> None:
    history = random_tokens(90, seed=9)
    outputs: dict[str, Run] = {}
    for where in ("ram", "disk"):
        h = EngineHarness(tiny_model(MODEL), batch_size=CHUNK, disk_dir=str(tmp_path / where),
                          disk_capacity_bytes=1 << 30)
        try:
            first = h.run(history, n_predict=4, session="alice")
            if where == "disk":  # move the snapshot out of RAM the way eviction does, then clear RAM
                disk = h.engine.prefix_cache.disk
                h.on_engine(lambda: [disk.spill("snapshot", e) for e in h.engine.prefix_cache.snapshots.store.entries()])
                assert _settled_disk(h)["entries"] == 1
                h.on_engine(lambda: h.engine.prefix_cache.reset("ram"))
            follow_up = history + first.tokens[:-1] + random_tokens(20, seed=10)
            outputs[where] = h.run(follow_up, n_predict=8, n_probs=4, session="alice")
            assert outputs[where].finish.n_cached == len(history) + len(first.tokens) - 1
            assert h.stats()["tiers"]["disk"]["hits"] == (1 if where == "disk" else 0)
        finally:
            h.close()
    assert outputs["disk"].tokens == outputs["ram"].tokens and outputs["disk"].logprobs == outputs["ram"].logprobs


def test_a_gguf_lora_adapter_on_the_attention_projections_equals_the_fused_weights() -> None:
    base = tiny_model("qwen3_5:f32")
    adapter = factory_adapters.ensure_adapter("qwen3_5", "tiny", "gguf", cache_dir=MODEL_CACHE)
    loaded = load_model(str(base), [], adapters=AdapterSet.from_specs([AdapterSpec(str(adapter), 1.0)]).adapters)
    factors, multiplier = factory_adapters.adapter_factors("qwen3_5", "tiny")
    attention = [p for p in factors if ".self_attn." in p]
    assert attention and loaded.n_adapted == len(factors)  # q, k, v, o of every attention layer, and the MLPs
    reference = load_gguf(str(base), on_cpu=True)[0]
    for path, (a, b) in factors.items():
        module = module_at(reference, path)
        module.weight = module.weight + np.float32(0.5 * multiplier) * (mx.array(b) @ mx.array(a))
    prompt = [1, 5, 9, 200, 33, 7, 8, 100, 42, 17, 256, 3]
    with lora_rows.applied([(0.5,)]):
        ours = np.array(loaded.model(mx.array([prompt]), cache=make_prompt_cache(loaded.model))[0])
    theirs = np.array(reference(mx.array([prompt]))[0])
    plain = np.array(load_gguf(str(base), on_cpu=True)[0](mx.array([prompt]))[0])
    assert np.max(np.abs(plain - theirs)) > 0.5  # the adapter matters
    assert np.max(np.abs(ours - theirs)) <= 2e-5 * np.max(np.abs(theirs))  # float32 summation order
