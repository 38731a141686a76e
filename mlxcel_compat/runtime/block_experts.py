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
and hands the native layer's ``mlxcel_expert_matmul_shared`` one group of pairs per chosen
expert, each pair pointing at its token's row (quantized once for all that token's experts):
each chosen expert's rows are read once for all the tokens that chose it, and no other expert's
are read. A ``SwitchGLU`` whose gate and up are block stacks becomes a :class:`BlockSwitchGLU`:
one sort for the layer's three products, gate and up in one native call, two MLX evaluations.

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
from mlx_lm.models.switch_layers import SwitchGLU

from mlxcel_compat.runtime.block_weight import BlockLibrary, BlockWeight

_P, _I, _L = ctypes.c_void_p, ctypes.c_int, ctypes.c_long


@lru_cache(maxsize=1)
def _expert_matmul() -> Any:
    """The shim's ``mlxcel_expert_matmul_shared``, or None when the loaded shim lacks it."""
    from mlxcel_compat.runtime import backend

    shim = backend.matmul_shim()
    fn = getattr(shim.lib, "mlxcel_expert_matmul_shared", None) if shim is not None else None
    if fn is not None:
        fn.restype = _I
        fn.argtypes = [_I, _P, _I, _I, _P, _P, _P, _I, _P, _L, _P, _L]
    return fn


def describe(lib: BlockLibrary, ggml_type: int) -> str:
    """What the start-up log says computes a stack of experts of this type."""
    kind = int(ggml_type)
    apart = "over rows split at load" if kind in lib.split_kinds else "over its rows"
    if kind in lib.grouped_kinds:
        own = f"mlxcel's AVX-512 lanes over rows grouped at load where each expert is whole groups of 16, else {apart}"
    elif kind in lib.split_kinds or kind in lib.own_kernels:
        own = f"mlxcel's AVX-512 kernel {apart}"
    else:
        own = "ggml's vec_dot"
    return (f"{lib.ggml.describe(ggml_type)}; only the chosen experts' rows, grouped by expert as ggml's mul_mat_id "
            f"(mlxcel_expert_matmul_shared: each token's activations quantized once as for decode, gate and up in one pass, rows by {own}), prompts and decode alike")


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

    def grouped_matmul(self, x: np.ndarray, experts: np.ndarray, starts: np.ndarray,
                       source: np.ndarray | None = None) -> np.ndarray:
        """Pairs grouped by expert: pairs ``starts[g]`` .. ``starts[g + 1] - 1`` times expert
        ``experts[g]``'s matrix transposed, pair ``i`` reading row ``source[i]`` of the (n, k)
        float32 ``x`` (row ``i`` without ``source``); (pairs, rows) float32."""
        return grouped_matmuls([self], x, experts, starts, source)[0]

    def dequantize(self) -> np.ndarray:
        """The whole stack as float32 (n_expert, rows, k): for tests and references only."""
        return self.weight.dequantize().reshape(self.shape)


def grouped_matmuls(stacks: list[ExpertStack], x: np.ndarray, experts: np.ndarray, starts: np.ndarray,
                    source: np.ndarray | None = None) -> list[np.ndarray]:
    """:meth:`ExpertStack.grouped_matmul` for one or two stacks of the same shape over the same
    pairs (a ``SwitchGLU``'s gate and up): one native call, each source row quantized once."""
    if not 1 <= len(stacks) <= 2 or any(s.shape != stacks[0].shape for s in stacks):
        raise ValueError("one or two expert stacks of one shape")
    k, rows = stacks[0].weight.k, stacks[0].rows
    x = np.ascontiguousarray(x, dtype=np.float32)
    experts = np.ascontiguousarray(experts, dtype=np.int32)
    starts = np.ascontiguousarray(starts, dtype=np.int32)
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"activations of shape {x.shape} do not have {k} columns")
    pairs = x.shape[0] if source is None else source.size
    if starts.shape != (experts.size + 1,) or starts[0] != 0 or starts[-1] != pairs:
        raise ValueError("group starts must run from 0 to the pair count")
    if source is not None:
        source = np.ascontiguousarray(source, dtype=np.int32)
    outs = [np.empty((pairs, rows), dtype=np.float32) for _ in stacks]
    weights = (_P * len(stacks))(*(s.weight.address for s in stacks))
    targets = (_P * len(stacks))(*(o.ctypes.data for o in outs))
    status = _expert_matmul()(len(stacks), weights, rows, experts.size, experts.ctypes.data, starts.ctypes.data,
                              None if source is None else source.ctypes.data, x.shape[0], x.ctypes.data, k,
                              targets, rows)
    if status:
        raise ValueError(f"expert ids must be in 0..{stacks[0].n_expert - 1}")
    return outs


@dataclass(eq=False)
class PairOrder:
    """A ``gather_mm`` call's (batch entry, expert) pairs sorted by expert (ggml's ``mul_mat_id``):
    ``x`` (*bx, M, k) and ``indices`` (*bi) broadcast to the batch (*S); sorted row ``i`` is row
    ``rows[i]`` of ``x`` as (-1, k), and sorted rows ``starts[g]`` .. ``starts[g + 1] - 1`` go to
    expert ``experts[g]``. The rows point into ``x``'s own rows, so a token that chose eight
    experts is quantized once, not copied eight times; and an expert MLP's three products can
    share one order, its activation being applied to the sorted rows."""

    batch: tuple[int, ...]
    m: int
    chosen: np.ndarray  # per batch entry, its expert
    order: np.ndarray  # sorted pair -> batch entry
    experts: np.ndarray
    starts: np.ndarray
    rows: np.ndarray

    @classmethod
    def of(cls, x_shape: tuple[int, ...], indices: np.ndarray) -> PairOrder:
        *bx, m, _ = x_shape
        batch = np.broadcast_shapes(tuple(bx), indices.shape)
        source = np.broadcast_to(np.arange(int(np.prod(bx, dtype=np.int64))).reshape(bx), batch).reshape(-1)
        chosen = np.broadcast_to(indices, batch).reshape(-1).astype(np.int32)
        order = np.argsort(chosen, kind="stable")
        experts, counts = np.unique(chosen[order], return_counts=True)
        starts = np.zeros(experts.size + 1, dtype=np.int32)
        np.cumsum(counts * m, out=starts[1:])
        rows = (source[order][:, None] * m + np.arange(m)).reshape(-1).astype(np.int32)
        return cls(tuple(batch), m, chosen, order, experts, starts, rows)

    def products(self, stacks: list[ExpertStack], x: np.ndarray, biases: list[np.ndarray | None],
                 presorted: bool = False) -> list[np.ndarray]:
        """Each stack's product in sorted order, (sorted rows, stack rows), biases added: ``x`` is
        the call's (*bx, M, k) input, or with ``presorted`` already one row per sorted row."""
        k = stacks[0].weight.k
        outs = grouped_matmuls(stacks, x.reshape(-1, k), self.experts, self.starts, None if presorted else self.rows)
        for out, bias in zip(outs, biases):
            if bias is not None:
                out += np.repeat(bias[self.chosen[self.order]], self.m, axis=0)
        return outs

    def unsort(self, sorted_out: np.ndarray) -> np.ndarray:
        """Sorted rows back in the call's order: (*S, M, columns)."""
        out = np.empty((self.chosen.size, self.m, sorted_out.shape[-1]), dtype=sorted_out.dtype)
        out[self.order] = sorted_out.reshape(-1, self.m, sorted_out.shape[-1])
        return out.reshape(*self.batch, self.m, sorted_out.shape[-1])


def gather_products(stacks: list[ExpertStack], x: np.ndarray, indices: np.ndarray,
                    biases: list[np.ndarray | None] | None = None) -> list[np.ndarray]:
    """``mx.gather_mm(x, W.swapaxes(-1, -2), rhs_indices=indices)`` (+ ``bias[indices]``) over
    each stack (one or two, the same pairs): ``x`` (*bx, M, k), ``indices`` (*bi) broadcast
    together to the batch (*S), each batch entry's M rows times its expert's matrix: (*S, M, rows),
    the pairs sorted once (:class:`PairOrder`)."""
    pairs = PairOrder.of(x.shape, indices)
    return [pairs.unsort(out) for out in pairs.products(stacks, x, biases or [None] * len(stacks))]


def gather_product(stack: ExpertStack, x: np.ndarray, indices: np.ndarray, bias: np.ndarray | None = None
                   ) -> np.ndarray:
    """:func:`gather_products` for one stack."""
    return gather_products([stack], x, indices, [bias])[0]


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

    def float_bias(self) -> Any:
        """The bias as a float32 MLX array (lazy), or None."""
        if "bias" not in self:
            return None
        return float32(self.bias)

    def __call__(self, x: Any, indices: Any, sorted_indices: bool = False) -> Any:
        values, chosen, bias = evaluate(float32(x), indices, self.float_bias())
        return mx.array(gather_product(self.stack, values, chosen, bias))

    def _extra_repr(self) -> str:
        return (f"input_dims={self.input_dims}, output_dims={self.output_dims}, num_experts={self.num_experts}, "
                f"type={self.block.ggml_type}")


def float32(x: Any) -> Any:
    """``x`` as float32, lazily (None stays None)."""
    return x if x is None or x.dtype == mx.float32 else x.astype(mx.float32)


def evaluate(*arrays: Any) -> list[np.ndarray | None]:
    """The MLX arrays as NumPy arrays (None stays None), from one ``mx.eval``: each evaluation
    waits for MLX's graph, and a decode step's MoE layer should wait as few times as it can."""
    try:
        mx.eval(*(a for a in arrays if a is not None))
    except ValueError as exc:  # inside an mx.compile trace
        raise RuntimeError("a block-format weight cannot be used inside mx.compile") from exc
    return [None if a is None else np.asarray(a) for a in arrays]


class BlockSwitchGLU(SwitchGLU):
    """mlx-lm's ``SwitchGLU`` whose gate and up projections are block stacks of one shape: the
    pairs sorted once for the layer (:class:`PairOrder`), gate and up in one native call (each
    token's row quantized once for both and for all its experts), the activation applied to the
    sorted rows and, where the down projection is a block stack too, its product on them in the
    same order, unsorted once at the end. No MLX sort of the pairs (``_gather_sort`` would copy
    each token's row once per chosen expert), and two MLX evaluations a layer (its input, the
    activation). Its parameters, activation and down projection are the ``SwitchGLU``'s own; a
    layer whose gate and up are not both block stacks takes mlx-lm's call."""

    def __call__(self, x: Any, indices: Any) -> Any:
        gate, up, down = self.gate_proj, self.up_proj, self.down_proj
        if not (isinstance(gate, BlockSwitchLinear) and isinstance(up, BlockSwitchLinear)
                and gate.stack.shape == up.stack.shape):
            return super().__call__(x, indices)
        x = mx.expand_dims(x, (-2, -3))
        values, chosen, gate_bias, up_bias = evaluate(float32(x), indices, gate.float_bias(), up.float_bias())
        pairs = PairOrder.of(values.shape, chosen)
        gate_out, up_out = pairs.products([gate.stack, up.stack], values, [gate_bias, up_bias])
        if not isinstance(down, BlockSwitchLinear):
            hidden = self.activation(mx.array(pairs.unsort(up_out)), mx.array(pairs.unsort(gate_out)))
            return down(hidden, indices).squeeze(-2)
        hidden, down_bias = evaluate(float32(self.activation(mx.array(up_out), mx.array(gate_out))),
                                     down.float_bias())
        (out,) = pairs.products([down.stack], hidden, [down_bias], presorted=True)
        return mx.array(pairs.unsort(out)).squeeze(-2)


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
    if type(parent) is SwitchGLU:  # gate and up then run as one product (BlockSwitchGLU)
        parent.__class__ = BlockSwitchGLU
    return new


__all__ = ["BlockSwitchGLU", "BlockSwitchLinear", "ExpertStack", "PairOrder", "available", "describe", "evaluate",
           "float32", "gather_product", "gather_products", "grouped_matmuls", "install"]
