"""The routes of llama-server's web UI: ``GET /`` and the UI's tool routes.

No web UI is bundled. Without ``--no-ui``, ``GET /`` (and ``/index.html``) serves one small
status page: the model, its context, the slots and where the API is documented. With ``--no-ui``
they answer 404, as llama-server does.

``/tools`` (the UI's built-in agent tools) and ``/cors-proxy`` (its MCP CORS proxy) are never
enabled here; llama-server answers 403 "this feature is disabled" when they are off, and clients
look for that 403 rather than a 404.
"""

from __future__ import annotations

import html

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from mlxcel_compat import __version__
from mlxcel_compat.server.errors import raw_error_response
from mlxcel_compat.server.openapi import Operation
from mlxcel_compat.server.pipeline import ctx_of

DOCS_URL = "https://github.com/ggml-org/llama.cpp/blob/master/tools/server/README.md"
_API_LINKS = ("/health", "/props", "/slots", "/v1/models", "/metrics")


def _status_page(request: Request) -> str:
    ctx = ctx_of(request)
    m = ctx.model
    esc = html.escape
    rows = "".join(
        f"<tr><td>{slot.id}</td><td>{slot.n_ctx}</td><td>{'busy' if slot.is_processing else 'idle'}</td></tr>"
        for slot in ctx.engine.slots
    )
    prefix = ctx.settings.api_prefix.rstrip("/")
    links = " · ".join(f'<a href="{esc(prefix + path)}">{esc(path)}</a>' for path in _API_LINKS)
    state = "sleeping (the next request reloads the model)" if ctx.engine.sleeping else "ready"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>mlxcel-server: {esc(m.model_id)}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:48em}}td,th{{padding:0 1em;text-align:left}}</style>
</head><body>
<h1>mlxcel-server</h1>
<p>An MLX server with llama-server's HTTP API (mlxcel_compat {esc(__version__)}). No web UI is bundled.</p>
<h2>Model</h2>
<p><b>{esc(m.model_id)}</b> ({esc(", ".join(m.aliases))}), {state}.<br>
Context: {m.n_ctx} tokens per slot, trained for {m.n_ctx_train}.</p>
<h2>Slots</h2>
<table><tr><th>id</th><th>n_ctx</th><th>state</th></tr>{rows}</table>
<h2>API</h2>
<p>{links}</p>
<p>The API is llama-server's: <a href="{DOCS_URL}">llama.cpp server documentation</a>.</p>
</body></html>
"""


async def index(request: Request) -> Response:
    if not ctx_of(request).settings.ui:
        return raw_error_response(404, {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}})
    return HTMLResponse(_status_page(request))


async def feature_disabled(request: Request) -> Response:
    return raw_error_response(403, {"error": {"message": "this feature is disabled", "type": "feature_disabled"}})


DISABLED = Operation("Built-in agent tools and the CORS proxy: always 403 here (feature disabled)", errors=(403,))
STATUS_PAGE = Operation("A plain status page (404 with --no-ui)", media=("text/html",), errors=(404,))
OPERATIONS = {
    ("GET", "/"): STATUS_PAGE,
    ("GET", "/index.html"): STATUS_PAGE,
    ("GET", "/tools"): DISABLED,
    ("POST", "/tools"): DISABLED,
    ("GET", "/cors-proxy"): DISABLED,
    ("POST", "/cors-proxy"): DISABLED,
}

ROUTES = [
    Route("/", index, methods=["GET"]),
    Route("/index.html", index, methods=["GET"]),
    Route("/tools", feature_disabled, methods=["GET", "POST"]),
    Route("/cors-proxy", feature_disabled, methods=["GET", "POST"]),
]
