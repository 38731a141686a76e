"""MCP servers the server itself talks to (``--mcp-servers-config`` / ``--mcp-servers-json``).

As llama-server (b11312, ``server-mcp.cpp``): the configuration is Cursor's ``{"mcpServers":
{NAME: {"command", "args", "env", "cwd", "timeout_ms"}}}``; each server is a child process
speaking JSON-RPC 2.0 over stdio, one JSON message per line. At start-up every server is spawned
once to list its tools (10 s each at most), then stopped; its tools join ``GET /tools`` as
``NAME_TOOL`` with type ``mcp``, and the first call spawns the server again and keeps it. A
server that dies is restarted on the next call, after a 5 s cool-down when it fails to start. A
call's result is the text parts of the MCP result joined by newlines, as ``plain_text_response``,
or ``{"error": ...}`` for an error result, a JSON-RPC error, a timeout (``timeout_ms``, 30 s by
default) or a server that cannot be reached.

Everything here runs on the threads of tool calls; nothing touches the event loop or MLX.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

PROTOCOL_VERSION = "2024-11-05"
WARMUP_TIMEOUT_S = 10.0
COOLDOWN_S = 5.0
MAX_LINE_BYTES = 1 << 20


@dataclass(frozen=True)
class McpServerConfig:
    name: str
    command: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # merged over this process's environment
    cwd: str = ""
    timeout_ms: int = 30000


@dataclass(frozen=True)
class McpToolDef:
    server: str
    name: str
    description: str
    input_schema: Any


def parse_config(text: str) -> list[McpServerConfig]:
    """The servers of a Cursor-format JSON text; entries without a command are skipped.

    Raises ``ValueError`` ("failed to parse MCP config JSON: ...") for malformed JSON or entries."""
    try:
        data = json.loads(text)
        servers = data.get("mcpServers") if isinstance(data, dict) else None
        if not isinstance(servers, dict):
            return []
        out = []
        for name, cfg in servers.items():
            if not isinstance(cfg, dict):
                raise ValueError(f"server {name!r} is not an object")
            command = cfg.get("command") or ""
            args = cfg.get("args") if isinstance(cfg.get("args"), list) else []
            env = cfg.get("env") if isinstance(cfg.get("env"), dict) else {}
            if not all(isinstance(a, str) for a in args) or not all(isinstance(v, str) for v in env.values()):
                raise ValueError(f"server {name!r}: args and env values must be strings")
            if not isinstance(command, str) or not command:
                log.warning("MCP server '%s' has no command, skipping", name)
                continue
            timeout = cfg.get("timeout_ms", 30000)
            out.append(McpServerConfig(name, command, tuple(args), tuple(env.items()), str(cfg.get("cwd") or ""),
                                       int(timeout) if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) else 30000))
        return out
    except ValueError as exc:
        raise ValueError(f"failed to parse MCP config JSON: {exc}") from None


def load_configs(config_path: str | None, config_json: str | None) -> list[McpServerConfig]:
    """``--mcp-servers-config`` then ``--mcp-servers-json``; a repeated name keeps the first."""
    texts = []
    if config_path:
        try:
            with open(config_path, encoding="utf-8") as f:
                texts.append(f.read())
        except OSError:
            raise ValueError("failed to open MCP config file: " + config_path) from None
    if config_json:
        texts.append(config_json)
    configs: list[McpServerConfig] = []
    for text in texts:
        parsed = parse_config(text)
        if not parsed:
            log.warning("MCP config: no servers found in JSON")
        for cfg in parsed:
            if any(c.name == cfg.name for c in configs):
                log.warning("MCP config: duplicate server name '%s', skipping", cfg.name)
                continue
            configs.append(cfg)
    return configs


def _rpc_error(reply: dict[str, Any]) -> str:
    error = reply.get("error")
    if isinstance(error, dict):
        return str(error.get("message", "unknown error"))
    return error if isinstance(error, str) else "unknown error"


def result_to_response(result: Any) -> dict[str, Any]:
    """An MCP ``tools/call`` result in the ``/tools`` shape: its text parts, or its error."""
    parts = result.get("content") if isinstance(result, dict) else None
    text = "\n".join(str(p.get("text", "")) for p in parts or () if isinstance(p, dict) and p.get("type") == "text")
    if isinstance(result, dict) and result.get("isError") is True:
        return {"error": text or "MCP tool returned an error"}
    return {"plain_text_response": text}


@dataclass
class StdioSession:
    """One running MCP server: its process, a reader thread, the JSON-RPC session."""

    config: McpServerConfig
    proc: subprocess.Popen | None = None
    replies: "queue.Queue[dict[str, Any] | None]" = field(default_factory=queue.Queue)
    lock: threading.Lock = field(default_factory=threading.Lock)
    next_id: int = 1
    initialized: bool = False
    last_error: str = ""
    stderr_tail: str = ""
    closed: bool = False  # its stdout has ended: the process is gone or going, whatever poll() says yet

    def start(self) -> bool:
        env = {**os.environ, **dict(self.config.env)} if self.config.env else None
        try:
            self.proc = subprocess.Popen([self.config.command, *self.config.args], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                         cwd=self.config.cwd or None, start_new_session=True)
        except OSError as exc:
            self.last_error = f"failed to spawn '{self.config.command}': {exc}"
            return False
        threading.Thread(target=self._read, daemon=True, name=f"mcp-{self.config.name}").start()
        threading.Thread(target=self._read_stderr, daemon=True, name=f"mcp-{self.config.name}-err").start()
        return True

    @property
    def alive(self) -> bool:
        return self.proc is not None and not self.closed and self.proc.poll() is None

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if len(line) > MAX_LINE_BYTES:
                continue
            try:
                message = json.loads(line)
            except ValueError:
                continue  # not a message: skipped, as llama-server does
            if isinstance(message, dict):
                self.replies.put(message)
        self.closed = True  # before the end is seen: the next call starts a new process
        self.replies.put(None)  # end of stream

    def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            self.stderr_tail = (self.stderr_tail + line.decode("utf-8", "replace"))[-4096:]

    def _send(self, message: dict[str, Any]) -> bool:
        try:
            assert self.proc is not None and self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(message).encode() + b"\n")
            self.proc.stdin.flush()
        except (OSError, ValueError, AssertionError):
            return False
        return True

    def _rpc(self, method: str, params: dict[str, Any] | None, deadline: float) -> dict[str, Any]:
        request: dict[str, Any] = {"jsonrpc": "2.0", "id": self.next_id, "method": method}
        if params is not None:
            request["params"] = params
        self.next_id += 1
        if not self._send(request):
            return {"error": {"code": -32603, "message": "transport closed"}}
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return {"error": {"code": -32603, "message": "request timed out"}}
            try:
                reply = self.replies.get(timeout=left)
            except queue.Empty:
                continue
            if reply is None:
                self.replies.put(None)
                return {"error": {"code": -32603, "message": "transport closed"}}
            if reply.get("id") == request["id"]:
                return reply  # notifications and stale replies are skipped

    def _ensure_init(self, deadline: float) -> bool:
        if self.initialized:
            return True
        reply = self._rpc("initialize", {"protocolVersion": PROTOCOL_VERSION, "capabilities": {},
                                         "clientInfo": {"name": "llama.cpp", "version": "1.0"}}, deadline)
        if "result" not in reply:
            self.last_error = "initialize failed: " + _rpc_error(reply)
            return False
        self._send({"jsonrpc": "2.0", "method": "notifications/initialized"})
        self.initialized = True
        return True

    def list_tools(self, timeout_s: float) -> list[McpToolDef]:
        deadline = time.monotonic() + timeout_s
        with self.lock:
            if not self._ensure_init(deadline):
                return []
            reply = self._rpc("tools/list", None, deadline)
        if "result" not in reply:
            self.last_error = "tools/list failed: " + _rpc_error(reply)
            return []
        tools = reply["result"].get("tools") if isinstance(reply["result"], dict) else None
        return [McpToolDef(self.config.name, str(t.get("name", "")), str(t.get("description", "")), t.get("inputSchema"))
                for t in tools or () if isinstance(t, dict)]

    def call_tool(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        deadline = time.monotonic() + self.config.timeout_ms / 1000
        with self.lock:
            if not self._ensure_init(deadline):
                return {"error": self.last_error}
            reply = self._rpc("tools/call", {"name": name, "arguments": arguments}, deadline)
        if "error" in reply:
            return {"error": _rpc_error(reply)}
        if "result" in reply:
            return result_to_response(reply["result"])
        return {"error": "invalid response from MCP server"}

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class McpManager:
    """Every configured server: the tools found at start-up and the sessions calls open."""

    def __init__(self, configs: list[McpServerConfig]) -> None:
        self.configs = {c.name: c for c in configs}
        self.tools: list[McpToolDef] = []
        self.sessions: dict[str, StdioSession] = {}
        self.dead_until: dict[str, float] = {}
        self.lock = threading.Lock()
        self.stopping = False

    def discover(self) -> None:
        """Spawn each server once and list its tools (blocking: run it off the event loop)."""
        found: list[McpToolDef] = []
        for cfg in self.configs.values():
            session = StdioSession(cfg)
            if not session.start():
                log.warning("MCP warmup: failed to spawn '%s': %s", cfg.name, session.last_error)
                continue
            tools = session.list_tools(WARMUP_TIMEOUT_S)
            log.info("MCP warmup: '%s' discovered %d tools", cfg.name, len(tools))
            found += tools
            session.close()
        self.tools = found

    def _session(self, server: str) -> StdioSession | None:
        with self.lock:
            if self.stopping or time.monotonic() < self.dead_until.get(server, 0):
                return None
            session = self.sessions.get(server)
            if session is not None and session.alive:
                return session
            if session is not None:
                log.warning("MCP '%s' is no longer alive: %s", server, session.last_error or session.stderr_tail)
                session.close()
                del self.sessions[server]
            cfg = self.configs.get(server)
            if cfg is None:
                return None
            fresh = StdioSession(cfg)
            if fresh.start() and fresh.alive:
                self.sessions[server] = fresh
                return fresh
            log.warning("MCP '%s': failed to start: %s", server, fresh.last_error)
            fresh.close()
            self.dead_until[server] = time.monotonic() + COOLDOWN_S
            return None

    def call_tool(self, server: str, tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
        session = self._session(server)
        if session is None:
            return {"error": "MCP server unavailable: " + server}
        return session.call_tool(tool, arguments)

    def close(self) -> None:
        with self.lock:
            self.stopping = True
            sessions, self.sessions = list(self.sessions.values()), {}
        for session in sessions:
            session.close()
