"""A sequence that decodes speculatively (``SpeculativeSequence``): before a step it proposes a
draft (``engine/speculative.py``), and the step feeds the pending token and the draft in one
pass and keeps what the request's own chain agrees with.

The factory builds one whenever the engine speculates; a request that cannot (a grammar, a
thinking budget: ``factory.speculator_for``) gets no ``speculator`` and decodes as any sequence.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx

from mlxcel_compat.engine.forward import verify_logits
from mlxcel_compat.engine.sequence import CLEAR_EVERY, Sequence
from mlxcel_compat.engine.speculative import verify_draft


class SpeculativeSequence(Sequence):
    """A :class:`Sequence` with the two steps of speculative decoding (the scheduler's
    ``_speculate`` calls them for a sequence whose ``speculator`` is set)."""

    def draft_tokens(self) -> list[int]:
        """The draft to verify with the pending token in this step, or [] for a plain step.

        At most as many tokens as may still be generated after the pending one with room for the
        token sampled after the last of them (so every fed token had room, as in a plain step)."""
        spec = self.speculator
        if spec is None or self.finished is not None or self._pending is None or self.cancelled or not self._room_for_more():
            return []
        from mlx_lm.models.cache import can_trim_prompt_cache

        n_max = self.n_ctx - (self.n_prompt + len(self.generated)) - 2
        if self.request.n_predict >= 0:
            n_max = min(n_max, max(self.request.n_predict, 1) - len(self.generated) - 2)
        if n_max < max(1, spec.n_min) or not can_trim_prompt_cache(self.cache):
            return []
        token = int(self._pending[0].item())
        draft = spec.propose(self.cache_tokens, token, n_max)
        if draft:
            self.stats.n_draft += len(draft)
            self.stats.n_draft_rounds += 1
        return draft

    def speculate_step(self, draft: list[int]) -> None:
        """Feed the pending token and ``draft`` in one pass, then accept tokens in order: each
        position is sampled with this request's chain (the history so far included), a draft
        token is kept while the sample equals it, and the first sample that differs (or the one
        after a fully accepted draft) becomes the pending token. The cache gives back the
        rejected positions. See engine/speculative.py for why the output is plain decoding's."""
        from mlx_lm.models.cache import trim_prompt_cache

        token_arr, logprobs, probs = self._pending
        token = int(token_arr.item())
        if self.stats.t_prompt_done is None:
            self.stats.t_prompt_done = time.perf_counter()
        fed = [token] + draft
        # The caller records in cache_tokens the fed tokens it keeps, and trims the others.
        rows = verify_logits(self.model, self.decoder, self.cache, self.owned, self.request.lora, fed)
        self._pending = None
        self._history.append(token)
        self.cache_tokens.append(token)
        n_before = len(self.generated)
        self._accept(token, logprobs, probs)
        greedy = self.chain.is_plain_argmax and self.request.n_probs <= 0
        picks = [self.chain.argmax_of(row) for row in rows] if greedy else None

        def sample_at(i: int) -> tuple[int, Any]:
            if greedy:  # no probabilities were asked for: the token is all a step keeps
                return int(picks[i]), (mx.array(int(picks[i]), dtype=mx.int32), None, None)
            result = self.chain.sample(mx.array(rows[i]), self._history)
            return int(result.token.item()), (result.token, result.logprobs, result.probs)

        per_pos = self.stats.accepted_per_pos
        kept: list[int] = []  # this round's accepted draft tokens

        def accept(value: int, sampled: Any) -> bool:
            # Counted before the token is emitted: a finish it causes reports this round too.
            if len(kept) == len(per_pos):
                per_pos.append(0)
            per_pos[len(kept)] += 1
            kept.append(value)
            self.stats.n_draft_accepted += 1
            self._history.append(value)
            self.cache_tokens.append(value)
            self._accept(value, sampled[1], sampled[2])
            return self.finished is None

        n_kept = 0
        if self.finished is None:
            n_kept, self._pending = verify_draft(draft, sample_at, accept)
        rejected = len(draft) - n_kept
        if rejected:  # the cache holds every fed position; cache_tokens only the accepted ones
            trim_prompt_cache(self.cache, rejected)
        self.speculator.verified(len(draft), n_kept)
        if self.finished is None and self._context_full():
            self._finish("limit", "", truncated=True)
        if len(self.generated) // CLEAR_EVERY != n_before // CLEAR_EVERY:
            mx.clear_cache()
