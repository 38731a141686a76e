"""Gemma 4's decode steps on the CPU decode runtime (mlx-lm's ``gemma4_text``; GGUF ``gemma4``): one
sequence or a batch of rows, each on its own cache, through the shim's ``mlxcel_gemma4_pass``
(``native/gemma4_pass.py`` describes the model to it).

Why its own decoder beside ``cpu_decode.CpuDecoder``: a Gemma 4 model is not the uniform stack the
other families' pass and KV layout assume. Its sliding layers have one head size (and KV head
count) and its full layers another, with a *proportional* RoPE (a rotated share of each head,
the frequencies over the whole head: the angle tables below are made by the layers' own RoPE
modules, so the unrotated pairs get cos 1 and sin 0); the last ``num_kv_shared_layers`` layers
have no cache of their own (mlx-lm's ``make_cache`` gives one per earlier layer) and attend over
the last earlier layer of their kind; the per-layer embeddings (PLE) add, after each layer's MLP,
a gated branch whose inputs are a second embedding and a projection of the first; values are
normed without a gain (and under ``attention_k_eq_v`` are the keys' projection), every layer ends
scaled by its ``layer_scalar``, the 26B-A4B layout has experts beside each dense MLP (their own
router, gating and norms: :class:`Gemma4Experts`), and the logits are soft-capped
(``decode_families.LogitTransform``, by MLX's tanh).

What it shares with the other families: the KV bookkeeping (``decode_kv.KvLayout`` and
``sequence_kv.SequenceKv`` over the layers with a cache: the step writes into buffers it made for
the sequence and leaves each ``KVCache`` and ``RotatingKVCache`` as mlx-lm's update would), the
weights as they are held (``decode_layers``: float32 buffers or ggml's blocks), the kernels.

Prompt chunks: every row of a chunk (or of several sequences' chunks) through each weight at once,
the full layers' causal chunk attention, the sliding layers' rings laid out as mlx-lm's chunk lays
them out (``ring_chunks``, one KV layout a kind of layer), the KV-sharing layers over their sliding
source's kept layout (``ring_slot``).

What it does not take (MLX does, and the caller asks first: ``can_run``, ``can_prefill``,
``can_step_tokens``): several tokens of one sequence in one pass (speculative drafts: rings take
one token a step), prompt-cache hits on shared KV blocks (``PagedKVCache`` layers: their own
buffers would need the layers' two shapes), and experts that are neither the GGUF loader's block
stacks nor a directory's float stacks (:func:`unsupported` says so).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxcel_compat.runtime import kv_blocks, kv_precision, ring_chunks
from mlxcel_compat.runtime.block_experts import BlockSwitchLinear
from mlxcel_compat.runtime.block_layers import BlockLinear, block_weight_of
from mlxcel_compat.runtime.block_weight import BlockWeight
from mlxcel_compat.runtime.decode_kv import KvLayout, OwnedCache, paged, ring_plan
from mlxcel_compat.runtime.decode_layers import LinearWeights, check_token_ids, float32_array, linear_weights
from mlxcel_compat.runtime.decode_moe import stack_kind
from mlxcel_compat.runtime.native import decode_pass, gemma4_pass
from mlxcel_compat.runtime.rope_angles import RopeAngles
from mlxcel_compat.runtime.sequence_kv import SequenceKv

MODEL_TYPE = "gemma4_text"
# A prompt chunk this long or longer takes the prompt products (cpu_decode.PROMPT_ROWS_MIN's rule,
# whose module this one does not import: cpu_decode builds this decoder).
PROMPT_ROWS_MIN = 17
LOG2E = 1.4426950408889634


def takes(model: Any) -> bool:
    """Whether ``model`` is a Gemma 4 text model (this decoder's, if :func:`unsupported` agrees)."""
    return getattr(getattr(model, "args", None), "model_type", None) == MODEL_TYPE


def unsupported(model: Any) -> str | None:
    """Why this Gemma 4 model's steps stay in MLX, or None if :class:`Gemma4Decoder` runs them."""
    if any(type(m).__name__.startswith("Quantized") for _, m in model.named_modules()):
        return "quantized weights"
    inner = model.model
    weights = [inner.embed_tokens.weight] if block_weight_of(inner.embed_tokens) is None else []
    for layer in inner.layers:
        attn = layer.self_attn
        modules = [attn.q_proj, attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj]
        modules += [attn.k_proj] + ([] if attn.use_k_eq_v else [attn.v_proj]) if attn.has_kv else []
        if layer.per_layer_input_gate is not None:
            modules += [layer.per_layer_input_gate, layer.per_layer_projection]
        if not all(isinstance(m, (nn.Linear, BlockLinear)) for m in modules):
            return "unexpected layer layout"
        if getattr(attn.rope, "traditional", False):
            return "traditional (interleaved) RoPE"
        if layer.enable_moe:
            reason = _experts_unsupported(layer)
            if reason is not None:
                return reason
            modules.append(layer.router.proj)
        weights += [m.weight for m in modules if block_weight_of(m) is None]
    if inner.hidden_size_per_layer_input and block_weight_of(inner.per_layer_model_projection) is None:
        weights.append(inner.per_layer_model_projection.weight)
    if any(w.dtype != mx.float32 for w in weights):
        return "weights are neither float32 nor in ggml's blocks"
    return None


def _experts_unsupported(layer: Any) -> str | None:
    """Why a layer's experts (the 26B-A4B layout) stay in MLX's step, or None: the C pass takes the
    GGUF loader's stacks in ggml's blocks (a fused gate-up stack and a down stack), or a
    directory's ``SwitchGLU`` of float stacks (``decode_moe.stack_kind``: gate and up fused into one
    float32 array at load)."""
    switch = layer.experts.switch_glu
    if type(switch).__name__ == "SwitchGLU" and stack_kind(switch) == "float":
        gate, up, down = (tuple(getattr(switch, n).weight.shape) for n in ("gate_proj", "up_proj", "down_proj"))
        if gate != up or down != (gate[0], gate[2], gate[1]) or any("bias" in getattr(switch, n)
                                                                     for n in ("gate_proj", "up_proj", "down_proj")):
            return "gemma4_text expert stacks of unexpected shapes"
        return None
    stacks = [getattr(switch, n, None) for n in ("gate_up_proj", "down_proj")]
    if type(switch).__name__ != "FusedGateUpSwitchGLU" or not all(isinstance(s, BlockSwitchLinear) for s in stacks):
        return ("model type 'gemma4_text' with experts not in ggml's blocks (a GGUF's stacks): its steps run in "
                "MLX's step")
    gate_up, down = (s.stack for s in stacks)
    if gate_up.n_expert != down.n_expert or gate_up.rows != 2 * down.weight.k or "bias" in stacks[0] or "bias" in stacks[1]:
        return "gemma4_text expert stacks of unexpected shapes"
    return None


@dataclass
class Gemma4Experts:
    """A layer's experts beside its MLP (the 26B-A4B layout), as ``struct mlxcel_gemma4_layer`` reads them."""

    router: LinearWeights  # hidden -> n_expert
    router_norm: np.ndarray  # the router input's gain: scale * hidden^-0.5 (computed by MLX, as the module does)
    expert_scale: np.ndarray  # per_expert_scale (n_expert)
    gate_up: BlockWeight | None  # (n_expert * 2 * rows, hidden): each expert's gate rows, then its up rows
    down: BlockWeight | None  # (n_expert * hidden, rows); None: the float32 stacks below
    mlp_out_1: np.ndarray  # post_feedforward_layernorm_1: the MLP's output
    moe_in: np.ndarray  # pre_feedforward_layernorm_2: the experts' input
    moe_out: np.ndarray  # post_feedforward_layernorm_2: their output
    n_expert: int
    top_k: int
    rows: int  # an expert's intermediate width
    float_gate_up: np.ndarray | None = None  # a directory's: (n_expert, 2 * rows, hidden) float32, gate rows then up
    float_down: np.ndarray | None = None  # (n_expert, hidden, rows) float32


def _experts(layer: Any, hidden: int) -> Gemma4Experts | None:
    if not layer.enable_moe:
        return None
    router, switch = layer.router, layer.experts.switch_glu
    if type(switch).__name__ == "SwitchGLU":  # a directory's float stacks: gate and up fused, all float32
        gate, up, down = (getattr(switch, n).weight.astype(mx.float32) for n in ("gate_proj", "up_proj", "down_proj"))
        n_expert, rows = gate.shape[0], gate.shape[1]
        return Gemma4Experts(
            linear_weights(router.proj), float32_array(router.scale * (hidden ** -0.5)),
            float32_array(router.per_expert_scale), None, None, _norm(layer.post_feedforward_layernorm_1),
            _norm(layer.pre_feedforward_layernorm_2), _norm(layer.post_feedforward_layernorm_2), n_expert,
            int(router.config.top_k_experts), rows, float_gate_up=float32_array(mx.concatenate([gate, up], axis=1)),
            float_down=float32_array(down))
    gate_up, down = switch.gate_up_proj.stack, switch.down_proj.stack
    return Gemma4Experts(
        linear_weights(router.proj), float32_array(router.scale * (hidden ** -0.5)), float32_array(router.per_expert_scale),
        gate_up.weight, down.weight, _norm(layer.post_feedforward_layernorm_1), _norm(layer.pre_feedforward_layernorm_2),
        _norm(layer.post_feedforward_layernorm_2), gate_up.n_expert, int(router.config.top_k_experts), gate_up.rows // 2)


@dataclass
class Gemma4Layer:
    """One layer as the C pass reads it (``struct mlxcel_gemma4_layer``)."""

    q: LinearWeights
    k: LinearWeights | None  # None: a KV-sharing layer
    v: LinearWeights | None  # None: values are the keys' projection (attention_k_eq_v), or KV-sharing
    o: LinearWeights
    gate: LinearWeights
    up: LinearWeights
    down: LinearWeights
    ple_gate: LinearWeights | None
    ple_proj: LinearWeights | None
    n_in: np.ndarray
    attn_out: np.ndarray
    mlp_in: np.ndarray
    mlp_out: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray | None
    v_norm: np.ndarray  # ones: mlx-lm's RMSNormNoScale
    ple_norm: np.ndarray | None
    heads: int
    kv_heads: int
    head_dim: int
    rope: int  # 0: the sliding layers' angles, 1: the full layers'
    source: int  # the layer whose KV it attends over (itself, or an earlier one for a KV-sharing layer)
    layer_scalar: float
    experts: Gemma4Experts | None = None  # the 26B-A4B layout's, beside the MLP
    ring_slot: int = 0  # a sliding source of KV-sharing layers: 1 + which kept chunk layout (theirs too); else 0


@dataclass
class PerLayerEmbeddings:
    """PLE: the second embedding (``embed_tokens_per_layer``, rows of ``n_layers * dim``), the
    projection of the scaled main embedding to the same width and its norm, and mlx-lm's scales."""

    embed: np.ndarray | BlockWeight
    embed_scale: np.float32
    model_proj: LinearWeights
    proj_norm: np.ndarray
    proj_scale: float
    input_scale: float
    dim: int


def _norm(module: Any) -> np.ndarray:
    return float32_array(module.weight)


def _embedding(module: Any) -> np.ndarray | BlockWeight:
    return block_weight_of(module) or float32_array(module.weight)


def _rows(embed: np.ndarray | BlockWeight, tokens: list[int], out: np.ndarray) -> None:
    """``out[r]`` = the embedding's row of ``tokens[r]`` (ids already checked)."""
    if isinstance(embed, BlockWeight):
        ids = np.array(tokens, np.int32)
        embed.lib.rows(embed.address, ids.ctypes.data, len(tokens), out.ctypes.data)
    else:
        np.take(embed, tokens, axis=0, out=out)


class Gemma4Decoder:
    """Decode steps of Gemma 4 models :func:`unsupported` accepts: one sequence or several rows.

    Not thread-safe: the engine thread owns it, as it owns the model."""

    def __init__(self, model: Any, lib: ctypes.CDLL, logit_transform: Any) -> None:
        """``logit_transform``: the family's ``decode_families.LogitTransform`` (the final
        soft-capping), applied to the logits the pass returns."""
        inner, args = model.model, model.args
        mx.eval(model.parameters())

        n = len(inner.layers)
        self.n_cached = n - args.num_kv_shared_layers if 0 < args.num_kv_shared_layers < n else n
        sliding = [t == "sliding_attention" for t in args.layer_types[:n]]
        firsts = [sliding.index(kind) if kind in sliding else 0 for kind in (True, False)]
        attns = [inner.layers[i].self_attn for i in firsts]
        self.angles = [RopeAngles([a.rope], a.head_dim) for a in attns]
        self.traditional = [0, 0]
        self.hidden = args.hidden_size
        self.eps = float(args.rms_norm_eps)
        self.scale = float(attns[0].scale) * LOG2E
        self.embed = _embedding(inner.embed_tokens)
        self.embed_scale = np.float32(inner.embed_scale)
        self.ple = None
        if inner.hidden_size_per_layer_input:
            self.ple = PerLayerEmbeddings(
                _embedding(inner.embed_tokens_per_layer), np.float32(inner.embed_tokens_per_layer_scale),
                linear_weights(inner.per_layer_model_projection), _norm(inner.per_layer_projection_norm),
                float(inner.per_layer_projection_scale), float(inner.per_layer_input_scale),
                int(inner.hidden_size_per_layer_input))
        self.layers = [self._layer(layer, i, sliding[i], inner.previous_kvs[i]) for i, layer in enumerate(inner.layers)]
        # the sliding layers whose prompt-chunk layout KV-sharing layers read again (gemma4_pass's ring_slot)
        kept = sorted({layer.source for layer in self.layers if layer.k is None and layer.rope == 0})
        for layer in self.layers:
            layer.ring_slot = kept.index(layer.source) + 1 if layer.source in kept else 0
        self.segments_max = max(1, gemma4_pass.KEPT_MAX // max(1, len(kept)))  # prompt chunks in one pass
        self.kv_width = max(layer.kv_heads * layer.head_dim for layer in self.layers)
        self.prompt_rows_min = PROMPT_ROWS_MIN
        self.norm = _norm(inner.norm)
        head = inner.embed_tokens if args.tie_word_embeddings else model.lm_head
        self.head = LinearWeights(_embedding(head), None)
        self.logit_transform = logit_transform
        self.window = int(args.sliding_window)
        self.sliding = sliding[:self.n_cached]
        kv_types = kv_precision.of_model(model)
        shapes = [(self.layers[i].kv_heads, self.layers[i].head_dim) for i in range(self.n_cached)]
        self.shapes = shapes
        self.kv = KvLayout(*shapes[0], self.window,
                           rings=[i for i, s in enumerate(self.sliding) if s],
                           plain=[i for i, s in enumerate(self.sliding) if not s],
                           dtypes=kv_types.dtypes(), blocks=kv_types.blocks)
        self.seq = SequenceKv(self.kv, self.n_cached, list(range(self.n_cached)), [], [])
        self.sources = np.array([layer.source for layer in self.layers], np.int64)
        self._buffers: dict[int, tuple[dict[str, np.ndarray], Any]] = {}
        self._chunk_buffers: tuple[dict[str, np.ndarray], Any] | None = None  # a prompt chunk's: the largest so far
        self.steps = 0
        self.prefilled = 0
        self.native = gemma4_pass.describe(self, lib)

    def _layer(self, layer: Any, i: int, sliding: bool, source: int) -> Gemma4Layer:
        a, m, lin = layer.self_attn, layer.mlp, linear_weights
        shared = not a.has_kv
        ple = layer.per_layer_input_gate is not None and self.ple is not None
        return Gemma4Layer(
            q=lin(a.q_proj), k=None if shared else lin(a.k_proj),
            v=None if shared or a.use_k_eq_v else lin(a.v_proj), o=lin(a.o_proj),
            gate=lin(m.gate_proj), up=lin(m.up_proj), down=lin(m.down_proj),
            ple_gate=lin(layer.per_layer_input_gate) if ple else None,
            ple_proj=lin(layer.per_layer_projection) if ple else None,
            n_in=_norm(layer.input_layernorm), attn_out=_norm(layer.post_attention_layernorm),
            mlp_in=_norm(layer.pre_feedforward_layernorm), mlp_out=_norm(layer.post_feedforward_layernorm),
            q_norm=_norm(a.q_norm), k_norm=None if shared else _norm(a.k_norm),
            v_norm=np.ones(a.head_dim, np.float32),
            ple_norm=_norm(layer.post_per_layer_input_norm) if ple else None,
            heads=a.n_heads, kv_heads=a.n_kv_heads, head_dim=a.head_dim, rope=0 if sliding else 1,
            source=i if not shared else source, layer_scalar=float(np.float32(np.array(layer.layer_scalar)[0])),
            experts=_experts(layer, self.hidden))

    # ------------------------------------------------------------------ eligibility

    def can_run(self, cache: list[Any], owned: OwnedCache) -> bool:
        """Whether ``cache`` is one sequence's cache as mlx-lm's ``make_cache`` makes it (one layer
        per layer with KV: ``RotatingKVCache`` rings of the window for sliding ones, ``KVCache``
        for full ones), each holding one row of the layer's shape and the storage types: the
        buffers this decoder made for it, or MLX's. Not shared prompt-cache blocks (``paged``)."""
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        if len(cache) != self.n_cached or any(paged(c) for c in cache):
            return False
        if not owned.holds(cache):
            for c, sliding, (hk, d) in zip(cache, self.sliding, self.shapes):
                widths = self._widths(d)
                if (type(c) is not (RotatingKVCache if sliding else KVCache) or c.keys is None
                        or c.keys.ndim != 4 or c.keys.shape[0] != 1 or c.keys.shape[1] != hk
                        or (c.keys.shape[3], c.values.shape[3]) != widths
                        or (c.keys.dtype, c.values.dtype) != tuple(self.kv.dtypes)):
                    return False
        return all(cache[i].max_size == self.window and ring_plan(cache[i]) is not None for i in self.kv.rings)

    def can_step_tokens(self, cache: list[Any], owned: OwnedCache) -> bool:
        """Several tokens of one sequence in a pass: not here (sliding-window rings take one token a step)."""
        return False

    def can_feed_tail(self, cache: list[Any], owned: OwnedCache) -> bool:
        """A prompt's short rest as one pass's rows: not here either (:meth:`can_step_tokens`)."""
        return False

    def can_prefill(self, cache: list[Any], owned: OwnedCache) -> bool:
        """Whether :meth:`prefill` takes this cache: each layer an empty mlx-lm cache (a cold
        prompt), or one a chunk can start from (``ring_chunks``: rings of the window holding the
        slots the chunk sees, plain layers of the layer's shape), all at one offset."""
        if len(cache) != self.n_cached or any(paged(c) for c in cache) or len({c.offset for c in cache}) != 1:
            return False
        for c, sliding, (hk, d) in zip(cache, self.sliding, self.shapes):
            widths = self._widths(d)
            if not (ring_chunks.ring_takes_chunk(c, self.window, hk, widths, self.kv.dtypes) if sliding
                    else ring_chunks.plain_takes_chunk(c, hk, widths, self.kv.dtypes)):
                return False
        return True

    def _widths(self, head_dim: int) -> tuple[int, int]:
        """A stored key's and value's last dimension for a layer of ``head_dim`` (each side's block
        type's bytes for them, or ``head_dim`` values)."""
        return tuple(kv_blocks.row_width(b, head_dim) if b else head_dim for b in self.kv.blocks)  # type: ignore[return-value]

    def offset(self, cache: list[Any]) -> int:
        return self.seq.offset(cache)

    def forget_chunk_buffers(self) -> None:
        """Drop a prompt chunk's buffers (made again by the next chunk): the engine calls this when
        it goes idle."""
        self._chunk_buffers = None

    # ------------------------------------------------------------------ the step

    def step(self, token: int, cache: list[Any], owned: OwnedCache, scales: Any = None) -> np.ndarray:
        """Feed ``token`` at the cache's offset; the logits (a buffer reused by the next step)."""
        return self.step_rows([token], [cache], [owned], None if scales is None else [scales])[0]

    def step_rows(self, tokens: list[int], caches: list[list[Any]], owned: list[OwnedCache],
                  scales: Any = None) -> np.ndarray:
        """One step of several sequences, each on its own cache at its own position: the
        projections take every row in one pass over each weight (each row computed exactly as
        alone), attention row by row. Returns (rows, vocabulary) logits, a reused buffer."""
        check_token_ids(tokens, self.embed.shape[0])
        positions = [self.offset(cache) for cache in caches]
        views = [self.seq.own(cache, o, pos) for cache, o, pos in zip(caches, owned, positions)]
        return self._run(tokens, caches, positions, views, scales)

    def prefill(self, tokens: list[int], cache: list[Any], owned: OwnedCache, scales: Any = None,
                logits: bool = True) -> np.ndarray | None:
        """Feed the rest of a prompt as one chunk (:meth:`can_prefill`); the last token's logits
        (a reused buffer), or None without ``logits``. The cache advances by ``len(tokens)``."""
        out = self.prefill_rows([tokens], [cache], [owned], [scales], logits=logits)
        return out[0] if logits else None

    def prefill_rows(self, chunks: list[list[int]], caches: list[list[Any]], owned: list[OwnedCache],
                     scales: list[Any] | None = None, logits: bool = False) -> np.ndarray | None:
        """Several sequences' prompt chunks in one pass (``CpuDecoder.prefill_rows``'s contract): every
        row through each weight together, each sequence's attention over its own cache (a sliding
        layer's ring laid out as mlx-lm's chunk lays it out: ``ring_chunks``). With ``logits``, one
        chunk only: its last row's logits."""
        if logits and len(chunks) != 1:
            raise ValueError("logits are for a single sequence's chunk")
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("each chunk needs its own sequence's cache")
        def pick(idx: list[int]) -> tuple[list, list, list, list | None]:
            return ([chunks[i] for i in idx], [caches[i] for i in idx], [owned[i] for i in idx],
                    None if scales is None else [scales[i] for i in idx])

        ones = [i for i, c in enumerate(chunks) if len(c) == 1]
        if ones:  # mlx-lm writes one token into a ring in place: a step
            rest = [i for i in range(len(chunks)) if i not in ones]
            if rest:
                self.prefill_rows(*pick(rest))
            tokens, step_caches, step_owned, step_scales = pick(ones)
            out = self.step_rows([t[0] for t in tokens], step_caches, step_owned, step_scales)
            return out if logits else None
        short = [len(c) < PROMPT_ROWS_MIN for c in chunks]
        if len(set(short)) > 1:  # one pass for each kind of product
            for kind in (True, False):
                self.prefill_rows(*pick([i for i, s in enumerate(short) if s == kind]))
            return None
        if len(chunks) > self.segments_max:  # the kept ring layouts a pass has room for
            for first in range(0, len(chunks), self.segments_max):
                self.prefill_rows(*pick(list(range(first, min(first + self.segments_max, len(chunks))))))
            return None
        for tokens in chunks:
            check_token_ids(tokens, self.embed.shape[0])
        starts = [self.offset(cache) for cache in caches]
        views = [self._chunk_views(cache, o, start, len(tokens))
                 for cache, o, start, tokens in zip(caches, owned, starts, chunks)]
        rows = [len(tokens) for tokens in chunks]
        row_scales = None if scales is None or all(s is None for s in scales) else [
            s if s is not None else () for s, n in zip(scales, rows) for _ in range(n)]
        out = self._run([t for tokens in chunks for t in tokens], caches, starts, views, row_scales,
                        segments=rows, head=logits)
        return out if logits else None

    def _chunk_views(self, cache: list[Any], owned: OwnedCache, start: int, rows: int) -> list[tuple[int, ...]]:
        """A prompt chunk's KV views (``ring_chunks.chunk_views``), one layout a kind of layer (the
        sliding and the full layers' shapes differ); ``owned`` then holds every layer's arrays."""
        n, mine = len(cache), len(owned.arrays) == len(cache)
        arrays: list[Any] = [None] * n
        views: list[Any] = [None] * n
        for sliding in (True, False):
            idx = [i for i in range(n) if self.sliding[i] == sliding]
            if not idx:
                continue
            hk, d = self.shapes[idx[0]]
            layout = KvLayout(hk, d, self.window if sliding else None, rings=list(range(len(idx))) if sliding else [],
                              plain=[] if sliding else list(range(len(idx))), dtypes=self.kv.dtypes, blocks=self.kv.blocks)
            part = OwnedCache(arrays=[owned.arrays[i] for i in idx] if mine else [],
                              views=[owned.views[i] for i in idx] if mine else [], reserve=owned.reserve)
            got = ring_chunks.chunk_views(layout, [cache[i] for i in idx], part, start, rows)
            for j, i in enumerate(idx):
                arrays[i], views[i] = part.arrays[j], got[j]
        owned.arrays, owned.views, owned.apart = arrays, views, None
        return views

    def _run(self, tokens: list[int], caches: list[list[Any]], positions: list[int],
             views: list[list[tuple[int, ...]]], scales: Any, segments: list[int] | None = None,
             head: bool = True) -> np.ndarray:
        """The pass itself (``mlxcel_gemma4_pass``): decode rows, row r ``tokens[r]`` at
        ``positions[r]`` on ``caches[r]``; or ``segments``: prompt chunks, ``segments[j]`` rows of
        sequence j from ``positions[j]`` (then only the last row's logits, one chunk)."""
        rows = len(tokens)
        arrays, native_buffers = self._chunk_buffers_for(rows) if segments is not None else self._buffers_for(rows)
        for angles in self.angles:
            angles.forget_if_many()
        if segments is not None:
            spans = [[a for angles in self.angles for a in angles.span(pos, n, 0)] for pos, n in zip(positions, segments)]
            angle_rows = np.array([[a.ctypes.data for a in span] for span in spans], np.int64)  # spans kept alive
            offsets = np.cumsum([0, *segments], dtype=np.int32)
        else:
            angle_rows = np.array([[a for angles in self.angles for a in angles.row(pos)] for pos in positions], np.int64)
            offsets = None
        table = self.seq.table(views, positions, caches, segments)
        kv = np.ascontiguousarray(table[:, self.sources])  # a KV-sharing layer reads its source's entry
        x = arrays["x"][:rows]
        _rows(self.embed, tokens, x)
        x *= self.embed_scale
        if self.ple is not None:
            ple = arrays["ple"][:rows]
            _rows(self.ple.embed, tokens, ple)
            ple *= self.ple.embed_scale
        failed = self.native.run(native_buffers, rows, offsets, head, kv, angle_rows, decode_pass.lora_scales(scales))
        if failed < 0:
            raise RuntimeError(f"layer {-failed - 1}: the grouped expert product refused its stacks")
        if failed:
            raise RuntimeError(f"layer {failed - 1}: positions from {min(positions)} do not fit the layer's KV cache")
        logits = arrays["logits"]
        n = 1 if segments is not None else rows
        if head and not self.logit_transform.identity:  # the soft-capping, by MLX's tanh: NumPy's differs from
            # it in the last bit for about a third of the values, which left no step bit-identical to MLX's
            logits[:n] = np.array(self.logit_transform.apply(mx.array(logits[:n]), mx.tanh))
        self.seq.advance(caches, segments if segments is not None else [1] * rows, chunk=segments is not None)
        if segments is not None:
            self.prefilled += rows
        else:
            self.steps += rows
        return logits

    def _chunk_buffers_for(self, rows: int) -> tuple[dict[str, np.ndarray], Any]:
        """A prompt chunk's buffers: one set, grown in steps of 64 rows, logits for one row."""
        held = self._chunk_buffers
        if held is None or held[0]["x"].shape[0] < rows:
            held = self._chunk_buffers = self._new_buffers(-(-rows // 64) * 64, 1)
        return held

    def _buffers_for(self, rows: int) -> tuple[dict[str, np.ndarray], Any]:
        held = self._buffers.get(rows)
        if held is None:
            held = self._buffers[rows] = self._new_buffers(rows, rows)
        return held

    def _new_buffers(self, rows: int, logit_rows: int) -> tuple[dict[str, np.ndarray], Any]:
        layers = self.layers
        n_ple = len(layers) * self.ple.dim if self.ple else 1
        widths = dict(x=self.hidden, h=self.hidden, branch=self.hidden,
                      q=max(layer.heads * layer.head_dim for layer in layers),
                      kv_rows=len(layers) * 2 * self.kv_width,
                      gate=max(layer.gate.weight.shape[0] for layer in layers),
                      ple=n_ple, ple_proj=n_ple, ple_gate=self.ple.dim if self.ple else 1,
                      ple_in=self.ple.dim if self.ple else 1)
        widths["att"], widths["up"] = widths["q"], widths["gate"]
        arrays = {name: np.zeros((rows, widths[name]), np.float32) for name in gemma4_pass.BUFFER_NAMES if name != "logits"}
        arrays["logits"] = np.zeros((logit_rows, self.head.weight.shape[0]), np.float32)
        return arrays, gemma4_pass.buffers(arrays)


__all__ = ["Gemma4Decoder", "Gemma4Layer", "MODEL_TYPE", "PerLayerEmbeddings", "takes", "unsupported"]
