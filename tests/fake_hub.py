"""A loopback HTTP server standing in for the Hugging Face hub (``HF_ENDPOINT``), for tests.

It answers only what huggingface-hub (2.x) calls to list and download model repositories:

- ``GET /api/models/{repo}[/revision/{rev}]``: the repository's info (``sha``, ``siblings``),
  which ``snapshot_download`` reads to pin the commit;
- ``GET /api/models/{repo}/tree/{rev}[/{path}]?recursive=&expand=``: the file listing
  (``list_repo_files``, ``snapshot_download``), one page, with git blob ids and LFS sha256;
- ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: a file, with the headers ``hf_hub_download``
  reads before downloading (``X-Repo-Commit``, ``ETag``, ``Content-Length``, and for LFS files
  ``X-Linked-Etag`` / ``X-Linked-Size``), and a ``Range`` to resume from.

A repository may require a token: requests without ``Authorization: Bearer <token>`` get 401,
as a private repository does. Unknown repositories and files get 404 with the hub's
``X-Error-Code``. Every request is recorded (method, path, authorization) for assertions.
A repository may be slow (``seconds_per_chunk``), so a test can act while a download runs.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".gguf", ".safetensors", ".bin")
CHUNK_BYTES = 64 << 10  # what a slow repository sends at a time


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    token: str | None = None  # required bearer token (a private repository)
    seconds_per_chunk: float = 0.0  # a slow hub: files are sent in 64 KiB chunks this far apart

    @property
    def commit(self) -> str:
        digest = hashlib.sha1()
        for name in sorted(self.files):
            digest.update(name.encode() + b"\0" + hashlib.sha256(self.files[name]).digest())
        return digest.hexdigest()


@dataclass
class Request:
    method: str
    path: str
    authorization: str | None


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None

    def add(self, repo_id: str, files: dict[str, bytes | Path], token: str | None = None,
            seconds_per_chunk: float = 0.0) -> FakeRepo:
        content = {name: data.read_bytes() if isinstance(data, Path) else data for name, data in files.items()}
        self.repos[repo_id] = FakeRepo(content, token, seconds_per_chunk)
        return self.repos[repo_id]

    @property
    def url(self) -> str:
        assert self._server is not None
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def downloads(self, repo_id: str) -> list[str]:
        """Paths of the files fetched with GET from ``repo_id``."""
        prefix = f"/{repo_id}/resolve/"
        return [unquote(r.path.split("?")[0][len(prefix):].split("/", 1)[1]) for r in self.requests
                if r.method == "GET" and r.path.startswith(prefix)]


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _is_lfs(name: str) -> bool:
    return name.endswith(LFS_SUFFIXES)


_API = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)(?:/revision/(?P<rev>[^/]+))?$")
_TREE = re.compile(r"^/api/models/(?P<repo>[^/]+/[^/]+)/tree/(?P<rev>[^/]+)(?:/(?P<path>.+))?$")
_RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._route(body=False)

    def do_GET(self) -> None:
        self._route(body=True)

    # ------------------------------------------------------------------ helpers

    def _send(self, status: int, payload: bytes = b"", headers: dict[str, str] | None = None, body: bool = True,
              content_type: str = "application/json", seconds_per_chunk: float = 0.0) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if body and seconds_per_chunk:
            try:
                for start in range(0, len(payload), CHUNK_BYTES):
                    self.wfile.write(payload[start:start + CHUNK_BYTES])
                    self.wfile.flush()
                    time.sleep(seconds_per_chunk)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (a cancelled download)
                pass
        elif body:
            self.wfile.write(payload)

    def _error(self, status: int, code: str, message: str, body: bool) -> None:
        self._send(status, json.dumps({"error": message}).encode(), {"X-Error-Code": code, "X-Error-Message": message},
                   body=body)

    def _repo(self, repo_id: str, body: bool) -> FakeRepo | None:
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found", body)
            return None
        if repo.token is not None and self.headers.get("Authorization") != f"Bearer {repo.token}":
            self._error(401, "RepoNotFound", "Invalid credentials in Authorization header", body)
            return None
        return repo

    def _route(self, body: bool) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        self.hub.requests.append(Request(self.command, self.path, self.headers.get("Authorization")))
        if match := _TREE.match(path):
            if (repo := self._repo(match["repo"], body)) is not None:
                self._tree(repo, match["path"] or "", parse_qs(url.query), body)
        elif match := _API.match(path):
            if (repo := self._repo(match["repo"], body)) is not None:
                info = {"id": match["repo"], "modelId": match["repo"], "sha": repo.commit, "private": repo.token is not None,
                        "siblings": [{"rfilename": name} for name in sorted(repo.files)], "tags": []}
                self._send(200, json.dumps(info).encode(), body=body)
        elif match := _RESOLVE.match(path):
            if (repo := self._repo(match["repo"], body)) is not None:
                self._file(repo, match["path"], body)
        else:
            self._error(404, "EntryNotFound", f"no route for {path}", body)

    def _tree(self, repo: FakeRepo, folder: str, query: dict[str, list[str]], body: bool) -> None:
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        prefix = f"{folder.rstrip('/')}/" if folder else ""
        entries, folders = [], set()
        for name in sorted(repo.files):
            if not name.startswith(prefix):
                continue
            rest = name[len(prefix):]
            parts = rest.split("/")
            for depth in range(1, len(parts)):
                if recursive or depth == 1:
                    folders.add(prefix + "/".join(parts[:depth]))
            if "/" in rest and not recursive:
                continue
            data = repo.files[name]
            entry = {"type": "file", "oid": _git_blob_id(data), "size": len(data), "path": name}
            if _is_lfs(name):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        entries += [{"type": "directory", "oid": hashlib.sha1(f.encode()).hexdigest(), "size": 0, "path": f}
                    for f in sorted(folders)]
        self._send(200, json.dumps(entries).encode(), body=body)

    def _file(self, repo: FakeRepo, name: str, body: bool) -> None:
        data = repo.files.get(name)
        if data is None:
            self._error(404, "EntryNotFound", f"{name} does not exist", body)
            return
        headers = {"X-Repo-Commit": repo.commit, "Accept-Ranges": "bytes"}
        if _is_lfs(name):
            etag = hashlib.sha256(data).hexdigest()
            headers.update({"ETag": f'"{etag}"', "X-Linked-Etag": f'"{etag}"', "X-Linked-Size": str(len(data))})
        else:
            headers["ETag"] = f'"{_git_blob_id(data)}"'
        status, payload = 200, data
        if (wanted := self.headers.get("Range")) and (match := re.fullmatch(r"bytes=(\d+)-(\d*)", wanted)):
            start = int(match[1])
            end = int(match[2]) if match[2] else len(data) - 1
            status, payload = 206, data[start:end + 1]
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        self._send(status, payload, headers, body=body, content_type="application/octet-stream",
                   seconds_per_chunk=repo.seconds_per_chunk)
