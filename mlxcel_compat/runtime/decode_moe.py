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
a ``SwitchGLU`` (SwiGLU activation, or gpt-oss's clamped one) whose three projections are
expert stacks in ggml's blocks (the GGUF loader's ``BlockSwitchLinear``) or all three mlx-lm's
float ``SwitchLinear`` (a model directory's or a float GGUF's experts: float32 read in place,
bfloat16/float16 widened to float32 once here, and multiplied by ``mlxcel_expert_matmul_f32``'s
grouped product over the shim's float32 kernels; biases only in gpt-oss's), the router a
float32 or block linear layer and, for qwen2_moe, the shared expert a float32 or block MLP
behind its one-output gate.

granitemoe's block routes as gpt-oss's (its router's ``layer`` has no bias, its experts none).
gpt-oss's block (``gpt_oss.MLPBlock``: ``router`` and ``experts`` where the others have ``gate``
and ``switch_mlp``) routes the other way round: the k largest router logits (its router has a
bias), then a softmax over those k; each expert's gate, up and down add its own bias, and the
activation is ``SwigluOAI``: ``(clip(up, -limit, limit) + 1) * g sigmoid(alpha g)``,
``g = min(gate, limit)``, alpha 1.702 and limit 7 as mlx-lm's module holds them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcel_compat.runtime.block_experts import BlockSwitchLinear
from mlxcel_compat.runtime.block_weight import BlockWeight
from mlxcel_compat.runtime.decode_layers import LinearWeights, float32_array, linear_weights

# mlx-lm's MoE block classes by the gating their ``__call__`` computes: "softmax" = softmax over
# every expert in float32, then the k largest (renormalised where ``norm_topk_prob`` says so).
# "topk_softmax" = the k largest logits, then a softmax over those k (gpt-oss). Keys: the class
# name, qualified by its mlx-lm module where the name alone says little (``block_name``).
GATING = {
    "Qwen3MoeSparseMoeBlock": "softmax",  # qwen3_moe: norm_topk_prob from the config
    "Qwen2MoeSparseMoeBlock": "softmax",  # qwen2_moe: never renormalised; a gated shared expert
    "OlmoeSparseMoeBlock": "softmax",  # olmoe: norm_topk_prob from the config
    "Qwen3NextSparseMoeBlock": "softmax",  # qwen3_5_moe: norm_topk_prob; a shared expert behind its sigmoid gate
    "gpt_oss.MLPBlock": "topk_softmax",  # gpt-oss: biases on the router and every expert, clamped SwiGLU
    "GraniteMoeMoE": "topk_softmax",  # granitemoe: its router's ``layer``, no biases
    "GraniteMoeHybridMoE": "topk_softmax",  # granitemoehybrid: granitemoe's (its shared MLP: decode_mamba.py)
    "Ernie4_5_MoeMLP": "softmax",  # ernie4_5_moe (its softmax gate only): renormalised; ungated shared experts
    # glm4_moe: sigmoid scores, the k largest of scores + e_score_correction_bias chosen, weighted by
    # the scores alone (renormalised by norm_topk_prob), times routed_scaling_factor; one expert group
    "glm4_moe.MoE": "sigmoid_bias",
    # lfm2_moe: as glm4_moe's, the selection bias its ``expert_bias`` (none: use_expert_bias off), the
    # chosen k renormalised by their sum + 1e-6 (k = 1 too), times routed_scaling_factor (the block's)
    "Lfm2MoeSparseMoeBlock": "sigmoid_bias_eps",
    # deepseek_v3: glm4_moe's gating (noaux_tc); deepseek_v2: the softmax over every expert, never
    # renormalised, times routed_scaling_factor. Both may rank expert groups first (expert_groups).
    "DeepseekV3MoE": "sigmoid_bias",
    "DeepseekV2MoE": "softmax",
}
# Blocks that always renormalise the chosen k weights to sum 1 (ERNIE 4.5 divides by
# max(sum, 1e-12): the sum of k softmax weights is never that small).
RENORMALISED = ("Ernie4_5_MoeMLP",)
# Routers' selection methods (mlx-lm's ``topk_method``) the C loop computes: deepseek_v3's and glm4_moe's
# noaux_tc, deepseek_v2's greedy (its misspelt default "gready" too) and group_limited_greedy.
TOPK_METHODS = ("noaux_tc", "greedy", "gready", "group_limited_greedy")
ACTIVATIONS = ("SwiGLU", "SwigluOAI")  # mlx-lm's activations of a SwitchGLU the C loop computes


@dataclass
class MoeWeights:
    """One MoE layer as ``struct mlxcel_moe`` reads it."""

    router: LinearWeights  # hidden -> n_expert logits
    gate: BlockWeight | None  # the stacks in ggml's blocks: (n_expert * rows, hidden), (n_expert * rows, hidden),
    up: BlockWeight | None
    down: BlockWeight | None  # (n_expert * hidden, rows); None: the float32 stacks below
    n_expert: int
    top_k: int
    rows: int  # an expert's intermediate width
    norm_topk: bool
    gating: str = "softmax"  # GATING's value
    gate_bias: np.ndarray | None = None  # gpt-oss: (n_expert, rows) float32
    up_bias: np.ndarray | None = None
    down_bias: np.ndarray | None = None  # (n_expert, hidden)
    alpha: float | None = None  # gpt-oss's clamped SwiGLU (SwigluOAI), else None
    limit: float | None = None
    shared_gate: LinearWeights | None = None  # qwen2_moe's shared expert
    shared_up: LinearWeights | None = None
    shared_down: LinearWeights | None = None
    shared_scale: LinearWeights | None = None  # its gate (hidden -> 1), through a sigmoid
    score_bias: np.ndarray | None = None  # glm4_moe, lfm2_moe: (n_expert) the selection bias, float32
    routed_scale: float = 1.0  # glm4_moe, lfm2_moe: routed_scaling_factor
    n_group: int = 1  # grouped selection (:func:`expert_groups`): the groups, the best ones kept
    topk_group: int = 1
    group_by_max: bool = False  # deepseek_v2's group_limited_greedy: a group's best score ranks it (else its best two)
    # float32 stacks in place of gate, up and down (mlx-lm's SwitchLinear weights, contiguous):
    # (n_expert, rows, hidden), (n_expert, rows, hidden), (n_expert, hidden, rows)
    float_gate: np.ndarray | None = None
    float_up: np.ndarray | None = None
    float_down: np.ndarray | None = None

    @property
    def linears(self) -> list[LinearWeights]:
        """The layer's non-expert products (router, shared expert)."""
        return [w for w in (self.router, self.shared_gate, self.shared_up, self.shared_down, self.shared_scale)
                if w is not None]

    @property
    def nbytes(self) -> int:
        return sum(w.nbytes for w in (self.gate, self.up, self.down, self.float_gate, self.float_up, self.float_down)
                   if w is not None)


def is_moe(mlp: Any) -> bool:
    """Whether ``mlp`` is a mixture-of-experts block (one with a ``switch_mlp``, or gpt-oss's
    ``experts`` behind its ``router``)."""
    return hasattr(mlp, "switch_mlp") or (hasattr(mlp, "experts") and hasattr(mlp, "router"))


def block_name(mlp: Any) -> str:
    """The block's key in :data:`GATING`: its class name, qualified by its mlx-lm module for
    gpt-oss's plainly named ``MLPBlock``."""
    name = type(mlp).__name__
    module = type(mlp).__module__.rsplit(".", 1)[-1]
    return f"{module}.{name}" if f"{module}.{name}" in GATING else name


def _experts(mlp: Any) -> Any:
    return mlp.switch_mlp if hasattr(mlp, "switch_mlp") else mlp.experts


def _router(mlp: Any) -> Any:
    """The router's linear layer: ``gate`` (qwen3_moe, ...), gpt-oss's ``router``, granitemoe's
    ``router.layer``."""
    if not hasattr(mlp, "router"):
        return mlp.gate
    return getattr(mlp.router, "layer", mlp.router)


# mlx-lm's stacked-expert projections the runtime reads as float32 (16-bit ones widened at load).
FLOAT_STACK_DTYPES = ("float32", "bfloat16", "float16")


def stack_kind(switch: Any) -> str | None:
    """How a ``SwitchGLU``'s three projections hold their experts: "blocks" (all three the GGUF
    loader's ``BlockSwitchLinear``), "float" (all three mlx-lm's ``SwitchLinear`` of a float dtype),
    or None (anything else: MLX's quantized ``QuantizedSwitchLinear``, a mix)."""
    stacks = [switch.gate_proj, switch.up_proj, switch.down_proj]
    if all(isinstance(s, BlockSwitchLinear) for s in stacks):
        return "blocks"
    if all(type(s).__name__ == "SwitchLinear" and str(s.weight.dtype).rsplit(".", 1)[-1] in FLOAT_STACK_DTYPES
           for s in stacks):
        return "float"
    return None


def _stack_shape(linear: Any) -> tuple[int, int, int]:
    """(n_expert, rows, k) of a stacked projection, either kind."""
    return linear.stack.shape if isinstance(linear, BlockSwitchLinear) else tuple(linear.weight.shape)


def unsupported(mlp: Any) -> str | None:
    """Why this MoE block stays in MLX's step, or None if the C loop runs it."""
    kind = block_name(mlp)
    if kind not in GATING:
        return f"{kind}'s gating is not one the runtime computes"
    switch = _experts(mlp)
    if type(switch).__name__ not in ("BlockSwitchGLU", "SwitchGLU") or type(switch.activation).__name__ not in ACTIVATIONS:
        return "experts not in a SwitchGLU or not SwiGLU"
    stacks = [switch.gate_proj, switch.up_proj, switch.down_proj]
    if stack_kind(switch) is None:
        return ("experts neither in ggml's blocks (the GGUF loader's stacks) nor float "
                f"(mlx-lm's SwitchLinear of {'/'.join(FLOAT_STACK_DTYPES)}): {type(stacks[0]).__name__}")
    biased = GATING[kind] == "topk_softmax"  # only gpt-oss's experts have biases (granitemoe's have none)
    if not all(("bias" in s) <= biased for s in stacks):
        return "experts with biases outside gpt-oss's block"
    gate, up, down = (_stack_shape(s) for s in stacks)
    if gate != up or down != (gate[0], gate[2], gate[1]):
        return "expert stacks of unexpected shapes"
    if _top_k(mlp) > gate[0]:
        return "more experts chosen than there are"
    router = _router(mlp)
    if getattr(router, "topk_method", "noaux_tc") not in TOPK_METHODS:
        return f"expert selection {router.topk_method!r} is not one the runtime computes"
    n_group, topk_group, _ = expert_groups(mlp)
    if n_group > 1 and (gate[0] % n_group or not 0 < topk_group <= n_group
                        or gate[0] // n_group < 2 and GATING[kind] == "sigmoid_bias"):
        return f"{n_group} expert groups of {gate[0]} experts (top {topk_group} groups)"
    if type(getattr(mlp, "gate_act", None)).__name__ == "Sigmoid":
        return "a sigmoid router (ERNIE 4.5's moe_gate_act) is not one the runtime computes"
    return None


def expert_groups(mlp: Any) -> tuple[int, int, bool]:
    """(n_group, topk_group, ranked by the group's best score) of the block's router: mlx-lm's
    deepseek_v3 and glm4_moe rank every group by the sum of its two best biased scores when
    ``n_group > 1``; deepseek_v2 ranks by the best softmax score, and only for
    ``topk_method == "group_limited_greedy"`` (its "greedy" takes no groups). (1, 1, False): none."""
    router = _router(mlp)
    method = getattr(router, "topk_method", None)
    if method in ("greedy", "gready"):
        return 1, 1, False
    n_group, topk_group = getattr(router, "n_group", None), getattr(router, "topk_group", None)
    if not n_group or int(n_group) <= 1:
        return 1, 1, False
    return int(n_group), int(topk_group), method == "group_limited_greedy"


def _top_k(mlp: Any) -> int:
    if hasattr(mlp, "top_k"):
        return int(mlp.top_k)
    if hasattr(mlp, "k"):  # ernie4_5_moe
        return int(mlp.k)
    return int(getattr(mlp, "num_experts_per_tok", None) or mlp.router.top_k)  # gpt-oss's, granitemoe's


def shared_expert(mlp: Any) -> Any:
    """The block's shared expert MLP (qwen2_moe's ``shared_expert``, ERNIE 4.5's ``shared_experts``,
    one MLP as wide as all of them), or None."""
    return getattr(mlp, "shared_expert", getattr(mlp, "shared_experts", None))


def _bias(linear: Any) -> np.ndarray | None:
    return float32_array(linear.bias) if "bias" in linear else None


def moe_weights(mlp: Any) -> MoeWeights:
    """An MoE block :func:`unsupported` accepts, as the C loop reads it."""
    switch = _experts(mlp)
    projections = [switch.gate_proj, switch.up_proj, switch.down_proj]
    n_expert, rows, _ = _stack_shape(switch.gate_proj)
    if stack_kind(switch) == "blocks":
        gate, up, down = (p.stack.weight for p in projections)
        floats = [None, None, None]
    else:  # float32 read in place (a contiguous copy where it is not), 16-bit widened once
        gate = up = down = None
        floats = [float32_array(p.weight if p.weight.dtype == mx.float32 else p.weight.astype(mx.float32))
                  for p in projections]
    shared = shared_expert(mlp)
    scale = getattr(mlp, "shared_expert_gate", None)
    clamped = type(switch.activation).__name__ == "SwigluOAI"
    n_group, topk_group, group_by_max = expert_groups(mlp)
    return MoeWeights(
        router=linear_weights(_router(mlp)), gate=gate, up=up, down=down,
        n_expert=n_expert, top_k=_top_k(mlp), rows=rows,
        norm_topk=bool(getattr(mlp, "norm_topk_prob", getattr(_router(mlp), "norm_topk_prob", False)))
        or block_name(mlp) in RENORMALISED,
        gating=GATING[block_name(mlp)],
        gate_bias=_bias(switch.gate_proj), up_bias=_bias(switch.up_proj), down_bias=_bias(switch.down_proj),
        alpha=float(switch.activation._alpha) if clamped else None,
        limit=float(switch.activation._limit) if clamped else None,
        shared_gate=linear_weights(shared.gate_proj) if shared is not None else None,
        shared_up=linear_weights(shared.up_proj) if shared is not None else None,
        shared_down=linear_weights(shared.down_proj) if shared is not None else None,
        shared_scale=linear_weights(scale) if scale is not None else None,
        score_bias=_score_bias(mlp),
        routed_scale=float(getattr(_router(mlp), "routed_scaling_factor", getattr(mlp, "routed_scaling_factor", 1.0))),
        n_group=n_group, topk_group=topk_group, group_by_max=group_by_max,
        float_gate=floats[0], float_up=floats[1], float_down=floats[2])


def _score_bias(mlp: Any) -> np.ndarray | None:
    """The selection bias of a sigmoid router: glm4_moe's ``e_score_correction_bias``, lfm2_moe's
    ``expert_bias`` (zeros where the block has none: adding 0 chooses as MLX's unbiased top k)."""
    gating = GATING[block_name(mlp)]
    if gating == "sigmoid_bias":
        return float32_array(_router(mlp).e_score_correction_bias)
    if gating == "sigmoid_bias_eps":
        bias = getattr(mlp, "expert_bias", None)
        return float32_array(bias) if bias is not None else np.zeros(int(mlp.num_experts), np.float32)
    return None


def shared_modules(mlp: Any) -> list[Any]:
    """The block's non-expert linear modules (router, shared expert and its gate): what the
    runtime's checks of weight types look at."""
    shared = shared_expert(mlp)
    router = _router(mlp)  # glm4_moe's MoEGate holds a float32 weight, no linear module: linear_weights reads it
    modules = [None if type(router).__name__ == "MoEGate" else router, getattr(mlp, "shared_expert_gate", None)]
    if shared is not None:
        modules += [shared.gate_proj, shared.up_proj, shared.down_proj]
    return [m for m in modules if m is not None]


def ffn_width(layers: list[Any]) -> int:
    """The widest MLP a pass's ``gate`` and ``up`` buffers hold: the dense layers' and the
    shared experts' (``decode_layers.LayerWeights``)."""
    widths = [(layer.gate or layer.up).weight.shape[0] for layer in layers if (layer.gate or layer.up) is not None]
    widths += [layer.gate_up.weight.shape[0] // 2 for layer in layers if layer.gate_up is not None]
    widths += [layer.moe.shared_gate.weight.shape[0] for layer in layers
               if layer.moe is not None and layer.moe.shared_gate is not None]
    return max(widths, default=1)


__all__ = ["ACTIVATIONS", "FLOAT_STACK_DTYPES", "GATING", "stack_kind", "TOPK_METHODS", "block_name", "expert_groups", "MoeWeights", "ffn_width", "is_moe", "moe_weights", "shared_modules", "unsupported"]
