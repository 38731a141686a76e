"""The infill sampler's merge of candidates whose pieces are prefixes of each other, and the
per-tokenizer index of pieces (``PieceIndex``) that keeps it linear in the candidates.

Built once per tokenizer on the request's worker thread (``server/pipeline.py``), because every
infill step without a top-k before it sees the whole vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from mlxcel_compat.engine.sampling.candidates import NEG_INF


@dataclass(frozen=True)
class PieceIndex:
    """A vocabulary's pieces in sorted order, for the infill merge: which tokens extend a token.

    The pieces that start with a given piece form one run of the sorted pieces, so the tokens whose
    piece starts with token t's are ``order[run_start[r]:run_end[r]]`` with ``r = rank[t]`` (t
    itself included, and the tokens with an equal piece, before or after it). Built once per
    tokenizer (:func:`piece_index`), because every infill step without a top-k before it sees the
    whole vocabulary.
    """

    order: np.ndarray  # token ids sorted by piece
    rank: np.ndarray  # rank[t]: where token t sits in ``order``
    run_start: np.ndarray  # run_start[pos]: the first of the pieces equal to the one at ``pos``
    run_end: np.ndarray  # run_end[pos]: the end of the pieces that start with the one at ``pos``

    @classmethod
    def from_pieces(cls, pieces: Sequence[bytes]) -> "PieceIndex":
        order = sorted(range(len(pieces)), key=pieces.__getitem__)
        ordered = [pieces[i] for i in order]
        run_start = np.arange(len(order), dtype=np.int64)
        run_end = run_start + 1
        for pos, head in enumerate(ordered):
            if not head:  # an empty piece (a special token) is nobody's prefix, as in llama.cpp
                continue
            if pos and ordered[pos - 1] == head:
                run_start[pos], run_end[pos] = run_start[pos - 1], run_end[pos - 1]
                continue
            end = pos + 1
            while end < len(ordered) and ordered[end].startswith(head):
                end += 1
            run_end[pos] = end
        rank = np.empty(len(order), dtype=np.int64)
        rank[order] = np.arange(len(order))
        return cls(np.asarray(order, dtype=np.int64), rank, run_start, run_end)


def piece_index(tokenizer: Any) -> PieceIndex:
    """The tokenizer's :class:`PieceIndex` over its generated-text pieces (built once)."""
    from mlxcel_compat.engine.textstream import all_token_bytes, derived

    def build(hf: Any) -> PieceIndex:
        return PieceIndex.from_pieces(all_token_bytes(hf, special=False))

    return derived(tokenizer, "infill piece index", build)


def merge_prefix_pieces(index: PieceIndex, ids: np.ndarray, logits: np.ndarray, probs: np.ndarray) -> None:
    """The infill sampler's merge, in place over the candidates ``ids`` (their logits and
    probabilities alongside): a candidate whose piece is a prefix of another's pools the two
    probabilities into the likelier one and the other drops out (logit -inf).

    llama.cpp compares every pair in order (i0 outer, i1 inner, both in candidate order), so
    the result depends on that order; this visits the same pairs in the same order but takes
    each i0's partners from the vocabulary's :class:`PieceIndex`, and skips the candidates that
    no other token extends (they have no partner). Without a top-k before it the sampler sees the
    whole vocabulary, and comparing every pair was quadratic in it: minutes of the engine thread
    a step for an 8K vocabulary, stalling every other request.
    """
    n_vocab = len(index.rank)
    position = np.full(max(n_vocab, int(ids.max()) + 1), -1, dtype=np.int64)
    position[ids] = np.arange(len(ids))
    known = ids < n_vocab  # a model's padded vocabulary beyond the tokenizer: no piece
    rank = np.where(known, index.rank[np.minimum(ids, n_vocab - 1)], 0)
    run_start, run_end = index.run_start[rank], index.run_end[rank]
    for i0 in np.flatnonzero(known & (run_end - run_start > 1)).tolist():
        partners = position[index.order[run_start[i0] : run_end[i0]]]
        for i1 in np.sort(partners[partners >= 0]).tolist():
            if logits[i0] == NEG_INF:
                break
            if i1 == i0 or logits[i1] == NEG_INF:
                continue
            dst, src = (i1, i0) if probs[i1] > probs[i0] else (i0, i1)
            probs[dst] += probs[src]
            logits[src] = NEG_INF
            probs[src] = 0.0
