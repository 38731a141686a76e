"""The OpenAPI 3.1 document at ``/openapi.json``, generated from what the server actually serves.

Paths and methods come from the application's routes, request bodies from the request-field
table (``request_fields.py``, also the source of the compatibility manifest) with this server's
limits filled in, and each route's response from the :class:`Operation` its API module declares
next to its handler. A route without an operation, or an operation without a route, is a test
failure (tests/server/test_openapi.py), so the document cannot drift from the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route

from mlxcel_compat import __version__
from mlxcel_compat.request_fields import REQUEST_FIELDS, RequestField, bounds, resolve
from mlxcel_compat.server.errors import json_response

JSON = "application/json"
SSE = "text/event-stream"
TEXT = "text/plain"

ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {"code": {"type": "integer"}, "message": {"type": "string"}, "type": {"type": "string"}},
            "required": ["message", "type"],  # llama-server's 403 "feature_disabled" body has no code
        }
    },
    "required": ["error"],
}
ERROR_REF = {"$ref": "#/components/schemas/Error"}
# Anthropic's error body, which the /v1/messages routes answer with (api_anthropic.ERROR_SHAPES).
ANTHROPIC_ERROR_SCHEMA = {
    "type": "object",
    "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "properties": {"type": {"type": "string"}, "message": {"type": "string"}}, "required": ["type", "message"]},
    },
    "required": ["type", "error"],
}
ANTHROPIC_ERROR_REF = {"$ref": "#/components/schemas/AnthropicError"}
# OpenAPI 3.1 reads the schema of text/event-stream as the schema of one event. Each data line is
# a JSON chunk of the route's stream (or "[DONE]" on the OpenAI routes, or a final error object).
SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string", "contentMediaType": "application/json"}, "event": {"type": "string"}, "id": {"type": "string"}},
    "required": ["data"],
}
STATUS_TEXT = {
    400: "invalid request (a field is named in the message)",
    401: "missing or invalid API key",
    403: "the feature is disabled on this server",
    404: "not found",
    413: "request body larger than --max-body-bytes",
    500: "the engine failed while running this request",
    501: "a feature this server does not support was asked for",
    503: "the model is loading, or the server is shutting down",
}


@dataclass(frozen=True)
class Operation:
    """What a route's documentation needs besides its path and method."""

    summary: str
    body: tuple[str, ...] | None = None  # request-field scopes the JSON body is read with; None: no body
    ok: Mapping[str, Any] | None = None  # JSON Schema of a JSON 200 body
    media: tuple[str, ...] = (JSON,)  # media types a 200 may have
    errors: tuple[int, ...] = ()  # statuses besides those every route can give
    query: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # query parameters and their schemas
    path: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)  # path parameters and their schemas
    error: Mapping[str, Any] = field(default_factory=lambda: ERROR_REF)  # schema of its error bodies
    ok_status: int = 200  # the success status (204: no body)


def served_routes(routes: Iterable[Any], prefix: str = "") -> list[tuple[str, str]]:
    """``(method, path)`` of every served route (HEAD left out), mounts flattened."""
    out = []
    for route in routes:
        if isinstance(route, Mount):
            out += served_routes(route.routes, prefix + route.path)
        elif isinstance(route, Route):
            out += [(method, prefix + route.path) for method in sorted(route.methods or ()) if method != "HEAD"]
    return out


def body_schema(scopes: tuple[str, ...], values: Mapping[str, int], fields: Iterable[RequestField] = REQUEST_FIELDS) -> dict[str, Any]:
    """The JSON body a route reads: the fields of ``scopes`` (later scopes win a shared name) and
    their aliases; ``null`` means absent everywhere; unknown fields are ignored, as llama-server does."""
    properties: dict[str, Any] = {}
    required: list[str] = []
    members: dict[str, dict[str, Any]] = {}
    for scope in scopes:
        for f in fields:
            if f.scope != scope or "[" in f.field:
                continue  # content-part types are described inside their field's schema
            schema = dict(resolve(f.schema, values))
            description = f.note or f.status
            if "." in f.field:
                parent, member = f.field.split(".", 1)
                members.setdefault(parent, {})[member] = schema
                continue
            for name in (f.field, *f.aliases):
                entry = {**schema, "description": description if name == f.field else f"alias of {f.field}"}
                properties[name] = entry if f.required else {"anyOf": [entry, {"type": "null"}]}
            if f.required:
                required.append(f.field)
    for parent, inner in members.items():
        properties[parent] = {"anyOf": [{"type": "object", "properties": inner}, {"type": "null"}]}
    out: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        out["required"] = required
    return out


def _response(description: str, content: Mapping[str, Any]) -> dict[str, Any]:
    return {"description": description, "content": dict(content)}


def build_document(
    routes: Iterable[Any], operations: Mapping[tuple[str, str], Operation], ctx: Any, public: Iterable[str] = ()
) -> dict[str, Any]:
    """The whole document for this server (its settings and model give the limits); ``public``:
    the paths that need no API key."""
    settings = ctx.settings
    values = bounds(settings, len(ctx.engine.slots), ctx.model.vocab_size)
    prefix = settings.api_prefix.rstrip("/") if settings.api_prefix else ""
    public = set(public)
    paths: dict[str, Any] = {}
    for method, path in served_routes(routes):
        local = path[len(prefix) :] if prefix and path.startswith(prefix) else path
        op = operations[(method, local)]
        statuses = {503, *op.errors}
        if op.body is not None:
            statuses |= {400, 413}
        if ctx.api_keys and local not in public:
            statuses.add(401)
        ok_content = {}
        for media in op.media:
            if media == JSON:
                ok_content[media] = {"schema": dict(op.ok or {})}
            else:
                ok_content[media] = {"schema": SSE_EVENT if media == SSE else {"type": "string"}}
        responses: dict[str, Any] = {str(op.ok_status): _response("success", ok_content)}
        for status in sorted(statuses):
            responses[str(status)] = _response(STATUS_TEXT[status], {JSON: {"schema": dict(op.error)}})
        entry: dict[str, Any] = {
            "operationId": f"{method.lower()}_{local.strip('/').replace('/', '_').replace('-', '_').replace('.', '_')}",
            "summary": op.summary,
            "responses": responses,
        }
        if op.body is not None:
            entry["requestBody"] = {"required": False, "content": {JSON: {"schema": body_schema(op.body, values)}}}
        parameters = [{"name": name, "in": "path", "required": True, "schema": dict(schema)} for name, schema in op.path.items()]
        parameters += [{"name": name, "in": "query", "required": False, "schema": dict(schema)} for name, schema in op.query.items()]
        if parameters:
            entry["parameters"] = parameters
        if 401 in statuses:
            entry["security"] = [{"apiKey": []}]
        paths.setdefault(path, {})[method.lower()] = entry
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "mlxcel_compat",
            "version": __version__,
            "description": "llama-server's HTTP API as this server serves it: the routes, the request fields with "
            "this server's limits, and the response shapes. Unknown request fields are ignored; null means absent.",
        },
        "paths": paths,
        "components": {"schemas": {"Error": ERROR_SCHEMA, "AnthropicError": ANTHROPIC_ERROR_SCHEMA}},
    }
    if ctx.api_keys:
        doc["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
    return doc


async def openapi(request: Request) -> Response:
    app = request.app
    return json_response(build_document(app.routes, app.state.operations, app.state.ctx, app.state.public_paths))


ROUTES = [Route("/openapi.json", openapi, methods=["GET"])]
OPERATIONS = {("GET", "/openapi.json"): Operation("This OpenAPI 3.1 document", ok={"type": "object", "required": ["openapi", "paths"]})}
