"""The engine thread: the only code that touches MLX.

HTTP handlers talk to it through a thread-safe command queue (submit, cancel, call) and receive
events through a per-request sink (see ``client.py``). One loop iteration:

    drain commands  ->  admit waiting requests into free slots  ->  prefill about one chunk
    (``--batch-size`` tokens) in total, similar chunks of several sequences in one pass  ->  one
    decode step of every decoding sequence in one batched pass, prompt-ready sequences feeding
    their last prompt token  ->  release finished sequences

Up to ``--parallel`` sequences are active at once; the rest wait in FIFO order (``id_slot`` pins
a request to a slot). With ``--no-cont-batching`` one sequence runs at a time.
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from mlxcel_compat.runtime import backend
from mlxcel_compat.engine.batch import (DecodeBatch, ForwardFailed, batch_caches_work, prefill_groups, prefill_together,
                                         probe_cache)
from mlxcel_compat.engine.factory import make_sequence
from mlxcel_compat.engine.grammar import GrammarCompiler
from mlxcel_compat.engine.kept_state import keep_state
from mlxcel_compat.engine.metrics import EngineMetrics
from mlxcel_compat.engine.request import EngineEvent, ErrorEvent, FinishEvent, GenerationRequest, Sink
from mlxcel_compat.engine.sequence import Sequence
from mlxcel_compat.engine.slots import Slot, slot_context

log = logging.getLogger(__name__)

WARMUP_QUEUE = 8  # pending background warm-ups (one per session)
SHUTTING_DOWN = "Server is shutting down"
NO_LOGITS = "the current context does not support logits computation. skipping"  # an encoder cannot generate
BATCH_FAILURES_TOLERATED = 3  # failed batched passes in a row, with no faulty row, before batching stops


def unavailable(message: str = SHUTTING_DOWN) -> ErrorEvent:
    return ErrorEvent(message, type="unavailable_error", code=503)


def empty_finish(request: GenerationRequest) -> FinishEvent:
    """The whole answer to a request without prompt tokens: nothing generated, no slot used."""
    return FinishEvent("limit", "", "", 0, 0, 0, 0, 0.0, 0.0, False, -1, request.sampling.seed)


@dataclass
class EngineConfig:
    """What the engine needs from the settings (kept small so tests can build one directly)."""

    model: str  # a local directory or .gguf file (or a hub id, resolved at load)
    aliases: list[str] = field(default_factory=list)
    model_name: str | None = None  # what the user asked for (-hf user/repo:quant), for the display id
    offline: bool = False
    repack: bool = True  # ggml's repacked layouts for quantized GGUF weights (llama.cpp's --repack)
    ctx_size: int = 0  # 0: the model's training context
    n_parallel: int = 4
    kv_unified: bool = False  # True: every slot may use the whole context (llama.cpp's -kvu)
    batch_size: int = 2048  # prefill chunk
    cont_batching: bool = True  # False: decode one sequence at a time (no batched steps)
    sleep_idle_seconds: int = -1  # unload the model after this many idle seconds (<= 0: never)
    keep_slot_state: bool = False  # slots keep their last state for slot files (--slot-save-path)
    adapters: list[Any] = field(default_factory=list)  # lora.AdapterFile: LoRA adapters, installed unfused
    speculative: Any = None  # engine.speculative.SpecConfig (None: plain decoding)


@dataclass
class _Submit:
    request: GenerationRequest
    sink: Sink


@dataclass
class _Cancel:
    task_id: int


@dataclass
class _Warmup:
    job: Any  # engine.snapshots.WarmupJob


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: Future
    wake: bool = False  # reload a sleeping model first (fn uses the weights)


@dataclass
class _Shutdown:
    running_too: bool  # False: refuse new and waiting requests only


@dataclass
class _SlotCall:
    slot_id: int
    fn: Callable[[Slot], Any]
    future: Future


class Engine:
    """Owns the model, its caches and the scheduler; runs them on one thread."""

    def __init__(self, config: EngineConfig, prefix_cache_factory: Callable[["Engine"], Any] | None = None) -> None:
        self.config = config
        self.state = "loading"  # loading -> ready | failed
        self.sleeping = False  # ready, but the model is unloaded until the next request (--sleep-idle-seconds)
        self._idle_since = time.monotonic()
        self.load_error: str | None = None
        self.loaded: Any = None  # LoadedModel once ready
        self.n_ctx = 0  # per slot: what one sequence may hold (prompt + generated tokens)
        self.n_ctx_total = 0
        self.metrics = EngineMetrics()
        self.slots: list[Slot] = [Slot(i) for i in range(max(1, config.n_parallel))]
        self.waiting: collections.deque[_Submit] = collections.deque()
        self.warmups: collections.deque[Any] = collections.deque()
        self.slot_calls: list[_SlotCall] = []  # slot actions waiting for their slot to be idle
        self.prefix_cache: Any = None
        self.draft: Any = None  # engine.speculative.DraftModel once loaded (-md)
        self.ngram_table: Any = None  # engine.speculative.NgramModTable (ngram-mod: shared by all sequences)
        self.speculative: Any = None  # engine.speculative.SpecConfig in force (None: off)
        self.grammars: Any = None  # engine.grammar.GrammarCompiler once the model is loaded
        self.compat: Any = None  # cache.disk.Compat: what saved state must match (set at load)
        self.batch: DecodeBatch = DecodeBatch(None)
        self.batched_decode = True  # off if the model fails the batch-cache probe at load
        self.batched_prefill = True  # ... or later, a batched prefill pass
        self.accepting = True  # False once a shutdown has begun: new requests get 503
        self.n_engine_errors = 0  # sequences failed by an exception in the engine
        self._batch_only_failures = 0  # consecutive failed batched passes whose rows all worked alone
        self._held: list[tuple[Sink, FinishEvent]] | None = None  # finishes of the iteration in progress
        self._prefix_cache_factory = prefix_cache_factory
        self._commands: queue.Queue[Any] = queue.Queue()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlxcel-engine", daemon=True)

    # ------------------------------------------------------------------ API (any thread)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Loaded and its thread still running: requests submitted now will be served."""
        return self.state == "ready" and self._thread.is_alive() and not self._stop.is_set()

    def wait_ready(self, timeout: float | None = None) -> bool:
        self._ready.wait(timeout)
        return self.state == "ready"

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine thread to stop after its current step and wait up to ``timeout`` s."""
        cache = self.prefix_cache
        if cache is not None and self.state == "ready" and self._thread.is_alive():
            # A clean stop writes the prompt cache's RAM entries to its disk tier first.
            try:
                self.call(cache.close).result(timeout=60)
            except Exception:
                log.exception("prompt cache: shutdown flush failed")
        self._stop.set()
        self._commands.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            _wait_for_os_thread(self._thread.native_id, timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        self._commands.put(_Submit(request, sink))

    def cancel(self, task_id: int) -> None:
        self._commands.put(_Cancel(task_id))

    def warmup(self, job: Any) -> None:
        """Queue a background warm-up of a session's next turn (snapshot families only)."""
        self._commands.put(_Warmup(job))

    def shutdown(self, running_too: bool = False) -> None:
        """Begin a shutdown: waiting and new requests end with a 503 error event; with
        ``running_too`` the running ones as well (their state may still be donated)."""
        self._commands.put(_Shutdown(running_too))

    def call(self, fn: Callable[[], Any], wake: bool = False) -> Future:
        """Run ``fn`` on the engine thread between steps (cache stats, reset, ...); ``wake``: ``fn``
        computes with the model (embeddings), so a sleeping one is reloaded first."""
        future: Future = Future()
        self._commands.put(_Call(fn, future, wake))
        return future

    def call_on_slot(self, slot_id: int, fn: Callable[[Slot], Any]) -> Future:
        """Run ``fn(slot)`` on the engine thread once that slot is idle (slot save/restore/erase;
        llama-server defers them while the slot is busy)."""
        future: Future = Future()
        self._commands.put(_SlotCall(slot_id, fn, future))
        return future

    @property
    def n_deferred(self) -> int:
        return len(self.waiting)

    @property
    def n_processing(self) -> int:
        return sum(1 for s in self.slots if s.is_processing)

    # ------------------------------------------------------------------ engine thread

    def _run(self) -> None:
        try:
            self._load()
        except Exception as exc:  # reported by /health; the process stays up to say why
            log.exception("model load failed")
            self.load_error = str(exc)
            self.state = "failed"
            self._ready.set()
            return
        self.state = "ready"
        self._ready.set()
        while not self._stop.is_set():
            try:
                self._iterate()
            except Exception as exc:  # a bug outside the per-sequence guards: keep serving
                log.exception("engine iteration failed; failing the running sequences")
                self._fail_all(exc)

    def _iterate(self) -> None:
        idle = not self._has_work() and not self.warmups
        self._drain_commands(block=idle, timeout=self._time_to_sleep() if idle else None)
        if self.sleeping and self.waiting:
            self._wake()
        self._run_slot_calls()
        self._admit()
        if self._has_work():
            self._step_all()
            self._idle_since = time.monotonic()
        elif self.warmups:
            self._run_warmup()
        elif self._time_to_sleep() == 0.0:
            self._sleep()

    # ------------------------------------------------------------------ sleep (--sleep-idle-seconds)

    def _time_to_sleep(self) -> float | None:
        """Seconds until the idle model should be unloaded (None: never; 0: now)."""
        limit = self.config.sleep_idle_seconds
        if limit <= 0 or self.sleeping:
            return None
        return max(0.0, limit - (time.monotonic() - self._idle_since))

    def _sleep(self) -> None:
        """Unload the model and hand its memory back; the tokenizer and the prompt cache stay
        (cached KV is still valid for the same weights once they are reloaded)."""
        import gc

        import mlx.core as mx

        before = mx.get_active_memory()
        self.loaded.model = self.loaded.decoder = None  # the decoder's views hold the weights too
        self.batch = DecodeBatch(None)
        gc.collect()
        mx.clear_cache()
        self.sleeping = True
        log.info(
            "sleeping after %d idle seconds: model unloaded, %d bytes of MLX memory released (%d still in use)",
            self.config.sleep_idle_seconds, before - mx.get_active_memory(), mx.get_active_memory(),
        )

    def _wake(self) -> None:
        """Reload the model for a waiting request; if that fails, fail the waiting requests."""
        from mlxcel_compat.model.loader import load_model

        t0 = time.perf_counter()
        try:
            reloaded = load_model(self.config.model, self.config.aliases, offline=self.config.offline,
                                  adapters=self.config.adapters, repack=self.config.repack)
            self.loaded.model, self.loaded.decoder = reloaded.model, reloaded.decoder
        except Exception as exc:
            log.exception("could not reload the model after sleep")
            for sub in list(self.waiting):
                self.waiting.remove(sub)
                sub.sink(ErrorEvent(f"could not reload the model: {exc}"))
            return
        self.batch = DecodeBatch(self.loaded.model, self.loaded.decoder)
        self.sleeping = False
        log.info("woke up: model '%s' reloaded in %.1f s for a new request", self.loaded.model_id, time.perf_counter() - t0)

    def _load(self) -> None:
        from mlxcel_compat.model.loader import load_model

        t0 = time.perf_counter()
        self.loaded = load_model(self.config.model, self.config.aliases, offline=self.config.offline,
                                 name=self.config.model_name, adapters=self.config.adapters, repack=self.config.repack)
        n_ctx_train = int(_config_value(self.loaded.config, "max_position_embeddings", 4096))
        self.n_ctx_total, self.n_ctx = slot_context(self.config.ctx_size, len(self.slots), self.config.kv_unified, n_ctx_train)
        for slot in self.slots:
            slot.n_ctx = self.n_ctx
        if self.loaded.kind == "encoder":
            self._load_encoder(t0)
            return
        self.batch = DecodeBatch(self.loaded.model, self.loaded.decoder)
        tokenizer = self.loaded.tokenizer
        vocab_size = int(_config_value(self.loaded.config, "vocab_size", 0) or len(tokenizer))
        # The llguidance tokenizer is built by the first request with a grammar, on its worker
        # thread (~0.3 s on a 49k vocabulary, ~1 s on 150k): built at load it held ~33 MiB of every
        # server's memory (SmolLM2), used or not.
        self.grammars = GrammarCompiler(tokenizer, vocab_size, sorted(tokenizer.eos_token_ids or []))
        from mlxcel_compat.cache.disk import Compat
        from mlxcel_compat.cache.kv_io import runtime_tag

        self._load_speculative()
        fingerprint = self.loaded.fingerprint
        if self.draft is not None:  # prompt-cache entries then hold the draft's tensors too
            fingerprint = f"{fingerprint}+draft:{self.draft.loaded.fingerprint}"
        self.compat = Compat(model=fingerprint, runtime=runtime_tag(self.loaded.model))
        if self._prefix_cache_factory is not None:
            self.prefix_cache = self._prefix_cache_factory(self)
        self._warm_up()
        log.info(
            "model '%s' loaded from %s in %.1f s (%d parameters, n_ctx %d, %d slots of %d tokens%s)",
            self.loaded.model_id,
            self.loaded.path,
            time.perf_counter() - t0,
            self.loaded.n_params,
            self.n_ctx_total,
            len(self.slots),
            self.n_ctx,
            ", unified KV" if self.config.kv_unified else "",
        )

    def _load_speculative(self) -> None:
        """Speculative decoding (engine/speculative.py): load the draft model (-md) and check it
        against the target; a model whose cache cannot give back rejected positions (recurrent
        layers) decodes plainly, and the log says so."""
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

        from mlxcel_compat.engine.speculative import DraftModel, NgramModTable, check_vocabularies

        spec = self.config.speculative
        if spec is None or not spec.enabled:
            return
        if not can_trim_prompt_cache(make_prompt_cache(self.loaded.model)):
            log.warning("speculative decoding off: this model's cache cannot drop rejected draft tokens (recurrent layers)")
            return
        if spec.uses_draft_model:
            from mlxcel_compat.model.loader import load_model

            t0 = time.perf_counter()
            loaded = load_model(spec.draft_model, [], offline=self.config.offline, repack=self.config.repack)
            check_vocabularies(self.loaded.tokenizer, loaded.tokenizer)
            self.draft = DraftModel(loaded)
            log.info("draft model '%s' loaded in %.1f s (%d parameters, %s)", loaded.path, time.perf_counter() - t0,
                     loaded.n_params, "CPU decode runtime" if loaded.decoder is not None else "MLX steps")
        if "ngram-mod" in spec.active:
            self.ngram_table = NgramModTable(spec.mod_n_match)
        self.speculative = spec
        for slot in self.slots:
            slot.speculative = True
        log.info("speculative decoding: %s (draft n_max %d, n_min %d, p_min %.2f; ngram-simple n %d, m %d; "
                 "ngram-mod n_match %d, n_min %d, n_max %d)", spec.type_names, spec.draft_n_max, spec.draft_n_min,
                 spec.draft_p_min, spec.ngram_size_n, spec.ngram_size_m, spec.mod_n_match, spec.mod_n_min, spec.mod_n_max)

    def _load_encoder(self, t0: float) -> None:
        """An encoder serves embeddings and rerank only: no decode batch, prompt cache or warm-up
        of the decode path; generation requests are refused at submit (``_drain_commands``)."""
        import mlx.core as mx

        tokenizer = self.loaded.tokenizer
        vocab_size = int(self.loaded.config.get("vocab_size") or 0)
        self.grammars = GrammarCompiler(tokenizer, vocab_size, [])  # built lazily; never used here
        self.batched_decode = self.batched_prefill = False
        mx.eval(self.loaded.model(mx.array([[0, 1]])))  # MLX's one-off first-call cost
        gc.collect()
        mx.clear_cache()
        log.info("encoder '%s' loaded from %s in %.1f s (%d parameters, %d positions): embeddings and rerank only",
                 self.loaded.model_id, self.loaded.path, time.perf_counter() - t0, self.loaded.n_params, self.n_ctx)

    def _warm_up(self) -> None:
        """Run one tiny forward pass: MLX's first call pays a one-off set-up cost."""
        import mlx.core as mx

        cache = probe_cache(self.loaded.model)
        mx.eval(self.loaded.model(mx.array([[0, 1]]), cache=cache))
        self.probe_batching()
        del cache
        # What loading and the probes freed (MLX's buffer cache, the tokenizer conversion's and the
        # header's temporaries) stays in the C heap's arenas unless handed back: ~50 MiB of RSS
        # on SmolLM2-135M.
        gc.collect()
        mx.clear_cache()
        backend.release_free_memory()

    def probe_batching(self) -> bool:
        """A model whose layers cannot take mlx-lm's batch caches serves its slots one sequence
        per forward pass, instead of failing every concurrent request."""
        if self.loaded.vision is not None:
            # Each sequence of a vision model has its own multimodal RoPE positions, which mlx-lm's
            # batch caches cannot carry per row (vision/model.py): one sequence per forward pass.
            log.info("vision-language model: one sequence per forward pass (no batched decode or prefill)")
            self.batched_decode = self.batched_prefill = False
            return False
        try:
            batch_caches_work(self.loaded.model)
        except Exception:
            log.warning("this model cannot decode through batch caches: one sequence per forward pass", exc_info=True)
            self.batched_decode = self.batched_prefill = False
        return self.batched_decode

    @property
    def busy(self) -> bool:
        """Whether requests are running or waiting (read from other threads: the disk tier's
        writer paces itself while this holds)."""
        return self._has_work()

    def _has_work(self) -> bool:
        return bool(self.waiting) or bool(self.slot_calls) or any(s.sequence is not None for s in self.slots)

    def _drain_commands(self, block: bool, timeout: float | None = None) -> None:
        while True:
            try:
                cmd = self._commands.get(block=block, timeout=timeout if block else None)
            except queue.Empty:
                return
            block = False
            if cmd is None:
                return
            if isinstance(cmd, _Submit):
                if not self.accepting:
                    cmd.sink(unavailable())
                elif not cmd.request.prompt_tokens:
                    cmd.sink(empty_finish(cmd.request))  # llama-server: an empty prompt ends at once
                elif self.loaded.kind == "encoder":
                    cmd.sink(ErrorEvent(NO_LOGITS))  # llama-server's answer on a model without a KV cache
                else:
                    self.waiting.append(cmd)
                    self._idle_since = time.monotonic()
            elif isinstance(cmd, _Cancel):
                self._cancel(cmd.task_id)
            elif isinstance(cmd, _Call):
                if cmd.wake:
                    self._idle_since = time.monotonic()
                    if self.sleeping:
                        self._wake()
                self._run_call(cmd)
            elif isinstance(cmd, _SlotCall):
                self.slot_calls.append(cmd)
            elif isinstance(cmd, _Warmup):
                self._queue_warmup(cmd.job)
            elif isinstance(cmd, _Shutdown):
                self._shutdown(cmd.running_too)

    def _shutdown(self, running_too: bool) -> None:
        self.accepting = False
        self.warmups.clear()
        while self.waiting:
            self.waiting.popleft().sink(unavailable())
        if running_too:
            for slot in self.slots:
                seq = slot.sequence
                if seq is not None and seq.finished is None:
                    # The client hears a final 503 now; the sequence is cancelled at its next step
                    # (still consistent, so its state may be donated) and says nothing more.
                    seq.emit(unavailable())
                    seq.emit = lambda event: None
                    seq.cancelled = True

    def _queue_warmup(self, job: Any) -> None:
        """Bounded queue: one pending warm-up per session (the newest wins); overflow is skipped."""
        cache = self.prefix_cache
        if cache is None or not cache.warmups:
            return
        if self.sleeping:  # warming up would reload the model for nobody
            cache.skip_warmup()
            return
        for old in [j for j in self.warmups if j.session_key == job.session_key]:
            self.warmups.remove(old)
            cache.skip_warmup()
        if len(self.warmups) == WARMUP_QUEUE:
            self.warmups.popleft()
            cache.skip_warmup()
        self.warmups.append(job)

    def _run_warmup(self) -> None:
        """Runs only while nothing waits; yields to any command that arrives meanwhile."""
        job = self.warmups.popleft()
        try:
            self.prefix_cache.run_warmup(job, self, should_stop=self._request_waiting)
        except Exception:  # a warm-up is an optimisation: never let it take the engine down
            log.exception("snapshot warm-up failed")

    def _request_waiting(self) -> bool:
        """Between warm-up chunks: serve commands that arrived; stop if a request is waiting."""
        self._drain_commands(block=False)
        return bool(self.waiting)

    def _run_slot_calls(self) -> None:
        """Slot actions whose slot is idle, in arrival order (before waiting requests take it)."""
        for call in list(self.slot_calls):
            slot = self.slots[call.slot_id]
            if slot.sequence is None:
                self.slot_calls.remove(call)
                self._run_call(_Call(lambda: call.fn(slot), call.future))

    def _run_call(self, cmd: _Call) -> None:
        if not cmd.future.set_running_or_notify_cancel():
            return
        try:
            cmd.future.set_result(cmd.fn())
        except Exception as exc:
            cmd.future.set_exception(exc)

    def _cancel(self, task_id: int) -> None:
        for sub in list(self.waiting):
            if sub.request.task_id == task_id:
                self.waiting.remove(sub)
                return
        for slot in self.slots:
            if slot.sequence is not None and slot.sequence.request.task_id == task_id:
                slot.sequence.cancelled = True

    def _admit(self) -> None:
        """Move waiting requests into free slots, oldest first; a pinned request waits for its slot.

        ``waiting`` is read by other threads (``/metrics``, ``/slots``): a request leaves it only
        when it is being started, so a request that stays deferred is never missing from it."""
        for sub in list(self.waiting):
            slot = self._pick_slot(sub.request)
            if slot is None:
                continue
            self.waiting.remove(sub)
            try:
                self._start(slot, sub)
            except Exception as exc:
                log.exception("could not start task %d", sub.request.task_id)
                sub.sink(ErrorEvent(f"could not start generation: {exc}"))

    def _pick_slot(self, request: GenerationRequest) -> Slot | None:
        if not self.config.cont_batching and self.n_processing:
            return None  # --no-cont-batching: one sequence at a time
        if request.id_slot >= 0:
            slot = self.slots[request.id_slot % len(self.slots)]
            return slot if slot.sequence is None else None
        free = [s for s in self.slots if s.sequence is None]
        return min(free, key=lambda s: s.t_last_used) if free else None

    def _start(self, slot: Slot, sub: _Submit) -> None:
        seq = make_sequence(self, sub.request, sub.sink, slot.id)

        def emit_counted(event: EngineEvent) -> None:
            # Count before the client hears of the finish: /metrics read right after a
            # response already includes it. A finish inside a scheduler iteration waits for the
            # iteration's pass to be counted too (llama-server counts a decode before sampling).
            if isinstance(event, FinishEvent):
                self._count(event)
                if self._held is not None:
                    self._held.append((sub.sink, event))
                    return
            sub.sink(event)

        seq.emit = emit_counted
        slot.begin(seq)
        if sub.request.return_progress and not sub.request.is_child:
            seq.report_progress()  # llama-server's first report: the prefix taken from the cache
        if seq.stats.n_cached and not seq.stats.shared:
            self.metrics.add_prompt_cached(seq.stats.n_cached)

    def _step_all(self) -> None:
        """One scheduler iteration: a bounded amount of prefill, then one decode step for all."""
        busy = [s for s in self.slots if s.sequence is not None]
        if not busy:
            return
        sequences = [s.sequence for s in busy]
        before = [(seq.stats.n_prompt_processed, len(seq.generated)) for seq in sequences]
        t0 = time.perf_counter()
        self._held = []
        try:
            self._prefill(busy)
            self._decode()
            self._count_pass(sequences, before, time.perf_counter() - t0)
        finally:
            held, self._held = self._held, None
            for sink, event in held:
                sink(event)

    def _count_pass(self, sequences: list[Sequence], before: list[tuple[int, int]], seconds: float) -> None:
        """llama-server's per-decode metrics for an iteration that ran forward passes.

        llama-server puts an iteration's tokens (one per decoding slot, then prompt tokens) into
        batches of at most ``--batch-size`` tokens, one ``llama_decode`` each; the iteration is
        counted as that many calls. A first token is sampled from a row that fed a prompt token,
        so that row is not counted twice.
        """
        n_prompt = n_fed_generated = 0
        for seq, (processed, generated) in zip(sequences, before):
            n_prompt += seq.stats.n_prompt_processed - processed
            new_tokens = len(seq.generated) - generated
            n_fed_generated += new_tokens - (1 if generated == 0 and new_tokens > 0 else 0)
        n_tokens = n_prompt + n_fed_generated
        if n_tokens > 0:
            longest = max(len(seq.cache_tokens) for seq in sequences)
            n_calls = -(-n_tokens // max(1, self.config.batch_size))
            self.metrics.add_pass(len(sequences), longest, n_prompt, seconds, n_calls)

    def _prefill(self, busy: list[Slot]) -> None:
        """Prefill at most about one chunk (``--batch-size`` tokens) per iteration, oldest first,
        so a long prompt never stalls the sequences that are streaming. A sequence stops one token
        short of its prompt's end: ``_decode`` feeds that last token (batched where it can).
        Chunks of similar length from several sequences go through one forward pass."""
        budget = self.config.batch_size
        waiting = [s.sequence for s in busy if s.sequence.phase == "prefill"]
        runnable: list[Sequence] = []
        for seq in sorted(waiting, key=lambda s: s.stats.t_start):
            if seq.cancelled:
                seq.cancel_now()
                self._release(self.slots[seq.slot_id], donate=True)
                continue
            try:
                self._share_prompt(seq, waiting)
            except Exception as exc:
                self._fail(self.slots[seq.slot_id], exc)
                continue
            if seq.prompt_ready or budget <= 0 or self._waits_for_sibling(seq, waiting):
                continue
            runnable.append(seq)
            budget -= max(1, len(seq.next_chunk()))
        # A lone sequence feeds the rest of its prompt in one pass that samples the first token
        # where it can (Sequence.prompt_tail); with others prefilling, its chunk shares their
        # batched pass instead.
        tails = {id(s) for s in runnable if len(waiting) == 1 and s.prompt_tail() is not None}
        chunkable = [s for s in runnable if len(s.cache_tokens) < s.n_prompt - 1 and id(s) not in tails]
        chunks = [s.next_chunk() for s in chunkable]
        batching = self.config.cont_batching and self.batched_prefill
        groups = prefill_groups(chunkable, chunks) if batching else [[i] for i in range(len(chunkable))]
        units = [[(chunkable[i], chunks[i]) for i in g] for g in groups] + [[(s, [])] for s in runnable if s not in chunkable]
        for unit in units:
            together = len(unit) > 1 and self._prefill_together(unit)
            all_alone_ok = True
            for seq, _ in unit:
                try:
                    if not together:
                        seq.prefill_step(rows_tail=id(seq) in tails)
                    self._share_prompt(seq, waiting)
                except Exception as exc:
                    all_alone_ok = False
                    self._fail(self.slots[seq.slot_id], exc)
            if len(unit) > 1 and not together and all_alone_ok:
                # Every row prefilled fine on its own: it was the batched pass that failed.
                log.warning("batched prefill failed where single passes work; prefilling one sequence at a time from now on")
                self.batched_prefill = False

    def _prefill_together(self, unit: list[tuple[Sequence, list[int]]]) -> bool:
        """One pass over several sequences' chunks. A failure leaves the sequences untouched
        (they are then prefilled alone, which tells a faulty row from a model whose layers cannot
        take a batch cache)."""
        try:
            prefill_together(self.loaded.model, [seq for seq, _ in unit], [chunk for _, chunk in unit])
            return True
        except Exception:
            log.warning("batched prefill pass failed; its rows are prefilled alone", exc_info=True)
            return False

    @staticmethod
    def _waits_for_sibling(seq: Sequence, waiting: list[Sequence]) -> bool:
        """A later completion of a shared prompt waits while an earlier sibling prefills it."""
        group = seq.request.share_group
        return group >= 0 and any(
            o.request.share_group == group and o.request.task_id < seq.request.task_id and len(o.cache_tokens) < o.n_prompt - 1
            for o in waiting
            if o.finished is None
        )

    @staticmethod
    def _share_prompt(seq: Sequence, waiting: list[Sequence]) -> None:
        """Once ``seq`` holds its prompt's KV (all but the last token), give each sibling
        completion of the same prompt (``n_cmpl``) a copy; they then sample on their own."""
        from mlxcel_compat.cache.kv import copy_cache

        if seq.request.share_group < 0 or len(seq.cache_tokens) != seq.n_prompt - 1 or seq.finished is not None:
            return
        for other in waiting:
            same_group = other.request.share_group == seq.request.share_group
            if other is not seq and same_group and other.finished is None and len(other.cache_tokens) < len(seq.cache_tokens):
                other.cache = copy_cache(seq.cache)
                other.adopt(len(seq.cache_tokens), shared=True)

    def _decode(self) -> None:
        """One decode step of every decoding sequence; prompt-ready sequences join with their
        last prompt token. Several rows go through one batched pass; a lone sequence steps on its
        own cache (faster than a batch of one). A sequence with a speculative draft this step
        verifies it alone, in one pass of its own (``_speculate``)."""
        speculated = self._speculate() if self.speculative is not None else set()
        joining = [
            s
            for s in self.slots
            if s.sequence is not None and (s.sequence.phase == "decode" or s.sequence.prompt_ready)
            and s.sequence not in self._batched and id(s.sequence) not in speculated
        ]
        batched = len(self.batch) + len(joining)
        if batched == 0:
            return
        if self.config.cont_batching and self.batched_decode and batched > 1:
            self._decode_batched(joining)
            return
        for slot in joining:
            self._step_alone(slot)

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
                self._release(slot, donate=True)
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
            self._release(slot, donate=True)
        return True

    def _decode_batched(self, joining: list[Slot]) -> None:
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
                self._fail_batch(joining, err.error)
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
            self._fail_batch(joining, exc)
            return
        self._batch_only_failures = 0
        for seq, exc in failed:
            self._fail(self.slots[seq.slot_id], exc)
        for seq in finished:
            self._release(self.slots[seq.slot_id], donate=True)

    def _fail_batch(self, joining: list[Slot], exc: Exception) -> None:
        members = set(map(id, self.batch.sequences)) | {id(s.sequence) for s in joining}
        self.batch = DecodeBatch(self.loaded.model, self.loaded.decoder)
        for slot in self.slots:
            if slot.sequence is not None and id(slot.sequence) in members:
                self._fail(slot, exc)

    def _fail_all(self, exc: Exception) -> None:
        """After an unexpected engine error: every running sequence ends with an error event."""
        self.batch = DecodeBatch(self.loaded.model, self.loaded.decoder)
        for slot in self.slots:
            if slot.sequence is not None:
                self._fail(slot, exc)

    @property
    def _batched(self) -> set[Any]:
        return set(self.batch.sequences)

    def _fail(self, slot: Slot, exc: Exception) -> None:
        """End one sequence with a 500 error event; its state is never donated to the cache."""
        seq = slot.sequence
        self.n_engine_errors += 1
        log.error("engine error in task %d: %s", seq.request.task_id, exc, exc_info=exc)
        try:
            seq.emit(ErrorEvent(f"engine error: {exc}"))
        finally:
            self._release(slot, donate=False)

    def _release(self, slot: Slot, donate: bool) -> None:
        seq = slot.sequence
        assert seq is not None
        fin = seq.finished
        if donate and fin is not None and self.prefix_cache is not None and not seq.request.is_child:
            try:
                self.prefix_cache.donate(seq)
            except Exception:  # a failed donation must never take the engine down
                log.exception("prompt cache donation failed")
        if self.config.keep_slot_state:
            slot.kept = keep_state(self.loaded.model_id, seq) if donate and fin is not None else None
        slot.end()

    def _count(self, fin: FinishEvent) -> None:
        """A generation's tokens and time, once it ends (prompt counts move per pass instead),
        and its speculative drafts (llama-server adds a slot's draft counts when it is released)."""
        if fin.n_decoded > 0:
            self.metrics.add_prediction(fin.n_decoded, fin.predicted_ms / 1000.0)
        if fin.n_draft_rounds > 0:
            self.metrics.add_drafts(fin.n_draft, fin.n_draft_accepted, fin.n_draft_rounds, fin.accepted_per_pos)


def _config_value(config: dict[str, Any], key: str, default: Any) -> Any:
    """Read a model config key at top level or inside ``text_config`` (multimodal wrappers)."""
    if key in config:
        return config[key]
    return config.get("text_config", {}).get(key, default)


def _wait_for_os_thread(native_id: int | None, timeout: float) -> None:
    """Wait until the OS thread ``native_id`` has exited, not only its Python code.

    ``Thread.join`` returns once the thread's Python code is done, but the OS thread then still
    runs its C++ thread-local destructors, and MLX's per-thread ``mx.compile`` cache is one that
    takes the GIL. If the interpreter is finalizing by then (a process that exits right after
    stopping the engine), taking the GIL ends the thread inside that destructor and the process
    aborts ("terminate called without an active exception"). Linux lists a process's live
    threads in /proc/self/task; where it does not, this returns at once."""
    if native_id is None:
        return
    task = f"/proc/self/task/{native_id}"
    deadline = time.monotonic() + timeout
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.001)


__all__ = ["Engine", "EngineConfig", "EngineMetrics"]
