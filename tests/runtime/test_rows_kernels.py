"""The shim's own multi-row decode kernels (quant_rows.c, k_quant_rows.c, split_rows.c, mxfp4_rows.c)
at every row count 1-16.

Batched decode, speculative verification and MoE experts multiply a weight by 2-16 activation
rows in one call; the kernels unpack each weight block once for up to 8 of them a pass (16 for
the lane kernels: Q8_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K, MXFP4). A row's result must not depend on the rows beside it (greedy output and cache-hit-equals-cold rest on
it), so each row of every call here is compared bit for bit with the same row computed alone,
at every row count from 1 to 16 and in every position of a pass, and the whole product with
ggml's vec_dot over the same blocks (the same integer sums added in another order: float32
rounding of the sum).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from mlxcel_compat.runtime.block_weight import BlockWeight, library, split_rows
from tests.runtime.test_block_weight import raw_weight, reference

LIB = library()
OWN = set() if isinstance(LIB, str) else set(LIB.own_kernels) | set(LIB.split_kinds)
ROWS = 16
# (type, k): K-quants over one, three and ten 256-value super-blocks (up to 8, 1-8 activation rows take the
# two-row path, else 1-2 do: k_quant_rows.c's FEW_ROWS_BLOCKS), Q8_0 over 768 values; the split types over 24 blocks
# (a group of 16 and a shorter one) and over 3 (a lone last block); MXFP4 over 5 and 3 blocks (over more,
# random E8M0 exponents let one block decide each sum, and ggml's order gives the same float).
CASES = [(T.Q4_K, 768), (T.Q6_K, 768), (T.Q4_K, 256), (T.Q6_K, 256), (T.Q4_K, 2560), (T.Q6_K, 2560), (T.Q8_0, 768), (T.Q8_0, 96), (T.Q4_1, 768), (T.Q4_1, 96),
         (T.Q5_0, 768), (T.Q5_0, 96), (T.Q5_1, 768), (T.Q5_1, 96), (T.MXFP4, 160), (T.MXFP4, 96)]


@pytest.mark.parametrize("qtype,k", CASES, ids=lambda v: v.name if isinstance(v, T) else str(v))
def test_every_row_count_gives_each_row_what_it_gets_alone(qtype: T, k: int) -> None:
    if int(qtype) not in OWN:
        pytest.skip(f"no own {qtype.name} kernel on this CPU")
    n = 37  # odd: a lone row's pairs of weight rows leave one over
    raw = raw_weight(qtype, n, k, seed=int(qtype) + k)
    weight = BlockWeight(raw.copy(), qtype, n, k, LIB)
    if int(qtype) in LIB.split_kinds:
        assert split_rows(weight)
    x = np.random.default_rng(k).standard_normal((ROWS, k)).astype(np.float32)
    alone = np.stack([weight.matmul(x[i:i + 1], tiles=False)[0] for i in range(ROWS)])
    for m in range(1, ROWS + 1):
        rows = (np.arange(m) + 3 * m) % ROWS  # each row lands in several positions of a pass
        np.testing.assert_array_equal(weight.matmul(x[rows], tiles=False), alone[rows], err_msg=f"{m} rows")

    plain = BlockWeight(raw, qtype, n, k, LIB)
    kind = LIB.block_type(qtype)
    own_kernel, kind.own_kernel = kind.own_kernel, -1  # ggml's vec_dot, as MLXCEL_OWN_KERNELS=0 gives
    try:
        by_ggml = plain.matmul(x, tiles=False)
    finally:
        kind.own_kernel = own_kernel
    scale = np.abs(x).astype(np.float64) @ np.abs(reference(qtype, raw)).T.astype(np.float64)
    assert np.all(np.abs(alone - by_ggml) <= 1e-6 * scale)
    assert not np.array_equal(alone, by_ggml)  # really another kernel


@pytest.mark.skipif(int(T.MXFP4) not in OWN, reason="no own MXFP4 kernel on this CPU")
def test_mxfp4_rows_against_float64() -> None:
    """The split MXFP4 rows (mxfp4_rows.c: a lane per weight row) against the exact product of
    the same values in float64: the weight's blocks as gguf-py expands them times the
    activations as ggml quantizes them (Q8_0), on gpt-oss's row length (2880: five groups of 16
    blocks and a group of 10), 37 weight rows (a partial band of 16), exponents around the
    model's plus the subnormal factors (E8M0 0 and 1), 1 to 16 activation rows: within float32
    rounding of each block's term and of their sum (1e-6 of the sum of |w a|)."""
    from gguf.quants import dequantize

    n, k = 37, 2880
    raw = raw_weight(T.MXFP4, n, k, seed=31)
    rng = np.random.default_rng(32)
    exponents = raw.reshape(n, k // 32, 17)[:, :, 0]
    exponents[:] = rng.integers(118, 128, size=exponents.shape)
    exponents[0, :4] = (0, 1, 0, 1)
    weight = BlockWeight(raw.copy(), T.MXFP4, n, k, LIB)
    assert split_rows(weight)
    w64 = reference(T.MXFP4, raw).astype(np.float64)
    for m in (1, 2, 7, 16):
        x = rng.standard_normal((m, k)).astype(np.float32)
        a64 = dequantize(LIB.ggml.quantize(T.Q8_0, x).reshape(-1), T.Q8_0).reshape(m, k).astype(np.float64)
        exact, scale = a64 @ w64.T, np.abs(a64) @ np.abs(w64).T
        got = weight.matmul(x, tiles=False)
        assert np.all(np.abs(got - exact) <= 1e-6 * scale), f"{m} rows"


Q8_K = np.dtype([("d", "<f4"), ("qs", "i1", 256), ("bsums", "<i2", 16)])  # ggml's block_q8_K


def q8_k_rows(x: np.ndarray) -> np.ndarray:
    """x's rows as the decode products see them: quantized to Q8_K by the shim's quantizer (ggml's
    bytes, ``test_own_q8_k_quantizer_writes_ggml_s_bytes``) and expanded back, in float64."""
    import ctypes

    quantize = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(LIB.quantizers[int(T.Q8_K)])
    m, k = x.shape
    blocks = np.zeros((m, k // 256), Q8_K)
    for i in range(m):
        row = np.ascontiguousarray(x[i])
        quantize(row.ctypes.data, blocks[i].ctypes.data, k)
    return (blocks["d"].astype(np.float64)[..., None] * blocks["qs"].astype(np.float64)).reshape(m, k)


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(5, 256), (37, 512), (53, 4096)])
def test_k_quant_lanes_give_the_float64_sums_of_their_blocks(qtype: T, n: int, k: int) -> None:
    """Q4_K's and Q6_K's lane kernels (k_quant_rows.c: 16 weight rows a pass, up to 16 activation
    rows against each unpacked super-block) compute exactly the integer sums of the blocks, so
    they agree with the float64 product of the dequantized weight (gguf-py's values) and the
    dequantized Q8_K activations to float32 rounding of the sum (1e-6 of the sum of |x w|). Weight
    rows short of a pass (5) or ending mid-pass (37, 53), one super-block to sixteen, and 19
    activation rows (a pass of 16 and one of 3), each bit for bit the row alone."""
    if int(qtype) not in OWN or int(T.Q8_K) not in LIB.quantizers:
        pytest.skip(f"no own {qtype.name} kernel on this CPU")
    raw = raw_weight(qtype, n, k, seed=n + k)
    weight = BlockWeight(raw, qtype, n, k, LIB)
    x = np.random.default_rng(n * k).standard_normal((19, k)).astype(np.float32)
    own = weight.matmul(x, tiles=False)
    w64 = reference(qtype, raw).astype(np.float64)
    a64 = q8_k_rows(x)
    exact = a64 @ w64.T
    assert np.all(np.abs(own - exact) <= 1e-6 * (np.abs(a64) @ np.abs(w64).T))
    for i in range(19):
        np.testing.assert_array_equal(weight.matmul(x[i:i + 1], tiles=False)[0], own[i], err_msg=f"row {i}")


# Split rows of odd shapes: one block (k 32), a group of 16 and a lone block (k 544), 3 blocks;
# 53, 19 and 37 weight rows: passes of 16 with 5, 3 and 5 rows over.
SPLIT_SHAPES = [(53, 32), (19, 544), (37, 96)]
FIFTH_BITS_AT = {T.Q5_0: 2, T.Q5_1: 4}  # where a block's qh starts


def exact_activations(rng: np.random.Generator, m: int, k: int) -> np.ndarray:
    """Activations that ggml's Q8_0 and Q8_1 blocks hold exactly: per block of 32, integers in
    [-60, 60] and one of ±127, times a power of two (so d is that power, each value its integer,
    and Q8_1's s = d x the sum, at most 1987 in size, a float16 without rounding)."""
    q = rng.integers(-60, 61, size=(m, k // 32, 32)).astype(np.float32)
    q[:, :, 0] = rng.choice([-127.0, 127.0], size=(m, k // 32))
    q = rng.permuted(q, axis=2)
    return (q * 2.0 ** rng.integers(-8, 1, size=(m, k // 32, 1))).reshape(m, k).astype(np.float32)


@pytest.mark.parametrize("n,k", SPLIT_SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_0, T.Q5_1], ids=lambda t: t.name)
def test_split_rows_give_the_float64_product_of_their_blocks(qtype: T, n: int, k: int) -> None:
    """The split rows' lane kernel (split_rows.c: split_lanes, one kernel for Q4_1, Q5_0 and
    Q5_1) against the float64 product of the dequantized blocks (gguf-py's values) with
    activations that 8-bit blocks hold exactly, so that only the kernel's float32 sums differ:
    within 1e-6 of |x| @ |W|, as against ggml's vec_dot above. Some blocks have every fifth bit
    set, some none, the rest random ones. Each row of 1 to 16 is bit for bit the row alone."""
    if int(qtype) not in OWN:
        pytest.skip(f"no split {qtype.name} kernel on this CPU")
    raw = raw_weight(qtype, n, k, seed=n + k)
    if qtype in FIFTH_BITS_AT:
        blocks = raw.reshape(n, k // 32, -1)
        at = FIFTH_BITS_AT[qtype]
        blocks[::3, 0, at:at + 4] = 0xFF  # every value's fifth bit set (rows 0, 3, ...: random fifth bits in 2, 5, ...)
        blocks[1::3, -1, at:at + 4] = 0
    weight = BlockWeight(raw.copy(), qtype, n, k, LIB)
    assert split_rows(weight)
    x = exact_activations(np.random.default_rng(k), ROWS, k)
    w64 = reference(qtype, raw).astype(np.float64)
    want = x.astype(np.float64) @ w64.T
    got = weight.matmul(x, tiles=False)
    scale = np.abs(x).astype(np.float64) @ np.abs(w64).T
    assert np.all(np.abs(got - want) <= 1e-6 * scale)
    for m in range(1, ROWS + 1):
        rows = (np.arange(m) * 5 + m) % ROWS
        np.testing.assert_array_equal(weight.matmul(x[rows], tiles=False), got[rows], err_msg=f"{m} rows")
