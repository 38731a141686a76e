"""``--path DIR``: a directory of static files served at ``/`` in place of the chat page.

What llama-server does with it (cpp-httplib's mount point at ``/``), done the same way here:

- a ``GET`` or ``HEAD`` whose path names a regular file under ``DIR`` gets that file, before any
  route is tried (httplib serves mount points first, so a file named like a route shadows it);
  a path naming a directory gets that directory's ``index.html`` (``/`` gets ``DIR/index.html``);
- anything else goes to the routes as usual; the built-in chat page (``/``, ``/index.html``,
  ``/ui/*``) is not served at all, so a directory without ``index.html`` answers 404 at ``/``;
- the API key and the "Loading model" gate apply as to any path (llama-server checks them
  before it routes): of the directory's files only ``/`` stays public (not ``/index.html``, nor
  ``/ui/...``, which the built-in page makes public), the others need the key when one is set;
- a path naming a directory without the final ``/`` is redirected there (301), as httplib does;
- with ``--no-ui`` the directory is not served (llama-server registers it only with the UI on).

Paths are resolved and must stay inside ``DIR`` (``..`` and symbolic links out of it answer as
if the file were not there). Media types come from the file name (``mimetypes``).
"""

from __future__ import annotations

import mimetypes
import os
from pathlib import Path
from urllib.parse import unquote

from starlette.responses import FileResponse, RedirectResponse
from starlette.types import ASGIApp, Receive, Scope, Send

INDEX = "index.html"


def static_is_public(path: str) -> bool:
    """With ``--path``, whether a path the built-in page would make public stays so (``/`` only;
    llama-server b11312 asks for the key at ``/index.html``)."""
    return path != "/index.html" and not path.startswith("/ui/")


def resolve_static(root: Path, url_path: str) -> tuple[Path, bool] | None:
    """The file ``url_path`` names under ``root`` (a directory's ``index.html``) and whether the
    path named a directory, or None when there is none or it would lie outside ``root``."""
    relative = unquote(url_path).lstrip("/")
    if "\0" in relative:
        return None
    candidate = (root / relative).resolve()
    if candidate != root and root not in candidate.parents:
        return None
    directory = candidate.is_dir()
    if directory:
        candidate = candidate / INDEX
    return (candidate, directory) if candidate.is_file() else None


class StaticDirectoryMiddleware:
    """Serve ``root``'s files ahead of the routes (see the module's docstring)."""

    def __init__(self, app: ASGIApp, root: str, prefix: str = "") -> None:
        self.app = app
        self.root = Path(os.path.expanduser(root)).resolve()
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("GET", "HEAD"):
            path = scope["path"]
            if not self.prefix or path == self.prefix or path.startswith(self.prefix + "/"):
                relative = path[len(self.prefix):]
                found = resolve_static(self.root, relative)
                if found is not None and found[1] and not relative.endswith("/"):
                    await RedirectResponse(path + "/", status_code=301)(scope, receive, send)
                    return
                if found is not None:
                    media = mimetypes.guess_type(found[0].name)[0] or "application/octet-stream"
                    await FileResponse(found[0], media_type=media)(scope, receive, send)  # HEAD: headers only
                    return
        await self.app(scope, receive, send)


__all__ = ["StaticDirectoryMiddleware", "resolve_static"]
