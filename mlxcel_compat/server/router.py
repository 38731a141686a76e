"""llama-server's router mode in one process: several models behind one listener.

Started without ``-m`` but with ``--models-dir``, ``--models-preset`` or GGUF models in
``$LLAMA_CACHE`` (``server/router_sources.py``), the server answers
the router's own routes itself (``/health``, ``/models`` (``?reload=1``; ``POST`` downloads a
model, ``DELETE`` removes one: ``server/router_downloads.py``), ``/v1/models``, ``/models/sse``
(``server/router_events.py``), ``/models/load``, ``/models/unload``, ``/props`` without
``?model=``, the chat page, ``POST /v1/streams/lookup``) and hands every other request
to the app of the model it names, unchanged: POST routes name it in the body's ``model`` field,
GET routes in ``?model=``, a resumable stream's routes (``/v1/stream``) by the model that ran the
conversation (``server/router_streams.py``). That app is the single-model server's (``server/instance.py``), so a
model behind the router answers exactly as it would served alone. Errors are llama-server's
(``tools/server/server-models.cpp``): a missing name, an unknown model, a model not loaded with
autoload off, a model that failed to load. Why one process and not a child per model:
docs/router.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator
from urllib.parse import parse_qs

import orjson
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from mlxcel_compat.server import api_web
from mlxcel_compat.server.api_tools import feature_disabled
from mlxcel_compat.server.app import ErrorMiddleware, GateMiddleware, ServerHeaderMiddleware
from mlxcel_compat.server.cors import CorsMiddleware, CorsPolicy
from mlxcel_compat.server.errors import InvalidRequest, NotFound, PayloadTooLarge, json_response
from mlxcel_compat.server.formats import BUILD_INFO
from mlxcel_compat.server.router_downloads import Downloads, remove_cached
from mlxcel_compat.server.router_events import event_stream
from mlxcel_compat.server.router_registry import (FAKE_TIMING_SECONDS, ModelRegistry, RouterModel, disk_size,
                                                  release_memory)
from mlxcel_compat.server.router_sources import SourceError, collect_sources, model_argv
from mlxcel_compat.server.router_streams import (LOOKUP_PATH, STREAM_PATH, ConversationOwners, conversation_header,
                                                 stream_owner, streams_lookup)
from mlxcel_compat.settings import SettingsError, mcp_proxy_enabled, resolve_settings

log = logging.getLogger(__name__)

# The routes the router answers itself; any other path goes to the model the request names.
OWN_PATHS = {"/health", "/v1/health", "/models", "/v1/models", "/models/load", "/models/unload", "/models/sse",
             "/", "/index.html", LOOKUP_PATH}
# GET routes the router answers itself when no ?model= names a model (the chat page reads both).
MODEL_OPTIONAL = {"/props", "/tools"}
ROUTER_BODY_BYTES = 64 << 20  # the most body the router reads to find "model" without --max-body-bytes
INLINE_JSON_BYTES = 64 << 10  # bodies above this are parsed on a thread, off the event loop
# llama-server's own debug hook, mirrored for its test suite (unit/test_router.py's queue tests set
# it): when set (non-empty), every model load starts, and every forwarded request reaches its
# model, 2 seconds late, so a test can keep a model busy. Unset, it costs nothing.
FAKE_TIMING_VARIABLE = "LLAMA_SERVER_DEBUG_FAKE_TIMING"


@dataclass
class RouterState:
    """What the router's gate and the chat page read (``request.app.state.ctx``); the shape of
    ``ServerContext`` those need: always ready, keys, the settings, the draining flag."""

    settings: Any
    registry: ModelRegistry
    downloads: Downloads
    argv: list[str]
    api_keys: list[str] = field(default_factory=list)
    owners: ConversationOwners = field(default_factory=ConversationOwners)  # whose resumable stream is whose
    draining: bool = False
    started: float = field(default_factory=time.time)
    ready: bool = True

    @property
    def engines(self) -> list[Any]:
        """The loaded models' engines (the shutdown drains them all)."""
        return self.registry.engines


# --------------------------------------------------------------------------- the model list


def build_models(settings: Any, argv: list[str]) -> list[RouterModel]:
    """Every model of the sources, with its settings resolved (a bad preset stops start-up)."""
    models = []
    for source in collect_sources(settings.models_dir, settings.models_preset, settings.llama_cache):
        args = model_argv(source, argv)
        try:
            model_settings = resolve_settings(args, os.environ)
        except SettingsError as exc:
            raise SourceError(f"model '{source.name}': {exc}") from exc
        models.append(RouterModel(source, args, model_settings, size_bytes=disk_size(source.model)))
    return models


def status_json(model: RouterModel) -> dict[str, Any]:
    """llama-server's ``status`` object: its value, the model's arguments, and after a failed
    load ``failed``, ``exit_code`` and (beyond llama-server) ``error``, the reason."""
    status: dict[str, Any] = {"value": model.shown_status, "args": ["mlxcel-server", *model.argv]}
    if model.status == "unloaded" and model.error is not None:
        status.update(failed=True, exit_code=1, error=model.error)
    return status


def model_json(model: RouterModel, created: int) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "id": model.name,
        "aliases": list(model.source.aliases),
        "tags": list(model.settings.tags or ()),
        "object": "model",
        "owned_by": "llamacpp",
        "created": created,
        "status": status_json(model),
        "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
        "source": model.source.source,
        "can_remove": model.source.source == "cache",
        "path": model.source.model,
        "pinned": model.source.pin,
    }
    ctx = model.ctx
    if model.status == "loaded" and ctx is not None and ctx.model is not None:
        m = ctx.model
        if ctx.media is not None and ctx.media.facts.images:
            entry["architecture"]["input_modalities"].append("image")
        entry["meta"] = {"vocab_type": 2, "n_vocab": m.vocab_size, "n_ctx": m.n_ctx, "n_ctx_train": m.n_ctx_train,
                         "n_embd": m.n_embd, "n_params": m.n_params, "size": m.size_bytes, "ftype": m.file_type}
    return entry


def download_json(name: str, created: int) -> dict[str, Any]:
    """A model whose download (``POST /models``) is under way, as llama-server lists it: status
    ``downloading``, removable (``DELETE /models`` cancels it)."""
    return {"id": name, "aliases": [], "tags": [], "object": "model", "owned_by": "llamacpp", "created": created,
            "status": {"value": "downloading", "args": []},
            "architecture": {"input_modalities": ["text"], "output_modalities": ["text"]},
            "source": "cache", "can_remove": True, "path": None, "pinned": False}


# --------------------------------------------------------------------------- the router's own routes


def _state(request: Request) -> RouterState:
    return request.app.state.ctx


async def health(request: Request) -> Response:
    return json_response({"status": "ok"})


async def list_models(request: Request) -> Response:
    """The model list; ``?reload=1`` first re-reads the sources (a preset edited, a file added)."""
    state = _state(request)
    if request.query_params.get("reload"):
        await reload_sources(state)
    created = int(time.time())
    models = [model_json(m, created) for m in state.registry.models.values() if not m.source.hidden]
    models += [download_json(name, created) for name in state.downloads.running if name not in state.registry.models]
    return json_response({"data": models, "object": "list"})


async def reload_sources(state: RouterState) -> None:
    try:
        fresh = await asyncio.to_thread(build_models, state.settings, state.argv)
    except SourceError as exc:
        raise InvalidRequest(f"cannot reload the model sources: {exc}") from None
    await state.registry.replace(fresh)


async def models_sse(request: Request) -> Response:
    return event_stream(_state(request).registry.events)


async def add_model(request: Request) -> Response:
    """``POST /models``: download ``{"model": "user/repo[:TAG]"}`` into the hub cache."""
    name = await _body_name(request)
    if not name:
        raise InvalidRequest("model must be a non-empty string")
    _state(request).downloads.start(name)
    return json_response({"success": True})


async def delete_model(request: Request) -> Response:
    """``DELETE /models?model=NAME``: stop a cache model and delete its files from the cache."""
    name = request.query_params.get("model", "")
    if not name:
        raise InvalidRequest("model must be a non-empty string")
    state = _state(request)
    if await state.downloads.cancel(name):  # a download under way: stopped, its files deleted
        state.registry.events.notify("model_remove", name)
        return json_response({"success": True})
    registry = state.registry
    model = registry.models.get(name)
    if model is None:
        raise InvalidRequest(f"model name={name} is not found")
    if model.source.source != "cache":
        raise InvalidRequest(f"model name={name} is not removable (not from cache)")
    await registry.remove(model)
    await asyncio.to_thread(remove_cached, model)
    registry.events.notify("model_remove", name)
    return json_response({"success": True})


async def _body_name(request: Request) -> str | None:
    """The body's ``model`` field (None when it is not a string)."""
    raw = await request.body()
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        raise InvalidRequest("request body is not valid JSON") from None
    name = body.get("model") if isinstance(body, dict) else None
    return name if isinstance(name, str) else None


async def _named(request: Request) -> RouterModel | None:
    name = await _body_name(request)
    return _state(request).registry.find(name) if name is not None else None


async def load_model(request: Request) -> Response:
    model = await _named(request)
    if model is None:
        raise NotFound("model is not found")
    if model.status in ("loading", "loaded"):
        raise InvalidRequest("model is already running")
    _state(request).registry.start_load(model)
    return json_response({"success": True})


async def unload_model(request: Request) -> Response:
    """Unload a model, or (as llama-server does) cancel the download of a model under way."""
    name = await _body_name(request)
    if name is not None and await _state(request).downloads.cancel(name):
        return json_response({"success": True})
    model = await _named(request)
    if model is None:
        raise InvalidRequest("model is not found")
    if model.status != "loaded":
        raise InvalidRequest("model is not running")
    _state(request).registry.start_unload(model)
    return json_response({"success": True})


async def router_tools(request: Request) -> Response:
    """The chat page's tool list: the router offers no built-in tools of its own (a model's
    ``--tools`` are reached with ``?model=``), so it answers as a server without tools."""
    return feature_disabled()


async def router_props(request: Request) -> Response:
    state = _state(request)
    settings = state.settings
    ui_settings: dict[str, Any] = {}
    if settings.ui_config_file:  # as ServerContext.ui_settings: the file, then --ui-config over it
        with open(os.path.expanduser(settings.ui_config_file), encoding="utf-8") as f:
            ui_settings.update(orjson.loads(f.read()))
    ui_settings.update(settings.ui_config or {})
    return json_response({
        "role": "router",
        "max_instances": settings.models_max,
        "models_autoload": bool(settings.models_autoload),
        "model_alias": "llama-server",
        "model_path": "none",
        "default_generation_settings": {"params": {}, "n_ctx": 0},
        "ui_settings": ui_settings,
        "build_info": BUILD_INFO,
        "cors_proxy_enabled": mcp_proxy_enabled(settings),
    })


ROUTES = [
    Route("/health", health, methods=["GET"]),
    Route("/v1/health", health, methods=["GET"]),
    Route("/models", list_models, methods=["GET"]),
    Route("/models", add_model, methods=["POST"]),
    Route("/models", delete_model, methods=["DELETE"]),
    Route("/models/sse", models_sse, methods=["GET"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/models/load", load_model, methods=["POST"]),
    Route("/models/unload", unload_model, methods=["POST"]),
    Route("/props", router_props, methods=["GET"]),
    Route("/tools", router_tools, methods=["GET"]),
    Route(LOOKUP_PATH, streams_lookup, methods=["POST"]),
    *api_web.ROUTES,
]


# --------------------------------------------------------------------------- forwarding


def _query(scope: Scope) -> dict[str, list[str]]:
    return parse_qs(scope.get("query_string", b"").decode("latin-1"))


def _autoload(scope: Scope, default: bool) -> bool:
    """``?autoload=true|false`` overrides ``--models-autoload`` for one request."""
    values = _query(scope).get("autoload")
    return default if not values else values[-1] in ("true", "1")


class Forwarder:
    """The ASGI app of every non-router path: find the model, wait for it, hand the request over."""

    def __init__(self, registry: ModelRegistry, settings: Any, owners: ConversationOwners, prefix: str = "") -> None:
        self.registry = registry
        self.settings = settings
        self.owners = owners
        self.prefix = prefix
        self.fake_timing = registry.fake_timing
        self.body_limit = settings.max_body_bytes or ROUTER_BODY_BYTES

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body: bytes | None = None
        if scope["method"] in ("GET", "HEAD", "DELETE"):
            name = (_query(scope).get("model") or [""])[-1]
            if not name and scope["path"].removeprefix(self.prefix) == STREAM_PATH:
                # a resumable stream's routes name the conversation: its owner answers
                conversation = (_query(scope).get("conv_id") or [""])[-1]
                deleting = scope["method"] == "DELETE"
                owner = stream_owner(self.registry, self.owners, conversation, deleting)
                if deleting:
                    self.owners.forget(conversation)
                if owner is None:  # a DELETE no loaded model answers for: llama-server's 204 all the same
                    await Response(status_code=204)(scope, receive, send)
                    return
                name = owner.name
        else:
            body = await self._read_body(receive)
            name = await self._body_model(body)
        if not name:
            raise InvalidRequest("model name is missing from the request")
        model = self.registry.find(name)
        if model is None:
            raise InvalidRequest(f"model '{name}' not found")
        autoload = _autoload(scope, bool(self.settings.models_autoload))
        session = conversation_header(scope) if body is not None else ""
        ticket = self.owners.remember(session, model.name) if session else 0
        if model.status == "loaded" or body is None or session:
            # A resumable stream's request waits for its model whatever its client does: the
            # generation goes to the stream's buffer for a later resume (llama-server detaches it).
            app = await self.registry.acquire(model, autoload)
        else:
            app, receive = await self._acquire_unless_gone(model, autoload, receive)
            if app is None:
                return  # the client left while its model was waiting for a place: no one to answer
        if session and not self.owners.alive(session, ticket):
            del app
            self.registry.release(model)
            raise InvalidRequest("request cancelled by a stop while the model was loading")
        try:
            if self.fake_timing:  # after the model counts the request as busy, as llama-server sleeps
                await asyncio.sleep(FAKE_TIMING_SECONDS)
            # A scope of its own: Starlette records its app (and the route's endpoint) in the scope,
            # which the HTTP server keeps until the connection goes; the model's must not outlive
            # the request there, or an unloaded model's memory would wait for that connection.
            own = {**scope, "state": dict(scope.get("state") or {})}
            await app(own, _replay(body, receive) if body is not None else receive, send)
        finally:
            if isinstance(receive, PendingReceive):
                receive.close()
            del app, own
            self.registry.release(model)
            if model.app is None:  # unloaded while this request ran: its memory goes now, not at the next gc
                await asyncio.to_thread(release_memory)

    async def _acquire_unless_gone(self, model: RouterModel, autoload: bool, receive: Receive) -> tuple[Any, Receive]:
        """:meth:`ModelRegistry.acquire`, given up when the client disconnects first (its body is
        read, so the next message it can send is ``http.disconnect``). Returns the app (None if the
        client left) and the ``receive`` to hand on, which gives back a message read meanwhile."""
        acquiring = asyncio.ensure_future(self.registry.acquire(model, autoload))
        listening = asyncio.ensure_future(receive())
        try:
            await asyncio.wait({acquiring, listening}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            acquiring.cancel()
            listening.cancel()
            raise
        if not acquiring.done() and listening.result()["type"] == "http.disconnect":
            acquiring.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await acquiring
            return None, receive
        try:
            app = await acquiring  # a load's error reaches the client as before
        except BaseException:
            listening.cancel()
            raise
        return app, PendingReceive(listening, receive)

    async def _read_body(self, receive: Receive) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.body_limit:
                raise PayloadTooLarge(f"request body too large: more than {self.body_limit} bytes; the limit is "
                                      f"{self.body_limit} bytes (--max-body-bytes)")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)

    async def _body_model(self, body: bytes) -> str:
        """The body's ``model`` field ("" when there is none, or the body is not a JSON object)."""
        if not body:
            return ""
        if len(body) > INLINE_JSON_BYTES:
            data = await asyncio.to_thread(_loads, body)
        else:
            data = _loads(body)
        name = data.get("model") if isinstance(data, dict) else None
        return name if isinstance(name, str) else ""


def _loads(body: bytes) -> Any:
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return None


class PendingReceive:
    """A ``receive`` that first answers with the message ``pending`` brings (a ``receive()`` started
    while the model was awaited), then with the client's own; :meth:`close` ends ``pending`` if
    the model's app never asked."""

    def __init__(self, pending: asyncio.Future, receive: Receive) -> None:
        self.pending: asyncio.Future | None = pending
        self.receive = receive

    async def __call__(self) -> Any:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            return await pending
        return await self.receive()

    def close(self) -> None:
        if self.pending is not None:
            self.pending.cancel()


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the model's app the body the router already read, then waits on
    the client's (a disconnect still reaches a streaming response)."""
    sent = False

    async def replay() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


# --------------------------------------------------------------------------- the app


class RouterApp:
    """Routes each request: the router's own paths (and ``/props`` without ``?model=``) to its
    Starlette app, every other one through the same edge middleware to the :class:`Forwarder`."""

    def __init__(self, own: Starlette, forward: ASGIApp, prefix: str) -> None:
        self.own = own
        self.forward = forward
        self.prefix = prefix
        self.state = own.state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._is_own(scope):
            await self.own(scope, receive, send)
        else:
            await self.forward(scope, receive, send)

    def _is_own(self, scope: Scope) -> bool:
        path = scope["path"]
        if self.prefix and path.startswith(self.prefix):
            path = path[len(self.prefix):]
        if path in OWN_PATHS or path.startswith(api_web.PUBLIC_PREFIXES) or scope["method"] == "OPTIONS":
            return True
        return path in MODEL_OPTIONAL and scope["method"] == "GET" and not _query(scope).get("model")


def build_router(settings: Any, argv: list[str], api_keys: list[str]) -> RouterApp:
    """The router's app over the models of ``$LLAMA_CACHE``, ``--models-dir`` and ``--models-preset``."""
    models = build_models(settings, argv)
    if not models:
        log.warning("router: no models found in --models-dir / --models-preset")
    registry = ModelRegistry(models, api_keys, int(settings.models_max), int(settings.models_memory or 0),
                             float(settings.timeout), fake_timing=bool(os.environ.get(FAKE_TIMING_VARIABLE)))
    state = RouterState(settings, registry, Downloads(registry, settings.llama_cache, settings.hf_token,
                                                      lambda: reload_sources(state)), argv, api_keys)
    prefix = settings.api_prefix.rstrip("/") if settings.api_prefix else ""
    policy = CorsPolicy.from_settings(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        for model in models:
            if model.source.load_on_startup:
                registry.start_load(model)
        log.info("router: %d models (%s); --models-max %d, autoload %s", len(models),
                 ", ".join(m.name for m in models), registry.models_max, bool(settings.models_autoload))
        try:
            yield
        finally:
            await state.downloads.close()
            await registry.close()

    edge = [Middleware(ServerHeaderMiddleware), Middleware(CorsMiddleware, policy=policy),
            Middleware(GateMiddleware, ctx=state, prefix=prefix), Middleware(ErrorMiddleware, prefix=prefix)]
    own = Starlette(routes=[Mount(prefix, routes=ROUTES)] if prefix else ROUTES, middleware=edge, lifespan=lifespan,
                    exception_handlers={404: _not_found, 405: _not_found})
    own.state.ctx = state
    forward: ASGIApp = Forwarder(registry, settings, state.owners, prefix)
    forward = ErrorMiddleware(forward, prefix=prefix)
    forward = GateMiddleware(forward, ctx=state, prefix=prefix)  # type: ignore[arg-type]
    forward = CorsMiddleware(forward, policy=policy)
    forward = ServerHeaderMiddleware(forward)
    return RouterApp(own, forward, prefix)


async def _not_found(request: Any, exc: Exception) -> Any:
    from mlxcel_compat.server.errors import raw_error_response

    return raw_error_response(404, {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}})


__all__ = ["RouterApp", "RouterState", "build_router"]
