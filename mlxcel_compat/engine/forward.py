"""One sequence's forward passes: through the CPU decode runtime where it takes the sequence's
cache (writing only the buffers it made for it, ``owned``), else through MLX, under the
request's LoRA scales (``lora``, its per-adapter scales; all zero: none).

``Sequence`` decides when to feed what; these decide how, and each says which tokens the cache
now holds, so the sequence's bookkeeping (``cache_tokens``) follows its cache exactly.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from mlxcel_compat.runtime.block_layers import logits_unused
from mlxcel_compat.runtime.cpu_decode import EXACT_ROWS
from mlxcel_compat.runtime.decode_families import head_module, logit_transform
from mlxcel_compat.runtime.decode_kv import OwnedCache
from mlxcel_compat.runtime.lora_rows import applied


def lora_rows(lora: tuple[float, ...]) -> list[tuple[float, ...]] | None:
    """The LoRA scales of a sequence's MLX passes (``lora_rows.applied``): None without adapters."""
    return [lora] if any(lora) else None


def prefill_chunk(model: Any, decoder: Any, cache: list[Any], owned: OwnedCache, lora: tuple[float, ...],
                  chunk: list[int]) -> None:
    """Feed one prefill chunk into ``cache``; only the cache is wanted, not the logits."""
    if decoder is not None and len(chunk) > 1 and decoder.can_prefill(cache, owned):
        # The CPU decode runtime's chunk (CpuDecoder.prefill, no output head): the same
        # products with none of MLX's eager evaluations around them, and its causal
        # attention kernel. Chunked like MLX's, so an aligned hit still equals a cold run.
        decoder.prefill(chunk, cache, owned, lora or None, logits=False)
    else:
        with logits_unused(), applied(lora_rows(lora)):  # only the cache is wanted
            model(mx.array(chunk)[None], cache=cache)
        mx.eval([c.state for c in cache])
        owned.forget()  # MLX wrote the cache: the runtime's next pass copies it (OwnedCache.forget)


def forward_logits(model: Any, decoder: Any, cache: list[Any], owned: OwnedCache, lora: tuple[float, ...],
                   tokens: list[int] | mx.array) -> tuple[Any, list[int]]:
    """The logits after feeding ``tokens`` (a list, or one lazy token) into ``cache``, and the
    tokens the cache now holds beyond what it held (-1 for a token MLX has not read back yet)."""
    if decoder is not None and (isinstance(tokens, mx.array) or len(tokens) == 1) and decoder.can_run(cache, owned):
        # The CPU decode runtime takes the token's value: no step is queued ahead of it,
        # and none needs to be (it never waits on MLX's scheduler).
        token = int(tokens.item()) if isinstance(tokens, mx.array) else tokens[0]
        logits = mx.array(decoder.step(token, cache, owned, lora or None))
        return logits, [token]
    if (decoder is not None and isinstance(tokens, list) and 1 < len(tokens) <= EXACT_ROWS
            and decoder.can_feed_tail(cache, owned)):
        # A short prompt tail (prompt_tail): one step whose rows are its tokens; the last
        # row's logits (the only ones computed) sample the first token.
        rows = decoder.step_tokens(tokens, cache, owned, lora or None, last_only=True)
        return mx.array(rows[0]), tokens
    if (decoder is not None and isinstance(tokens, list) and len(tokens) > EXACT_ROWS
            and decoder.can_prefill(cache, owned)):
        # A hit's longer rest off the chunk grid (prompt_tail): one prompt chunk through the
        # CPU decode runtime, the head on its last row (sliding-window rings too:
        # ring_chunks.py). Not bit-exact with any other split (as MLX's chunk was not), so the
        # runtime's GEMM and chunk attention serve it.
        logits = decoder.prefill(tokens, cache, owned, lora or None)
        return mx.array(logits), tokens
    inputs = tokens.reshape(1, 1) if isinstance(tokens, mx.array) else mx.array(tokens)[None]
    owned.forget()  # MLX writes the cache: the runtime's next pass copies it (OwnedCache.forget)
    with applied(lora_rows(lora)):
        if decoder is not None and inputs.shape[1] > 1:  # a hit's rest in one chunk (prompt_tail)
            logits = last_row_logits(model, inputs, cache)
        else:
            logits = model(inputs, cache=cache)[0, -1, :]
    # A lazy token is a placeholder, filled in when the token is read back.
    return logits, [-1] if isinstance(tokens, mx.array) else tokens


def verify_logits(model: Any, decoder: Any, cache: list[Any], owned: OwnedCache, lora: tuple[float, ...],
                  fed: list[int]) -> np.ndarray:
    """(len(fed), vocabulary) logits of feeding ``fed`` after the cache: the CPU decode
    runtime's rows (bit-identical to single steps) where it runs, else one MLX pass. The
    caller records in ``cache_tokens`` the fed tokens it keeps, and trims the others."""
    if decoder is not None and decoder.can_step_tokens(cache, owned):
        rows = decoder.step_tokens(fed, cache, owned, lora or None)
    else:
        owned.forget()  # MLX writes the cache: the runtime's next pass copies it (OwnedCache.forget)
        with applied(lora_rows(lora)):
            logits = model(mx.array(fed)[None], cache=cache)[0]
        rows = np.array(logits.astype(mx.float32))
    return rows


def last_row_logits(model: Any, inputs: Any, cache: Any) -> Any:
    """``model(inputs, cache)[0, -1]`` with the output head applied to the last row only: mlx-lm's
    models compute the head on every position (a prompt chunk's 70 rows of a 49K-token vocabulary
    cost a fifth of a small model's pass), and slicing the logits afterwards does not spare it.
    For the CPU decode runtime's families (``decode_families.MODEL_TYPES``), whose ``__call__`` is the
    head over ``model.model``'s normed hidden states, and nothing after it but the family's
    ``decode_families.logit_transform`` (granite's divisor, cohere2's factor, soft-capping)."""
    hidden = model.model(inputs, cache)[:, -1:, :]
    head = head_module(model)
    logits = head.as_linear(hidden) if head is model.model.embed_tokens else head(hidden)
    return logit_transform(model).apply(logits[0, -1, :], mx.tanh)
