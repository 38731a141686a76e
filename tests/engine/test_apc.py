"""APC (partial reuse through block-hash chains) on a real engine and real tiny models.

Sizes are chosen so each case is what it claims to be: blocks of 16 tokens, prefill chunks of 32.
A shared prefix of 200 tokens ends inside block 13 (12 agreeing blocks = 192 tokens, 8 more
verified token by token) and inside a chunk (200 % 32 = 8): its adoption splits the prefill where a
cold run does not, so it is compared with a tolerance. A shared prefix of 192 tokens ends on a
block *and* a chunk boundary that the stored entry and the cold run both used, so it must
reproduce the cold run exactly (bit-identical log-probabilities), as the spec's exactness rule says.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mlxcel_compat.engine.apc import trace_line
from tests.conftest import tiny_model
from tests.engine.harness import EngineHarness, Run

CHUNK = 32
BLOCK = 16
LOGPROB_TOL = 1e-4
N_PROBS = 8

HarnessFactory = Callable[..., EngineHarness]


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8000) for _ in range(n)]


def diverging(shared: list[int], seed_a: int, seed_b: int, n: int) -> tuple[list[int], list[int]]:
    """Two prompts sharing exactly ``shared``: their next tokens differ."""
    a, b = random_tokens(n, seed_a), random_tokens(n, seed_b)
    b[0] = (a[0] + 1) % 8000
    return shared + a, shared + b


@pytest.fixture(scope="module")
def harnesses() -> Iterator[HarnessFactory]:
    """One engine per (family, cache config), built on first use and emptied before each use."""
    made: dict[tuple[str, tuple[tuple[str, Any], ...]], EngineHarness] = {}

    def get(family: str = "llama", **config: Any) -> EngineHarness:
        key = (family, tuple(sorted(config.items())))
        if key not in made:
            made[key] = EngineHarness(tiny_model(family), batch_size=CHUNK, **{"apc_block_size": BLOCK, **config})
        harness = made[key]
        harness.reset()
        return harness

    yield get
    for harness in made.values():
        harness.close()


def assert_close(warm: Run, cold: Run) -> None:
    common = set(warm.logprobs[0]) & set(cold.logprobs[0])
    assert len(common) >= N_PROBS - 1
    for token in common:
        assert abs(warm.logprobs[0][token] - cold.logprobs[0][token]) < LOGPROB_TOL, token


# --- partial overlap: APC on and off ---


@pytest.mark.parametrize(
    "apc_enabled, apc_hash, expected",
    [(True, "sha256", 200), (True, "blake3", 200), (False, "sha256", 0)],
)
def test_shared_200_then_diverging(harnesses: HarnessFactory, apc_enabled: bool, apc_hash: str, expected: int) -> None:
    h = harnesses(apc_enabled=apc_enabled, apc_hash=apc_hash)
    first, second = diverging(random_tokens(200, seed=1), 2, 3, 30)
    h.run(first, n_predict=4)
    before = h.stats()  # counters are monotonic: they survive reset
    warm = h.run(second, n_predict=1, session="other")
    assert warm.finish.n_cached == expected
    stats = h.stats()
    delta = {k: stats[k] - before[k] for k in ("hits", "apc_hits", "apc_block_tokens_total", "apc_extended_tokens_total")}
    assert stats["apc_enabled"] is apc_enabled
    if apc_enabled:
        assert stats["hash"] == apc_hash and stats["block_size"] == BLOCK
        # 12 agreeing blocks (192 tokens), then 8 tokens verified one by one.
        assert delta == {"hits": 1, "apc_hits": 1, "apc_block_tokens_total": 192, "apc_extended_tokens_total": 8}
    else:
        # The stored entry is not a whole prefix of the request, so without APC it is not eligible.
        assert stats["apc_disabled_reason"] == "flag"
        assert delta["hits"] == 0
        assert stats["miss_reasons"]["no_candidate"] == before["miss_reasons"]["no_candidate"] + 1


@pytest.mark.parametrize("apc_enabled", [True, False])
def test_exact_repeat_adopts_all_but_the_last_token(harnesses: HarnessFactory, apc_enabled: bool) -> None:
    h = harnesses(apc_enabled=apc_enabled)
    prompt = random_tokens(50, seed=4)
    cold = h.run(prompt, n_predict=1)  # stores exactly the prompt (the sampled token is never fed back)
    warm = h.run(prompt, n_predict=1)
    assert warm.finish.n_cached == len(prompt) - 1
    assert warm.tokens == cold.tokens


@pytest.mark.parametrize("apc_enabled, expected", [(True, 49), (False, 0)])
def test_repeat_of_a_prompt_inside_a_longer_entry(harnesses: HarnessFactory, apc_enabled: bool, expected: int) -> None:
    # The entry holds prompt + generated tokens: the request lies inside it. APC cuts the entry to
    # the request (token-granular past the 48-token block floor, then clamped to len - 1); without
    # APC the entry is not a whole prefix of the request and is not eligible.
    h = harnesses(apc_enabled=apc_enabled)
    prompt = random_tokens(50, seed=5)
    h.run(prompt, n_predict=6)
    assert h.run(prompt, n_predict=1).finish.n_cached == expected


@pytest.mark.parametrize("family", ["llama", "llama:q4_0"])
def test_partial_adoption_is_within_tolerance_of_a_cold_prefill(harnesses: HarnessFactory, family: str) -> None:
    h = harnesses(family)
    first, second = diverging(random_tokens(200, seed=6), 7, 8, 25)
    h.run(first, n_predict=2)
    apc_hits = h.stats()["apc_hits"]  # counters are monotonic: they survive reset
    warm = h.run(second, n_predict=1, n_probs=N_PROBS)
    cold = h.run(second, n_predict=1, n_probs=N_PROBS, cache=False)
    assert warm.finish.n_cached == 200 and 200 % CHUNK != 0
    assert cold.finish.n_cached == 0
    assert h.stats()["apc_hits"] == apc_hits + 1
    assert_close(warm, cold)


@pytest.mark.parametrize("family", ["llama", "llama:q4_0"])
def test_partial_adoption_at_a_chunk_boundary_is_exact(harnesses: HarnessFactory, family: str) -> None:
    h = harnesses(family)
    first, second = diverging(random_tokens(6 * CHUNK, seed=9), 10, 11, 40)
    h.run(first, n_predict=3)
    apc_hits = h.stats()["apc_hits"]
    warm = h.run(second, n_predict=10, n_probs=N_PROBS)
    cold = h.run(second, n_predict=10, n_probs=N_PROBS, cache=False)
    assert warm.finish.n_cached == 6 * CHUNK
    assert h.stats()["apc_hits"] == apc_hits + 1  # a real partial overlap: the entry goes on past 192
    assert warm.tokens == cold.tokens
    assert warm.logprobs == cold.logprobs  # bit-identical, not just close


# --- families without APC ---


@pytest.mark.parametrize(
    "family, reason",
    [
        ("qwen3_next", "recurrent_family"),  # hybrid: linear-attention (ArraysCache) + KV layers
        ("gemma3_text", "non_trimmable_cache"),  # sliding window of 64 (RotatingKVCache)
    ],
)
def test_apc_off_families_keep_whole_prefix_reuse(harnesses: HarnessFactory, family: str, reason: str) -> None:
    h = harnesses(family)
    stats = h.stats()
    assert stats["enabled"] is True
    assert (stats["apc_enabled"], stats["apc_disabled_reason"], stats["block_size"]) == (False, reason, 0)
    prompt = random_tokens(100, seed=12)  # longer than the sliding window: the rotating cache wraps
    first = h.run(prompt, n_predict=4)
    # The next turn: the stored prompt + reply is a whole prefix of it.
    follow_up = prompt + first.tokens + random_tokens(20, seed=13)
    warm = h.run(follow_up, n_predict=1, n_probs=N_PROBS)
    cold = h.run(follow_up, n_predict=1, n_probs=N_PROBS, cache=False)
    assert warm.finish.n_cached == len(prompt) + len(first.tokens) - 1
    assert_close(warm, cold)
    # A partial overlap is never adopted: the state cannot be cut back to it.
    other = prompt[:80] + random_tokens(30, seed=14)
    assert h.run(other, n_predict=1).finish.n_cached == 0
    stats = h.stats()
    assert (stats["total_blocks_stored"], stats["apc_active_entries"], stats["apc_hits"]) == (0, 0, 0)


# --- stats, reset, trace ---


def test_stats_count_shared_blocks_and_reset_clears_chains(harnesses: HarnessFactory) -> None:
    h = harnesses()
    first, second = diverging(random_tokens(4 * BLOCK, seed=15), 16, 17, 40)
    h.run(first, n_predict=1, session="a")  # entry of 104 tokens: 7 blocks (6 full + 1 partial)
    assert h.run(second, n_predict=1, session="b").finish.n_cached == 4 * BLOCK
    stats = h.stats()
    assert stats["entries"] == 2 and stats["apc_active_entries"] == 2
    assert stats["total_blocks_stored"] == 14
    # The 4 full blocks of the shared prefix are stored twice under the same hashes.
    assert stats["total_blocks_stored"] - stats["unique_block_hashes"] == 4
    h.reset()
    stats = h.stats()
    assert (stats["entries"], stats["total_blocks_stored"], stats["unique_block_hashes"], stats["apc_active_entries"]) == (0, 0, 0, 0)
    assert h.run(second, n_predict=1, session="c").finish.n_cached == 0


def test_trace_logs_one_line_per_lookup(harnesses: HarnessFactory, caplog: pytest.LogCaptureFixture) -> None:
    h = harnesses(apc_trace=True)
    first, second = diverging(random_tokens(200, seed=18), 19, 20, 30)
    with caplog.at_level(logging.INFO, logger="mlxcel_compat.engine.prefix_cache"):
        h.run(first, n_predict=2)
        h.run(second, n_predict=1)
        h.run(second, n_predict=1, cache=False)  # no lookup, no line
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("apc-trace:")]
    assert len(lines) == 2, lines
    assert "miss " in lines[0] and "candidate=- " in lines[0] and "reason=no_candidate why=no_overlap" in lines[0]
    entry_id = h.on_engine(lambda: [e.id for e in h.engine.prefix_cache.store.entries()][0])
    assert (
        "hit task=" in lines[1]
        and f"candidate={entry_id} common=200 block_verified=192 verified=200 adopted=200 reason=session why=apc_blocks_then_tokens"
        in lines[1]
    ), lines[1]
    assert str(first[0]) not in " ".join(lines)  # never log tokens


def test_trace_line_for_a_clamped_whole_entry_and_a_failed_adoption(harnesses: HarnessFactory) -> None:
    h = harnesses()
    prompt = random_tokens(40, seed=21)
    h.run(prompt, n_predict=1)

    def lookup() -> Any:
        from mlxcel_compat.cache.key import RAW_PROMPT_TEMPLATE_SIG, TEXT_ONLY_MM_DIGEST, Bucket

        cache = h.engine.prefix_cache
        bucket = Bucket(cache.model_id, "", RAW_PROMPT_TEMPLATE_SIG, None, TEXT_ONLY_MM_DIGEST)
        return cache.store.lookup(bucket, "s", tuple(prompt))

    result = h.on_engine(lookup)
    line = trace_line(7, len(prompt), result)
    assert "hit task=7 prompt=40" in line and "common=40 block_verified=40 verified=40 adopted=39" in line
    assert line.endswith("why=whole_entry_prefix,clamped_to_prompt_minus_1")
    assert "miss " in trace_line(7, 40, result, failed=True) and "adopted=0 reason=adoption_failed" in trace_line(7, 40, result, failed=True)
