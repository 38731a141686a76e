"""The routes of llama-server's web UI: the chat page at ``GET /`` and its files.

The page is static files shipped in the package (``mlxcel_compat/webui``: plain HTML, CSS and
JavaScript modules, two vendored libraries; no build step and nothing fetched from elsewhere, so
it works offline). ``/`` and ``/index.html`` serve the page, ``/ui/{file}`` and
``/ui/vendor/{file}`` its assets. With ``--no-ui`` every one of them answers 404, as llama-server
does; so do they with ``--path DIR``, whose files are served instead (``static_files.py``). The page itself talks to the API (``/props``, ``/v1/chat/completions``) like any client.

Every UI response carries a content-security policy that allows scripts from this origin only
(no inline script, no ``eval``, no remote fetches), and ``Cache-Control: no-cache`` with an
``ETag``: the browser keeps its copy and revalidates it, so an upgraded server never runs a
stale page, at the cost of one 304 per file.

The page's companions, ``/tools`` (``--tools``) and ``/cors-proxy`` (``--ui-mcp-proxy``), live
in ``api_tools.py``. When ``GET /tools`` lists tools, the page offers them to the model and runs
the calls it makes through ``POST /tools``.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlxcel_compat.server.errors import raw_error_response
from mlxcel_compat.server.openapi import TEXT, Operation
from mlxcel_compat.server.pipeline import ctx_of

UI_DIR = Path(__file__).resolve().parent.parent / "webui"

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "connect-src 'self'; font-src 'self'; manifest-src 'self'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'; object-src 'none'"
)
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".md": "text/markdown; charset=utf-8",
    ".LICENSE": "text/plain; charset=utf-8",
}


@dataclass(frozen=True)
class StaticFile:
    """One file of the page, read once: its bytes, media type and entity tag."""

    body: bytes
    media_type: str
    etag: str


@lru_cache(maxsize=1)
def ui_files(root: Path = UI_DIR) -> dict[str, StaticFile]:
    """Every servable file under ``root`` by its URL path relative to the page (``index.html``,
    ``ui/main.js``, ...). Lookups go through this table, so no request path reaches the file system."""
    files: dict[str, StaticFile] = {}
    for path in sorted(root.rglob("*")):
        media = MEDIA_TYPES.get(path.suffix)
        if not path.is_file() or media is None:
            continue
        body = path.read_bytes()
        files[path.relative_to(root).as_posix()] = StaticFile(body, media, '"' + hashlib.sha256(body).hexdigest()[:32] + '"')
    return files


def _not_found() -> Response:
    return raw_error_response(404, {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}})


def _serve(request: Request, name: str) -> Response:
    settings = ctx_of(request).settings
    file = ui_files().get(name) if settings.ui and not settings.static_path else None
    if file is None:
        return _not_found()
    headers = {
        "Cache-Control": "no-cache",
        "ETag": file.etag,
        "Content-Security-Policy": CONTENT_SECURITY_POLICY,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "Cross-Origin-Opener-Policy": "same-origin",
    }
    if file.etag in request.headers.get("if-none-match", ""):
        return Response(status_code=304, headers=headers)
    return Response(file.body, media_type=file.media_type, headers=headers)


async def index(request: Request) -> Response:
    return _serve(request, "index.html")


async def asset(request: Request) -> Response:
    return _serve(request, "ui/" + request.path_params["file"])


async def vendor_asset(request: Request) -> Response:
    return _serve(request, "ui/vendor/" + request.path_params["file"])


PAGE = Operation("The chat page (404 with --no-ui)", media=("text/html",), errors=(404,))
ASSET_MEDIA = ("text/javascript", "text/css", "image/svg+xml", "text/markdown", TEXT)
FILE_PARAM = {"file": {"type": "string"}}
OPERATIONS = {
    ("GET", "/"): PAGE,
    ("GET", "/index.html"): PAGE,
    ("GET", "/ui/{file}"): Operation("A file of the chat page (404 with --no-ui)", media=ASSET_MEDIA, errors=(404,), path=FILE_PARAM),
    ("GET", "/ui/vendor/{file}"): Operation("A vendored library of the chat page, or its licence (404 with --no-ui)", media=ASSET_MEDIA,
                                            errors=(404,), path=FILE_PARAM),
}

ROUTES = [
    Route("/", index, methods=["GET"]),
    Route("/index.html", index, methods=["GET"]),
    Route("/ui/{file}", asset, methods=["GET"]),
    Route("/ui/vendor/{file}", vendor_asset, methods=["GET"]),
]

# Paths the API key never guards (llama-server: "/" and every UI asset); see app.GateMiddleware.
PUBLIC_PREFIXES = ("/ui/",)
