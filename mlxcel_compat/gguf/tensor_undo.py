"""Undo steps a GGUF architecture row declares per tensor: row and column orders, element-wise maps.

llama.cpp's converter rearranges some tensors for ggml's kernels. Qwen3.5's gated delta-net, for
one, stores its value heads "tiled" (``[k0 v0, k1 v0, ..., k0 v1, k1 v1, ...]``) where the
checkpoint and mlx-lm group them by key head (``[k0 v0, k0 v1, ..., k1 v0, ...]``), and stores
``A_log`` as ``-exp(A_log)``. A row (``arch_spec.ArchSpec.undo``) says, for one mlx-lm
parameter, what gives it back its values (:class:`TensorUndo`); the loader (``gguf/load.py``)
applies it on whichever path the tensor takes:

- row orders everywhere: on the raw block rows before they are expanded, on float rows in MLX,
  and as the row index of a weight kept in its blocks (``BlockWeight.rows``, read in order);
- column orders on float values; a weight kept in its blocks keeps its columns as stored and
  its layer gathers the activations into the stored order instead (``input_order.InputOrderLinear``:
  one gather of a row of activations, where permuting the columns of quantized blocks would need
  requantizing them);
- element-wise maps (``xp`` is ``numpy`` or ``mlx.core``, whichever holds the values) on float
  values only: a tensor that needs one is never kept in blocks or MLX affine form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


@dataclass(frozen=True)
class TensorUndo:
    """What turns one stored tensor back into the mlx-lm parameter's values."""

    rows: np.ndarray | None = None  # model row r is stored row rows[r] (element r of a 1-D tensor)
    columns: np.ndarray | None = None  # model column c is stored column columns[c]
    values: Callable[[Any, Any], Any] | None = None  # (values, xp) -> values, element-wise

    @property
    def float_only(self) -> bool:
        """The tensor's values must be read as floats (an element-wise map cannot act on blocks)."""
        return self.values is not None


def grouped_from_tiled(n_groups: int, per_group: int, width: int = 1) -> np.ndarray:
    """The order that gives back heads grouped by key head from llama.cpp's tiled order.

    Stored entry ``(s * n_groups + g) * width + d`` holds grouped entry ``(g * per_group + s) *
    width + d`` (``g`` a key head, ``s`` one of its ``per_group`` value heads, ``d`` within a head
    of ``width``); the result maps each grouped entry to the stored one."""
    stored = np.arange(n_groups * per_group * width, dtype=np.int32).reshape(per_group, n_groups, width)
    return np.ascontiguousarray(stored.transpose(1, 0, 2).reshape(-1))


def llama_rows(n: int, heads: int) -> np.ndarray:
    """The order that undoes llama.cpp's ``permute`` of a query or key projection's ``n`` rows
    (within each head, the two rotary halves interleaved)."""
    return np.ascontiguousarray(np.arange(n, dtype=np.int32).reshape(heads, n // heads // 2, 2).swapaxes(1, 2).reshape(-1))


def with_offset(order: np.ndarray, before: int) -> np.ndarray:
    """``order`` applied to the entries after the first ``before`` ones, which stay in place."""
    return np.concatenate([np.arange(before, dtype=np.int32), order.astype(np.int32) + before])


def apply(undo: TensorUndo, values: Any, xp: Any) -> Any:
    """Rows, columns and the element-wise map of ``undo`` on float ``values`` (a NumPy or MLX
    array in the stored layout: 1-D, or rows first)."""
    if undo.rows is not None:
        values = xp.take(values, xp.array(undo.rows) if xp is not np else undo.rows, axis=0)
    if undo.columns is not None:
        values = xp.take(values, xp.array(undo.columns) if xp is not np else undo.columns, axis=1)
    if undo.values is not None:
        values = undo.values(values, xp)
    return values
