"""``--tools`` and ``--ui-mcp-proxy`` on a real server, driven with raw httpx.

Expected values are llama-server b11312's, read from its code and checked against its binary on
the same requests (the MCP server's tools too, with the same demo MCP server): each tool's result shape and text, the bare error object of ``POST /tools``,
the 404 of an unknown tool, the SSE events of a streamed command, and the proxy's rules for the
headers that go out and come back, against a real HTTP server started here.
"""

from __future__ import annotations

import base64
import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from tests.conftest import free_port
from tests.e2e.helpers import parse_sse

pytestmark = pytest.mark.e2e

DISABLED = {"error": {"message": "this feature is disabled", "type": "feature_disabled"}}
NOT_FOUND = {"error": {"message": "File Not Found", "type": "not_found_error", "code": 404}}
TOOL_NAMES = ["read_file", "file_glob_search", "grep_search", "exec_shell_command", "write_file", "edit_file", "get_info"]


@pytest.fixture(scope="module")
def tools_server(server_factory, llama_dir: Path):
    return server_factory(["-m", str(llama_dir), "-c", "512", "-np", "1", "--tools", "all", "--ui-mcp-proxy"])


@pytest.fixture()
def client(tools_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=tools_server.base_url, timeout=60) as c:
        yield c


@pytest.fixture()
def work(tmp_path: Path) -> Path:
    (tmp_path / "a.txt").write_bytes(b"l1\nl2\r\nl3")
    (tmp_path / "sub" / "deep").mkdir(parents=True)
    (tmp_path / "sub" / "b.txt").write_text("hi\n")
    (tmp_path / "sub" / "deep" / "c.md").write_text("x\n")
    (tmp_path / "node_modules").mkdir()
    (tmp_path / "node_modules" / "z.txt").write_text("y\n")
    return tmp_path


def call(client: httpx.Client, tool: str, params: dict[str, Any], cwd: Path | None = None, **headers: str) -> Any:
    if cwd is not None:
        headers["X-Tool-Cwd"] = str(cwd)
    r = client.post("/tools", json={"tool": tool, "params": params}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


# --------------------------------------------------------------------------- off by default


def test_off_by_default_is_403_and_props_says_no_proxy(http: httpx.Client) -> None:
    for method, path in (("GET", "/tools"), ("POST", "/tools"), ("GET", "/cors-proxy"), ("POST", "/cors-proxy")):
        r = http.request(method, path)
        assert (r.status_code, r.json()) == (403, DISABLED), (method, path)
    assert http.get("/props").json()["cors_proxy_enabled"] is False


def test_unknown_tool_and_runtime_stop_start_up(llama_dir: Path) -> None:
    import sys

    for args, message in ((["--tools", "read_file,nope"], 'unknown tool "nope". available tools: read_file, file_glob_search'),
                          (["--tools-runtime", "docker:alpine"], "--tools-runtime is not supported")):
        proc = subprocess.run([sys.executable, "-m", "mlxcel_compat", "-m", str(llama_dir), *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and message in proc.stderr + proc.stdout, (args, proc.stderr)


# --------------------------------------------------------------------------- listing and errors


def test_get_tools_lists_llama_server_definitions(client: httpx.Client, tools_server) -> None:
    tools = client.get("/tools").json()
    assert [t["tool"] for t in tools] == TOOL_NAMES
    read = tools[0]
    assert list(read) == ["display_name", "tool", "type", "permissions", "uses_cwd", "definition"]
    assert read["display_name"] == "Read file" and read["type"] == "server" and read["permissions"] == {"write": False}
    fn = read["definition"]["function"]
    assert fn["parameters"]["required"] == ["path"]
    assert list(fn["parameters"]["properties"]) == ["path", "start_line", "end_line", "append_loc"]
    by_name = {t["tool"]: t for t in tools}
    assert by_name["exec_shell_command"]["permissions"] == {"write": True}
    assert by_name["get_info"]["definition"]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert client.get("/props").json()["cors_proxy_enabled"] is True
    log = tools_server.log_path.read_text()
    assert "security: MCP proxy (experimental), server tools (experimental) enabled" in log
    assert "using localhost as default CORS origin" in log


def test_cors_origins_default_to_localhost(client: httpx.Client) -> None:
    local = client.get("/tools", headers={"Origin": "http://localhost:5173"})
    assert local.headers["access-control-allow-origin"] == "http://localhost:5173"
    remote = client.get("/tools", headers={"Origin": "http://evil.example"})
    assert "access-control-allow-origin" not in remote.headers


@pytest.mark.parametrize("body, status, message", [
    (b"notjson", 400, "[json.exception.parse_error.101]"),
    (b"{}", 400, "[json.exception.out_of_range.403] key 'tool' not found"),
    (b'{"tool":"read_file","params":{}}', 400, "[json.exception.out_of_range.403] key 'path' not found"),
    (b'{"tool":"read_file","params":{"path":5}}', 400, "[json.exception.type_error.302] type must be string, but is number"),
    (b'{"tool":"get_info","stream":"x"}', 400, "[json.exception.type_error.302] type must be boolean, but is string"),
])
def test_bad_calls_get_the_bare_error_object(client: httpx.Client, body: bytes, status: int, message: str) -> None:
    r = client.post("/tools", content=body)
    assert r.status_code == status
    data = r.json()
    assert list(data) == ["code", "message", "type"]
    assert data["code"] == status and data["type"] == "invalid_request_error" and data["message"].startswith(message)


def test_unknown_tool_and_unstreamable_tool_are_404(client: httpx.Client) -> None:
    for body in ({"tool": "nope"}, {"tool": "get_info", "stream": True}):
        r = client.post("/tools", json=body)
        assert (r.status_code, r.json()) == (404, NOT_FOUND)


def test_other_runtimes_are_500(client: httpx.Client) -> None:
    for runtime, message in (("bogus", "unknown tool runtime: bogus"), ("docker-container:-x", "invalid container id: -x"),
                             ("ssh:host", "only the host runtime is supported")):
        r = client.post("/tools", json={"tool": "get_info"}, headers={"X-Tool-Runtime": runtime})
        assert r.status_code == 500 and r.json()["type"] == "server_error" and message in r.json()["message"]


# --------------------------------------------------------------------------- each tool


def test_get_info(client: httpx.Client, work: Path) -> None:
    info = call(client, "get_info", {"cwd": "/ignored"}, cwd=work)
    uname = subprocess.run(["uname", "-a"], capture_output=True, text=True).stdout.strip()
    assert info == {"os": uname, "cwd": str(work)}


def test_read_file(client: httpx.Client, work: Path) -> None:
    assert call(client, "read_file", {"path": "a.txt"}, work) == {"plain_text_response": "l1\nl2\r\nl3\n"}
    assert call(client, "read_file", {"path": "a.txt", "append_loc": True, "start_line": 2}, work) == {
        "plain_text_response": "2\u2192l2\r\n3\u2192l3\n"}
    assert call(client, "read_file", {"path": "a.txt", "start_line": "x", "end_line": 1}, work) == {"plain_text_response": "l1\n"}
    assert call(client, "read_file", {"path": "a.txt"}, work, **{"X-Resp-Type": "base64"}) == {
        "base64": base64.b64encode(b"l1\nl2\r\nl3").decode(), "size_bytes": 9}
    assert call(client, "read_file", {"path": "sub"}, work) == {"error": "cannot stat file: sub"}
    (work / "big.txt").write_text("y" * 100 + "\n" + "z" * 20000 + "\n")
    assert call(client, "read_file", {"path": "big.txt"}, work)["error"].startswith("file too large (20102 bytes, max 16384)")
    assert call(client, "read_file", {"path": "big.txt", "end_line": 9}, work) == {"plain_text_response": "y" * 100 + "\n[output truncated]"}


def test_file_glob_search(client: httpx.Client, work: Path) -> None:
    found = call(client, "file_glob_search", {"path": "."}, work)
    assert found["base"] == str(work)
    assert sorted(e["path"] for e in found["entries"]) == ["a.txt", "sub/b.txt", "sub/deep/c.md"]  # node_modules skipped
    assert found["plain_text_response"].endswith("\n---\nTotal matches: 3\n")
    md = call(client, "file_glob_search", {"path": str(work), "include": "deep/*.md"})  # anchored as **/deep/*.md
    assert md["entries"] == [{"path": "sub/deep/c.md", "type": "file"}]
    # as in llama-server, the added **/ needs a directory before sub/: a top-level sub/ does not match
    assert call(client, "file_glob_search", {"path": ".", "include": "sub/**/*.md"}, work)["entries"] == []
    dirs = call(client, "file_glob_search", {"path": ".", "type": "dir"}, work)
    assert sorted(e["path"] for e in dirs["entries"]) == ["node_modules", "sub", "sub/deep"]
    assert "sub/\n" in dirs["plain_text_response"]
    capped = call(client, "file_glob_search", {"path": ".", "limit": 1}, work)
    assert "[1 results limit reached (3 total matches)." in capped["plain_text_response"]
    assert call(client, "file_glob_search", {"path": ".", "limit": 0}, work) == {"error": "invalid limit: 0 (expected 1 or more)"}
    assert call(client, "file_glob_search", {"path": "zz"}, work) == {"error": "path does not exist or is not a directory: zz"}


def test_file_glob_search_honours_gitignore(client: httpx.Client, work: Path) -> None:
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    (work / ".gitignore").write_text("sub/\n")
    found = call(client, "file_glob_search", {"path": "."}, work)
    assert sorted(e["path"] for e in found["entries"]) == [".gitignore", "a.txt", "node_modules/z.txt"]


def test_grep_search(client: httpx.Client, work: Path) -> None:
    assert call(client, "grep_search", {"path": "a.txt", "pattern": "l2", "context_lines": 1}, work) == {
        "plain_text_response": "a.txt-1-l1\na.txt:2:l2\r\na.txt-3-l3\n--\n\n---\nTotal matches: 1\n"}
    found = call(client, "grep_search", {"path": ".", "pattern": "L[12]", "ignore_case": True, "return_line_numbers": True}, work)
    assert found == {"plain_text_response": "a.txt:1:l1\na.txt:2:l2\r\n\n---\nTotal matches: 2\n"}
    assert call(client, "grep_search", {"path": ".", "pattern": "(", "literal": True}, work)["plain_text_response"].endswith("Total matches: 0\n")
    assert call(client, "grep_search", {"path": ".", "pattern": "("}, work)["error"].startswith("invalid regex: ")
    assert call(client, "grep_search", {"path": "nope", "pattern": "x"}, work) == {"error": "path does not exist: nope"}


def test_exec_shell_command(client: httpx.Client, work: Path) -> None:
    out = call(client, "exec_shell_command", {"command": "pwd; echo err >&2; exit 3"}, work)
    assert out == {"plain_text_response": f"{work}\nerr\n\n[exit code: 3]"}
    assert call(client, "exec_shell_command", {"command": "printf 0123456789", "max_output_size": 4}) == {
        "plain_text_response": "0123\n[output truncated]\n[exit code: 0]"}
    assert call(client, "exec_shell_command", {"command": "sleep 5", "timeout": 1}) == {
        "plain_text_response": "\n[exit code: 1] [exit due to timed out]"}


def test_exec_shell_command_streams(client: httpx.Client) -> None:
    r = client.post("/tools", json={"tool": "exec_shell_command", "stream": True,
                                    "params": {"command": "echo a; sleep 0.2; echo b; exit 2"}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert "".join(e.get("chunk", "") for e in events) == "a\nb\n\n[exit code: 2]"
    assert events[-1] == {"done": True}
    r = client.post("/tools", json={"tool": "exec_shell_command", "stream": True, "params": {}})
    assert parse_sse(r.text) == [{"done": True, "error": "[json.exception.out_of_range.403] key 'command' not found"}]


def test_write_and_edit_file(client: httpx.Client, work: Path) -> None:
    assert call(client, "write_file", {"path": "new/dir/f.txt", "content": "h\u00e9llo\n"}, work) == {
        "result": "file written successfully", "path": "new/dir/f.txt", "bytes": 7}
    assert (work / "new/dir/f.txt").read_text(encoding="utf-8") == "h\u00e9llo\n"
    assert call(client, "write_file", {"path": "/proc/x/y", "content": "a"}) == {"error": "failed to write file: /proc/x/y"}
    (work / "e.txt").write_text("alpha  \nbeta \u201cq\u201d\ngamma\n", encoding="utf-8")
    ok = {"result": "file edited successfully", "path": "e.txt", "edits_applied": 1}
    assert call(client, "edit_file", {"path": "e.txt", "edits": [{"old_text": "gamma", "new_text": "GAMMA"}]}, work) == ok
    # typographic quotes match as ASCII; the untouched line keeps its trailing blanks
    assert call(client, "edit_file", {"path": "e.txt", "edits": [{"old_text": 'beta "q"', "new_text": "BETA"}]}, work) == ok
    assert (work / "e.txt").read_text(encoding="utf-8") == "alpha  \nBETA\nGAMMA\n"
    for edits, error in (([], '"edits" must be a non-empty array'),
                         ([{"old_text": "", "new_text": "x"}], "edits[0].old_text must not be empty"),
                         ([{"old_text": "zzz", "new_text": "x"}], "could not find edits[0].old_text in e.txt, it must match the file's current content exactly"),
                         ([{"old_text": "A", "new_text": "x"}], "found 3 occurrences of edits[0].old_text in e.txt, it must be unique"),
                         ([{"old_text": "GAMMA", "new_text": "GAMMA"}], "no changes made: the replacement(s) produced identical content"),
                         ([{"old_text": "alph", "new_text": "1"}, {"old_text": "lpha", "new_text": "2"}],
                          "edits[0] and edits[1] overlap in e.txt; merge them into one edit or target disjoint regions")):
        assert call(client, "edit_file", {"path": "e.txt", "edits": edits}, work) == {"error": error}
    assert call(client, "edit_file", {"path": "nofile", "edits": [{"old_text": "a", "new_text": "b"}]}, work) == {
        "error": "failed to open file: nofile"}


# --------------------------------------------------------------------------- the CORS proxy


class Upstream(BaseHTTPRequestHandler):
    """Echoes what it received as JSON, with headers the proxy must drop or keep."""

    def _answer(self) -> None:
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(n) if n else b""
        out = json.dumps({"method": self.command, "path": self.path, "headers": list(self.headers.items()),
                          "body": body.decode()}).encode()
        if self.path.startswith("/redirect"):
            self.send_response(302)
            self.send_header("Location", "/final")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(201)
        self.send_header("Content-Type", "application/x-test")
        self.send_header("X-Upstream", "yes")
        self.send_header("Access-Control-Allow-Origin", "http://evil.example")
        self.send_header("Set-Cookie", "a=1")
        self.send_header("Set-Cookie", "b=2")
        self.send_header("Keep-Alive", "timeout=5")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Upstream)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_proxy_forwards_only_prefixed_headers(client: httpx.Client, upstream: str) -> None:
    r = client.get("/cors-proxy", params={"url": upstream + "/p?q=1"}, headers={
        "Origin": "http://localhost:5173", "X-Llama-Server-Proxy-Header-Authorization": "Bearer t",
        "x-llama-server-proxy-header-Host": "foo", "x-llama-server-proxy-header-accept-encoding": "gzip",
        "x-llama-server-proxy-header-content-length": "99", "x-llama-server-proxy-header-X-Custom": "v",
        "X-Other": "dropped", "User-Agent": "myua", "Cookie": "s=1"})
    assert r.status_code == 201
    seen = r.json()
    assert (seen["method"], seen["path"], seen["body"]) == ("GET", "/p?q=1", "")
    headers = dict(seen["headers"])
    assert headers == {"Authorization": "Bearer t", "Host": upstream.removeprefix("http://"), "X-Custom": "v",
                       "Connection": "close", "Accept": "*/*"}
    # what comes back: the target's headers less Server, Keep-Alive, Content-Length and CORS; ours apply
    assert r.headers["x-upstream"] == "yes" and r.headers["content-type"] == "application/x-test"
    assert r.headers["set-cookie"] == "b=2"  # a repeated header keeps its last value
    assert r.headers["access-control-allow-origin"] == "http://localhost:5173"
    assert "keep-alive" not in r.headers and "BaseHTTP" not in r.headers.get("server", "")


def test_proxy_post_body_and_content_type(client: httpx.Client, upstream: str) -> None:
    plain = client.post("/cors-proxy", params={"url": upstream + "/post"}, json={"a": 1}).json()
    assert plain["body"] == '{"a":1}' and dict(plain["headers"])["Content-Type"] == "text/plain"
    typed = client.post("/cors-proxy", params={"url": upstream + "/post"}, content=b'{"a":1}',
                        headers={"x-llama-server-proxy-header-content-type": "application/json"}).json()
    assert dict(typed["headers"])["Content-Type"] == "application/json" and dict(typed["headers"])["Content-Length"] == "7"
    empty = client.post("/cors-proxy", params={"url": upstream + "/e"}).json()
    assert dict(empty["headers"])["Content-Length"] == "0" and "Content-Type" not in dict(empty["headers"])


def test_proxy_follows_redirects(client: httpx.Client, upstream: str) -> None:
    r = client.get("/cors-proxy", params={"url": upstream + "/redirect"})
    assert r.status_code == 201 and r.json()["path"] == "/final"


@pytest.mark.parametrize("url, status, message", [
    ("", 500, "invalid URL: no scheme"),
    ("ftp://x/", 500, "unsupported URL scheme: ftp"),
    ("http:///p", 500, "invalid target URL: missing host"),
    ("http://u:p@127.0.0.1:9/", 500, "authentication in target URL is not supported"),
    ("http://127.0.0.1:abc/", 400, "invalid port in target URL: abc"),
])
def test_proxy_bad_target(client: httpx.Client, url: str, status: int, message: str) -> None:
    r = client.get("/cors-proxy", params={"url": url})
    kind = "invalid_request_error" if status == 400 else "server_error"
    assert (r.status_code, r.json()) == (status, {"error": {"code": status, "message": message, "type": kind}})


def test_proxy_unreachable_target(client: httpx.Client) -> None:
    r = client.get("/cors-proxy", params={"url": f"http://127.0.0.1:{free_port()}/"})
    assert (r.status_code, r.text) == (500, "proxy error: Could not establish connection")
    assert r.headers["x-accel-buffering"] == "no"


def test_a_client_that_goes_away_stops_the_streamed_command(client: httpx.Client, tmp_path: Path) -> None:
    import time

    ticks = tmp_path / "ticks"
    command = f"while true; do echo x >> {ticks}; echo tick; sleep 0.1; done"
    with client.stream("POST", "/tools", json={"tool": "exec_shell_command", "stream": True,
                                               "params": {"command": command, "timeout": 60}}) as r:
        first = next(r.iter_lines())
        assert first.startswith("data: ") and json.loads(first[6:]) == {"chunk": "tick\n"}
    time.sleep(1.0)  # the next chunk finds the client gone and the process group is killed
    size = ticks.stat().st_size
    time.sleep(0.6)
    assert ticks.stat().st_size == size, "the command kept running after the client left"


# --------------------------------------------------------------------------- MCP servers (stdio)

MCP_SERVER = r'''
import json, os, sys
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue  # notifications/initialized
    method, rid = msg["method"], msg["id"]
    if method == "initialize":
        result = {"protocolVersion": msg["params"]["protocolVersion"], "capabilities": {"tools": {}},
                  "serverInfo": {"name": "demo", "version": "1"}}
    elif method == "tools/list":
        result = {"tools": [{"name": "echo", "description": "Echo the text back",
                             "inputSchema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}},
                            {"name": "fail", "description": "Always fails", "inputSchema": {"type": "object"}}]}
    elif method == "tools/call":
        args = msg["params"]["arguments"]
        if msg["params"]["name"] == "echo":
            sys.stdout.write(json.dumps({"jsonrpc": "2.0", "method": "notifications/progress", "params": {}}) + "\n")
            result = {"content": [{"type": "text", "text": "echo: " + args["text"]},
                                  {"type": "text", "text": "pid " + os.environ["DEMO_MARK"]}]}
        else:
            result = {"content": [{"type": "text", "text": "it failed"}], "isError": True}
    else:
        sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": rid, "error": {"code": -32601, "message": "no such method"}}) + "\n")
        sys.stdout.flush()
        continue
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": rid, "result": result}) + "\n")
    sys.stdout.flush()
'''


@pytest.fixture(scope="module")
def mcp_server(server_factory, llama_dir: Path, tmp_path_factory):
    import sys

    script = tmp_path_factory.mktemp("mcp") / "demo_mcp.py"
    script.write_text(MCP_SERVER)
    config = {"mcpServers": {"demo": {"command": sys.executable, "args": [str(script)], "env": {"DEMO_MARK": "set"}},
                             "nocommand": {"args": []}}}
    return server_factory(["-m", str(llama_dir), "-c", "512", "-np", "1", "--mcp-servers-json", json.dumps(config)])


def test_mcp_tools_are_listed_and_called(mcp_server) -> None:
    with httpx.Client(base_url=mcp_server.base_url, timeout=60) as c:
        tools = c.get("/tools").json()
        assert [t["tool"] for t in tools] == ["demo_echo", "demo_fail"]  # no built-in tools without --tools
        echo = tools[0]
        assert echo["type"] == "mcp" and echo["display_name"] == "demo_echo" and echo["uses_cwd"] is False
        assert echo["definition"]["function"] == {"name": "demo_echo", "description": "Echo the text back",
                                                  "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}
        r = c.post("/tools", json={"tool": "demo_echo", "params": {"text": "hi"}})
        assert r.json() == {"plain_text_response": "echo: hi\npid set"}  # env merged over ours, a notification skipped
        assert c.post("/tools", json={"tool": "demo_fail", "params": {}}).json() == {"error": "it failed"}
        # the demo server dies on a call without "text": that call reads "transport closed", the next one restarts it
        assert c.post("/tools", json={"tool": "demo_echo", "params": {}}).json() == {"error": "transport closed"}
        assert c.post("/tools", json={"tool": "demo_echo", "params": {"text": "again"}}).json() == {
            "plain_text_response": "echo: again\npid set"}
        assert c.post("/tools", json={"tool": "demo_echo", "stream": True}).status_code == 404
        origin = c.get("/tools", headers={"Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in origin.headers  # MCP servers on: CORS origins default to localhost
    log = mcp_server.log_path.read_text()
    assert "MCP server 'nocommand' has no command, skipping" in log and "'demo' discovered 2 tools" in log
    assert "security: MCP servers (experimental) enabled" in log


def test_bad_mcp_config_stops_start_up(llama_dir: Path, tmp_path: Path) -> None:
    import sys

    for args, message in ((["--mcp-servers-json", "{not json"], "failed to parse MCP config JSON"),
                          (["--mcp-servers-config", str(tmp_path / "missing.json")], "failed to open MCP config file")):
        proc = subprocess.run([sys.executable, "-m", "mlxcel_compat", "-m", str(llama_dir), *args],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and message in proc.stderr + proc.stdout, (args, proc.stderr)


def test_other_sites_cannot_run_tools_or_use_the_proxy(client: httpx.Client, tools_server, tmp_path: Path, upstream: str) -> None:
    # CORS keeps a foreign page from reading answers, not from sending a simple POST: the Origin check does.
    marker = tmp_path / "ran"
    body = json.dumps({"tool": "exec_shell_command", "params": {"command": f"touch {marker}"}})
    r = client.post("/tools", content=body, headers={"Origin": "http://evil.example", "Content-Type": "text/plain"})
    assert (r.status_code, r.json()) == (403, {"error": {"code": 403, "message": "origin not allowed: http://evil.example",
                                                        "type": "permission_error"}})
    assert not marker.exists()
    proxied = client.post("/cors-proxy", params={"url": upstream + "/x"}, headers={"Origin": "http://evil.example"})
    assert proxied.status_code == 403
    assert client.post("/tools", content=body, headers={"Origin": "http://localhost:5173"}).status_code == 200  # allowed
    # the server's own name is no pass: a DNS-rebinding page has it too (list it in --cors-origins instead)
    rebound = {"Origin": "http://box.example:8080", "Host": "box.example:8080"}
    assert client.post("/tools", content=body, headers=rebound).status_code == 403
    assert marker.exists()


SLOW_MCP_SERVER = r'''
import json, sys, time
for line in sys.stdin:
    msg = json.loads(line)
    if "id" not in msg:
        continue
    if msg["method"] == "initialize":
        result = {"protocolVersion": msg["params"]["protocolVersion"], "capabilities": {"tools": {}},
                  "serverInfo": {"name": "slow", "version": "1"}}
    elif msg["method"] == "tools/list":
        result = {"tools": [{"name": "sleep", "description": "Sleep a while", "inputSchema": {"type": "object"}}]}
    else:
        open(sys.argv[1], "w").close()  # the call has started
        time.sleep(msg["params"]["arguments"]["seconds"])
        result = {"content": [{"type": "text", "text": "slept"}]}
    sys.stdout.write(json.dumps({"jsonrpc": "2.0", "id": msg["id"], "result": result}) + "\n")
    sys.stdout.flush()
'''


def test_a_slow_mcp_call_does_not_hold_the_shutdown(server_factory, llama_dir: Path, tmp_path: Path) -> None:
    """SIGTERM during a 20 s MCP tool call: the call's session is closed at once (llama-server's
    shutdown ends running MCP calls), the call answers with an error and the server exits in a
    moment, not when the tool or the HTTP server's graceful wait would have ended."""
    import sys
    import time

    script, started = tmp_path / "slow_mcp.py", tmp_path / "started"
    script.write_text(SLOW_MCP_SERVER)
    config = {"mcpServers": {"slow": {"command": sys.executable, "args": [str(script), str(started)], "timeout_ms": 60000}}}
    server = server_factory(["-m", str(llama_dir), "-c", "512", "-np", "1", "--mcp-servers-json", json.dumps(config)])
    answers: list[Any] = []

    def slow_call() -> None:
        try:
            with httpx.Client(base_url=server.base_url, timeout=60) as c:
                answers.append(c.post("/tools", json={"tool": "slow_sleep", "params": {"seconds": 20}}))
        except httpx.HTTPError as exc:
            answers.append(exc)

    caller = threading.Thread(target=slow_call)
    caller.start()
    deadline = time.monotonic() + 30
    while not started.exists():
        assert time.monotonic() < deadline, "the tool call never started"
        time.sleep(0.05)
    t0 = time.monotonic()
    server.terminate()
    server.proc.wait(15)
    elapsed = time.monotonic() - t0
    caller.join(15)
    assert elapsed < 2.5, f"shutdown took {elapsed:.1f} s"
    assert answers and (isinstance(answers[0], httpx.HTTPError) or answers[0].json() == {"error": "transport closed"})
