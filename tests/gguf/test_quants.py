"""GGML block decoding (gguf/quants.py) against gguf-py's reference dequantizer.

The loader decodes every type with its own NumPy code, so gguf-py is an independent reference
here. K-quant test data are raw random-but-valid blocks (gguf-py cannot quantize K types): random
bytes everywhere except the float16 scale fields, which get finite values.
"""

from __future__ import annotations

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from mlxcel_compat.gguf import quants as gguf_quants
from mlxcel_compat.gguf import precision
from tests.conftest import slow_but

# Byte offsets of the float16 fields (d, dmin/m) inside one block of each type.
F16_FIELDS = {
    T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
    T.IQ4_NL: [0], T.IQ4_XS: [0], T.IQ3_XXS: [0], T.IQ3_S: [0], T.IQ2_XXS: [0], T.IQ2_XS: [0],
    T.IQ2_S: [0], T.IQ1_S: [0],
}
K_QUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
I_QUANTS = [T.IQ4_NL, T.IQ4_XS, T.IQ3_XXS, T.IQ3_S, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_S, T.IQ1_M]
# Every quantized type the loader reads: IQ1_M keeps its float16 factor in the top nibbles of its
# four 16-bit sub-block scale words, MXFP4 an 8-bit exponent per block (random_blocks sets both).
QUANTIZED_TYPES = [*F16_FIELDS, T.IQ1_M, T.MXFP4]
IQ1_M_SCALES = 48  # byte offset of block_iq1_m's scales: qs[32], qh[16], then scales[8]
# MXFP4's exponents in random blocks: 2^(e - 127) from 2^-17 to 2^7, values up to 6 * 2^7.
MXFP4_EXPONENTS = (110, 135)


def random_blocks(qtype: T, n_blocks: int, seed: int = 0) -> np.ndarray:
    """Random but valid blocks: random bytes (every bit pattern of the codes, grid indices and
    signs is a valid value), the factors finite, up to 0.1 in size."""
    rng = np.random.default_rng(seed + int(qtype))
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS.get(qtype, []):
        scales = rng.uniform(-0.1, 0.1, size=n_blocks).astype(np.float16)
        raw[:, offset:offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    if qtype == T.IQ1_M:  # bits 4i..4i+3 of the factor are the top nibble of scale word i
        factor = rng.uniform(-0.1, 0.1, size=n_blocks).astype(np.float16).view(np.uint16).astype(np.uint16)
        words = np.ascontiguousarray(raw[:, IQ1_M_SCALES:IQ1_M_SCALES + 8]).view("<u2")
        for i in range(4):
            words[:, i] = (words[:, i] & 0x0FFF) | (((factor >> (4 * i)) & 0xF) << 12)
        raw[:, IQ1_M_SCALES:IQ1_M_SCALES + 8] = words.view(np.uint8)
    if qtype == T.MXFP4:
        raw[:, 0] = rng.integers(*MXFP4_EXPONENTS, size=n_blocks)
    return raw.reshape(-1)


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES, ids=lambda t: t.name)
def test_every_quantized_type_equals_gguf_py(qtype: T) -> None:
    """Bit for bit, MXFP4 and the i-quants included (ggml's to_float there, where it is loaded)."""
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 300)
    reference = gguf.quants.dequantize(raw, qtype).reshape(-1)
    ours = gguf_quants.dequantize(raw, qtype, 300 * block_size)
    assert ours.dtype == np.float32
    assert np.isfinite(reference).all() and np.abs(reference).max() > 0  # the blocks hold real values
    np.testing.assert_array_equal(ours, reference)


@pytest.mark.parametrize("qtype", [*K_QUANTS, T.MXFP4, T.IQ4_NL, T.IQ2_XXS], ids=lambda t: t.name)
def test_decoding_across_chunk_boundaries(qtype: T, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_quants, "CHUNK_BLOCKS", 7)  # 50 blocks -> 8 slices, the last partial
    raw = random_blocks(qtype, 50, seed=1)
    ours = gguf_quants.dequantize(raw, qtype, 50 * GGML_QUANT_SIZES[qtype][0])
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, qtype).reshape(-1))


def test_table_types_decode_without_ggml(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ggml's library is not loaded (another platform, MLXCEL_GGML=0) MXFP4 and the
    i-quants are decoded by gguf-py: the same values; where it is, by ggml's to_float, which
    agrees bit for bit (test_every_quantized_type_equals_gguf_py)."""
    from mlxcel_compat.runtime import ggml_cpu

    calls: list[int] = []
    kernels = ggml_cpu.kernels()
    if not isinstance(kernels, str):
        monkeypatch.setattr(kernels, "dequantize", lambda t, b: calls.append(t) or type(kernels).dequantize(kernels, t, b))
        gguf_quants.dequantize(random_blocks(T.IQ3_S, 4), T.IQ3_S, 4 * 256)
        assert calls == [T.IQ3_S]  # ggml's to_float served it
    served = len(calls)
    monkeypatch.setattr(ggml_cpu, "kernels", lambda: "off (MLXCEL_GGML=0)")
    for qtype in gguf_quants.TABLE_TYPES:
        raw = random_blocks(qtype, 20, seed=2)
        n = 20 * GGML_QUANT_SIZES[qtype][0]
        np.testing.assert_array_equal(gguf_quants.dequantize(raw, qtype, n),
                                      gguf.quants.dequantize(raw, qtype).reshape(-1))
    assert len(calls) == served  # gguf-py's, not ggml's


def test_hand_built_blocks_decode_to_known_values() -> None:
    # Q8_0: d = 0.5, q = -16..15 -> values -8.0 .. 7.5
    d = np.array([0.5], dtype=np.float16).view(np.uint8)
    q = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    np.testing.assert_array_equal(gguf_quants.dequantize(np.concatenate([d, q]), T.Q8_0, 32),
                                  np.arange(-16, 16, dtype=np.float32) * 0.5)
    # Q4_0: byte j holds value j (low nibble) and value j+16 (high nibble); value = d * (q - 8)
    d = np.array([2.0], dtype=np.float16).view(np.uint8)
    qs = (np.arange(16, dtype=np.uint8) | (np.arange(15, -1, -1, dtype=np.uint8) << 4))
    expected = np.concatenate([np.arange(16) - 8, np.arange(15, -1, -1) - 8]).astype(np.float32) * 2
    np.testing.assert_array_equal(gguf_quants.dequantize(np.concatenate([d, qs]), T.Q4_0, 32), expected)
    # BF16 is the top half of a float32
    values = np.array([1.5, -2.25, 2.0**100, -(2.0**-100)], dtype=np.float32)
    bf16 = (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    np.testing.assert_array_equal(gguf_quants.dequantize(bf16, T.BF16, 4), values)


def test_float16_output_is_the_rounded_float32() -> None:
    raw = random_blocks(T.Q4_K, 20)
    full = gguf_quants.dequantize(raw, T.Q4_K, 20 * 256)
    half = gguf_quants.dequantize(raw, T.Q4_K, 20 * 256, dtype=np.float16)
    np.testing.assert_array_equal(half, full.astype(np.float16))


@pytest.mark.parametrize("qtype", [T.TQ1_0, T.TQ2_0, T.NVFP4, T.Q8_1, T.Q8_K])
def test_unsupported_types_are_refused_by_name(qtype: T) -> None:
    with pytest.raises(gguf_quants.UnsupportedTensorType) as info:
        gguf_quants.check_supported("blk.3.ffn_down.weight", qtype)
    message = str(info.value)
    assert "blk.3.ffn_down.weight" in message and qtype.name in message and "Q4_K" in message


def test_a_truncated_tensor_is_an_error() -> None:
    raw = random_blocks(T.Q8_0, 4)
    with pytest.raises(ValueError, match="do not hold"):
        gguf_quants.dequantize(raw[:-1], T.Q8_0, 128, name="x")


# --------------------------------------------------------------------------- MLX affine forms

# The types with an MLX affine form (MXFP4's is MLX's mxfp4 mode: test_mxfp4_form_is_the_file_s_values).
QUANTIZED = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, *I_QUANTS]
# Unit roundoff (nearest) and one ulp's relative size (directed rounding) of each scale dtype, and
# its smallest subnormal: the terms of the bounds precision.py states.
NEAREST = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}
DIRECTED = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23}
TINY = {"float16": 2.0**-24, "bfloat16": 2.0**-133, "float32": 2.0**-149}
# Float32 arithmetic in mx.dequantize and in gguf-py: a few roundings of |scale| u + |bias|.
F32_SLACK = 2.0**-22


def _affine(raw: np.ndarray, qtype: T, shape: tuple[int, int], dtype: str
            ) -> tuple[precision.AffineForm, gguf_quants.AffineBlocks, np.ndarray]:
    """The policy's form of ``raw``, its arrays and their float32 dequantization by MLX."""
    form = precision.affine_form(qtype, dtype)
    assert form is not None
    blocks = gguf_quants.to_affine(raw, qtype, shape, form.bits, form.group_size, dtype)
    assert blocks is not None and blocks.bits == form.bits and blocks.group_size == form.group_size
    # Scales and biases hold dtype values; dequantizing them in float32 shows the form's own error.
    restored = mx.dequantize(mx.array(blocks.weight), mx.array(blocks.scales), mx.array(blocks.biases),
                             group_size=form.group_size, bits=form.bits)
    return form, blocks, np.array(restored)


def _bound(raw: np.ndarray, qtype: T, form: precision.AffineForm, reference: np.ndarray, dtype: str) -> np.ndarray:
    """Per value, the error precision.py's docstring promises for this form, plus the float32
    rounding of computing ``scale * u + bias`` and the reference (F32_SLACK of |scale| u + |bias|)."""
    shape = reference.shape
    if form.method in (precision.EXACT, precision.ROUNDED):
        # The file's integers u are kept; |round(s) - s| <= e |s| + tiny/2, the same for the bias.
        split = gguf_quants.integer_form(qtype, form.bits, form.group_size)
        _, type_size = GGML_QUANT_SIZES[qtype]
        u, scale, bias = split.split(raw.reshape(-1, type_size))
        per = GGML_QUANT_SIZES[qtype][0] // scale.shape[1]
        scale, bias = np.repeat(scale, per, axis=1).reshape(shape), np.repeat(bias, per, axis=1).reshape(shape)
        u = u.reshape(shape).astype(np.float64)
        magnitude = np.abs(scale) * u + np.abs(bias)
        if form.method == precision.EXACT:
            return F32_SLACK * magnitude
        e, h = NEAREST[dtype], TINY[dtype] / 2
        return (e * np.abs(scale) + h) * u + e * np.abs(bias) + h + F32_SLACK * magnitude
    # Requantized: half the grid step, the step (max - bias) / top rounded up, bias = min rounded down.
    top = 2**form.bits - 1
    groups = reference.reshape(-1, form.group_size).astype(np.float64)
    lo, hi = groups.min(axis=1, keepdims=True), groups.max(axis=1, keepdims=True)
    e, h = DIRECTED[dtype], TINY[dtype]
    step = (hi - lo + e * np.abs(lo) + h) / top * (1 + e) + h
    magnitude = step * top + np.abs(lo) + step
    return np.broadcast_to(step / 2 + F32_SLACK * magnitude, groups.shape).reshape(shape)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_affine_form_matches_gguf_py(qtype: T, dtype: str) -> None:
    """Every type's MLX form against gguf-py's dequantizer: exact where the policy says exact,
    within the stated bound otherwise (plus float32 rounding of the comparison itself)."""
    rows, cols = 6, 512
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, rows * cols // block_size, seed=3)
    reference = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    form, blocks, restored = _affine(raw, qtype, (rows, cols), dtype)
    assert blocks.exact == (form.method == precision.EXACT)
    error = np.abs(restored.astype(np.float64) - reference)
    if form.method == precision.EXACT:
        np.testing.assert_array_equal(restored, reference)
    bound = _bound(raw, qtype, form, reference, dtype)
    assert (error <= bound).all(), (error - bound).max()
    # The dtype really holds the scales and biases MLX will be handed.
    assert np.array_equal(gguf_quants.round_to(blocks.scales, dtype), blocks.scales)
    assert np.array_equal(gguf_quants.round_to(blocks.biases, dtype), blocks.biases)


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_affine_quantized_matmul_within_the_bound(qtype: T) -> None:
    """One mx.quantized_matmul per type (float32 activations, float16 scales held in float32):
    the product of the file's values, within the per-value bound times |x| plus the float32 sum."""
    rows, cols = 8, 1024
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, rows * cols // block_size, seed=5)
    reference = gguf.quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float64)
    form, blocks, _ = _affine(raw, qtype, (rows, cols), "float16")
    x = np.random.default_rng(9).standard_normal((3, cols)).astype(np.float32)
    got = mx.quantized_matmul(mx.array(x), mx.array(blocks.weight), mx.array(blocks.scales), mx.array(blocks.biases),
                              transpose=True, group_size=form.group_size, bits=form.bits)
    expected = x.astype(np.float64) @ reference.T
    # A float32 sum of n products is off by at most n * 2^-24 * sum |x| |w| (Higham's gamma_n).
    limit = (np.abs(x) @ _bound(raw, qtype, form, reference, "float16").T
             + cols * 2.0**-24 * (np.abs(x) @ np.abs(reference).T))
    assert (np.abs(np.array(got) - expected) <= limit).all()


# Measured: Q3_K, Q8_0 0 (exact); Q4_K 0.009, Q5_K 0.018 (scales rounded); Q2_K 0.23 and Q6_K 0.30
# (requantized); the i-quants (on 32 rows): IQ3_S 0.006 and IQ1_S
# 0.0012 (their own integers, scales rounded), the requantized IQ4_NL 0.23, IQ4_XS 0.29, IQ3_XXS
# 0.29, IQ2_XXS 0.26, IQ2_XS 0.26, IQ2_S 0.29, IQ1_M 0.22; limits with 1.15x headroom.
AFFINE_ERROR_LIMIT = {T.Q2_K: 0.27, T.Q3_K: 0.0, T.Q4_K: 0.011, T.Q5_K: 0.021, T.Q6_K: 0.35, T.Q8_0: 0.0,
                      T.IQ4_NL: 0.27, T.IQ4_XS: 0.34, T.IQ3_XXS: 0.33, T.IQ3_S: 0.007, T.IQ2_XXS: 0.30,
                      T.IQ2_XS: 0.30, T.IQ2_S: 0.34, T.IQ1_S: 0.0014, T.IQ1_M: 0.25}

# ggml's quantizers of these set up their grids' neighbour tables first, once a process: 24 s
# (IQ1_S, IQ1_M), 13 s (IQ2_S), 5 s (IQ2_XS) here. Their measurements run with --slow; their forms'
# bounds run by default (test_affine_form_matches_gguf_py, tests/gguf/test_types.py).
SLOW_QUANTIZERS = (T.IQ1_S, T.IQ1_M, T.IQ2_S, T.IQ2_XS)


@pytest.mark.parametrize("qtype", slow_but(list(AFFINE_ERROR_LIMIT), [t for t in AFFINE_ERROR_LIMIT
                                                                       if t not in SLOW_QUANTIZERS]),
                         ids=lambda t: t.name)
def test_affine_error_on_ggml_quantized_weights(qtype: T) -> None:
    """The measurements behind the choice of forms (precision.py): heavy-tailed weights quantized by
    ggml (the i-quants with a uniform importance matrix, as the test factory's), the RMS error
    each form adds to the file's values, against the file's own error."""
    from mlxcel_compat.runtime import ggml_cpu

    kernels = ggml_cpu.kernels()
    if isinstance(kernels, str):
        pytest.skip(f"ggml's quantizer is needed to write {qtype.name} blocks: {kernels}")
    rng = np.random.default_rng(0)
    rows, cols = (32 if qtype in I_QUANTS else 256), 2048
    weights = rng.standard_t(5, size=(rows, cols)) * 0.02 * np.exp(rng.normal(0, 0.3, size=(rows, 1)))
    weights = weights.astype(np.float32)
    importance = np.ones(cols, np.float32) if qtype in I_QUANTS else None
    raw = kernels.quantize(qtype, weights, importance).reshape(-1)
    values = gguf.quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float64)
    _, _, restored = _affine(raw, qtype, (rows, cols), "float16")
    file_error = np.sqrt(np.mean((values - weights) ** 2))
    added = np.sqrt(np.mean((restored - values) ** 2)) / file_error
    print(f"{qtype.name}: the affine form adds {added:.4f}x the file's RMS error")
    assert added <= AFFINE_ERROR_LIMIT[qtype]


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_is_mlx_layout(bits: int) -> None:
    """The packer writes MLX's own words: re-pack the integers mx.quantize chose and compare."""
    w = mx.array(np.random.default_rng(bits).standard_normal((4, 256)).astype(np.float32))
    packed, scales, biases = mx.quantize(w, group_size=64, bits=bits)
    values = np.array(mx.dequantize(packed, scales, biases, group_size=64, bits=bits))
    s, b = np.repeat(np.array(scales), 64, axis=1), np.repeat(np.array(biases), 64, axis=1)
    u = np.rint((values - b) / s).astype(np.uint8)
    assert u.max() == 2**bits - 1  # the top bit of each field is exercised
    np.testing.assert_array_equal(gguf_quants.pack(u.reshape(-1), bits).reshape(4, -1), np.array(packed))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_rounding_to_the_scale_dtype(dtype: str) -> None:
    """round_to is MLX's own conversion; step_to reaches the adjacent value, with none between."""
    x = (np.random.default_rng(1).standard_normal(2000) * 10.0 ** np.random.default_rng(2).integers(-6, 4, 2000))
    x = np.concatenate([x, [0.0, -0.0, 1.0, -1.0]]).astype(np.float32)
    target = mx.float16 if dtype == "float16" else mx.bfloat16
    y = gguf_quants.round_to(x, dtype)
    np.testing.assert_array_equal(y, np.array(mx.array(x).astype(target).astype(mx.float32)))
    for up in (True, False):
        z = gguf_quants.step_to(y, dtype, up)
        assert ((z > y) if up else (z < y)).all()
        assert np.array_equal(gguf_quants.round_to(z, dtype), z)
        near, far = y + (z - y) * np.float32(0.49), y + (z - y) * np.float32(0.51)
        assert np.array_equal(gguf_quants.round_to(near, dtype), y)
        assert np.array_equal(gguf_quants.round_to(far, dtype), z)


def test_affine_overflow_is_refused() -> None:
    """Q8_0 with d = 512: the bias -128 d = -65536 is beyond float16 (the loader dequantizes that
    tensor instead); bfloat16 holds it. d = 511.75, the float16 below, still fits."""
    block = random_blocks(T.Q8_0, 2).reshape(2, -1)
    block[0, 0:2] = np.array([511.75], dtype=np.float16).view(np.uint8)
    assert gguf_quants.to_affine(block.reshape(-1), T.Q8_0, (1, 64), 8, 32, "float16") is not None
    block[0, 0:2] = np.array([512.0], dtype=np.float16).view(np.uint8)
    assert gguf_quants.to_affine(block.reshape(-1), T.Q8_0, (1, 64), 8, 32, "float16") is None
    assert gguf_quants.to_affine(block.reshape(-1), T.Q8_0, (1, 64), 8, 32, "bfloat16") is not None
    with pytest.raises(ValueError, match="groups of 128"):
        gguf_quants.to_affine(block.reshape(-1), T.Q8_0, (1, 64), 8, 128, "float16")


def test_precision_policy() -> None:
    f32, f16, bf16 = {T.F32}, {T.F32, T.F16, T.Q4_K}, {T.F32, T.BF16}
    assert precision.compute_dtype(True, f16) == "float32"
    assert precision.compute_dtype(False, f32) == "float32"
    assert precision.compute_dtype(False, f16) == "float16"
    assert precision.compute_dtype(False, bf16) == "bfloat16"
    for qtype in (T.Q8_0, T.Q4_K, T.Q6_K, T.F16):
        assert precision.tensor_precision(qtype, True, True, "float32") == "float32"  # CPU without ggml
        assert precision.tensor_precision(qtype, True, True, "float32", blocks=True) == "blocks"
        assert precision.tensor_precision(qtype, True, False, "float32", blocks=True) == "float32"
    # Metal / CUDA: every quantized matrix of a Linear or Embedding is affine; nothing else is.
    for qtype in QUANTIZED:
        assert precision.tensor_precision(qtype, False, True, "float16") == "affine"
        assert precision.tensor_precision(qtype, False, False, "float16") == "float16"  # not a Linear
    for qtype in (T.F16, T.BF16, T.F32):
        assert precision.tensor_precision(qtype, False, True, "bfloat16") == "bfloat16"
        assert precision.affine_form(qtype, "float16") is None
    forms = {t: precision.affine_form(t, "float16") for t in QUANTIZED}
    assert {t.name: (f.bits, f.group_size, f.method) for t, f in forms.items()} == {
        "Q8_0": (8, 32, "exact"), "Q4_0": (4, 32, "exact"), "Q4_1": (4, 32, "exact"),
        "Q5_0": (5, 32, "exact"), "Q5_1": (5, 32, "exact"), "Q3_K": (8, 128, "exact"),
        "Q4_K": (4, 32, "rounded"), "Q5_K": (5, 32, "rounded"),
        "Q6_K": (8, 64, "requantized"), "Q2_K": (4, 32, "requantized"),
        "IQ4_NL": (6, 32, "requantized"), "IQ4_XS": (6, 64, "requantized"), "IQ3_XXS": (5, 64, "requantized"),
        "IQ3_S": (4, 32, "rounded"), "IQ2_XXS": (4, 64, "requantized"), "IQ2_XS": (4, 32, "requantized"),
        "IQ2_S": (4, 32, "requantized"), "IQ1_S": (2, 32, "rounded"), "IQ1_M": (4, 64, "requantized"),
    }
    # IQ3_S's and IQ1_S's grids are evenly spaced: their integers fit, exact in float32.
    assert precision.affine_form(T.IQ3_S, "float32").method == precision.affine_form(T.IQ1_S, "float32").method == "exact"
    # MXFP4 is MLX's own mxfp4 mode (this MLX has it), exact, 4.25 bits a weight as in the file;
    # an embedding's rows would come out in bfloat16, so MXFP4 embeddings are expanded instead.
    mxfp4 = precision.affine_form(T.MXFP4, "float16")
    assert (mxfp4.bits, mxfp4.group_size, mxfp4.method, mxfp4.mode) == (4, 32, "exact", "mxfp4")
    assert mxfp4.bits_per_weight == GGML_QUANT_SIZES[T.MXFP4][1] * 8 / 32 and mxfp4.describe() == "MLX mxfp4, group 32 (exact)"
    assert precision.tensor_precision(T.MXFP4, False, True, "bfloat16") == "affine"
    assert precision.tensor_precision(T.MXFP4, False, True, "float16", embedding=True) == "float16"
    assert precision.tensor_precision(T.MXFP4, True, True, "float32", blocks=True) == "blocks"
    # bfloat16 scales cannot hold float16 ones; float32 holds d * sc exactly.
    assert precision.affine_form(T.Q8_0, "bfloat16").method == "rounded"
    assert precision.affine_form(T.Q4_K, "float32").method == "exact"
    assert precision.affine_form(T.Q6_K, "float32").method == "requantized"
    # Bytes against the file's: within the 1.3x goal for the types of Q4_K_M, Q5_K_M, Q6_K, Q8_0 files.
    for qtype, limit in ((T.Q8_0, 1.06), (T.Q4_K, 1.12), (T.Q5_K, 1.1), (T.Q6_K, 1.3)):
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        assert forms[qtype].bits_per_weight / (type_size * 8 / block_size) <= limit


# --------------------------------------------------------------------------- MLX mxfp4 form


def test_mxfp4_form_is_the_file_s_values() -> None:
    """ggml's MXFP4 blocks as MLX mxfp4 weights: every value gguf-py reads, bit for bit, through
    mx.dequantize, for every exponent ggml can write (0..254, subnormal scales included); a
    product by mx.quantized_matmul is the file's product to float32 rounding."""
    rows, cols = 8, 1024
    raw = random_blocks(T.MXFP4, rows * cols // 32, seed=7).reshape(-1, 17)
    raw[:255, 0] = np.arange(255)  # every exponent but E8M0's NaN
    with np.errstate(over="ignore"):  # 6 * 2^127 is inf, in MLX as in gguf-py
        reference = gguf.quants.dequantize(raw.reshape(-1), T.MXFP4).reshape(rows, cols)
    fp4 = gguf_quants.to_mxfp4(raw.reshape(-1), (rows, cols))
    assert fp4.weight.shape == (rows, cols // 8) and fp4.weight.dtype == np.uint32
    assert fp4.scales.shape == (rows, cols // 32) and fp4.scales.dtype == np.uint8
    weight, scales = mx.array(fp4.weight), mx.array(fp4.scales)
    restored = mx.dequantize(weight, scales, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
    np.testing.assert_array_equal(np.array(restored), reference)

    sane = raw.copy()
    sane[:, 0] = random_blocks(T.MXFP4, rows * cols // 32, seed=8).reshape(-1, 17)[:, 0]  # no overflowing products
    values = gguf.quants.dequantize(sane.reshape(-1), T.MXFP4).reshape(rows, cols).astype(np.float64)
    fp4 = gguf_quants.to_mxfp4(sane.reshape(-1), (rows, cols))
    x = np.random.default_rng(9).standard_normal((3, cols)).astype(np.float32)
    got = mx.quantized_matmul(mx.array(x), mx.array(fp4.weight), mx.array(fp4.scales), transpose=True,
                              group_size=32, bits=4, mode="mxfp4")
    limit = cols * 2.0**-24 * (np.abs(x) @ np.abs(values).T)
    assert (np.abs(np.array(got) - x.astype(np.float64) @ values.T) <= limit).all()


def test_mxfp4_exponent_255_has_no_mlx_form() -> None:
    """E8M0's 255 is NaN to MLX and 2^128 to ggml: such a tensor is dequantized instead (None)."""
    raw = random_blocks(T.MXFP4, 4).reshape(4, 17)
    raw[2, 0] = 255
    assert gguf_quants.to_mxfp4(raw.reshape(-1), (2, 64)) is None
    with pytest.raises(ValueError, match="whole blocks"):
        gguf_quants.to_mxfp4(raw.reshape(-1)[:34], (1, 48))
