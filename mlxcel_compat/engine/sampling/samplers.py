"""The chain's stages, one function per llama.cpp sampler, and ``SAMPLERS``: the table the chain
walks, each stage under its llama.cpp name with the rule that says when it is active.

A stage takes the candidates and the request's :class:`ChainState` and returns the candidates
left (a removed token gets a ``-inf`` logit; ``top_k`` compacts them: ``candidates.py``). Stages
stay in lazy MLX ops where they can, so the engine can ``mx.async_eval`` the sampled token; the
infill sampler runs in NumPy. Order and arithmetic follow llama.cpp's ``src/llama-sampler.cpp``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from mlxcel_compat.engine.sampling.candidates import NEG_INF, Candidates, softmax, softmax_np
from mlxcel_compat.engine.sampling.dry import dry_penalties
from mlxcel_compat.engine.sampling.history import TokenHistory
from mlxcel_compat.engine.sampling.infill_pieces import merge_prefix_pieces, piece_index
from mlxcel_compat.engine.sampling.params import SamplingParams


@dataclass
class ChainState:
    """What the stages of one request read besides the candidates (its chain owns it)."""

    params: SamplingParams
    vocab_size: int
    eog_token_ids: list[int]
    tokenizer: Any  # the served tokenizer (an HF tokenizer or an mlx-lm wrapper); DRY and infill only
    history: TokenHistory
    dry_breakers: dict[int, list[tuple[int, ...]]]  # dry.dry_sequence_breakers of the request's strings
    xtc_key: mx.array  # split at every XTC step: the request's seed fixes its choices


# -- helpers over sorted candidates ---------------------------------------------


def _keep_sorted_prefix(cond: mx.array) -> mx.array:
    """Keep sorted positions up to and including the first one where ``cond`` holds."""
    before = mx.cumsum(cond.astype(mx.int32)) - cond.astype(mx.int32)
    return before == 0


def _scatter_mask(order: mx.array, sorted_mask: mx.array) -> mx.array:
    """Map a mask over sorted positions back to candidate positions."""
    empty = mx.zeros(order.shape, dtype=mx.bool_)
    return mx.put_along_axis(empty, order, sorted_mask, axis=0)


def _greedy_mask(logits: mx.array) -> mx.array:
    """llama.cpp temp <= 0: keep the (first) highest logit, set the rest to -inf."""
    best = mx.argmax(logits)
    keep = mx.arange(logits.shape[0]) == best
    return mx.where(keep, logits, NEG_INF)


def _alive(logits: mx.array) -> mx.array:
    return logits > NEG_INF


# -- the stages ------------------------------------------------------------------


def penalties(c: Candidates, s: ChainState) -> Candidates:
    p = s.params
    if s.history.counts is None:
        return c
    counts = c.gather(s.history.counts)
    logits = c.logits
    repeated = mx.where(logits <= 0, logits * p.repeat_penalty, logits / p.repeat_penalty)
    penalized = repeated - counts * p.frequency_penalty - p.presence_penalty
    return Candidates(mx.where(counts > 0, penalized, logits), c.ids)


def dry(c: Candidates, s: ChainState) -> Candidates:
    p = s.params
    size = s.history.dry_window_size()
    tokens = s.history.dry_tokens if size is None else s.history.dry_tokens[-size:] if size else []
    found = dry_penalties(tokens, s.dry_breakers, p.dry_multiplier, p.dry_base, p.dry_allowed_length)
    found = {t: v for t, v in found.items() if 0 <= t < s.vocab_size}
    if not found:
        return c
    idx = mx.array(list(found.keys()), dtype=mx.int32)
    val = mx.array(list(found.values()), dtype=mx.float32)
    if c.ids is None:
        return Candidates(c.logits.at[idx].add(-val), None)
    dense = mx.zeros((s.vocab_size,), dtype=mx.float32).at[idx].add(val)
    return Candidates(c.logits - dense[c.ids], c.ids)


def top_k(c: Candidates, s: ChainState) -> Candidates:
    k = s.params.top_k
    if k >= c.logits.shape[0]:
        return c
    idx = mx.argpartition(-c.logits, kth=k - 1)[:k]
    ids = idx if c.ids is None else c.ids[idx]
    return Candidates(c.logits[idx], ids)


def top_p(c: Candidates, s: ChainState) -> Candidates:
    p = s.params
    order = mx.argsort(-c.logits)
    probs = softmax(c.logits)[order]
    cum = mx.cumsum(probs)
    positions = mx.arange(probs.shape[0])
    cond = (cum >= p.top_p) & (positions + 1 >= p.min_keep)
    keep = _scatter_mask(order, _keep_sorted_prefix(cond))
    return Candidates(mx.where(keep, c.logits, NEG_INF), c.ids)


def min_p(c: Candidates, s: ChainState) -> Candidates:
    p = s.params
    logits = c.logits
    threshold = mx.max(logits) + math.log(p.min_p)
    keep = logits >= threshold
    n = logits.shape[0]
    if p.min_keep > 0:
        # Keep at least min_keep tokens: the filter result or the top min_keep.
        m = min(p.min_keep, n)
        top = mx.argpartition(-logits, kth=m - 1)[:m]
        keep = mx.put_along_axis(keep, top, mx.array(True), axis=0)
    return Candidates(mx.where(keep, logits, NEG_INF), c.ids)


def typical(c: Candidates, s: ChainState) -> Candidates:
    p = s.params
    probs = softmax(c.logits)
    logp = mx.log(probs)
    entropy = -mx.sum(mx.where(probs > 0, probs * logp, 0.0))
    shifted = mx.abs(-logp - entropy)  # +inf for removed tokens: sorted last
    order = mx.argsort(shifted)
    cum = mx.cumsum(probs[order])
    positions = mx.arange(probs.shape[0])
    cond = cum > p.typical_p
    if p.min_keep > 0:
        cond = cond & (positions >= p.min_keep - 1)
    keep = _scatter_mask(order, _keep_sorted_prefix(cond))
    return Candidates(mx.where(keep, c.logits, NEG_INF), c.ids)


def top_n_sigma(c: Candidates, s: ChainState) -> Candidates:
    logits = c.logits
    if logits.shape[0] <= 1:
        return c
    alive = _alive(logits)
    count = mx.maximum(mx.sum(alive), 1)
    mean = mx.sum(mx.where(alive, logits, 0.0)) / count
    var = mx.sum(mx.where(alive, mx.square(logits - mean), 0.0)) / count
    cut = mx.max(logits) - s.params.top_n_sigma * mx.sqrt(var)
    return Candidates(mx.where(logits < cut, NEG_INF, logits), c.ids)


def xtc(c: Candidates, s: ChainState) -> Candidates:
    """Exclude Top Choices: with some chance, drop all tokens above the
    threshold except the least likely of them."""
    p = s.params
    s.xtc_key, sub = mx.random.split(s.xtc_key)
    chance = mx.random.uniform(key=sub)
    logits = c.logits
    order = mx.argsort(-logits)
    sorted_probs = softmax(logits)[order]
    n_remove = mx.sum(sorted_probs >= p.xtc_threshold) - 1
    n_alive = mx.sum(_alive(logits))
    apply = (
        (chance <= p.xtc_probability)
        & (n_alive >= 2)
        & (n_remove > 0)
        & (n_alive - n_remove >= p.min_keep)
    )
    remove = _scatter_mask(order, mx.arange(logits.shape[0]) < n_remove)
    return Candidates(mx.where(apply & remove, NEG_INF, logits), c.ids)


def temperature(c: Candidates, s: ChainState) -> Candidates:
    p = s.params
    if p.dynatemp_range <= 0.0:
        return plain_temperature(c, p.temperature)
    logits = c.logits
    if logits.shape[0] <= 1:
        return c
    min_temp = max(0.0, p.temperature - p.dynatemp_range)
    max_temp = p.temperature + p.dynatemp_range
    # Removed tokens do not count towards the maximum entropy here; llama.cpp
    # counts every candidate left in its array (bias-banned ones included).
    n_alive = mx.sum(_alive(logits))
    probs = softmax(logits)
    entropy = -mx.sum(mx.where(probs > 0, probs * mx.log(probs), 0.0))
    max_entropy = mx.log(mx.maximum(n_alive, 2).astype(mx.float32))
    normalized = entropy / max_entropy
    dyn_temp = min_temp + (max_temp - min_temp) * mx.power(normalized, p.dynatemp_exponent)
    scaled = logits / mx.maximum(dyn_temp, 1e-30)
    out = mx.where(dyn_temp <= 0, _greedy_mask(logits), scaled)
    return Candidates(mx.where(n_alive > 1, out, logits), c.ids)


def plain_temperature(c: Candidates, temperature: float) -> Candidates:
    """A fixed temperature (no dynamic range): greedy at <= 0, as mirostat's chain applies it too."""
    if temperature <= 0.0:
        return Candidates(_greedy_mask(c.logits), c.ids)
    if temperature == 1.0:
        return c
    return Candidates(c.logits / temperature, c.ids)


def infill(c: Candidates, s: ChainState) -> Candidates:
    """llama.cpp's infill sampler: prefer EOG when text is unlikely, merge
    tokens that are prefixes of each other, then keep the confident ones."""
    logits_np = np.array(c.logits, dtype=np.float64)
    ids_np = (
        np.arange(logits_np.shape[0]) if c.ids is None else np.array(c.ids).astype(np.int64)
    )
    alive = np.flatnonzero(logits_np > NEG_INF)
    if alive.size == 0:
        return c
    alive = alive[np.argsort(-logits_np[alive], kind="stable")]
    lg = logits_np[alive].copy()
    ids = ids_np[alive]
    probs = softmax_np(lg)
    is_eog = np.isin(ids, s.eog_token_ids)
    keep = np.zeros(logits_np.shape[0], dtype=bool)

    p_eog = float(probs[is_eog].sum())
    p_txt = float(probs[~is_eog].sum())
    if 3.0 * p_eog * len(ids) > p_txt:
        keep[alive[is_eog]] = True
        return Candidates(mx.where(mx.array(keep), c.logits, NEG_INF), c.ids)

    merge_prefix_pieces(piece_index(s.tokenizer), ids, lg, probs)

    # Whole-array steps: without a top-k before it this sees the whole vocabulary every token.
    survivors = (probs >= 0.2) | is_eog
    n_non_eog = int((survivors & ~is_eog).sum())
    if n_non_eog == 0:
        # llama.cpp collapses to a single EOT/EOS token.
        eot = s.eog_token_ids[0] if s.eog_token_ids else int(ids[0])
        only_eot = mx.where(mx.arange(s.vocab_size) == eot, 1.0, NEG_INF)
        return Candidates(only_eot.astype(mx.float32), None)
    total = sum(probs[survivors].tolist())  # a few terms, summed in order as before
    threshold = 1.0 / (n_non_eog + 1)
    final = survivors & ((probs / total >= threshold) | is_eog) & (lg > NEG_INF)
    keep[alive[final]] = True
    return Candidates(mx.where(mx.array(keep), c.logits, NEG_INF), c.ids)


# -- the table -------------------------------------------------------------------


@dataclass(frozen=True)
class Sampler:
    """One stage of the chain: what it does, and when it runs at all."""

    apply: Callable[[Candidates, ChainState], Candidates]
    # Mirror llama.cpp, which swaps disabled samplers for no-op ones: a stage whose parameters
    # leave the candidates as they are is left out of the chain.
    is_active: Callable[[SamplingParams], bool]


# Every stage under its llama.cpp name (parsing.CANONICAL_SAMPLERS). adaptive_p is the final
# draw, not a stage (draws.py), so it has no row: it is never active as a stage.
SAMPLERS: dict[str, Sampler] = {
    "penalties": Sampler(penalties, lambda p: p.repeat_last_n != 0 and not (
        p.repeat_penalty == 1.0 and p.frequency_penalty == 0.0 and p.presence_penalty == 0.0)),
    "dry": Sampler(dry, lambda p: p.dry_multiplier != 0.0 and p.dry_base >= 1.0 and p.dry_penalty_last_n != 0),
    "top_k": Sampler(top_k, lambda p: p.top_k > 0),
    "top_p": Sampler(top_p, lambda p: p.top_p < 1.0),
    "min_p": Sampler(min_p, lambda p: p.min_p > 0.0),
    "typ_p": Sampler(typical, lambda p: p.typical_p < 1.0),
    "top_n_sigma": Sampler(top_n_sigma, lambda p: p.top_n_sigma > 0.0),
    "xtc": Sampler(xtc, lambda p: p.xtc_probability > 0.0 and p.xtc_threshold <= 0.5),
    "temperature": Sampler(temperature, lambda p: not (p.temperature == 1.0 and p.dynatemp_range <= 0.0)),
    "infill": Sampler(infill, lambda p: True),
}
