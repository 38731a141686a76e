"""ggml's q8_0 and q4_0 blocks as MLX arrays: the KV cache's storage at ``-ctk``/``-ctv q8_0`` and
``q4_0`` (``kv_precision.py``).

A row of ``head_dim`` values is ``head_dim / 32`` blocks, each an f16 scale and 32 values: int8
(q8_0, 34 bytes a block) or 4-bit values offset by 8, value j in the low nibble of byte j and
value j + 16 in the high one (q4_0, 18 bytes). A cache layer holds its rows as ``uint8`` arrays
of shape ``(B, heads, positions, head_dim / 32 * bytes)``, so mlx-lm's caches, their batch forms,
the prompt cache and the disk format slice, merge and save them as they do any KV array.

Why the same blocks as the CPU decode runtime's, not mlx-lm's
``QuantizedKVCache``: MLX's prefill and the runtime's steps share one cache (a prompt written by
MLX is decoded by the runtime, a hit's entry is read by both), so both must store and read the
same bytes; mlx-lm's affine groups (a scale *and* a bias per group, other rounding) are not
llama.cpp's format and would be a second kind of cache to every consumer. MLX's attention then
reads the rows dequantized (:func:`dequantize`), as ggml's flash attention dequantizes V.

Quantization rounds as ggml's reference quantizers (``quantize_row_q8_0_ref``,
``quantize_row_q4_0_ref``): q8_0's scale is the block's largest magnitude over 127 and each value
``x * (1 / scale)`` rounded half away from zero; q4_0's scale is the value of largest magnitude
(the first such) over -8 and each value ``x * (1 / scale) + 8.5`` truncated, at most 15. On the
CPU the decode runtime's native kernels give the same bytes (tests/runtime/test_cpu_decode_kvq.py).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

QK = 32  # values a block
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}


def row_width(kind: str, head_dim: int) -> int:
    """The bytes (uint8 elements) a stored row of ``head_dim`` values takes."""
    if head_dim % QK:
        raise ValueError(f"{kind} KV needs a head size that is a multiple of {QK} (this model's is {head_dim})")
    return head_dim // QK * BLOCK_BYTES[kind]


def kind_of(width: int, head_dim: int) -> str | None:
    """Which block type a uint8 row of ``width`` bytes holding ``head_dim`` values is (None: neither)."""
    for kind, size in BLOCK_BYTES.items():
        if head_dim % QK == 0 and width == head_dim // QK * size:
            return kind
    return None


def quantize(x: Any, kind: str) -> Any:
    """Rows of ``x`` (..., head_dim) as ``kind``'s blocks (..., head_dim / 32 * bytes), uint8."""
    lead, d = x.shape[:-1], x.shape[-1]
    row_width(kind, d)
    b = x.astype(mx.float32).reshape(*lead, d // QK, QK)
    if kind == "q8_0":
        amax = mx.abs(b).max(axis=-1, keepdims=True)
        scale = amax / 127.0
        inv = mx.where(scale != 0, 1.0 / scale, 0.0)
        x0 = b * inv
        t = mx.trunc(x0)
        q = t + mx.sign(x0) * (mx.abs(x0 - t) >= 0.5)  # roundf: half away from zero
        body = q.astype(mx.int8).view(mx.uint8)
    else:
        mags = mx.abs(b)
        first = mx.where(mags == mags.max(axis=-1, keepdims=True), mx.arange(QK), QK).min(axis=-1, keepdims=True)
        scale = mx.take_along_axis(b, first, axis=-1) / -8.0
        inv = mx.where(scale != 0, 1.0 / scale, 0.0)
        q = mx.minimum(mx.trunc(b * inv + 8.5), 15).astype(mx.uint8)
        body = q[..., : QK // 2] | (q[..., QK // 2:] << 4)
    head = scale.astype(mx.float16).view(mx.uint8)
    return mx.concatenate([head, body], axis=-1).reshape(*lead, d // QK * BLOCK_BYTES[kind])


def dequantize(blocks: Any, kind: str, dtype: Any = mx.float32) -> Any:
    """``kind``'s blocks (..., width) as values (..., width / bytes * 32) of ``dtype``: each
    value times its block's scale, in float32."""
    lead, width = blocks.shape[:-1], blocks.shape[-1]
    n = width // BLOCK_BYTES[kind]
    b = blocks.reshape(*lead, n, BLOCK_BYTES[kind])
    scale = b[..., :2].view(mx.float16).astype(mx.float32)
    if kind == "q8_0":
        q = b[..., 2:].view(mx.int8).astype(mx.float32)
    else:
        body = b[..., 2:]
        q = mx.concatenate([body & 15, body >> 4], axis=-1).astype(mx.float32) - 8.0
    return (q * scale).reshape(*lead, n * QK).astype(dtype)


__all__ = ["BLOCK_BYTES", "QK", "dequantize", "kind_of", "quantize", "row_width"]
