"""gemma3's prompts prefill through the CPU decode runtime in the engine (its sliding-window
rings: runtime/ring_chunks.py), and an engine that goes idle hands back what the passes freed
(``loading.release_idle_memory``): MLX's buffer cache empty, the chunk buffers dropped; a
recurrent hybrid's idle engine keeps two recurrent states' buffers of it, primed.

The gemma3 test is slow (an engine of its own: 19 s on a busy machine): the default suite covers
both through ``test_batching.py``'s gemma3 rows (its chunks batched on the runtime) and every
engine test (the release runs after each request); ``scripts/test.sh --slow`` runs it.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxcel_compat.engine.request import FinishEvent
from tests.conftest import tiny_model
from tests.engine.harness import EngineHarness

@pytest.mark.slow
def test_gemma3_prompts_prefill_on_the_runtime_and_an_idle_engine_holds_no_freed_memory() -> None:
    h = EngineHarness(tiny_model("gemma3_text"), batch_size=16)
    try:
        decoder = h.engine.loaded.decoder
        assert decoder is not None and decoder.kv.rings
        fed = decoder.prefilled
        prompt = [(13 * i + 7) % 400 + 20 for i in range(100)]  # past the 64-position window
        run = h.run(prompt, n_predict=4, ignore_eos=True, cache=False)
        assert isinstance(run.finish, FinishEvent) and len(run.tokens) == 4
        assert decoder.prefilled - fed == 99  # every prompt token but the last (a decode step)
        assert h.on_engine(mx.get_cache_memory) == 0
        again = h.run(prompt, n_predict=4, ignore_eos=True, cache=False)
        assert again.tokens == run.tokens  # buffers made again give the same numbers
    finally:
        h.close()


def test_an_idle_hybrid_keeps_two_recurrent_states_of_primed_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recurrent hybrid's idle engine keeps exactly two sets of one sequence's recurrent state
    arrays in MLX's cache, already written (``release_idle_memory``): the next session-snapshot
    hit makes its own state and the boundary snapshot from them, not from fresh pages. Its
    snapshot hit then equals the split cold run (test_snapshots.py's exactness, here with the
    primed buffers in use). Under a bound (``IDLE_PRIMED_MAX``) below two sets it keeps one, below
    one none."""
    import math
    import random

    from mlxcel_compat.engine import loading

    h = EngineHarness(tiny_model("qwen3_next"), batch_size=16, min_prefix=8)
    try:
        decoder = h.engine.loaded.decoder
        assert decoder is not None and decoder.delta_layers
        shapes = decoder.recurrent_state_shapes
        state = sum(4 * math.prod(shape) for shape in shapes)

        def primed(sets: int) -> bool:  # MLX rounds each buffer up a little
            held = h.on_engine(mx.get_cache_memory)
            return sets * state <= held <= sets * (state + 64 * len(shapes))

        rng = random.Random(3)
        history = [rng.randrange(8000) for _ in range(40)]
        second = history + [rng.randrange(8000) for _ in range(12)]
        h.run(history + [5, 6], n_predict=3, boundary=len(history), session="x")
        assert primed(2)
        warm = h.run(second, n_predict=6, n_probs=4, boundary=len(history), session="x")
        assert warm.finish.n_cached == len(history)
        assert primed(2)
        cold = h.run(second, n_predict=6, n_probs=4, boundary=len(history), session="fresh")
        assert cold.finish.n_cached == 0 and (warm.tokens, warm.logprobs) == (cold.tokens, cold.logprobs)
        for bound, sets in ((state * 3 // 2, 1), (state // 2, 0)):
            monkeypatch.setattr(loading, "IDLE_PRIMED_MAX", bound)
            h.run(second, n_predict=2, cache=False)
            assert primed(sets), sets
    finally:
        h.close()
