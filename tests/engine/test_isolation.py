"""The prompt cache on a real engine: tenant namespaces and token-verified adoption.

A request never adopts (whole, through APC, or from a session snapshot) state that another
namespace donated, and never adopts on the word of block hashes alone. Proven by reused tokens
and by output equal to a cold run.
"""

from __future__ import annotations

import queue

import pytest

from tests.cache.test_store import CollidingHash
from tests.conftest import tiny_model
from tests.engine.harness import EngineHarness, Run, collect
from tests.engine.test_batching import random_tokens

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module", params=["llama", "qwen3_next", "gemma3_text"])
def harness(request: pytest.FixtureRequest):
    h = EngineHarness(tiny_model(request.param), batch_size=32, n_parallel=2)
    yield h
    h.close()


def run(h: EngineHarness, prompt: list[int], namespace: str, n_predict: int = 6) -> Run:
    events: queue.Queue = queue.Queue()
    request = h.request(prompt, n_predict=n_predict, ignore_eos=True)
    request.cache.namespace = namespace
    h.engine.submit(request, events.put)
    return collect(events)


def test_another_namespace_never_adopts_and_its_own_does(harness: EngineHarness) -> None:
    harness.reset()
    first = random_tokens(60, seed=1)
    a = run(harness, first, "tenant-a")
    assert a.finish.n_cached == 0
    # The next turn: the first prompt, its reply and more. A's own namespace reuses its state
    # (dense KV whole or cut, or a whole-state snapshot); B's never does, though the session
    # key, template and tokens are the same.
    follow_up = first + a.tokens + random_tokens(12, seed=2)
    cold = harness.run(follow_up, n_predict=6, ignore_eos=True, cache=False)
    b = run(harness, follow_up, "tenant-b")
    assert b.finish.n_cached == 0
    assert b.tokens == cold.tokens
    a_again = run(harness, follow_up, "tenant-a")
    assert a_again.finish.n_cached >= len(first)
    assert a_again.tokens[:3] == cold.tokens[:3]
    # The shared namespace ("" = isolation off) is a namespace of its own as well.
    assert run(harness, follow_up + [7], "").finish.n_cached == 0


@pytest.mark.parametrize("harness", ["llama"], indirect=True)  # APC (block hashes) runs on dense KV models
def test_forced_hash_collision_is_refused_at_adoption(harness: EngineHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a hash whose blocks all collide, a prompt sharing 3 tokens with a stored entry would
    adopt that entry's state; the token check refuses it, counts it, and the output is cold."""
    import mlxcel_compat.cache.block_hash as block_hash

    assert harness.stats()["apc_enabled"]
    harness.reset()
    monkeypatch.setattr(block_hash, "hasher_factory", lambda name: CollidingHash)
    stored = random_tokens(80, seed=3)
    harness.run(stored, n_predict=2, ignore_eos=True)
    other = stored[:3] + random_tokens(70, seed=4)
    before = harness.stats()["adoption_rejects"]["token_mismatch"]
    hit = harness.run(other, n_predict=6, ignore_eos=True)
    cold = harness.run(other, n_predict=6, ignore_eos=True, cache=False)
    assert hit.finish.n_cached == 0
    assert hit.tokens == cold.tokens
    assert harness.stats()["adoption_rejects"]["token_mismatch"] == before + 1
