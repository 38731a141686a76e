"""What the CPU decode runtime holds of a hybrid's gated delta-net layer, which ones it takes, and
the recurrent state it updates.

Why: in MLX's step a Qwen3.5 delta-net layer is a dozen small operations a token over a 1 MiB
state (mlx-lm's ``gated_delta_ops`` on the CPU; a prompt a Python loop over its tokens); on a
Qwen3.5-0.8B-shaped file those layers held the step at 0.42x llama-server's speed. The decode
pass's C loop runs the layer instead (the native layer's delta-net mixer: the in-projections on
the blocks, the causal conv over its rolling state, the q/k L2 norms, the gates, the delta rule's update and
readout, the gated RMS norm, the out-projection). This module says which layers it can describe
that way, takes their weights from the modules as they are, and keeps the state where mlx-lm's
cache keeps it.

The state: mlx-lm's ``ArraysCache`` of the layer holds the conv state (``cache[0]``: the last
``kernel - 1`` in-projections, (1, kernel - 1, conv_dim)) and the delta rule's
(``cache[1]``: (1, v_heads, v_dim, k_dim)), float32. The pass updates both in place, but only in
arrays it made for the sequence (:func:`own_states`, recorded in ``OwnedCache.states``): a cache
holding anyone else's (MLX's prefill, a restored snapshot, a prompt-cache hit) gets copies first.
Copies of a cache (``cache/kv.py``: snapshots, prompt-cache entries, slot files) copy recurrent
arrays for real, so the session-snapshot store keeps what the state was when it was taken.

Which layers: mlx-lm's ``qwen3_5`` ``GatedDeltaNet`` (separate q/k/v, z, b and a projections;
the GGUF loader's out-projection may read its input in the file's order, ``InputOrderLinear``)
and ``qwen3_next``'s ``Qwen3NextGatedDeltaNet`` (fused ``in_proj_qkvz``, possibly stored as
parts by the GGUF loader, and ``in_proj_ba``, their columns interleaved per key head: the C
layer gathers them into its layout by ``in_order``), float32 or in ggml's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from mlxcel_compat.runtime.block_layers import BlockLinear
from mlxcel_compat.runtime.decode_layers import LayerWeights, LinearWeights, float32_array, linear_weights, norm_weights

# mlx-lm's delta-net mixers the pass computes, by class name: qwen3_5's separate in-projections,
# qwen3_next's fused ones (their columns interleaved per key head: ``in_order``).
DELTA_MIXERS = ("GatedDeltaNet", "Qwen3NextGatedDeltaNet")
# The hybrids' attention, gated and with a partial RoPE (``gated_q`` and ``rope_dims`` of the pass's C
# description, ``native/decode_pass.py``).
GATED_ATTENTION = ("Qwen3NextAttention",)


@dataclass
class DeltaWeights:
    """One delta-net mixer as ``struct mlxcel_delta`` reads it."""

    inputs: list[LinearWeights]  # qwen3_5: in_proj_qkv, z, b, a; qwen3_next: in_proj_qkvz's parts, in_proj_ba
    in_order: np.ndarray | None  # (2, layout width) int32: input and column of each of [q | k | v | z | b | a]
    out: LinearWeights  # value_dim -> hidden
    conv: np.ndarray  # (conv_dim, kernel)
    decay: np.ndarray  # (v_heads): -exp(A_log), as MLX computes it
    dt_bias: np.ndarray  # (v_heads)
    norm: np.ndarray  # (v_dim)
    out_order: np.ndarray | None  # (value_dim) int32: out_proj's input j is the mixer's output out_order[j]
    eps: float
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    kernel: int

    @property
    def linears(self) -> list[LinearWeights]:
        return [*self.inputs, self.out]

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


def is_delta(layer: Any) -> bool:
    """Whether a decoder layer's mixer is a recurrent one (a ``linear_attn``) instead of attention."""
    return getattr(layer, "linear_attn", None) is not None and getattr(layer, "is_linear", True)


def unsupported(mixer: Any) -> str | None:
    """Why this delta-net mixer stays in MLX's step, or None if the C loop runs it."""
    kind = type(mixer).__name__
    if kind not in DELTA_MIXERS:
        return f"{kind}: not a delta-net mixer the runtime computes"
    qkvz = getattr(mixer, "in_proj_qkvz", None)
    if qkvz is not None and not isinstance(qkvz, (BlockLinear, *_float_linears())) and (
            getattr(qkvz, "row_order", None) is None or len(qkvz.parts) > 2):
        return "a fused delta-net projection of an unknown kind"
    linears = linear_modules(mixer)
    if not all(isinstance(m, (BlockLinear, *_float_linears())) for m in linears):
        return "delta-net projections neither float32 nor in ggml's blocks"
    conv = mixer.conv1d
    if "bias" in conv or conv.weight.shape != (mixer.conv_dim, mixer.conv_kernel_size, 1):
        return "a delta-net conv of unexpected shape"
    if type(mixer.norm).__name__ != "Qwen3NextRMSNormGated":
        return "a delta-net norm other than the gated RMS norm"
    if any(w.dtype != mx.float32 for w in (mixer.A_log, mixer.dt_bias, conv.weight, mixer.norm.weight)):
        return "delta-net parameters other than float32"
    return None


def linear_modules(mixer: Any) -> list[Any]:
    """The mixer's in- and out-projection modules (a stored-parts projection's parts: the
    GGUF loader's ``StoredPartsLinear``), what the runtime's weight checks look at and multiplies."""
    names = ("in_proj_qkvz", "in_proj_ba", "out_proj") if hasattr(mixer, "in_proj_qkvz") else (
        "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
    modules = [getattr(mixer, n, None) for n in names]
    return [p for m in modules for p in (m.parts if getattr(m, "row_order", None) is not None else [m])]


def _fused_order(mixer: Any) -> np.ndarray:
    """qwen3_next's ``in_order``: for each column of the layout [q | k | v | z | b | a], the input
    (in_proj_qkvz's parts, then in_proj_ba) and its column. mlx-lm's
    ``fix_query_key_value_ordering``: per key head j, qkvz's columns are q_j, k_j, then the j-th
    group of v heads and of z heads; ba's are the group's b, then its a."""
    nk, nv, dk, dv = mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
    r = nv // nk
    group = 2 * dk + 2 * r * dv  # one key head's qkvz columns
    heads = np.arange(nk)[:, None]
    q = (heads * group + np.arange(dk)).ravel()
    k = (heads * group + dk + np.arange(dk)).ravel()
    v = (heads * group + 2 * dk + np.arange(r * dv)).ravel()
    z = (heads * group + 2 * dk + r * dv + np.arange(r * dv)).ravel()
    fused = mixer.in_proj_qkvz
    order = getattr(fused, "row_order", None)
    widths = [p.weight.shape[0] if not hasattr(p, "block") else p.block.n for p in linear_modules(mixer)[:-2]]
    source = np.concatenate([q, k, v, z])
    if order is not None:  # model column -> the parts' concatenated column
        source = np.asarray(order)[source]
    starts = np.cumsum([0, *widths])
    part = np.searchsorted(starts, source, side="right") - 1
    column = source - starts[part]
    ba = (heads * 2 * r + np.arange(r)).ravel()
    part = np.concatenate([part, np.full(2 * nv, len(widths)), ])
    column = np.concatenate([column, ba, ba + r])
    return np.ascontiguousarray(np.stack([part, column]), np.int32)


def _float_linears() -> tuple[type, ...]:
    import mlx.nn as nn

    return (nn.Linear,)


def delta_weights(mixer: Any) -> DeltaWeights:
    """A mixer :func:`unsupported` accepts, as the C loop reads it."""
    gather = getattr(mixer.out_proj, "input_gather", None)  # InputOrderLinear: activations taken in the file's order
    decay = -mx.exp(mixer.A_log.astype(mx.float32))  # mlx-lm's compute_g, by MLX's own exp
    mx.eval(decay)
    modules = linear_modules(mixer)
    return DeltaWeights(
        inputs=[linear_weights(m) for m in modules[:-1]], out=linear_weights(modules[-1]),
        in_order=_fused_order(mixer) if hasattr(mixer, "in_proj_qkvz") else None,
        conv=float32_array(mixer.conv1d.weight[..., 0]), decay=float32_array(decay),
        dt_bias=float32_array(mixer.dt_bias), norm=float32_array(mixer.norm.weight),
        out_order=np.ascontiguousarray(np.asarray(gather), np.int32) if gather is not None else None,
        eps=float(mixer.norm.eps), k_heads=int(mixer.num_k_heads), v_heads=int(mixer.num_v_heads),
        k_dim=int(mixer.head_k_dim), v_dim=int(mixer.head_v_dim), kernel=int(mixer.conv_kernel_size))


@dataclass
class OwnedStates:
    """The recurrent arrays the decoder made for one sequence (conv, state per delta layer; the
    state of an LFM2 short convolution, ``decode_conv.py``), the only ones it writes, and their
    addresses (the second 0 for a layer of one array)."""

    arrays: list[tuple[Any, ...]] = field(default_factory=list)
    addresses: list[tuple[int, int]] = field(default_factory=list)
    last: tuple[Any, Any, list[tuple[int, ...]]] | None = None  # the last merged views, by their parts

    def holds(self, layers: list[Any]) -> bool:
        return len(self.arrays) == len(layers) and all(
            len(c.cache) == len(arrays) and all(a is b for a, b in zip(c.cache, arrays))
            for c, arrays in zip(layers, self.arrays))

    def merged(self, views: list[tuple[int, ...]], states: list[tuple[int, int]],
               delta_layers: list[int]) -> list[tuple[int, ...]]:
        """Every layer's ``struct mlxcel_kv`` view: the attention layers' ``views``, and (conv, state, 0)
        at each delta-net layer; the same list while its parts are (the pass keys its addresses by it)."""
        if self.last is not None and self.last[0] is views and self.last[1] is states:
            return self.last[2]
        out = list(views)
        for i, (conv, state) in zip(delta_layers, states):
            out.insert(i, (conv, state, 0))
        self.last = (views, states, out)
        return out


def delta_layer(layer: Any, rope: int, gemma: bool, moe: Any = None) -> LayerWeights:
    """A delta-net decoder layer as ``decode_layers.layer_weights`` gives an attention one: its two
    norms, its MLP (or ``moe``), the mixer's weights in place of attention's."""
    del rope, gemma  # no RoPE; no Gemma hybrid
    m, lin = layer.mlp, linear_weights
    mlp = dict(gate=None, up=None, down=None, moe=moe) if moe is not None else dict(
        gate=lin(m.gate_proj), up=lin(m.up_proj), down=lin(m.down_proj))
    return LayerWeights(n1=norm_weights(layer.input_layernorm), n2=norm_weights(layer.post_attention_layernorm),
                        q=None, k=None, v=None, o=None, q_norm=None, k_norm=None,
                        delta=delta_weights(layer.linear_attn), **mlp)


def is_fresh(layer: Any) -> bool:
    """An ``ArraysCache`` nothing has been fed to yet."""
    return all(a is None for a in layer.cache)


def state_shapes(weights: Any) -> tuple[tuple[int, ...], ...]:
    """The ``ArraysCache`` arrays of one sequence of a recurrent layer: its weights' own
    ``state_shapes`` where they say (an LFM2 short convolution's one array), else a delta-net's
    conv state and delta rule's state under ``DeltaWeights``' names."""
    shapes = getattr(weights, "state_shapes", None)
    if shapes is not None:
        return shapes
    return (1, weights.kernel - 1, weights.conv_dim), (1, weights.v_heads, weights.v_dim, weights.k_dim)


def can_take(layer: Any, weights: Any) -> bool:
    """Whether an ``ArraysCache`` holds one sequence's float32 state of this mixer's shapes
    (:func:`state_shapes`: a delta-net's, an LFM2 short convolution's), or none yet."""
    shapes = state_shapes(weights)
    if type(layer).__name__ != "ArraysCache" or len(layer.cache) != len(shapes) or layer.lengths is not None:
        return False
    if getattr(layer, "left_padding", None) is not None:
        return False
    if is_fresh(layer):
        return True
    return all(a is not None and a.dtype == mx.float32 and a.shape == shape for a, shape in zip(layer.cache, shapes))


def own_states(layers: list[Any], weights: list[Any], owned: OwnedStates) -> list[tuple[int, int]]:
    """Addresses of every recurrent layer's state arrays (a delta layer's conv state and delta
    state; an LFM2 short convolution's one, then 0) that the pass may update in place: the arrays
    made for this sequence, or new ones (the cache's values copied in, zeros for a fresh cache)
    put into the cache first."""
    if owned.holds(layers):
        return owned.addresses
    mx.eval([c.cache for c in layers if not is_fresh(c)])
    owned.arrays, owned.addresses = [], []
    for c, w in zip(layers, weights):
        made = []
        for i, shape in enumerate(state_shapes(w)):
            fresh = mx.zeros(shape, dtype=mx.float32)
            mx.eval(fresh)
            view = np.asarray(fresh)
            if not (view.flags.c_contiguous and view.flags.writeable):
                raise RuntimeError("MLX gave no writable buffer of its own for the recurrent state")
            if c.cache[i] is not None:
                view[...] = np.asarray(c.cache[i])
            made.append((fresh, view.ctypes.data))
        for i, (array, _) in enumerate(made):
            c.cache[i] = array
        owned.arrays.append(tuple(array for array, _ in made))
        owned.addresses.append((made[0][1], made[1][1] if len(made) > 1 else 0))
    return owned.addresses


__all__ = ["DELTA_MIXERS", "GATED_ATTENTION", "DeltaWeights", "OwnedStates", "can_take", "delta_layer", "delta_weights",
           "is_delta",
           "is_fresh", "linear_modules", "own_states", "state_shapes", "unsupported"]
