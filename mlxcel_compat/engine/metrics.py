"""What the engine counts for ``/metrics``: llama-server's ``server_metrics``, at the same moments.

llama-server (``server-context.cpp``, ``server-common.h``) moves its counters at three points,
and so does the engine:

- **admission**: the prompt tokens taken from the prompt cache (``prompt_tokens_cached_total``);
- **every forward pass** (a scheduler iteration that ran a prefill chunk or a decode step): its
  ``n_decode`` calls (as many as llama-server's batches of ``--batch-size`` tokens would take), the
  busy slots, the longest sequence held, and the prompt tokens computed in it with the
  iteration's time (``prompt_tokens_total``, ``prompt_seconds_total``);
- **an embedding or rerank job**: its prompt tokens and decode calls, as a prefill's;
- **the end of a generation**: its tokens, its decode steps and its time
  (``tokens_predicted_total``, ``tokens_predicted_seconds_total``). The first generated token
  comes from the prompt's last pass and costs no decode step, so a generation of ``n`` tokens
  counts ``n - 1`` steps, and the generation rate is steps over time.

Written by the engine thread only. Buckets are immutable and replaced whole, so a reader on
another thread never sees a bucket's count without its time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from mlxcel_compat.engine.request import FinishEvent
    from mlxcel_compat.engine.sequence import Sequence as EngineSequence


@dataclass(frozen=True)
class Bucket:
    """Tokens, the decode steps they took and the seconds spent (llama-server's ``bucket``)."""

    count: int = 0
    steps: int = 0
    seconds: float = 0.0

    def plus(self, count: int, steps: int, seconds: float) -> Bucket:
        return Bucket(self.count + count, self.steps + steps, self.seconds + seconds)

    def rate_since(self, earlier: Bucket) -> float:
        """Steps per second between ``earlier`` and this reading (0.0 when no time passed)."""
        seconds = self.seconds - earlier.seconds
        return (self.steps - earlier.steps) / seconds if seconds > 0 else 0.0


@dataclass
class EngineMetrics:
    """Cumulative since start-up; ``server/metrics.py`` turns them into the ``llamacpp:*`` text."""

    # llama-server's t_start (ggml_time_us() at start-up: a monotonic clock in microseconds, not
    # Unix time, whatever the Process-Start-Time-Unix header that carries it says).
    t_start_us: int = field(default_factory=lambda: time.monotonic_ns() // 1000)
    prompt: Bucket = Bucket()  # computed prompt tokens only; cached ones are counted apart
    predict: Bucket = Bucket()
    prompt_tokens_cached_total: int = 0
    n_decode_total: int = 0
    n_busy_slots_total: int = 0  # summed over forward passes, for n_busy_slots_per_decode
    n_tokens_max: int = 0  # the most tokens a slot held at a forward pass
    n_draft_tokens: int = 0  # speculative decoding: draft tokens proposed
    n_draft_accepted: int = 0  # ... accepted
    n_draft_rounds: int = 0  # ... verification passes
    accepted_per_pos: tuple[int, ...] = ()  # verification passes that accepted draft position i

    def add_prompt_cached(self, n_tokens: int) -> None:
        self.prompt_tokens_cached_total += n_tokens

    def add_pass(self, n_busy: int, n_tokens_max: int, n_prompt: int, seconds: float, n_calls: int = 1) -> None:
        """A scheduler iteration over ``n_busy`` slots, worth ``n_calls`` of llama-server's
        ``llama_decode`` calls; ``n_prompt`` of its tokens were prompt tokens."""
        self.n_decode_total += n_calls
        self.n_busy_slots_total += n_busy * n_calls
        self.n_tokens_max = max(self.n_tokens_max, n_tokens_max)
        if n_prompt > 0:
            self.prompt = self.prompt.plus(n_prompt, n_prompt, seconds)

    def add_iteration(self, sequences: Sequence["EngineSequence"], before: Sequence[tuple[int, int]], seconds: float,
                      batch_size: int) -> None:
        """llama-server's per-decode metrics for an iteration that ran forward passes.

        llama-server puts an iteration's tokens (one per decoding slot, then prompt tokens) into
        batches of at most ``--batch-size`` tokens, one ``llama_decode`` each; the iteration is
        counted as that many calls. A first token is sampled from a row that fed a prompt token,
        so that row is not counted twice. ``before``: each sequence's (prompt tokens processed,
        tokens generated) when the iteration began.
        """
        n_prompt = n_fed_generated = 0
        for seq, (processed, generated) in zip(sequences, before):
            n_prompt += seq.stats.n_prompt_processed - processed
            new_tokens = len(seq.generated) - generated
            n_fed_generated += new_tokens - (1 if generated == 0 and new_tokens > 0 else 0)
        n_tokens = n_prompt + n_fed_generated
        if n_tokens > 0:
            longest = max(len(seq.cache_tokens) for seq in sequences)
            n_calls = -(-n_tokens // max(1, batch_size))
            self.add_pass(len(sequences), longest, n_prompt, seconds, n_calls)

    def add_embedding(self, lengths: Sequence[int], seconds: float, batch_size: int) -> None:
        """An embedding or rerank job: its prompts are computed like any prompt (llama-server runs
        them through its slots), in batches of at most ``--batch-size`` tokens; nothing is predicted."""
        n_tokens = sum(lengths)
        if n_tokens > 0:
            self.add_pass(len(lengths), max(lengths), n_tokens, seconds, -(-n_tokens // max(1, batch_size)))

    def add_finish(self, fin: "FinishEvent") -> None:
        """A generation's tokens and time, once it ends (prompt counts move per pass instead),
        and its speculative drafts (llama-server adds a slot's draft counts when it is released)."""
        if fin.n_decoded > 0:
            self.add_prediction(fin.n_decoded, fin.predicted_ms / 1000.0)
        if fin.n_draft_rounds > 0:
            self.add_drafts(fin.n_draft, fin.n_draft_accepted, fin.n_draft_rounds, fin.accepted_per_pos)

    def add_drafts(self, n_draft: int, n_accepted: int, n_rounds: int, per_pos: tuple[int, ...]) -> None:
        """A finished generation's speculative drafts."""
        self.n_draft_tokens += n_draft
        self.n_draft_accepted += n_accepted
        self.n_draft_rounds += n_rounds
        width = max(len(self.accepted_per_pos), len(per_pos))
        mine, theirs = (tuple(v) + (0,) * (width - len(v)) for v in (self.accepted_per_pos, per_pos))
        self.accepted_per_pos = tuple(a + b for a, b in zip(mine, theirs))

    def add_prediction(self, n_tokens: int, seconds: float) -> None:
        """A finished generation of ``n_tokens`` (> 0), ``seconds`` from its first to its last token."""
        self.predict = self.predict.plus(n_tokens, max(n_tokens - 1, 0), seconds)


__all__ = ["Bucket", "EngineMetrics"]
