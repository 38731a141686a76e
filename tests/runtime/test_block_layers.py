"""Block layers in a loaded model (runtime/block_layers.py): what replaces nn.Linear/nn.Embedding,
the per-sequence choice of kernel path, and the skipped output head of prefill chunks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlxcel_compat.runtime.block_layers import BlockEmbedding, BlockLinear, holds_blocks, logits_unused
from mlxcel_compat.gguf.load import load_gguf
from tests.conftest import tiny_model

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def qwen3():
    """Tiny qwen3 as Q4_0: tied embeddings, so the head is the embedding's ``as_linear``."""
    return load_gguf(str(tiny_model("qwen3:q4_0")), on_cpu=True)[0]


@pytest.fixture(scope="module")
def llama():
    """Tiny llama as Q8_0: a separate ``lm_head``."""
    return load_gguf(str(tiny_model("llama:q8_0")), on_cpu=True)[0]


def test_linear_layers_and_the_embedding_hold_blocks(qwen3, llama) -> None:
    assert isinstance(qwen3.model.embed_tokens, BlockEmbedding)
    assert isinstance(qwen3.model.layers[0].mlp.down_proj, BlockLinear)
    assert isinstance(llama.lm_head, BlockLinear) and llama.lm_head.head
    assert not llama.model.layers[0].self_attn.q_proj.head
    assert holds_blocks(llama.model.layers[0]) and not holds_blocks(llama.model.norm)


@pytest.mark.parametrize("name", ["qwen3", "llama"])
def test_a_prefill_chunk_skips_the_head_and_leaves_the_same_cache(name: str, request: pytest.FixtureRequest) -> None:
    model = request.getfixturevalue(name)
    ids = mx.array([[5, 17, 300, 42, 7, 99, 1000, 3]])
    full_cache, skipped_cache = make_prompt_cache(model), make_prompt_cache(model)
    logits = model(ids, cache=full_cache)
    with logits_unused():
        skipped = model(ids, cache=skipped_cache)
    assert mx.abs(logits).max().item() > 0 and mx.abs(skipped).max().item() == 0
    for a, b in zip(full_cache, skipped_cache):
        assert mx.array_equal(a.keys[..., :8, :], b.keys[..., :8, :]).item()
        assert mx.array_equal(a.values[..., :8, :], b.values[..., :8, :]).item()
    assert mx.abs(model(ids)).max().item() > 0  # the context ended: heads compute again


def test_a_sequence_result_does_not_depend_on_its_batch(llama) -> None:
    """Prompt chunks take float32 tiles and decode steps vec_dot, per sequence: a row of a batch
    of two equals that sequence alone (decode: bit for bit; prompt chunks: the BLAS's sgemm
    blocks by row count, so to float32 rounding)."""
    a, b = [5, 17, 300, 42, 7, 99], [8, 1, 2, 3, 4, 5]
    together = np.array(llama(mx.array([a, b])))
    alone = np.array(llama(mx.array([a])))[0]
    np.testing.assert_allclose(together[0], alone, rtol=1e-5, atol=1e-5)
    step_together = np.array(llama(mx.array([[a[0]], [b[0]]])))
    step_alone = np.array(llama(mx.array([[a[0]]])))[0]
    np.testing.assert_array_equal(step_together[0], step_alone)
