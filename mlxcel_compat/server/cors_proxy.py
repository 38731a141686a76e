"""llama-server's MCP CORS proxy (``--ui-mcp-proxy``): ``GET|POST /cors-proxy?url=TARGET``.

A browser page cannot call an MCP server on another origin that sends no CORS headers; the
page asks this server to make the request instead. The rules are llama-server's (b11312,
``server-cors-proxy.h`` and ``server_http_proxy``), checked against its binary:

- Only headers the page names ``X-Llama-Server-Proxy-Header-NAME: V`` go out, as ``NAME: V``;
  every other request header (cookies, the API key, the browser's own) stays here. NAME goes out
  in canonical casing (``X-Custom``): the ASGI server hands header names over lowercased, where
  llama-server keeps the casing the page used. Of those,
  ``Accept-Encoding``, ``Transfer-Encoding`` and ``Content-Length`` are dropped and ``Host`` is
  set to the target's. The request also carries ``Host``, ``Accept: */*`` and ``Connection:
  close``, and ``Content-Type: text/plain`` with a body whose type was not forwarded; the body
  goes out as received. Redirects are followed.
- The response keeps the target's status, body (streamed) and headers except ``Server``,
  ``Transfer-Encoding``, ``Content-Length``, ``Keep-Alive`` and ``Access-Control-*`` (this
  server's own CORS headers apply); a repeated header keeps its last value.
- A bad target URL is a 500 (400 for a port that is not a number) in the usual error shape; a
  target that cannot be reached is a 500 whose body is ``proxy error: ...``.

The proxy reaches any http(s) URL this host can reach, which is why it is off by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from mlxcel_compat.server.errors import raw_error_response

HEADER_PREFIX = "x-llama-server-proxy-header-"
DROPPED_REQUEST_HEADERS = frozenset({"accept-encoding", "transfer-encoding", "content-length"})
DROPPED_RESPONSE_HEADERS = frozenset({"server", "transfer-encoding", "content-length", "keep-alive"})
TIMEOUT_S = 600.0  # llama-server: ten minutes to read and to write


class TargetError(ValueError):
    """The ``url`` parameter cannot be proxied; ``status`` is llama-server's for the case."""

    def __init__(self, message: str, status: int = 500) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Target:
    scheme: str
    host: str
    port: int
    path: str  # with the query, as given

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.path}"


def parse_target(url: str) -> Target:
    """Split ``url`` as llama.cpp's ``common_http_parse_url`` does, with the proxy's checks."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise TargetError("invalid URL: no scheme")
    if scheme not in ("http", "https"):
        raise TargetError("unsupported URL scheme: " + scheme)
    password = ""
    if "@" in rest:
        auth, _, rest = rest.partition("@")
        password = auth.partition(":")[2]
    authority, slash, path = rest.partition("/")
    path = slash + path if slash else "/"
    port_text = ""
    if authority.startswith("["):
        close = authority.find("]")
        if close < 0:
            raise TargetError("invalid IPv6 URL authority: " + authority)
        after = authority[close + 1:]
        port_text = after[1:] if after.startswith(":") else ""
        host = authority[1:close]
    else:
        host, _, port_text = authority.partition(":")
    if port_text:
        if not port_text.isdigit():
            raise TargetError(f"invalid port in target URL: {port_text}", 400)
        port = int(port_text)
    else:
        port = 443 if scheme == "https" else 80
    if not host:
        raise TargetError("invalid target URL: missing host")
    if password:
        raise TargetError("authentication in target URL is not supported")
    return Target(scheme, host, port, path)


def outgoing_headers(request_headers: list[tuple[str, str]], has_body: bool) -> list[tuple[str, str]]:
    """The headers sent to the target, from the request's raw ``(name, value)`` pairs."""
    out: dict[str, tuple[str, str]] = {}
    for name, value in request_headers:
        if not name.lower().startswith(HEADER_PREFIX):
            continue
        key = name[len(HEADER_PREFIX):]
        lowered = key.lower()
        if not key or lowered in DROPPED_REQUEST_HEADERS or lowered == "host":
            continue  # Host: the HTTP client sets the target's
        out[lowered] = ("-".join(part.capitalize() for part in key.split("-")), value)
    out.setdefault("connection", ("Connection", "close"))
    out.setdefault("accept", ("Accept", "*/*"))
    if has_body:
        out.setdefault("content-type", ("Content-Type", "text/plain"))
    return list(out.values())


def returned_headers(raw: list[tuple[bytes, bytes]]) -> tuple[dict[str, str], str | None]:
    """The target's response headers that come back, and its content type."""
    headers: dict[str, str] = {}
    content_type = None
    for name_b, value_b in raw:
        name, value = name_b.decode("latin-1"), value_b.decode("latin-1")
        lowered = name.lower()
        if lowered in DROPPED_RESPONSE_HEADERS or lowered.startswith("access-control-"):
            continue
        if lowered == "content-type":
            content_type = value
            continue
        headers = {k: v for k, v in headers.items() if k.lower() != lowered}
        headers[name] = value
    return headers, content_type


async def proxy(request: Request) -> Response:
    import httpx  # here, not at start-up: ~11 MiB of the process for a route that is off by default

    try:
        target = parse_target(request.query_params.get("url", ""))
    except TargetError as exc:
        kind = "invalid_request_error" if exc.status == 400 else "server_error"
        return raw_error_response(exc.status, {"error": {"code": exc.status, "message": str(exc), "type": kind}})
    body = await request.body()
    raw = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.headers.raw]
    client = httpx.AsyncClient(follow_redirects=True, timeout=TIMEOUT_S, trust_env=False)
    outgoing = client.build_request(request.method, target.url, headers=outgoing_headers(raw, bool(body)),
                                    content=body if body or request.method == "POST" else None)
    sent = {name.lower() for name, _ in outgoing_headers(raw, bool(body))}
    for default in ("user-agent", "accept-encoding"):  # httpx's own; llama-server sends neither
        if default not in sent and default in outgoing.headers:
            del outgoing.headers[default]
    try:
        upstream = await client.send(outgoing, stream=True)
    except httpx.HTTPError as exc:
        await client.aclose()
        message = "Could not establish connection" if isinstance(exc, httpx.ConnectError) else type(exc).__name__
        return Response("proxy error: " + message, status_code=500, media_type="application/json; charset=utf-8",
                        headers={"X-Accel-Buffering": "no"})
    headers, content_type = returned_headers(upstream.headers.raw)
    headers["X-Accel-Buffering"] = "no"

    async def relay() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()
            await client.aclose()

    response = StreamingResponse(relay(), status_code=upstream.status_code, headers=headers)
    if content_type is not None:
        response.headers["content-type"] = content_type
    elif "content-type" in response.headers:
        del response.headers["content-type"]
    return response
