"""Session snapshots on real recurrent-hybrid (qwen3_next) and sliding-window (gemma3_text) models.

Exactness: a restored boundary snapshot continues exactly like a cold run whose prefill is split
at the same boundary (identical greedy tokens, bit-identical log-probabilities). Against a cold
run without that split, first-token log-probabilities agree within LOGPROB_TOL.
"""

from __future__ import annotations

import random
import time

import pytest

from mlxcel_compat.cache.key import RAW_PROMPT_TEMPLATE_SIG
from mlxcel_compat.engine.request import WarmupJob
from tests.conftest import tiny_model
from tests.engine.harness import EngineHarness

CHUNK = 32
LOGPROB_TOL = 1e-4


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8000) for _ in range(n)]


@pytest.fixture(scope="module", params=["qwen3_next", "gemma3_text", "gemma3_text:q8_0"])
def harness(request: pytest.FixtureRequest):
    h = EngineHarness(tiny_model(request.param), batch_size=CHUNK, n_parallel=2, min_prefix=8)
    yield h
    h.close()


@pytest.fixture(autouse=True)
def _empty(harness: EngineHarness) -> None:
    harness.reset()


def test_the_model_uses_the_snapshot_store(harness: EngineHarness) -> None:
    stats = harness.stats()
    assert stats["snapshot_family"] is True and stats["snapshot_enabled"] is True
    assert stats["apc_enabled"] is False
    harness.run(random_tokens(90, seed=1), n_predict=3)
    stats = harness.stats()
    assert stats["snapshot_entries"] == 1 and stats["entries"] == 0  # not the KV store


def test_restored_boundary_snapshot_is_exact(harness: EngineHarness) -> None:
    history = random_tokens(100, seed=2)  # boundary not on a chunk multiple: 100 = 3 * 32 + 4
    first = history + random_tokens(12, seed=3)
    second = history + random_tokens(15, seed=4)
    harness.run(first, n_predict=4, boundary=len(history), session="x")
    decoder = harness.engine.loaded.decoder
    prefilled, steps = (decoder.prefilled, decoder.steps) if decoder is not None else (0, 0)
    warm = harness.run(second, n_predict=10, n_probs=8, boundary=len(history), session="x")
    assert warm.finish.n_cached == len(history)
    if harness.engine.loaded.model.model_type == "qwen3_next":
        # the hybrid's 15-token rest went as the 15 rows of one decode pass (then 9 steps), no prompt chunk
        assert decoder is not None and (decoder.prefilled, decoder.steps) == (prefilled, steps + 15 + 9)
    split_cold = harness.run(second, n_predict=10, n_probs=8, boundary=len(history), session="fresh")
    assert split_cold.finish.n_cached == 0
    assert warm.tokens == split_cold.tokens
    assert warm.logprobs == split_cold.logprobs
    unsplit = harness.run(second, n_predict=1, n_probs=8, cache=False)
    common = set(warm.logprobs[0]) & set(unsplit.logprobs[0])
    assert len(common) >= 7
    for token in common:
        assert abs(warm.logprobs[0][token] - unsplit.logprobs[0][token]) < LOGPROB_TOL


def test_a_warm_up_computes_what_a_cold_prefill_computes(harness: EngineHarness) -> None:
    """The idle warm-up extends the boundary snapshot through the reply the way a prefill does
    (through the CPU decode runtime where it takes the cache, not MLX's forward): on the chunk
    grid, the next turn restored from it is bit-identical to a cold run of the same prompt."""
    history, reply, new = random_tokens(3 * CHUNK, seed=5), random_tokens(CHUNK, seed=6), random_tokens(15, seed=7)
    harness.run(history + random_tokens(12, seed=8), n_predict=2, boundary=len(history), session="x")
    decoder = harness.engine.loaded.decoder
    prefilled = decoder.prefilled if decoder is not None else 0
    harness.engine.warmup(WarmupJob(session_key="x", template_sig=RAW_PROMPT_TEMPLATE_SIG, tokens=history + reply))
    deadline = time.monotonic() + 60
    while harness.stats()["snapshot_warmups_run"] < 1:
        assert time.monotonic() < deadline, "the warm-up never ran"
        time.sleep(0.05)
    if decoder is not None:
        assert decoder.prefilled == prefilled + len(reply)  # the runtime fed the reply
    prompt = history + reply + new
    warm = harness.run(prompt, n_predict=8, n_probs=8, boundary=len(prompt) - 1, session="x")
    assert warm.finish.n_cached == len(history + reply)
    cold = harness.run(prompt, n_predict=8, n_probs=8, cache=False)
    assert warm.tokens == cold.tokens
    assert warm.logprobs == cold.logprobs


def test_rewritten_history_is_rejected_with_its_geometry(harness: EngineHarness) -> None:
    history = random_tokens(80, seed=5)
    run = harness.run(history + random_tokens(10, seed=6), n_predict=3, boundary=len(history), session="y")
    completion_len = 90 + len(run.tokens) - 1
    rewritten = history[:50] + random_tokens(60, seed=7)  # the client changed an early turn
    cold = harness.run(rewritten, n_predict=2, session="y")
    assert cold.finish.n_cached == 0
    stats = harness.stats()
    assert stats["snapshot_rejections"]["snapshot_diverged"] == 1
    reject = stats["snapshot_last_reject"]
    assert reject["reason"] == "snapshot_diverged"
    assert reject["common_prefix"] == 50
    assert reject["stored_len"] in (len(history), completion_len)
    assert reject["request_len"] == len(rewritten)


def test_another_session_never_restores_a_snapshot(harness: EngineHarness) -> None:
    prompt = random_tokens(70, seed=8)
    harness.run(prompt, n_predict=3, session="owner")
    stranger = harness.run(prompt + random_tokens(5, seed=9), n_predict=2, session="stranger")
    assert stranger.finish.n_cached == 0
    assert harness.stats()["snapshot_rejections"]["no_candidate"] >= 1


def test_byte_budget_holds_under_churn(harness: EngineHarness) -> None:
    def set_budget(nbytes: int) -> None:
        harness.engine.prefix_cache.snapshots.store.capacity_bytes = nbytes

    harness.run(random_tokens(60, seed=10), n_predict=2, session="probe")
    one = harness.stats()["snapshot_bytes"]
    budget = 3 * one + one // 2
    harness.on_engine(lambda: set_budget(budget))
    try:
        for i in range(10):
            harness.run(random_tokens(60, seed=100 + i), n_predict=2, session=f"user-{i}")
            stats = harness.stats()
            assert stats["snapshot_bytes"] <= budget
        assert stats["snapshot_evictions_lru"] > 0
    finally:
        harness.on_engine(lambda: set_budget(1 << 30))
