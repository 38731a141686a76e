"""Batched decode: every decoding sequence advances by one token in one forward pass.

The batch owns a merged cache built with mlx-lm's batch caches (``KVCache.merge`` gives a
left-padded ``BatchKVCache``; rotating, recurrent and list caches merge likewise). A sequence
joins with ``extend`` once its own prefill is done, and leaves through ``extract`` (its row, for
prompt-cache donation) plus ``filter`` (the remaining rows), without stopping the others.

One step, pipelined like the single-sequence path:

    feed every row's pending token  ->  forward (B, 1)  ->  sample row i with sequence i's chain
    ->  async_eval the new pending tokens  ->  read back the fed tokens  ->  emit, stop checks

A sequence whose prompt is prefilled up to its last token joins with that token as its pending
one: its first token is then sampled by the batched pass (nothing is emitted for the prompt
token), so several new sequences start decoding without a (1, 1) forward pass each.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlxcel_compat.engine.sequence import Sequence


def _merge(layers: list[Any]) -> Any:
    return type(layers[0]).merge(layers)


class DecodeBatch:
    def __init__(self, model: Any) -> None:
        self.model = model
        self.sequences: list[Sequence] = []
        self.cache: list[Any] | None = None

    def __len__(self) -> int:
        return len(self.sequences)

    def add(self, seq: Sequence) -> None:
        """Take over ``seq``'s cache as a new row: a decoding sequence, or a prompt-ready one whose
        last prompt token the next step feeds (so its first token comes out of the batched pass)."""
        assert seq.phase == "decode" or seq.prompt_ready, f"{seq.phase=}"
        row = [_merge([layer]) for layer in seq.cache]
        if self.cache is None:
            self.cache = row
        else:
            for mine, theirs in zip(self.cache, row):
                mine.extend(theirs)
        seq.cache = []  # the batch owns the state until the sequence leaves
        self.sequences.append(seq)

    def remove(self, indices: list[int]) -> list[Sequence]:
        """Extract the given rows back into their sequences' own caches and drop them."""
        assert self.cache is not None
        gone = [self.sequences[i] for i in indices]
        for i, seq in zip(indices, gone):
            seq.cache = [layer.extract(i) for layer in self.cache]
        keep = [i for i in range(len(self.sequences)) if i not in set(indices)]
        if keep:
            for layer in self.cache:
                layer.filter(keep)
        else:
            self.cache = None
        self.sequences = [self.sequences[i] for i in keep]
        return gone

    def step(self) -> list[Sequence]:
        """Advance every row by one token; return the sequences that finished (already removed)."""
        cancelled = [i for i, s in enumerate(self.sequences) if s.cancelled]
        done = self.remove(cancelled) if cancelled else []
        for seq in done:
            seq.cancel_now()
        if not self.sequences:
            return done
        fed = [seq.begin_batched_feed() for seq in self.sequences]
        tokens = mx.stack([p[0] for p in fed]).reshape(len(fed), 1)
        logits = self.model(tokens, cache=self.cache)[:, -1, :]
        plain = [s.chain.is_plain_argmax and s.request.n_probs <= 0 for s in self.sequences]
        argmax = mx.argmax(logits, axis=-1).astype(mx.int32) if any(plain) else None
        pending: list[Any] = []
        for i, seq in enumerate(self.sequences):
            pending += seq.sample_next(logits[i], argmax[i] if plain[i] else None)
        mx.async_eval(*pending)
        values = tokens.reshape(-1).tolist()
        for seq, value, (_, logprobs, probs) in zip(self.sequences, values, fed):
            seq.finish_batched_feed(int(value), logprobs, probs)
        finished = [i for i, s in enumerate(self.sequences) if s.finished is not None]
        if finished:
            done += self.remove(finished)
        return done
