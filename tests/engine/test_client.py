"""The asyncio side of the engine (engine/client.py) on a real engine: the events a request
yields, and how often the event loop is woken for them."""

from __future__ import annotations

import asyncio

from mlxcel_compat.engine.client import EngineClient
from mlxcel_compat.engine.request import FinishEvent, TokenEvent
from tests.conftest import tiny_model
from tests.engine.harness import EngineHarness


def test_a_consumer_that_needs_only_the_end_wakes_the_loop_once() -> None:
    """``incremental=False`` (a non-streaming response): the same events as a streaming
    consumer, in order, with one wake of the event loop (the finish) instead of one per token;
    every wake takes the GIL from the engine thread between its steps."""
    harness = EngineHarness(tiny_model("llama"), n_parallel=1, enabled=False)
    try:
        client = EngineClient(harness.engine)

        async def run(incremental: bool) -> tuple[list[object], int]:
            loop = asyncio.get_running_loop()
            wakes = 0
            plain = loop.call_soon_threadsafe

            def counted(*args: object, **kwargs: object) -> object:
                nonlocal wakes
                wakes += 1
                return plain(*args, **kwargs)

            loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
            request = harness.request([5, 6, 7, 8, 9], n_predict=48, cache=False, ignore_eos=True)
            events = [event async for event in client.generate(request, incremental=incremental)]
            return events, wakes

        streamed, stream_wakes = asyncio.run(run(True))
        collected, collect_wakes = asyncio.run(run(False))
    finally:
        harness.close()
    tokens = [[e.token for e in events if isinstance(e, TokenEvent)] for events in (streamed, collected)]
    assert len(tokens[0]) == 48 and tokens[0] == tokens[1]
    assert isinstance(streamed[-1], FinishEvent) and isinstance(collected[-1], FinishEvent)
    assert collect_wakes == 1
    assert stream_wakes > 1  # a streaming consumer is woken as the tokens come (several at a wake when it lags)


def test_a_streaming_consumer_makes_decode_steps_release_the_gil_while_it_reads() -> None:
    """A streamed response counts as a consumer (``blas_shim.StreamedConsumers``) from its
    request until its last event or until it stops reading, and only then: while one reads, a
    small model's decode steps release the GIL so the event loop sends each token as it comes
    (held, they left it waiting and tokens came in bursts)."""
    from mlxcel_compat.runtime.native.blas_shim import StreamedConsumers

    harness = EngineHarness(tiny_model("llama"), n_parallel=1, enabled=False)
    try:
        client = EngineClient(harness.engine)

        async def run(incremental: bool, stop_after: int | None) -> list[int]:
            seen = []
            stream = client.generate(harness.request([5, 6, 7], n_predict=24, cache=False, ignore_eos=True),
                                     incremental=incremental)
            async for event in stream:
                seen.append(StreamedConsumers.count)
                if stop_after is not None and len(seen) == stop_after:
                    break
            await stream.aclose()
            return seen

        assert StreamedConsumers.count == 0
        assert set(asyncio.run(run(True, None))) == {1}
        assert StreamedConsumers.count == 0
        assert set(asyncio.run(run(True, 3))) == {1}  # a client that goes away ends it too
        assert StreamedConsumers.count == 0
        assert set(asyncio.run(run(False, None))) == {0}  # a non-streamed response: steps keep the GIL
    finally:
        harness.close()
