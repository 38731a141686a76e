"""The forward passes of one engine iteration over the busy slots (``Scheduler``).

    prefill about one chunk (``--batch-size`` tokens) in total, oldest sequence first, similar
    chunks of several sequences in one pass  ->  one decode step of every decoding sequence in
    one batched pass, prompt-ready sequences feeding their last prompt token, a speculative
    draft verified alone

A failure fails only the sequence at fault (through the engine's ``fail``), and a finished
sequence goes back to the engine (``release``) to be donated and its slot freed. A batched pass
that fails where its rows work alone turns that kind of batching off for good.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from mlxcel_compat.cache.kv import copy_cache
from mlxcel_compat.engine.batch import DecodeBatch, ForwardFailed, prefill_groups, prefill_together
from mlxcel_compat.engine.sequence import Sequence
from mlxcel_compat.engine.slots import Slot

log = logging.getLogger(__name__)

BATCH_FAILURES_TOLERATED = 3  # failed batched passes in a row, with no faulty row, before batching stops


class Scheduler:
    """Runs one iteration's prefill and decode over the engine's slots, on the engine thread.

    ``fail(slot, exc)`` ends a sequence with an error event and frees its slot; ``release(slot,
    donate)`` frees the slot of a finished or cancelled one (the engine's ``_fail`` and
    ``_release``). The decode batch and whether batching still works are the scheduler's.
    """

    def __init__(self, slots: list[Slot], batch_size: int, cont_batching: bool,
                 fail: Callable[[Slot, Exception], None], release: Callable[[Slot, bool], None]) -> None:
        self.slots = slots
        self.batch_size = batch_size
        self.cont_batching = cont_batching
        self._fail = fail
        self._release = release
        self.batch: DecodeBatch = DecodeBatch(None)
        self.batched_decode = True  # off if the model fails the batch-cache probe at load
        self.batched_prefill = True  # ... or later, a batched prefill pass
        self._batch_only_failures = 0  # consecutive failed batched passes whose rows all worked alone

    # ------------------------------------------------------------------ prefill

    def prefill(self, busy: list[Slot], model: Any) -> None:
        """Prefill at most about one chunk (``--batch-size`` tokens) per iteration, oldest first,
        so a long prompt never stalls the sequences that are streaming. A sequence stops one token
        short of its prompt's end: ``decode`` feeds that last token (batched where it can).
        Chunks of similar length from several sequences go through one forward pass."""
        budget = self.batch_size
        waiting = [s.sequence for s in busy if s.sequence.phase == "prefill"]
        runnable: list[Sequence] = []
        for seq in sorted(waiting, key=lambda s: s.stats.t_start):
            if seq.cancelled:
                seq.cancel_now()
                self._release(self.slots[seq.slot_id], True)
                continue
            try:
                _share_prompt(seq, waiting)
            except Exception as exc:
                self._fail(self.slots[seq.slot_id], exc)
                continue
            if seq.prompt_ready or budget <= 0 or _waits_for_sibling(seq, waiting):
                continue
            runnable.append(seq)
            budget -= max(1, len(seq.next_chunk()))
        # A lone sequence feeds the rest of its prompt in one pass that samples the first token
        # where it can (Sequence.prompt_tail); with others prefilling, its chunk shares their
        # batched pass instead.
        tails = {id(s) for s in runnable if len(waiting) == 1 and s.prompt_tail() is not None}
        chunkable = [s for s in runnable if len(s.cache_tokens) < s.n_prompt - 1 and id(s) not in tails]
        chunks = [s.next_chunk() for s in chunkable]
        batching = self.cont_batching and self.batched_prefill
        groups = prefill_groups(chunkable, chunks) if batching else [[i] for i in range(len(chunkable))]
        units = [[(chunkable[i], chunks[i]) for i in g] for g in groups] + [[(s, [])] for s in runnable if s not in chunkable]
        for unit in units:
            together = len(unit) > 1 and self._prefill_together(unit, model)
            all_alone_ok = True
            for seq, _ in unit:
                try:
                    if not together:
                        seq.prefill_step(rows_tail=id(seq) in tails)
                    _share_prompt(seq, waiting)
                except Exception as exc:
                    all_alone_ok = False
                    self._fail(self.slots[seq.slot_id], exc)
            if len(unit) > 1 and not together and all_alone_ok:
                # Every row prefilled fine on its own: it was the batched pass that failed.
                log.warning("batched prefill failed where single passes work; prefilling one sequence at a time from now on")
                self.batched_prefill = False

    @staticmethod
    def _prefill_together(unit: list[tuple[Sequence, list[int]]], model: Any) -> bool:
        """One pass over several sequences' chunks. A failure leaves the sequences untouched
        (they are then prefilled alone, which tells a faulty row from a model whose layers cannot
        take a batch cache)."""
        try:
            prefill_together(model, [seq for seq, _ in unit], [chunk for _, chunk in unit])
            return True
        except Exception:
            log.warning("batched prefill pass failed; its rows are prefilled alone", exc_info=True)
            return False

    # ------------------------------------------------------------------ decode

    def decode(self, loaded: Any, speculative: bool) -> None:
        """One decode step of every decoding sequence; prompt-ready sequences join with their
        last prompt token. Several rows go through one batched pass; a lone sequence steps on its
        own cache (faster than a batch of one). A sequence with a speculative draft this step
        verifies it alone, in one pass of its own (``_speculate``)."""
        self._shift_contexts()
        speculated = self._speculate() if speculative else set()
        joining = [
            s
            for s in self.slots
            if s.sequence is not None and (s.sequence.phase == "decode" or s.sequence.prompt_ready)
            and s.sequence not in self._batched and id(s.sequence) not in speculated
        ]
        batched = len(self.batch) + len(joining)
        if batched == 0:
            return
        if self.cont_batching and self.batched_decode and batched > 1:
            self._decode_batched(joining, loaded)
            return
        for slot in joining:
            self._step_alone(slot)

    def _shift_contexts(self) -> None:
        """Shift the context of every sequence whose next token would fill it (``--context-shift``):
        a batch row leaves the batch for it (its cache is its own again) and joins again below."""
        for slot in self.slots:
            seq = slot.sequence
            if seq is None or not seq.needs_shift:
                continue
            try:
                if seq in self._batched:
                    self.batch.remove([self.batch.sequences.index(seq)])
                seq.shift_context()
            except Exception as exc:
                self._fail(slot, exc)
                continue
            if seq.finished is not None:
                self._release(slot, True)

    def _speculate(self) -> set[int]:
        """Draft for every decoding sequence that speculates, and verify each non-empty draft:
        the pending token and the draft in one pass (a row leaves the batch for it, and joins
        again on a step without a draft). Returns the ids of the sequences stepped here."""
        stepped: set[int] = set()
        for slot in self.slots:
            seq = slot.sequence
            if seq is None or seq.speculator is None or seq.phase != "decode":
                continue
            try:
                draft = seq.draft_tokens()
                if not draft:
                    continue
                stepped.add(id(seq))
                if seq in self._batched:
                    self.batch.remove([self.batch.sequences.index(seq)])
                seq.speculate_step(draft)
            except Exception as exc:
                stepped.add(id(seq))
                self._fail(slot, exc)
                continue
            if seq.finished is not None:
                self._release(slot, True)
        return stepped

    def _step_alone(self, slot: Slot) -> bool:
        """One decode step of a sequence on its own cache; a failure fails this sequence only."""
        seq = slot.sequence
        try:
            if seq.prompt_ready:
                seq.prefill_step()  # the last prompt token, alone
            seq.step()
        except Exception as exc:
            self._fail(slot, exc)
            return False
        if seq.finished is not None:
            self._release(slot, True)
        return True

    def _decode_batched(self, joining: list[Slot], loaded: Any) -> None:
        """One batched step. A row whose own work raises fails alone. A forward pass that raises
        is undone and every row is stepped alone instead, which fails only the row at fault. If
        no row is at fault several steps in a row, the batched pass itself is the problem (the
        load-time probe missed it) and decoding stops batching; a one-off failure does not."""
        try:
            for slot in joining:
                self.batch.add(slot.sequence)
            finished, failed = self.batch.step()
            if len(self.batch) == 1:
                self.batch.remove([0])  # a lone sequence decodes faster on its own cache
        except ForwardFailed as err:
            if not err.restored:
                self._fail_batch(joining, err.error, loaded)
                return
            log.warning("batched decode pass failed (%s); stepping its %d rows alone", err.error, len(self.batch))
            rows = self.batch.remove(list(range(len(self.batch))))
            results = [self._step_alone(self.slots[seq.slot_id]) for seq in rows]
            self._batch_only_failures = self._batch_only_failures + 1 if all(results) else 0
            if self._batch_only_failures >= BATCH_FAILURES_TOLERATED:
                log.warning("batched decode keeps failing where every row works alone; one sequence per pass from now on")
                self.batched_decode = False
            return
        except Exception as exc:  # the batch cache itself is in doubt: its rows cannot go on
            self._fail_batch(joining, exc, loaded)
            return
        self._batch_only_failures = 0
        for seq, exc in failed:
            self._fail(self.slots[seq.slot_id], exc)
        for seq in finished:
            self._release(self.slots[seq.slot_id], True)

    def _fail_batch(self, joining: list[Slot], exc: Exception, loaded: Any) -> None:
        members = set(map(id, self.batch.sequences)) | {id(s.sequence) for s in joining}
        self.batch = DecodeBatch(loaded.model, loaded.decoder)
        for slot in self.slots:
            if slot.sequence is not None and id(slot.sequence) in members:
                self._fail(slot, exc)

    @property
    def _batched(self) -> set[Any]:
        return set(self.batch.sequences)


def _waits_for_sibling(seq: Sequence, waiting: list[Sequence]) -> bool:
    """A later completion of a shared prompt waits while an earlier sibling prefills it."""
    group = seq.request.share_group
    return group >= 0 and any(
        o.request.share_group == group and o.request.task_id < seq.request.task_id and len(o.cache_tokens) < o.n_prompt - 1
        for o in waiting
        if o.finished is None
    )


def _share_prompt(seq: Sequence, waiting: list[Sequence]) -> None:
    """Once ``seq`` holds its prompt's KV (all but the last token), give each sibling
    completion of the same prompt (``n_cmpl``) a copy; they then sample on their own."""
    if seq.request.share_group < 0 or len(seq.cache_tokens) != seq.n_prompt - 1 or seq.finished is not None:
        return
    for other in waiting:
        same_group = other.request.share_group == seq.request.share_group
        if other is not seq and same_group and other.finished is None and len(other.cache_tokens) < len(seq.cache_tokens):
            other.cache = copy_cache(seq.cache)
            other.adopt(len(seq.cache_tokens), shared=True)
