"""The router's eviction rule (``ModelRegistry.make_room``) on models that are only states: which
model goes for ``--models-max`` and ``--models-memory``, pins, and busy models waited for."""

from __future__ import annotations

import asyncio

import pytest

from mlxcel_compat.server.errors import Unavailable
from mlxcel_compat.server.router_registry import ModelRegistry, RouterModel
from mlxcel_compat.server.router_sources import ModelSource


def model(name: str, size: int = 0, pin: bool = False, loaded_at: float | None = None, busy: int = 0) -> RouterModel:
    entry = RouterModel(ModelSource(name, f"/models/{name}.gguf", "preset", pin=pin), [], None, size_bytes=size)
    if loaded_at is not None:
        entry.status, entry.last_used, entry.in_flight = "loaded", loaded_at, busy
    return entry


def make_room(models: list[RouterModel], new: RouterModel, models_max: int = 0, memory: int = 0,
              timeout: float = 0.2) -> dict[str, str]:
    async def run() -> None:
        await ModelRegistry([*models, new], [], models_max, memory, timeout).make_room(new)

    asyncio.run(run())
    return {m.name: m.status for m in models}


def test_count_limit_unloads_the_least_recently_used() -> None:
    models = [model("a", loaded_at=2.0), model("b", loaded_at=1.0), model("c", loaded_at=3.0)]
    assert make_room(models, model("new"), models_max=3) == {"a": "loaded", "b": "unloaded", "c": "loaded"}
    assert make_room(models, model("new"), models_max=0) == {"a": "loaded", "b": "unloaded", "c": "loaded"}


def test_pinned_and_busy_models_stay() -> None:
    models = [model("a", pin=True, loaded_at=1.0), model("b", loaded_at=2.0, busy=1), model("c", loaded_at=3.0)]
    assert make_room(models, model("new"), models_max=3) == {"a": "loaded", "b": "loaded", "c": "unloaded"}


def test_memory_budget_unloads_until_the_new_model_fits() -> None:
    models = [model("a", 60, loaded_at=1.0), model("b", 30, loaded_at=2.0), model("c", 30, loaded_at=3.0)]
    # 120 loaded + 50 > 130: a (the oldest) goes, then 60 + 50 fits.
    assert make_room(models, model("new", 50), memory=130) == {"a": "unloaded", "b": "loaded", "c": "loaded"}
    models = [model("a", 60, loaded_at=1.0), model("b", 30, loaded_at=2.0)]
    assert make_room(models, model("new", 110), memory=130) == {"a": "unloaded", "b": "unloaded"}


def test_a_busy_model_is_waited_for_then_the_load_is_refused() -> None:
    models = [model("a", loaded_at=1.0, busy=1), model("b", pin=True, loaded_at=2.0)]
    with pytest.raises(Unavailable, match="model limit reached, try again later"):
        make_room(models, model("new"), models_max=2, timeout=0.1)
    assert [m.status for m in models] == ["loaded", "loaded"]


def test_pins_alone_over_the_limits() -> None:
    pinned = [model("a", 100, pin=True, loaded_at=1.0), model("b", 100, pin=True, loaded_at=2.0)]
    with pytest.raises(Unavailable, match="2 pinned models are loaded"):
        make_room(pinned, model("new"), models_max=2)
    # Over the memory budget with nothing to unload: the load goes ahead (and the log says so).
    assert make_room(pinned, model("new", 100), memory=150) == {"a": "loaded", "b": "loaded"}


def test_a_model_loaded_for_waiting_requests_serves_them_first() -> None:
    """llama.cpp's test_router_queue_two_waiters_share_one_eviction: two requests for two other
    models at --models-max 1 are both served; the model loaded for the first is not evicted for
    the second before the first request has had it."""
    waiting = model("b", loaded_at=2.0)
    waiting.waiting = 1
    with pytest.raises(Unavailable):
        make_room([waiting], model("c"), models_max=1, timeout=0.1)
    assert waiting.status == "loaded"
    waiting.waiting = 0
    assert make_room([waiting], model("c"), models_max=1) == {"b": "unloaded"}


def test_a_model_still_waiting_for_a_place_holds_none() -> None:
    """Two loads queued at --models-max 1: the one waiting behind the lock does not count against
    the one making room (they would wait for each other until --timeout)."""
    queued = model("b")
    queued.status = "loading"  # asked for, no place yet
    assert make_room([queued, model("a", loaded_at=1.0)], model("c"), models_max=1) == {"b": "loading", "a": "unloaded"}
    queued.placed = True  # past make_room: it counts
    with pytest.raises(Unavailable):
        make_room([queued], model("c"), models_max=1, timeout=0.1)


def test_a_load_for_requests_that_all_left_is_given_up() -> None:
    """llama.cpp's test_router_queue_client_disconnect_keeps_model: a load started for requests
    waits for a busy model's place; once every request waiting for it has left it gives up, and
    the busy model keeps its place. A load asked for with /models/load keeps waiting."""
    from mlxcel_compat.server.router_registry import Abandoned

    busy = model("a", loaded_at=1.0, busy=1)
    wanted = model("b")
    wanted.on_demand = True
    with pytest.raises(Abandoned):
        make_room([busy], wanted, models_max=1, timeout=5.0)
    assert busy.status == "loaded"
    wanted.waiting = 1  # a request still waits: the load waits too, until --timeout
    with pytest.raises(Unavailable):
        make_room([busy], wanted, models_max=1, timeout=0.1)
    wanted.on_demand, wanted.waiting = False, 0
    with pytest.raises(Unavailable):
        make_room([busy], wanted, models_max=1, timeout=0.1)


def test_a_load_nobody_waits_for_evicts_nothing() -> None:
    """The check comes before any eviction: a load whose requests left while it waited (under
    LLAMA_SERVER_DEBUG_FAKE_TIMING, 2 s) must not unload a model that went idle meanwhile."""
    from mlxcel_compat.server.router_registry import Abandoned

    idle = model("a", loaded_at=1.0)
    wanted = model("b")
    wanted.on_demand = True
    with pytest.raises(Abandoned):
        make_room([idle], wanted, models_max=1)
    assert idle.status == "loaded"
