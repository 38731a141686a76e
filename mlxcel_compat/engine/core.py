"""The engine thread: the only code that touches MLX.

HTTP handlers talk to it through a thread-safe command queue (submit, cancel, call) and receive
events through a per-request sink (see ``client.py``). One loop iteration:

    drain commands  ->  admit waiting requests into free slots  ->  prefill about one chunk
    (``--batch-size`` tokens) in total, similar chunks of several sequences in one pass  ->  one
    decode step of every decoding sequence in one batched pass, prompt-ready sequences feeding
    their last prompt token  ->  release finished sequences

Up to ``--parallel`` sequences are active at once; the rest wait in FIFO order (``id_slot`` pins
a request to a slot). With ``--no-cont-batching`` one sequence runs at a time.

This module holds the thread, its command queue (the records are ``commands.py``'s), admission and
release, and sleep; the prefill and decode passes of an iteration are ``scheduler.py``'s, building a
sequence is ``factory.py``'s and what loading needs past the weights is ``loading.py``'s.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

from mlxcel_compat.engine.batch import DecodeBatch, batch_caches_work
from mlxcel_compat.engine.commands import Call, Cancel, Shutdown, SlotCall, Submit, Warmup
from mlxcel_compat.engine.factory import make_sequence
from mlxcel_compat.engine.grammar import GrammarCompiler
from mlxcel_compat.engine.kept_state import keep_state
from mlxcel_compat.engine.loading import (config_value, load_speculation, release_idle_memory, warm_up,
                                          warm_up_encoder)
from mlxcel_compat.engine.metrics import EngineMetrics
from mlxcel_compat.engine.request import EngineEvent, ErrorEvent, FinishEvent, GenerationRequest, Sink
from mlxcel_compat.engine.scheduler import Scheduler
from mlxcel_compat.engine.slots import Slot, slot_context

log = logging.getLogger(__name__)

WARMUP_QUEUE = 8  # pending background warm-ups (one per session)
SHUTTING_DOWN = "Server is shutting down"
NO_LOGITS = "the current context does not support logits computation. skipping"  # an encoder cannot generate


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
    mmproj: str | None = None  # llama.cpp's projector GGUF beside a GGUF text model (--mmproj)
    image_min_tokens: int = 0  # --image-min-tokens / --image-max-tokens (0: the projector's own)
    image_max_tokens: int = 0
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
    load_options: Any = None  # model.load_options.LoadOptions: RoPE, --override-kv, --no-mmap, --mlock
    context_shift: bool = False  # --context-shift: a full context drops its middle instead of stopping


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
        self.waiting: collections.deque[Submit] = collections.deque()
        self.warmups: collections.deque[Any] = collections.deque()
        self.slot_calls: list[SlotCall] = []  # slot actions waiting for their slot to be idle
        self.prefix_cache: Any = None
        self.draft: Any = None  # engine.speculative.DraftModel once loaded (-md)
        self.ngram_table = self.lookup_files = None  # shared by all sequences: ngram-mod's table, ngram-cache's files
        self.speculative: Any = None  # engine.speculative.SpecConfig in force (None: off)
        self.grammars: Any = None  # engine.grammar.GrammarCompiler once the model is loaded
        self.key_rotation: Any = None  # engine.context_shift.KeyRotation when the context shifts
        self.compat: Any = None  # cache.disk_format.Compat: what saved state must match (set at load)
        # The forward passes of each iteration: it owns the decode batch and whether batching works.
        self.scheduler = Scheduler(self.slots, config.batch_size, config.cont_batching, self._fail, self._release)
        self.accepting = True  # False once a shutdown has begun: new requests get 503
        self.n_engine_errors = 0  # sequences failed by an exception in the engine
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
        """Whether the engine thread is alive: started, and neither stopped nor failed to load."""
        return self._thread.is_alive()

    def submit(self, request: GenerationRequest, sink: Sink) -> None:
        self._commands.put(Submit(request, sink))

    def cancel(self, task_id: int) -> None:
        self._commands.put(Cancel(task_id))

    def warmup(self, job: Any) -> None:
        """Queue a background warm-up of a session's next turn (snapshot families only)."""
        self._commands.put(Warmup(job))

    def shutdown(self, running_too: bool = False) -> None:
        """Begin a shutdown: waiting and new requests end with a 503 error event; with
        ``running_too`` the running ones as well (their state may still be donated)."""
        self._commands.put(Shutdown(running_too))

    def call(self, fn: Callable[[], Any], wake: bool = False) -> Future:
        """Run ``fn`` on the engine thread between steps (cache stats, reset, ...); ``wake``: ``fn``
        computes with the model (embeddings), so a sleeping one is reloaded first."""
        future: Future = Future()
        self._commands.put(Call(fn, future, wake))
        return future

    def call_on_slot(self, slot_id: int, fn: Callable[[Slot], Any]) -> Future:
        """Run ``fn(slot)`` on the engine thread once that slot is idle (slot save/restore/erase;
        llama-server defers them while the slot is busy)."""
        future: Future = Future()
        self._commands.put(SlotCall(slot_id, fn, future))
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
            if not self._has_work():  # the last sequence is done
                release_idle_memory(self.loaded.decoder)
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
        self.scheduler.batch = DecodeBatch(None)
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
                                  adapters=self.config.adapters, repack=self.config.repack,
                                  options=self.config.load_options, **self._vision_args())
            self.loaded.model, self.loaded.decoder = reloaded.model, reloaded.decoder
        except Exception as exc:
            log.exception("could not reload the model after sleep")
            for sub in list(self.waiting):
                self.waiting.remove(sub)
                sub.sink(ErrorEvent(f"could not reload the model: {exc}"))
            return
        self.scheduler.batch = DecodeBatch(self.loaded.model, self.loaded.decoder)
        self._load_context_shift()  # the key rotation reads the reloaded model's RoPE
        self.sleeping = False
        log.info("woke up: model '%s' reloaded in %.1f s for a new request", self.loaded.model_id, time.perf_counter() - t0)

    def _vision_args(self) -> dict[str, Any]:
        """The projector arguments of ``load_model`` (``--mmproj`` and its image token bounds)."""
        return {"mmproj": self.config.mmproj, "image_min_tokens": self.config.image_min_tokens,
                "image_max_tokens": self.config.image_max_tokens}

    def _load(self) -> None:
        from mlxcel_compat.model.loader import load_model

        t0 = time.perf_counter()
        self.loaded = load_model(self.config.model, self.config.aliases, offline=self.config.offline,
                                 name=self.config.model_name, adapters=self.config.adapters, repack=self.config.repack,
                                 options=self.config.load_options, **self._vision_args())
        n_ctx_train = int(config_value(self.loaded.config, "max_position_embeddings", 4096))
        self.n_ctx_total, self.n_ctx = slot_context(self.config.ctx_size, len(self.slots), self.config.kv_unified, n_ctx_train)
        for slot in self.slots:
            slot.n_ctx = self.n_ctx
        if self.loaded.kind == "encoder":
            self._load_encoder(t0)
            return
        self.scheduler.batch = DecodeBatch(self.loaded.model, self.loaded.decoder)
        tokenizer = self.loaded.tokenizer
        vocab_size = int(config_value(self.loaded.config, "vocab_size", 0) or len(tokenizer))
        # The llguidance tokenizer is built by the first request with a grammar, on its worker
        # thread (~0.3 s on a 49k vocabulary, ~1 s on 150k): built at load it held ~33 MiB of every
        # server's memory (SmolLM2), used or not.
        self.grammars = GrammarCompiler(tokenizer, vocab_size, sorted(tokenizer.eos_token_ids or []))
        from mlxcel_compat.cache.disk_format import Compat
        from mlxcel_compat.cache.kv_io import runtime_tag
        from mlxcel_compat.runtime.kv_precision import of_model

        self._load_speculative()
        self._load_context_shift()
        fingerprint = self.loaded.fingerprint
        if self.draft is not None:  # prompt-cache entries then hold the draft's tensors too
            fingerprint = f"{fingerprint}+draft:{self.draft.loaded.fingerprint}"
        self.compat = Compat(model=fingerprint, runtime=runtime_tag(self.loaded.model, of_model(self.loaded.model).tag))
        if self._prefix_cache_factory is not None:
            self.prefix_cache = self._prefix_cache_factory(self)
        warm_up(self.loaded.model, self.probe_batching)
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

    def _load_context_shift(self) -> None:
        from mlxcel_compat.engine.context_shift import rotation_for

        self.key_rotation = rotation_for(self.loaded) if self.config.context_shift else None

    def _load_speculative(self) -> None:
        """Speculative decoding, if configured and the model can take it (``loading.load_speculation``)."""
        speculation = load_speculation(self.config.speculative, self.loaded, self.config.offline, self.config.repack)
        if speculation is None:
            return
        self.draft, self.ngram_table, self.lookup_files, self.speculative = (
            speculation.draft, speculation.ngram_table, speculation.lookup_files, speculation.config)
        for slot in self.slots:
            slot.speculative = True

    def _load_encoder(self, t0: float) -> None:
        """An encoder serves embeddings and rerank only: no decode batch, prompt cache or warm-up
        of the decode path; generation requests are refused at submit (``_drain_commands``)."""
        tokenizer = self.loaded.tokenizer
        vocab_size = int(self.loaded.config.get("vocab_size") or 0)
        self.grammars = GrammarCompiler(tokenizer, vocab_size, [])  # built lazily; never used here
        self.scheduler.batched_decode = self.scheduler.batched_prefill = False
        warm_up_encoder(self.loaded.model)
        log.info("encoder '%s' loaded from %s in %.1f s (%d parameters, %d positions): embeddings and rerank only",
                 self.loaded.model_id, self.loaded.path, time.perf_counter() - t0, self.loaded.n_params, self.n_ctx)

    def probe_batching(self) -> bool:
        """A model whose layers cannot take mlx-lm's batch caches serves its slots one sequence
        per forward pass, instead of failing every concurrent request."""
        if self.loaded.vision is not None:
            # Each sequence of a vision model has its own multimodal RoPE positions, which mlx-lm's
            # batch caches cannot carry per row (vision/model.py): one sequence per forward pass.
            log.info("vision-language model: one sequence per forward pass (no batched decode or prefill)")
            self.scheduler.batched_decode = self.scheduler.batched_prefill = False
            return False
        try:
            batch_caches_work(self.loaded.model)
        except Exception:
            log.warning("this model cannot decode through batch caches: one sequence per forward pass", exc_info=True)
            self.scheduler.batched_decode = self.scheduler.batched_prefill = False
        return self.scheduler.batched_decode

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
            if isinstance(cmd, Submit):
                if not self.accepting:
                    cmd.sink(unavailable())
                elif not cmd.request.prompt_tokens:
                    cmd.sink(empty_finish(cmd.request))  # llama-server: an empty prompt ends at once
                elif self.loaded.kind == "encoder":
                    cmd.sink(ErrorEvent(NO_LOGITS))  # llama-server's answer on a model without a KV cache
                else:
                    self.waiting.append(cmd)
                    self._idle_since = time.monotonic()
            elif isinstance(cmd, Cancel):
                self._cancel(cmd.task_id)
            elif isinstance(cmd, Call):
                if cmd.wake:
                    self._idle_since = time.monotonic()
                    if self.sleeping:
                        self._wake()
                self._run_call(cmd)
            elif isinstance(cmd, SlotCall):
                self.slot_calls.append(cmd)
            elif isinstance(cmd, Warmup):
                self._queue_warmup(cmd.job)
            elif isinstance(cmd, Shutdown):
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
                self._run_call(Call(lambda: call.fn(slot), call.future))

    def _run_call(self, cmd: Call) -> None:
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

    def _start(self, slot: Slot, sub: Submit) -> None:
        seq = make_sequence(self, sub.request, sub.sink, slot.id)

        def emit_counted(event: EngineEvent) -> None:
            # Count before the client hears of the finish: /metrics read right after a
            # response already includes it. A finish inside a scheduler iteration waits for the
            # iteration's pass to be counted too (llama-server counts a decode before sampling).
            if isinstance(event, FinishEvent):
                self.metrics.add_finish(event)
                if self._held is not None:
                    self._held.append((sub.sink, event))
                    return
            sub.sink(event)

        seq.emit = emit_counted
        slot.sequence = seq  # from here on, a failure ends the sequence where every other ending does
        try:
            slot.begin(seq)
            if sub.request.return_progress and not sub.request.is_child:
                seq.report_progress()  # llama-server's first report: the prefix taken from the cache
            if seq.stats.n_cached and not seq.stats.shared:
                self.metrics.add_prompt_cached(seq.stats.n_cached)
        except BaseException:
            self._release(slot, donate=False)  # the slot is free again, the lease on shared blocks goes
            raise

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
            self.scheduler.prefill(busy, self.loaded.model)
            self.scheduler.decode(self.loaded, self.speculative is not None)
            self.metrics.add_iteration(sequences, before, time.perf_counter() - t0, self.config.batch_size)
        finally:
            held, self._held = self._held, None
            for sink, event in held:
                sink(event)

    def _fail_all(self, exc: Exception) -> None:
        """After an unexpected engine error: every running sequence ends with an error event."""
        self.scheduler.batch = DecodeBatch(self.loaded.model, self.loaded.decoder)
        for slot in self.slots:
            if slot.sequence is not None:
                self._fail(slot, exc)

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
        if self.prefix_cache is not None:
            self.prefix_cache.release(seq)  # its shared KV blocks' lease, whatever the ending
        if self.config.keep_slot_state:
            slot.kept = keep_state(self.loaded.model_id, seq) if donate and fin is not None else None
        slot.end()


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
