"""An MoE layer's stacked experts kept in ggml's blocks, and the layer that multiplies only the chosen ones.

llama.cpp's converter stacks a layer's experts into one tensor per projection
(``blk.N.ffn_{gate,up,down}_exps``, ``[n_expert, rows, cols]``). In the file, expert ``e``'s
matrix is a contiguous run of rows of one ``(n_expert * rows, cols)`` block weight, so the stack
is served like any linear weight (``block_weight.py``): a view of the memory-mapped file,
nothing copied, nothing expanded. A 30B-A3B Q4_K_M file then takes its own ~17 GB, where the
experts expanded to float32 for MLX's gather matmul would take ~120 GB.

:class:`BlockSwitchLinear` takes the place of mlx-lm's ``SwitchLinear`` (the projections of its
``SwitchGLU`` and ``SwitchMLP``, and of the loader's fused gate-up layer), so the families'
routers, top-k, gating, activations (SwiGLU, gpt-oss's clamped SwiGLU, GeGLU, ReLU²) and the
weighted sum stay mlx-lm's code: only ``mx.gather_mm``'s product changes. A call evaluates its
input and the chosen indices, sorts the (token, expert) pairs by expert (ggml's ``mul_mat_id``)
and hands the native layer's ``mlxcel_expert_matmul`` one group of activation rows per chosen
expert: each chosen expert's rows are read once for all the tokens that chose it, and no other
expert's are read.

Every row takes the decode path of the block products (activations quantized to the type's
``vec_dot_type``, llama.cpp's arithmetic), in a prompt chunk as in a decode step, and a row's
result does not depend on the other rows of its group: a token's expert outputs are the same
whatever else shares the chunk or the batch, which keeps prompt-cache hits equal to cold runs.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxcel_compat.runtime.block_weight import BlockLibrary, BlockWeight

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long


@lru_cache(maxsize=1)
def _expert_matmul() -> Any:
    """The shim's ``mlxcel_expert_matmul``, or None when the loaded shim lacks it."""
    from mlxcel_compat.runtime import backend

    shim = backend.matmul_shim()
    fn = getattr(shim.lib, "mlxcel_expert_matmul", None) if shim is not None else None
    if fn is not None:
        fn.restype = _I
        fn.argtypes = [_P, _I, _I, _P, _P, _P, _L, _P, _L]
    return fn


def describe(lib: BlockLibrary, ggml_type: int) -> str:
    """What the start-up log says computes a stack of experts of this type."""
    own = "mlxcel's AVX-512 kernel" if int(ggml_type) in lib.own_kernels else "ggml's vec_dot"
    return (f"{lib.ggml.describe(ggml_type)}; only the chosen experts' rows, grouped by expert as ggml's mul_mat_id "
            f"(mlxcel_expert_matmul: activations quantized as for decode, rows by {own}), prompts and decode alike")


def available() -> bool:
    """Whether expert stacks can be served from their blocks (the shim has the grouped product)."""
    return _expert_matmul() is not None


@dataclass(eq=False)
class ExpertStack:
    """``n_expert`` matrices of ``rows`` x ``weight.k``, expert ``e`` being rows ``e * rows`` ..
    ``(e + 1) * rows - 1`` of ``weight``."""

    weight: BlockWeight
    n_expert: int

    def __post_init__(self) -> None:
        if self.n_expert <= 0 or self.weight.n % self.n_expert:
            raise ValueError(f"{self.weight.n} rows do not split into {self.n_expert} experts")
        if self.weight.rows is not None or self.weight.group_bias is not None:
            raise ValueError("an expert stack's rows are read as stored")

    @property
    def rows(self) -> int:
        return self.weight.n // self.n_expert

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.n_expert, self.rows, self.weight.k)

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes

    def grouped_matmul(self, x: np.ndarray, experts: np.ndarray, starts: np.ndarray) -> np.ndarray:
        """``x`` (m, k) float32 rows grouped by expert: rows ``starts[g]`` .. ``starts[g + 1] - 1``
        times expert ``experts[g]``'s matrix transposed; (m, rows) float32."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        experts = np.ascontiguousarray(experts, dtype=np.int32)
        starts = np.ascontiguousarray(starts, dtype=np.int32)
        if x.ndim != 2 or x.shape[1] != self.weight.k:
            raise ValueError(f"activations of shape {x.shape} do not have {self.weight.k} columns")
        if starts.shape != (experts.size + 1,) or starts[0] != 0 or starts[-1] != x.shape[0]:
            raise ValueError("group starts must run from 0 to the row count")
        out = np.empty((x.shape[0], self.rows), dtype=np.float32)
        status = _expert_matmul()(self.weight.address, self.rows, experts.size, experts.ctypes.data,
                                  starts.ctypes.data, x.ctypes.data, self.weight.k, out.ctypes.data, self.rows)
        if status:
            raise ValueError(f"expert ids must be in 0..{self.n_expert - 1}")
        return out

    def dequantize(self) -> np.ndarray:
        """The whole stack as float32 (n_expert, rows, k): for tests and references only."""
        return self.weight.dequantize().reshape(self.shape)


def gather_product(stack: ExpertStack, x: np.ndarray, indices: np.ndarray, bias: np.ndarray | None = None
                   ) -> np.ndarray:
    """``mx.gather_mm(x, W.swapaxes(-1, -2), rhs_indices=indices)`` (+ ``bias[indices]``) over the
    stack: ``x`` (*bx, M, k), ``indices`` (*bi) broadcast together to the batch (*S), each
    batch entry's M rows times its expert's matrix: (*S, M, rows)."""
    *bx, m, k = x.shape
    batch = np.broadcast_shapes(tuple(bx), indices.shape)
    source = np.broadcast_to(np.arange(int(np.prod(bx, dtype=np.int64))).reshape(bx), batch).reshape(-1)
    chosen = np.broadcast_to(indices, batch).reshape(-1).astype(np.int32)
    order = np.argsort(chosen, kind="stable")  # each expert's pairs together, as ggml's mul_mat_id
    experts, counts = np.unique(chosen[order], return_counts=True)
    starts = np.zeros(experts.size + 1, dtype=np.int32)
    np.cumsum(counts * m, out=starts[1:])
    rows = (source[order][:, None] * m + np.arange(m)).reshape(-1)
    sorted_out = stack.grouped_matmul(x.reshape(-1, k)[rows], experts, starts)
    if bias is not None:
        sorted_out += np.repeat(bias[chosen[order]], m, axis=0)
    out = np.empty((chosen.size, m, stack.rows), dtype=np.float32)
    out[order] = sorted_out.reshape(-1, m, stack.rows)
    return out.reshape(*batch, m, stack.rows)


class BlockSwitchLinear(nn.Module):
    """mlx-lm's ``SwitchLinear`` over an :class:`ExpertStack` (a bias, gpt-oss's, stays an MLX
    array of (n_expert, rows))."""

    def __init__(self, stack: ExpertStack, bias: Any = None) -> None:
        super().__init__()
        self.block = stack.weight  # not an mx.array: not a parameter
        self.stack = stack
        if bias is not None:
            self.bias = bias

    @property
    def input_dims(self) -> int:
        return self.stack.weight.k

    @property
    def output_dims(self) -> int:
        return self.stack.rows

    @property
    def num_experts(self) -> int:
        return self.stack.n_expert

    def __call__(self, x: Any, indices: Any, sorted_indices: bool = False) -> Any:
        try:
            mx.eval(x, indices)
        except ValueError as exc:  # inside an mx.compile trace
            raise RuntimeError("a block-format weight cannot be used inside mx.compile") from exc
        values = np.asarray(x.astype(mx.float32) if x.dtype != mx.float32 else x)
        bias = None
        if "bias" in self:
            bias = self.bias.astype(mx.float32) if self.bias.dtype != mx.float32 else self.bias
            mx.eval(bias)
            bias = np.asarray(bias)
        return mx.array(gather_product(self.stack, values, np.asarray(indices), bias))

    def _extra_repr(self) -> str:
        return (f"input_dims={self.input_dims}, output_dims={self.output_dims}, num_experts={self.num_experts}, "
                f"type={self.block.ggml_type}")


def install(model: Any, path: str, stack: ExpertStack) -> BlockSwitchLinear:
    """Replace the ``SwitchLinear`` at ``path`` (``model.layers.0.mlp.switch_mlp.up_proj``) with
    its block form over ``stack``; its bias, if any, stays (loaded later by name)."""
    *parents, last = path.split(".")
    parent = model
    for part in parents:
        parent = parent[int(part)] if isinstance(parent, list) else getattr(parent, part)
    old = parent[int(last)] if isinstance(parent, list) else getattr(parent, last)
    if type(old).__name__ != "SwitchLinear":
        raise TypeError(f"{path} is a {type(old).__name__}, not a stacked-expert linear layer")
    if tuple(old.weight.shape[:2]) != (stack.n_expert, stack.rows) or old.input_dims != stack.weight.k:
        raise ValueError(f"{path} holds {tuple(old.weight.shape)} experts; the stack is {stack.shape}")
    new = BlockSwitchLinear(stack, old.bias if "bias" in old else None)
    if isinstance(parent, list):
        parent[int(last)] = new
    else:
        setattr(parent, last, new)
    return new


__all__ = ["BlockSwitchLinear", "ExpertStack", "available", "describe", "gather_product", "install"]
