"""The attention kernels over shared prompt-cache blocks read in place (``attention.c``:
``mlxcel_decode_attention_paged``, ``mlxcel_chunk_attention_paged``; the span of ``kv_rows.h``):
a cache whose first positions are blocks of ``block_tokens`` rows, each its own buffer, and whose
later positions are the sequence's own buffer gives the bits of the same step or chunk on one
buffer holding the same rows (docs/prompt-cache.md, "The CPU decode runtime reads the blocks in
place"), at every storage type, and never writes a block.
"""

from __future__ import annotations

import ctypes
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxcel_compat.runtime import backend, cpu_decode

CODES = {"f32": 0, "f16": 1, "bf16": 2}

pytestmark = pytest.mark.skipif(backend.matmul_shim() is None, reason="the BLAS shim is not built on this machine")


def _lib() -> Any:
    lib = backend.matmul_shim().lib
    p, i, f, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    lib.mlxcel_decode_attention_at.argtypes = [p, p, p, p, p, p, i, i, i, i, i, L, f, i, i]
    lib.mlxcel_chunk_attention.argtypes = [p, p, p, p, p, p, i, i, i, i, i, L, f, i, i]
    lib.mlxcel_decode_attention_paged.argtypes = [p, p, p, p, p, p, i, i, i, i, L, f, i, i, p, p, i, i]
    lib.mlxcel_chunk_attention_paged.argtypes = [p, p, p, p, p, p, i, i, i, i, i, L, f, i, i, i, p, p, i, i]
    for fn in (lib.mlxcel_decode_attention_at, lib.mlxcel_chunk_attention, lib.mlxcel_decode_attention_paged,
               lib.mlxcel_chunk_attention_paged):
        fn.restype = ctypes.c_int
    return lib


def _stored(x: np.ndarray, kind: str) -> np.ndarray:
    if kind == "f32":
        return x
    if kind == "f16":
        return x.astype(np.float16).view(np.uint16)
    return np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))


class Split:
    """One cache (Hk, capacity, d) and the same rows as blocks of ``bt`` positions (each its own
    buffer) for the first ``nb`` positions, then an own buffer holding the rest from row 0."""

    def __init__(self, whole: np.ndarray, nb: int, bt: int, own_capacity: int) -> None:
        self.whole, self.nb = whole, nb
        self.blocks = [np.ascontiguousarray(whole[:, b * bt:(b + 1) * bt]) for b in range(nb // bt)]
        self.own = np.zeros((whole.shape[0], own_capacity, whole.shape[2]), whole.dtype)
        held = whole.shape[1] - nb
        self.own[:, :held] = whole[:, nb:]
        self.before = [b.copy() for b in self.blocks]

    def untouched(self) -> bool:
        return all(np.array_equal(b, c) for b, c in zip(self.blocks, self.before))


def _table(keys: Split, values: Split) -> np.ndarray:
    return np.array([b.ctypes.data for b in keys.blocks] + [b.ctypes.data for b in values.blocks], np.int64)


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("d,n,nb,bt", [(64, 300, 256, 16), (20, 49, 32, 16), (64, 17, 16, 16), (64, 40, 0, 16)])
def test_a_decode_step_over_blocks_is_the_step_over_one_buffer(kind: str, d: int, n: int, nb: int, bt: int) -> None:
    rng = np.random.default_rng(3)
    kv_heads, group, pos = 2, 3, n - 1
    capacity = n + 8
    keys = _stored(rng.standard_normal((kv_heads, capacity, d)).astype(np.float32), kind)
    values = _stored(rng.standard_normal((kv_heads, capacity, d)).astype(np.float32), kind)
    q = (rng.standard_normal(kv_heads * group * d) * 2).astype(np.float32)
    k_new, v_new = (rng.standard_normal(kv_heads * d).astype(np.float32) for _ in range(2))
    k_split, v_split = Split(keys[:, :pos], nb, bt, capacity - nb), Split(values[:, :pos], nb, bt, capacity - nb)
    table = _table(k_split, v_split)
    scale, code, lib = d ** -0.5 * cpu_decode.LOG2E, CODES[kind], _lib()
    want, got = (np.empty(kv_heads * group * d, np.float32) for _ in range(2))
    assert lib.mlxcel_decode_attention_at(q.ctypes.data, k_new.ctypes.data, v_new.ctypes.data, keys.ctypes.data,
                                          values.ctypes.data, want.ctypes.data, kv_heads, group, d, pos, n, capacity,
                                          scale, code, code) == 0
    assert lib.mlxcel_decode_attention_paged(q.ctypes.data, k_new.ctypes.data, v_new.ctypes.data,
                                             k_split.own.ctypes.data, v_split.own.ctypes.data, got.ctypes.data,
                                             kv_heads, group, d, pos, capacity - nb, scale, code, code, None,
                                             table.ctypes.data if nb else None, nb, bt) == 0
    assert np.array_equal(got, want)  # bit for bit
    assert np.array_equal(k_split.own[:, pos - nb], keys[:, pos]) and np.array_equal(v_split.own[:, pos - nb], values[:, pos])
    assert k_split.untouched() and v_split.untouched()
    # positions that do not fit are refused, nothing written
    bad = dict(pos=nb - 1) if nb else dict(pos=capacity)
    assert lib.mlxcel_decode_attention_paged(q.ctypes.data, k_new.ctypes.data, v_new.ctypes.data,
                                             k_split.own.ctypes.data, v_split.own.ctypes.data, got.ctypes.data,
                                             kv_heads, group, d, bad["pos"], capacity - nb, scale, code, code, None,
                                             table.ctypes.data if nb else None, nb, bt) == -1


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("pos,nb", [(150, 128), (64, 64), (37, 0)])
def test_a_prompt_chunk_over_blocks_is_the_chunk_over_one_buffer(kind: str, pos: int, nb: int) -> None:
    rng = np.random.default_rng(4)
    kv_heads, group, d, rows, bt = 2, 2, 64, 37, 32
    capacity = pos + rows + 5
    keys = _stored(rng.standard_normal((kv_heads, capacity, d)).astype(np.float32), kind)
    values = _stored(rng.standard_normal((kv_heads, capacity, d)).astype(np.float32), kind)
    q = (rng.standard_normal((rows, kv_heads * group * d)) * 2).astype(np.float32)
    k_new, v_new = (rng.standard_normal((rows, kv_heads * d)).astype(np.float32) for _ in range(2))
    k_split, v_split = Split(keys[:, :pos], nb, bt, capacity - nb), Split(values[:, :pos], nb, bt, capacity - nb)
    table = _table(k_split, v_split)
    scale, code, lib = d ** -0.5 * cpu_decode.LOG2E, CODES[kind], _lib()
    want, got = (np.empty((rows, kv_heads * group * d), np.float32) for _ in range(2))
    assert lib.mlxcel_chunk_attention(q.ctypes.data, k_new.ctypes.data, v_new.ctypes.data, keys.ctypes.data,
                                      values.ctypes.data, want.ctypes.data, rows, kv_heads, group, d, pos, capacity,
                                      scale, code, code) == 0
    assert lib.mlxcel_chunk_attention_paged(q.ctypes.data, k_new.ctypes.data, v_new.ctypes.data,
                                            k_split.own.ctypes.data, v_split.own.ctypes.data, got.ctypes.data, rows,
                                            kv_heads, group, d, pos, capacity - nb, scale, code, code, 0, None,
                                            table.ctypes.data if nb else None, nb, bt) == 0
    assert np.array_equal(got, want)
    span = slice(pos - nb, pos - nb + rows)
    assert np.array_equal(k_split.own[:, span], keys[:, pos:pos + rows])
    assert np.array_equal(v_split.own[:, span], values[:, pos:pos + rows])
    assert k_split.untouched() and v_split.untouched()
