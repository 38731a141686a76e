"""The C description of a Gemma 4 model for ``gemma4_pass.c`` (``struct mlxcel_gemma4``), built once
from a ``decode_gemma4.Gemma4Decoder``'s weights, and the function that runs a pass.

Why apart from ``decode_pass.py``: Gemma 4's pass is its own loop (per-layer head sizes, KV
sharing, per-layer embeddings); its layers' projections are the same ``struct mlxcel_linear``
(``decode_pass.LinearStruct``). Nothing here imports MLX.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlxcel_compat.runtime.native.decode_pass import LinearStruct, array_address, describe_linear

_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float

LINEARS = ("q", "k", "v", "o", "gate", "up", "down", "ple_gate", "ple_proj")
NORMS = ("n_in", "attn_out", "mlp_in", "mlp_out", "q_norm", "k_norm", "v_norm", "ple_norm")
# Sliding layers' prompt-chunk layouts a pass keeps for the KV-sharing layers, times its segments
# (MLXCEL_GEMMA4_KEPT_MAX): the decoder passes no more segments than that allows.
KEPT_MAX = 64
EXPERT_POINTERS = ("router_norm", "expert_scale", "gate_up_exps", "down_exps", "mlp_out_1", "moe_in", "moe_out")
BUFFER_NAMES = ("x", "h", "branch", "q", "kv_rows", "att", "gate", "up", "logits", "ple", "ple_proj", "ple_gate",
                "ple_in")


class Gemma4LayerStruct(ctypes.Structure):
    _fields_ = [*((name, LinearStruct) for name in LINEARS), *((name, _P) for name in NORMS),
                *((name, _I) for name in ("heads", "kv_heads", "head_dim", "rope", "source")), ("layer_scalar", _F),
                ("router", LinearStruct), *((name, _P) for name in EXPERT_POINTERS),
                *((name, _I) for name in ("n_expert", "top_k", "expert_rows", "ring_slot")),
                ("gate_up_f32", _P), ("down_f32", _P)]


class Gemma4Struct(ctypes.Structure):
    _fields_ = [("n_layers", _I), ("hidden", _I), ("ple_dim", _I), ("eps", _F), ("scale", _F), ("k_type", _I),
                ("v_type", _I), ("traditional", _I * 2), ("kv_width", _I), ("layers", _P),
                ("ple_model_proj", LinearStruct), ("ple_proj_norm", _P), ("ple_proj_scale", _F),
                ("ple_input_scale", _F), ("norm", _P), ("head", LinearStruct), ("prompt_rows_min", _I)]


@dataclass(eq=False)
class Gemma4Native:
    """A decoder's model as ``gemma4_pass.c`` reads it, and the function that runs a pass."""

    struct: Gemma4Struct
    keep: list[Any]  # the ctypes arrays the structure points into
    fn: Any  # mlxcel_gemma4_pass

    def run(self, buffers: Any, rows: int, segments: np.ndarray | None, head: bool, kv: np.ndarray,
            angles: np.ndarray, scales: np.ndarray | None) -> int:
        """One pass; 0, or 1 + the layer whose attention did not fit its cache, or -(1 + the layer)
        whose expert stacks the grouped product refused. ``segments``: int32 row offsets of prompt
        chunks (one more than there are chunks), or None for decode rows."""
        return self.fn(ctypes.addressof(self.struct), ctypes.addressof(buffers), rows,
                       array_address(segments),
                       len(segments) - 1 if segments is not None else 0, int(head), kv.ctypes.data,
                       angles.ctypes.data, array_address(scales),
                       scales.shape[1] if scales is not None else 0)


def buffers(arrays: dict[str, np.ndarray]) -> Any:
    """``struct mlxcel_gemma4_buffers`` over one set of activation buffers (kept alive by the caller)."""
    return (_P * len(BUFFER_NAMES))(*(arrays[name].ctypes.data for name in BUFFER_NAMES))


def describe(decoder: Any, lib: ctypes.CDLL) -> Gemma4Native:
    """The C structures of a ``decode_gemma4.Gemma4Decoder`` (its ``layers``, PLE, norm, head)."""
    keep: list[Any] = []
    layers = (Gemma4LayerStruct * len(decoder.layers))()
    for s, layer in zip(layers, decoder.layers):
        for name in LINEARS:
            setattr(s, name, describe_linear(getattr(layer, name), keep))
        for name in NORMS:
            setattr(s, name, array_address(getattr(layer, name)))
        s.heads, s.kv_heads, s.head_dim = layer.heads, layer.kv_heads, layer.head_dim
        s.rope, s.source, s.layer_scalar, s.ring_slot = layer.rope, layer.source, layer.layer_scalar, layer.ring_slot
        experts = layer.experts
        if experts is not None:
            s.router = describe_linear(experts.router, keep)
            for name in ("router_norm", "expert_scale", "mlp_out_1", "moe_in", "moe_out"):
                setattr(s, name, array_address(getattr(experts, name)))
            if experts.gate_up is not None:  # ggml's blocks, else float32 stacks (expert_f32.c)
                s.gate_up_exps, s.down_exps = experts.gate_up.address, experts.down.address
            else:
                s.gate_up_f32, s.down_f32 = array_address(experts.float_gate_up), array_address(experts.float_down)
            s.n_expert, s.top_k, s.expert_rows = experts.n_expert, experts.top_k, experts.rows
    keep.append(layers)
    ple = decoder.ple
    struct = Gemma4Struct(
        n_layers=len(decoder.layers), hidden=decoder.hidden, ple_dim=ple.dim if ple else 0, eps=decoder.eps,
        scale=decoder.scale, k_type=decoder.kv.codes[0], v_type=decoder.kv.codes[1],
        traditional=(_I * 2)(*decoder.traditional), kv_width=decoder.kv_width, layers=ctypes.addressof(layers),
        ple_model_proj=describe_linear(ple.model_proj if ple else None, keep),
        ple_proj_norm=array_address(ple.proj_norm) if ple else None, ple_proj_scale=ple.proj_scale if ple else 0.0,
        ple_input_scale=ple.input_scale if ple else 0.0, norm=array_address(decoder.norm),
        head=describe_linear(decoder.head, keep), prompt_rows_min=decoder.prompt_rows_min)
    fn = lib.mlxcel_gemma4_pass  # the GIL released during the call (ctypes.CDLL's functions)
    fn.restype = _I
    fn.argtypes = [_P, _P, _I, _P, _I, _I, _P, _P, _P, _I]
    return Gemma4Native(struct, keep, fn)


__all__ = ["BUFFER_NAMES", "KEPT_MAX", "Gemma4Native", "Gemma4LayerStruct", "Gemma4Struct", "buffers", "describe"]
