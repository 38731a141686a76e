"""GGML block decoding (model/gguf_quants.py) against gguf-py's reference dequantizer.

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

from mlxcel_compat.model import gguf_quants, precision

# Byte offsets of the float16 fields (d, dmin/m) inside one block of each type.
F16_FIELDS = {
    T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
K_QUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


def random_blocks(qtype: T, n_blocks: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed + int(qtype))
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        scales = rng.uniform(-0.1, 0.1, size=n_blocks).astype(np.float16)
        raw[:, offset:offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(-1)


@pytest.mark.parametrize("qtype", list(F16_FIELDS), ids=lambda t: t.name)
def test_every_quantized_type_equals_gguf_py(qtype: T) -> None:
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, 300)
    reference = gguf.quants.dequantize(raw, qtype).reshape(-1)
    ours = gguf_quants.dequantize(raw, qtype, 300 * block_size)
    assert ours.dtype == np.float32
    np.testing.assert_array_equal(ours, reference)


@pytest.mark.parametrize("qtype", K_QUANTS, ids=lambda t: t.name)
def test_k_quants_decode_across_chunk_boundaries(qtype: T, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gguf_quants, "CHUNK_BLOCKS", 7)  # 50 blocks -> 8 slices, the last partial
    raw = random_blocks(qtype, 50, seed=1)
    ours = gguf_quants.dequantize(raw, qtype, 50 * 256)
    np.testing.assert_array_equal(ours, gguf.quants.dequantize(raw, qtype).reshape(-1))


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


@pytest.mark.parametrize("qtype", [T.IQ4_XS, T.IQ2_XXS, T.MXFP4, T.TQ1_0, T.Q8_1])
def test_unsupported_types_are_refused_by_name(qtype: T) -> None:
    with pytest.raises(gguf_quants.UnsupportedTensorType) as info:
        gguf_quants.check_supported("blk.3.ffn_down.weight", qtype)
    message = str(info.value)
    assert "blk.3.ffn_down.weight" in message and qtype.name in message and "Q4_K" in message


def test_a_truncated_tensor_is_an_error() -> None:
    raw = random_blocks(T.Q8_0, 4)
    with pytest.raises(ValueError, match="do not hold"):
        gguf_quants.dequantize(raw[:-1], T.Q8_0, 128, name="x")


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_affine_form_is_exact(qtype: T) -> None:
    rows, cols = 6, 96
    block_size, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, rows * cols // block_size, seed=3)
    blocks = gguf_quants.to_affine(raw, qtype, (rows, cols))
    assert blocks is not None and blocks.bits == (8 if qtype == T.Q8_0 else 4)
    assert blocks.scales.dtype == np.float16 and blocks.biases.dtype == np.float16
    # In float32 the affine arithmetic is exact, so this checks the integers, scales and offsets.
    restored = mx.dequantize(mx.array(blocks.weight), mx.array(blocks.scales).astype(mx.float32),
                             mx.array(blocks.biases).astype(mx.float32), group_size=32, bits=blocks.bits)
    reference = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    np.testing.assert_array_equal(np.array(restored.astype(mx.float32)), reference)


def test_precision_policy() -> None:
    f32, f16, bf16 = {T.F32}, {T.F32, T.F16, T.Q4_K}, {T.F32, T.BF16}
    assert precision.compute_dtype(True, f16) == "float32"
    assert precision.compute_dtype(False, f32) == "float32"
    assert precision.compute_dtype(False, f16) == "float16"
    assert precision.compute_dtype(False, bf16) == "bfloat16"
    for qtype in (T.Q8_0, T.Q4_K, T.Q6_K, T.F16):
        assert precision.tensor_precision(qtype, True, True, "float32") == "float32"  # CPU: always float32
    for qtype in (T.Q8_0, T.Q4_0, T.Q4_1):
        assert precision.tensor_precision(qtype, False, True, "float16") == "affine"
        assert precision.tensor_precision(qtype, False, False, "float16") == "float16"  # not a Linear
    for qtype in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q2_K, T.Q3_K, T.Q5_0, T.Q5_1):
        assert precision.tensor_precision(qtype, False, True, "float16") == "float16"
