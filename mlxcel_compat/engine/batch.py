"""Batched decode: every decoding sequence advances by one token in one forward pass.

The batch owns a merged cache built with mlx-lm's batch caches (``KVCache.merge`` gives a
left-padded ``BatchKVCache``; rotating, recurrent and list caches merge likewise). A sequence
joins with ``extend`` once its own prefill is done, and leaves through ``extract`` (its row, for
prompt-cache donation) plus ``filter`` (the remaining rows), without stopping the others.

One step, pipelined like the single-sequence path:

    feed every row's pending token  ->  forward (B, 1)  ->  sample row i with sequence i's chain
    ->  async_eval the new pending tokens  ->  read back the fed tokens  ->  emit, stop checks

Rows with a grammar draw after the read-back instead: their masks depend on the fed tokens, and
are computed (all rows in parallel) while the forward pass runs (``sequence.draw_pending``).

A sequence whose prompt is prefilled up to its last token joins with that token as its pending
one: its first token is then sampled by the batched pass (nothing is emitted for the prompt
token), so several new sequences start decoding without a (1, 1) forward pass each.

With the CPU decode runtime (``runtime/cpu_decode.py``), rows keep their own caches instead and
the runtime steps them together (``CpuDecoder.step_rows``: one pass over the weights for every
row, attention row by row); nothing is merged or extracted, and a row's logits are bit-identical
to its step alone. The runtime needs the fed tokens' values, so that pass is not pipelined.
A row the runtime cannot take (never seen: every cache of a model it takes is a plain
``KVCache``) turns the batch back into a merged one.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlxcel_compat.cache import kv
from mlxcel_compat.engine.sequence import Sequence, draw_pending
from mlxcel_compat.runtime.block_layers import logits_unused
from mlxcel_compat.runtime.lora_rows import applied


def _merge(layers: list[Any]) -> Any:
    return type(layers[0]).merge(layers)


# Batched prefill pays for a row only if the chunks are of about the same length: on a CPU a
# padded token costs ~2.5 ms of compute, a (1, L) pass ~50 ms on top of its tokens (it reads every
# weight once), and a row's cached prefix is copied into the batch cache and back
# (scripts/bench_prefill_batching.py, docs/benchmarks/batching.md).
PREFILL_PAD_LIMIT = 16  # tokens of right padding allowed per row
PREFILL_PREFIX_LIMIT = 2048  # cached tokens a row may bring along


def can_prefill_together(seq: Sequence) -> bool:
    """Plain attention caches only: their batch form handles right-padded chunks exactly
    (recurrent and rotating caches keep stepping through padding or drop what they rotate out); a
    hit's paged layers gather when merged (``kv.PagedKVCache``)."""
    return (all(type(layer) is KVCache or type(layer) is kv.PagedKVCache for layer in seq.cache)
            and len(seq.cache_tokens) <= PREFILL_PREFIX_LIMIT)


def on_runtime(seq: Sequence, chunk: list[int]) -> bool:
    """Whether the CPU decode runtime prefills this chunk (``CpuDecoder.can_prefill``), as it
    does a lone sequence's (``Sequence.prefill_step``)."""
    return seq.decoder is not None and len(chunk) > 1 and seq.decoder.can_prefill(seq.cache, seq.owned)


def prefill_groups(seqs: list[Sequence], chunks: list[list[int]]) -> list[list[int]]:
    """Split sequences (by index) into groups that prefill in one pass each: the chunks the CPU
    decode runtime takes, all together (nothing is padded); batchable rows whose chunks are
    within PREFILL_PAD_LIMIT tokens of the group's longest; the rest alone."""
    runtime = [i for i, (s, c) in enumerate(zip(seqs, chunks)) if on_runtime(s, c)]
    groups: list[list[int]] = [runtime] if runtime else []
    batchable = sorted((i for i, s in enumerate(seqs) if i not in runtime and can_prefill_together(s)),
                       key=lambda i: -len(chunks[i]))
    padded: list[list[int]] = []
    for i in batchable:
        if padded and len(chunks[padded[-1][0]]) - len(chunks[i]) <= PREFILL_PAD_LIMIT:
            padded[-1].append(i)
        else:
            padded.append([i])
    groups += padded
    alone = set(range(len(seqs))) - set(batchable) - set(runtime)
    return sorted([sorted(g) for g in groups] + [[i] for i in alone])


def batch_caches_work(model: Any) -> bool:
    """Decode two sequences of different lengths through one merged batch cache. Some models'
    layers cannot take mlx-lm's batch caches; the engine then gives each sequence its own pass."""
    rows = [probe_cache(model) for _ in range(2)]
    for cache, tokens in zip(rows, ([[0, 1, 2]], [[0, 1]])):
        model(mx.array(tokens), cache=cache)
    merged = [_merge(list(layers)) for layers in zip(*rows)]
    for layer in merged:
        layer.step = PROBE_STEP
    mx.eval(model(mx.array([[3], [4]]), cache=merged))
    return True


# Positions a probe's cache allocates at a time: mlx-lm's 256 would make each of the load-time
# probes' caches hold 256 positions a layer (tens of MiB on a small model, all at once: the
# process's peak memory), for passes of a few tokens.
PROBE_STEP = 8


def probe_cache(model: Any) -> list[Any]:
    """``make_prompt_cache(model)`` for a pass of a few tokens, allocating ``PROBE_STEP`` at a time."""
    cache = make_prompt_cache(model)
    for layer in cache:
        if hasattr(layer, "step"):
            layer.step = PROBE_STEP
    return cache


def prefill_together(model: Any, seqs: list[Sequence], chunks: list[list[int]]) -> None:
    """One forward pass over several sequences' prompt chunks (a group of ``prefill_groups``).

    Chunks the CPU decode runtime takes go through ``CpuDecoder.prefill_rows``: each written into
    its sequence's own buffers, the products over all rows at once. Otherwise MLX's pass, the
    chunks right-padded to the longest: the rows' caches are merged into mlx-lm batch caches
    (left-padded to a common length), the padding is declared with ``prepare`` and rolled out of
    the way by ``finalize``, and each row is extracted back into its sequence's own cache.
    """
    if all(on_runtime(s, c) for s, c in zip(seqs, chunks)):
        seqs[0].decoder.prefill_rows(chunks, [s.cache for s in seqs], [s.owned for s in seqs],
                                     [s.request.lora or None for s in seqs])
        for seq, chunk in zip(seqs, chunks):
            seq.chunk_done(chunk)
        return
    lengths = [len(c) for c in chunks]
    padding = [max(lengths) - n for n in lengths]
    cache = [_merge(list(layers)) for layers in zip(*(s.cache for s in seqs))]
    if any(padding):
        for layer in cache:
            layer.prepare(lengths=lengths, right_padding=padding)
    with logits_unused(), applied(lora_rows(seqs)):  # only the caches are wanted
        model(mx.array([c + [0] * p for c, p in zip(chunks, padding)]), cache=cache)
    if any(padding):
        for layer in cache:
            layer.finalize()
    mx.eval([layer.state for layer in cache])
    rows = [[layer.extract(i) for layer in cache] for i in range(len(seqs))]  # all or nothing
    for seq, row, chunk in zip(seqs, rows, chunks):
        seq.cache = row
        seq.chunk_done(chunk)


def lora_rows(seqs: list[Sequence]) -> list[tuple[float, ...]] | None:
    """Each row's LoRA scales (``lora_rows.applied`` scales every row by its own), or None
    when no row uses an adapter: rows with different adapter sets share a pass exactly."""
    rows = [s.request.lora for s in seqs]
    return rows if any(any(r) for r in rows) else None


class DecodeBatch:
    def __init__(self, model: Any, decoder: Any = None) -> None:
        self.model = model
        self.decoder = decoder  # model.cpu_decode.CpuDecoder: rows keep their caches; None: merged
        self.sequences: list[Sequence] = []
        self.cache: list[Any] | None = None

    def __len__(self) -> int:
        return len(self.sequences)

    def add(self, seq: Sequence) -> None:
        """Take over ``seq``'s cache as a new row: a decoding sequence, or a prompt-ready one whose
        last prompt token the next step feeds (so its first token comes out of the batched pass)."""
        assert seq.phase == "decode" or seq.prompt_ready, f"{seq.phase=}"
        if self.decoder is not None:
            if self.decoder.can_run(seq.cache, seq.owned):
                self.sequences.append(seq)  # its cache stays its own
                return
            self._merge_rows()
        row = [_merge([layer]) for layer in seq.cache]
        if self.cache is None:
            self.cache = row
        else:
            for mine, theirs in zip(self.cache, row):
                mine.extend(theirs)
        seq.cache = []  # the batch owns the state until the sequence leaves
        self.sequences.append(seq)

    def _merge_rows(self) -> None:
        """From rows on their own caches (the CPU decode runtime's) to one merged batch cache."""
        rows, self.sequences, self.decoder = self.sequences, [], None
        for seq in rows:
            self.add(seq)

    def remove(self, indices: list[int]) -> list[Sequence]:
        """Extract the given rows back into their sequences' own caches and drop them."""
        gone = [self.sequences[i] for i in indices]
        if self.decoder is not None:
            self.sequences = [s for i, s in enumerate(self.sequences) if i not in set(indices)]
            return gone
        assert self.cache is not None
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

    def step(self) -> tuple[list[Sequence], list[tuple[Sequence, Exception]]]:
        """Advance every row by one token.

        Returns ``(finished, failed)``, both already removed from the batch: the sequences that
        finished, and those whose own part of the step (feeding, sampling, stop checks) raised,
        with the error. The other rows go on. If the forward pass itself raises, the batch and
        its sequences are put back as they were before the step and :class:`ForwardFailed` is
        raised, so that the engine can step each row alone and find the one at fault.
        """
        cancelled = [i for i, s in enumerate(self.sequences) if s.cancelled]
        done = self.remove(cancelled) if cancelled else []
        for seq in done:
            seq.cancel_now()
        fed, failed = self._begin_feeds()
        if not self.sequences:
            return done, failed
        tokens = mx.stack([p[0] for p in fed]).reshape(len(fed), 1)
        try:
            logits = self._forward(tokens)
        except ForwardFailed:
            for seq in self.sequences:
                seq.undo_batched_feed()
            raise
        constrained = [s for s in self.sequences if s.grammar is not None]
        plain = [s.chain.is_plain_argmax and s.request.n_probs <= 0 and s.grammar is None for s in self.sequences]
        argmax = None
        if any(plain):  # one argmax for the batch, each plain row with its logit bias (ignore_eos)
            biased = logits
            for i, seq in enumerate(self.sequences):
                if plain[i]:
                    biased = seq.chain.biased(biased, i)
            argmax = mx.argmax(biased, axis=-1).astype(mx.int32)
        pending: list[Any] = [logits] if constrained else []
        broken: dict[int, Exception] = {}
        for i, seq in enumerate(self.sequences):
            try:
                if seq.grammar is not None:
                    seq.defer_draw(logits[i])  # its mask needs the token fed this step
                else:
                    pending += seq.sample_next(logits[i], argmax[i] if plain[i] else None)
            except Exception as exc:
                broken[i] = exc
        mx.async_eval(*pending)
        values = tokens.reshape(-1).tolist()
        for i, (seq, value, (_, logprobs, probs)) in enumerate(zip(self.sequences, values, fed)):
            if i not in broken:
                try:
                    seq.finish_batched_feed(int(value), logprobs, probs)
                except Exception as exc:
                    broken[i] = exc
        live = [i for i, s in enumerate(self.sequences) if s.grammar is not None and s.finished is None and i not in broken]
        if live:
            row_of = {id(self.sequences[i]): i for i in live}
            for seq, exc in draw_pending([self.sequences[i] for i in live]):
                broken[row_of[id(seq)]] = exc
        leaving = sorted({i for i, s in enumerate(self.sequences) if s.finished is not None} | set(broken))
        for i, seq in zip(leaving, self.remove(leaving) if leaving else []):
            if i in broken:
                failed.append((seq, broken[i]))
            else:
                done.append(seq)
        return done, failed

    def _forward(self, tokens: Any) -> Any:
        """(B, vocabulary) logits of the fed tokens; ForwardFailed (caches as before) if it raises."""
        if self.decoder is not None:
            try:  # a failed runtime step advances no cache: nothing to roll back
                rows = self.decoder.step_rows(tokens.reshape(-1).tolist(), [s.cache for s in self.sequences],
                                              [s.owned for s in self.sequences], lora_rows(self.sequences))
            except Exception as exc:
                raise ForwardFailed(exc, True) from exc
            return mx.array(rows)
        marks = kv.checkpoint(self.cache)
        try:
            with applied(lora_rows(self.sequences)):
                return self.model(tokens, cache=self.cache)[:, -1, :]
        except Exception as exc:
            raise ForwardFailed(exc, kv.rollback(self.cache, marks)) from exc

    def _begin_feeds(self) -> tuple[list[tuple[Any, Any, Any]], list[tuple[Sequence, Exception]]]:
        """Every row's pending token, in row order; a row that cannot hand it over leaves the batch."""
        fed: dict[int, tuple[Any, Any, Any]] = {}
        failed: list[tuple[Sequence, Exception]] = []
        for i in reversed(range(len(self.sequences))):  # removing row i leaves rows < i in place
            seq = self.sequences[i]
            try:
                fed[id(seq)] = seq.begin_batched_feed()
            except Exception as exc:
                failed.append((self.remove([i])[0], exc))
        return [fed[id(seq)] for seq in self.sequences], failed


class ForwardFailed(Exception):
    """A batched forward pass raised. ``restored``: the batch cache and its sequences are back as
    before the step (False only for a full sliding window, which the pass may have overwritten)."""

    def __init__(self, error: Exception, restored: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.restored = restored
