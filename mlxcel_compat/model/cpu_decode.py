"""Decode steps outside MLX, one sequence or a batch, for dense llama-style models on the CPU.

Why: on the CPU, MLX runs a decode step as ~900 scheduled operations, kept in lockstep with the
engine thread that queues them (docs/benchmarks.md, issue 15: ``MAX_ACTIVE_TASKS``), and its
exponential is a scalar loop. The weight matrix-vector products, which are the step's real work,
already run at the machine's streaming speed in the BLAS shim's kernel (``blas_shim.c``); what
kept the step at 1.6-1.8x that speed was everything around them. Here the same step is a short,
fixed sequence of calls into the shim's library, made by the engine thread itself: per layer
one RMS norm, the projections (the shim's matrix-vector kernel, residuals added by the kernel's
``beta``), one RoPE call each for queries and keys, one attention call for every head (the new
key and value written into the cache, a vectorized softmax, the heads spread over the shim's
threads) and one SiLU-gating call. NumPy holds the buffers; nothing is allocated per step.

The KV cache stays mlx-lm's ``KVCache``: the step writes the new position into the cache's own
MLX buffers (NumPy views of them) and advances ``offset``, so prefill, batching, the prompt
cache and slot files see the cache exactly as MLX's step would have left it. MLX arrays are
immutable to everything else, so the step writes only into buffers it made itself for this
sequence (:class:`OwnedCache`): at its first step, and whenever someone else replaced a layer's
arrays (a merged MLX batch, MLX's own step), it copies the layer into a fresh buffer first; the arrays
others hold (prompt-cache entries, a sibling completion's prefix) are never written.

Several sequences decoding together (a batch) are stepped at once (:meth:`CpuDecoder.step_rows`),
each on its own cache: the projections take every row in one pass over the weights.

Which models: mlx-lm's ``llama`` (and ``mistral``, which mlx-lm runs as llama), ``qwen2`` and
``qwen3`` modules with float32 weights, every layer a plain ``KVCache``. Anything else (quantized
weights, other families, sliding windows) keeps MLX's step; :func:`build` says why.

Exactness: the logits match MLX's to float32 rounding (a different summation order and a
polynomial ``2 ** x`` within 1e-7), tested per family against the MLX step, greedy tokens
included (``tests/test_cpu_decode.py``).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxcel_compat.model.block_layers import BlockEmbedding, BlockLinear, block_weight_of
from mlxcel_compat.model.block_weight import BlockWeight

LOG2E = 1.4426950408889634
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ANGLE_BLOCK = 256  # RoPE angles are computed by MLX for this many positions at a time
ANGLE_BLOCKS_KEPT = 64  # blocks of angles kept (a batch's rows sit at different positions)

# CBLAS constants (cblas.h).
_ROW_MAJOR, _NO_TRANS, _TRANS = 101, 111, 112


def enabled() -> bool:
    """``MLXCEL_CPU_DECODE=0`` keeps MLX's decode step (for comparison, or as a fallback)."""
    return os.environ.get("MLXCEL_CPU_DECODE", "1").strip().lower() not in ("0", "off", "false", "no")


def _f32(a: Any) -> np.ndarray:
    """A float32 NumPy view of an evaluated MLX array (its buffer), or a contiguous copy."""
    return np.ascontiguousarray(np.asarray(a), dtype=np.float32)


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


@dataclass
class _Linear:
    weight: np.ndarray | BlockWeight  # (N, K): the module's own float32 buffer, or its blocks
    bias: np.ndarray | None
    ptr: int = field(init=False)  # the weight's address, taken once (``ndarray.ctypes`` costs ~1 us a call)
    block: BlockWeight | None = field(init=False)  # quantized (ggml's kernels), else None

    def __post_init__(self) -> None:
        self.block = self.weight if isinstance(self.weight, BlockWeight) else None
        self.ptr = 0 if self.block is not None else _ptr(self.weight)


@dataclass
class _Norm:
    weight: np.ndarray
    eps: float
    ptr: int = field(init=False)

    def __post_init__(self) -> None:
        self.ptr = _ptr(self.weight)


@dataclass
class _Layer:
    n1: _Norm  # before attention
    n2: _Norm  # before the MLP
    q: _Linear
    k: _Linear
    v: _Linear
    o: _Linear
    gate: _Linear
    up: _Linear
    down: _Linear
    q_norm: _Norm | None  # qwen3's per-head norms
    k_norm: _Norm | None


@dataclass
class _Buffers:
    """One step's activations for ``rows`` sequences, allocated once per row count, with their
    addresses (the step passes them to the kernels ~20 times a layer)."""

    x: np.ndarray  # (rows, hidden): the residual stream
    h: np.ndarray  # (rows, hidden): normed
    q: np.ndarray  # (rows, heads * head_dim)
    k_new: np.ndarray  # (rows, kv_heads * head_dim): the new keys
    v_new: np.ndarray  # and values
    att: np.ndarray  # (rows, heads * head_dim)
    gate: np.ndarray  # (rows, intermediate)
    up: np.ndarray
    logits: np.ndarray  # (rows, vocabulary)
    ptr: dict[str, int] = field(init=False)  # by field name
    rows: list[tuple[int, int, int, int]] = field(init=False)  # per row: q, new key, new value, att

    def __post_init__(self) -> None:
        self.ptr = {name: _ptr(a) for name, a in vars(self).items() if isinstance(a, np.ndarray)}
        self.rows = [(_ptr(q), _ptr(k), _ptr(v), _ptr(a)) for q, k, v, a in zip(self.q, self.k_new, self.v_new, self.att)]


@dataclass
class OwnedCache:
    """The MLX arrays (keys, values per layer) the decoder made for one sequence: the only
    buffers it may write. A new sequence starts with none."""

    arrays: list[tuple[Any, Any]] = field(default_factory=list)
    views: list[tuple[int, int, int]] = field(default_factory=list)  # per layer: keys, values, capacity

    def holds(self, cache: list[Any]) -> bool:
        """Whether every layer of ``cache`` still holds the arrays made for it."""
        return len(self.arrays) == len(cache) and all(
            c.keys is a and c.values is b for c, (a, b) in zip(cache, self.arrays))


class _Kernels:
    """The shim's decode-step functions and its cblas_sgemm, with ctypes argument types."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        p, i, f, L = ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_long
        self.sgemm = self._fn(lib.cblas_sgemm, [i, i, i, i, i, i, f, p, i, p, i, f, p, i])
        self.rms_norm = self._fn(lib.mlxcel_rms_norm, [p, p, p, i, i, f])
        self.rope = self._fn(lib.mlxcel_rope, [p, i, i, p, p, i])
        self.swiglu = self._fn(lib.mlxcel_swiglu, [p, p, i])
        self.attention = self._fn(lib.mlxcel_decode_attention, [p, p, p, p, p, p, i, i, i, i, L, f])

    @staticmethod
    def _fn(fn: Any, argtypes: list[Any]) -> Any:
        fn.restype = None
        fn.argtypes = argtypes
        return fn


def _head_dim(attn: Any) -> int:
    block = block_weight_of(attn.q_proj)
    rows = block.n if block is not None else attn.q_proj.weight.shape[0]
    return rows // attn.n_heads


def unsupported(model: Any) -> str | None:
    """Why this model's decode steps stay in MLX, or None if :class:`CpuDecoder` runs them."""
    model_type = getattr(getattr(model, "args", None), "model_type", None)
    if model_type not in MODEL_TYPES:
        return f"model type {model_type!r} (supported: {', '.join(MODEL_TYPES)})"
    if any(type(m).__name__.startswith("Quantized") for _, m in model.named_modules()):
        return "quantized weights"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers or not isinstance(getattr(inner, "embed_tokens", None), (nn.Embedding, BlockEmbedding)):
        return "unexpected module layout"
    if getattr(model.args, "sliding_window", None) and any(t != "full_attention" for t in getattr(model.args, "layer_types", None) or ()):
        return "sliding-window layers"
    head = model.lm_head if hasattr(model, "lm_head") else inner.embed_tokens
    weights = [m.weight for m in (inner.embed_tokens, head) if block_weight_of(m) is None]
    for layer in layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not any(c.__name__ == "MLP" for c in type(mlp).__mro__):
            return "unexpected layer layout"
        projections = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        projections += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(m, (nn.Linear, BlockLinear)) for m in projections) or not hasattr(attn, "n_heads"):
            return "unexpected attention layout"
        norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
        norms += [getattr(attn, n) for n in ("q_norm", "k_norm") if hasattr(attn, n)]
        if not all(isinstance(n, nn.RMSNorm) for n in norms):
            return "norms other than RMSNorm"
        if getattr(getattr(attn, "rope", None), "dims", None) != _head_dim(attn):
            return "partial or unknown rotary embedding"
        weights += [m.weight for m in projections if block_weight_of(m) is None]
    if any(w.dtype != mx.float32 for w in weights):
        return "weights are neither float32 nor in ggml's blocks"
    return None


def build(model: Any, shim: Any) -> "CpuDecoder | str":
    """The decoder for ``model``, or why there is none (logged at start-up)."""
    if not enabled():
        return "off (MLXCEL_CPU_DECODE=0)"
    if shim is None:
        return "the BLAS shim's kernels are not loaded"
    try:
        kernels = _Kernels(shim.lib)
    except AttributeError:  # a library built from an older source
        return "the loaded shim has no decode-step kernels"
    reason = unsupported(model)
    if reason is not None:
        return reason
    return CpuDecoder(model, kernels)


class CpuDecoder:
    """Decode steps of one sequence or several, for a model :func:`unsupported` accepts.

    Not thread-safe: the engine thread owns it, as it owns the model.
    """

    def __init__(self, model: Any, kernels: _Kernels) -> None:
        self.k = kernels
        inner = model.model
        mx.eval(model.parameters())
        attn0 = inner.layers[0].self_attn
        self.n_heads, self.n_kv_heads = attn0.n_heads, attn0.n_kv_heads
        self.head_dim = _head_dim(attn0)
        self.scale = float(attn0.scale) * LOG2E
        self.rope = attn0.rope
        self.traditional = bool(getattr(self.rope, "traditional", False))
        self.embed = block_weight_of(inner.embed_tokens) or _f32(inner.embed_tokens.weight)
        self.norm = self._norm(inner.norm)
        head = model.lm_head if hasattr(model, "lm_head") else inner.embed_tokens
        self.head = _Linear(block_weight_of(head) or _f32(head.weight), None)
        self.layers = [self._layer(layer) for layer in inner.layers]
        self._buffers: dict[int, _Buffers] = {}  # by row count
        self._angle_blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # first position -> (cos, sin)
        self.steps = 0  # steps run so far (tests and benchmarks check that it ran)

    @staticmethod
    def _linear(module: Any) -> _Linear:
        bias = module.bias if "bias" in module else None
        return _Linear(block_weight_of(module) or _f32(module.weight), _f32(bias) if bias is not None else None)

    @staticmethod
    def _norm(module: Any) -> _Norm | None:
        return _Norm(_f32(module.weight), float(module.eps)) if module is not None else None

    def _layer(self, layer: Any) -> _Layer:
        a, m, lin, norm = layer.self_attn, layer.mlp, self._linear, self._norm
        return _Layer(
            n1=norm(layer.input_layernorm), n2=norm(layer.post_attention_layernorm),
            q=lin(a.q_proj), k=lin(a.k_proj), v=lin(a.v_proj), o=lin(a.o_proj),
            gate=lin(m.gate_proj), up=lin(m.up_proj), down=lin(m.down_proj),
            q_norm=norm(getattr(a, "q_norm", None)), k_norm=norm(getattr(a, "k_norm", None)),
        )

    # ------------------------------------------------------------------ eligibility

    @staticmethod
    def can_run(cache: list[Any], owned: OwnedCache) -> bool:
        """Whether ``cache`` is one sequence's plain float32 KV cache: the buffers this decoder
        made for it (the common case, checked by identity), or mlx-lm ``KVCache`` layers holding
        one row of float32 keys and values."""
        from mlx_lm.models.cache import KVCache

        return owned.holds(cache) or all(
            type(c) is KVCache and c.keys is not None and c.keys.ndim == 4 and c.keys.shape[0] == 1
            and c.keys.dtype == mx.float32 and c.values.dtype == mx.float32 for c in cache
        )

    # ------------------------------------------------------------------ the step

    def step(self, token: int, cache: list[Any], owned: OwnedCache) -> np.ndarray:
        """Feed ``token`` at position ``cache[0].offset``; return the logits (a buffer reused by
        the next step: copy it before then). The cache advances by one position."""
        return self.step_rows([token], [cache], [owned])[0]

    def step_rows(self, tokens: list[int], caches: list[list[Any]], owned: list[OwnedCache]) -> np.ndarray:
        """One step of several sequences at once, each on its own cache at its own position:
        the projections take all rows in one pass over each weight (the shim's kernel reads a
        weight row once for up to 16 rows, and computes each row exactly as it would alone, so a
        row's logits are bit-identical to its step alone); RoPE and attention go row by row.
        Returns (rows, vocabulary) logits, a buffer reused by the next step. If anything raises,
        no cache has advanced (a position written past ``offset`` is unused)."""
        vocab = self.embed.shape[0]
        for token in tokens:
            if not 0 <= token < vocab:  # NumPy would wrap a negative index silently
                raise ValueError(f"token id {token} is outside the vocabulary (0..{vocab - 1})")
        rows = len(tokens)
        positions = [cache[0].offset for cache in caches]
        views = [self._own(cache, o, pos) for cache, o, pos in zip(caches, owned, positions)]
        if len(self._angle_blocks) > ANGLE_BLOCKS_KEPT:
            self._angle_blocks.clear()  # between steps: no address handed out below is freed
        angles = [self._angle_row(pos) for pos in positions]
        b = self._buffers_for(rows)
        k, p, mv, trad = self.k, b.ptr, self._mv, self.traditional
        hq, hk, d = self.n_heads, self.n_kv_heads, self.head_dim
        group, hidden = hq // hk, b.x.shape[1]
        if isinstance(self.embed, BlockWeight):
            self.embed.take(tokens, out=b.x)
        else:
            np.take(self.embed, tokens, axis=0, out=b.x)
        for i, layer in enumerate(self.layers):
            k.rms_norm(p["x"], layer.n1.ptr, p["h"], rows, hidden, layer.n1.eps)
            mv(layer.q, b, "h", "q")
            mv(layer.k, b, "h", "k_new")
            mv(layer.v, b, "h", "v_new")
            if layer.q_norm is not None:
                k.rms_norm(p["q"], layer.q_norm.ptr, p["q"], rows * hq, d, layer.q_norm.eps)
                k.rms_norm(p["k_new"], layer.k_norm.ptr, p["k_new"], rows * hk, d, layer.k_norm.eps)
            for (q, kn, vn, att), (cos, sin), pos, row_views in zip(b.rows, angles, positions, views):
                keys, values, capacity = row_views[i]
                k.rope(q, hq, d, cos, sin, trad)
                k.rope(kn, hk, d, cos, sin, trad)
                k.attention(q, kn, vn, keys, values, att, hk, group, d, pos, capacity, self.scale)
            mv(layer.o, b, "att", "x", accumulate=True)
            k.rms_norm(p["x"], layer.n2.ptr, p["h"], rows, hidden, layer.n2.eps)
            mv(layer.gate, b, "h", "gate")
            mv(layer.up, b, "h", "up")
            k.swiglu(p["gate"], p["up"], b.gate.size)
            mv(layer.down, b, "gate", "x", accumulate=True)
        k.rms_norm(p["x"], self.norm.ptr, p["h"], rows, hidden, self.norm.eps)
        mv(self.head, b, "h", "logits")
        for cache in caches:
            for c in cache:
                c.offset += 1
        self.steps += rows
        return b.logits

    def _buffers_for(self, rows: int) -> _Buffers:
        b = self._buffers.get(rows)
        if b is None:
            hidden, inter = self.embed.shape[1], self.layers[0].gate.weight.shape[0]
            hq, hk, d = self.n_heads, self.n_kv_heads, self.head_dim

            def buf(n: int) -> np.ndarray:
                return np.empty((rows, n), np.float32)

            b = self._buffers[rows] = _Buffers(x=buf(hidden), h=buf(hidden), q=buf(hq * d), k_new=buf(hk * d), v_new=buf(hk * d),
                                               att=buf(hq * d), gate=buf(inter), up=buf(inter),
                                               logits=buf(self.head.weight.shape[0]))
        return b

    def _mv(self, lin: _Linear, b: _Buffers, x: str, out: str, accumulate: bool = False) -> None:
        """b.out = b.x W^T (+ bias), or b.out += b.x W^T (+ bias), for every row: the shim's kernel."""
        n, kk = lin.weight.shape
        if lin.block is not None:  # ggml's vec_dot, row by row: a row's result never depends on the others
            lin.block.matmul_into(b.x.shape[0], b.ptr[x], kk, b.ptr[out], n, 1.0 if accumulate else 0.0)
        else:
            self.k.sgemm(_ROW_MAJOR, _NO_TRANS, _TRANS, b.x.shape[0], n, kk, 1.0, b.ptr[x], kk, lin.ptr, kk,
                         1.0 if accumulate else 0.0, b.ptr[out], n)
        if lin.bias is not None:
            getattr(b, out)[...] += lin.bias

    # ------------------------------------------------------------------ the cache

    def _own(self, cache: list[Any], owned: OwnedCache, pos: int) -> list[tuple[int, int, int]]:
        """Addresses of every layer's keys and values, and their capacity, with room for
        position ``pos``: the buffers made for this sequence, copied first if the cache holds
        others now (or they are full)."""
        if owned.holds(cache) and all(pos < capacity for _, _, capacity in owned.views):
            return owned.views
        mx.eval([(c.keys, c.values) for c in cache])
        owned.arrays, owned.views = [], []
        for c in cache:
            keys, values = (self._fresh(a, pos, c.step) for a in (c.keys, c.values))
            c.keys, c.values = keys, values
            owned.arrays.append((keys, values))
            owned.views.append((_ptr(np.asarray(keys)), _ptr(np.asarray(values)), keys.shape[2]))
        return owned.views

    @staticmethod
    def _fresh(a: Any, pos: int, step: int) -> Any:
        """A new MLX array with ``a``'s first ``pos`` positions and room for at least one more
        (capacity rounded up to the cache's allocation step, as mlx-lm's cache grows): one
        buffer of MLX's, filled through a NumPy view of it."""
        b, h, cap, d = a.shape
        capacity = max(cap, (pos // step + 1) * step)
        fresh = mx.zeros((b, h, capacity, d), dtype=mx.float32)
        mx.eval(fresh)
        view = np.asarray(fresh)
        if not (view.flags.c_contiguous and view.flags.writeable):  # e.g. a broadcast constant: not ours to write
            raise RuntimeError("MLX gave no writable buffer of its own for the KV cache")
        view[:, :, :pos] = np.asarray(a)[:, :, :pos]
        return fresh

    def _angle_row(self, pos: int) -> tuple[int, int]:
        """Addresses of cos and sin of position ``pos``'s RoPE angles, as the model's RoPE module computes
        them: it is applied to unit vectors (rotating (1, 0) gives (cos, sin)) for a block of
        positions at a time, so every scaling variant mlx-lm implements is taken as it is. The
        blocks stay until there are more than ``ANGLE_BLOCKS_KEPT`` (rows of a batch sit at
        different positions)."""
        first = pos - pos % ANGLE_BLOCK
        block = self._angle_blocks.get(first)
        if block is None:
            d, half = self.head_dim, self.head_dim // 2
            unit = np.zeros((1, 1, ANGLE_BLOCK, d), np.float32)
            if self.traditional:
                unit[..., 0::2] = 1.0
            else:
                unit[..., :half] = 1.0
            probe = np.array(self.rope(mx.array(unit), offset=first))[0, 0]
            if self.traditional:
                cos, sin = probe[:, 0::2], probe[:, 1::2]
            else:
                cos, sin = probe[:, :half], probe[:, half:]
            block = self._angle_blocks[first] = (np.ascontiguousarray(cos), np.ascontiguousarray(sin))
        cos, sin = block
        row = (pos - first) * cos.strides[0]
        return _ptr(cos) + row, _ptr(sin) + row


__all__ = ["CpuDecoder", "OwnedCache", "build", "enabled", "unsupported"]
