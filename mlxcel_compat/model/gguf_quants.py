"""GGML tensor types: decode the raw blocks of a GGUF tensor into floats, or into MLX's affine form.

Every type the loader accepts is decoded here, with NumPy, straight from the block layouts of
ggml (``ggml-common.h``, ``dequantize_row_*`` in ``ggml-quants.c``). MLX's GGUF reader (``mx.load``
on the file) is deliberately not used: in mlx 0.32 it gives Q4_K wrong scales on odd sub-blocks,
raises on Q5_0, Q5_1, Q5_K, Q3_K and the IQ types, and silently drops MXFP4/TQ tensors and
everything after them. (Float tensors skip NumPy: ``gguf.read_float_tensor``.)
gguf-py's own dequantizer is the reference the tests compare against, so the two are
independent implementations of the same layouts.

A type not listed in ``DECODERS`` (IQ*, TQ*, MXFP4, NVFP4, Q8_1, Q8_K, integer types) raises
``UnsupportedTensorType`` naming the tensor and the type: never silently wrong weights.

Decoding runs over slices of at most ``CHUNK_BLOCKS`` blocks, so the temporaries stay small next
to the tensor itself (peak memory while loading stays near the final weight bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

T = GGMLQuantizationType
CHUNK_BLOCKS = 1 << 15  # 32K blocks: 1-8M values per slice


class UnsupportedTensorType(ValueError):
    """A tensor is stored in a GGML type this loader cannot decode correctly."""


def type_name(ggml_type: int) -> str:
    try:
        return T(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The little-endian float16 at byte ``start`` of each block, as a float32 column."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit order: the low nibbles of all bytes first, then the high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _bits(words: np.ndarray, count: int) -> np.ndarray:
    """Bits 0..count-1 of each uint32 in ``words`` (shape (n,)), as uint8 (n, count)."""
    shifts = np.arange(count, dtype=np.uint32)
    return ((words[:, None] >> shifts) & 1).astype(np.uint8)


def _q8_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * b[:, 2:34].view(np.int8).astype(np.float32)


def _q4_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * (_nibbles(b[:, 2:18]).astype(np.float32) - 8)


def _q4_1(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * _nibbles(b[:, 4:20]).astype(np.float32) + _f16(b, 2)


def _q5_0(b: np.ndarray) -> np.ndarray:
    high = _bits(np.ascontiguousarray(b[:, 2:6]).view("<u4")[:, 0], 32) << 4
    return _f16(b, 0) * ((_nibbles(b[:, 6:22]) | high).astype(np.float32) - 16)


def _q5_1(b: np.ndarray) -> np.ndarray:
    high = _bits(np.ascontiguousarray(b[:, 4:8]).view("<u4")[:, 0], 32) << 4
    return _f16(b, 0) * (_nibbles(b[:, 8:24]) | high).astype(np.float32) + _f16(b, 2)


def _q2_k(b: np.ndarray) -> np.ndarray:
    # 256 values = 2 halves x 4 shifts x 2 runs of 16; each run has a 4-bit scale and min.
    n = len(b)
    scales = b[:, 0:16].reshape(n, 2, 4, 2, 1)
    qs = b[:, 16:80].reshape(n, 2, 1, 2, 16)
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1, 1)
    q = ((qs >> shifts) & 3).astype(np.float32)
    d, dmin = _f16(b, 80).reshape(n, 1, 1, 1, 1), _f16(b, 82).reshape(n, 1, 1, 1, 1)
    y = d * (scales & 0x0F).astype(np.float32) * q - dmin * (scales >> 4).astype(np.float32)
    return y.reshape(n, 256)


def _q3_k_scales(raw: np.ndarray) -> np.ndarray:
    """The 16 signed 6-bit scales packed into 12 bytes (low 4 bits in 0..7, high 2 bits in 8..11)."""
    aux = np.ascontiguousarray(raw).view("<u4")  # (n, 3)
    kmask1, kmask2 = np.uint32(0x03030303), np.uint32(0x0F0F0F0F)
    a0, a1, tmp = aux[:, 0], aux[:, 1], aux[:, 2]
    words = np.stack([
        (a0 & kmask2) | (((tmp >> 0) & kmask1) << 4),
        (a1 & kmask2) | (((tmp >> 2) & kmask1) << 4),
        ((a0 >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4),
        ((a1 >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4),
    ], axis=1).astype("<u4")
    return words.view(np.int8).astype(np.float32) - 32  # (n, 16)


def _q3_k(b: np.ndarray) -> np.ndarray:
    # Like Q2_K's order; a set bit of hmask means "no -4" for that value.
    n = len(b)
    hmask = b[:, 0:32].reshape(n, 1, 1, 2, 16)
    qs = b[:, 32:96].reshape(n, 2, 1, 2, 16)
    scales = _q3_k_scales(b[:, 96:108]).reshape(n, 2, 4, 2, 1)
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1, 1)
    low = ((qs >> shifts) & 3).astype(np.float32)
    mask_bit = (np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1, 1))  # bit h*4 + j of hmask
    high = ((hmask >> mask_bit) & 1).astype(np.float32)
    d = _f16(b, 108).reshape(n, 1, 1, 1, 1)
    return (d * scales * (low - 4 * (1 - high))).reshape(n, 256)


def _k4_scales(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: eight 6-bit scales and mins packed into 12 bytes (ggml's get_scale_min_k4)."""
    s = raw.astype(np.uint8)
    sc = np.empty((len(s), 8), dtype=np.uint8)
    mn = np.empty((len(s), 8), dtype=np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(b: np.ndarray) -> np.ndarray:
    # 4 chunks of 64: 32 low nibbles (scale 2c) then 32 high nibbles (scale 2c+1) of 32 bytes.
    n = len(b)
    sc, mn = _k4_scales(b[:, 4:16])
    qs = b[:, 16:144].reshape(n, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).astype(np.float32)  # (n, 4, 2, 32)
    d, dmin = _f16(b, 0).reshape(n, 1, 1, 1), _f16(b, 2).reshape(n, 1, 1, 1)
    y = d * sc.reshape(n, 4, 2, 1) * q - dmin * mn.reshape(n, 4, 2, 1)
    return y.reshape(n, 256)


def _q5_k(b: np.ndarray) -> np.ndarray:
    n = len(b)
    sc, mn = _k4_scales(b[:, 4:16])
    qh = b[:, 16:48].reshape(n, 1, 1, 32)
    qs = b[:, 48:176].reshape(n, 4, 1, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # (n, 4, 2, 32)
    bit = np.arange(8, dtype=np.uint8).reshape(1, 4, 2, 1)  # chunk c, nibble k -> qh bit 2c + k
    q = (low | (((qh >> bit) & 1) << 4)).astype(np.float32)
    d, dmin = _f16(b, 0).reshape(n, 1, 1, 1), _f16(b, 2).reshape(n, 1, 1, 1)
    y = d * sc.reshape(n, 4, 2, 1) * q - dmin * mn.reshape(n, 4, 2, 1)
    return y.reshape(n, 256)


def _q6_k(b: np.ndarray) -> np.ndarray:
    # 2 halves of 128 = 4 runs of 32; run k takes the (k//2) nibble of ql[(k%2)*32 + l] and
    # bits 2k..2k+1 of qh[l]; every 16 values have their own int8 scale.
    n = len(b)
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # half, ql offset (0 or 32), l
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    low = np.stack([ql[:, :, 0] & 0x0F, ql[:, :, 1] & 0x0F, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], axis=2)
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)
    q = (low | (((qh >> shifts) & 3) << 4)).astype(np.float32) - 32  # (n, 2, 4, 32)
    scales = b[:, 192:208].view(np.int8).astype(np.float32).reshape(n, 2, 4, 2, 1)
    d = _f16(b, 208).reshape(n, 1, 1, 1, 1)
    return (d * scales * q.reshape(n, 2, 4, 2, 16)).reshape(n, 256)


def _bf16(b: np.ndarray) -> np.ndarray:
    return (np.ascontiguousarray(b).view("<u2").astype(np.uint32) << 16).view(np.float32)


def _f16_values(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f2").astype(np.float32)


def _f32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f4")


DECODERS: dict[int, Callable[[np.ndarray], np.ndarray]] = {
    T.F32: _f32,
    T.F16: _f16_values,
    T.BF16: _bf16,
    T.Q8_0: _q8_0,
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
}
SUPPORTED_TYPES: tuple[str, ...] = tuple(type_name(t) for t in DECODERS)
FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})
K_QUANTS = frozenset({T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K})


def check_supported(name: str, ggml_type: int) -> None:
    if ggml_type not in DECODERS:
        raise UnsupportedTensorType(
            f"tensor '{name}' is stored as {type_name(ggml_type)}, which mlxcel_compat cannot load "
            f"correctly; supported types: {', '.join(SUPPORTED_TYPES)}"
        )


def byte_size(ggml_type: int, n_values: int) -> int:
    block_size, type_size = GGML_QUANT_SIZES[T(ggml_type)]
    return n_values // block_size * type_size


def dequantize(raw: np.ndarray, ggml_type: int, n_values: int, dtype: type = np.float32,
               name: str = "?") -> np.ndarray:
    """Decode ``raw`` (uint8, the tensor's bytes) into a flat array of ``n_values`` in ``dtype``."""
    check_supported(name, ggml_type)
    block_size, type_size = GGML_QUANT_SIZES[T(ggml_type)]
    if n_values % block_size or raw.size != n_values // block_size * type_size:
        raise ValueError(f"tensor '{name}': {raw.size} bytes do not hold {n_values} {type_name(ggml_type)} values")
    decode = DECODERS[ggml_type]
    blocks = raw.reshape(-1, type_size)
    if ggml_type == T.F32 and dtype == np.float32:
        return decode(raw)
    out = np.empty(n_values, dtype=dtype)
    step = CHUNK_BLOCKS
    for start in range(0, len(blocks), step):
        chunk = decode(blocks[start:start + step])
        out[start * block_size:(start + len(chunk)) * block_size] = chunk.reshape(-1)
    return out


# --------------------------------------------------------------------------- MLX affine form


@dataclass
class AffineBlocks:
    """A GGML tensor re-expressed exactly as MLX affine quantization (group size 32).

    MLX computes ``scale * q + bias`` per group of 32, with ``q`` unsigned and packed into
    uint32 words from the least significant bits up. Q8_0 (``d * q``, q signed) becomes
    ``q + 128`` with bias ``-128 d``; Q4_0 (``d * (q - 8)``) has bias ``-8 d``; Q4_1 (``d * q + m``)
    maps directly. All scales and biases are float16 values ggml already stored (times a power
    of two), so the conversion is exact.
    """

    weight: np.ndarray  # uint32, (rows, cols * bits / 32)
    scales: np.ndarray  # float16, (rows, cols / 32)
    biases: np.ndarray  # float16, (rows, cols / 32)
    bits: int
    group_size: int = 32


def to_affine(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> AffineBlocks | None:
    """The exact MLX affine form of a Q8_0/Q4_0/Q4_1 matrix, or None if a bias overflows float16."""
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    _, type_size = GGML_QUANT_SIZES[T(ggml_type)]
    b = raw.reshape(-1, type_size)
    d = np.ascontiguousarray(b[:, 0:2]).view("<f2")[:, 0]
    if ggml_type == T.Q8_0:
        q = (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        bias32, bits = d.astype(np.float32) * -128, 8
    elif ggml_type == T.Q4_0:
        q = _nibbles(b[:, 2:18])
        bias32, bits = d.astype(np.float32) * -8, 4
    elif ggml_type == T.Q4_1:
        q = _nibbles(b[:, 4:20])
        bias32, bits = np.ascontiguousarray(b[:, 2:4]).view("<f2")[:, 0].astype(np.float32), 4
    else:
        raise ValueError(f"{type_name(ggml_type)} has no exact MLX affine form")
    bias = bias32.astype(np.float16)
    if not np.array_equal(bias.astype(np.float32), bias32):
        return None
    q = q.reshape(rows, cols)
    if bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)
    weight = np.ascontiguousarray(q).view("<u4")
    groups = (rows, cols // 32)
    return AffineBlocks(weight, d.reshape(groups).copy(), bias.reshape(groups), bits)
