"""Decode steps outside MLX, one sequence or a batch, for dense llama-style models on the CPU.

Why: on the CPU, MLX runs a decode step as ~900 scheduled operations, kept in lockstep with the
engine thread that queues them (docs/benchmarks/cpu.md, issue 15: ``MAX_ACTIVE_TASKS``), and its
exponential is a scalar loop. The weight matrix-vector products, which are the step's real work,
already run at the machine's streaming speed in the BLAS shim's few-row kernel; what
kept the step at 1.6-1.8x that speed was everything around them. Here the same step is one call
into the shim's library (``mlxcel_decode_pass``, made by the engine thread itself), whose loop runs
per layer one RMS norm, the projections (the shim's matrix-vector kernel, or ggml's ``vec_dot``
for a weight kept in a GGUF file's blocks; residuals added by the kernel's ``beta``), one RoPE
call each for queries and keys, one attention call for every head (the new key and value written
into the cache, a vectorized softmax, the heads spread over the shim's threads) and one gating
call (SiLU, or Gemma's GELU with the tanh approximation). Made from Python, those ~15 calls a
layer cost a fifth of a small model's step in interpreter work; ``runtime/native/decode_pass.py``
describes the model to the C loop once. NumPy holds the buffers; nothing is allocated per step.

The KV cache stays mlx-lm's (``KVCache``, and ``RotatingKVCache`` for a sliding-window layer): the
step writes into buffers it made for the sequence, or reads a prompt-cache hit's shared arrays in
place, and leaves the cache as MLX's step would have (``decode_kv.py``). The model is held as its
layers' weights (``decode_layers.py``), its RoPE angles as tables made by its own RoPE modules
(``rope_angles.py``).

Several sequences decoding together (a batch) are stepped at once (:meth:`CpuDecoder.step_rows`),
each on its own cache: the projections take every row in one pass over the weights.

A prompt-cache hit's longer rest (more than ``EXACT_ROWS`` tokens after a hit off the chunk grid)
is fed here too, as one prompt chunk (:meth:`CpuDecoder.prefill`): the rows through the BLAS's
GEMM, one chunk-attention call a layer (the adopted KV read in place, the rows' kept apart until
the next step copies both once), the head on the last row only; MLX's pass over the same rest
spent as long around its products as in them.

Which models: ``decode_families.py`` (the families, and why another model keeps MLX's step).

Exactness: the logits match MLX's to float32 rounding (a different summation order and a
polynomial ``2 ** x`` within 1e-7), tested per family against the MLX step, greedy tokens
included (``tests/runtime/test_cpu_decode.py``). Block weights are multiplied by the same ggml kernels
as MLX's step runs them (``BlockLinear``), so there too only the rest of the step differs.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxcel_compat.runtime import (decode_conv, decode_delta, decode_exaone, decode_gemma2, decode_gemma4, decode_mamba,
                                  decode_mla, decode_moe, decode_nemotron, kv_precision, ring_chunks)
from mlxcel_compat.runtime.block_layers import BlockLinear, block_weight_of
from mlxcel_compat.runtime.decode_families import (ACTIVATIONS, GEMMA_TYPES, MULTIPLIER_TYPES, PARALLEL_TYPES,
                                                   Q_TEMPERATURE_TYPES, attention_shape, head_module, layer_rope,
                                                   logit_transform, rotated_dims, sliding_layers, unsupported)
from mlxcel_compat.runtime.block_weight import BlockWeight
from mlxcel_compat.runtime.decode_kv import KvLayout, OwnedCache, paged, paged_fits, ring_plan
from mlxcel_compat.runtime.decode_layers import (LinearWeights, LoraFactors, PassBuffers, attention_heads, check_token_ids,
                                                 float32_array, layer_mlp, layer_weights, norm_weights)
from mlxcel_compat.runtime.lora_rows import factors_of
from mlxcel_compat.runtime.native import decode_pass
from mlxcel_compat.runtime.native.blas_shim import SMALL_M_MAX
from mlxcel_compat.runtime.rope_angles import RopeAngles
from mlxcel_compat.runtime.sequence_kv import SequenceKv

LOG2E = 1.4426950408889634
# A prompt chunk this long or longer takes the prompt products (``mlxcel_decode_pass``: ggml's tiled
# kernels); a shorter one the decode rows' kernels (a graph of ggml's for a handful of rows cost
# ~0.2 ms a weight in set-up). Chunks of the two kinds never share a pass.
PROMPT_ROWS_MIN = 17
# Rows the shim's matrix kernel computes each exactly as alone (its ``small_m_max``); more rows
# go to the BLAS's GEMM, whose sums round differently.
EXACT_ROWS = SMALL_M_MAX
# What a pass computes of the output head (``mlxcel_decode_pass``'s ``head``): nothing, every
# row's logits (a prompt chunk's: its last row's), or a row pass's last row's only.
HEAD_NONE, HEAD_ALL, HEAD_LAST = 0, 1, 2


def enabled() -> bool:
    """``MLXCEL_CPU_DECODE=0`` keeps MLX's decode step (for comparison, or as a fallback)."""
    return os.environ.get("MLXCEL_CPU_DECODE", "1").strip().lower() not in ("0", "off", "false", "no")


def build(model: Any, shim: Any) -> "CpuDecoder | str":
    """The decoder for ``model``, or why there is none (logged at start-up)."""
    if not enabled():
        return "off (MLXCEL_CPU_DECODE=0)"
    if shim is None:
        return "the BLAS shim's kernels are not loaded"
    if not hasattr(shim.lib, "mlxcel_decode_pass"):  # a library built from an older source
        return "the loaded shim has no decode-step kernels"
    model = decode_exaone.runtime_view(model)  # EXAONE 3.5: its modules under llama's names
    reason = unsupported(model)
    if reason is not None:
        return reason
    if decode_gemma4.takes(model):  # Gemma 4's own pass (per-layer head sizes, shared KV, PLE)
        return decode_gemma4.Gemma4Decoder(model, shim.lib, logit_transform(model))
    return CpuDecoder(model, shim.lib)


class CpuDecoder:
    """Decode steps of one sequence or several, for a model :func:`unsupported` accepts.

    Not thread-safe: the engine thread owns it, as it owns the model.
    """

    def __init__(self, model: Any, lib: ctypes.CDLL) -> None:
        model = decode_nemotron.decoder_view(model)  # Nemotron-H: its blocks paired into layers
        inner = model.model
        mx.eval(model.parameters())
        # a hybrid's layers with recurrent state (delta-net: decode_delta.py; Granite 4.0-H's and
        # Nemotron-H's Mamba-2: decode_mamba.py; LFM2's short convolutions: decode_conv.py) and its
        # attention layers, which hold the KV cache
        self.delta_layers = [i for i, layer in enumerate(inner.layers)
                             if decode_delta.is_delta(layer) or decode_mamba.is_mamba(layer) or decode_conv.is_conv(layer)]
        self.attn_layers = [i for i in range(len(inner.layers)) if i not in self.delta_layers]
        attn0 = inner.layers[self.attn_layers[0]].self_attn
        self.gemma = model.args.model_type in GEMMA_TYPES
        mla = decode_mla.is_mla(attn0)  # DeepSeek's latent attention: the shapes its cache holds (decode_mla.py)
        self.n_heads, self.n_kv_heads, self.head_dim = decode_mla.cache_shape(attn0)[:3] if mla else attention_shape(attn0)
        heads = attention_heads(attn0)  # gpt-oss's scale is its sm_scale
        self.scale = (heads[2] if heads is not None else float(attn0.scale)) * LOG2E
        # Gemma 2's attention soft-cap (0: none): its kernels take the plain scale, log2 e after the cap
        self.attn_softcap = decode_gemma2.attention_softcap(model)
        if self.attn_softcap:
            self.scale = float(attn0.scale)
        dims = rotated_dims(layer_rope(attn0), self.head_dim)
        self.rope_dims = dims if dims != self.head_dim else 0  # a partial RoPE (the hybrids', phi3's, glm4's)
        # RoPE modules by layer kind: mlx-lm builds every layer of a kind from the same arguments
        # (gemma3: sliding layers with rope_local_base_freq, the others with rope_theta and its
        # scaling; smollm3: every fourth layer's module is NoPE, the identity, whose angles are 0),
        # so one module per kind gives every layer's angles.
        kinds = sliding_layers(model)
        rope_kinds = [(kinds[i], type(layer_rope(getattr(layer, "self_attn", None))).__name__)
                      for i, layer in enumerate(inner.layers)]
        firsts = {rope_kinds[i]: i for i in reversed(self.attn_layers)}
        order = sorted(firsts, key=firsts.get)
        self.angles = RopeAngles([layer_rope(inner.layers[firsts[kind]].self_attn) for kind in order],
                                 self.rope_dims or self.head_dim)
        self.embed = block_weight_of(inner.embed_tokens) or float32_array(inner.embed_tokens.weight)
        # Gemma scales the embedding by sqrt(hidden) (gemma3: rounded to bfloat16; its own expression)
        hidden = self.embed.shape[1]
        self.embed_scale = decode_gemma2.embedding_scale(model, hidden) if self.gemma else None
        # granitemoe's multipliers: the embedding's, each branch's before its residual sum (the C
        # loop's residual_scale; 0: none), and the logits divided by logits_scaling
        granite = model.args.model_type in MULTIPLIER_TYPES
        if granite:
            self.embed_scale = np.float32(inner.embedding_multiplier)
        self.residual_scale = float(model.args.residual_multiplier) if granite else 0.0
        # what the family does to the head's logits (granite's divisor, cohere2's factor, soft-capping)
        self.logit_transform = logit_transform(model)
        # the MLP's activation; cohere2's parallel branches
        self.act = ACTIVATIONS.get(model.args.model_type, "swiglu")
        self.parallel = model.args.model_type in PARALLEL_TYPES
        # ministral3: Llama 4's attention temperature, queries times 1 + beta log(1 + floor(pos / original))
        rope = getattr(model.args, "rope_parameters", None) or {}
        self.q_temperature = ((float(rope["llama_4_scaling_beta"]), int(rope["original_max_position_embeddings"]))
                              if model.args.model_type in Q_TEMPERATURE_TYPES else None)
        self.window = int(model.args.sliding_window) if any(kinds) else None
        self.norm = norm_weights(inner.embedding_norm if hasattr(inner, "embedding_norm") else inner.norm)  # LFM2's name
        head = head_module(model)
        self.head = LinearWeights(block_weight_of(head) or float32_array(head.weight), None,
                                  [LoraFactors(f) for f in factors_of(head)]
                                  if isinstance(head, (nn.Linear, BlockLinear)) else [])
        lfm2 = model.args.model_type in decode_conv.CONV_TYPES
        self.layers = [decode_nemotron.paired_layer(layer) if decode_nemotron.is_paired(layer)
                       else decode_mamba.mamba_layer(layer, moe) if decode_mamba.is_mamba(layer)
                       else decode_conv.layer_weights(layer, order.index(rope_kinds[i]) if i in self.attn_layers else 0, moe)
                       if lfm2 else decode_delta.delta_layer(layer, 0, self.gemma, moe) if i in self.delta_layers
                       else decode_mla.mla_layer(layer, order.index(rope_kinds[i]), moe) if mla
                       else layer_weights(layer, order.index(rope_kinds[i]), self.gemma, moe, sliding=kind)
                       for i, (layer, kind) in enumerate(zip(inner.layers, kinds))
                       for moe in [decode_mamba.with_shared_mlp(layer, decode_moe.moe_weights(layer_mlp(layer)))
                                   if decode_moe.is_moe(layer_mlp(layer)) else None]]
        # each recurrent layer's weights (a delta-net's, a Mamba-2 mixer's, a short convolution's: the state's shapes)
        self.recurrent = [self.layers[i].recurrent for i in self.delta_layers]
        for i in self.attn_layers:  # qwen3_next's attention: queries and gates from one projection
            self.layers[i].gated_q = type(inner.layers[i].self_attn).__name__ in decode_delta.GATED_ATTENTION
        self.ffn_width = decode_moe.ffn_width(self.layers)  # the pass's gate and up buffers' width
        # olmoe's q and k norms span the whole projection (a gain per head and channel), qwen3's and
        # gemma3's one head (a gain per channel)
        q_norm = self.layers[self.attn_layers[0]].q_norm
        self.qk_norm_whole = q_norm is not None and self.n_heads > 1 and q_norm.weight.size == self.n_heads * self.head_dim
        attn = [self.layers[i] for i in self.attn_layers]  # the KV layout's layers (all but a hybrid's delta-net)
        self.kv = KvLayout(self.n_kv_heads, self.head_dim, self.window,
                           rings=[i for i, layer in enumerate(attn) if layer.sliding],  # RotatingKVCache layers
                           plain=[i for i, layer in enumerate(attn) if not layer.sliding],  # KVCache layers
                           dtypes=kv_precision.of_model(model).dtypes(),  # -ctk/-ctv
                           blocks=kv_precision.of_model(model).blocks,
                           value_dim=decode_mla.cache_shape(attn0)[3] if mla else None)
        # a sequence's KV as the pass reads it (sequence_kv.py): views, the struct mlxcel_kv table
        self.seq = SequenceKv(self.kv, len(self.layers), self.attn_layers, self.delta_layers, self.recurrent)
        self._buffers: dict[int, PassBuffers] = {}  # by row count
        self._chunk_buffers: PassBuffers | None = None  # a prompt chunk's (prefill): the largest so far
        self.steps = 0  # steps run so far (tests and benchmarks check that it ran)
        self.prefilled = 0  # prompt tokens fed by prefill so far
        self.prompt_rows_min = PROMPT_ROWS_MIN
        self.native = decode_pass.describe(self, lib)  # the C loop's view of all of the above

    # ------------------------------------------------------------------ eligibility

    def can_run(self, cache: list[Any], owned: OwnedCache) -> bool:
        """Whether ``cache`` is one sequence's KV cache, each layer what mlx-lm's ``make_cache``
        gives it: the buffers this decoder made for it (the common case, checked by identity), or
        mlx-lm ``KVCache`` layers (``RotatingKVCache`` rings of the model's window for sliding
        layers) holding one row of keys and values of the model's storage types (-ctk/-ctv). A ring must be in
        a state mlx-lm's update can write one token into (:func:`decode_kv.ring_plan`)."""
        from mlx_lm.models.cache import KVCache, RotatingKVCache

        if len(cache) != len(self.layers):
            return False
        if not all(decode_delta.can_take(cache[i], weights) and not decode_delta.is_fresh(cache[i])
                   for i, weights in zip(self.delta_layers, self.recurrent)):
            return False
        cache = self.seq.attention(cache)
        k_dtype, v_dtype = self.kv.dtypes
        if not owned.holds(cache) and not all(
            paged_fits(c, self.n_kv_heads, self.kv.widths, self.kv.dtypes) if paged(c) else
            type(c) is (RotatingKVCache if self.layers[i].sliding else KVCache)
            and c.keys is not None and c.keys.ndim == 4 and c.keys.shape[0] == 1
            and c.keys.dtype == k_dtype and c.values.dtype == v_dtype
            for c, i in zip(cache, self.attn_layers)
        ):
            return False
        return all(cache[i].max_size == self.window and ring_plan(cache[i]) is not None for i in self.kv.rings)

    # ------------------------------------------------------------------ the step

    def step(self, token: int, cache: list[Any], owned: OwnedCache, scales: Any = None) -> np.ndarray:
        """Feed ``token`` at position ``cache[0].offset``; return the logits (a buffer reused by
        the next step: copy it before then). The cache advances by one position. ``scales``:
        the LoRA adapters' scales (one per adapter id), None for the base model."""
        return self.step_rows([token], [cache], [owned], None if scales is None else [scales])[0]

    def step_rows(self, tokens: list[int], caches: list[list[Any]], owned: list[OwnedCache],
                  scales: Any = None) -> np.ndarray:
        """One step of several sequences at once, each on its own cache at its own position:
        the projections take all rows in one pass over each weight (the shim's kernel reads a
        weight row once for up to 16 rows, and computes each row exactly as it would alone, so a
        row's logits are bit-identical to its step alone); RoPE and attention go row by row.
        ``scales``: per row, the LoRA adapters' scales (None: the base model for every row; a
        row of zeros adds exactly nothing to its projections).
        Returns (rows, vocabulary) logits, a buffer reused by the next step. If anything raises,
        no cache has advanced (a position written past ``offset`` is unused)."""
        check_token_ids(tokens, self.embed.shape[0])
        positions = [self.offset(cache) for cache in caches]
        borrowed = [self.seq.borrow(cache, o, pos) for cache, o, pos in zip(caches, owned, positions)]
        views = [b.views if b is not None else self.seq.own(cache, o, pos)
                 for b, cache, o, pos in zip(borrowed, caches, owned, positions)]
        logits = self._run(tokens, caches, positions, views, scales)
        for b, cache, o in zip(borrowed, caches, owned):
            if b is not None:
                o.apart = b.keep_apart(cache)
        return logits

    def step_tokens(self, tokens: list[int], cache: list[Any], owned: OwnedCache, scales: Any = None,
                    last_only: bool = False) -> np.ndarray:
        """Feed several consecutive tokens of one sequence (a speculative draft to verify):
        ``tokens[j]`` at position ``offset + j``. Returns (len(tokens), vocabulary) logits, or
        with ``last_only`` (1, vocabulary): the last row's only, the head on that row alone (a
        prompt's short rest, :meth:`can_feed_tail`: the rows before the last one sample nothing,
        and a 150K-token vocabulary's head would cost each of them about a step's weights).

        Why it exists: verifying a draft of n tokens must cost about one step, not n. The
        tokens go through the projections as the rows of one batch (one pass over each weight),
        and attention runs row by row in order, each row writing its key and value before it
        attends, so row j sees the rows before it: causal attention over the chunk. Every row
        is computed exactly as :meth:`step` computes it at that position (in passes of at most
        ``EXACT_ROWS`` rows), so the logits are bit-identical to n single steps (greedy speculation then reproduces plain decoding
        token for token). Plain KV caches only (no sliding-window ring: :meth:`can_step_tokens`).
        The cache advances by ``len(tokens)`` positions; drop rejected ones with ``trim``.
        Returns a new array (not a reused buffer)."""
        if self.kv.rings:
            raise RuntimeError("a model with sliding-window layers feeds one token per step here")
        check_token_ids(tokens, self.embed.shape[0])
        start = self.offset(cache)
        views = self.seq.own(cache, owned, start, last=start + len(tokens) - 1)
        out = np.empty((1 if last_only else len(tokens), self.head.weight.shape[0]), np.float32)
        for first in range(0, len(tokens), EXACT_ROWS):
            part = tokens[first:first + EXACT_ROWS]
            rows, final = len(part), first + EXACT_ROWS >= len(tokens)
            head = (HEAD_LAST if final else HEAD_NONE) if last_only else HEAD_ALL
            logits = self._run(part, [cache] * rows, [start + first + j for j in range(rows)],
                               [views] * rows, None if scales is None else [scales] * rows, head=head)
            if not last_only:
                out[first:first + rows] = logits[:rows]
            elif final:
                out[0] = logits[0]
        return out

    def can_step_tokens(self, cache: list[Any], owned: OwnedCache) -> bool:
        """Whether :meth:`step_tokens` and :meth:`prefill` take this cache (a plain-attention
        model's, see can_run), rows that may be trimmed again (a speculative draft's)."""
        return not self.delta_layers and self.can_feed_tail(cache, owned)

    def can_feed_tail(self, cache: list[Any], owned: OwnedCache) -> bool:
        """Whether a prompt's short rest may go as the rows of one :meth:`step_tokens`: as
        :meth:`can_step_tokens`, and a hybrid's too. Its recurrent layers take the rows one
        after another, each from the state the row before left, so every row is computed as its
        single step would be; the rows are never trimmed again (a speculative draft's are, and a
        recurrent state cannot drop a token: no drafts on hybrids)."""
        return not self.kv.rings and self.can_run(cache, owned)

    def can_prefill(self, cache: list[Any], owned: OwnedCache) -> bool:
        """Whether :meth:`prefill` takes this cache: as :meth:`can_step_tokens`, or an empty
        mlx-lm ``KVCache`` per layer (a cold prompt's first chunk); with sliding-window layers,
        each layer in a state a chunk can start from (``ring_chunks``: rings of the model's
        window, empty or holding the slots the chunk sees), at one offset."""
        from mlx_lm.models.cache import KVCache

        if len(cache) != len(self.layers):
            return False
        if self.kv.rings:
            d, hk = self.kv.widths, self.n_kv_heads  # a stored key's and value's last dimension
            return (len({c.offset for c in cache}) == 1
                    and all(ring_chunks.ring_takes_chunk(cache[i], self.window, hk, d, self.kv.dtypes) for i in self.kv.rings)
                    and all(ring_chunks.plain_takes_chunk(cache[i], hk, d, self.kv.dtypes) for i in self.kv.plain))
        if all(type(c) is KVCache and c.keys is None and c.offset == 0 for c in self.seq.attention(cache)) and all(
                decode_delta.can_take(cache[i], weights) and decode_delta.is_fresh(cache[i])
                for i, weights in zip(self.delta_layers, self.recurrent)):
            return True
        return self.can_run(cache, owned)

    def prefill(self, tokens: list[int], cache: list[Any], owned: OwnedCache, scales: Any = None,
                logits: bool = True) -> np.ndarray | None:
        """Feed the rest of a prompt, ``tokens[j]`` at position ``offset + j``, as one prompt
        chunk, and return the last token's logits (a buffer reused by the next pass: copy it
        before then), or None without ``logits`` (a prefill chunk: no output head). The cache
        advances by ``len(tokens)`` positions; an empty cache (:meth:`can_prefill`) gets this
        sequence's own buffers. On a hit's adopted arrays
        (which it may not write) it reads them in place and keeps the rows' keys and values apart,
        as a step on shared arrays does (:meth:`KvLayout.borrow`): the copy into this sequence's own
        buffers is made once, at the next step, after the first token has gone out.

        Why it exists: a prompt-cache hit leaves a rest of tens of tokens over a long cache, and
        MLX's pass over it spends as long around its matrix products as in them (norms, RoPE,
        the attention evaluated mid-pass, the KV concatenated; docs/benchmarks/prompt-cache.md).
        Here the rows go through each weight in one product (the BLAS's GEMM), the attention is
        one call a layer (``mlxcel_chunk_attention``: each KV head's keys read once per block of
        queries, both products vectorized, on the shim's threads), and the output head takes the
        last row only. Unlike :meth:`step_tokens` the rows are not computed as single steps
        would compute them (the GEMM and the blocked attention sum in other orders): the logits
        agree with MLX's chunk to float32 rounding, as any two prompt splits do. Plain KV caches
        only (:meth:`can_step_tokens`), or with sliding-window layers as mlx-lm's chunk leaves
        them (:meth:`can_prefill`, ``ring_chunks.py``)."""
        out = self.prefill_rows([tokens], [cache], [owned], [scales], logits=logits)
        return out[0] if logits else None

    def prefill_rows(self, chunks: list[list[int]], caches: list[list[Any]], owned: list[OwnedCache],
                     scales: list[Any] | None = None, logits: bool = False) -> np.ndarray | None:
        """:meth:`prefill` of several sequences' prompt chunks in one pass: ``chunks[i]`` on
        ``caches[i]`` from its offset, every sequence's rows through each weight together (one
        product a weight for all of them), each sequence's attention over its own cache (one call
        a layer and sequence). Each :meth:`can_prefill` cache, each its own sequence's. With
        ``logits``, one chunk only: the last row's logits.

        Why: sequences admitted together (several slots) went through MLX's batched pass, which
        merged their caches into one padded batch cache and extracted them again, then had this
        runtime copy each into its own buffers at the first step: three copies of every row's KV
        at once (the peak memory of a four-stream server). Here each chunk is written into its
        sequence's own buffers once, and the products still take all rows in one pass."""
        if logits and len(chunks) != 1:
            raise ValueError("logits are for a single sequence's chunk")
        if self.kv.rings and any(len(c) == 1 for c in chunks):  # mlx-lm writes one token into a ring in place
            ones = [i for i, c in enumerate(chunks) if len(c) == 1]
            rest = [i for i, c in enumerate(chunks) if len(c) != 1]
            if rest:
                self.prefill_rows([chunks[i] for i in rest], [caches[i] for i in rest], [owned[i] for i in rest],
                                  None if scales is None else [scales[i] for i in rest])
            out = self.step_rows([chunks[i][0] for i in ones], [caches[i] for i in ones], [owned[i] for i in ones],
                                 None if scales is None else [scales[i] for i in ones])
            return out if logits else None
        short = [len(c) < PROMPT_ROWS_MIN for c in chunks]
        if len(chunks) > 1 and any(short) and not all(short):  # one pass for each kind of product
            for kind in (True, False):
                picked = [i for i, s in enumerate(short) if s == kind]
                self.prefill_rows([chunks[i] for i in picked], [caches[i] for i in picked], [owned[i] for i in picked],
                                  None if scales is None else [scales[i] for i in picked])
            return None
        for tokens in chunks:
            check_token_ids(tokens, self.embed.shape[0])
        if len({id(c) for c in caches}) != len(caches):
            raise ValueError("each chunk needs its own sequence's cache")
        starts = [self.offset(cache) for cache in caches]
        borrowed = [self.seq.borrow(cache, o, start, len(tokens))
                    for cache, o, start, tokens in zip(caches, owned, starts, chunks)]
        views = [b.views if b is not None else self.seq.chunk_views(cache, o, start, len(tokens))
                 for b, cache, o, start, tokens in zip(borrowed, caches, owned, starts, chunks)]
        rows = [len(tokens) for tokens in chunks]
        row_scales = None if scales is None or all(s is None for s in scales) else [
            s if s is not None else () for s, n in zip(scales, rows) for _ in range(n)]
        out = self._run([t for tokens in chunks for t in tokens], caches, starts, views, row_scales,
                        segments=rows, head=HEAD_ALL if logits else HEAD_NONE)
        for b, cache, o in zip(borrowed, caches, owned):
            if b is not None:
                o.apart = b.keep_apart(cache)
        return out if logits else None

    def offset(self, cache: list[Any]) -> int:
        """The sequence's position: its first attention layer's (a delta-net layer keeps none)."""
        return self.seq.offset(cache)

    def _run(self, tokens: list[int], caches: list[list[Any]], positions: list[int],
             views: list[list[tuple[int, ...]]], scales: Any, segments: list[int] | None = None,
             head: int = HEAD_ALL) -> np.ndarray:
        """The pass itself (``mlxcel_decode_pass``): row r is ``tokens[r]`` at ``positions[r]`` on
        ``caches[r]`` (the same cache on several rows for consecutive positions of one sequence,
        a speculative draft's). ``segments``: prompt chunks instead, ``segments[j]`` rows of
        sequence j from ``positions[j]`` on ``caches[j]`` (``views[j]``), attended in one call a
        layer and sequence; only the last row's logits are computed (one chunk; :meth:`prefill`),
        and the result then has one row. ``head``: ``HEAD_NONE``, ``HEAD_ALL`` (every row's logits,
        or a chunk's last row's), ``HEAD_LAST`` (decode rows: the last row's only, in the result's
        first row). ``scales``: per row."""
        rows = len(tokens)
        self.angles.forget_if_many()  # between passes: no address handed out below is freed
        if segments is not None:
            b = self._chunk_buffers_for(rows)
            spans = [[self.angles.span(pos, n, kind) for kind in range(len(self.angles.ropes))]
                     for pos, n in zip(positions, segments)]  # kept alive for the call
            angles = np.array([[a.ctypes.data for span in row for a in span] for row in spans], np.int64)
            offsets = np.cumsum([0, *segments], dtype=np.int32)
        else:
            b = self._buffers_for(rows)
            angles = np.array([[self.angles.row(pos, kind) for kind in range(len(self.angles.ropes))] for pos in positions],
                              np.int64)
            offsets = None
        kv = self.seq.table(views, positions, caches, segments)
        if self.delta_layers:  # the pass updates recurrent state in place: nothing may fail once it started
            ends = kv[:, self.attn_layers, 5] + np.array(segments or [1] * rows)[:, None]
            if (ends > kv[:, self.attn_layers, 4]).any():
                raise RuntimeError(f"positions from {min(positions)} do not fit the attention layers' KV cache")
        x = b.x[:rows]
        if isinstance(self.embed, BlockWeight):  # the ids were checked (check_token_ids)
            ids = np.array(tokens, np.int32)
            self.embed.lib.rows(self.embed.address, ids.ctypes.data, rows, b.native.pointers[0])
        else:
            np.take(self.embed, tokens, axis=0, out=x)
        if self.embed_scale is not None:
            x *= self.embed_scale
        if self.q_temperature is not None:
            b.q_scale[:rows, 0] = self._q_scales(positions, segments)
        failed = self.native.run(b.native, rows, offsets, head, kv, angles, decode_pass.lora_scales(scales))
        if failed:
            raise RuntimeError(f"layer {failed - 1}: positions from {min(positions)} do not fit the layer's KV cache")
        if head and not self.logit_transform.identity:
            n = 1 if segments is not None or head == HEAD_LAST else rows
            b.logits[:n] = self.logit_transform.apply(b.logits[:n], np.tanh)
        self.seq.advance(caches, segments if segments is not None else [1] * rows, chunk=segments is not None)
        if segments is not None:
            self.prefilled += rows
        else:
            self.steps += rows
        return b.logits

    def _q_scales(self, positions: list[int], segments: list[int] | None) -> np.ndarray:
        """Each row's query factor (ministral3), by mlx-lm's expression in MLX's float32 arithmetic
        (the same bits): a step's row at its position, a chunk's rows at consecutive ones."""
        beta, original = self.q_temperature
        at = (positions if segments is None
              else [p + t for p, n in zip(positions, segments) for t in range(n)])
        if max(at) < original:  # floor(pos / original) = 0: log 1 = 0, every factor exactly 1 (no MLX call a step)
            return np.ones(len(at), np.float32)
        scale = 1 + beta * mx.log(1 + mx.floor(mx.array(at, mx.int32) / original))
        return np.array(scale.astype(mx.float32))

    def _buffers_for(self, rows: int) -> PassBuffers:
        b = self._buffers.get(rows)
        if b is None:
            b = self._buffers[rows] = self._new_buffers(rows, rows)
        return b

    @property
    def recurrent_state_shapes(self) -> list[tuple[int, ...]]:
        """The shapes of one sequence's recurrent state arrays (float32), every recurrent layer's."""
        return [shape for weights in self.recurrent for shape in decode_delta.state_shapes(weights)]

    def forget_chunk_buffers(self) -> None:
        """Drop a prompt chunk's buffers (made again by the next chunk): the engine calls this when
        it goes idle, so a server waiting for requests does not hold a 512-row chunk's activations
        (17 MiB on Gemma 3 270M, whose gate and up rows are 2048 wide)."""
        self._chunk_buffers = None

    def _chunk_buffers_for(self, rows: int) -> PassBuffers:
        """A prompt chunk's buffers: one set, grown in steps of 64 rows, its first ``rows`` used
        (rows are contiguous, so the addresses hold for any count), logits for one row."""
        b = self._chunk_buffers
        if b is None or b.x.shape[0] < rows:
            b = self._chunk_buffers = self._new_buffers(-(-rows // 64) * 64, 1)
        return b

    def _new_buffers(self, rows: int, logit_rows: int) -> PassBuffers:
        hidden, inter = self.embed.shape[1], self.ffn_width
        hq, hk, d = self.n_heads, self.n_kv_heads, self.head_dim

        def buf(n: int, r: int = rows) -> np.ndarray:
            return np.empty((r, n), np.float32)

        return PassBuffers(x=buf(hidden), h=buf(hidden), branch=buf(hidden), q=buf(hq * d), k_new=buf(hk * d),
                        v_new=buf(hk * d), att=buf(hq * d), gate=buf(inter), up=buf(inter),
                        logits=buf(self.head.weight.shape[0], logit_rows), q_scale=buf(1))



__all__ = ["CpuDecoder", "build", "enabled", "head_module", "unsupported"]
