"""The chain's final draw: llama.cpp's ``dist`` (a categorical draw over what the stages left),
or one of the draws that replace it and keep state across steps: mirostat 1 and 2 (which also
replace the stages) and adaptive-p. Mirostat and adaptive-p run in NumPy."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from mlxcel_compat.engine.sampling.candidates import NEG_INF, Candidates, softmax, softmax_np


def draw_dist(c: Candidates, key: mx.array) -> tuple[mx.array, mx.array]:
    """A draw from the candidates' softmax with ``key``: the token and the candidates' probabilities."""
    idx = mx.random.categorical(c.logits, key=key)
    token = idx if c.ids is None else c.ids[idx]
    return token, softmax(c.logits)


def full_probs(c: Candidates, probs: mx.array, vocab_size: int) -> mx.array:
    """The candidates' probabilities spread over the vocabulary (0 for the others)."""
    if c.ids is None:
        return probs
    empty = mx.zeros((vocab_size,), dtype=mx.float32)
    return mx.put_along_axis(empty, c.ids.astype(mx.int32), probs, axis=0)


def draw_numpy(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw for the numpy-side samplers (mirostat, adaptive-p)."""
    cdf = np.cumsum(probs)
    target = rng.random() * cdf[-1]
    return int(min(np.searchsorted(cdf, target, side="left"), len(probs) - 1))


class Mirostat:
    """Mirostat 1 or 2: each draw keeps the tokens whose surprise fits ``mu``, then moves ``mu``
    towards the target surprise ``tau`` at rate ``eta``."""

    def __init__(self, version: int, tau: float, eta: float, vocab_size: int, rng: np.random.Generator) -> None:
        self.version = version
        self.tau = tau
        self.eta = eta
        self.vocab_size = vocab_size
        self.rng = rng
        self.mu = 2.0 * tau  # the maximum surprise, learnt as tokens are drawn

    def draw(self, c: Candidates) -> tuple[mx.array, mx.array]:
        logits = np.array(c.logits, dtype=np.float64)
        order = np.argsort(-logits, kind="stable")
        sorted_logits = logits[order]
        probs = softmax_np(sorted_logits)
        if self.version == 1:
            m = 100
            count = min(m - 1, len(probs) - 1)
            with np.errstate(divide="ignore", invalid="ignore"):
                t = np.log(np.arange(2, count + 2) / np.arange(1, count + 1))
                b = np.log(probs[:count] / probs[1 : count + 1])
                s_hat = float(np.sum(t * b) / np.sum(t * t)) if count > 0 else 1.0
                eps = s_hat - 1.0
                k_float = ((eps * 2.0**self.mu) / (1.0 - self.vocab_size ** (-eps))) ** (
                    1.0 / s_hat
                )
            k = int(k_float) if math.isfinite(k_float) else len(probs)
            size = min(max(k, 1), len(probs))
        else:
            surprise = -np.log2(np.maximum(probs, 1e-45))
            over = np.flatnonzero(surprise > self.mu)
            size = int(over[0]) if over.size else len(probs)
            size = max(size, 1)
        kept = softmax_np(sorted_logits[:size])
        idx = draw_numpy(kept, self.rng)
        observed = -math.log2(max(float(kept[idx]), 1e-45))
        self.mu -= self.eta * (observed - self.tau)
        ids = order[:size] if c.ids is None else np.array(c.ids).astype(np.int64)[order[:size]]
        full = np.zeros(self.vocab_size, dtype=np.float32)
        full[ids] = kept
        return mx.array(int(ids[idx]), dtype=mx.int32), mx.array(full)


class AdaptiveP:
    """adaptive-p: reshape the distribution towards a moving target probability."""

    def __init__(self, target: float, decay: float, vocab_size: int, rng: np.random.Generator) -> None:
        self.target = target
        self.decay = min(max(decay, 0.0), 0.99)
        self.vocab_size = vocab_size
        self.rng = rng
        self.weighted_sum = target / (1.0 - self.decay)
        self.total_weight = 1.0 / (1.0 - self.decay)

    def draw(self, c: Candidates) -> tuple[mx.array, mx.array]:
        logits = np.array(c.logits, dtype=np.float64)
        ids = np.arange(logits.shape[0]) if c.ids is None else np.array(c.ids).astype(np.int64)
        alive = logits > NEG_INF
        probs = np.zeros_like(logits)
        probs[alive] = softmax_np(logits[alive])
        target = min(max(self.target, 0.0), 1.0)
        if self.total_weight == 0.0:
            adapted = target
        else:
            adapted = 2.0 * target - self.weighted_sum / self.total_weight
        adapted = min(max(adapted, 0.0), 1.0)
        dist = np.abs((probs - adapted) / 0.3)
        new_logits = np.where(alive, 5.0 - 10.0 * dist * dist / (1.0 + dist), NEG_INF)
        new_probs = np.zeros_like(new_logits)
        new_probs[alive] = softmax_np(new_logits[alive])
        idx = draw_numpy(new_probs, self.rng)
        decay = self.decay
        self.weighted_sum = probs[idx] + decay * self.weighted_sum
        self.total_weight = 1.0 + decay * self.total_weight
        full = np.zeros(self.vocab_size, dtype=np.float32)
        full[ids] = new_probs
        return mx.array(int(ids[idx]), dtype=mx.int32), mx.array(full)
