"""One running sequence: its cache, its sampler chain, its text stream and its counters.

The engine thread drives a sequence with :meth:`Sequence.step`, which does one unit of work: one
prefill chunk, or one decode step. Decode is pipelined like mlx-lm's ``generate_step``: the graph
for token n+1 is built and handed to ``mx.async_eval`` before token n is read back, so the CPU
never waits idle between steps.

Prefill chunks are aligned on absolute multiples of the chunk size (``--batch-size``), so that a
cache hit reproduces the cold run bit for bit when the adopted length is itself on such a
boundary (``prompt_chunks.py``).

A sequence with a grammar (``engine/grammar.py``) cannot build token n+1's draw before token n is
known: the mask depends on it. It still queues the forward pass for n+1 first, then reads token n
back, feeds it to its grammar and computes the mask while that pass runs, and only then adds the
masked draw to the graph (:meth:`Sequence.draw_pending`). The model never waits for the grammar.

The passes themselves (CPU decode runtime or MLX) are ``forward.py``'s, the counters and the
events reporting them ``sequence_stats.py``'s, llama-server's newline rules ``line_rules.py``'s,
and speculative decoding's steps ``speculative_sequence.py``'s.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any, Callable, Sequence as Seq

import mlx.core as mx

from mlxcel_compat.engine.forward import forward_logits, prefill_chunk
from mlxcel_compat.engine.grammar import GrammarState, compute_masks
from mlxcel_compat.engine.line_rules import LineRules
from mlxcel_compat.engine.prompt_chunks import next_chunk, prompt_tail
from mlxcel_compat.engine.reasoning_budget import ReasoningBudget
from mlxcel_compat.engine.request import EngineEvent, FinishEvent, GenerationRequest, ProgressEvent
from mlxcel_compat.engine.sampling.chain import SamplerChain
from mlxcel_compat.engine.sequence_stats import SequenceStats, fill_probs
from mlxcel_compat.engine.textstream import TextStream, token_is_complete_utf8
from mlxcel_compat.runtime.decode_kv import OwnedCache

log = logging.getLogger(__name__)

# Release MLX's buffer cache every so many decode steps (as mlx-lm does) to bound memory.
CLEAR_EVERY = 256


class Sequence:
    """Per-request generation state. Lives and dies on the engine thread."""

    def __init__(
        self,
        request: GenerationRequest,
        model: Any,
        cache: list[Any],
        n_ctx: int,
        chunk_size: int,
        chain: SamplerChain,
        text: TextStream,
        eog_ids: set[int],
        emit: Callable[[EngineEvent], None],
        slot_id: int,
        grammar: GrammarState | None = None,
        decoder: Any = None,
    ) -> None:
        self.request = request
        self.model = model
        self.cache = cache
        self.n_ctx = n_ctx
        self.chunk_size = max(1, chunk_size)
        self.chain = chain
        self.text = text
        self.eog_ids = eog_ids
        self.emit = emit
        self.slot_id = slot_id
        self.grammar = grammar
        # model.cpu_decode.CpuDecoder: this sequence's single-token steps run there (alone here,
        # in a batch through engine/batch.py), writing only the buffers it made for it (``owned``).
        self.decoder = decoder
        # The positions a bounded request can fill (its prompt and n_predict, within the
        # context): the decoder allocates its buffers for them at once, not in growing copies.
        # An unbounded one (n_predict -1) grows them as it goes.
        bound = len(request.prompt_tokens) + max(request.n_predict, 1) if request.n_predict >= 0 else 0
        self.owned = OwnedCache(reserve=min(bound, n_ctx))
        # A hit's rest may be fed with its last token in one prefill chunk (prompt_tail); set by
        # the factory where the runtime's rows match a prefill chunk (factory.rows_match_chunks).
        self.tail_rows = False
        self.prompt = request.prompt_tokens
        # Tokens whose KV/state the cache holds, in order (prompt first, then fed-back samples).
        self.cache_tokens: list[int] = []
        self.generated: list[int] = []
        self.stats = SequenceStats()
        self.finished: FinishEvent | None = None
        self.cancelled = False
        self._pending: Any = None  # (token, logprobs, probs) of the step in flight
        self._undrawn: Any = None  # grammar: logits in flight whose token waits for the mask
        self._feeding_prompt = False  # a batch step is feeding the last prompt token
        # The logits at the prompt's last position: computed by this sequence's last prefill
        # pass, or its donor's (a whole prompt adopted, ``adopt``); the prompt cache keeps them
        # with the entry this sequence donates (``PrefixCache.donate``).
        self.final_logits: Any = None
        self._ready_logits: Any = None  # adopted ones, not yet sampled
        # Snapshot families: prefill stops exactly at the rendered history's end and calls back.
        self.boundary: int | None = None
        self.on_boundary: Callable[["Sequence"], None] | None = None
        # Explicit cache breakpoints still ahead: (position, pin seconds), ascending; once the
        # cache holds a position, on_pin stores a pinned copy of that prefix.
        self.pins: list[tuple[int, float]] = []
        self.on_pin: Callable[["Sequence", int, float], None] | None = None
        self._history: list[int] = list(self.prompt)
        # llama-server's newline rules: the text sent so far (kept for n_indent only), whether a
        # newline was sent (t_max_predict_ms, /slots has_new_line) and where the last line starts.
        self.lines = LineRules(request.n_indent, request.t_max_predict_ms)
        # engine.speculative.Speculator: this sequence's drafting (None: plain decoding).
        self.speculator: Any = None
        spec = request.reasoning_budget
        self.budget = ReasoningBudget(spec, partial(token_is_complete_utf8, text.tokenizer)) if spec is not None else None
        # A plain greedy sequence on the CPU decode runtime: its eager steps take the argmax of
        # the runtime's logits in NumPy (_decode_step_eager). Decided once: none of it changes.
        self._runtime_argmax = (decoder is not None and self.budget is None and request.n_probs <= 0
                                and grammar is None and chain.is_plain_argmax)
        # Context shift (engine/context_shift.py): the model's key rotation where the server
        # shifts and this sequence may (set by the factory); None stops at the context limit.
        self.rotation: Any = None
        self.n_shifts = 0
        # The leading tokens whose KV a cold prefill reproduces: all of them until a shift, the
        # kept ones after it. Only these are ever reused (donated, kept by the slot).
        self.exact_tokens: int | None = None

    # ------------------------------------------------------------------ public

    @property
    def n_prompt(self) -> int:
        return len(self.prompt)

    @property
    def phase(self) -> str:
        """"prefill" until the first token is sampled, then "decode", then "done"."""
        if self.finished is not None:
            return "done"
        return "prefill" if self._pending is None else "decode"

    @property
    def prompt_ready(self) -> bool:
        """Everything but the last prompt token is in the cache: the next forward pass that feeds
        it samples the first token. A batch does that for many such sequences in one (B, 1) pass
        instead of one (1, 1) pass each, which costs nearly as much as a whole batched step."""
        return self.finished is None and self._pending is None and 0 < len(self.cache_tokens) == self.n_prompt - 1

    def adopt(self, n_tokens: int, shared: bool = False, final_logits: Any = None) -> None:
        """Record that the cache already holds the first ``n_tokens`` prompt tokens.

        ``shared``: they came from a sibling completion of the same request (``n_cmpl``), not
        from the prompt cache; they are not computed again, so they count as cached.
        ``final_logits``: the whole prompt is adopted (``n_tokens == n_prompt``), with the logits
        its donor computed at the prompt's last position: the first token is sampled from them,
        and no forward pass runs before it (``PrefixCache.adopt``).
        """
        whole = final_logits is not None and n_tokens == self.n_prompt
        assert 0 <= n_tokens < self.n_prompt or whole, f"{n_tokens=} {self.n_prompt=}"
        self._ready_logits = final_logits if whole else None
        self.cache_tokens = list(self.prompt[:n_tokens])
        self.stats.n_cached = n_tokens
        self.stats.shared = shared

    def cancel_now(self) -> None:
        """Finish as cancelled (the client went away); the state stays consistent for donation."""
        if self.finished is None:
            self._finish("none", "", cancelled=True)

    def step(self) -> None:
        """Do one unit of work on this sequence alone: a prefill chunk, or one decode step."""
        if self.finished is not None:
            return
        if self.cancelled:
            self.cancel_now()
        elif self._pending is None:
            self.prefill_step()
        else:
            self.decode_step()

    # ------------------------------------------------------------------ context shift

    @property
    def needs_shift(self) -> bool:
        """The next token fed would fill the context, and this sequence shifts instead of stopping."""
        return (self.rotation is not None and self.finished is None and self._pending is not None
                and len(self.cache_tokens) + 1 >= self.n_ctx)

    def shift_context(self) -> None:
        """Drop the middle of the cache as llama-server's context shift does (``context_shift.py``).
        The sequence must own its cache (not be a row of a decode batch)."""
        from mlxcel_compat.engine.context_shift import plan_shift, shift_cache

        plan = plan_shift(len(self.cache_tokens), self.n_ctx, self.n_prompt, self.request.n_keep,
                          self.request.n_discard, self.rotation.add_bos)
        log.warning("task %d: context shift, n_keep = %d, n_left = %d, n_discard = %d", self.request.task_id,
                    plan.n_keep, len(self.cache_tokens) - plan.n_keep, plan.n_discard)
        if plan.n_discard <= 0:
            self._finish("limit", "", truncated=True)
            return
        shift_cache(self.cache, self.rotation, plan)
        del self.cache_tokens[plan.n_keep:plan.n_keep + plan.n_discard]
        self.exact_tokens = min(plan.n_keep, self.exact_tokens if self.exact_tokens is not None else plan.n_keep)
        self.n_shifts += 1

    # ------------------------------------------------------------------ batched decode
    # A DecodeBatch owns the cache while the sequence is in it; per step it feeds every row's
    # pending token at once, samples each row with the row's own chain, then reads back.

    def begin_batched_feed(self) -> tuple[Any, Any, Any]:
        """Hand the pending (sampled, not yet fed) token to the batch; return the pending step.

        A prompt-ready sequence hands over its last prompt token instead: the batch step then
        samples its first token.
        """
        if self._pending is None:
            assert self.prompt_ready, "only a prompt-ready sequence joins a batch without a sampled token"
            self._feeding_prompt = True
            self.cache_tokens.append(self.prompt[-1])
            self.stats.n_prompt_processed += 1
            return mx.array(self.prompt[-1], dtype=mx.int32), None, None
        pending = self._pending
        if self.budget is not None:
            self.budget.accept(int(pending[0].item()))  # the budget masks this row's next sample
        self._history.append(pending[0])
        self.cache_tokens.append(-1)  # filled in by finish_batched_feed
        if self.stats.t_prompt_done is None:
            mx.eval(pending[0])
            self.stats.t_prompt_done = time.perf_counter()
        return pending

    def undo_batched_feed(self) -> None:
        """The batch's forward pass failed and its cache was rolled back: forget the fed token, so
        the sequence is exactly as it was before :meth:`begin_batched_feed` (and can step alone)."""
        self.cache_tokens.pop()
        if self._feeding_prompt:
            self._feeding_prompt = False
            self.stats.n_prompt_processed -= 1
        else:
            self._history.pop()

    def sample_next(self, logits: Any, token: Any = None, allowed: Any = None) -> list[Any]:
        """Sample the next token from this row's logits (lazily); returns arrays to evaluate.

        ``token``: already chosen by the batch (plain argmax rows); log-probabilities are then
        still available lazily from ``logits`` if a caller needs them. ``allowed``: the grammar's
        mask (an ``mx.array`` of booleans).
        """
        if token is not None and self.budget is None:
            self._pending = (token, logits - mx.logsumexp(logits), None)
        else:
            result = self.chain.sample(self._budget_mask(logits), self._history, allowed)
            self._pending = (result.token, result.logprobs, result.probs)
        self._undrawn = None
        return self._pending_arrays()

    def defer_draw(self, logits: Any) -> None:
        """Grammar rows: keep this step's logits; the draw waits for the fed token's mask."""
        self._undrawn = logits

    def finish_batched_feed(self, token: int, logprobs: Any, probs: Any) -> None:
        if self._feeding_prompt:  # the fed token was the prompt's: nothing was generated yet
            self._feeding_prompt = False
            if self.request.return_progress:
                self.report_progress()  # processed == total: the whole prompt is in the cache
            return
        self._history[-1] = token
        self.cache_tokens[-1] = token
        self._accept(token, logprobs, probs)  # finishes on EOS, a stop string or the budget
        if self.finished is None and self._context_full():
            self._finish("limit", "", truncated=True)

    # ------------------------------------------------------------------ prefill

    def prefill_step(self, rows_tail: bool = False) -> int:
        """Prefill one aligned chunk, or the last prompt token (which samples the first token).
        ``rows_tail``: feed the rest of the prompt in one pass that samples the first token, where
        :meth:`prompt_tail` allows it (the engine asks when this sequence prefills alone).

        Returns the number of prompt tokens processed.
        """
        last = self.n_prompt - 1
        tail = self.prompt_tail() if rows_tail else None
        if tail is None and len(self.cache_tokens) < last:
            chunk = self.next_chunk()
            prefill_chunk(self.model, self.decoder, self.cache, self.owned, self.request.lora, chunk)
            self.chunk_done(chunk)
            return len(chunk)
        # The final prompt token (or the short tail that ends with it) produces the logits of
        # the first sampled token; a whole prompt adopted with its donor's logits feeds nothing.
        fed = [] if self._ready_logits is not None else tail if tail is not None else self.prompt[last:]
        self.stats.n_prompt_processed += len(fed)
        logits, self._ready_logits = (self._forward_logits(fed) if fed else self._ready_logits), None
        self.final_logits = logits
        if self.grammar is None:
            self._pending = self._sample(logits)
            mx.async_eval(*self._pending_arrays())
        else:
            self._undrawn = logits
            mx.async_eval(self._undrawn)
            self._draw_alone()
        if self.request.return_progress:
            self.report_progress()  # processed == total: the whole prompt is in the cache
        return len(fed)

    def prompt_tail(self) -> list[int] | None:
        """The rest of the prompt, its last token included, when one pass feeds it and its last
        row samples the first token (``prompt_chunks.prompt_tail``: decode rows, or a hit's rest
        in one chunk, that one where the factory found rows compute as a chunk would:
        ``tail_rows``); None otherwise. Only on the CPU decode runtime, before the first token.

        The engine takes it only for a sequence that prefills alone: with others, the tail's
        chunk shares one batched pass with theirs. Not for a completion whose siblings copy its
        prompt's KV (``n_cmpl``: they take it one token short).
        """
        if self.decoder is None or self._pending is not None or self.request.share_group >= 0:
            return None
        return prompt_tail(self.prompt, len(self.cache_tokens), self.chunk_size, self.boundary, self.pins,
                           lambda: self.decoder.can_feed_tail(self.cache, self.owned), self.tail_rows)

    def next_chunk(self) -> list[int]:
        """The prompt tokens of the next prefill chunk (``prompt_chunks.next_chunk``): up to the
        next multiple of the chunk size, the snapshot boundary or the last prompt token."""
        return next_chunk(self.prompt, len(self.cache_tokens), self.chunk_size, self.boundary)

    def chunk_done(self, chunk: list[int]) -> None:
        """The cache now holds ``chunk`` too (computed alone or in a batched prefill pass)."""
        self.cache_tokens.extend(chunk)
        self.stats.n_prompt_processed += len(chunk)
        if self.boundary is not None and len(self.cache_tokens) == self.boundary and self.on_boundary is not None:
            self.boundary = None
            self.on_boundary(self)
        self.pin_reached()

    def pin_reached(self) -> None:
        """Pin every breakpoint the cache now covers."""
        while self.pins and self.pins[0][0] <= len(self.cache_tokens) and self.on_pin is not None:
            position, ttl = self.pins.pop(0)
            self.on_pin(self, position, ttl)
        if self.request.return_progress:
            self.report_progress()

    def report_progress(self) -> None:
        """A ``ProgressEvent``: the prompt tokens in the cache now, the adopted ones included.

        Sent when the sequence starts (the adopted prefix), after each prefill chunk and when the
        last prompt token is in; ``server/progress.py`` maps them onto llama-server's reports.
        """
        done = len(self.cache_tokens)
        self.emit(
            ProgressEvent(
                total=self.n_prompt,
                cache=self.stats.n_cached,
                processed=done,
                time_ms=(time.perf_counter() - self.stats.t_start) * 1000.0,
                id_slot=self.slot_id,
            )
        )

    # ------------------------------------------------------------------ decode

    def _forward_logits(self, tokens: list[int] | mx.array) -> Any:
        logits, fed = forward_logits(self.model, self.decoder, self.cache, self.owned, self.request.lora, tokens)
        self.cache_tokens.extend(fed)
        return logits

    def _forward(self, tokens: list[int] | mx.array) -> tuple[Any, Any, Any]:
        return self._sample(self._forward_logits(tokens))

    def _argmax_step(self, token: int) -> tuple[Any, Any, Any]:
        """A plain greedy step on the CPU decode runtime (``_runtime_argmax``, on a cache it
        runs): the argmax of its logits buffer after the logit bias, in NumPy
        (``SamplerChain.argmax_of``), not a round trip through MLX's scheduler (~0.1 ms a token);
        nothing reads the log-probabilities."""
        logits = self.decoder.step(token, self.cache, self.owned, self.request.lora or None)
        self.cache_tokens.append(token)
        return mx.array(self.chain.argmax_of(logits), dtype=mx.int32), None, None

    def _sample(self, logits: Any) -> tuple[Any, Any, Any]:
        result = self.chain.sample(self._budget_mask(logits), self._history)
        return result.token, result.logprobs, result.probs

    def _budget_mask(self, logits: Any) -> Any:
        """While the thinking budget forces a token, every other token is impossible."""
        forced = self.budget.forced_token() if self.budget is not None else None
        if forced is None:
            return logits
        return mx.where(mx.arange(logits.shape[-1]) == forced, logits, float("-inf"))

    def _pending_arrays(self) -> list[Any]:
        """What to evaluate for the step in flight: the token, plus probabilities only if asked."""
        if self.request.n_probs <= 0:
            return [self._pending[0]]
        return [a for a in self._pending if a is not None]

    def decode_step(self) -> None:
        """One pipelined decode step of this sequence alone (it owns its cache)."""
        token_arr, logprobs, probs = self._pending
        if self.stats.t_prompt_done is None:
            mx.eval(token_arr)
            self.stats.t_prompt_done = time.perf_counter()
        if self.grammar is not None:
            self._decode_step_constrained(token_arr, logprobs, probs)
        else:
            self._decode_step_pipelined(token_arr, logprobs, probs)
        if len(self.generated) % CLEAR_EVERY == 0:
            mx.clear_cache()

    def _decode_step_pipelined(self, token_arr: Any, logprobs: Any, probs: Any) -> None:
        if self._room_for_more() and self._forward_is_eager():
            self._decode_step_eager(token_arr, logprobs, probs)
            return
        if self._room_for_more() and self.budget is not None:
            # The thinking budget decides the next step from this token: read it first.
            token = int(token_arr.item())
            self.budget.accept(token)
            self._history.append(token)
            self._pending = self._forward([token])
            mx.async_eval(*self._pending_arrays())
        elif self._room_for_more():
            # Pipelining: feed the (still lazy) token back and launch step n+1 before reading it.
            self._history.append(token_arr)
            self._pending = self._forward(token_arr)
            mx.async_eval(*self._pending_arrays())
            token = int(token_arr.item())
            self._history[-1] = token
            self.cache_tokens[-1] = token
        else:
            token = int(token_arr.item())
            self._history.append(token)
            self._pending = None
        self._accept(token, logprobs, probs)
        if self.finished is None and self._pending is None:
            self._finish("limit", "", truncated=self._context_full())

    def _forward_is_eager(self) -> bool:
        """Whether the next single-token forward pass runs to completion when it is called (the
        CPU decode runtime) rather than being queued on MLX's scheduler."""
        return self.decoder is not None and self.decoder.can_run(self.cache, self.owned)

    def _decode_step_eager(self, token_arr: Any, logprobs: Any, probs: Any) -> None:
        """A decode step whose forward pass runs synchronously (the CPU decode runtime): token n
        is read back and sent first, then step n+1 runs. Pipelining buys nothing there (nothing
        overlaps a call that returns finished), and feeding first would hold every token, the
        first one included, back for a whole step: on a full cache hit that step was as long
        as the hit itself. A token that ends the sequence (EOS, a stop string, the budget) is not
        fed at all, as in the no-room case."""
        token = int(token_arr.item())
        if self.budget is not None:
            self.budget.accept(token)  # the thinking budget masks the next sample from this token
        self._history.append(token)
        self._pending = None
        self._accept(token, logprobs, probs)
        if self.finished is None:
            self._pending = self._argmax_step(token) if self._runtime_argmax else self._forward([token])
            mx.async_eval(*self._pending_arrays())

    def _decode_step_constrained(self, token_arr: Any, logprobs: Any, probs: Any) -> None:
        """The grammar's decode step: queue the forward pass fed with token n, read n back, feed it
        to the grammar, then draw n+1 under the mask computed while the pass runs."""
        room = self._room_for_more()
        self._history.append(token_arr)
        if room:
            self._undrawn = self._forward_logits(token_arr)
            mx.async_eval(self._undrawn)
        token = int(token_arr.item())
        self._history[-1] = token
        if room:
            self.cache_tokens[-1] = token
            if self.budget is not None:
                self.budget.accept(token)  # the thinking budget may force the next token
        self._pending = None
        self._accept(token, logprobs, probs)
        if self.finished is None:
            if room:
                self._draw_alone()
            else:
                self._finish("limit", "", truncated=self._context_full())

    def _accept(self, token: int, logprobs: Any, probs: Any) -> None:
        self.generated.append(token)
        event = self.stats.token_event(token, len(self.generated), self.slot_id, self.n_prompt)
        if self.request.n_probs > 0:
            fill_probs(event, token, logprobs, probs, self.request.n_probs, self.request.post_sampling_probs)
        piece = self.text.push(token)  # an end-of-generation token flushes held-back text
        eog = token in self.eog_ids and not self.request.sampling.ignore_eos
        grammar = self.grammar
        complete = False
        if grammar is not None and not eog and not piece.stopped:
            grammar.accept(token)
            # A complete grammar admits only the end of generation: stop here, with the text
            # flushed as an end-of-generation token would (llama.cpp samples that EOS instead).
            complete = grammar.complete
        event.text = piece.text + (self.text.finish() if complete else "")
        self.emit(event)
        self.lines.add_text(event.text)
        if eog:
            self._finish("eos", "")
        elif piece.stopped:
            self._finish("word", piece.stopping_word)
        elif complete:
            self._finish("eos", "")
        elif grammar is not None and grammar.error is not None:
            self._grammar_failed()
        elif (not self._budget_left() or self.lines.under_indented()
              or self.lines.out_of_time(piece.text, self.stats.t_prompt_done)):
            self._finish("limit", "")

    def _grammar_failed(self) -> None:
        """The grammar cannot go on (llguidance gave up): end with what was generated."""
        assert self.grammar is not None
        log.warning("task %d: grammar stopped the generation: %s", self.request.task_id, self.grammar.error)
        self._finish("limit", "")

    def _budget_left(self) -> bool:
        n_predict = self.request.n_predict
        # llama-server checks the budget after sampling, so n_predict=0 still yields one token.
        return n_predict < 0 or len(self.generated) < max(n_predict, 1)

    def _context_full(self) -> bool:
        return self.rotation is None and len(self.prompt) + len(self.generated) >= self.n_ctx

    def _room_for_more(self) -> bool:
        """Before reading the token in flight: may it be fed back for one more step? (With a
        context shift, the scheduler makes room before the step: ``needs_shift``.)"""
        room = self.rotation is not None or len(self.prompt) + len(self.generated) + 1 < self.n_ctx
        return self._budget_left_after_next() and room

    def _budget_left_after_next(self) -> bool:
        n_predict = self.request.n_predict
        return n_predict < 0 or len(self.generated) + 1 < max(n_predict, 1)

    # ------------------------------------------------------------------ finish

    def _finish(self, stop_type: str, stopping_word: str, *, truncated: bool = False, cancelled: bool = False) -> None:
        if self._pending is not None:
            # The step in flight was fed a token we report: make its state real before donation.
            mx.eval(*self._pending_arrays())
            self._pending = None
        if self._undrawn is not None:
            mx.eval(self._undrawn)
            self._undrawn = None
        tail = "" if stop_type in ("word", "eos") or cancelled else self.text.finish()
        self.finished = self.stats.finish_event(
            stop_type, stopping_word, tail, n_prompt=self.n_prompt, n_decoded=len(self.generated),
            tokens_cached=len(self.cache_tokens), truncated=truncated or self.n_shifts > 0, id_slot=self.slot_id, seed=self.chain.seed,
            cancelled=cancelled, content_cut=self.lines.content_cut,
        )
        self.emit(self.finished)

    def _draw_alone(self) -> None:
        """Draw this grammar sequence's in-flight token outside a batch: its failure raises here,
        as any error of its own step does (a batch instead fails the row, ``draw_pending``)."""
        failed = draw_pending([self])
        if failed:
            raise failed[0][1]


def draw_pending(seqs: Seq[Sequence]) -> list[tuple[Sequence, Exception]]:
    """Draw the next token of grammar sequences whose logits are in flight (``_undrawn``).

    The masks of all of them are computed together (in parallel, the GIL released) while the
    forward pass runs; each draw is then queued behind it. Returns the sequences whose own draw
    raised, with the error, so that a batch can fail that row alone; the others are drawn.
    """
    active = [s for s in seqs if s.grammar is not None and s.grammar.active]
    masks = compute_masks([s.grammar for s in active], active[0].grammar.compiler.vocab_size) if active else None  # type: ignore[union-attr]
    allowed = {id(s): masks[k] for k, s in enumerate(active)} if masks is not None else {}
    pending: list[Any] = []
    failed: list[tuple[Sequence, Exception]] = []
    for seq in seqs:
        assert seq.grammar is not None and seq._undrawn is not None
        if seq.grammar.error is not None:
            seq._grammar_failed()
            continue
        mask = allowed.get(id(seq))
        try:
            pending += seq.sample_next(seq._undrawn, allowed=None if mask is None else mx.array(mask))
        except Exception as exc:
            failed.append((seq, exc))
    if pending:
        mx.async_eval(*pending)
    return failed
