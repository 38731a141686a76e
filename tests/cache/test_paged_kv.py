"""A prompt-cache hit adopted without a tensor copy (cache/kv.py: ``paged``, ``PagedKVCache``):
the adopted layers hold the pool's very block arrays, reading ``keys``/``values`` (the MLX path,
a snapshot, a slot save) gathers them into mlx-lm's own ``KVCache`` bit for bit, and a donation
reads the positions past the blocks without gathering (docs/prompt-cache.md, "The CPU decode
runtime reads the blocks in place"). Real MLX arrays, no model: the engine-level checks are
tests/engine/test_prefix_cache.py's.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from mlxcel_compat.cache import kv
from mlxcel_compat.cache.block_pool import BlockPool

BLOCK = 16
HEADS, DIM, LAYERS = 2, 8, 3


def _state(n: int, seed: int = 0) -> list[KVCache]:
    """A sequence's cache of ``n`` positions, random keys and values, with slack past them."""
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(LAYERS):
        layer = KVCache()
        layer.keys, layer.values = (mx.array(rng.standard_normal((1, HEADS, n + 7, DIM)).astype(np.float32))
                                    for _ in range(2))
        layer.offset = n
        layers.append(layer)
    return layers


def _bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint32))


def _table(n: int):
    pool = BlockPool(BLOCK)
    return pool, kv.to_blocks(pool, _state(n), n)


def test_an_adopted_cache_holds_the_pools_block_arrays() -> None:
    pool, table = _table(5 * BLOCK + 3)
    n = 3 * BLOCK + 5
    layers = kv.paged(table, n)
    assert len(layers) == LAYERS and all(type(layer) is kv.PagedKVCache for layer in layers)
    for i, layer in enumerate(layers):
        assert layer.offset == n and layer.n_blocked == 3 * BLOCK
        for b, block_id in enumerate(table.block_ids[:3]):
            assert layer.blocks[b][0] is pool.data(block_id)[i][0]  # the very arrays: no copy
            assert layer.blocks[b][1] is pool.data(block_id)[i][1]
        assert layer.own_keys.shape[2] == 5  # the partly adopted block's rows: its own, copied on write
    before = pool.nbytes
    own = sum(layer.own_keys.nbytes + layer.own_values.nbytes for layer in layers)
    assert kv.nbytes(layers) == 3 * table.pool.block(table.block_ids[0]).nbytes + own
    assert pool.nbytes == before


def test_reading_keys_gathers_into_mlx_lms_kv_cache_bit_for_bit() -> None:
    _, table = _table(4 * BLOCK)
    n = 2 * BLOCK + 9
    layers, want = kv.paged(table, n), kv.gather(table, n)
    copy = kv.copy_cache(layers)  # a sibling's copy: paged too, sharing the blocks
    assert all(type(c) is kv.PagedKVCache and c.blocks[0][0] is p.blocks[0][0] for c, p in zip(copy, layers))
    for layer, ref in zip(layers, want):
        keys = layer.keys  # the MLX path's first read
        assert type(layer) is KVCache and layer.offset == n
        assert np.array_equal(_bits(keys), _bits(ref.keys)) and np.array_equal(_bits(layer.values), _bits(ref.values))
    assert all(type(c) is kv.PagedKVCache for c in copy)  # the copy is still paged
    step = mx.ones((1, HEADS, 1, DIM))
    for layer, c in zip(layers, copy):  # mlx-lm's update on a paged layer gathers first, then writes
        k, _ = c.update_and_fetch(step, step)
        assert type(c) is KVCache and c.offset == n + 1 and k.shape[2] == n + 1
        assert np.array_equal(_bits(k[..., :n, :]), _bits(layer.keys[..., :n, :]))


def test_a_donation_reads_past_the_blocks_without_gathering() -> None:
    pool, table = _table(4 * BLOCK)
    n = 2 * BLOCK + 3
    layers = kv.paged(table, n)
    rng = np.random.default_rng(1)
    for layer in layers:  # the sequence's own positions past the adopted ones (what the runtime writes)
        own = mx.array(rng.standard_normal((1, HEADS, 3 + 2 * BLOCK, DIM)).astype(np.float32))
        layer.own_keys = mx.concatenate([layer.own_keys, own], axis=2)
        layer.own_values = mx.concatenate([layer.own_values, own * 2], axis=2)
        layer.offset = n + 2 * BLOCK
    lease = table.block_ids[:2]
    donated = kv.to_blocks(pool, layers, n + 2 * BLOCK, lease)
    assert all(type(layer) is kv.PagedKVCache for layer in layers)  # nothing gathered
    assert donated.block_ids[:2] == lease and not set(donated.block_ids[2:]) & set(table.block_ids)
    whole = kv.gather(donated, donated.n_tokens)
    for layer, ref in zip(layers, whole):
        assert np.array_equal(_bits(layer.keys), _bits(ref.keys))  # gathered now, to compare


def test_a_rolled_back_pass_leaves_the_layer_paged_and_a_trim_into_the_blocks_gathers() -> None:
    _, table = _table(3 * BLOCK)
    layers = kv.paged(table, 2 * BLOCK + 4)
    marks = kv.checkpoint(layers)
    for layer in layers:
        layer.update_and_fetch(mx.zeros((1, HEADS, 1, DIM)), mx.zeros((1, HEADS, 1, DIM)))  # gathers
    assert kv.rollback(layers, marks)
    assert all(type(layer) is kv.PagedKVCache and layer.offset == 2 * BLOCK + 4 for layer in layers)
    layers[0].trim(3)  # within its own rows: still paged
    assert type(layers[0]) is kv.PagedKVCache and layers[0].offset == 2 * BLOCK + 1
    layers[1].trim(10)  # into the blocks: one buffer first
    assert type(layers[1]) is KVCache and layers[1].offset == 2 * BLOCK - 6


def test_a_slot_save_or_snapshot_of_a_paged_cache_is_mlx_lms_kv_cache() -> None:
    """A slot's kept state (``detached_prefix``) and a whole snapshot gather: what slot files and
    the disk format write is mlx-lm's own class, with the same bits."""
    _, table = _table(3 * BLOCK)
    n = 2 * BLOCK + 6
    want = kv.gather(table, n)
    for cut in (n, BLOCK + 3):  # the whole state, and a prefix that ends inside the blocks
        kept = kv.detached_prefix(kv.paged(table, n), cut)
        assert all(type(layer) is KVCache and layer.offset == cut for layer in kept)
        for layer, ref in zip(kept, want):
            assert np.array_equal(_bits(layer.keys[..., :cut, :]), _bits(ref.keys[..., :cut, :]))
    whole = kv.snapshot(kv.paged(table, n))
    assert all(type(layer) is KVCache for layer in whole)
    assert all(np.array_equal(_bits(a.values), _bits(b.values)) for a, b in zip(whole, want))
