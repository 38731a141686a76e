"""KV precision (-ctk/-ctv, runtime/kv_precision.py) on a real engine and the tiny llama.

The KV is stored in the configured type and attention reads the stored values in the cold run
as in a hit, so an aligned hit reproduces the cold run exactly (tokens and log-probabilities) at
every precision; the entries hold half the bytes at f16 and bf16. The CPU decode runtime runs
the prompt and the steps over the 16-bit KV (tests/runtime/test_cpu_decode_kv16.py).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxcel_compat.model.load_options import LoadOptions
from mlxcel_compat.runtime.kv_precision import KvTypes
from tests.conftest import tiny_model
from tests.engine.harness import EngineHarness
from tests.engine.test_prefix_cache import CHUNK, N_PROBS, random_tokens

DTYPES = {"f16": mx.float16, "bf16": mx.bfloat16}


@pytest.fixture(scope="module", params=["f16", pytest.param("bf16", marks=pytest.mark.slow)])
def harness(request: pytest.FixtureRequest):
    h = EngineHarness(tiny_model("llama"), batch_size=CHUNK,
                      load_options=LoadOptions(kv_types=KvTypes(request.param, request.param)))
    h.precision = request.param
    yield h
    h.close()


@pytest.fixture(autouse=True)
def _empty_cache(harness: EngineHarness) -> None:
    harness.reset()


def test_aligned_hit_equals_the_cold_run_exactly(harness: EngineHarness) -> None:
    shared = random_tokens(2 * CHUNK, seed=11)
    harness.run(shared + random_tokens(9, seed=12), n_predict=4)
    second = shared + random_tokens(27, seed=13)
    warm = harness.run(second, n_predict=12, n_probs=N_PROBS)
    assert warm.finish.n_cached == 2 * CHUNK
    cold = harness.run(second, n_predict=12, n_probs=N_PROBS, cache=False)
    assert warm.tokens == cold.tokens
    assert warm.logprobs == cold.logprobs  # bit-identical


def test_entries_hold_kv_in_the_configured_type(harness: EngineHarness) -> None:
    """An entry's bytes are its tokens at the configured precision: half of float32's at 16 bits."""
    harness.run(random_tokens(3 * CHUNK, seed=14), n_predict=3)
    stats = harness.stats()
    assert (stats["kv_cache_type_k"], stats["kv_cache_type_v"]) == (harness.precision, harness.precision)
    config = harness.engine.loaded.config
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    f32_per_token = config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4
    assert stats["kv_bytes_per_token"] == f32_per_token // 2
    assert stats["entries"] == 1
    assert stats["bytes"] == (3 * CHUNK + 2) * f32_per_token // 2  # the prompt and two generated tokens


def test_the_engine_decodes_with_the_cpu_runtime_at_16_bits(harness: EngineHarness) -> None:
    """The CPU decode runtime reads and writes 16-bit KV: it runs the prompt and the steps, and
    the entry it leaves holds the configured type."""
    decoder = harness.engine.loaded.decoder
    assert decoder is not None and decoder.kv.dtypes == (DTYPES[harness.precision],) * 2
    steps, prefilled = decoder.steps, decoder.prefilled
    harness.run(random_tokens(CHUNK + 5, seed=15), n_predict=6)
    assert decoder.steps > steps and decoder.prefilled > prefilled


def test_the_default_budget_sizes_entries_at_the_configured_precision() -> None:
    """The model-aware prompt-cache budget (six entries of min(n_ctx, 8192) tokens) counts an
    entry at the KV's storage type: at f16 an entry, and so the budget, is half of float32's."""
    from mlxcel_compat.engine.prefix_cache_config import kv_bytes_per_token, model_aware_capacity

    config = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}
    f32 = model_aware_capacity(config, 32768, 8 << 30, 128 << 30)
    f16 = model_aware_capacity(config, 32768, 8 << 30, 128 << 30, kv_bytes_per_token(config, 2))
    assert f32 == (6 * (2 << 30), 2 << 30) and f16 == (6 * (1 << 30), 1 << 30)
