"""Fault containment on a real engine: an exception in one sequence fails that request only.

Faults are injected around the real model (as tests/engine/test_batching.py does to refuse
multi-row passes): a wrapper raises when a forward pass carries a "poison" token that only one
request holds, or raises once on a batched pass, or a row's sampler chain raises. In every case
the other rows of the batch finish like lone runs (where the lone run's choice was decided), the
failed sequence donates nothing to the prompt cache, and the engine keeps serving.
"""

from __future__ import annotations

import queue
from typing import Any

import mlx.core as mx
import pytest

from mlxcel_compat.engine.request import ErrorEvent, FinishEvent, TokenEvent
from tests.conftest import tiny_model
from tests.engine.harness import EngineHarness, Run, collect
from tests.engine.test_batching import agree_where_decided, random_tokens, run_with_model

POISON = 8100  # random_tokens() draws below 8000, so only the poisoned prompt holds this id
N_TOKENS = 6

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module", params=["llama", "qwen3_next", "gemma3_text"])
def harness(request: pytest.FixtureRequest):
    h = EngineHarness(tiny_model(request.param), batch_size=32, n_parallel=4)
    yield h
    h.close()


class Faulty:
    """The real model, raising on the passes ``fails(inputs)`` picks."""

    def __init__(self, model: Any, fails: Any) -> None:
        self.model = model
        self.fails = fails
        self.raised = 0

    def __call__(self, inputs, **kwargs):
        if self.fails(inputs):
            self.raised += 1
            raise RuntimeError("injected fault")
        return self.model(inputs, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def wrap(self, decoder: Any) -> Any:
        """The CPU decode runtime (one token a step, and a lone sequence's prompt chunks, outside
        the model's call), raising on the same passes: a sequence stepped alone runs there."""
        return None if decoder is None else FaultyDecoder(self, decoder)


class FaultyDecoder:
    def __init__(self, faulty: Faulty, decoder: Any) -> None:
        self.faulty = faulty
        self.decoder = decoder

    def step(self, token, cache, owned, scales=None):
        return self.step_rows([token], [cache], [owned], None if scales is None else [scales])[0]

    def step_rows(self, tokens, caches, owned, scales=None):
        if self.faulty.fails(mx.array(tokens).reshape(-1, 1)):
            self.faulty.raised += 1
            raise RuntimeError("injected fault")
        return self.decoder.step_rows(tokens, caches, owned, scales)

    def prefill(self, tokens, cache, owned, scales=None, logits=True):
        if self.faulty.fails(mx.array(tokens).reshape(1, -1)):  # a lone prompt chunk on the runtime
            self.faulty.raised += 1
            raise RuntimeError("injected fault")
        return self.decoder.prefill(tokens, cache, owned, scales, logits)

    def prefill_rows(self, chunks, caches, owned, scales=None, logits=False):
        if any(self.faulty.fails(mx.array(c).reshape(1, -1)) for c in chunks):  # several sequences' chunks
            self.faulty.raised += 1
            raise RuntimeError("injected fault")
        return self.decoder.prefill_rows(chunks, caches, owned, scales, logits)

    def __getattr__(self, name):
        return getattr(self.decoder, name)


def tokens_of(events: list) -> list[int]:
    return [e.token for e in events if isinstance(e, TokenEvent)]


def assert_like_lone_runs(h: EngineHarness, prompts: list[list[int]], events: list[list]) -> None:
    for prompt, seen in zip(prompts, events):
        assert isinstance(seen[-1], FinishEvent), seen[-1]
        tokens = tokens_of(seen)
        assert len(tokens) == N_TOKENS
        agree_where_decided(Run(tokens=tokens), h.run(prompt, n_predict=N_TOKENS, n_probs=2, ignore_eos=True, cache=False))


def test_a_fault_in_one_rows_forward_pass_fails_that_request_only(harness: EngineHarness) -> None:
    """The poisoned prompt's last token is fed by the batched pass that starts every sequence's
    decoding: that pass raises, is undone, and each row is stepped alone; only the poisoned one
    fails (a 500 in llama.cpp's shape at the HTTP side), the others go on batched."""
    harness.reset()
    prompts = [random_tokens(12 + i, seed=900 + i) for i in range(3)]
    poisoned = random_tokens(14, seed=950)[:-1] + [POISON]
    requests = [harness.request(p, n_predict=N_TOKENS, n_probs=2, ignore_eos=True) for p in prompts + [poisoned]]
    sinks = [queue.Queue() for _ in requests]
    wrapper = Faulty(harness.engine.loaded.model, lambda inputs: any(POISON in row for row in inputs.tolist()))
    events = run_with_model(harness, wrapper, requests, sinks)
    assert wrapper.raised >= 2  # the batched pass, then the poisoned row alone
    error = events[3][-1]
    assert isinstance(error, ErrorEvent) and error.code == 500 and "injected fault" in error.message
    assert not tokens_of(events[3])
    assert_like_lone_runs(harness, prompts, events[:3])
    engine = harness.engine
    assert harness.on_engine(lambda: (engine.scheduler.batched_decode, engine.n_processing)) == (True, 0)
    # Nothing of the failed sequence was donated; the others' states were (prompt + generated,
    # a prefix of the next turn: dense KV and whole-state snapshots alike can serve it).
    again = harness.run(poisoned + [1, 2, 3], n_predict=2, ignore_eos=True)
    assert again.finish.n_cached == 0
    hit = harness.run(prompts[0] + tokens_of(events[0]) + [1, 2, 3], n_predict=2, ignore_eos=True)
    assert hit.finish.n_cached >= len(prompts[0])


def test_a_one_off_fault_in_a_batched_pass_is_retried_alone(harness: EngineHarness) -> None:
    """A batched decode pass raises once, mid-generation: the batch cache is rolled back and the
    rows are stepped alone, so every request still finishes like a lone run (exactly: the
    rollback restores the state bit for bit), and decoding goes back to batching."""
    prompts = [random_tokens(10 + 3 * i, seed=1000 + i) for i in range(3)]
    requests = [harness.request(p, n_predict=N_TOKENS, n_probs=2, ignore_eos=True, cache=False) for p in prompts]
    sinks = [queue.Queue() for _ in requests]
    batched_passes = []

    def third_batched_pass(inputs) -> bool:
        if inputs.shape[0] > 1 and inputs.shape[1] == 1:
            batched_passes.append(inputs.shape)
            return len(batched_passes) == 3
        return False

    wrapper = Faulty(harness.engine.loaded.model, third_batched_pass)
    events = run_with_model(harness, wrapper, requests, sinks)
    assert wrapper.raised == 1 and len(batched_passes) > 3  # batching resumed after the failure
    assert_like_lone_runs(harness, prompts, events)
    assert harness.on_engine(lambda: harness.engine.scheduler.batched_decode)


def test_a_sampling_fault_in_one_row_leaves_the_batch_running(harness: EngineHarness) -> None:
    """One sequence's sampler raises on its third token, inside a batched step: that row leaves
    the batch with an error, the others take their tokens from the same pass and finish."""
    engine = harness.engine
    prompts = [random_tokens(11 + i, seed=1100 + i) for i in range(3)]
    requests = [harness.request(p, n_predict=N_TOKENS, n_probs=2, ignore_eos=True) for p in prompts]
    target = requests[1].task_id
    sinks = [queue.Queue() for _ in requests]

    def install_and_submit() -> None:
        for request, sink in zip(requests, sinks):
            engine.submit(request, sink.put)

    def break_sampler() -> bool:
        for slot in engine.slots:
            seq = slot.sequence
            if seq is not None and seq.request.task_id == target:
                real, calls = seq.chain.sample, []

                def sample(*args, **kwargs):
                    calls.append(1)
                    if len(calls) == 3:
                        raise ValueError("injected sampler fault")
                    return real(*args, **kwargs)

                seq.chain.sample = sample
                return True
        return False

    while harness.on_engine(lambda: engine.n_processing):
        pass
    harness.on_engine(install_and_submit)
    while not harness.on_engine(break_sampler):  # once admitted (before its first token is read)
        pass
    runs = [collect(sinks[i]) for i in (0, 2)]
    seen = [sinks[1].get(timeout=120)]
    while not isinstance(seen[-1], (FinishEvent, ErrorEvent)):
        seen.append(sinks[1].get(timeout=120))
    assert isinstance(seen[-1], ErrorEvent) and "injected sampler fault" in seen[-1].message
    assert len(tokens_of(seen)) < N_TOKENS
    for run, prompt in zip(runs, (prompts[0], prompts[2])):
        assert len(run.tokens) == N_TOKENS
        agree_where_decided(run, harness.run(prompt, n_predict=N_TOKENS, n_probs=2, ignore_eos=True, cache=False))
    assert harness.on_engine(lambda: engine.n_processing) == 0


def test_a_fault_in_one_rows_prefill_chunk(harness: EngineHarness) -> None:
    """The poison sits inside a prompt chunk. Where chunks prefill together, that pass raises and
    every row is prefilled alone: only the poisoned request fails, and prefill keeps batching."""
    prompts = [random_tokens(10, seed=1200 + i) for i in range(2)]
    poisoned = random_tokens(10, seed=1250)
    poisoned[4] = POISON
    requests = [harness.request(p, n_predict=N_TOKENS, n_probs=2, ignore_eos=True) for p in prompts + [poisoned]]
    sinks = [queue.Queue() for _ in requests]
    wrapper = Faulty(harness.engine.loaded.model, lambda inputs: any(POISON in row for row in inputs.tolist()))
    events = run_with_model(harness, wrapper, requests, sinks)
    assert isinstance(events[2][-1], ErrorEvent) and "injected fault" in events[2][-1].message
    assert_like_lone_runs(harness, prompts, events[:2])
    assert harness.on_engine(lambda: harness.engine.scheduler.batched_prefill)


def test_an_unexpected_error_in_the_engine_loop_keeps_the_engine_serving(harness: EngineHarness) -> None:
    """A bug outside every per-sequence guard (here: the scheduler itself raises once) fails the
    running sequences with an error event instead of killing the engine thread."""
    engine = harness.engine
    sink: queue.Queue = queue.Queue()
    real_prefill = engine.scheduler.prefill
    state = {"raised": False}

    def broken_prefill(busy, model):
        if not state["raised"]:
            state["raised"] = True
            raise RuntimeError("scheduler bug")
        return real_prefill(busy, model)

    def install_and_submit() -> None:
        engine.scheduler.prefill = broken_prefill
        harness.submit(random_tokens(12, seed=1300), sink.put, n_predict=3, ignore_eos=True)

    harness.on_engine(install_and_submit)
    try:
        event = sink.get(timeout=60)
        while isinstance(event, TokenEvent):
            event = sink.get(timeout=60)
        assert isinstance(event, ErrorEvent) and "scheduler bug" in event.message
    finally:
        harness.on_engine(lambda: setattr(engine.scheduler, "prefill", real_prefill))
    assert len(harness.run(random_tokens(12, seed=1301), n_predict=3, ignore_eos=True).tokens) == 3
