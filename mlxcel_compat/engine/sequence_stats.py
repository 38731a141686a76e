"""A sequence's counters and timings (``SequenceStats``), and the events that report them: one per
generated token and one at the finish (llama-server's timings, cache and draft counts), with the
token's most likely alternatives when the request asks for them (``n_probs``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from mlxcel_compat.engine.request import FinishEvent, TokenEvent, TokenProb
from mlxcel_compat.engine.sampling.results import top_logprobs, top_probs


@dataclass
class SequenceStats:
    """What a sequence counts as it runs; ``/slots``, ``/metrics`` and its events read them."""

    n_cached: int = 0  # prompt tokens adopted from the prompt cache (or a sibling, see shared)
    n_cache_written: int = 0  # prompt tokens newly pinned at cache breakpoints, beyond n_cached
    shared: bool = False  # n_cached came from a sibling completion (n_cmpl), not the prompt cache
    n_prompt_processed: int = 0  # prompt tokens run through the model (cached ones excluded)
    n_draft: int = 0  # speculative decoding: draft tokens proposed (llama-server's draft_n)
    n_draft_accepted: int = 0  # ... and accepted by the model (draft_n_accepted)
    n_draft_rounds: int = 0  # verification passes
    accepted_per_pos: list[int] = field(default_factory=list)  # rounds accepting draft position i
    t_start: float = field(default_factory=time.perf_counter)
    t_prompt_done: float | None = None
    t_end: float | None = None
    cache_explain: dict[str, Any] | None = None  # cache_explain: why the prompt cache reused what it did

    def token_event(self, token: int, n_decoded: int, id_slot: int, n_prompt: int) -> TokenEvent:
        """The event of a generated token, as of now; its text is the text stream's to fill in."""
        now = time.perf_counter()
        t_prompt = self.t_prompt_done or now
        return TokenEvent(
            token=token,
            text="",
            n_decoded=n_decoded,
            id_slot=id_slot,
            n_prompt=n_prompt,
            n_cached=self.n_cached,
            prompt_ms=(t_prompt - self.t_start) * 1000.0,
            predicted_ms=(now - t_prompt) * 1000.0,
            n_cache_written=self.n_cache_written,
            n_draft=self.n_draft,
            n_draft_accepted=self.n_draft_accepted,
        )

    def finish_event(self, stop_type: str, stopping_word: str, text: str, *, n_prompt: int, n_decoded: int,
                     tokens_cached: int, truncated: bool, id_slot: int, seed: int, cancelled: bool,
                     content_cut: int) -> FinishEvent:
        """The finish event, ending the sequence's time now (``t_end``)."""
        now = time.perf_counter()
        self.t_end = now
        t_prompt = self.t_prompt_done or now
        return FinishEvent(
            stop_type=stop_type,  # type: ignore[arg-type]
            stopping_word=stopping_word,
            text=text,
            n_prompt=n_prompt,
            n_cached=self.n_cached,
            n_decoded=n_decoded,
            tokens_cached=tokens_cached,
            prompt_ms=(t_prompt - self.t_start) * 1000.0,
            predicted_ms=(now - t_prompt) * 1000.0,
            truncated=truncated,
            id_slot=id_slot,
            seed=seed,
            cancelled=cancelled,
            content_cut=content_cut,
            n_cache_written=self.n_cache_written,
            n_draft=self.n_draft,
            n_draft_accepted=self.n_draft_accepted,
            n_draft_rounds=self.n_draft_rounds,
            accepted_per_pos=tuple(self.accepted_per_pos),
            cache_explain=self.cache_explain,
        )


def fill_probs(event: TokenEvent, token: int, logprobs: Any, probs: Any, n: int, post_sampling: bool) -> None:
    """The ``n`` most likely tokens and the token's own probability, into ``event``: after the
    sampler chain when ``post_sampling`` and the chain gave them, else the raw log-probabilities."""
    if post_sampling and probs is not None:
        event.top = [TokenProb(i, p) for i, p in top_probs(probs, n)]
        event.logprob = float(probs[token].item())
    else:
        event.top = [TokenProb(i, lp) for i, lp in top_logprobs(logprobs, n)]
        event.logprob = float(logprobs[token].item())
