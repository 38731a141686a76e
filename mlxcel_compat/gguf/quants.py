"""GGML tensor types: decode the raw blocks of a GGUF tensor into floats, or into MLX's forms.

The float types, Q4_0-Q8_0 and the K-quants are decoded here, with NumPy, straight from the
block layouts of ggml (``ggml-common.h``, ``dequantize_row_*`` in ``ggml-quants.c``); gguf-py's
own dequantizer is the reference the tests compare against, so the two are independent
implementations of the same layouts. MXFP4 and the i-quants (``TABLE_TYPES``: values looked up
in ggml's grids and code tables) are decoded by ggml's own ``to_float`` where its CPU library is
loaded (what the CPU's block weights expand with, 5-30x faster than NumPy), else by gguf-py's
``dequantize``, the reference again: the two agree bit for bit (tests/gguf/test_quants.py), and
neither copies ggml's tables into this project. MLX's GGUF reader (``mx.load`` on the file) is
deliberately not used: in mlx 0.32 it gives Q4_K wrong scales on odd sub-blocks, raises on Q5_0,
Q5_1, Q5_K, Q3_K and the IQ types, and silently drops MXFP4/TQ tensors and everything after
them. (Float tensors skip NumPy: ``gguf.read_float_tensor``.)

A type not listed in ``DECODERS`` (TQ*, NVFP4, Q8_1, Q8_K, integer types) raises
``UnsupportedTensorType`` naming the tensor and the type: never silently wrong weights.

Decoding runs over slices of at most ``CHUNK_BLOCKS`` blocks, so the temporaries stay small next
to the tensor itself (peak memory while loading stays near the final weight bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from mlxcel_compat.runtime import ggml_cpu

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


def _q5_ints(b: np.ndarray, qh: int, qs: int) -> np.ndarray:
    """Q5_0/Q5_1: 4 low bits as ``_nibbles``, the fifth from a 32-bit word at byte ``qh``."""
    high = _bits(np.ascontiguousarray(b[:, qh:qh + 4]).view("<u4")[:, 0], 32) << 4
    return _nibbles(b[:, qs:qs + 16]) | high


def _k_quant_ints(b: np.ndarray, high_bits: bool) -> np.ndarray:
    """Q4_K (``high_bits`` False) / Q5_K: the unsigned integers, shaped (n, 4 chunks, 2 sub-blocks, 32)."""
    n = len(b)
    qs = b[:, 48:176].reshape(n, 4, 1, 32) if high_bits else b[:, 16:144].reshape(n, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2)  # chunk c: low nibbles (sub-block 2c), high (2c+1)
    if high_bits:
        qh = b[:, 16:48].reshape(n, 1, 1, 32)
        bit = np.arange(8, dtype=np.uint8).reshape(1, 4, 2, 1)  # sub-block 2c + k -> qh bit 2c + k
        q = q | (((qh >> bit) & 1) << 4)
    return q


def _q8_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * b[:, 2:34].view(np.int8).astype(np.float32)


def _q4_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * (_nibbles(b[:, 2:18]).astype(np.float32) - 8)


def _q4_1(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * _nibbles(b[:, 4:20]).astype(np.float32) + _f16(b, 2)


def _q5_0(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * (_q5_ints(b, 2, 6).astype(np.float32) - 16)


def _q5_1(b: np.ndarray) -> np.ndarray:
    return _f16(b, 0) * _q5_ints(b, 4, 8).astype(np.float32) + _f16(b, 2)


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
    q = _k_quant_ints(b, high_bits=False).astype(np.float32)  # (n, 4, 2, 32)
    d, dmin = _f16(b, 0).reshape(n, 1, 1, 1), _f16(b, 2).reshape(n, 1, 1, 1)
    y = d * sc.reshape(n, 4, 2, 1) * q - dmin * mn.reshape(n, 4, 2, 1)
    return y.reshape(n, 256)


def _q5_k(b: np.ndarray) -> np.ndarray:
    n = len(b)
    sc, mn = _k4_scales(b[:, 4:16])
    q = _k_quant_ints(b, high_bits=True).astype(np.float32)  # (n, 4, 2, 32)
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


def _table_decoder(ggml_type: int) -> Callable[[np.ndarray], np.ndarray]:
    """A decoder of a ``TABLE_TYPES`` type: ggml's ``to_float`` where its library is loaded and
    has the type, else gguf-py's ``dequantize`` (the same values, bit for bit)."""

    def decode(b: np.ndarray) -> np.ndarray:
        kernels = ggml_cpu.kernels()
        if not isinstance(kernels, str) and kernels.supports(ggml_type):
            return kernels.dequantize(ggml_type, b)
        import gguf.quants

        return gguf.quants.dequantize(np.ascontiguousarray(b), T(ggml_type)).reshape(len(b), -1)

    return decode


# MXFP4 (an E8M0 exponent per 32 E2M1 values) and the i-quants (IQ4_NL/IQ4_XS: a 16-value
# non-linear code; IQ3/IQ2/IQ1: lattice grids with signs), as ggml stores them.
TABLE_TYPES = (T.MXFP4, T.IQ4_XS, T.IQ4_NL, T.IQ3_XXS, T.IQ3_S, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_S, T.IQ1_M)

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
    **{t: _table_decoder(t) for t in TABLE_TYPES},
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
#
# MLX's affine quantization stores ``scale * u + bias`` per group of 32, 64 or 128 values along a
# row, ``u`` unsigned with 2, 3, 4, 5, 6 or 8 bits, the row's values packed as one little-endian
# bit stream into uint32 words (value i at bits i*bits .. i*bits + bits - 1). Most GGML types are
# already that arithmetic over the file's integers (``INTEGER_FORMS``); the others (Q6_K, Q2_K:
# a scale or a min per 16 values) are requantized from their values (``to_affine``).


@dataclass(frozen=True)
class IntegerForm:
    """A GGML type's values written as ``scale * u + bias`` over its own integers ``u``.

    ``split(blocks)`` gives ``u`` (uint8, one row per block) and one float32 ``scale`` and
    ``bias`` per ``group`` values, each computed exactly in float32 from the stored fields.
    ``scale_bits`` is how many significant bits those scales and biases can need: 11 when they
    are a stored float16 times a power of two, 17 when a float16 times a 6-bit sub-block scale,
    so whether a compute dtype holds them exactly is decided before any data is read.
    """

    bits: int
    group: int
    scale_bits: int
    split: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray, np.ndarray]]


def _split_q8_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    return (b[:, 2:34].view(np.int8).astype(np.int16) + 128).astype(np.uint8), d, d * -128


def _split_q4_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    return _nibbles(b[:, 2:18]), d, d * -8


def _split_q4_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _nibbles(b[:, 4:20]), _f16(b, 0), _f16(b, 2)


def _split_q5_0(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d = _f16(b, 0)
    return _q5_ints(b, 2, 6), d, d * -16


def _split_q5_1(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _q5_ints(b, 4, 8), _f16(b, 0), _f16(b, 2)


def _split_k(b: np.ndarray, high_bits: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: scale ``d * sc`` and bias ``-dmin * m`` per 32-value sub-block."""
    sc, mn = _k4_scales(b[:, 4:16])
    return _k_quant_ints(b, high_bits).reshape(len(b), 256), _f16(b, 0) * sc, -(_f16(b, 2) * mn)


def _split_q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _split_k(b, high_bits=False)


def _split_q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    return _split_k(b, high_bits=True)


def _split_q3_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q3_K's values are ``d * sc * (q - 4)``, sc in [-32, 31] and q - 4 in [-4, 3]; the integers
    ``-sc * (q - 4)`` lie in [-128, 124], so ``u = 128 - sc * (q - 4)`` fits 8 bits, with scale
    ``-d`` and bias ``128 d`` for the whole 256-value block."""
    n = len(b)
    hmask = b[:, 0:32].reshape(n, 1, 1, 2, 16)
    qs = b[:, 32:96].reshape(n, 2, 1, 2, 16)
    shifts = (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1, 1)
    low = ((qs >> shifts) & 3).astype(np.int16)
    mask_bit = np.arange(8, dtype=np.uint8).reshape(1, 2, 4, 1, 1)
    signed = low - 4 * (1 - ((hmask >> mask_bit) & 1)).astype(np.int16)
    sc = _q3_k_scales(b[:, 96:108]).astype(np.int16).reshape(n, 2, 4, 2, 1)
    d = _f16(b, 108)
    return (128 - sc * signed).astype(np.uint8).reshape(n, 256), -d, d * 128


def _grid_ints(b: np.ndarray, ggml_type: int, step: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """The integers ``u = values / step + offset`` of a grid type, per 32-value sub-block (``step``
    and ``offset`` (n, 8)): read from the decoded values, which are exact multiples of the step,
    so the grids' tables stay ggml's and gguf-py's."""
    values = DECODERS[ggml_type](b).reshape(len(b), 8, 32)
    safe = np.where(step != 0, step, np.float32(1))[:, :, None]  # a zero factor: zero values, u = offset
    return np.rint(values / safe + offset[:, :, None]).astype(np.uint8).reshape(len(b), 256)


def _split_iq3_s(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IQ3_S's values are ``db * g`` per 32-value sub-block, ``db = d (1 + 2 s)`` with its 4-bit
    scale s (two to a byte of ``scales``, at byte 106) and g an odd integer in [-15, 15] (its grid
    points, 1..15, times a sign): ``u = (g + 15) / 2`` fits 4 bits, scale ``2 db``, bias ``-15 db``."""
    s = b[:, 106:110]
    db = _f16(b, 0) * (1 + 2 * np.stack([s & 0x0F, s >> 4], axis=2).reshape(len(b), 8).astype(np.float32))
    return _grid_ints(b, T.IQ3_S, 2 * db, np.full_like(db, 7.5)), 2 * db, -15 * db


def _split_iq1_s(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """IQ1_S's values are ``dl (g + delta)`` per 32-value sub-block: ``dl = d (2 s + 1)`` with the
    3-bit scale s in bits 12-14 of the sub-block's ``qh`` word (at byte 34), ``delta`` -1/8 or
    1/8 by its bit 15, g in {-1, 0, 1} (the grid's points): ``u = g + 1`` fits 2 bits, scale
    ``dl``, bias ``dl (delta - 1)``."""
    qh = np.ascontiguousarray(b[:, 34:50]).view("<u2")  # (n, 8)
    dl = _f16(b, 0) * (2 * ((qh >> 12) & 7).astype(np.float32) + 1)
    delta = np.where(qh & 0x8000, np.float32(-0.125), np.float32(0.125))
    return _grid_ints(b, T.IQ1_S, dl, 1 - delta), dl, dl * (delta - 1)


INTEGER_FORMS: dict[int, IntegerForm] = {
    T.Q8_0: IntegerForm(8, 32, 11, _split_q8_0),
    T.Q4_0: IntegerForm(4, 32, 11, _split_q4_0),
    T.Q4_1: IntegerForm(4, 32, 11, _split_q4_1),
    T.Q5_0: IntegerForm(5, 32, 11, _split_q5_0),
    T.Q5_1: IntegerForm(5, 32, 11, _split_q5_1),
    T.Q4_K: IntegerForm(4, 32, 17, _split_q4_k),
    T.Q5_K: IntegerForm(5, 32, 17, _split_q5_k),
    T.Q3_K: IntegerForm(8, 256, 11, _split_q3_k),
    T.IQ3_S: IntegerForm(4, 32, 20, _split_iq3_s),  # 2 d (1 + 2 s): 16 bits; 15 d (1 + 2 s): 20
    T.IQ1_S: IntegerForm(2, 32, 19, _split_iq1_s),  # d (2 s + 1): 15 bits; times 7/8 or 9/8: 19
}
# Significant bits of each dtype scales and biases can be kept in (MLX wants the activations' dtype).
DTYPE_BITS = {"float16": 11, "bfloat16": 8, "float32": 24}
AFFINE_CHUNK_VALUES = 1 << 20  # values converted per step: temporaries of a few MiB


def integer_form(ggml_type: int, bits: int, group_size: int) -> IntegerForm | None:
    """The type's own integers as MLX affine with ``bits`` and ``group_size``, if they fit it."""
    form = INTEGER_FORMS.get(ggml_type)
    if form is None or form.bits != bits or form.group % group_size:
        return None
    return form


@dataclass
class AffineBlocks:
    """A GGML matrix as MLX affine quantization: ``weight`` (uint32, packed as MLX packs), and
    ``scales`` / ``biases`` per group, as float32 arrays holding values of the target dtype (so
    casting them in MLX is exact). ``exact``: every value equals the file's dequantized value."""

    weight: np.ndarray  # uint32, (rows, cols * bits / 32)
    scales: np.ndarray  # float32 holding dtype values, (rows, cols / group_size)
    biases: np.ndarray  # the same
    bits: int
    group_size: int
    exact: bool


def pack(u: np.ndarray, bits: int) -> np.ndarray:
    """uint8 values below ``2**bits`` (flat, a multiple of 32 of them) as MLX's uint32 words."""
    if bits == 8:
        return np.ascontiguousarray(u, dtype=np.uint8).view("<u4")
    # Eight values fill exactly ``bits`` bytes of the stream: assemble them in a uint64, keep those bytes.
    eights = u.reshape(-1, 8).astype(np.uint64)
    shifts = (np.arange(8, dtype=np.uint64) * np.uint64(bits))
    words = np.bitwise_or.reduce(eights << shifts, axis=1).astype("<u8")
    return np.ascontiguousarray(words.view(np.uint8).reshape(-1, 8)[:, :bits]).reshape(-1).view("<u4")


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` (float32) rounded to the nearest ``dtype`` value (ties to even), as float32."""
    if dtype == "float16":
        with np.errstate(over="ignore"):  # overflow is inf, which to_affine refuses
            return x.astype(np.float16).astype(np.float32)
    if dtype == "bfloat16":
        bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.astype(np.uint32).view(np.float32)
    return np.asarray(x, dtype=np.float32)


def step_to(x: np.ndarray, dtype: str, up: bool) -> np.ndarray:
    """The next ``dtype`` value above (``up``) or below each ``x`` (already ``dtype`` values)."""
    if dtype in ("float16", "float32"):
        np_type = np.float16 if dtype == "float16" else np.float32
        return np.nextafter(x.astype(np_type), np_type(np.inf if up else -np.inf)).astype(np.float32)
    y = np.ascontiguousarray(x, dtype=np.float32) + np.float32(0)  # -0 becomes +0
    bits = y.view(np.uint32).astype(np.int64)
    away = (y > 0) if up else (y < 0)  # moving away from zero adds one bfloat16 ulp to the magnitude
    bits = np.where(y == 0, 0x00010000 if up else 0x80010000, np.where(away, bits + 0x10000, bits - 0x10000))
    return bits.astype(np.uint32).view(np.float32)


def requantize(values: np.ndarray, bits: int, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """8-, 6-, ... bit affine codes for ``values`` (float32, one group per row), min/max per group.

    The bias is the group's minimum rounded down to ``dtype`` and the scale ``(max - bias) / top``
    rounded up (``top = 2^bits - 1``), so the grid ``bias + scale * [0, top]`` covers every value
    and each one is off by at most ``scale / 2``, the nearest grid point being found in float64.
    With e one ulp of ``dtype`` relative (2^-10 for float16) and t its smallest subnormal:
    ``scale / 2 <= (max - min + e |min| + t) / top * (1 + e) / 2 + t / 2``. Rounding the other way
    (nearest for both) would leave values outside the grid, clipped by more than half a step.
    """
    top = (1 << bits) - 1
    lo, hi = values.min(axis=1, keepdims=True), values.max(axis=1, keepdims=True)
    bias = round_to(lo, dtype)
    high = bias > lo
    bias[high] = step_to(bias[high], dtype, up=False)
    scale = round_to(((hi.astype(np.float64) - bias) / top).astype(np.float32), dtype)
    short = bias.astype(np.float64) + top * scale.astype(np.float64) < hi
    scale[short] = step_to(scale[short], dtype, up=True)
    safe = np.where(scale > 0, scale, np.float32(1)).astype(np.float64)  # float64: the nearest point, no tie slips
    u = np.clip(np.rint((values.astype(np.float64) - bias) / safe), 0, top).astype(np.uint8)
    return u, scale, bias


def to_affine(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...], bits: int, group_size: int,
              dtype: str) -> AffineBlocks | None:
    """The MLX affine form (``bits``, ``group_size``, scales in ``dtype``) of a GGML matrix.

    Where the type's own integers fit (``integer_form``) they are kept and its scales and biases
    rounded once to ``dtype`` (exact when ``dtype`` holds them); otherwise the values are
    requantized per group (``requantize``). Returns None when a scale or bias overflows
    ``dtype``: that tensor has no affine form in it.
    """
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    block_size, type_size = GGML_QUANT_SIZES[T(ggml_type)]
    if cols % group_size or block_size % group_size or cols % block_size:
        raise ValueError(f"{type_name(ggml_type)} rows of {cols} values have no affine form in groups of {group_size}")
    blocks = raw.reshape(-1, type_size)
    form = integer_form(ggml_type, bits, group_size)
    weight = np.empty(rows * cols * bits // 32, dtype=np.uint32)
    scales = np.empty(rows * cols // group_size, dtype=np.float32)
    biases = np.empty_like(scales)
    exact = form is not None
    step = max(1, AFFINE_CHUNK_VALUES // block_size)
    for start in range(0, len(blocks), step):
        chunk = blocks[start:start + step]
        if form is not None:
            u, scale, bias = form.split(chunk)
            repeat = form.group // group_size
            scale32, bias32 = np.repeat(scale, repeat, axis=1), np.repeat(bias, repeat, axis=1)
            scale, bias = round_to(scale32, dtype), round_to(bias32, dtype)
            exact = exact and np.array_equal(scale, scale32) and np.array_equal(bias, bias32)
        else:
            values = DECODERS[ggml_type](chunk).reshape(-1, group_size)
            u, scale, bias = requantize(values, bits, dtype)
        if not (np.isfinite(scale).all() and np.isfinite(bias).all()):
            return None
        v0, g0 = start * block_size, start * block_size // group_size
        weight[v0 * bits // 32:(v0 + u.size) * bits // 32] = pack(u.reshape(-1), bits)
        scales[g0:g0 + scale.size] = scale.reshape(-1)
        biases[g0:g0 + bias.size] = bias.reshape(-1)
    return AffineBlocks(weight.reshape(rows, -1), scales.reshape(rows, -1), biases.reshape(rows, -1),
                        bits, group_size, exact)


# --------------------------------------------------------------------------- MLX mxfp4 form
#
# MLX's ``mxfp4`` quantization mode is the format of ggml's MXFP4 (OCP Microscaling FP4): per
# 32 values one E8M0 exponent (the value 2^(e - 127)) and 4-bit E2M1 codes (sign, 2 exponent
# bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6). Only the order of the codes differs: a
# ggml block holds value j in the low nibble of byte j and value j + 16 in its high nibble, MLX
# packs a row's codes in order, two to a byte, low nibble first.


@dataclass
class Mxfp4Blocks:
    """A GGML MXFP4 matrix in MLX's mxfp4 mode: ``weight`` (uint32, (rows, cols / 8)) and
    ``scales`` (uint8 exponents, (rows, cols / 32)), the file's own codes and exponents."""

    weight: np.ndarray
    scales: np.ndarray


def to_mxfp4(raw: np.ndarray, shape: tuple[int, ...]) -> Mxfp4Blocks | None:
    """The MLX mxfp4 form of an MXFP4 matrix (``raw``: its bytes), exact: every value equals
    ggml's. None when an exponent is 255, E8M0's NaN, which ggml reads as 2^128 and MLX as NaN
    (ggml's quantizer never writes it: float32 weights need at most 253)."""
    rows, cols = int(np.prod(shape[:-1])), shape[-1]
    block_size, type_size = GGML_QUANT_SIZES[T.MXFP4]
    if cols % block_size:
        raise ValueError(f"MXFP4 rows of {cols} values do not fill whole blocks of {block_size}")
    blocks = raw.reshape(-1, type_size)
    if (blocks[:, 0] == 255).any():
        return None
    packed = np.empty((len(blocks), block_size // 2), dtype=np.uint8)
    step = max(1, AFFINE_CHUNK_VALUES // block_size)
    for start in range(0, len(blocks), step):
        codes = _nibbles(blocks[start:start + step, 1:])  # (n, 32) in value order
        packed[start:start + step] = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return Mxfp4Blocks(packed.reshape(-1).view("<u4").reshape(rows, -1),
                       np.ascontiguousarray(blocks[:, 0]).reshape(rows, -1))
