"""Weights in ggml's block formats (runtime/block_weight.py, block_matmul.c, ggml's kernels).

Every type the CPU serves from its blocks is checked against gguf-py's dequantizer, an
independent implementation of the layouts:

- expanding rows (embeddings, the tiles of prompt chunks) gives gguf-py's values exactly;
- a product by float32 tiles and the BLAS equals float32 math on those values to float32
  rounding;
- a product by ggml's vec_dot (decode steps) quantizes the activations as llama.cpp does (Q8_0,
  Q8_1 or Q8_K blocks of 8-bit integers, or F16 / BF16 values), so it is checked against the
  error bound that quantization implies: for each output, the sum over inputs of |w| times the
  largest rounding error of that input (half a step of its block, or its half-float rounding).

Rows are independent whatever the row count and the thread count, the permuted row order of
llama's query and key projections reads the same values, and bad arguments are errors.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from mlxcel_compat.runtime import ggml_cpu
from mlxcel_compat.runtime.block_weight import SPLIT_TYPE_BASE, BlockWeight, library
from tests.gguf.test_quants import I_QUANTS, QUANTIZED_TYPES, random_blocks

LIB = library()
pytestmark = pytest.mark.skipif(isinstance(LIB, str), reason=f"no block kernels here: {LIB}")

TYPES = [*QUANTIZED_TYPES, T.F16, T.BF16]
# The activations' type of each weight type, and values per block: what vec_dot quantizes x to
# (Q8_0 for the 32-value types, MXFP4 and IQ4_NL; Q8_K for the others).
ACTIVATION_BLOCK = {T.Q8_0: 32, T.Q4_0: 32, T.Q5_0: 32, T.Q4_1: 32, T.Q5_1: 32, T.MXFP4: 32, T.IQ4_NL: 32,
                    T.Q2_K: 256, T.Q3_K: 256, T.Q4_K: 256, T.Q5_K: 256, T.Q6_K: 256,
                    **{t: 256 for t in I_QUANTS if t != T.IQ4_NL}}


def raw_weight(qtype: T, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random but valid stored bytes of an (n, k) weight: uint8 (n, row bytes)."""
    block, _ = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZED_TYPES:
        raw = random_blocks(qtype, n * k // block, seed=seed)
    elif qtype == T.F16:
        raw = rng.standard_normal(n * k).astype(np.float16).view(np.uint8)
    else:  # BF16: the top half of float32 values
        raw = (rng.standard_normal(n * k).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    return raw.reshape(n, -1)


def reference(qtype: T, raw: np.ndarray) -> np.ndarray:
    n = raw.shape[0]
    return gguf.quants.dequantize(raw.reshape(-1), qtype).reshape(n, -1).astype(np.float32)


def activation_error(qtype: T, x: np.ndarray) -> np.ndarray:
    """The largest rounding error of each activation when vec_dot quantizes it, (m, k)."""
    if qtype == T.F16:
        return np.abs(x) * 2.0**-11
    if qtype == T.BF16:
        return np.abs(x) * 2.0**-8
    block = ACTIVATION_BLOCK[qtype]
    m, k = x.shape
    amax = np.abs(x).reshape(m, k // block, block).max(axis=-1, keepdims=True)
    return np.broadcast_to(amax / 127 / 2, (m, k // block, block)).reshape(m, k)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_rows_expand_to_gguf_py_values(qtype: T) -> None:
    raw = raw_weight(qtype, 40, 512)
    weight = BlockWeight(raw, qtype, 40, 512, LIB)
    np.testing.assert_array_equal(weight.dequantize(), reference(qtype, raw))
    ids = [39, 0, 7, 7]
    np.testing.assert_array_equal(weight.take(ids), reference(qtype, raw)[ids])


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_products_by_tiles_and_by_vec_dot(qtype: T) -> None:
    n, k = 300, 512
    raw = raw_weight(qtype, n, k, seed=1)
    w = reference(qtype, raw)
    weight = BlockWeight(raw, qtype, n, k, LIB)
    x = np.random.default_rng(2).standard_normal((12, k)).astype(np.float32)
    exact = x.astype(np.float64) @ w.T.astype(np.float64)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)  # sum |x w| per output

    bound = activation_error(qtype, x).astype(np.float64) @ np.abs(w).T.astype(np.float64)
    tiles = weight.matmul(x, tiles=True)
    by_dot = weight.matmul(x, tiles=False)
    assert np.all(np.abs(by_dot - exact) <= 1.02 * bound + 1e-5 * scale + 1e-6)
    assert np.abs(by_dot - exact).max() > 1e-5 * scale.max()  # the activations really were quantized
    if int(qtype) in LIB.lane_prompts:  # the shim's lanes take prompt chunks as decode rows
        np.testing.assert_array_equal(tiles, by_dot)
    else:
        assert np.all(np.abs(tiles - exact) <= 1e-5 * scale + 1e-6)


@pytest.mark.parametrize("tiles", [False, True], ids=["vec_dot", "tiles"])
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.Q6_K, T.F16], ids=lambda t: t.name)
def test_a_row_does_not_depend_on_the_others(qtype: T, tiles: bool) -> None:
    """By vec_dot (decode steps, decode batches), each row's result is bit for bit the same
    whatever rows share the call; the product is large enough to run on every thread of the
    pool. By tiles, the BLAS's sgemm blocks its work by the row count, so rows agree to float32
    rounding only (as MLX's own float32 prompt chunks do)."""
    n, k = 1024, 768
    weight = BlockWeight(raw_weight(qtype, n, k, seed=3), qtype, n, k, LIB)
    x = np.random.default_rng(4).standard_normal((16, k)).astype(np.float32)
    together = weight.matmul(x, tiles=tiles)
    scale = float((np.abs(x) @ np.abs(weight.dequantize()).T).max())  # the largest sum of |x w|
    check = (lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * scale)) if tiles else np.testing.assert_array_equal
    for i in (0, 5, 15):
        check(weight.matmul(x[i:i + 1], tiles=tiles)[0], together[i])
    check(weight.matmul(x[3:9], tiles=tiles), together[3:9])


@pytest.mark.parametrize("tiles", [False, True], ids=["vec_dot", "tiles"])
def test_permuted_rows_and_accumulation(tiles: bool) -> None:
    n, k = 96, 256
    raw = raw_weight(T.Q4_K, n, k, seed=5)
    order = np.random.default_rng(6).permutation(n).astype(np.int32)
    plain = BlockWeight(raw, T.Q4_K, n, k, LIB)
    permuted = BlockWeight(raw, T.Q4_K, n, k, LIB, rows=order)
    np.testing.assert_array_equal(permuted.dequantize(), plain.dequantize()[order])
    x = np.random.default_rng(7).standard_normal((3, k)).astype(np.float32)
    np.testing.assert_array_equal(permuted.matmul(x, tiles=tiles), plain.matmul(x, tiles=tiles)[:, order])
    start = np.random.default_rng(8).standard_normal((3, n)).astype(np.float32)
    out = start.copy()
    plain.matmul(x, out=out, beta=1.0, tiles=tiles)
    np.testing.assert_allclose(out, start + plain.matmul(x, tiles=tiles), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("tiles", [False, True], ids=["vec_dot", "tiles"])
def test_group_biases_are_added_per_group_of_inputs(tiles: bool) -> None:
    n, k, group = 64, 256, 64
    raw = raw_weight(T.Q8_0, n, k, seed=9)
    bias = np.random.default_rng(10).standard_normal((n, k // group)).astype(np.float32)
    weight = BlockWeight(raw, T.Q8_0, n, k, LIB, group_bias=bias, bias_group=group)
    expected = reference(T.Q8_0, raw) + np.repeat(bias, group, axis=1)
    np.testing.assert_allclose(weight.dequantize(), expected, rtol=1e-6, atol=1e-6)
    x = np.random.default_rng(11).standard_normal((2, k)).astype(np.float32)
    # A weight with group biases takes float32 tiles for prompt chunks (no own GEMM): compared
    # with float32 math there, with vec_dot's product of the same blocks for decode rows.
    plain = x @ reference(T.Q8_0, raw).T if tiles else BlockWeight(raw, T.Q8_0, n, k, LIB).matmul(x, tiles=False)
    sums = x.reshape(2, k // group, group).sum(axis=-1)
    np.testing.assert_allclose(weight.matmul(x, tiles=tiles) - plain, sums @ bias.T, rtol=1e-4, atol=2e-3)


def test_bad_arguments_are_errors() -> None:
    raw = raw_weight(T.Q4_0, 8, 64)
    with pytest.raises(ValueError, match="does not hold"):
        BlockWeight(raw[:, :-1], T.Q4_0, 8, 64, LIB)
    with pytest.raises(ValueError, match="row order"):
        BlockWeight(raw, T.Q4_0, 8, 64, LIB, rows=np.array([0, 1, 2, 3, 4, 5, 6, 8]))
    weight = BlockWeight(raw, T.Q4_0, 8, 64, LIB)
    with pytest.raises(ValueError, match="columns"):
        weight.matmul(np.zeros((1, 32), np.float32))
    with pytest.raises(ValueError, match="row ids"):
        weight.take([8])
    with pytest.raises(ValueError, match="row ids"):
        weight.take([-1])


def test_ggml_quantizer_round_trips_through_the_kernels() -> None:
    """The factory quantizes with ggml's own quantizer: its blocks expand to values close to the
    input (within each type's step) and equal gguf-py's reading of them."""
    kernels = ggml_cpu.kernels()
    values = np.random.default_rng(12).standard_normal((8, 512)).astype(np.float32)
    for qtype, tolerance in ((T.Q8_0, 0.02), (T.Q6_K, 0.06), (T.Q4_K, 0.3), (T.Q5_1, 0.15)):
        raw = kernels.quantize(qtype, values)
        weight = BlockWeight(raw, qtype, 8, 512, LIB)
        np.testing.assert_array_equal(weight.dequantize(), reference(qtype, raw))
        assert np.abs(weight.dequantize() - values).max() < tolerance, qtype.name


def test_ggml_quantizer_writes_the_new_types() -> None:
    """MXFP4 and the i-quants from ggml's quantizer (the factory's files): close to the input
    (within each type's step), read alike by ggml and gguf-py; the types whose quantizer
    asserts an importance matrix get an error here, not an aborted process."""
    kernels = ggml_cpu.kernels()
    values = np.random.default_rng(13).standard_normal((4, 512)).astype(np.float32)
    uniform = np.ones(512, np.float32)
    # (largest, mean) error on unit normal values; measured 0.60/0.086, 0.20/0.063, 0.21/0.063,
    # 0.55/0.11, 1.23/0.27 (a value left at 0 would be 0.8 off on average). Not IQ1_* / IQ2_S /
    # IQ2_XS here: their quantizers' set-up takes 5-25 s a process (tests/gguf/test_quants.py).
    for qtype, largest, mean in ((T.MXFP4, 0.75, 0.11), (T.IQ4_NL, 0.25, 0.08), (T.IQ4_XS, 0.27, 0.08),
                                 (T.IQ3_S, 0.7, 0.14), (T.IQ2_XXS, 1.5, 0.35)):
        raw = kernels.quantize(qtype, values, uniform)
        weight = BlockWeight(raw, qtype, 4, 512, LIB)
        np.testing.assert_array_equal(weight.dequantize(), reference(qtype, raw))
        error = np.abs(weight.dequantize() - values)
        assert error.max() < largest and error.mean() < mean, qtype.name
    for qtype in (T.IQ2_XXS, T.IQ2_XS, T.IQ1_S):
        assert kernels.needs_importance(qtype)
        with pytest.raises(ValueError, match="importance matrix"):
            kernels.quantize(qtype, values)
    assert not kernels.needs_importance(T.IQ4_XS)
    with pytest.raises(ValueError, match="one weight per column"):
        kernels.quantize(T.IQ2_XXS, values, uniform[:256])


def test_each_ggml_build_has_the_kernels_of_every_block_type() -> None:
    """This build of ggml and the libggml-python wheel's (ggml 0.20, the fallback where
    scripts/setup.sh could not build) both serve every block type, MXFP4 and the i-quants
    included; a type the build lacks would be expanded to float32, not served."""
    import importlib.util
    import os
    import subprocess
    import sys

    assert all(LIB.serves(t) for t in ggml_cpu.BLOCK_TYPES)
    assert not LIB.serves(T.TQ1_0) and not LIB.serves(T.Q8_K)  # in ggml, but not a block type here
    wheel = importlib.util.find_spec("libggml")
    if wheel is None or not wheel.submodule_search_locations:
        pytest.skip("the libggml-python wheel is not installed")
    lib64 = next((d for root in wheel.submodule_search_locations for d in (f"{root}/lib64", f"{root}/lib")
                  if os.path.exists(f"{d}/libggml-cpu.so")), None)
    if lib64 is None:
        pytest.skip("the libggml-python wheel has no CPU library here")
    probe = ("from mlxcel_compat.runtime import ggml_cpu; k = ggml_cpu.kernels(); "
             "print(k.version, sorted(t.name for t in ggml_cpu.BLOCK_TYPES if not k.supports(t)))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MLXCEL_GGML_LIB": lib64})
    assert done.returncode == 0, done.stderr
    version, missing = done.stdout.split(" ", 1)
    assert version.startswith("0.20") and missing.strip() == "[]"


OWN = sorted(LIB.own_kernels) if not isinstance(LIB, str) else []


@pytest.mark.skipif(not OWN, reason="the shim has no own rows kernels on this CPU (AVX-512 BW)")
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], ids=lambda t: t.name)
def test_own_rows_kernels_agree_with_ggml_s_vec_dot(qtype: T) -> None:
    """k_quant_rows.c serves decode rows of Q4_K and Q6_K, quant_rows.c of Q8_0, where the CPU
    has AVX-512 BW and VNNI: the same
    integer products as ggml's vec_dot, summed in another order, so the two agree to float32
    rounding of the sum (1e-6 of the sum of |x w|); every row count, odd weight-row counts (the
    paired rows' remainder) and permuted rows give each row bit for bit what it gets alone."""
    if qtype not in OWN:
        pytest.skip(f"no own {qtype.name} kernel on this CPU")
    n, k = 301, 768
    raw = raw_weight(qtype, n, k, seed=5)
    weight = BlockWeight(raw, qtype, n, k, LIB)
    x = np.random.default_rng(6).standard_normal((9, k)).astype(np.float32)
    own = weight.matmul(x, tiles=False)
    kind = LIB.block_type(qtype)
    kind.own_kernel = -1  # ggml's vec_dot for this type, as MLXCEL_OWN_KERNELS=0 gives
    try:
        by_ggml = weight.matmul(x, tiles=False)
    finally:
        kind.own_kernel = int(qtype)
    scale = np.abs(x).astype(np.float64) @ np.abs(reference(qtype, raw)).T.astype(np.float64)
    assert np.all(np.abs(own - by_ggml) <= 1e-6 * scale)
    assert not np.array_equal(own, by_ggml)  # really another kernel
    for rows in ([0], [1, 2], [0, 1, 2], [0, 1, 2, 3], [2, 3, 4, 5, 6], list(range(9))):
        np.testing.assert_array_equal(weight.matmul(x[rows], tiles=False), own[rows])
    order = np.random.default_rng(7).permutation(n).astype(np.int32)
    permuted = BlockWeight(raw, qtype, n, k, LIB, rows=order)
    np.testing.assert_array_equal(permuted.matmul(x, tiles=False), own[:, order])


@pytest.mark.skipif(isinstance(LIB, str) or not LIB.quantizers, reason="the shim has no own quantizer on this CPU")
def test_own_q8_k_quantizer_writes_ggml_s_bytes() -> None:
    """quant_rows.c's Q8_K quantizer of decode activations: byte for byte what ggml's
    quantize_row_q8_K writes, for ordinary rows, blocks of zeros, a largest magnitude held by
    both signs (the first one decides the scale's sign), exact halves (round half to even) and
    values far apart in size."""
    import ctypes

    q8_k = int(T.Q8_K)
    ours_fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(LIB.quantizers[q8_k])
    ggml_fn = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(
        LIB.ggml.cpu.ggml_get_type_traits_cpu(q8_k).contents.from_float)
    row_bytes = GGML_QUANT_SIZES[T.Q8_K][1] * 3
    rng = np.random.default_rng(8)
    rows = [rng.standard_normal(768).astype(np.float32) * s for s in (1e-3, 1.0, 300.0)]
    tie = rng.standard_normal(768).astype(np.float32)
    tie[[5, 300, 600]], tie[[9, 301, 700]] = 4.0, -4.0  # both signs at the block's largest magnitude
    tie[[700]] = 4.0
    halves = np.full(768, 0.5, np.float32) * rng.choice([-1, 1, 3, 5], 768).astype(np.float32)
    halves[0] = 127.0  # iscale -1: every other value lands on a half exactly
    zeros = np.zeros(768, np.float32)
    zeros[300:] = rng.standard_normal(468)
    for x in [*rows, tie, halves, zeros]:
        # ggml leaves a zero block's 16-value sums as they were (d = 0 makes them irrelevant);
        # ours writes zeros: both buffers start as zeros
        ours, theirs = np.zeros(row_bytes, np.uint8), np.zeros(row_bytes, np.uint8)
        ours_fn(x.ctypes.data, ours.ctypes.data, 768)
        ggml_fn(x.ctypes.data, theirs.ctypes.data, 768)
        np.testing.assert_array_equal(ours, theirs)


@pytest.mark.skipif(isinstance(LIB, str) or not LIB.dequantizers, reason="the shim has no own dequantizers on this CPU")
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1], ids=lambda t: t.name)
def test_own_dequantizers_write_ggml_s_floats(qtype: T) -> None:
    """The shim's expansion of 32-value blocks to float32 (``mlxcel_dequantizer``; a prompt
    chunk's tiles, an embedding row): bit for bit ggml's to_float (its scalar reference code), on random valid
    blocks and on blocks at the ends of their ranges (every bit of qh set, factors of both signs,
    subnormal and largest half-precision factors)."""
    import ctypes

    assert int(qtype) in LIB.dequantizers
    fn_type = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    ours_fn = fn_type(LIB.dequantizers[int(qtype)])
    ggml_fn = fn_type(LIB.ggml.base.ggml_get_type_traits(int(qtype)).contents.to_float)
    k = 512
    raw = raw_weight(qtype, 6, k, seed=9)
    blocks = raw.reshape(-1, GGML_QUANT_SIZES[qtype][1])
    extremes = np.array([0x0001, 0x7BFF, 0xFBFF, 0x8001], np.uint16).view(np.uint8).reshape(4, 2)
    blocks[:4, :2] = extremes  # d: smallest subnormal, largest, its negative, negative subnormal
    if qtype in (T.Q5_0, T.Q5_1):
        offset = 2 if qtype == T.Q5_0 else 4
        blocks[4:8, offset:offset + 4] = 0xFF  # every fifth bit set
    for row in raw:
        ours, theirs = np.zeros(k, np.float32), np.ones(k, np.float32)
        ours_fn(row.ctypes.data, ours.ctypes.data, k)
        ggml_fn(row.ctypes.data, theirs.ctypes.data, k)
        np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.skipif(isinstance(LIB, str) or not LIB.split_kinds, reason="the shim has no split-row kernels on this CPU")
@pytest.mark.parametrize("qtype", [T.Q4_1, T.Q5_0, T.Q5_1, T.MXFP4], ids=lambda t: t.name)
@pytest.mark.parametrize("n,k", [(300, 512), (7, 96), (64, 4096), (33, 896)])
def test_split_rows_give_ggml_s_products(qtype: T, n: int, k: int) -> None:
    """A Q4_1/Q5_0/Q5_1/MXFP4 weight whose rows split_rows rearranged (in groups of 16 blocks, factors,
    minimums and fifth bits ahead of the nibbles, MXFP4's exponents ahead of its codes: the same
    bytes) expands to exactly the values of its blocks (gguf-py's), and its
    decode rows agree with ggml's vec_dot over the original blocks to float32 rounding (the same
    integer sums, the block terms added in another order), each row whatever rows share its
    call; its prompt chunks (tiles=True) are bit for bit the original's float32 tiles, or, where
    the shim has the split rows' GEMM, ``test_split_gemm_agrees_with_ggml_s_vec_dot``'s. Row
    lengths of 3, 16, 28 and 128 blocks: a lone last block, whole groups of 16 and a group's
    remainder."""
    from mlxcel_compat.runtime.block_weight import split_rows

    if int(qtype) not in LIB.split_kinds:
        pytest.skip(f"no split {qtype.name} kernel on this CPU")
    raw = raw_weight(qtype, n, k, seed=21)
    plain = BlockWeight(raw, qtype, n, k, LIB)
    split = BlockWeight(raw.copy(), qtype, n, k, LIB)
    assert split_rows(split) and split.split and not split_rows(split)  # once only
    assert not np.array_equal(split.data, raw)  # rearranged
    np.testing.assert_array_equal(split.dequantize(), reference(qtype, raw))
    x = np.random.default_rng(22).standard_normal((11, k)).astype(np.float32)
    want = plain.matmul(x, tiles=False)
    got = split.matmul(x, tiles=False)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    for i in (0, 5, 10):
        np.testing.assert_array_equal(split.matmul(x[i:i + 1], tiles=False)[0], got[i])
    if SPLIT_TYPE_BASE + int(qtype) not in LIB.lane_prompts:
        np.testing.assert_array_equal(split.matmul(x, tiles=True), plain.matmul(x, tiles=True))


LANE_PROMPT_CASES = [(T.Q8_0, False), (T.Q4_1, True), (T.Q5_0, True), (T.Q5_1, True), (T.MXFP4, True)]


@pytest.mark.parametrize("qtype,split", LANE_PROMPT_CASES, ids=lambda c: getattr(c, "name", "split" if c else "plain"))
@pytest.mark.parametrize("n,k", [(301, 896), (7, 96), (64, 640)])
def test_prompt_chunks_take_the_lanes(qtype: T, split: bool, n: int, k: int) -> None:
    """Prompt chunks (tiles=True) of a Q8_0 weight and of split Q4_1/Q5_0/Q5_1/MXFP4 rows take the
    shim's lane kernels, as decode rows do (block_matmul.c: mlxcel_lanes_take_prompts): bit for
    bit the decode rows' results, so a prompt's rows and a step's agree exactly. Their activations
    are quantized by ggml's from_float (Q8_0, Q8_1), as llama-server's prompts are: the same
    integer sums as ggml's vec_dot over the original blocks, the block terms added in another
    order (float32 rounding of the sum), and further from float32 math, by the activations'
    rounding. 37 activation rows: three passes of 16, quantized over the pool (32 and more).
    Weight-row counts that leave a short last band of 16, rows of 3 blocks, a permuted Q8_0
    weight, accumulation (beta); each row's result is the same whatever rows share the call."""
    from mlxcel_compat.runtime.block_weight import split_rows

    code = SPLIT_TYPE_BASE + int(qtype) if split else int(qtype)
    if isinstance(LIB, str) or code not in LIB.lane_prompts:
        pytest.skip(f"no {qtype.name} lane kernel on this CPU (AVX-512 VNNI)")
    raw = raw_weight(qtype, n, k, seed=31)
    plain = BlockWeight(raw, qtype, n, k, LIB)
    weight = BlockWeight(raw.copy(), qtype, n, k, LIB)
    assert split_rows(weight) == split
    x = np.random.default_rng(32).standard_normal((37, k)).astype(np.float32)
    prompt = weight.matmul(x, tiles=True)
    np.testing.assert_array_equal(prompt, weight.matmul(x, tiles=False))
    kind = LIB.block_type(qtype)
    kind.own_kernel = -1  # ggml's vec_dot on the original blocks, as MLXCEL_OWN_KERNELS=0 gives
    try:
        by_ggml = plain.matmul(x, tiles=False)
    finally:
        kind.own_kernel = int(qtype) if int(qtype) in LIB.own_kernels else -1
    w = reference(qtype, raw)
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)
    assert np.all(np.abs(prompt - by_ggml) <= 2e-6 * scale)
    float32 = x @ w.T
    bound = np.abs(w).astype(np.float64) @ activation_error(qtype, x).T.astype(np.float64)
    assert np.all(np.abs(prompt - float32) <= bound.T + 1e-5 * scale)
    assert np.abs(prompt - float32).max() > 10 * np.abs(prompt - by_ggml).max()  # really 8-bit activations
    for rows in ([0], [1, 2], [36], [3, 4, 5], list(range(10, 37))):
        np.testing.assert_array_equal(weight.matmul(x[rows], tiles=True), prompt[rows])
    if not split:
        order = np.random.default_rng(25).permutation(n).astype(np.int32)
        permuted = BlockWeight(raw, qtype, n, k, LIB, rows=order)
        np.testing.assert_array_equal(permuted.matmul(x, tiles=True), prompt[:, order])
    start = np.random.default_rng(33).standard_normal((37, n)).astype(np.float32)
    out = start.copy()
    weight.matmul(x, out=out, beta=1.0, tiles=True)
    np.testing.assert_allclose(out, start + prompt, rtol=1e-6, atol=1e-5)


@pytest.mark.skipif(isinstance(LIB, str) or not (LIB.own_kernels or LIB.split_kinds), reason="no own kernels on this CPU")
def test_permuted_rows_are_copied_in_order_for_the_own_kernels() -> None:
    """llama's query and key rows are read permuted (``rows``); where the shim's own kernels
    multiply the type, the loader copies them into output order (``in_output_order``: the
    kernels take a band of rows at once only then), before a split-row type is split. Every
    product is bit for bit the permuted weight's; types the kernels do not serve are left as
    they are."""
    from mlxcel_compat.runtime.block_weight import in_output_order, split_rows

    n, k = 96, 512
    order = np.random.default_rng(27).permutation(n).astype(np.int32)
    x = np.random.default_rng(28).standard_normal((5, k)).astype(np.float32)
    served = [t for t in (T.Q8_0, T.Q4_K, T.Q6_K, T.Q4_1, T.Q5_0) if int(t) in LIB.own_kernels or int(t) in LIB.split_kinds]
    assert served
    for qtype in served:
        raw = raw_weight(qtype, n, k, seed=29)
        permuted = BlockWeight(raw.copy(), qtype, n, k, LIB, rows=order)
        split_rows(permuted)  # a split type's kernel on the rows as stored, read permuted
        weight = BlockWeight(raw, qtype, n, k, LIB, rows=order)
        assert in_output_order(weight) and weight.rows is None and not in_output_order(weight)
        np.testing.assert_array_equal(weight.data, raw[order])
        split_rows(weight)
        for tiles in (False, True):
            np.testing.assert_array_equal(weight.matmul(x, tiles=tiles), permuted.matmul(x, tiles=tiles), err_msg=qtype.name)
    other = BlockWeight(raw_weight(T.Q3_K, n, k, seed=30), T.Q3_K, n, k, LIB, rows=order)
    assert not in_output_order(other) and other.rows is not None
