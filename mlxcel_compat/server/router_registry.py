"""The router's models and their lifecycle: load on demand, unload, evict.

Every model the router knows is a :class:`RouterModel`. A loaded one holds a whole single-model
server in this process (``server/instance.py``: its engine on a thread of its own, its
``ServerContext``, its app built with ``edge=False``); the router forwards requests to that app.

Loading runs off the event loop: the model is resolved and its app built on a worker thread, the
weights load on the model's own engine thread, and ``server.app.open_model`` waits for them with
``asyncio.sleep``, so one model's load never stalls another model's streams.

Room is made before a load, under one lock so two loads cannot both take the last place: while
more than ``--models-max`` models (0: no limit) would be loaded, or their files would take more than
``--models-memory`` bytes, the least recently used model that is not pinned (``pin = true``)
and serves no request is unloaded. A model busy with requests, or loaded for requests that have
not reached it yet, is waited for (up to ``--timeout``), never cut off.

A model's prompt cache outlives its unload (docs/router.md): with no disk tier, its RAM store of
KV entries is kept by the router and handed to the next load of the same weights (the same
fingerprint); with ``--prompt-cache-dir`` the engine writes its entries to the disk tier as it
stops, and the next load reads them back from there.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxcel_compat.server.app import open_model
from mlxcel_compat.server.errors import InvalidRequest, ServerError, Unavailable
from mlxcel_compat.server.instance import InstanceError, build_server, prepare_model
from mlxcel_compat.server.router_events import RouterEvents
from mlxcel_compat.server.router_sources import ModelSource

log = logging.getLogger(__name__)

POLL_SECONDS = 0.02  # how often a waiting request looks at a model's state
FLUSH_SECONDS = 5.0  # after a stop's grace: time for ended sequences to leave their engine
FAKE_TIMING_SECONDS = 2.0  # llama-server's LLAMA_SERVER_DEBUG_FAKE_TIMING delay (server_models::load, proxy_request)


def disk_size(model: str) -> int:
    """Bytes of a model's files on disk (all parts of a split GGUF; a directory's weights), the
    measure ``--models-memory`` counts before a model is loaded. 0 for a hub repository."""
    path = Path(model).expanduser()
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir() if p.is_file() and p.suffix in (".safetensors", ".gguf", ".npz"))
    if not path.is_file():
        return 0
    from mlxcel_compat.server.router_sources import FIRST_SPLIT

    split = FIRST_SPLIT.match(path.name)
    if split:
        return sum(p.stat().st_size for p in path.parent.glob(f"{split['stem']}-*-of-*.gguf"))
    return path.stat().st_size


class Abandoned(Exception):
    """A load for requests that all left while it waited for a place."""


@dataclass
class KeptCache:
    """A model's prompt-cache RAM store kept across its unload, with the weights it belongs to."""

    fingerprint: str
    store: Any  # cache.prompt_store.PromptCacheStore


@dataclass
class RouterModel:
    """One model the router serves: where it comes from, its settings, its state."""

    source: ModelSource
    argv: list[str]  # what it is served with (router_sources.model_argv)
    settings: Any  # settings.Settings resolved from argv
    size_bytes: int = 0
    status: str = "unloaded"  # unloaded | loading | loaded | unloading
    error: str | None = None  # why the last load failed (None: it did not)
    app: Any = None  # the model's app while loaded (server/instance.py, edge=False)
    in_flight: int = 0  # requests being served
    waiting: int = 0  # requests waiting for it to load (it is not evicted before they are served)
    placed: bool = False  # it has its place under the limits (a "loading" model may still wait for one)
    on_demand: bool = False  # loading for requests (not /models/load): given up if they all leave first
    last_used: float = 0.0
    kept: KeptCache | None = None
    tasks: set[asyncio.Task] = field(default_factory=set)

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def ctx(self) -> Any:
        return self.app.state.ctx if self.app is not None else None

    @property
    def shown_status(self) -> str:
        """``/models``' status value: ``sleeping`` for a loaded model asleep (--sleep-idle-seconds)."""
        ctx = self.ctx
        if self.status == "loaded" and ctx is not None and ctx.engine.sleeping:
            return "sleeping"
        return self.status


class ModelRegistry:
    def __init__(self, models: list[RouterModel], api_keys: list[str], models_max: int, models_memory: int,
                 timeout: float, fake_timing: bool = False) -> None:
        self.models: dict[str, RouterModel] = {}
        self.labels: dict[str, RouterModel] = {}
        self._index(models)
        self.events = RouterEvents()
        self.api_keys = api_keys
        self.models_max = models_max
        self.models_memory = models_memory
        self.timeout = timeout
        self.fake_timing = fake_timing  # LLAMA_SERVER_DEBUG_FAKE_TIMING (server/router.py)
        self.room = asyncio.Lock()

    def _index(self, models: list[RouterModel]) -> None:
        self.models = {m.name: m for m in models}
        self.labels = {label: m for m in models for label in [m.name, *m.source.aliases]}

    def _set_status(self, model: RouterModel, status: str) -> None:
        """Change a model's status and tell ``/models/sse`` (llama-server's ``status_change``)."""
        model.status = status
        data: dict[str, Any] = {"status": status}
        if status == "unloaded":
            data["exit_code"] = 1 if model.error is not None else 0
        self.events.notify("status_change", model.name, data)

    async def replace(self, fresh: list[RouterModel]) -> None:
        """``GET /models?reload=1``: take the sources' new model list, as llama-server's reload
        does: a running model whose source is gone or whose arguments changed is unloaded, a model
        no longer in any source is dropped, the others take their new settings (a failed load's
        error is cleared), new ones are added unloaded (``load-on-startup`` is not honoured)."""
        new = {m.name: m for m in fresh}
        for model in list(self.models.values()):
            changed = model.name not in new or new[model.name].argv != model.argv
            if changed and model.status in ("loading", "loaded"):
                while model.status == "loading":
                    await asyncio.sleep(POLL_SECONDS)
                if model.status == "loaded":
                    await self._unload(model, "its source changed (reload)")
        kept = []
        for name, entry in new.items():
            old = self.models.get(name)
            if old is not None and (old.status != "unloaded" or old.waiting or old.in_flight):
                # running, or requests hold it: it stays (its new arguments apply from its next reload)
                old.source.hidden = entry.source.hidden
                kept.append(old)
                continue
            if old is not None:
                entry.kept = old.kept  # its prompt cache still serves the same weights
            kept.append(entry)
        self._index(kept)
        self.events.notify("models_reload", "*")

    async def remove(self, model: RouterModel) -> None:
        """Stop ``model`` if it runs and drop it from the list (``DELETE /models``)."""
        while model.status == "loading":
            await asyncio.sleep(POLL_SECONDS)
        if model.status == "loaded":
            await self._unload(model, "removed")
        self._index([m for m in self.models.values() if m is not model])

    def add(self, model: RouterModel) -> None:
        self._index([*self.models.values(), model])

    def find(self, label: str) -> RouterModel | None:
        """The model of a name or alias."""
        return self.labels.get(label)

    @property
    def engines(self) -> list[Any]:
        return [m.ctx.engine for m in self.models.values() if m.ctx is not None]

    # ------------------------------------------------------------------ requests

    async def acquire(self, model: RouterModel, autoload: bool) -> Any:
        """The app of ``model`` once it is loaded (loading it if ``autoload``), counted as busy
        until :meth:`release`. Waits at most ``--timeout`` seconds for a load."""
        deadline = time.monotonic() + self.timeout if self.timeout > 0 else None
        started = False
        model.waiting += 1
        try:
            while True:
                if model.status == "loaded" and model.app is not None:
                    model.in_flight += 1
                    model.last_used = time.monotonic()
                    return model.app
                if model.status == "unloaded":
                    if started and model.error is not None:
                        raise ServerError(f"model name={model.name} failed to load: {model.error}")
                    if not autoload:
                        raise InvalidRequest("model is not loaded")
                    self.start_load(model, on_demand=True)
                    started = True
                if deadline is not None and time.monotonic() > deadline:
                    raise Unavailable(f"model '{model.name}' is still {model.status} after {self.timeout:g} s (--timeout)")
                await asyncio.sleep(POLL_SECONDS)
        finally:
            model.waiting -= 1

    def release(self, model: RouterModel) -> None:
        model.in_flight -= 1
        model.last_used = time.monotonic()

    # ------------------------------------------------------------------ load and unload

    def start_load(self, model: RouterModel, on_demand: bool = False) -> None:
        """Begin loading ``model`` in the background (its status says how it goes). A load
        ``on_demand`` (for requests) is given up while it waits for a place if every request
        waiting for it has left (llama-server's queue drops a client that disconnects), so a
        client that gave up does not cost a busy model its place."""
        if model.status != "unloaded":
            model.on_demand = model.on_demand and on_demand
            return
        model.on_demand = on_demand
        self._set_status(model, "loading")
        self._spawn(model, self._load(model))

    def start_unload(self, model: RouterModel) -> None:
        if model.status == "loaded":
            self._set_status(model, "unloading")
            self._spawn(model, self._unload(model, "requested"))

    def _spawn(self, model: RouterModel, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        model.tasks.add(task)
        task.add_done_callback(model.tasks.discard)

    async def _load(self, model: RouterModel) -> None:
        t0 = time.perf_counter()
        try:
            if self.fake_timing:  # llama-server's debug hook: every load starts 2 s late
                await asyncio.sleep(FAKE_TIMING_SECONDS)
            await self.make_room(model)
            model.placed = True
            # No local keeps the app: a reference left in this frame while it is unloaded would
            # hold the model's memory until the collector's next full pass (see release_memory).
            model.app = await asyncio.to_thread(self._build, model)
            model.ctx.engine.start()
            failure = await open_model(model.ctx)
            if failure is not None:
                raise InstanceError(failure.removeprefix("model failed to load: "))
        except Abandoned:
            log.info("router: load of '%s' given up: the requests waiting for it left", model.name)
            self._set_status(model, "unloaded")
            return
        except (InstanceError, Unavailable) as exc:
            await self._fail(model, str(exc.message if isinstance(exc, Unavailable) else exc))
            return
        except Exception as exc:  # a bug must not leave the model "loading" for ever
            log.exception("router: loading model '%s' failed", model.name)
            await self._fail(model, f"{type(exc).__name__}: {exc}")
            return
        model.error = None
        self._set_status(model, "loaded")
        model.last_used = time.monotonic()
        log.info("router: model '%s' loaded in %.2f s", model.name, time.perf_counter() - t0)

    def _build(self, model: RouterModel) -> Any:
        """The model's app (worker thread: resolving may download; no weights load here)."""
        prepared = prepare_model(model.settings, model.source.model)
        return build_server(model.settings, prepared.path, self.api_keys, model_name=model.name,
                            adapters=prepared.adapters, speculative=prepared.speculative, edge=False,
                            load_options=prepared.load_options, mmproj=prepared.mmproj,
                            prefix_cache_hook=lambda engine, cache: self._adopt_kept(model, engine, cache))

    def _adopt_kept(self, model: RouterModel, engine: Any, cache: Any) -> Any:
        """Engine thread, at load: give the new prompt cache the entries of the previous load."""
        kept, model.kept = model.kept, None
        if kept is not None and cache.disk is None and kept.fingerprint == engine.compat.model:
            cache.store = kept.store
            log.info("router: model '%s' keeps %d prompt-cache entries from its previous load", model.name, len(kept.store))
        return cache

    async def _fail(self, model: RouterModel, reason: str) -> None:
        log.error("router: model '%s' failed to load: %s", model.name, reason)
        await self._stop_app(model)
        model.placed = False
        model.error = reason
        self._set_status(model, "unloaded")

    async def _unload(self, model: RouterModel, why: str) -> None:
        """Stop ``model``'s engine (running requests get ``stop-timeout`` seconds) and free it."""
        if model.status != "unloading":
            self._set_status(model, "unloading")
        await self._drain(model)
        model.kept = kept_cache(model.ctx)
        await self._stop_app(model)
        model.placed = False
        self._set_status(model, "unloaded")
        log.info("router: model '%s' unloaded (%s)", model.name, why)

    async def _drain(self, model: RouterModel) -> None:
        """Let running requests finish within ``stop-timeout`` (new ones get a 503), then end them."""
        if model.ctx is None or not model.in_flight:
            return
        model.ctx.engine.shutdown(running_too=False)
        deadline = time.monotonic() + model.source.stop_timeout
        while model.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(POLL_SECONDS)
        if model.ctx is not None:
            model.ctx.engine.shutdown(running_too=True)
        deadline = time.monotonic() + FLUSH_SECONDS
        while model.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(POLL_SECONDS)

    async def _stop_app(self, model: RouterModel) -> None:
        app, model.app = model.app, None
        if app is None:
            return
        held = [app]
        del app  # the list holds the last reference, and the worker thread takes it from there
        await asyncio.to_thread(_stop_and_release, held)

    async def make_room(self, model: RouterModel) -> None:
        """Unload least recently used models until ``model`` fits ``--models-max`` and
        ``--models-memory``; wait (up to ``--timeout``) for busy ones."""
        deadline = time.monotonic() + self.timeout if self.timeout > 0 else None
        async with self.room:
            while True:
                # Models that hold a place: loaded, unloading, or loading past this step (a model
                # still waiting here for a place holds none, or two waiters would block each other).
                others = [m for m in self.models.values()
                          if m is not model and m.status != "unloaded" and (m.status != "loading" or m.placed)]
                over_count = self.models_max > 0 and len(others) >= self.models_max
                over_memory = self.models_memory > 0 and sum(m.size_bytes for m in others) + model.size_bytes > self.models_memory
                if not (over_count or over_memory):
                    return
                if model.on_demand and model.waiting == 0:
                    # Checked before any eviction: a model that went idle meanwhile keeps its place.
                    raise Abandoned(model.name)
                movable = sorted((m for m in others if not m.source.pin), key=lambda m: m.last_used)
                # A model loaded for requests still waiting for it serves them before it may go.
                idle = [m for m in movable if m.status == "loaded" and m.in_flight == 0 and m.waiting == 0]
                if idle:
                    await self._unload(idle[0], "least recently used: " + ("--models-max" if over_count else "--models-memory"))
                    continue
                if not movable:
                    if over_count:
                        raise Unavailable(f"model limit reached: {len(others)} pinned models are loaded (--models-max {self.models_max})")
                    log.warning("router: loading '%s' past --models-memory: every loaded model is pinned", model.name)
                    return
                if deadline is not None and time.monotonic() > deadline:
                    raise Unavailable("model limit reached, try again later")
                await asyncio.sleep(POLL_SECONDS)

    async def close(self) -> None:
        """Stop every model (server shutdown)."""
        for model in self.models.values():
            for task in list(model.tasks):
                task.cancel()
            await self._stop_app(model)
            model.placed = False
            model.status = "unloaded"


def kept_cache(ctx: Any) -> KeptCache | None:
    """What an unloading model's prompt cache leaves for its next load: its RAM store, unless a
    disk tier takes the entries (written there as the engine stops)."""
    engine = ctx.engine if ctx is not None else None
    cache = engine.prefix_cache if engine is not None else None
    if cache is None or cache.disk is not None or engine.compat is None:
        return None
    return KeptCache(engine.compat.model, cache.store)


def _stop(ctx: Any) -> None:
    """Stop a model's engine thread (its prompt cache flushed to the disk tier first) and its
    worker pool."""
    ctx.engine.stop()
    ctx.workers.close()
    ctx.engine.loaded = None


def _stop_and_release(held: list[Any]) -> None:
    """Worker thread: stop the model in ``held`` (its only reference), drop it, and collect, in
    one call. Stopping it in one executor call and collecting in a second let the collection miss
    it: the first call's finished work item, still held by its thread for a moment, referenced the
    model's context, so a collection on another executor thread then found it reachable; nothing
    collected its reference cycles afterwards, and the GGUF stayed mapped after "unloaded"
    (``tests/e2e/test_router.py::test_unload_gives_the_memory_back``, now and then under load)."""
    app = held.pop()
    _stop(app.state.ctx)
    del app
    release_memory()


def release_memory() -> None:
    """Give an unloaded model's memory back now. Its objects hold reference cycles (the engine
    and its scheduler, sequences and their sinks), which only a full collection frees: without
    one, the weights (and the memory-mapped GGUF pages) stayed resident until the collector
    happened to run. Callers keep no reference to the model's objects in their frames."""
    gc.collect()
    try:
        import mlx.core as mx

        mx.clear_cache()
    except Exception:  # pragma: no cover - MLX always imports where an engine ran
        pass


__all__ = ["ModelRegistry", "RouterModel", "disk_size", "kept_cache", "release_memory"]
