"""What the CPU decode runtime holds of a hybrid's Mamba-2 layer (Granite 4.0-H, Nemotron-H), which
ones it takes, and Granite 4.0-H's shared MLP beside its experts.

Why: in MLX's step a Mamba-2 mixer is some twenty small operations a token (mlx-lm's ``ssm_attn``
on the CPU for one token: the SSD form's products, a segment sum, exponentials), each scheduled and
evaluated on its own. The decode pass's C loop runs the mixer instead (the native layer's Mamba-2 mixer: the
in-projection on the file's blocks, the causal conv over its rolling state, softplus and the
clip of dt, the SSM update and readout, the D skip, the gated RMS norm, the out-projection). This
module says which mixers it can describe that way and takes their weights from the modules as
they are.

The state: as a delta-net layer's (``decode_delta.py``), mlx-lm's ``ArraysCache`` of the layer
holds the conv state (``cache[0]``: the last ``kernel - 1`` in-projections of x, B and C,
(1, kernel - 1, conv_dim)) and the SSM state (``cache[1]``: (1, heads, head_dim, d_state)),
float32. The pass updates both in place only in arrays it made for the sequence
(``decode_delta.own_states``, which reads a :class:`MambaWeights`' shapes by the same names as a
delta-net's: ``v_heads``, ``v_dim``, ``k_dim``), so session snapshots and prompt-cache entries
keep the state they were taken with.

Which mixers: mlx-lm's ``GraniteMoeHybridMamba2Mixer`` (the gated norm over all heads at once) and
``NemotronHMamba2Mixer`` (over ``n_groups`` groups of channels), their projections float32 or in
ggml's blocks, the conv with or without a bias.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxcel_compat.runtime.block_layers import BlockLinear
from mlxcel_compat.runtime.decode_layers import LayerWeights, LinearWeights, float32_array, linear_weights, norm_weights

# mlx-lm's Mamba-2 mixers the pass computes, by class name, and their gated norms' classes.
MAMBA_MIXERS = ("GraniteMoeHybridMamba2Mixer", "NemotronHMamba2Mixer")
GATED_NORMS = ("GraniteMoeHybridRMSNormGated", "MambaRMSNormGated")


@dataclass
class MambaWeights:
    """One Mamba-2 mixer as ``struct mlxcel_mamba`` reads it."""

    in_proj: LinearWeights  # hidden -> [z | x B C | dt]
    out: LinearWeights  # heads * head_dim -> hidden
    conv: np.ndarray  # (conv_dim, kernel)
    conv_bias: np.ndarray | None  # (conv_dim)
    decay: np.ndarray  # (heads): A = -exp(A_log), as MLX computes it
    dt_bias: np.ndarray  # (heads)
    skip: np.ndarray  # (heads): D
    norm: np.ndarray  # (heads * head_dim): the gated norm's gain
    eps: float
    dt_min: float  # time_step_limit
    dt_max: float
    heads: int
    head_dim: int
    d_state: int
    groups: int
    kernel: int
    norm_group: int  # the gated norm's group width

    @property
    def linears(self) -> list[LinearWeights]:
        return [self.in_proj, self.out]

    @property
    def conv_dim(self) -> int:
        return self.heads * self.head_dim + 2 * self.groups * self.d_state

    # the state's shape under decode_delta's names (own_states, can_take): (1, v_heads, v_dim, k_dim)
    @property
    def v_heads(self) -> int:
        return self.heads

    @property
    def v_dim(self) -> int:
        return self.head_dim

    @property
    def k_dim(self) -> int:
        return self.d_state


def mixer_of(layer: Any) -> Any:
    """A decoder layer's Mamba-2 mixer (Granite's ``mamba``, Nemotron-H's ``mixer``), or None."""
    for name in ("mamba", "mixer"):
        mixer = getattr(layer, name, None)
        if type(mixer).__name__ in MAMBA_MIXERS:
            return mixer
    return None


def is_mamba(layer: Any) -> bool:
    """Whether a decoder layer's mixer is a Mamba-2 one instead of attention."""
    return mixer_of(layer) is not None


def linear_modules(mixer: Any) -> list[Any]:
    """The mixer's in- and out-projection modules (what the runtime's weight checks look at)."""
    return [mixer.in_proj, mixer.out_proj]


def unsupported(mixer: Any) -> str | None:
    """Why this Mamba-2 mixer stays in MLX's step, or None if the C loop runs it."""
    if type(mixer).__name__ not in MAMBA_MIXERS:
        return f"{type(mixer).__name__}: not a Mamba-2 mixer the runtime computes"
    if not all(isinstance(m, (BlockLinear, nn.Linear)) for m in linear_modules(mixer)):
        return "Mamba-2 projections neither float32 nor in ggml's blocks"
    conv = mixer.conv1d
    if conv.weight.shape != (mixer.conv_dim, mixer.conv_kernel_size, 1) or mixer.num_heads % mixer.n_groups:
        return "a Mamba-2 conv of unexpected shape"
    if type(mixer.norm).__name__ not in GATED_NORMS:
        return "a Mamba-2 norm other than the gated RMS norm"
    params = [mixer.A_log, mixer.dt_bias, mixer.D, conv.weight, mixer.norm.weight] + (
        [conv.bias] if "bias" in conv else [])
    if any(w.dtype != mx.float32 for w in params):
        return "Mamba-2 parameters other than float32"
    return None


def mamba_weights(mixer: Any) -> MambaWeights:
    """A mixer :func:`unsupported` accepts, as the C loop reads it."""
    decay = -mx.exp(mixer.A_log.astype(mx.float32))  # mlx-lm's ssm_attn, by MLX's own exp
    mx.eval(decay)
    conv = mixer.conv1d
    inner = mixer.num_heads * mixer.head_dim
    low, high = mixer.time_step_limit
    return MambaWeights(
        in_proj=linear_weights(mixer.in_proj), out=linear_weights(mixer.out_proj),
        conv=float32_array(conv.weight[..., 0]), conv_bias=float32_array(conv.bias) if "bias" in conv else None,
        decay=float32_array(decay), dt_bias=float32_array(mixer.dt_bias), skip=float32_array(mixer.D),
        norm=float32_array(mixer.norm.weight), eps=float(mixer.norm.eps), dt_min=float(low), dt_max=float(high),
        heads=int(mixer.num_heads), head_dim=int(mixer.head_dim), d_state=int(mixer.ssm_state_size),
        groups=int(mixer.n_groups), kernel=int(mixer.conv_kernel_size),
        norm_group=int(getattr(mixer.norm, "group_size", inner)))


def mamba_layer(layer: Any, moe: Any = None) -> LayerWeights:
    """A Granite 4.0-H Mamba-2 decoder layer as ``decode_layers.layer_weights`` gives an attention
    one: its two norms, its MLP (or ``moe``), the mixer's weights in place of attention's."""
    lin = linear_weights
    if moe is not None:
        mlp = dict(gate=None, up=None, down=None, moe=moe)
    else:
        m = layer.mlp
        mlp = dict(gate=lin(m.gate_proj), up=lin(m.up_proj), down=lin(m.down_proj))
    return LayerWeights(n1=norm_weights(layer.input_layernorm), n2=norm_weights(layer.post_attention_layernorm),
                        q=None, k=None, v=None, o=None, q_norm=None, k_norm=None,
                        mamba=mamba_weights(mixer_of(layer)), **mlp)


# ---------------------------------------------------------------- Granite 4.0-H's shared MLP


def shared_mlp_unsupported(layer: Any) -> str | None:
    """Why Granite 4.0-H's shared MLP beside the experts (``shared_mlp``: gate and up in one
    ``input_linear``, its first half of rows the gate's) is not one the MoE layer takes, or None
    (also for a layer without one)."""
    shared = getattr(layer, "shared_mlp", None)
    if shared is None:
        return None
    if _gate_up(shared.input_linear) is None:
        return "a shared MLP whose gate and up projections are neither float32 nor two stored parts"
    if not isinstance(shared.output_linear, (BlockLinear, nn.Linear)):
        return "a shared MLP's output projection neither float32 nor in ggml's blocks"
    return None


def shared_mlp_modules(layer: Any) -> list[Any]:
    """The shared MLP's linear modules (what the runtime's weight checks look at)."""
    shared = getattr(layer, "shared_mlp", None)
    if shared is None:
        return []
    parts = getattr(shared.input_linear, "parts", None)
    return [*(parts if parts is not None else [shared.input_linear]), shared.output_linear]


def _gate_up(fused: Any) -> tuple[LinearWeights, LinearWeights] | None:
    """The gate and up projections of ``input_linear``: a float32 ``nn.Linear`` split in halves of
    rows (as mlx-lm's ``mx.split(..., 2)``), or the GGUF loader's two stored parts in order."""
    if isinstance(fused, nn.Linear) and "bias" not in fused and fused.weight.dtype == mx.float32:
        w = np.asarray(fused.weight)
        half = w.shape[0] // 2
        return (LinearWeights(np.ascontiguousarray(w[:half]), None), LinearWeights(np.ascontiguousarray(w[half:]), None))
    parts, order = getattr(fused, "parts", None), getattr(fused, "row_order", None)
    if parts is None or len(parts) != 2 or order is None:
        return None
    gate, up = (linear_weights(p) for p in parts)
    rows = gate.weight.shape[0]
    if (not all(isinstance(p, (BlockLinear, nn.Linear)) for p in parts) or up.weight.shape[0] != rows
            or not np.array_equal(np.asarray(order), np.arange(2 * rows))):
        return None
    return gate, up


def with_shared_mlp(layer: Any, moe: Any) -> Any:
    """``moe`` (``decode_moe.MoeWeights``) with the layer's Granite shared MLP as its ungated shared
    expert (``x + (experts + shared) * residual_multiplier``, summed in mlx-lm's order), or as it is."""
    shared = getattr(layer, "shared_mlp", None)
    if moe is None or shared is None:
        return moe
    gate, up = _gate_up(shared.input_linear)
    return dataclasses.replace(moe, shared_gate=gate, shared_up=up, shared_down=linear_weights(shared.output_linear))


__all__ = ["GATED_NORMS", "MAMBA_MIXERS", "MambaWeights", "is_mamba", "linear_modules", "mamba_layer", "mamba_weights",
           "mixer_of", "shared_mlp_modules", "shared_mlp_unsupported", "unsupported", "with_shared_mlp"]
