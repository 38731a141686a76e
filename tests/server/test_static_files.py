"""``--path``: the static directory's lookup, redirects and what stays public (``server/static_files.py``)."""

from __future__ import annotations

from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from mlxcel_compat.server.static_files import StaticDirectoryMiddleware, resolve_static, static_is_public


def client(root: Path, prefix: str = "") -> TestClient:
    async def route(request):
        return PlainTextResponse("route")

    routes = [Route(prefix + "/health", route), Route(prefix + "/other", route)]
    app = Starlette(routes=routes, middleware=[Middleware(StaticDirectoryMiddleware, root=str(root), prefix=prefix)])
    return TestClient(app, follow_redirects=False)


def test_files_first_then_routes_and_directories_get_their_index(tmp_path: Path) -> None:
    (tmp_path / "index.html").write_text("IDX")
    (tmp_path / "health").write_text("a file")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "index.html").write_text("DOCS")
    http = client(tmp_path)
    assert http.get("/").text == "IDX" and http.get("/").headers["content-type"].startswith("text/html")
    assert http.get("/health").text == "a file"  # shadows the route, as httplib's mount point does
    assert http.get("/health").headers["content-type"] == "application/octet-stream"
    assert http.get("/other").text == "route"
    assert http.get("/docs").status_code == 301 and http.get("/docs").headers["location"].endswith("/docs/")
    assert http.get("/docs/").text == "DOCS"
    assert http.head("/health").status_code == 200 and http.head("/health").content == b""
    assert http.post("/health").status_code == 405  # only GET and HEAD read files


def test_paths_out_of_the_directory_are_not_found(tmp_path: Path) -> None:
    root = tmp_path / "public"
    root.mkdir()
    (tmp_path / "secret").write_text("no")
    (root / "link").symlink_to(tmp_path / "secret")
    assert resolve_static(root.resolve(), "/../secret") is None
    assert resolve_static(root.resolve(), "/%2e%2e/secret") is None
    assert resolve_static(root.resolve(), "/link") is None
    assert client(root).get("/%2e%2e/secret").status_code == 404


def test_a_prefix_mounts_the_directory_under_it(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("A")
    http = client(tmp_path, "/api")
    assert http.get("/api/a.txt").text == "A" and http.get("/a.txt").status_code == 404


def test_only_the_root_stays_public() -> None:
    assert static_is_public("/") and not static_is_public("/index.html") and not static_is_public("/ui/main.js")
