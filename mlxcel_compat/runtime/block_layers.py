"""MLX layers whose weights stay in ggml's block format (``block_weight.py``), for the CPU.

A quantized GGUF (or an MLX affine model, repacked) keeps every linear layer's weight and the
token embedding in its blocks; these modules take the place of mlx-lm's ``nn.Linear`` and
``nn.Embedding`` in the loaded model, so the model's own code runs unchanged. A call evaluates
its input (like the NumPy paths of ``attention.py`` and ``cpu_fusion.py``, one evaluation in the
middle of a step), runs the product in the native layer's block products (``mlxcel_block_matmul``)
and hands MLX the float32 result.

Prompt chunks (more than one token a sequence) expand the weight in tiles for the BLAS: every
prompt token is float32 math on the weights' values, whatever the chunk's length, its padding
in a batched prefill, or where a prompt-cache hit split the prompt, so a token's KV does not
depend on how it was scheduled. A weight ggml repacks (Q4_0, Q4_K: ``ggml_repack.py``) takes
ggml's int8 GEMM for prompt chunks instead, with the same independence (every row is a GEMM
row). Decode steps (one token a sequence) take ggml's vec_dot,
llama.cpp's arithmetic (activations quantized to 8 bits), row by row, so a sequence's results do
not depend on how many sequences share a batch either.
Decode steps of the families the CPU decode runtime knows do not come here: it calls the
weights directly (``cpu_decode.py``).

They cannot run inside an ``mx.compile`` trace (nothing can be evaluated there), so
``cpu_fusion`` compiles no module that holds one.

Being eager, they also compute what nobody reads: a prompt chunk's logits, which MLX's lazy
graph never computes for a float model (the engine evaluates only the cache). Under
:func:`logits_unused` (the engine's prefill chunks) the output head returns a lazy zero array
instead: for SmolLM2 a 900-token chunk's head is 25 GMAC and 350 MB of float32 logits.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxcel_compat.runtime.block_experts import BlockSwitchLinear
from mlxcel_compat.runtime.block_weight import BlockWeight


_state = threading.local()


@contextlib.contextmanager
def logits_unused() -> Iterator[None]:
    """Within this block, output heads in block form skip their product (see the module's
    docstring): for forward passes whose logits are discarded."""
    previous = getattr(_state, "skip_head", False)
    _state.skip_head = True
    try:
        yield
    finally:
        _state.skip_head = previous


def _head(weight: BlockWeight, x: Any) -> Any:
    if getattr(_state, "skip_head", False):
        return mx.zeros((*x.shape[:-1], weight.n), dtype=mx.float32)  # lazy: never materialized
    return _product(weight, x)


def _product(weight: BlockWeight, x: Any) -> Any:
    """x @ W^T for an MLX array ``x`` (..., k), as a float32 MLX array (..., n)."""
    try:
        mx.eval(x)
    except ValueError as exc:  # inside an mx.compile trace
        raise RuntimeError("a block-format weight cannot be used inside mx.compile") from exc
    view = np.asarray(x.astype(mx.float32) if x.dtype != mx.float32 else x)
    rows = view.reshape(-1, weight.k)
    tokens = x.shape[-2] if x.ndim >= 2 else 1
    out = weight.matmul(rows, tiles=tokens > 1)
    return mx.array(out).reshape(*x.shape[:-1], weight.n)


class BlockLinear(nn.Module):
    """``nn.Linear`` over a :class:`BlockWeight` (the bias, if any, stays an MLX array).
    ``head``: the model's output projection (see :func:`logits_unused`)."""

    def __init__(self, weight: BlockWeight, bias: Any = None, head: bool = False) -> None:
        super().__init__()
        self.block = weight  # not an mx.array: not a parameter
        self.head = head
        if bias is not None:
            self.bias = bias

    def __call__(self, x: Any) -> Any:
        y = _head(self.block, x) if self.head else _product(self.block, x)
        return y + self.bias if "bias" in self else y

    def _extra_repr(self) -> str:
        return f"input_dims={self.block.k}, output_dims={self.block.n}, type={self.block.ggml_type}"


class BlockEmbedding(nn.Module):
    """``nn.Embedding`` over a :class:`BlockWeight`, with ``as_linear`` for tied output heads."""

    def __init__(self, weight: BlockWeight) -> None:
        super().__init__()
        self.block = weight

    def __call__(self, ids: Any) -> Any:
        mx.eval(ids)
        values = np.asarray(ids)
        rows = self.block.take(values.reshape(-1))
        return mx.array(rows).reshape(*values.shape, self.block.k)

    def as_linear(self, x: Any) -> Any:
        return _head(self.block, x)  # a tied output head

    def _extra_repr(self) -> str:
        return f"{self.block.n}, {self.block.k}, type={self.block.ggml_type}"


def _parent(model: Any, path: str) -> tuple[Any, str]:
    *parents, last = path.split(".")
    parent = model
    for part in parents:
        parent = parent[int(part)] if isinstance(parent, list) else getattr(parent, part)
    return parent, last


def module_at(model: Any, path: str) -> Any:
    """The module at ``path`` (``model.layers.0.mlp.up_proj``, as ``named_modules`` names it)."""
    parent, last = _parent(model, path)
    return parent[int(last)] if isinstance(parent, list) else getattr(parent, last)


def install(model: Any, path: str, weight: BlockWeight) -> Any:
    """Replace the linear layer or embedding at ``path`` (``model.layers.0.mlp.up_proj``) with its
    block form over ``weight``; a linear layer's bias stays (loaded later by name, or kept).

    The layer may be float (``nn.Linear`` / ``nn.Embedding``: a GGUF's, whose weight is never
    loaded) or MLX-quantized (``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding``: a quantized
    directory's, whose weight ``weight`` is repacked from, ``mlx_affine.py``)."""
    parent, last = _parent(model, path)
    old = module_at(model, path)
    if isinstance(old, (nn.Embedding, nn.QuantizedEmbedding)):
        new: nn.Module = BlockEmbedding(weight)
    elif isinstance(old, (nn.Linear, nn.QuantizedLinear)):
        new = BlockLinear(weight, old.bias if "bias" in old else None, head=path.endswith("lm_head"))
    else:
        raise TypeError(f"{path} is a {type(old).__name__}, not a linear layer or an embedding")
    if isinstance(parent, list):
        parent[int(last)] = new
    else:
        setattr(parent, last, new)
    return new


BLOCK_MODULES = (BlockLinear, BlockEmbedding, BlockSwitchLinear)  # a stack of experts too (block_experts.py)


def block_weight_of(module: Any) -> BlockWeight | None:
    """The block weight a layer holds (a stack of experts' whole stack), or None for any other module."""
    return module.block if isinstance(module, BLOCK_MODULES) else None


def holds_blocks(module: Any) -> bool:
    """Whether ``module`` or any module inside it holds a block weight."""
    return any(isinstance(m, BLOCK_MODULES) for _, m in module.named_modules())


__all__ = ["BlockEmbedding", "BlockLinear", "block_weight_of", "holds_blocks", "install", "logits_unused", "module_at"]
