"""The chat page's companions: ``/tools`` (``--tools``, MCP servers) and ``/cors-proxy`` (``--ui-mcp-proxy``).

``/tools`` serves the built-in tools (``agent_tools.py``) and those of the MCP servers the
server runs (``mcp_client.py``), found at start-up. Both routes are off by default and then answer llama-server's 403 "this feature is disabled", which
clients look for (rather than a 404) to learn that a feature is off.

``POST /tools`` takes ``{"tool": NAME, "params": {...}, "stream": false}``. The headers
``X-Tool-Cwd`` (the directory paths resolve against), ``X-Tool-Runtime`` and ``X-Resp-Type``
(``base64`` for ``read_file``) replace any ``cwd``, ``runtime`` or ``resp_type`` in ``params``:
the model writes ``params``, the page writes the headers. Errors are llama-server's: a body or
parameter it cannot read is a 400 and a tool that fails a 500, both with the bare
``{"code", "message", "type"}`` object (no ``error`` wrapper, as llama-server sends it); an
unknown tool is the plain 404. A browser request from an origin CORS does not allow is refused (403), which llama-server does not do (see ``foreign_origin``). ``stream: true`` (``exec_shell_command`` only) answers SSE
events ``{"chunk": TEXT}`` as output arrives, then ``{"done": true}`` (with ``error`` when the
call failed). A client that goes away stops the command. Tools run on threads of their own, not
on the request worker pool: a shell command may take a minute.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from mlxcel_compat.server import agent_params, cors_proxy
from mlxcel_compat.server.agent_params import ParamError
from mlxcel_compat.server.agent_tools import Tool
from mlxcel_compat.server.errors import json_response, raw_error_response
from mlxcel_compat.server.formats import sse
from mlxcel_compat.server.openapi import Operation
from mlxcel_compat.server.pipeline import SSE_HEADERS, ctx_of
from mlxcel_compat.settings import mcp_proxy_enabled

_DISABLED = {"error": {"message": "this feature is disabled", "type": "feature_disabled"}}
_NOT_FOUND = {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}


def feature_disabled() -> Response:
    return raw_error_response(403, _DISABLED)


def _enabled(request: Request) -> tuple[Tool, ...] | None:
    """The tools ``/tools`` serves (built-in and MCP), or None when the route is off."""
    state = request.app.state
    return state.agent_tools if getattr(state, "tools_enabled", False) else None


def foreign_origin(request: Request) -> str | None:
    """The request's ``Origin`` when the CORS policy does not allow it.

    CORS only keeps a page from reading answers; a page on any site can still send a simple POST
    here. A browser names the page's origin on such a request, so refusing the origins CORS would
    not allow keeps other sites from running tools or using the proxy (llama-server has no such
    check). The server's own name is not trusted as such: a DNS-rebinding page has it too. With
    tools on the origins default to ``localhost``, so the chat page works when opened at
    localhost, 127.0.0.1 or [::1]; reached by another name, that name goes in ``--cors-origins``.
    Clients that are not browsers send no Origin and are unaffected."""
    origin = request.headers.get("origin")
    if not origin or request.app.state.cors_policy.allow_origin(origin) is not None:
        return None
    return origin


def _refuse_origin(origin: str) -> Response:
    return raw_error_response(403, {"error": {"code": 403, "message": f"origin not allowed: {origin}", "type": "permission_error"}})


def _bare_error(status: int, message: str) -> Response:
    kind = "invalid_request_error" if status == 400 else "server_error"
    return json_response({"code": status, "message": message, "type": kind}, status_code=status)


def check_runtime(spec: str) -> None:
    """``X-Tool-Runtime``: refused with llama-server's message for a malformed spec, and because
    only the host runtime exists here for a well-formed one."""
    kind, _, arg = spec.partition(":")
    if kind in ("docker", "podman"):
        raise RuntimeError("tool runtime must name a running container: " + spec)
    if kind in ("docker-container", "podman-container"):
        if not arg or not arg[0].isalnum() or not all(c.isalnum() or c in "._-" for c in arg):
            raise RuntimeError("invalid container id: " + arg)
    elif kind == "ssh":
        if not arg or arg[0] == "-" or not all(c.isalnum() or c in ".-_@" for c in arg):
            raise RuntimeError("invalid ssh target: " + arg)
    else:
        raise RuntimeError("unknown tool runtime: " + spec)
    raise RuntimeError(f"tool runtime {spec}: only the host runtime is supported by mlxcel_compat")


def _invoke(tool: Tool, params: dict[str, Any], stream: agent_params.Chunk | None) -> Any:
    if params.get("runtime"):
        check_runtime(params["runtime"])
    return tool.invoke(params, stream)


def _parse_call(raw: bytes, headers: Any) -> tuple[str, dict[str, Any], bool]:
    """``(tool name, params with the header values, stream)``; raises ``ParamError``."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ParamError(f"[json.exception.parse_error.101] parse error: {exc}") from None
    if not isinstance(body, dict):
        raise ParamError(f"[json.exception.type_error.304] cannot use at() with {agent_params.type_name(body)}")
    name = agent_params.required(body, "tool", str)
    params = body.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise ParamError(f"[json.exception.type_error.305] cannot use operator[] with a string argument with "
                         f"{agent_params.type_name(params)}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ParamError(f"[json.exception.type_error.302] type must be boolean, but is {agent_params.type_name(stream)}")
    for key, header in (("cwd", "x-tool-cwd"), ("runtime", "x-tool-runtime"), ("resp_type", "x-resp-type")):
        params.pop(key, None)
        if headers.get(header):
            params[key] = headers[header]
    return name, params, stream


async def tools_get(request: Request) -> Response:
    tools = _enabled(request)
    if tools is None:
        return feature_disabled()
    return json_response([t.to_json() for t in tools])


async def tools_post(request: Request) -> Response:
    tools = _enabled(request)
    if tools is None:
        return feature_disabled()
    if (origin := foreign_origin(request)) is not None:
        return _refuse_origin(origin)
    try:
        name, params, stream = _parse_call(await request.body(), request.headers)
    except ParamError as exc:
        return _bare_error(400, str(exc))
    tool = next((t for t in tools if t.name == name), None)
    if tool is None or (stream and not tool.support_stream):
        return raw_error_response(404, _NOT_FOUND)  # llama-server's 404 body replaces the tool's message
    if stream:
        return StreamingResponse(_stream(tool, params), media_type="text/event-stream", headers=SSE_HEADERS)
    try:
        result = await asyncio.to_thread(_invoke, tool, params, None)
    except ParamError as exc:
        return _bare_error(400, str(exc))
    except Exception as exc:  # a tool that fails is a 500, never a crash
        return _bare_error(500, str(exc) or type(exc).__name__)
    return json_response(result)


async def _stream(tool: Tool, params: dict[str, Any]) -> AsyncIterator[bytes]:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    gone = threading.Event()

    def push(chunk: str) -> bool:
        if chunk:
            loop.call_soon_threadsafe(queue.put_nowait, {"chunk": chunk})
        return not gone.is_set()

    def run() -> None:
        done: dict[str, Any] = {"done": True}
        try:
            _invoke(tool, params, push)
        except Exception as exc:
            done["error"] = str(exc) or type(exc).__name__
        loop.call_soon_threadsafe(queue.put_nowait, done)

    worker = threading.Thread(target=run, name="tool-" + tool.name, daemon=True)
    worker.start()
    try:
        while True:
            event = await queue.get()
            yield sse(event)
            if event.get("done"):
                return
    finally:
        gone.set()  # the client went away (or the stream ended): the command is stopped


async def cors_proxy_route(request: Request) -> Response:
    if not mcp_proxy_enabled(ctx_of(request).settings):
        return feature_disabled()
    if (origin := foreign_origin(request)) is not None:
        return _refuse_origin(origin)
    return await cors_proxy.proxy(request)


TOOLS_OK = {"type": "array", "items": {"type": "object"}}
URL_PARAM = {"url": {"type": "string"}}
OPERATIONS = {
    ("GET", "/tools"): Operation("The built-in agent tools (--tools) and MCP servers' tools: names, JSON schemas, permissions; 403 when off",
                                 ok=TOOLS_OK, errors=(403,)),
    ("POST", "/tools"): Operation("Run one built-in or MCP tool (stream: true answers SSE); 403 when neither --tools nor MCP servers are on",
                                  body=(), media=("application/json", "text/event-stream"), errors=(400, 403, 404)),
    ("GET", "/cors-proxy"): Operation("Forward a GET to ?url= with the X-Llama-Server-Proxy-Header-* headers "
                                      "(--ui-mcp-proxy; 403 when off)", media=("*/*",), errors=(400, 403), query=URL_PARAM),
    ("POST", "/cors-proxy"): Operation("Forward a POST to ?url= with the X-Llama-Server-Proxy-Header-* headers "
                                       "(--ui-mcp-proxy; 403 when off)", media=("*/*",), errors=(400, 403), query=URL_PARAM),
}

ROUTES = [
    Route("/tools", tools_get, methods=["GET"]),
    Route("/tools", tools_post, methods=["POST"]),
    Route("/cors-proxy", cors_proxy_route, methods=["GET", "POST"]),
]
