"""KV stored as ggml's q8_0 and q4_0 blocks (-ctk/-ctv q8_0, q4_0: runtime/kv_blocks.py), alone or
beside a 16-bit side (-ctk q8_0 -ctv f16), on a real engine: the tiny mistral (llama's shape with a
head size of 32: one block a row) and the tiny gemma2 (soft caps) on the CPU decode runtime.

MLX's prefill and the CPU decode runtime's chunks and steps quantize alike and read the stored
blocks, so an aligned hit equals the cold run bit for bit; entries hold the blocks' bytes.
"""

from __future__ import annotations

import pytest

from mlxcel_compat.model.load_options import LoadOptions
from mlxcel_compat.runtime.kv_precision import KvTypes
from tests.conftest import tiny_model
from tests.engine.harness import EngineHarness
from tests.engine.test_prefix_cache import CHUNK, N_PROBS, random_tokens


BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "f16": 64}  # bytes for 32 values


@pytest.fixture(scope="module", params=["mistral:q8_0", "mistral:q4_0", "gemma2:q8_0", "mistral:q8_0/f16",
                                        pytest.param("gemma2:f16/q4_0", marks=pytest.mark.slow)])
def block_harness(request: pytest.FixtureRequest):
    """A tiny model with a head size of 32 (one block a row) storing its KV as ggml's blocks: the
    mistral and gemma2 (soft caps) on the CPU decode runtime; ``K/V`` a pair of types (-ctk q8_0 -ctv f16)."""
    family, kinds = request.param.split(":")
    k, _, v = kinds.partition("/")
    h = EngineHarness(tiny_model(family), batch_size=CHUNK, load_options=LoadOptions(kv_types=KvTypes(k, v or k)))
    h.precision, h.runtime = (k, v or k), family in ("mistral", "gemma2")
    yield h
    h.close()


def test_aligned_hit_equals_the_cold_run_exactly_over_blocks(block_harness: EngineHarness) -> None:
    """MLX's prefill and the runtime's chunks and steps write the same blocks and read them as
    stored: an aligned hit gives the cold run's tokens and log-probabilities bit for bit, and the
    runtime ran the prompt's rest and the steps."""
    block_harness.reset()
    decoder = block_harness.engine.loaded.decoder
    assert (decoder is not None) == block_harness.runtime
    steps = decoder.steps if decoder else 0
    shared = random_tokens(2 * CHUNK, seed=21)
    block_harness.run(shared + random_tokens(9, seed=22), n_predict=4)
    second = shared + random_tokens(27, seed=23)
    warm = block_harness.run(second, n_predict=12, n_probs=N_PROBS)
    assert warm.finish.n_cached == 2 * CHUNK
    cold = block_harness.run(second, n_predict=12, n_probs=N_PROBS, cache=False)
    assert warm.tokens == cold.tokens
    assert warm.logprobs == cold.logprobs  # bit-identical
    if decoder:
        codes = {"f16": 1, "q8_0": 3, "q4_0": 4}
        assert decoder.steps > steps and decoder.kv.codes == tuple(codes[t] for t in block_harness.precision)


def test_entries_hold_blocks(block_harness: EngineHarness) -> None:
    """An entry's bytes are its tokens' blocks: 34 (q8_0) or 18 (q4_0) bytes per 32 values (64 at
    f16), each side at its own type."""
    block_harness.reset()
    block_harness.run(random_tokens(3 * CHUNK, seed=24), n_predict=3)
    stats = block_harness.stats()
    assert (stats["kv_cache_type_k"], stats["kv_cache_type_v"]) == block_harness.precision
    config = block_harness.engine.loaded.config
    values_per_side = config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"]
    per_token = sum(values_per_side // 32 * BLOCK_BYTES[t] for t in block_harness.precision)
    assert stats["kv_bytes_per_token"] == per_token
    assert stats["entries"] == 1 and stats["bytes"] == (3 * CHUNK + 2) * per_token
