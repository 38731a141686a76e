"""What the CPU decode runtime holds of a mixture-of-experts layer, and which ones it takes.

Why: an MoE model's step in MLX runs its layers' routers, top-k, gathers and weighted sums as
many small MLX operations, each evaluated between the experts' block products
(``block_experts.BlockSwitchGLU``); on a Qwen3-30B-A3B-shaped file that glue, not the products,
kept decode at half llama-server's speed. The decode pass's C loop (``native/decode_pass.py``
describes the model to it) runs the whole layer instead: the router's product, the family's gating, a counting sort of the
(row, expert) pairs by expert, gate and up of every pair in one grouped call on the stacked
blocks (``mlxcel_expert_matmul_shared``, only the chosen experts' rows read), SwiGLU, down,
the weighted sum and the shared expert. This module says which layers it can describe that way
and takes their weights from the modules as they are.

Which layers: mlx-lm's sparse MoE blocks whose gating is known here (:data:`GATING`), with
a ``SwitchGLU`` (SwiGLU activation) whose three projections are expert stacks in ggml's blocks
without biases (the GGUF loader's ``BlockSwitchLinear``), the router a float32 or block linear
layer and, for qwen2_moe, the shared expert a float32 or block MLP behind its one-output gate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxcel_compat.runtime.block_experts import BlockSwitchLinear
from mlxcel_compat.runtime.block_weight import BlockWeight
from mlxcel_compat.runtime.decode_layers import LinearWeights, linear_weights

# mlx-lm's MoE block classes by the gating their ``__call__`` computes: "softmax" = softmax over
# every expert in float32, then the k largest (renormalised where ``norm_topk_prob`` says so).
GATING = {
    "Qwen3MoeSparseMoeBlock": "softmax",  # qwen3_moe: norm_topk_prob from the config
    "Qwen2MoeSparseMoeBlock": "softmax",  # qwen2_moe: never renormalised; a gated shared expert
    "OlmoeSparseMoeBlock": "softmax",  # olmoe: norm_topk_prob from the config
    "Qwen3NextSparseMoeBlock": "softmax",  # qwen3_5_moe: norm_topk_prob; a shared expert behind its sigmoid gate
}


@dataclass
class MoeWeights:
    """One MoE layer as ``struct mlxcel_moe`` reads it."""

    router: LinearWeights  # hidden -> n_expert logits
    gate: BlockWeight  # the stacks: (n_expert * rows, hidden), (n_expert * rows, hidden),
    up: BlockWeight
    down: BlockWeight  # (n_expert * hidden, rows)
    n_expert: int
    top_k: int
    rows: int  # an expert's intermediate width
    norm_topk: bool
    shared_gate: LinearWeights | None = None  # qwen2_moe's shared expert
    shared_up: LinearWeights | None = None
    shared_down: LinearWeights | None = None
    shared_scale: LinearWeights | None = None  # its gate (hidden -> 1), through a sigmoid

    @property
    def linears(self) -> list[LinearWeights]:
        """The layer's non-expert products (router, shared expert)."""
        return [w for w in (self.router, self.shared_gate, self.shared_up, self.shared_down, self.shared_scale)
                if w is not None]

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in (self.gate, self.up, self.down))


def is_moe(mlp: Any) -> bool:
    """Whether ``mlp`` is a mixture-of-experts block (one with a ``switch_mlp``)."""
    return hasattr(mlp, "switch_mlp")


def unsupported(mlp: Any) -> str | None:
    """Why this MoE block stays in MLX's step, or None if the C loop runs it."""
    kind = type(mlp).__name__
    if kind not in GATING:
        return f"{kind}'s gating is not one the runtime computes"
    switch = mlp.switch_mlp
    if type(switch).__name__ != "BlockSwitchGLU" or type(switch.activation).__name__ != "SwiGLU":
        return "experts not in ggml's blocks (the GGUF loader's stacks) or not SwiGLU"
    stacks = [switch.gate_proj, switch.up_proj, switch.down_proj]
    if not all(isinstance(s, BlockSwitchLinear) and "bias" not in s for s in stacks):
        return "experts not in ggml's blocks (the GGUF loader's stacks) or with biases"
    gate, up, down = (s.stack for s in stacks)
    if gate.shape != up.shape or down.shape != (gate.n_expert, gate.weight.k, gate.rows):
        return "expert stacks of unexpected shapes"
    if mlp.top_k > gate.n_expert:
        return "more experts chosen than there are"
    return None


def moe_weights(mlp: Any) -> MoeWeights:
    """An MoE block :func:`unsupported` accepts, as the C loop reads it."""
    switch = mlp.switch_mlp
    gate, up, down = (getattr(switch, n).stack for n in ("gate_proj", "up_proj", "down_proj"))
    shared = getattr(mlp, "shared_expert", None)
    scale = getattr(mlp, "shared_expert_gate", None)
    return MoeWeights(
        router=linear_weights(mlp.gate), gate=gate.weight, up=up.weight, down=down.weight,
        n_expert=gate.n_expert, top_k=int(mlp.top_k), rows=gate.rows,
        norm_topk=bool(getattr(mlp, "norm_topk_prob", False)),
        shared_gate=linear_weights(shared.gate_proj) if shared is not None else None,
        shared_up=linear_weights(shared.up_proj) if shared is not None else None,
        shared_down=linear_weights(shared.down_proj) if shared is not None else None,
        shared_scale=linear_weights(scale) if scale is not None else None)


def shared_modules(mlp: Any) -> list[Any]:
    """The block's non-expert linear modules (router, shared expert and its gate): what the
    runtime's checks of weight types look at."""
    shared = getattr(mlp, "shared_expert", None)
    modules = [mlp.gate, getattr(mlp, "shared_expert_gate", None)]
    if shared is not None:
        modules += [shared.gate_proj, shared.up_proj, shared.down_proj]
    return [m for m in modules if m is not None]


def ffn_width(layers: list[Any]) -> int:
    """The widest MLP a pass's ``gate`` and ``up`` buffers hold: the dense layers' and the
    shared experts' (``decode_layers.LayerWeights``)."""
    widths = [layer.gate.weight.shape[0] for layer in layers if layer.gate is not None]
    widths += [layer.moe.shared_gate.weight.shape[0] for layer in layers
               if layer.moe is not None and layer.moe.shared_gate is not None]
    return max(widths, default=1)


__all__ = ["GATING", "MoeWeights", "ffn_width", "is_moe", "moe_weights", "shared_modules", "unsupported"]
