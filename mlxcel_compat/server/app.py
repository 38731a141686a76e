"""The Starlette application: middleware stack, routes and start-up.

Middleware, outermost first: the ``Server`` header, CORS (``server/cors.py``), the "Loading model" gate
(every path answers 503 until the model is loaded, before any key check, as llama-server does,
and again once a shutdown has begun), the API-key check (``Authorization: Bearer`` or
``x-api-key``), the error renderer that turns any exception into llama.cpp error JSON, or into the
shape an API module declares for its paths (``ERROR_SHAPES``: the Anthropic routes answer
``{"type": "error", "error": {...}}``), and the body and write limits (``--max-body-bytes``, the
write half of ``--timeout``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import Mount, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from mlxcel_compat.cache.key import api_key_id
from mlxcel_compat.engine.core import Engine
from mlxcel_compat.server import (
    api_anthropic,
    api_cache,
    api_control,
    api_embeddings,
    api_lora,
    api_native,
    api_openai,
    api_rerank,
    api_responses,
    api_router,
    api_slots,
    api_status,
    api_streams,
    api_vertex,
    api_tools,
    api_web,
    openapi,
)
from mlxcel_compat.server.api_vertex import VertexConfig
from mlxcel_compat.server.cache_hooks import CacheHooks
from mlxcel_compat.server.context import ModelInfo, ServerContext
from mlxcel_compat.server.cors import CorsMiddleware, CorsPolicy
from mlxcel_compat.server.errors import ApiError, AuthenticationError, ErrorShape, PayloadTooLarge, ServerError, Unavailable, error_response, raw_error_response
from mlxcel_compat.server.prompts import max_chars_per_token
from mlxcel_compat.server.static_files import StaticDirectoryMiddleware, static_is_public
from mlxcel_compat.server import agent_tools
from mlxcel_compat.server.mcp_client import McpManager, load_configs
from mlxcel_compat.server.structured import StructuredOutput, server_default
from mlxcel_compat.settings import mcp_proxy_enabled, server_tools

log = logging.getLogger(__name__)

# /get_load is public like /health: routers poll it without the client's API key. /models and
# /v1/models need the key, as in llama-server b11312 (its public endpoints are /health, /v1/health
# and the chat page's files).
PUBLIC_PATHS = {"/health", "/v1/health", "/get_load", "/", "/index.html"}


# llama-server's routes that read its model or vocabulary outside a generation: each wakes a
# sleeping server (--sleep-idle-seconds) before it answers, as llama-server's do. Generations and
# embeddings wake the engine themselves; /health, /metrics, GET /props and /models never wake it.
WAKING_PATHS = {"/tokenize", "/detokenize", "/apply-template", "/chat/completions/input_tokens",
                "/v1/chat/completions/input_tokens", "/responses/input_tokens", "/v1/responses/input_tokens",
                "/v1/messages/count_tokens", "/lora-adapters", "/slots"}


def wakes_model(method: str, path: str) -> bool:
    return path in WAKING_PATHS or path.startswith("/slots/") or (method == "POST" and path == "/props")


def _nothing() -> None:
    return None


def is_public(path: str) -> bool:
    """Paths that never need the API key: health, the model list and the chat page's files."""
    return path in PUBLIC_PATHS or path.startswith(api_web.PUBLIC_PREFIXES)


API_MODULES = (api_status, api_router, api_native, api_openai, api_embeddings, api_rerank, api_anthropic, api_responses, api_cache, api_slots, api_lora, api_web, api_tools, api_streams, api_control, openapi)
ERROR_SHAPES: dict[str, ErrorShape] = {path: shape for m in API_MODULES for path, shape in getattr(m, "ERROR_SHAPES", {}).items()}


def _route_path(scope: Scope, prefix: str) -> str:
    path = scope["path"]
    return path[len(prefix) :] if prefix and path.startswith(prefix) else path


class ServerHeaderMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = list(message["headers"]) + [(b"Server", b"llama.cpp")]
            await send(message)

        await self.app(scope, receive, send_with_header)


class GateMiddleware:
    """503 while loading and while shutting down, then the API key check (public paths and OPTIONS
    are exempt from the key). The key that matched is recorded, as a digest, in the request's
    ``state.api_key_id``: the prompt cache keeps tenants apart by it (``--prompt-cache-isolation``)."""

    def __init__(self, app: ASGIApp, ctx: ServerContext, prefix: str = "") -> None:
        self.app = app
        self.ctx = ctx
        self.prefix = prefix
        self.key_ids = {key: api_key_id(key) for key in ctx.api_keys}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        path = _route_path(scope, self.prefix)
        shape = ERROR_SHAPES.get(path)
        if not self.ctx.ready or self.ctx.draining:
            if self.ctx.draining:
                message = "Server is shutting down"
            elif self.ctx.engine.state == "failed":
                message = f"Model failed to load: {self.ctx.engine.load_error}"
            else:
                message = "Loading model"
            await error_response(Unavailable(message), shape)(scope, receive, send)
            return
        if self.ctx.api_keys:
            key = self._matching_key(scope)
            if key is not None:
                scope.setdefault("state", {})["api_key_id"] = self.key_ids[key]
            elif not is_public(path) or (self.ctx.settings.static_path and not static_is_public(path)):
                if shape is not None:
                    await error_response(AuthenticationError("Invalid API Key"), shape)(scope, receive, send)
                    return
                body = {"error": {"message": "Invalid API Key", "type": "authentication_error", "code": 401}}
                await raw_error_response(401, body)(scope, receive, send)
                return
        engine = getattr(self.ctx, "engine", None)  # the router's own routes have no engine of their own
        if engine is not None and engine.sleeping and wakes_model(scope["method"], path):
            await asyncio.wrap_future(engine.call(_nothing, wake=True))
        await self.app(scope, receive, send)

    def _matching_key(self, scope: Scope) -> str | None:
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"").decode("latin-1").strip()
        if not given:
            given = headers.get(b"x-api-key", b"").decode("latin-1").strip()
        if given.startswith("Bearer "):
            given = given[len("Bearer ") :].strip()
        # Compare against every key so timing does not reveal which one (or whether any) matched.
        matches = [hmac.compare_digest(given.encode(), key.encode()) for key in self.ctx.api_keys]
        return self.ctx.api_keys[matches.index(True)] if any(matches) else None


class _WriteTimeout(Exception):
    """The client did not take a response chunk within ``--timeout`` seconds."""


# Lingering close after an early 413: how much of the rest of an over-limit body is read and
# dropped before the connection closes (at most this many seconds, and this many bytes or this
# many times the limit, whichever is more). Beyond that the connection is cut.
DRAIN_SECONDS = 10.0
DRAIN_MIN_BYTES = 128 << 20
DRAIN_LIMIT_FACTOR = 8


def drain_bound(limit: int) -> int:
    """The most body bytes a refused request may send before its connection is cut."""
    return max(DRAIN_MIN_BYTES, DRAIN_LIMIT_FACTOR * limit)


async def drain_body(receive: Receive, received: int, bound: int, seconds: float = DRAIN_SECONDS) -> bool:
    """Read and drop the rest of a request body (nothing is parsed or kept).

    ``received``: body bytes already read. True once the client has sent all of it, False when
    it sent more than ``bound`` bytes in all, took longer than ``seconds`` or went away.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while True:
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            return False
        if message["type"] != "http.request":
            return False  # http.disconnect
        received += len(message.get("body", b""))
        if received > bound:
            return False
        if not message.get("more_body", False):
            return True


# An answer that goes out before its request's body has all arrived (an early refusal: a 403 on
# the Origin, a 401, a 501 without a flag) first reads and drops the rest of a body up to this
# size, so the connection can serve the client's next request; a longer body gets
# ``Connection: close``.
EARLY_DRAIN_BYTES = 1 << 20


class EarlyAnswerMiddleware:
    """Keep a connection usable after an answer sent before the request's body was read.

    Why: hypercorn closes a connection whose request body was not all received when the answer
    ended, without saying so in the answer. A client that reuses its connections (httpx, the
    openai SDK, requests) then sends its next request into a closed socket and reports "server
    disconnected without sending a response", depending on whether the body's bytes had arrived
    in time. So, before the answer starts: a small declared body is read and dropped first (at
    most ``EARLY_DRAIN_BYTES``, ``DRAIN_SECONDS``); any other unread body gets ``Connection: close``.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length", b"").strip()
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        body_done = not chunked and declared in (b"", b"0")
        received = 0

        async def tracked_receive() -> Any:
            nonlocal body_done, received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                body_done = body_done or not message.get("more_body", False)
            elif message["type"] == "http.disconnect":
                body_done = True  # nothing more will come, nor will the connection be reused
            return message

        async def answer(message: Any) -> None:
            nonlocal body_done
            closing = any(k.lower() == b"connection" and v.lower() == b"close" for k, v in message.get("headers", ()))
            if message["type"] == "http.response.start" and not body_done and not closing:  # (a 413 closes itself)
                if not chunked and declared.isdigit() and int(declared) <= EARLY_DRAIN_BYTES:
                    body_done = await drain_body(tracked_receive, received, EARLY_DRAIN_BYTES)
                if not body_done:
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, tracked_receive, answer)


class LimitsMiddleware:
    """``--max-body-bytes`` while the body streams in, and ``--timeout`` for each write.

    A body whose ``Content-Length`` is over the cap is refused before any of it is read; a body
    without one is counted as it arrives and refused (413, llama.cpp's error shape) as soon as it
    passes the cap. The connection is closed after the answer, so the unread rest never reaches
    a next request, but not at once: as nginx's lingering close, the 413 goes out first and the
    rest of the body is read and dropped (up to :func:`drain_bound` bytes and ``DRAIN_SECONDS``),
    because httpx, requests and the openai SDK write the whole body before they read anything:
    closed on them mid-body, they report a broken pipe instead of the 413. A longer body is cut
    as soon as it is refused. A client that stops reading a response (a full socket buffer for
    ``--timeout`` seconds) loses its connection, which cancels its generation.
    """

    def __init__(self, app: ASGIApp, ctx: ServerContext, write_timeout: float, prefix: str = "") -> None:
        self.app = app
        self.ctx = ctx
        self.prefix = prefix
        self.write_timeout = write_timeout if write_timeout > 0 else None

    def too_large(self, size: int, limit: int, exact: bool) -> PayloadTooLarge:
        size_text = f"{size} bytes" if exact else f"more than {limit} bytes"
        return PayloadTooLarge(f"request body too large: {size_text}; the limit is {limit} bytes (--max-body-bytes)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.ctx.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            drain = int(declared) <= drain_bound(limit)
            await self._refuse(self.too_large(int(declared), limit, exact=True), scope, receive, send, drain=drain)
            return
        received = 0
        started = False

        async def limited_receive() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise self.too_large(received, limit, exact=False)
            return message

        async def timed_send(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            try:
                await asyncio.wait_for(send(message), self.write_timeout)
            except asyncio.TimeoutError:
                raise _WriteTimeout() from None

        try:
            await self.app(scope, limited_receive, timed_send)
        except PayloadTooLarge as exc:
            if started:
                raise
            await self._refuse(exc, scope, receive, send, drain=True, received=received)
        except _WriteTimeout:
            log.info("closing a connection on %s: the client took no data for %s s (--timeout)", scope.get("path"), self.write_timeout)

    async def _refuse(self, exc: PayloadTooLarge, scope: Scope, receive: Receive, send: Send, drain: bool, received: int = 0) -> None:
        """The 413; with ``drain``, the connection stays open while the rest of the body is dropped."""
        response = error_response(exc, ERROR_SHAPES.get(_route_path(scope, self.prefix)))
        response.headers["connection"] = "close"  # the unread rest of the body must not become a request
        if not drain:
            await response(scope, receive, send)
            return
        # The whole answer goes out now (its Content-Length tells the client where it ends); the
        # response is finished, and the connection closed, once the body is drained.
        await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": True})
        if not await drain_body(receive, received, drain_bound(self.ctx.max_body_bytes)):
            log.info("closing a connection on %s: its refused body went past the drain bound", scope.get("path"))
        await send({"type": "http.response.body", "body": b"", "more_body": False})


class ErrorMiddleware:
    """Render :class:`ApiError` (and anything unexpected, as a 500) as llama.cpp error JSON."""

    def __init__(self, app: ASGIApp, prefix: str = "") -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False
        shape = ERROR_SHAPES.get(_route_path(scope, self.prefix))

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except ApiError as exc:
            if started:
                raise
            await error_response(exc, shape)(scope, receive, send)
        except Exception as exc:
            log.exception("unhandled error on %s", scope.get("path"))
            if started:
                raise
            await error_response(ServerError(f"internal error: {type(exc).__name__}: {exc}"), shape)(scope, receive, send)


async def not_found(request: Any, exc: Exception) -> Any:
    return raw_error_response(404, {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}})




def routes(vertex: VertexConfig | None = None) -> list[Route]:
    api = [route for module in API_MODULES for route in module.ROUTES]
    return api + api_vertex.make_routes(vertex or VertexConfig(enabled=False), api, api_status.health)


def operations(vertex: VertexConfig | None = None) -> dict[tuple[str, str], openapi.Operation]:
    """Each route's documentation, declared by its module next to its handler (``/openapi.json``)."""
    ops = {key: op for module in API_MODULES for key, op in module.OPERATIONS.items()}
    ops.update(api_vertex.operations(vertex or VertexConfig(enabled=False)))
    return ops


def model_info(engine: Engine, settings: Any) -> ModelInfo:
    from mlxcel_compat.tokenizer.fim import FimTokens
    from mlxcel_compat.chat import builtin_templates
    from mlxcel_compat.chat.builtin_templates import BuiltinTemplate
    from mlxcel_compat.chat.template import ChatTemplate
    from mlxcel_compat.encoders.rerank import rank_head

    loaded = engine.loaded
    tok = loaded.tokenizer
    cfg = loaded.config
    text_cfg = cfg.get("text_config", {})
    plain = list(tok.encode("a", add_special_tokens=False))
    special = list(tok.encode("a", add_special_tokens=True))
    bos_id = special[0] if len(special) > len(plain) else None
    override = settings.chat_template
    if settings.chat_template_file:
        with open(settings.chat_template_file, encoding="utf-8") as f:
            override = f.read()
    if settings.jinja:
        template = ChatTemplate.from_tokenizer(tok, override=override)
    else:  # --no-jinja: llama.cpp's built-in format that matches the template (ChatML if none does)
        source = override or ChatTemplate.from_tokenizer(tok).source
        template = BuiltinTemplate(builtin_templates.detect(source) or "chatml", bos_token=tok.bos_token or "", eos_token=tok.eos_token or "")
    pooling = served_pooling(settings, loaded.path)
    return ModelInfo(
        model_id=loaded.model_id,
        aliases=loaded.aliases or [loaded.model_id],
        path=str(loaded.path),
        tokenizer=tok,
        vocab_size=int(cfg.get("vocab_size") or text_cfg.get("vocab_size")),
        n_ctx=engine.n_ctx,
        n_ctx_train=int(cfg.get("max_position_embeddings") or text_cfg.get("max_position_embeddings") or engine.n_ctx),
        n_embd=int(cfg.get("hidden_size") or text_cfg.get("hidden_size") or 0),
        n_params=loaded.n_params,
        size_bytes=loaded.size_bytes,
        eog_ids=sorted(tok.eos_token_ids or []),
        bos_id=bos_id,
        bos_token=tok.bos_token or "",
        eos_token=tok.eos_token or "",
        chat_template=template,
        tags=sorted(set(settings.tags or ())),
        file_type=loaded.file_type,
        format="gguf" if loaded.gguf is not None else "safetensors",
        chars_per_token=max_chars_per_token(tok),
        fim=getattr(loaded, "fim", None) or FimTokens(),
        pooling=pooling,
        rank_head=rank_head(loaded.path, tok) if pooling == "rank" else None,
        kind=getattr(loaded, "kind", "decoder"),
    )


def served_pooling(settings: Any, path: Any) -> str:
    """llama-server's choice: ``--rerank`` means rank, then ``--pooling``, then the model's type
    (read only when embeddings are served: a GGUF header is read again for it)."""
    if settings.rerank:
        return "rank"
    if settings.pooling:
        return str(settings.pooling)
    if not settings.embeddings:
        return "none"
    from mlxcel_compat.encoders.pooling import model_pooling

    return model_pooling(path)


def build_app(ctx: ServerContext, edge: bool = True) -> Starlette:
    """The app serving ``ctx``'s model. ``edge=False`` builds a model's app behind the router
    (``server/router.py``), which faces the clients itself: no ``Server`` header or CORS of its
    own (the router's apply), and no lifespan (the router starts and stops its engine)."""
    settings = ctx.settings

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if ctx.engine.state == "loading" and not ctx.engine.running:
            ctx.engine.start()
        waiter = asyncio.create_task(_wait_for_model(ctx))
        if mcp is not None:  # spawn each MCP server once to list its tools, as llama-server does at start-up
            await asyncio.to_thread(mcp.discover)
            app.state.agent_tools = builtin_tools + agent_tools.mcp_tools(mcp, builtin_tools)
        try:
            yield
        finally:
            if mcp is not None:
                await asyncio.to_thread(mcp.close)
            waiter.cancel()
            ctx.streams.close_all()  # resumable streams' generations stop, their readers end
            ctx.engine.stop()
            ctx.workers.close()

    warn_agent_features(settings)
    cors_policy = CorsPolicy.from_settings(settings)
    builtin_tools = agent_tools.select_tools(server_tools(settings))
    configs = load_configs(settings.mcp_servers_config, settings.mcp_servers_json)
    mcp = McpManager(configs) if configs else None
    if mcp is not None:  # a shutdown ends running tool calls at once (their sessions close)
        ctx.on_drain.append(mcp.close)
    prefix = settings.api_prefix.rstrip("/") if settings.api_prefix else ""
    vertex = VertexConfig.from_env()
    route_list: list[Any] = routes(vertex)
    if prefix:
        route_list = [Mount(prefix, routes=route_list)]
    outer = [Middleware(ServerHeaderMiddleware), Middleware(CorsMiddleware, policy=cors_policy)] if edge else []
    app = Starlette(
        routes=route_list,
        middleware=[
            Middleware(EarlyAnswerMiddleware),
            *outer,
            Middleware(GateMiddleware, ctx=ctx, prefix=prefix),
            Middleware(ErrorMiddleware, prefix=prefix),
            *([Middleware(StaticDirectoryMiddleware, root=settings.static_path, prefix=prefix)]
              if settings.static_path and settings.ui else []),
            Middleware(LimitsMiddleware, ctx=ctx, write_timeout=settings.timeout, prefix=prefix),
        ],
        exception_handlers={404: not_found, 405: not_found},
        lifespan=lifespan if edge else None,
    )
    app.state.ctx = ctx
    app.state.cors_policy = cors_policy
    app.state.agent_tools = builtin_tools  # plus the MCP servers' tools once discovered (lifespan)
    app.state.tools_enabled = bool(builtin_tools) or mcp is not None  # llama-server: /tools 403 otherwise
    app.state.operations = operations(vertex)
    app.state.public_paths = PUBLIC_PATHS | {path for _, path in openapi.served_routes(api_web.ROUTES) if is_public(path)}
    return app


def warn_agent_features(settings: Any) -> None:
    """llama-server's start-up warnings for the features that reach the host or the network."""
    features = []
    mcp = bool(settings.mcp_servers_config or settings.mcp_servers_json)
    if (server_tools(settings) or mcp) and not settings.is_set("cors_origins"):
        log.warning("server tools or MCP servers are enabled, using localhost as default CORS origin (change via --cors-origins)")
    if mcp_proxy_enabled(settings):
        features.append("MCP proxy (experimental)")
    if server_tools(settings):
        features.append("server tools (experimental)")
    if mcp:
        features.append("MCP servers (experimental)")
    if features:
        log.warning("security: %s enabled - do not expose to untrusted environments", ", ".join(features))


async def _wait_for_model(ctx: ServerContext) -> None:
    failure = await open_model(ctx)
    if failure is not None:
        # llama-server exits when the model cannot be loaded; ask our own process to stop.
        log.error("%s", failure)
        os.kill(os.getpid(), signal.SIGTERM)


async def open_model(ctx: ServerContext) -> str | None:
    """Wait for the engine to load (off the event loop), then fill in the model-derived parts of
    ``ctx``, which opens its gate. Returns why the model cannot be served, or None once it is
    ready. The router calls it for each model it loads (``server/router_registry.py``)."""
    while ctx.engine.state == "loading":
        await asyncio.sleep(0.05)
    if ctx.engine.state == "failed":
        return f"model failed to load: {ctx.engine.load_error}"
    if ctx.engine.state == "ready":
        model = await asyncio.to_thread(model_info, ctx.engine, ctx.settings)
        try:
            default = await asyncio.to_thread(server_default, ctx.settings, ctx.engine.grammars)
        except ValueError as exc:  # llama-server refuses a bad --grammar/--json-schema at start-up
            return str(exc)
        ctx.structured = StructuredOutput(ctx.engine.grammars, ctx.tokenize, default)
        cache = ctx.engine.prefix_cache
        ctx.cache_hooks = CacheHooks(
            enabled=cache is not None and cache.config.enabled,
            template=model.chat_template,
            tokenize=ctx.tokenize_rendered,
            boundary_snapshots=cache is not None and cache.boundary_snapshots,
            warmup=cache is not None and cache.warmups,
            isolation=ctx.cache_isolation,
            pins=cache is not None and cache.pins_enabled,
            pin_max_ttl=float(ctx.settings.prompt_cache_pin_max_ttl),
        )
        if ctx.engine.loaded.vision is not None:
            from mlxcel_compat.server.media import ImageInput, MediaLimits

            media = ImageInput(ctx.engine.loaded.vision, MediaLimits.from_settings(ctx.settings))
            # The image processor and the audio feature extractor, read before the gate opens.
            if media.facts.images:
                await asyncio.to_thread(media.processor)
            if media.facts.audio is not None:
                await asyncio.to_thread(media.extractor)
            ctx.media = media
        ctx.model = model  # last: this is what opens the gate
        log.info(
            "model '%s' ready: serving on %d slots, n_ctx %d, prompts prefilled in chunks of %d tokens",
            ctx.model.model_id, len(ctx.engine.slots), ctx.model.n_ctx, ctx.engine.config.batch_size,
        )
        log.info(
            "request limits: body %d bytes, prompts of more than %s characters refused before tokenizing, %d worker threads; prompt-cache isolation: %s",
            ctx.max_body_bytes,
            model.n_ctx * model.chars_per_token if model.chars_per_token else "(no proven bound)",
            ctx.workers.threads,
            ctx.cache_isolation,
        )
    return None


__all__ = ["build_app", "open_model"]
