"""The C description of a model for ``decode_pass.c``, which runs the CPU decode runtime's forward
passes in one call each.

``cpu_decode.CpuDecoder`` holds the model as NumPy buffers and block weights (``decode_layers``);
this module mirrors that as the C structures once (``struct mlxcel_model``: per layer its
projections, norms and RoPE set), keeps every buffer they point to alive, and turns a pass's
per-call state (the rows' KV slots, their RoPE angles, the LoRA scales) into the arrays the C loop
reads. Nothing here imports MLX.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from mlxcel_compat.runtime.native import blas_shim

_P, _I, _F, _D = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_double

# Passes this long or shorter hold the GIL (steps of up to GIL_HELD_ROWS_MAX rows over at most
# this many weight bytes: a few milliseconds) unless a response is being streamed
# (blas_shim.StreamedConsumers); a longer one releases it, so the HTTP side is not held up for a
# whole step of a big model.
GIL_HELD_WEIGHT_BYTES_MAX = 512 << 20
# struct mlxcel_kv: keys, values, k_out, v_out, capacity, write, n, window, blocks, n_blocked, block_tokens
# (8 bytes each)
KV_FIELDS = 11


class LoraStruct(ctypes.Structure):
    _fields_ = [("a", _P), ("b", _P), ("multiplier", _D), ("rank", _I), ("adapter", _I)]


class LinearStruct(ctypes.Structure):
    _fields_ = [("w", _P), ("blocks", _P), ("repacked", _P), ("repacked_matmul", _P), ("prompt", _P),
                ("prompt_matmul", _P), ("bias", _P), ("lora", _P), ("n_lora", _I), ("n", _I), ("k", _I)]


class NormStruct(ctypes.Structure):
    _fields_ = [("w", _P), ("eps", _F), ("bias", _P), ("layer", _I)]


class MoeStruct(ctypes.Structure):
    _fields_ = [("router", LinearStruct), ("gate", _P), ("up", _P), ("down", _P),
                *((name, LinearStruct) for name in ("shared_gate", "shared_up", "shared_down", "shared_scale")),
                ("n_expert", _I), ("top_k", _I), ("rows", _I), ("norm_topk", _I),
                ("gate_bias", _P), ("up_bias", _P), ("down_bias", _P), ("gating", _I), ("clamped", _I),
                ("alpha", _F), ("limit", _F), ("score_bias", _P), ("routed_scale", _F),
                ("n_group", _I), ("topk_group", _I), ("group_by_max", _I),
                ("gate_f32", _P), ("up_f32", _P), ("down_f32", _P)]

# struct mlxcel_moe's gating: the routers' weights as the families compute them (decode_moe.GATING).
GATING_CODES = {"softmax": 0, "topk_softmax": 1, "sigmoid_bias": 2, "sigmoid_bias_eps": 3}


class DeltaStruct(ctypes.Structure):
    _fields_ = [("inputs", _P * 4), ("out", _P), ("in_order", _P), ("n_in", _I), ("in_width", _I * 4),
                *((name, _P) for name in ("conv", "decay", "dt_bias", "norm", "out_order")),
                ("eps", _F), *((name, _I) for name in ("k_heads", "v_heads", "k_dim", "v_dim", "kernel"))]


class MambaStruct(ctypes.Structure):
    """``struct mlxcel_mamba`` (mamba2.h)."""

    _fields_ = [("in_", LinearStruct), ("out", LinearStruct),
                *((name, _P) for name in ("conv", "conv_bias", "decay", "dt_bias", "skip", "norm")),
                *((name, _F) for name in ("eps", "dt_min", "dt_max")),
                *((name, _I) for name in ("heads", "head_dim", "d_state", "groups", "kernel", "norm_group"))]


class ShortConvStruct(ctypes.Structure):
    _fields_ = [("inp", _P), ("out", _P), ("conv", _P), ("hidden", _I), ("kernel", _I)]


class LayerStruct(ctypes.Structure):
    _fields_ = [*((name, LinearStruct) for name in ("q", "k", "v", "o", "gate", "up", "down")),
                *((name, NormStruct) for name in ("n1", "n2", "q_norm", "k_norm", "attn_out", "mlp_out")),
                ("rope", _I), ("moe", _P), ("delta", _P), ("gated_q", _I), ("sinks", _P),
                ("qkv", LinearStruct), ("gate_up", LinearStruct), ("xielu", _F * 4), ("mamba", _P),
                ("conv", _P), ("mla", _P)]


class MlaStruct(ctypes.Structure):
    """``struct mlxcel_mla`` (mla_attention.h): DeepSeek's latent attention."""

    _fields_ = [*((name, LinearStruct) for name in ("q", "q_a", "q_b", "kv_a", "kv_b", "o")),
                ("q_a_norm", _P), ("kv_norm", _P), ("q_a_eps", _F), ("kv_eps", _F), ("embed_q", _P),
                ("unembed_out", _P), *((name, _I) for name in ("heads", "nope", "rope", "kv_lora", "v_dim")),
                ("scale", _F)]


class ModelStruct(ctypes.Structure):
    _fields_ = [("n_layers", _I), ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_dim", _I), ("inter", _I),
                ("act", _I), ("scale", _F), ("angle_sets", _I), ("prompt_rows_min", _I), ("traditional", _I * 2),
                ("layers", _P),
                ("norm", NormStruct), ("head", LinearStruct), ("qk_norm_whole", _I), ("rope_dims", _I), ("k_type", _I),
                ("v_type", _I), ("residual_scale", _F), ("q_scaled", _I), ("parallel", _I),
                ("softcap", _F)]


# struct mlxcel_model's act (MLXCEL_ACT_*): the MLP's activation, by CpuDecoder.act.
ACT_CODES = {"swiglu": 0, "gelu_tanh_gate": 1, "gelu_erf": 2, "xielu": 3, "relu2": 4}

BUFFER_NAMES = ("x", "h", "branch", "q", "k_new", "v_new", "att", "gate", "up", "logits", "q_scale")


def array_address(array: np.ndarray | None) -> int | None:
    """An optional array's data address (None for none: a NULL pointer to the C side)."""
    return array.ctypes.data if array is not None else None


def _address(fn: Any) -> int:
    return ctypes.cast(fn, _P).value or 0


@dataclass(eq=False)
class NativeModel:
    """A decoder's model as ``decode_pass.c`` reads it, and the function that runs a pass."""

    struct: ModelStruct
    keep: list[Any]  # the ctypes arrays the structure points into
    run_released: Any  # mlxcel_decode_pass, the GIL released during the call
    run_held: Any  # and held
    hold_gil: bool  # whether short passes hold it (a small model's)
    address: int = field(init=False)

    def __post_init__(self) -> None:
        self.address = ctypes.addressof(self.struct)

    def run(self, buffers: "NativeBuffers", rows: int, segments: np.ndarray | None, head: int, kv: np.ndarray,
            angles: np.ndarray, scales: np.ndarray | None) -> int:
        """One pass (``mlxcel_decode_pass``); 0, or 1 + the layer whose attention did not fit.
        ``segments``: int32 row offsets of prompt chunks (one more than there are chunks), or
        None for decode rows. ``head``: ``cpu_decode.HEAD_NONE``, ``HEAD_ALL`` or ``HEAD_LAST``."""
        held = (self.hold_gil and segments is None and rows <= blas_shim.GIL_HELD_ROWS_MAX
                and not blas_shim.StreamedConsumers.count)
        fn = self.run_held if held else self.run_released
        return fn(self.address, buffers.address, rows,
                  array_address(segments), len(segments) - 1 if segments is not None else 0,
                  int(head), kv.ctypes.data, angles.ctypes.data,
                  array_address(scales), scales.shape[1] if scales is not None else 0)


@dataclass(eq=False)
class NativeBuffers:
    """``struct mlxcel_buffers`` over one set of the decoder's activation buffers."""

    pointers: Any
    address: int


def buffers(arrays: dict[str, np.ndarray]) -> NativeBuffers:
    pointers = (_P * len(BUFFER_NAMES))(*(arrays[name].ctypes.data for name in BUFFER_NAMES))
    return NativeBuffers(pointers, ctypes.addressof(pointers))


def _linear(lin: Any, keep: list[Any]) -> LinearStruct:
    """``lin``: a ``decode_layers.LinearWeights``, or None (an absent layer: n = 0)."""
    if lin is None:
        return LinearStruct()
    s = LinearStruct(n=lin.weight.shape[0], k=lin.weight.shape[1])
    block = lin.block
    if block is None:
        s.w = lin.ptr
    else:
        s.blocks = block.address
        if block.repacked is not None:
            s.repacked, s.repacked_matmul = block.repacked.handle, _address(block.repacked.lib.matmul)
        if block.prompt is not None:
            s.prompt, s.prompt_matmul = block.prompt.handle, _address(block.prompt.lib.plain_matmul)
    if lin.bias is not None:
        s.bias = lin.bias.ctypes.data
    if lin.lora:
        loras = (LoraStruct * len(lin.lora))(*(
            LoraStruct(lora.a_ptr, lora.b_ptr, float(lora.factor.multiplier), lora.rank, lora.factor.adapter)
            for lora in lin.lora))
        keep.append(loras)
        s.lora, s.n_lora = ctypes.addressof(loras), len(lin.lora)
    return s


def describe_linear(lin: Any, keep: list[Any]) -> LinearStruct:
    """``struct mlxcel_linear`` of a ``decode_layers.LinearWeights`` (or None: n = 0), for the
    passes of other files (Gemma 4's: gemma4_pass.py); its adapters kept alive in ``keep``."""
    return _linear(lin, keep)


def _moe(moe: Any, keep: list[Any]) -> int:
    """``struct mlxcel_moe`` of a ``decode_moe.MoeWeights`` (kept alive in ``keep``), its address;
    0 for None."""
    if moe is None:
        return 0
    stacks = {name: getattr(moe, name).address for name in ("gate", "up", "down") if getattr(moe, name) is not None}
    stacks.update({f"{name}_f32": stack.ctypes.data for name in ("gate", "up", "down")  # float32 stacks (expert_f32.c)
                   if (stack := getattr(moe, f"float_{name}")) is not None})
    s = MoeStruct(router=_linear(moe.router, keep), **stacks,
                  n_expert=moe.n_expert, top_k=moe.top_k, rows=moe.rows, norm_topk=int(moe.norm_topk),
                  gating=GATING_CODES[moe.gating], clamped=int(moe.limit is not None),
                  alpha=moe.alpha or 0.0, limit=moe.limit or 0.0, routed_scale=moe.routed_scale,
                  n_group=moe.n_group, topk_group=moe.topk_group, group_by_max=int(moe.group_by_max))
    for name in ("gate_bias", "up_bias", "down_bias", "score_bias"):
        bias = getattr(moe, name)
        if bias is not None:
            setattr(s, name, bias.ctypes.data)
    for name in ("shared_gate", "shared_up", "shared_down", "shared_scale"):
        setattr(s, name, _linear(getattr(moe, name), keep))
    keep.append(s)
    return ctypes.addressof(s)


def _delta(delta: Any, keep: list[Any]) -> int:
    """``struct mlxcel_delta`` of a ``decode_delta.DeltaWeights`` (kept alive in ``keep``), its
    address; 0 for None. Its projections are ``struct mlxcel_linear``s of their own, pointed to."""
    if delta is None:
        return 0
    inputs = [_linear(lin, keep) for lin in delta.inputs]
    out = _linear(delta.out, keep)
    keep.extend([*inputs, out])
    n = len(inputs)
    s = DeltaStruct((_P * 4)(*(ctypes.addressof(lin) for lin in inputs)), ctypes.addressof(out),
                    array_address(delta.in_order), n,
                    (_I * 4)(*(lin.n for lin in inputs)),
                    *(a.ctypes.data for a in (delta.conv, delta.decay, delta.dt_bias, delta.norm)),
                    array_address(delta.out_order),
                    delta.eps, delta.k_heads, delta.v_heads, delta.k_dim, delta.v_dim, delta.kernel)
    keep.append(s)
    return ctypes.addressof(s)


def _mamba(mamba: Any, keep: list[Any]) -> int:
    """``struct mlxcel_mamba`` of a ``decode_mamba.MambaWeights`` (kept alive in ``keep``), its
    address; 0 for None."""
    if mamba is None:
        return 0
    s = MambaStruct(in_=_linear(mamba.in_proj, keep), out=_linear(mamba.out, keep),
                    conv=mamba.conv.ctypes.data,
                    conv_bias=array_address(mamba.conv_bias),
                    decay=mamba.decay.ctypes.data, dt_bias=mamba.dt_bias.ctypes.data, skip=mamba.skip.ctypes.data,
                    norm=mamba.norm.ctypes.data, eps=mamba.eps, dt_min=mamba.dt_min, dt_max=mamba.dt_max,
                    heads=mamba.heads, head_dim=mamba.head_dim, d_state=mamba.d_state, groups=mamba.groups,
                    kernel=mamba.kernel, norm_group=mamba.norm_group)
    keep.append(s)
    return ctypes.addressof(s)


def _mla(mla: Any, keep: list[Any]) -> int:
    """``struct mlxcel_mla`` of a ``decode_mla.MlaWeights`` (kept alive in ``keep``), its address;
    0 for None."""
    if mla is None:
        return 0
    s = MlaStruct(**{name: _linear(getattr(mla, name), keep) for name in ("q", "q_a", "q_b", "kv_a", "kv_b", "o")},
                  q_a_norm=mla.q_a_norm.ptr if mla.q_a_norm is not None else None, kv_norm=mla.kv_norm.ptr,
                  q_a_eps=mla.q_a_norm.eps if mla.q_a_norm is not None else 0.0, kv_eps=mla.kv_norm.eps,
                  embed_q=array_address(mla.embed_q),
                  unembed_out=array_address(mla.unembed_out),
                  heads=mla.heads, nope=mla.nope, rope=mla.rope, kv_lora=mla.kv_lora, v_dim=mla.v_dim, scale=mla.scale)
    keep.append(s)
    return ctypes.addressof(s)


def _conv(conv: Any, keep: list[Any]) -> int:
    """``struct mlxcel_short_conv`` of a ``decode_conv.ConvWeights`` (kept alive in ``keep``), its
    address; 0 for None."""
    if conv is None:
        return 0
    inp, out = _linear(conv.inp, keep), _linear(conv.out, keep)
    s = ShortConvStruct(ctypes.addressof(inp), ctypes.addressof(out), conv.conv.ctypes.data, conv.hidden, conv.kernel)
    keep.extend([inp, out, s])
    return ctypes.addressof(s)


def _norm(norm: Any) -> NormStruct:
    if norm is None:
        return NormStruct()
    return NormStruct(norm.ptr, norm.eps, array_address(norm.bias), int(norm.layer))


def describe(decoder: Any, lib: ctypes.CDLL) -> NativeModel:
    """The C structures of a ``cpu_decode.CpuDecoder``'s model (its ``layers``, ``norm``, ``head``)."""
    keep: list[Any] = []
    layers = (LayerStruct * len(decoder.layers))()
    for s, layer in zip(layers, decoder.layers):
        for name in ("q", "k", "v", "o", "gate", "up", "down", "qkv", "gate_up"):
            setattr(s, name, _linear(getattr(layer, name), keep))
        for name in ("n1", "n2", "q_norm", "k_norm", "attn_out", "mlp_out"):
            setattr(s, name, _norm(getattr(layer, name)))
        s.rope = layer.rope
        s.moe = _moe(layer.moe, keep)
        s.delta, s.gated_q = _delta(layer.delta, keep), int(layer.gated_q)
        if layer.sinks is not None:
            s.sinks = layer.sinks.ctypes.data
        if layer.xielu is not None:
            s.xielu = (_F * 4)(*layer.xielu)
        s.mamba = _mamba(layer.mamba, keep)
        s.conv = _conv(layer.conv, keep)
        s.mla = _mla(layer.mla, keep)
    keep.append(layers)
    rope_traditional = decoder.angles.traditional
    traditional = (_I * 2)(*[int(t) for t in rope_traditional] + [0] * (2 - len(rope_traditional)))
    struct = ModelStruct(
        n_layers=len(decoder.layers), hidden=decoder.embed.shape[1], heads=decoder.n_heads,
        kv_heads=decoder.n_kv_heads, head_dim=decoder.head_dim, inter=decoder.ffn_width,
        act=ACT_CODES[decoder.act], scale=decoder.scale, angle_sets=len(decoder.angles.ropes),
        prompt_rows_min=decoder.prompt_rows_min, traditional=traditional,
        layers=ctypes.addressof(layers), norm=_norm(decoder.norm), head=_linear(decoder.head, keep),
        qk_norm_whole=int(decoder.qk_norm_whole), rope_dims=decoder.rope_dims, k_type=decoder.kv.codes[0],
        v_type=decoder.kv.codes[1], residual_scale=decoder.residual_scale,
        q_scaled=int(decoder.q_temperature is not None), parallel=int(decoder.parallel),
        softcap=decoder.attn_softcap)
    held_lib = blas_shim.holding_the_gil(lib)
    fns = [lib.mlxcel_decode_pass, held_lib.mlxcel_decode_pass]
    for fn in fns:
        fn.restype = _I
        fn.argtypes = [_P, _P, _I, _P, _I, _I, _P, _P, _P, _I]
    weight_bytes = sum(_weight_bytes(lin) for layer in decoder.layers
                       for lin in (layer.q, layer.k, layer.v, layer.o, layer.gate, layer.up, layer.down, layer.qkv,
                                   layer.gate_up)
                       if lin is not None)
    weight_bytes += sum(layer.moe.nbytes + sum(_weight_bytes(lin) for lin in layer.moe.linears)
                        for layer in decoder.layers if layer.moe is not None)
    weight_bytes += sum(_weight_bytes(lin) for layer in decoder.layers if layer.delta is not None
                        for lin in layer.delta.linears)
    weight_bytes += sum(_weight_bytes(lin) for layer in decoder.layers if layer.mamba is not None
                        for lin in layer.mamba.linears)
    weight_bytes += sum(_weight_bytes(lin) for layer in decoder.layers if layer.conv is not None
                        for lin in layer.conv.linears)
    weight_bytes += sum(_weight_bytes(lin) for layer in decoder.layers if layer.mla is not None
                        for lin in layer.mla.linears)
    weight_bytes += _weight_bytes(decoder.head)
    return NativeModel(struct, keep, fns[0], fns[1], weight_bytes <= GIL_HELD_WEIGHT_BYTES_MAX)


def _weight_bytes(lin: Any) -> int:
    return lin.block.nbytes if lin.block is not None else lin.weight.nbytes


def lora_scales(scales: Sequence[Sequence[float] | None] | None) -> np.ndarray | None:
    """Per row, each adapter's LoRA scale (float64, zeros where a row names fewer adapters), or
    None when no row has a non-zero one (the base model: no adapter's product runs)."""
    if not scales or not any(row and any(row) for row in scales):
        return None
    n = max(len(row) for row in scales if row)
    out = np.zeros((len(scales), n), np.float64)
    for i, row in enumerate(scales):
        if row:
            out[i, :len(row)] = row
    return out
