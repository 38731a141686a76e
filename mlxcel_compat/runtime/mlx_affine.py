"""MLX affine-quantized weights (mlx-community directories) repacked into ggml blocks for the CPU.

Why: MLX's own quantized matmul is ~40x slower than a float32 one on the CPU, and expanding the
weights to float32 costs 6-8x the directory in memory. ggml's block formats hold the same
numbers: an MLX affine weight is ``w = scale * q + bias`` per group of ``group_size`` inputs,
``q`` an unsigned ``bits``-bit integer, and two ggml types have exactly that shape per block of
32 values. So at load each quantized layer is rewritten, in NumPy, into blocks that the block
layers (``block_layers.py``) and the CPU decode runtime multiply by ggml's kernels, like a
quantized GGUF's:

- **2, 3 and 4 bits -> Q4_1** (per 32 values: ``d`` = scale, ``m`` = bias as float16, and 16
  bytes of nibbles, byte j holding value j in its low nibble and value j + 16 in its high one).
  ggml expands a value as ``q * d + m``: the same product and sum MLX computes, so the values
  are bit-exact whenever the scales and biases are float16 values. A 2- or 3-bit integer is just
  a nibble with its top bits clear.
- **5, 6 and 8 bits -> Q8_0 plus a bias per group** (``BlockWeight.group_bias``): the integers
  minus ``o = 2 ** (bits - 1)`` as int8, ``d`` = scale, and per MLX group the float32 bias
  ``bias + o * scale``. ``(q - o) * d`` is exact, so the expansion ``(q - o) * d + group_bias``
  is bit-exact whenever ``bias + o * scale`` is a float32 value (always for float16 scales and
  biases whose exponents are within 13 of each other: every real model; counted in
  :attr:`AffineLoad.inexact` otherwise, then within one float32 rounding). Centring the integers
  halves what quantizing the activations to 8 bits (ggml's Q8_0 vec_dot) costs next to using
  them as they are; the group biases meet the exact input sums.

Group sizes 32, 64 and 128 all fit: a group of 64 or 128 is 2 or 4 blocks with the same scale.
Exact in float16 means: the directory's scales and biases (bfloat16 in most mlx-community
directories, float16 in others) survive a round trip through float16; a bfloat16 value does
unless it is tiny (below 2 ** -24, or a subnormal of float16 with more than its bits) or huge.

A scale that multiplies only zero integers is replaced by 0 (MLX gives a group of equal values,
such as an all-zero row, the scale -1e-7, which float16 cannot hold). Anything else (another
mode such as mxfp4, a group size that is not a multiple of 32, scales or biases that are not
float16 values, e.g. a float32 directory) is expanded to float32 by
``mx.dequantize``, and the start-up log says which tensors and why. Bytes: Q4_1 takes 5 bits a
weight (an MLX 4-bit directory 4.5 at group 64, 4.25 at 128), Q8_0 8.5 plus 32 / group_size
for the group biases (MLX 8-bit: 8.5 at group 64).

The repacking is whole-array NumPy over slices of rows (:data:`CHUNK_VALUES` values at a time,
so the temporaries stay small next to the weight), on the engine thread at load.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from math import gcd
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T

from mlxcel_compat.runtime import block_layers
from mlxcel_compat.runtime.block_weight import BlockLibrary, BlockWeight, row_bytes, split_rows

AFFINE = "affine"
BLOCK = 32  # values per ggml block (Q4_1, Q8_0)
NIBBLE_BITS = frozenset({2, 3, 4})  # -> Q4_1
BYTE_BITS = frozenset({5, 6, 8})  # -> Q8_0 + group biases
CHUNK_VALUES = 1 << 22  # values repacked at a time (a slice of whole rows)

# The block layouts (ggml-common.h): block_q4_1 and block_q8_0.
_Q4_1 = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (16,))])
_Q8_0 = np.dtype([("d", "<f2"), ("qs", "u1", (32,))])
assert _Q4_1.itemsize == 20 and _Q8_0.itemsize == 34


@dataclass(frozen=True)
class Repacked:
    """One weight in ggml's blocks: what a :class:`BlockWeight` is built from."""

    data: np.ndarray  # uint8 (n, row bytes)
    ggml_type: int  # T.Q4_1 or T.Q8_0
    group_bias: np.ndarray | None  # float32 (n, k / group_size) for Q8_0, else None
    bias_group: int  # inputs per group bias (the MLX group size), or 0
    exact: bool  # expands bit for bit to MLX's float32 dequantization


def block_type(bits: int, group_size: int, mode: str = AFFINE) -> int | str:
    """The ggml type an MLX quantized weight of these parameters is repacked into, or why none."""
    if mode != AFFINE:
        return f"mode {mode} has no block form here (only affine)"
    if group_size % BLOCK:
        return f"group size {group_size} is not a multiple of {BLOCK}"
    if bits in NIBBLE_BITS:
        return T.Q4_1
    if bits in BYTE_BITS:
        return T.Q8_0
    return f"{bits}-bit integers have no block form here"


def _as_float16(values: np.ndarray) -> np.ndarray | None:
    """``values`` (float32) as float16 if every one is a float16 value, else None."""
    half = values.astype(np.float16)
    return half if np.array_equal(half.astype(np.float32), values) else None


def _scales_as_float16(scales: np.ndarray, weight: np.ndarray, bits: int, group_size: int) -> np.ndarray | None:
    """The scales as float16 if each one that is used is a float16 value, else None.

    MLX gives a group of equal values (all zeros, a padded row) a scale of -1e-7 and integers
    0: that scale is no float16 value, but it multiplies only zeros, so it is replaced by 0
    (``0 * s + b`` is ``b`` either way). Only the rows holding such scales are unpacked."""
    half = scales.astype(np.float16)
    bad = half.astype(np.float32) != scales
    if not bad.any():
        return half
    rows = np.flatnonzero(bad.any(axis=1))
    n_groups = scales.shape[1]
    used = _unpack(weight[rows], bits, n_groups * group_size).reshape(len(rows), n_groups, group_size).any(axis=-1)
    if (bad[rows] & used).any():
        return None
    half[rows] = np.where(bad[rows], np.float16(0), half[rows])
    return half


def _unpack(packed: np.ndarray, bits: int, k: int) -> np.ndarray:
    """MLX's packed integers, uint8 (rows, k). MLX writes each row as one little-endian bit
    stream, values from the least significant bits up (checked against ``mx.dequantize`` by
    the tests for every width): ``pack`` bytes hold ``per_pack`` whole values."""
    rows = packed.shape[0]
    raw = packed.view(np.uint8).reshape(rows, -1)
    if bits == 8:
        return raw
    pack = bits // gcd(bits, 8)  # 1 byte (2, 4 bits), 3 (3, 6 bits) or 5 (5 bits)
    per_pack = 8 * pack // bits
    word_type = np.uint8 if pack == 1 else np.uint32 if pack <= 4 else np.uint64
    groups = raw.reshape(rows, -1, pack)
    word = groups[..., 0].astype(word_type)
    for i in range(1, pack):
        word |= groups[..., i].astype(word_type) << word_type(8 * i)
    values = np.empty((rows, groups.shape[1], per_pack), dtype=np.uint8)
    mask = word_type((1 << bits) - 1)
    for j in range(per_pack):
        values[..., j] = (word >> word_type(bits * j)) & mask
    return values.reshape(rows, k)


def _q4_1_nibbles(packed: np.ndarray, bits: int, k: int, out: np.ndarray) -> None:
    """Fill ``out`` (rows, k / 32, 16) with ggml's nibbles of MLX's packed integers."""
    rows = packed.shape[0]
    if bits == 4:
        # Byte t of a 32-value group holds values 2t (low nibble) and 2t + 1 (high nibble);
        # ggml's byte j wants values j and j + 16: bytes u and 8 + u give ggml's 2u and 2u + 1.
        b = packed.view(np.uint8).reshape(rows, k // BLOCK, 16)
        lo, hi = b[..., :8], b[..., 8:]
        out[..., 0::2] = (lo & 0x0F) | (hi << 4)
        out[..., 1::2] = (lo >> 4) | (hi & 0xF0)
        return
    v = _unpack(packed, bits, k).reshape(rows, k // BLOCK, 2, 16)
    out[...] = v[:, :, 0] | (v[:, :, 1] << 4)


def repack(weight: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group_size: int,
           mode: str = AFFINE) -> Repacked | str:
    """MLX's quantized ``weight`` (uint32 (n, k * bits / 32)) with float32 ``scales`` and
    ``biases`` (n, k / group_size) as ggml blocks, or why it has no exact block form."""
    target = block_type(bits, group_size, mode)
    if isinstance(target, str):
        return target
    if sys.byteorder != "little":  # MLX's words and ggml's blocks are read as little-endian bytes
        return "a big-endian machine"
    n, groups = scales.shape
    k = groups * group_size
    if weight.dtype != np.uint32 or weight.shape != (n, k * bits // 32) or biases.shape != scales.shape:
        return f"unexpected shapes: weight {weight.shape} {weight.dtype}, scales {scales.shape}, biases {biases.shape}"
    weight = np.ascontiguousarray(weight)
    scales = np.ascontiguousarray(scales, dtype=np.float32)
    biases = np.ascontiguousarray(biases, dtype=np.float32)
    d = _scales_as_float16(scales, weight, bits, group_size)
    if d is None:
        return "scales are not float16 values (ggml's blocks hold float16 scales)"
    scales = d.astype(np.float32)  # the same values, with unused ones zeroed
    per_group = group_size // BLOCK
    if target == T.Q4_1:
        m = _as_float16(biases)
        if m is None:
            return "biases are not float16 values (Q4_1 blocks hold float16 minimums)"
        group_bias, exact = None, True
    else:
        offset = np.float32(1 << (bits - 1))
        group_bias = biases + offset * scales
        exact = bool(np.array_equal(group_bias.astype(np.float64),
                                    biases.astype(np.float64) + float(offset) * scales.astype(np.float64)))
    layout = _Q4_1 if target == T.Q4_1 else _Q8_0
    blocks = np.empty((n, k // BLOCK), dtype=layout)
    step = max(1, CHUNK_VALUES // max(k, 1))
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        part, packed = blocks[r0:r1], weight[r0:r1]
        part["d"] = np.repeat(d[r0:r1], per_group, axis=1)
        if target == T.Q4_1:
            part["m"] = np.repeat(m[r0:r1], per_group, axis=1)
            _q4_1_nibbles(packed, bits, k, part["qs"])
        else:  # q - offset wraps in uint8 to the int8 bytes of the centred integer
            part["qs"] = (_unpack(packed, bits, k) - np.uint8(1 << (bits - 1))).reshape(r1 - r0, k // BLOCK, BLOCK)
    data = blocks.view(np.uint8).reshape(n, -1)
    assert data.shape[1] == row_bytes(target, k)
    return Repacked(data, target, group_bias, group_size if group_bias is not None else 0, exact)


# ---------------------------------------------------------------------------------- the model


@dataclass
class AffineLoad:
    """What the start-up log says about a quantized directory's weights on the CPU.

    ``precision`` / ``weight_bytes`` / ``kernels`` use the GGUF path's labels (``blocks q4_1``,
    ``float32``); ``sources`` says which MLX parameters each label came from.
    """

    precision: dict[str, int] = field(default_factory=dict)  # label -> tensors
    weight_bytes: dict[str, int] = field(default_factory=dict)  # label -> bytes they take now
    kernels: dict[str, str] = field(default_factory=dict)  # label -> what computes with them
    sources: dict[str, set[str]] = field(default_factory=dict)  # label -> {"affine 4-bit, group 64"}
    expanded: dict[str, list[str]] = field(default_factory=dict)  # why -> module paths, expanded to float32
    kept: dict[str, list[str]] = field(default_factory=dict)  # module class -> paths left to MLX
    inexact: int = 0  # Q8_0 tensors whose group biases round once in float32
    source_bytes: int = 0  # bytes the quantized tensors took as loaded (integers, scales, biases)
    compute_dtype: str = "float32"

    def count(self, label: str, nbytes: int, source: str, kernel: str) -> None:
        self.precision[label] = self.precision.get(label, 0) + 1
        self.weight_bytes[label] = self.weight_bytes.get(label, 0) + nbytes
        self.sources.setdefault(label, set()).add(source)
        self.kernels.setdefault(label, kernel)

    @property
    def fingerprint(self) -> dict[str, Any]:
        """How the weights are kept, for ``model_fingerprint``: KV computed from blocks differs
        from KV computed by MLX's quantized matmul."""
        return {"precision": dict(sorted(self.precision.items())), "compute": self.compute_dtype}


def _numpy(a: Any) -> np.ndarray:
    import mlx.core as mx

    if a.dtype in (mx.float16, mx.bfloat16):
        a = a.astype(mx.float32)  # NumPy has no bfloat16; widening is exact
    mx.eval(a)
    return np.asarray(a)


def _expand(module: Any) -> Any:
    """The float32 ``nn.Linear`` / ``nn.Embedding`` of a quantized module (``mx.dequantize`` with
    its scales and biases in float32: the values MLX's own layer multiplies by)."""
    import mlx.core as mx
    import mlx.nn as nn

    def wide(a: Any) -> Any:
        return a.astype(mx.float32) if a is not None and a.dtype in (mx.float16, mx.bfloat16) else a

    extra = {"global_scale": module["global_scale"]} if "global_scale" in module else {}
    weight = mx.dequantize(module.weight, wide(module.scales), wide(module.get("biases")), module.group_size,
                           module.bits, module.mode, dtype=mx.float32, **extra)
    mx.eval(weight)
    n, k = weight.shape
    if isinstance(module, nn.QuantizedEmbedding):
        new = nn.Embedding(n, k)
    else:
        new = nn.Linear(k, n, bias="bias" in module)
        if "bias" in module:
            new.bias = module.bias
    new.weight = weight
    return new


def serve(model: Any, lib: BlockLibrary) -> AffineLoad:
    """Replace every ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding`` of ``model`` by a block
    layer over its repacked weight, or by a float32 layer where it has no block form; other
    quantized modules (e.g. mixture-of-experts switch layers) stay MLX's and are listed.

    One module at a time: its arrays are evaluated (read from the directory when the model was
    loaded lazily), repacked and dropped before the next, so the peak stays near the final
    weights. Biases of linear layers stay (MLX arrays in the block layer).
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    summary = AffineLoad()
    paths = []
    for path, module in model.named_modules():
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            paths.append(path)
        elif type(module).__name__.startswith("Quantized"):
            summary.kept.setdefault(type(module).__name__, []).append(path)
    for path in paths:
        module = block_layers.module_at(model, path)
        bits, group, mode = module.bits, module.group_size, module.mode
        source = f"{mode} {bits}-bit, group {group}"
        arrays = [a for a in (module.weight, module.scales, module.get("biases")) if a is not None]
        mx.eval(arrays)
        summary.source_bytes += sum(a.nbytes for a in arrays)
        target = block_type(bits, group, mode)
        if not isinstance(target, str):
            target = repack(np.asarray(module.weight), _numpy(module.scales), _numpy(module.biases), bits, group, mode)
        if isinstance(target, str):
            new = _expand(module)
            model.update_modules(tree_unflatten([(path, new)]))
            summary.expanded.setdefault(f"{source}: {target}", []).append(path)
            summary.count("float32", new.weight.nbytes, source, "MLX float32 (expanded at load)")
            continue
        n, k = module.weight.shape[0], module.weight.shape[1] * 32 // bits
        weight = BlockWeight(target.data, target.ggml_type, n, k, lib, group_bias=target.group_bias,
                             bias_group=target.bias_group, float_prompts=True)
        split_rows(weight)  # a 4-bit weight's Q4_1 rows, for the shim's own kernel (block_weight.py)
        block_layers.install(model, path, weight)
        summary.inexact += not target.exact
        kernel = lib.describe(target.ggml_type, weight.split) + (" + group biases" if target.group_bias is not None else "")
        summary.count(f"blocks {T(target.ggml_type).name.lower()}", weight.nbytes, source, kernel)
        del module, arrays, target, weight
    return summary


__all__ = ["AFFINE", "AffineLoad", "Repacked", "block_type", "repack", "serve"]
