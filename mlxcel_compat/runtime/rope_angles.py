"""The RoPE angles of the CPU decode runtime (``cpu_decode.CpuDecoder``): cos and sin tables of
every position its rows sit at, made by the model's own RoPE modules and handed to the C pass by
address.

Why the modules themselves: each is applied to unit vectors (rotating (1, 0) gives (cos, sin)) for
a block of positions at a time, so every scaling variant mlx-lm implements is taken as it is, and
the C loop's rotation multiplies by exactly the numbers MLX's would.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

ANGLE_BLOCK = 256  # RoPE angles are computed by MLX for this many positions at a time
ANGLE_BLOCKS_KEPT = 64  # blocks of angles kept (a batch's rows sit at different positions)


class RopeAngles:
    """The cos and sin blocks of a decoder's RoPE modules, one module per layer kind (``kind``: an
    index into ``ropes``; gemma3's sliding layers have their own base), made ``ANGLE_BLOCK``
    positions at a time and kept while there are at most ``ANGLE_BLOCKS_KEPT`` a kind."""

    def __init__(self, ropes: list[Any], head_dim: int) -> None:
        self.ropes = ropes
        self.traditional = [bool(getattr(rope, "traditional", False)) for rope in ropes]  # None: no rotation
        self.head_dim = head_dim
        self.blocks: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}  # (kind, first position) -> (cos, sin)

    def forget_if_many(self) -> None:
        """Drop every block once there are more than ``ANGLE_BLOCKS_KEPT`` a kind: call it between
        passes, when no address handed out before is in use."""
        if len(self.blocks) > ANGLE_BLOCKS_KEPT * len(self.ropes):
            self.blocks.clear()

    def span(self, first: int, rows: int, kind: int) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin of positions ``first`` .. ``first + rows - 1`` (rows, head_dim / 2) each,
        contiguous: a prompt chunk's angles for one ``rope_rows`` call."""
        parts = []
        for pos in range(first - first % ANGLE_BLOCK, first + rows, ANGLE_BLOCK):
            self.row(pos, kind)  # makes the block
            cos, sin = self.blocks[(kind, pos)]
            lo, hi = max(first - pos, 0), min(first + rows - pos, ANGLE_BLOCK)
            parts.append((cos[lo:hi], sin[lo:hi]))
        return np.concatenate([c for c, _ in parts]), np.concatenate([s for _, s in parts])

    def row(self, pos: int, kind: int = 0) -> tuple[int, int]:
        """Addresses of cos and sin of position ``pos``'s RoPE angles, as the model's RoPE module
        of this ``kind`` (an index into ``ropes``) computes them: it is applied to unit vectors
        (rotating (1, 0) gives (cos, sin)) for a block of positions at a time, so every scaling
        variant mlx-lm implements is taken as it is. The blocks stay until there are more than
        ``ANGLE_BLOCKS_KEPT`` a kind (rows of a batch sit at different positions)."""
        first = pos - pos % ANGLE_BLOCK
        block = self.blocks.get((kind, first))
        if block is None:
            d, half, traditional = self.head_dim, self.head_dim // 2, self.traditional[kind]
            unit = np.zeros((1, 1, ANGLE_BLOCK, d), np.float32)
            if traditional:
                unit[..., 0::2] = 1.0
            else:
                unit[..., :half] = 1.0
            rope = self.ropes[kind]  # None: a layer without RoPE (angles 0)
            probe = unit[0, 0] if rope is None else np.array(rope(mx.array(unit), offset=first))[0, 0]
            if traditional:
                cos, sin = probe[:, 0::2], probe[:, 1::2]
            else:
                cos, sin = probe[:, :half], probe[:, half:]
            block = self.blocks[(kind, first)] = (np.ascontiguousarray(cos), np.ascontiguousarray(sin))
        cos, sin = block
        row = (pos - first) * cos.strides[0]
        return cos.ctypes.data + row, sin.ctypes.data + row


__all__ = ["ANGLE_BLOCK", "ANGLE_BLOCKS_KEPT", "RopeAngles"]
