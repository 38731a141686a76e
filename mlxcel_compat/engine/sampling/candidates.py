"""The candidate set every sampler takes and returns, and the softmaxes they share.

Representation: llama.cpp shrinks its candidate array as samplers remove
tokens. Here a removed token gets a ``-inf`` logit instead, except ``top_k``,
which compacts the candidates to ``k`` entries (``ids`` + ``logits``) so later
sorts run on ``k`` values rather than the whole vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

NEG_INF = float("-inf")  # the logit of a removed token


@dataclass
class Candidates:
    """Candidate set: ``logits`` over the vocab (``ids`` None) or over ``ids``."""

    logits: mx.array
    ids: mx.array | None = None

    def gather(self, full: mx.array) -> mx.array:
        """The entries of a vocabulary-sized array ``full`` that belong to the candidates."""
        return full if self.ids is None else full[self.ids]


def softmax(logits: mx.array) -> mx.array:
    """The candidates' probabilities, lazily (removed tokens get 0)."""
    return mx.softmax(logits, axis=-1)


def softmax_np(logits: np.ndarray) -> np.ndarray:
    """Softmax of float64 logits for the samplers that run in NumPy. Logits that overflowed to
    +inf (a temperature near 0 divides them) hold all the probability, shared equally; the
    shift by the maximum would otherwise compute inf - inf."""
    top = logits.max()
    probs = np.isposinf(logits).astype(np.float64) if np.isposinf(top) else np.exp(logits - top)
    return probs / probs.sum()
