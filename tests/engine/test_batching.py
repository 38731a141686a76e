"""Continuous batching on a real engine: concurrent sequences decode together in one forward pass.

Equality with sequential runs: a batched forward pass computes each row with other matrix shapes
than a lone pass, so logits may differ in the last bits. Greedy tokens are compared where the
sequential run's top-2 log-probability gap exceeds MARGIN ("decided positions"); the first
differing position must be one where the sequential run was near a tie.
"""

from __future__ import annotations

import os
import queue
import random

import pytest

from mlxcel_compat.engine.request import ErrorEvent, FinishEvent, ProgressEvent, TokenEvent
from mlxcel_compat.runtime.decode_kv import OwnedCache
from tests.conftest import tiny_model
from tests.engine.harness import EngineHarness, Run, collect

MARGIN = 1e-3
N_TOKENS = 24


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(8000) for _ in range(n)]


@pytest.fixture(scope="module", params=["llama", "qwen3_next", "gemma3_text", "qwen3:q4_k_m"])
def harness(request: pytest.FixtureRequest):
    h = EngineHarness(tiny_model(request.param), batch_size=32, n_parallel=4, enabled=False)
    yield h
    h.close()


def run_concurrently(h: EngineHarness, prompts: list[list[int]], **kwargs) -> list[Run]:
    sinks = [queue.Queue() for _ in prompts]
    for prompt, sink in zip(prompts, sinks):
        h.submit(prompt, sink.put, **kwargs)
    return [collect(sink) for sink in sinks]


def agree_where_decided(batched: Run, alone: Run) -> None:
    for pos, (a, b) in enumerate(zip(batched.tokens, alone.tokens)):
        if a != b:
            top = sorted(alone.logprobs[pos].values(), reverse=True)
            assert top[0] - top[1] < MARGIN, f"position {pos} differs although decided ({top[0] - top[1]:.4f})"
            return


def test_concurrent_greedy_requests_match_sequential_runs(harness: EngineHarness) -> None:
    prompts = [random_tokens(n, seed=n) for n in (20, 45, 33, 70)]
    batched = run_concurrently(harness, prompts, n_predict=N_TOKENS, n_probs=2, ignore_eos=True)
    alone = [harness.run(p, n_predict=N_TOKENS, n_probs=2, ignore_eos=True) for p in prompts]
    for b, a in zip(batched, alone):
        assert len(b.tokens) == N_TOKENS and b.finish.stop_type == "limit"
        agree_where_decided(b, a)
    exact = sum(b.tokens == a.tokens for b, a in zip(batched, alone))
    assert exact >= 3, "almost every sequence should match its sequential run token for token"
    # The engine really batched: decode calls were shared by several sequences.
    metrics = harness.engine.metrics
    assert metrics.n_busy_slots_total / metrics.n_decode_total > 1.0


def test_cancelling_one_stream_leaves_the_others_intact(harness: EngineHarness) -> None:
    prompts = [random_tokens(30, seed=100 + i) for i in range(3)]
    sinks = [queue.Queue() for _ in prompts]
    requests = [harness.submit(p, s.put, n_predict=40, ignore_eos=True) for p, s in zip(prompts, sinks)]
    first = sinks[1].get(timeout=60)
    assert isinstance(first, TokenEvent)
    harness.engine.cancel(requests[1].task_id)
    cancelled = collect(sinks[1])
    assert cancelled.finish.cancelled and len(cancelled.tokens) < 40
    for i in (0, 2):
        run = collect(sinks[i])
        assert len(run.tokens) == 40 and not run.finish.cancelled
    assert harness.engine.n_processing == 0


def test_long_prompt_does_not_stall_streaming_sequences(harness: EngineHarness) -> None:
    """While a long prompt prefills chunk by chunk, the running stream keeps getting tokens."""
    chunk = harness.engine.config.batch_size
    events: queue.Queue = queue.Queue()
    streaming = harness.submit(random_tokens(16, seed=7), lambda e: events.put(("a", e)), n_predict=200, ignore_eos=True)
    assert events.get(timeout=60)[0] == "a"  # the stream is decoding
    long_prompt = random_tokens(12 * chunk, seed=8)
    harness.submit(long_prompt, lambda e: events.put(("b", e)), n_predict=2, ignore_eos=True)
    a_tokens_before_b = 0
    while True:
        who, event = events.get(timeout=60)
        if who == "b":
            break  # B's first token: its prefill is over
        if isinstance(event, TokenEvent):
            a_tokens_before_b += 1
    # One decode step of A per iteration, at most about one chunk of B's prefill per iteration.
    assert a_tokens_before_b >= 12 - 2
    harness.engine.cancel(streaming.task_id)


def test_requests_beyond_the_slots_wait_in_fifo_order(harness: EngineHarness) -> None:
    while harness.on_engine(lambda: harness.engine.n_processing):
        pass  # let the previous test's cancelled stream finish
    order: queue.Queue = queue.Queue()
    prompts = [random_tokens(12, seed=200 + i) for i in range(6)]
    sinks = []
    for i, p in enumerate(prompts):
        sink: queue.Queue = queue.Queue()
        sinks.append(sink)

        def forward(event, i=i, sink=sink):
            if isinstance(event, TokenEvent) and event.n_decoded == 1:
                order.put(i)
            sink.put(event)

        harness.submit(p, forward, n_predict=30, ignore_eos=True)
    started = [order.get(timeout=60)]  # admitted sequences are decoding now
    counts = harness.on_engine(lambda: (harness.engine.n_processing, harness.engine.n_deferred))
    assert counts == (4, 2)
    runs = [collect(s) for s in sinks]
    started += [order.get(timeout=5) for _ in range(5)]
    assert sorted(started[4:]) == [4, 5]  # the two that waited started last, in order
    assert all(isinstance(r.finish, FinishEvent) and len(r.tokens) == 30 for r in runs)
    assert harness.on_engine(lambda: harness.engine.n_deferred) == 0


def test_completions_of_one_prompt_share_its_prefill(harness: EngineHarness) -> None:
    """n_cmpl > 1: the prompt is prefilled once; the siblings copy its KV and sample on their own."""
    prompt = random_tokens(90, seed=300)
    sinks = [queue.Queue() for _ in range(3)]
    first = harness.request(prompt, n_predict=6, ignore_eos=True, cache=False)
    requests = [first] + [harness.request(prompt, n_predict=6, ignore_eos=True, cache=False) for _ in range(2)]
    for req, sink in zip(requests, sinks):
        req.share_group = first.task_id
    def prompt_tokens() -> int:
        return harness.on_engine(lambda: harness.engine.metrics.prompt.count)

    prompt_tokens_before = prompt_tokens()
    for req, sink in zip(requests, sinks):
        harness.engine.submit(req, sink.put)
    runs = [collect(s) for s in sinks]
    assert runs[0].finish.n_cached == 0
    assert [r.finish.n_cached for r in runs[1:]] == [len(prompt) - 1] * 2
    # Only the first completion computed the prompt; the others computed its last token only.
    assert prompt_tokens() - prompt_tokens_before == len(prompt) + 2
    alone = harness.run(prompt, n_predict=6, ignore_eos=True, cache=False)
    assert all(len(run.tokens) == 6 for run in runs)
    # Same prompt state, same greedy chain: every sibling continues like a lone run.
    for run in runs:
        assert run.tokens[:3] == alone.tokens[:3]


def prompts_batch(h: EngineHarness) -> bool:
    """Whether the model's prompt chunks batch: its caches are all plain KV caches, or the CPU
    decode runtime takes its chunks (gemma3's sliding-window rings: runtime/ring_chunks.py)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    def check() -> bool:
        loaded = h.engine.loaded
        cache = make_prompt_cache(loaded.model)
        if loaded.decoder is not None and loaded.decoder.can_prefill(cache, OwnedCache()):
            return True
        return all(type(c) is KVCache for c in cache)

    return h.on_engine(check)


def run_logged(h: EngineHarness, requests: list, sinks: list) -> tuple["ForwardLog", list[list]]:
    """Submit ``requests`` in one engine iteration with every forward pass logged; return the log
    and each request's events."""
    log = ForwardLog(h.engine.loaded.model)
    return log, run_with_model(h, log, requests, sinks)


def run_with_model(h: EngineHarness, wrapper, requests: list, sinks: list) -> list[list]:
    """Install ``wrapper`` (around the real model) and submit ``requests`` in one engine
    iteration, so all are admitted together; return each request's events up to its end."""
    engine = h.engine
    while h.on_engine(lambda: engine.n_processing):
        pass
    real, real_decoder = engine.loaded.model, engine.loaded.decoder

    def install_and_submit() -> None:  # on the engine thread
        engine.loaded.model = engine.scheduler.batch.model = wrapper
        if hasattr(wrapper, "wrap"):  # the CPU decode runtime steps rows alone and together
            engine.loaded.decoder = engine.scheduler.batch.decoder = wrapper.wrap(real_decoder)
        for request, sink in zip(requests, sinks):
            engine.submit(request, sink.put)

    h.on_engine(install_and_submit)
    try:
        events = []
        for sink in sinks:
            seen = [sink.get(timeout=120)]
            while not isinstance(seen[-1], (FinishEvent, ErrorEvent)):
                seen.append(sink.get(timeout=120))
            events.append(seen)
    finally:
        h.on_engine(lambda: setattr(engine.loaded, "model", real) or setattr(engine.scheduler.batch, "model", real)
                    or setattr(engine.loaded, "decoder", real_decoder) or setattr(engine.scheduler.batch, "decoder", real_decoder))
    return events


class ForwardLog:
    """Wraps the engine's real model and records the (batch, tokens) shape of every forward pass,
    the CPU decode runtime's steps and prompt chunks included (``wrap``)."""

    def __init__(self, model) -> None:
        self.model = model
        self.shapes: list[tuple[int, int]] = []

    def __call__(self, inputs, **kwargs):
        self.shapes.append(tuple(inputs.shape[:2]))
        return self.model(inputs, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def wrap(self, decoder):
        return None if decoder is None else _LoggedDecoder(self, decoder)


class _LoggedDecoder:
    def __init__(self, log: ForwardLog, decoder) -> None:
        self.log, self.decoder = log, decoder

    def step(self, token, cache, owned, scales=None):
        return self.step_rows([token], [cache], [owned], None if scales is None else [scales])[0]

    def step_rows(self, tokens, caches, owned, scales=None):
        self.log.shapes.append((len(tokens), 1))
        return self.decoder.step_rows(tokens, caches, owned, scales)

    def prefill(self, tokens, cache, owned, scales=None, logits=True):
        self.log.shapes.append((1, len(tokens)))  # a lone prompt chunk, as MLX's pass would be
        return self.decoder.prefill(tokens, cache, owned, scales, logits)

    def prefill_rows(self, chunks, caches, owned, scales=None, logits=False):
        self.log.shapes.append((len(chunks), max(len(c) for c in chunks)))  # as MLX's padded pass would be
        return self.decoder.prefill_rows(chunks, caches, owned, scales, logits)

    def __getattr__(self, name):
        return getattr(self.decoder, name)


def test_new_sequences_get_their_first_tokens_from_one_batched_pass(harness: EngineHarness) -> None:
    """Prompts admitted together prefill up to their last token; one (B, 1) pass then feeds every
    last prompt token and samples every first token, instead of one (1, 1) pass per sequence."""
    prompts = [random_tokens(10, seed=400 + i) for i in range(3)]  # 3 x 9 tokens: one chunk budget
    sinks = [queue.Queue() for _ in prompts]
    requests = [harness.request(p, n_predict=3, n_probs=2, ignore_eos=True, cache=False) for p in prompts]
    for request in requests:
        request.return_progress = True
    log, events = run_logged(harness, requests, sinks)
    if prompts_batch(harness):  # the three prompt chunks went through one pass as well
        assert log.shapes[:2] == [(3, 9), (3, 1)]
    else:
        assert log.shapes[:4] == [(1, 9), (1, 9), (1, 9), (3, 1)]
    assert (1, 1) not in log.shapes
    alone = [harness.run(p, n_predict=3, n_probs=2, ignore_eos=True, cache=False) for p in prompts]
    for seen, single in zip(events, alone):
        progress = [e for e in seen if isinstance(e, ProgressEvent)]
        first_token = next(i for i, e in enumerate(seen) if isinstance(e, TokenEvent))
        # The last progress report (the whole prompt processed) comes before the first token.
        assert progress[-1].processed == progress[-1].total == 10
        assert seen.index(progress[-1]) < first_token
        tokens = [e for e in seen if isinstance(e, TokenEvent)]
        agree_where_decided(Run(tokens=[e.token for e in tokens]), single)


def test_prompt_chunks_of_similar_length_share_one_pass(harness: EngineHarness) -> None:
    """Chunks of different lengths (right-padded) and rows with different cached lengths (left-
    padded) prefill together on plain-attention models, alone elsewhere; either way every
    sequence continues like a lone run wherever the lone run's choice was decided."""
    chunk = harness.engine.config.batch_size  # 32
    # A needs two chunks (32, then 7 more); B and C (11 and 8 tokens before the last) arrive with
    # it, wait for the chunk budget, then prefill with A's second chunk: caches of 32, 0 and 0.
    prompts = [random_tokens(chunk + 8, seed=500), random_tokens(12, seed=501), random_tokens(9, seed=502)]
    far = random_tokens(chunk - 1, seed=503)  # 30 tokens before the last: too long to pad 8 to
    sinks = [queue.Queue() for _ in range(4)]
    requests = [harness.request(p, n_predict=4, n_probs=2, ignore_eos=True, cache=False) for p in prompts + [far]]
    log, events = run_logged(harness, requests, sinks)
    if prompts_batch(harness):  # the CPU decode runtime pads nothing: the far one joins them
        assert log.shapes[:3] == [(1, 32), (4, 30), (4, 1)]
    else:
        assert log.shapes[:5] == [(1, 32), (1, 7), (1, 11), (1, 8), (1, 30)]
    for prompt, seen in zip(prompts + [far], events):
        tokens = [e.token for e in seen if isinstance(e, TokenEvent)]
        assert len(tokens) == 4
        agree_where_decided(Run(tokens=tokens), harness.run(prompt, n_predict=4, n_probs=2, ignore_eos=True, cache=False))


class NoBatchedPrefill(ForwardLog):
    """The real model, made to refuse prompt chunks of several rows (as a model whose layers cannot
    take mlx-lm's batch caches would), and its CPU decode runtime likewise."""

    def __call__(self, inputs, **kwargs):
        self.shapes.append(tuple(inputs.shape[:2]))
        if inputs.shape[0] > 1 and inputs.shape[1] > 1:
            raise ValueError("this model cannot prefill a batch")
        return self.model(inputs, **kwargs)



class RefusingDecoder:
    """The CPU decode runtime, made to refuse prompt chunks of several sequences at once."""

    def __init__(self, decoder) -> None:
        self.decoder = decoder

    def prefill_rows(self, chunks, *args, **kwargs):
        if len(chunks) > 1:
            raise ValueError("this runtime cannot prefill a batch")
        return self.decoder.prefill_rows(chunks, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.decoder, name)


def test_a_model_that_cannot_batch_prefill_falls_back_to_one_at_a_time(harness: EngineHarness) -> None:
    engine = harness.engine
    batches_prompts = prompts_batch(harness)
    prompts = [random_tokens(10, seed=600 + i) for i in range(3)]
    sinks = [queue.Queue() for _ in prompts]
    requests = [harness.request(p, n_predict=3, n_probs=2, ignore_eos=True, cache=False) for p in prompts]
    real, real_decoder = engine.loaded.model, engine.loaded.decoder
    refusing = NoBatchedPrefill(real)
    refusing_decoder = None if real_decoder is None else RefusingDecoder(real_decoder)

    def install(model, decoder) -> None:
        engine.loaded.model = engine.scheduler.batch.model = model
        engine.loaded.decoder = engine.scheduler.batch.decoder = decoder

    harness.on_engine(lambda: install(refusing, refusing_decoder))
    try:
        log, events = run_logged(harness, requests, sinks)
        still_batching = harness.on_engine(lambda: engine.scheduler.batched_prefill)
    finally:
        harness.on_engine(lambda: install(real, real_decoder) or setattr(engine.scheduler, "batched_prefill", True))
    chunks = [s for s in log.shapes if s[1] > 1]
    if batches_prompts:  # the refused pass, then each chunk alone, and no batched prefill after
        assert chunks[:4] == [(3, 9), (1, 9), (1, 9), (1, 9)] and not still_batching
    else:  # recurrent caches never try a batched prefill
        assert chunks[:3] == [(1, 9), (1, 9), (1, 9)] and still_batching
    # Either way every request completes like a lone run.
    for prompt, seen in zip(prompts, events):
        assert not any(isinstance(e, ErrorEvent) for e in seen)
        tokens = [e.token for e in seen if isinstance(e, TokenEvent)]
        agree_where_decided(Run(tokens=tokens), harness.run(prompt, n_predict=3, n_probs=2, ignore_eos=True, cache=False))


class NoBatchCaches(ForwardLog):
    """The real model, made to refuse any pass of several rows (a model whose layers cannot take
    mlx-lm's batch caches)."""

    def __call__(self, inputs, **kwargs):
        self.shapes.append(tuple(inputs.shape[:2]))
        if inputs.shape[0] > 1:
            raise ValueError("this model cannot take batch caches")
        return self.model(inputs, **kwargs)


def test_a_model_without_batch_caches_serves_concurrent_requests_one_pass_each(harness: EngineHarness) -> None:
    """The load-time probe finds out; concurrent requests then all complete, none fails."""
    engine = harness.engine
    real = engine.loaded.model
    refusing = NoBatchCaches(real)

    def install_and_probe() -> bool:
        engine.loaded.model = engine.scheduler.batch.model = refusing
        return engine.probe_batching()

    prompts = [random_tokens(n, seed=700 + n) for n in (12, 20, 9)]
    sinks = [queue.Queue() for _ in prompts]
    requests = [harness.request(p, n_predict=5, n_probs=2, ignore_eos=True, cache=False) for p in prompts]
    try:
        assert harness.on_engine(install_and_probe) is False
        refusing.shapes.clear()
        _, events = run_logged(harness, requests, sinks)
    finally:
        def restore() -> None:
            engine.loaded.model = engine.scheduler.batch.model = real
            engine.scheduler.batched_decode = engine.scheduler.batched_prefill = True

        harness.on_engine(restore)
    # Lone prompt chunks and steps run on the CPU decode runtime where it takes the model (the
    # refusing model then sees no pass at all); MLX's passes, where there are any, are single rows.
    assert all(rows == 1 for rows, _ in refusing.shapes)
    assert refusing.shapes or harness.engine.loaded.decoder is not None
    for prompt, seen in zip(prompts, events):
        assert not any(isinstance(e, ErrorEvent) for e in seen)
        tokens = [e.token for e in seen if isinstance(e, TokenEvent)]
        assert len(tokens) == 5
        agree_where_decided(Run(tokens=tokens), harness.run(prompt, n_predict=5, n_probs=2, ignore_eos=True, cache=False))
    assert harness.on_engine(engine.probe_batching)  # the real model batches


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's per-thread /proc entries")
def test_stop_returns_once_the_engine_os_thread_is_gone() -> None:
    """Engine.stop waits for the engine's OS thread to end, its C++ thread-local destructors
    included: MLX's per-thread compile cache takes the GIL there, and a process that exited
    right after a stop aborted ("terminate called without an active exception", about one exit
    in three for this file) when that destructor ran during interpreter finalization."""
    h = EngineHarness(tiny_model("llama"), n_parallel=1, enabled=False)
    h.run(random_tokens(20, seed=1), n_predict=4)  # the engine thread runs compiled functions
    task = f"/proc/self/task/{h.engine._thread.native_id}"
    assert os.path.exists(task)
    h.close()
    assert not os.path.exists(task)
