"""Vertex AI prediction (``AIP_MODE=PREDICTION``): ``POST /predict`` runs several API requests at once.

Google's custom-container contract, as llama-server implements it: the body is
``{"instances": [...]}`` (at most 128); each instance names the route it is for in
``@requestFormat``, either as a path (``/v1/chat/completions``) or in camelCase without the
``/v1`` prefix (``chatCompletions``, ``completion``, ``applyTemplate``). The rest of the instance is
that route's body. Instances run concurrently and never stream; the answer is
``{"predictions": [...]}`` holding each route's JSON, or ``{"error": {...}}`` for an instance that
failed. ``AIP_PREDICT_ROUTE`` renames the route, ``AIP_HEALTH_ROUTE`` adds a health route and
``AIP_HTTP_PORT`` is the port to listen on (see ``cli.py``).
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from typing import Any, Mapping

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxcel_compat.server.errors import ApiError, InvalidRequest, ServerError, json_response
from mlxcel_compat.server.openapi import Operation
from mlxcel_compat.server.pipeline import read_json

MAX_INSTANCES = 128


@dataclass(frozen=True)
class VertexConfig:
    """The ``AIP_*`` variables Vertex AI sets for a custom container."""

    enabled: bool
    predict_route: str = "/predict"
    health_route: str = ""
    port: int = 8080

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "VertexConfig":
        env = os.environ if environ is None else environ

        def route(name: str, default: str) -> str:
            value = env.get(name) or default
            return value if not value or value.startswith("/") else "/" + value

        return cls(
            enabled=env.get("AIP_MODE") == "PREDICTION",
            predict_route=route("AIP_PREDICT_ROUTE", "/predict"),
            health_route=route("AIP_HEALTH_ROUTE", ""),
            port=int(env.get("AIP_HTTP_PORT") or 8080),
        )


def request_format_alias(path: str) -> str:
    """``/v1/chat/completions`` -> ``chatCompletions``; ``/apply-template`` -> ``applyTemplate``."""
    if path.startswith("/v1"):
        path = path[3:]
    out: list[str] = []
    upper = False
    for ch in path.lstrip("/"):
        if ch in "/-_":
            upper = True
        else:
            out.append(ch.upper() if upper else ch)
            upper = False
    return "".join(out)


def _route_table(routes: list[Route]) -> dict[str, str]:
    """``@requestFormat`` value (alias or path) -> path; the first registration wins."""
    table: dict[str, str] = {}
    for route in routes:
        table.setdefault(request_format_alias(route.path), route.path)
    for route in routes:
        table.setdefault(route.path, route.path)
    return table


def _error(exc: ApiError) -> dict[str, Any]:
    return exc.to_json()


async def _dispatch(request: Request, path: str, methods: set[str], payload: dict[str, Any]) -> Any:
    """Run one route of this app in-process (no middleware: the outer request passed them)."""
    body = orjson.dumps(payload)
    method = "POST" if "POST" in methods else "GET"
    headers = [(k, v) for k, v in request.scope["headers"] if k.lower() not in (b"content-length", b"transfer-encoding")]
    full_path = request.scope.get("root_path", "") + path  # under --api-prefix the routes are mounted
    scope = {**request.scope, "method": method, "path": full_path, "raw_path": full_path.encode(), "root_path": "",
             "query_string": b"", "headers": headers + [(b"content-length", str(len(body)).encode())]}
    sent = False
    status = 200
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client never disconnects from an internal call
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    try:
        await request.app.router(scope, receive, send)
    except ApiError as exc:
        return _error(exc)
    data = b"".join(chunks)
    if not data:
        return None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return data.decode("utf-8", "replace") if status < 400 else _error(ServerError(data.decode("utf-8", "replace")))


async def _predict_one(request: Request, table: dict[str, str], methods: dict[str, set[str]], instance: Any) -> Any:
    if not isinstance(instance, dict):
        return _error(InvalidRequest("each instance must be a JSON object"))
    fmt_name = instance.get("@requestFormat")
    if not isinstance(fmt_name, str):
        return _error(InvalidRequest("each instance must include a string @requestFormat"))
    path = table.get(fmt_name)
    if path is None:
        return _error(InvalidRequest(f"no handler registered for @requestFormat: {fmt_name}"))
    payload = {k: v for k, v in instance.items() if k != "@requestFormat"}
    if "stream" in payload:
        payload["stream"] = False  # the predict route never streams
    try:
        return await _dispatch(request, path, methods[path], payload)
    except Exception as exc:  # one failed instance never fails the others
        return _error(ServerError(str(exc) or type(exc).__name__))


def make_routes(config: VertexConfig, api_routes: list[Route], health: Any) -> list[Route]:
    """The prediction route (and the optional health route) over ``api_routes``."""
    if not config.enabled:
        return []
    if config.predict_route in {r.path for r in api_routes}:
        raise ValueError(f"AIP_PREDICT_ROUTE={config.predict_route} conflicts with an existing route")
    table = _route_table(api_routes)
    methods: dict[str, set[str]] = {}
    for route in api_routes:
        methods.setdefault(route.path, set()).update(route.methods or ())

    async def predict(request: Request) -> Response:
        data = await read_json(request)
        instances = data.get("instances")
        if not isinstance(instances, list):
            raise InvalidRequest("request body must include an array field named instances")
        if len(instances) > MAX_INSTANCES:
            raise InvalidRequest(f"instances array exceeds maximum size of {MAX_INSTANCES}")
        predictions = await asyncio.gather(*(_predict_one(request, table, methods, i) for i in instances))
        return json_response({"predictions": list(predictions)})

    routes = [Route(config.predict_route, predict, methods=["POST"])]
    if config.health_route:
        routes.append(Route(config.health_route, health, methods=["GET"]))
    return routes


def operations(config: VertexConfig) -> dict[tuple[str, str], Operation]:
    """The documentation of the routes ``make_routes`` serves under ``config``."""
    if not config.enabled:
        return {}
    ops = {
        ("POST", config.predict_route): Operation(
            "Vertex AI prediction: up to 128 API requests (instances) at once, never streamed",
            body=("vertex",),
            ok={"type": "object", "properties": {"predictions": {"type": "array"}}, "required": ["predictions"]},
            errors=(500, 501),
        )
    }
    if config.health_route:
        ops[("GET", config.health_route)] = Operation(
            "Liveness (AIP_HEALTH_ROUTE)", ok={"type": "object", "properties": {"status": {"const": "ok"}}, "required": ["status"]}
        )
    return ops
