"""gemma3's prompts prefill through the CPU decode runtime in the engine (its sliding-window
rings: runtime/ring_chunks.py), and an engine that goes idle hands back what the passes freed
(``loading.release_idle_memory``): MLX's buffer cache empty, the chunk buffers dropped.

Slow (an engine of its own: 19 s on a busy machine): the default suite covers both through
``test_batching.py``'s gemma3 rows (its chunks batched on the runtime) and every engine test (the
release runs after each request); ``scripts/test.sh --slow`` runs this one.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxcel_compat.engine.request import FinishEvent
from tests.conftest import tiny_model
from tests.engine.harness import EngineHarness

pytestmark = pytest.mark.slow


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
