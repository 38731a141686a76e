"""Layers a GGUF stores in another split than mlx-lm's: ``StoredPartsLinear``, ``FusedGateUpSwitchGLU``.

llama.cpp's converter splits some fused projections: Qwen3-Next's ``in_proj_qkvz`` (rows
interleaved per key head: ``[q, k, v, z]`` of head 0, then of head 1, ...) becomes ``attn_qkv``
(every head's q, then every k, then every v) and ``attn_gate`` (every z). mlx-lm's model keeps
the fused layer. An architecture row replaces it before the weights load
(``ArchSpec.prepare_model``) with this layer: one linear layer per stored matrix, loaded like
any other (float, or kept in the file's blocks), whose outputs are concatenated and gathered
into the fused layer's row order. The products are the fused layer's, row for row.

The other way round, Gemma 4's converter keeps the checkpoint's fused expert ``gate_up_proj``
(``ffn_gate_up_exps``) where mlx-lm splits it into ``gate_proj`` and ``up_proj``: the expert
layer becomes one that multiplies the fused matrix once and splits its output.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class StoredPartsLinear(nn.Module):
    """``x @ W^T`` for a weight stored as row blocks ``parts`` (in the file's order); output row r
    of the model is row ``order[r]`` of the parts' concatenated outputs."""

    def __init__(self, input_dims: int, part_rows: list[int], order: np.ndarray) -> None:
        super().__init__()
        if sorted(np.asarray(order).tolist()) != list(range(sum(part_rows))):
            raise ValueError("the row order must name each of the parts' rows once")
        self.parts = [nn.Linear(input_dims, rows, bias=False) for rows in part_rows]
        self._order = mx.array(np.asarray(order, dtype=np.int32))  # "_": not a parameter

    @property
    def row_order(self) -> Any:
        """Output row r of the model is row ``row_order[r]`` of the parts' concatenated outputs
        (the CPU decode runtime gathers them so: runtime/decode_delta.py)."""
        return self._order

    def __call__(self, x: Any) -> Any:
        return mx.take(mx.concatenate([part(x) for part in self.parts], axis=-1), self._order, axis=-1)

    def fused_weight(self) -> Any:
        """The fused layer's weight (its rows in the model's order), for references and tests;
        parts kept in blocks are expanded."""
        from mlxcel_compat.runtime.block_layers import block_weight_of

        rows = [mx.array(block.dequantize()) if (block := block_weight_of(part)) is not None else part.weight
                for part in self.parts]
        return mx.take(mx.concatenate(rows, axis=0), self._order, axis=0)


class FusedGateUpSwitchGLU(nn.Module):
    """mlx-lm's ``SwitchGLU`` (a gated expert MLP) with the gate and up projections as one stored
    matrix ``gate_up_proj`` (experts, 2 * hidden, input): its first half of rows is the gate's."""

    def __init__(self, input_dims: int, hidden_dims: int, num_experts: int, activation: Any) -> None:
        super().__init__()
        from mlx_lm.models.switch_layers import SwitchLinear

        self.gate_up_proj = SwitchLinear(input_dims, 2 * hidden_dims, num_experts, bias=False)
        self.down_proj = SwitchLinear(hidden_dims, input_dims, num_experts, bias=False)
        self.activation = activation

    def __call__(self, x: Any, indices: Any) -> Any:
        x = mx.expand_dims(x, (-2, -3))
        indices = mx.stop_gradient(indices)
        gate, up = mx.split(self.gate_up_proj(x, indices), 2, axis=-1)
        return self.down_proj(self.activation(up, gate), indices).squeeze(-2)

