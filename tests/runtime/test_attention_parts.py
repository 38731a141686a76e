"""The decode attention's parts over the shim's pool (``runtime/native/attention.c``).

With fewer KV heads than a whole number of threads' worth, a decode step splits each head's
query heads into parts (``attend_heads``), and a sequence's draft rows split each head's rows
(``mlxcel_decode_attention_rows``). The parts must not change a number: every query's scores,
softmax and value sum are its own. Here the same step and the same 16 draft rows run on pools of
1 to 4 threads, over float32 and f16 caches, and give the same bits; the rows give their single
steps' bits; and the step stays within float32 rounding of float64 attention.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from mlxcel_compat.runtime import backend, cpu_decode
from tests.runtime.step_checks import address, attention_lib, attention_reference

pytestmark = pytest.mark.skipif(backend.matmul_shim() is None, reason="the BLAS shim is not built on this machine")

CODES = {"f32": 0, "f16": 1}
KERNEL_RTOL = 1e-5
ROWS = 16


def _rows_lib() -> ctypes.CDLL:
    lib = attention_lib()
    p, i, f, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
    lib.mlxcel_decode_attention_rows.argtypes = [p, p, p, p, p, p, i, i, i, i, i, i, L, f, i, i]
    lib.mlxcel_decode_attention_rows.restype = ctypes.c_int
    return lib


def _stored(x: np.ndarray, kind: str) -> np.ndarray:
    return x.astype(np.float16) if kind == "f16" else x


@pytest.mark.parametrize("kind", ["f32", "f16"])
@pytest.mark.parametrize("kv_heads,group,d", [(3, 3, 64), (1, 4, 256), (2, 6, 64)])
def test_attention_gives_the_same_bits_on_any_number_of_threads(kind: str, kv_heads: int, group: int, d: int) -> None:
    rng = np.random.default_rng(5)
    n, capacity = 300, 340
    lib, shim = _rows_lib(), backend.matmul_shim()
    code, scale = CODES[kind], d ** -0.5 * cpu_decode.LOG2E
    base_k = _stored(rng.standard_normal((kv_heads, capacity, d)).astype(np.float32), kind)
    base_v = _stored(rng.standard_normal((kv_heads, capacity, d)).astype(np.float32), kind)
    q = (rng.standard_normal((ROWS, kv_heads * group * d)) * 2).astype(np.float32)
    k_new = rng.standard_normal((ROWS, kv_heads * d)).astype(np.float32)
    v_new = rng.standard_normal((ROWS, kv_heads * d)).astype(np.float32)

    def step_outputs() -> tuple[np.ndarray, np.ndarray]:
        """Row 0 as one step; then all rows as draft rows (one call), on fresh copies of the cache."""
        keys, values = base_k.copy(), base_v.copy()
        step = np.empty(kv_heads * group * d, np.float32)
        assert lib.mlxcel_decode_attention_at(address(q[0]), address(k_new[0]), address(v_new[0]), address(keys),
                                              address(values), address(step), kv_heads, group, d, n - 1, n, capacity,
                                              scale, code, code) == 0
        keys, values = base_k.copy(), base_v.copy()
        rows = np.empty((ROWS, kv_heads * group * d), np.float32)
        assert lib.mlxcel_decode_attention_rows(address(q), address(k_new), address(v_new), address(keys),
                                                address(values), address(rows), ROWS, kv_heads, group, d, n - 1, n,
                                                capacity, scale, code, code) == 0
        return step, rows

    threads = shim.threads
    try:
        seen = []
        for count in (1, 2, 3, 4):
            shim.configure(threads=count)
            seen.append(step_outputs())
        shim.configure(threads=2)  # the rows against single steps, on a pool that splits them
        keys, values = base_k.copy(), base_v.copy()
        singles = np.empty((ROWS, kv_heads * group * d), np.float32)
        for j in range(ROWS):
            assert lib.mlxcel_decode_attention_at(address(q[j]), address(k_new[j]), address(v_new[j]), address(keys),
                                                  address(values), address(singles[j]), kv_heads, group, d, n - 1 + j,
                                                  n + j, capacity, scale, code, code) == 0
    finally:
        shim.configure(threads=threads)
    step, rows = seen[0]
    for other_step, other_rows in seen[1:]:
        assert np.array_equal(other_step, step) and np.array_equal(other_rows, rows)
    assert np.array_equal(rows[0], step) and np.array_equal(rows, singles)
    keys, values = base_k.astype(np.float64), base_v.astype(np.float64)
    keys[:, n - 1], values[:, n - 1] = (_stored(k_new[0], kind).reshape(kv_heads, d),
                                        _stored(v_new[0], kind).reshape(kv_heads, d))
    ref = attention_reference(q[0].reshape(kv_heads, group, d).astype(np.float64), keys[:, :n], values[:, :n],
                              d ** -0.5).reshape(-1)
    assert np.abs(step - ref).max() <= KERNEL_RTOL * np.abs(ref).max()
