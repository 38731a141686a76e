"""A block linear layer that keeps its weight's columns in the file's order (``tensor_undo.py``).

Where a GGUF stores a matrix's columns in another order than the model's (Qwen3.5's tiled value
heads in ``ssm_out``), a float weight gets its columns back by a gather at load; a weight kept in
ggml's blocks cannot (its columns are packed into blocks with shared scales), so its layer
gathers each row of activations into the stored order instead, before the block product.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mlxcel_compat.runtime.block_layers import BlockLinear, module_at


class InputOrderLinear(BlockLinear):
    """A block linear layer whose weight's columns stay in the stored order: the activations are
    gathered into that order first, which multiplies like the model's own column order (stored
    column ``columns[c]`` meets activation ``c``)."""

    def __init__(self, linear: BlockLinear, columns: np.ndarray) -> None:
        import mlx.core as mx

        super().__init__(linear.block, linear.bias if "bias" in linear else None, head=linear.head)
        # Activation j of the stored order is the model's activation argsort(columns)[j]. "_": not a parameter.
        self._gather = mx.array(np.argsort(np.asarray(columns)).astype(np.int32))

    @property
    def input_gather(self) -> Any:
        """Activation j of the stored order is the model's activation ``input_gather[j]`` (the CPU
        decode runtime gathers them so: runtime/decode_delta.py)."""
        return self._gather

    def __call__(self, x: Any) -> Any:
        import mlx.core as mx

        return super().__call__(mx.take(x, self._gather, axis=-1))


def order_inputs(model: Any, path: str, columns: np.ndarray) -> InputOrderLinear:
    """Replace the block linear layer at ``path`` with its :class:`InputOrderLinear`."""
    *parents, last = path.split(".")
    parent = module_at(model, ".".join(parents)) if parents else model
    layer = InputOrderLinear(module_at(model, path), columns)
    if isinstance(parent, list):
        parent[int(last)] = layer
    else:
        setattr(parent, last, layer)
    return layer
