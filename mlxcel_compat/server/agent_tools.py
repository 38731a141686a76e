"""llama-server's built-in agent tools (``--tools``), run on the host.

The chat page lists them with ``GET /tools`` and runs one with ``POST /tools`` when the model
calls it. Names, JSON schemas, limits and result shapes are llama-server's (b11312,
``tools/server/server-tools.cpp``), read from its code and checked against its binary:

- a tool's own failure is a 200 with ``{"error": "..."}``, which the page hands to the model;
- a missing or mistyped required parameter raises ``ParamError`` (llama-server: its JSON
  library's exception, a 400 with the library's message);
- an optional parameter of the wrong type falls back to its default, as llama-server's
  ``json_value`` does.

Everything here is plain Python on a worker thread (subprocesses for the shell, ``uname`` and
``git ls-files``); nothing touches MLX or the event loop. The tools are as powerful as the user
running the server: that is why they are off by default and the log warns when they are on.
Paths resolve against ``X-Tool-Cwd`` or the server's working directory (``~`` expands), with
``.``/``..`` folded away, and are not confined to it, as in llama-server.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from mlxcel_compat.server.text_edits import apply_edits

log = logging.getLogger(__name__)

READ_FILE_MAX_SIZE = 16 * 1024
READ_FILE_MAX_SIZE_BASE64 = 32 * 1024 * 1024
FILE_SEARCH_MAX_RESULTS = 100
GREP_SEARCH_MAX_RESULTS = 100
EXEC_MAX_OUTPUT_SIZE = 16 * 1024
EXEC_MAX_TIMEOUT = 60
GET_INFO_MAX_OUTPUT = 4096
GET_INFO_TIMEOUT = 5
LIST_ENTRIES_TIMEOUT = 15
GIT_LS_FILES_MAX_OUTPUT = 8 * 1024 * 1024
# Listings report these directories but never walk into them: they can be enormous.
JUNK_DIR_NAMES = frozenset({".git", ".svn", ".hg", "node_modules", "__pycache__", ".venv", "venv", "dist",
                            "build", "target", ".cache", ".idea", ".vscode"})

Chunk = Callable[[str], bool]  # streaming sink: returns False when the client has gone


class ParamError(ValueError):
    """A required parameter is missing or has the wrong type (llama-server: 400)."""


# --------------------------------------------------------------------------- parameters

_JSON_TYPE = {str: "string", bool: "boolean", int: "number", float: "number", list: "array", dict: "object",
              type(None): "null"}


def type_name(value: Any) -> str:
    return _JSON_TYPE.get(type(value), "object")


def required(params: dict[str, Any], key: str, kind: type) -> Any:
    """``params[key]`` of JSON type ``kind``; worded as llama-server's JSON library words it."""
    if key not in params:
        raise ParamError(f"[json.exception.out_of_range.403] key '{key}' not found")
    value = params[key]
    if not _is_kind(value, kind):
        raise ParamError(f"[json.exception.type_error.302] type must be {_JSON_TYPE[kind]}, but is {type_name(value)}")
    return int(value) if kind is int else value


def optional(params: dict[str, Any], key: str, default: Any) -> Any:
    """``params[key]`` when present and of the default's type, else the default."""
    value = params.get(key)
    kind = type(default)
    if value is None or not _is_kind(value, kind):
        return default
    return int(value) if kind is int else value


def _is_kind(value: Any, kind: type) -> bool:
    if kind is int:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is bool:
        return isinstance(value, bool)
    return isinstance(value, kind)


# --------------------------------------------------------------------------- host I/O


@dataclass
class ExecResult:
    output: str
    exit_code: int = -1
    timed_out: bool = False


def run_process(args: list[str], max_output: int, timeout: int, cwd: str = "",
                on_chunk: Chunk | None = None) -> ExecResult:
    """Run ``args`` with stdout and stderr combined, keeping at most ``max_output`` bytes.

    As llama-server: the output past the cap is drained (so the child never blocks on a full
    pipe) and marked ``[output truncated]``; a child killed by the timeout or by a signal reports
    exit code 1. Unlike llama-server the whole process group is killed, so a shell's children
    do not keep the pipe open past the timeout.
    """
    try:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                cwd=cwd or None, start_new_session=True)
    except OSError:
        return ExecResult("failed to spawn process")
    timed_out = threading.Event()
    done = threading.Event()

    def kill() -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def watchdog() -> None:
        if not done.wait(max(0, timeout)):
            timed_out.set()
            kill()

    threading.Thread(target=watchdog, daemon=True).start()
    out = bytearray()
    truncated = False
    assert proc.stdout is not None
    while True:
        data = proc.stdout.read1(4096)
        if not data:
            break
        if truncated:
            continue
        if len(out) + len(data) <= max_output:
            out += data
            if on_chunk is not None and not on_chunk(data.decode("utf-8", "replace")):
                kill()
                break
        else:
            rest = data[: max(0, max_output - len(out))]
            out += rest
            if on_chunk is not None and rest:
                on_chunk(rest.decode("utf-8", "replace"))
            truncated = True
    code = proc.wait()
    done.set()
    proc.stdout.close()
    text = out.decode("utf-8", "replace") + ("\n[output truncated]" if truncated else "")
    return ExecResult(text, code if code >= 0 else 1, timed_out.is_set())


def resolve(path: str, cwd: str = "") -> str:
    """Absolute, ``~`` expanded, ``.``/``..`` folded (llama-server's ``tools_io_basic::resolve``)."""
    if path == "~" or path.startswith(("~/", "~\\")):
        home = os.environ.get("HOME", "")
        if home:
            path = home + path[1:]
    full = path if os.path.isabs(path) else os.path.join(cwd or os.getcwd(), path)
    return os.path.normpath(full)


@dataclass
class Listing:
    entries: list[tuple[str, bool]] = field(default_factory=list)  # (relative path, is a directory)
    error: str = ""
    truncated: bool = False


def list_entries(base: str, max_depth: int, kind: str) -> Listing:
    """Entries under ``base``: ``git ls-files`` for files inside a repository (``.gitignore``
    honoured), else a walk that skips links and junk directories, within a time budget."""
    if not os.path.isdir(base):
        return Listing(error="path does not exist or is not a directory")
    deadline = time.monotonic() + LIST_ENTRIES_TIMEOUT
    if kind == "file":
        res = run_process(["git", "-C", base, "ls-files", "--cached", "--others", "--exclude-standard"],
                          GIT_LS_FILES_MAX_OUTPUT, LIST_ENTRIES_TIMEOUT)
        if res.exit_code == 0 and not res.timed_out:
            out = Listing()
            for line in res.output.split("\n"):
                line = line.rstrip("\r").replace("\\", "/")
                if not line or (max_depth > 0 and line.count("/") + 1 > max_depth):
                    continue
                if os.path.isfile(os.path.join(base, line)):
                    out.entries.append((line, False))
            return out
    return _walk(base, max_depth, kind, deadline)


def _walk(base: str, max_depth: int, kind: str, deadline: float) -> Listing:
    out = Listing()
    stack: list[tuple[str, str, int]] = [(base, "", 0)]
    while stack:
        directory, rel_dir, depth = stack.pop()
        try:
            with os.scandir(directory) as it:
                children = sorted(it, key=lambda e: e.name)
        except OSError:
            out.truncated = True
            continue
        for entry in children:
            if time.monotonic() >= deadline:
                out.truncated = True
                return out
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            try:
                is_dir = entry.is_dir()
                is_file = not is_dir and entry.is_file()
            except OSError:
                continue
            if is_dir:
                if kind in ("dir", "all"):
                    out.entries.append((rel, True))
                if entry.name in JUNK_DIR_NAMES or entry.is_symlink():
                    continue
                if max_depth == 0 or depth + 1 < max_depth:
                    stack.append((entry.path, rel, depth + 1))
            elif is_file and kind in ("file", "all"):
                out.entries.append((rel, False))
    return out


def glob_regex(pattern: str) -> re.Pattern[str]:
    """llama.cpp's glob: ``**`` spans ``/``, ``*`` and ``?`` do not, ``[...]`` / ``[!...]`` classes."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if c == "*":
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = i + 1
            if end < len(pattern) and pattern[end] == "!":
                end += 1
            if end < len(pattern) and pattern[end] in "]-":
                end += 1
            end = pattern.find("]", end)
            if end < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1:end]
                negated = body.startswith("!")
                body = body[1:] if negated else body
                out.append("[" + ("^" if negated else "") + body.replace("\\", "\\\\").replace("^", "\\^") + "]")
                i = end
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out), re.DOTALL)


def path_glob_match(pattern: str, rel: str) -> bool:
    """No ``/`` in the pattern: match the basename; else the whole path, anchored with ``**/``."""
    if "/" not in pattern:
        return glob_regex(pattern).fullmatch(rel.rsplit("/", 1)[-1]) is not None
    if not (pattern == "**" or pattern.startswith(("**/", "/"))):
        pattern = "**/" + pattern
    return glob_regex(pattern).fullmatch(rel) is not None


def _lines(content: bytes) -> list[bytes]:
    """Lines as ``std::getline`` yields them: a final newline adds no empty line."""
    lines = content.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return lines


# --------------------------------------------------------------------------- the tools


def _function(name: str, description: str, properties: dict[str, Any], required_keys: tuple[str, ...] | None) -> dict[str, Any]:
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required_keys is not None:
        parameters["required"] = list(required_keys)
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def _prop(kind: str, description: str) -> dict[str, Any]:
    return {"type": kind, "description": description}


def read_file(params: dict[str, Any], stream: Chunk | None = None) -> dict[str, Any]:
    path = required(params, "path", str)
    start_line = optional(params, "start_line", 1)
    end_line = optional(params, "end_line", -1)
    append_loc = optional(params, "append_loc", False)
    full = resolve(path, params.get("cwd", ""))
    if not os.path.isfile(full):
        return {"error": "cannot stat file: " + path}
    size = os.path.getsize(full)
    if params.get("resp_type") == "base64":
        if size > READ_FILE_MAX_SIZE_BASE64:
            return {"error": f"file too large ({size} bytes, max {READ_FILE_MAX_SIZE_BASE64})"}
        try:
            content = Path(full).read_bytes()
        except OSError:
            return {"error": "failed to open file: " + path}
        return {"base64": base64.b64encode(content).decode("ascii"), "size_bytes": len(content)}
    if size > READ_FILE_MAX_SIZE and end_line == -1:
        return {"error": f"file too large ({size} bytes, max {READ_FILE_MAX_SIZE}). "
                         "Use start_line/end_line to read a portion."}
    try:
        content = Path(full).read_bytes()
    except OSError:
        return {"error": "failed to open file: " + path}
    result = bytearray()
    for number, line in enumerate(_lines(content), start=1):
        if number < start_line:
            continue
        if end_line != -1 and number > end_line:
            break
        out_line = (f"{number}\u2192".encode() if append_loc else b"") + line + b"\n"
        if len(result) + len(out_line) > READ_FILE_MAX_SIZE:
            result += b"[output truncated]"
            break
        result += out_line
    return {"plain_text_response": result.decode("utf-8", "replace")}


def file_glob_search(params: dict[str, Any], stream: Chunk | None = None) -> dict[str, Any]:
    path = required(params, "path", str)
    base = resolve(path, params.get("cwd", ""))
    include = optional(params, "include", "**")
    exclude = optional(params, "exclude", "")
    kind = optional(params, "type", "file")
    max_depth = max(0, optional(params, "max_depth", 0))
    limit = optional(params, "limit", FILE_SEARCH_MAX_RESULTS)
    if limit < 1:
        return {"error": f"invalid limit: {limit} (expected 1 or more)"}
    limit = min(limit, FILE_SEARCH_MAX_RESULTS)
    if kind not in ("file", "dir", "all"):
        return {"error": f'invalid type: {kind} (expected "file", "dir" or "all")'}
    listing = list_entries(base, max_depth, kind)
    if listing.error:
        return {"error": f"{listing.error}: {path}"}
    matches = [(rel, is_dir) for rel, is_dir in listing.entries
               if path_glob_match(include, rel) and not (exclude and path_glob_match(exclude, rel))]
    shown = matches[:limit]
    text = "".join(rel + ("/" if is_dir else "") + "\n" for rel, is_dir in shown)
    text += f"\n---\nTotal matches: {len(matches)}\n"
    if len(matches) > len(shown):
        text += (f"[{len(shown)} results limit reached ({len(matches)} total matches). "
                 "Refine the glob pattern to narrow the search.]\n")
    if listing.truncated:
        text += "[results truncated: time budget or unreadable directory]\n"
    entries = [{"path": rel, "type": "dir" if is_dir else "file"} for rel, is_dir in shown]
    return {"plain_text_response": text, "entries": entries, "base": base}


def grep_search(params: dict[str, Any], stream: Chunk | None = None) -> dict[str, Any]:
    path = required(params, "path", str)
    pattern = required(params, "pattern", str)
    include = optional(params, "include", "**")
    exclude = optional(params, "exclude", "")
    show_number = optional(params, "return_line_numbers", False)
    literal = optional(params, "literal", False)
    ignore_case = optional(params, "ignore_case", False)
    context = max(0, optional(params, "context_lines", 0))
    try:
        regex = re.compile(re.escape(pattern) if literal else pattern, re.IGNORECASE if ignore_case else 0)
    except re.error as exc:
        return {"error": f"invalid regex: {exc}"}
    full = resolve(path, params.get("cwd", ""))
    files: list[tuple[str, str]] = []
    if os.path.isfile(full):
        files.append((full, path))
    elif os.path.isdir(full):
        listing = list_entries(full, 0, "file")
        if listing.error:
            return {"error": f"{listing.error}: {path}"}
        files += [(os.path.join(full, rel), rel) for rel, _ in listing.entries
                  if path_glob_match(include, rel) and not (exclude and path_glob_match(exclude, rel))]
    else:
        return {"error": "path does not exist: " + path}
    out: list[str] = []
    total = 0
    limit_reached = False
    show_number = show_number or context > 0
    for file_path, shown in files:
        if limit_reached:
            break
        try:
            lines = [line.decode("utf-8", "replace") for line in _lines(Path(file_path).read_bytes())]
        except OSError:
            continue
        for i, line in enumerate(lines):
            if total >= GREP_SEARCH_MAX_RESULTS:
                limit_reached = True
                break
            if not regex.search(line):
                continue
            first, last = (max(0, i - context), min(len(lines) - 1, i + context)) if context else (i, i)
            for j in range(first, last + 1):
                mark = ":" if j == i else "-"
                out.append(f"{shown}{mark}" + (f"{j + 1}{mark}" if show_number else "") + lines[j] + "\n")
            if context:
                out.append("--\n")
            total += 1
    text = "".join(out) + f"\n---\nTotal matches: {total}\n"
    if limit_reached:
        text += f"[{GREP_SEARCH_MAX_RESULTS} matches limit reached. Narrow the path/pattern/include to see more.]\n"
    return {"plain_text_response": text}


def exec_shell_command(params: dict[str, Any], stream: Chunk | None = None) -> dict[str, Any] | None:
    command = required(params, "command", str)
    timeout = min(optional(params, "timeout", 10), EXEC_MAX_TIMEOUT)
    max_output = optional(params, "max_output_size", EXEC_MAX_OUTPUT_SIZE)
    max_output = EXEC_MAX_OUTPUT_SIZE if max_output < 0 else min(max_output, EXEC_MAX_OUTPUT_SIZE)  # size_t in C++
    cwd = params.get("cwd", "")
    if stream is not None:
        alive = [True]

        def push(chunk: str) -> bool:
            alive[0] = stream(chunk)
            return alive[0]

        res = run_process(["sh", "-c", command], max_output, timeout, cwd, push)
        if alive[0]:
            stream(_exit_tail(res))
        return None
    res = run_process(["sh", "-c", command], max_output, timeout, cwd)
    return {"plain_text_response": res.output + _exit_tail(res)}


def _exit_tail(res: ExecResult) -> str:
    return f"\n[exit code: {res.exit_code}]" + (" [exit due to timed out]" if res.timed_out else "")


def _write(full: str, content: bytes) -> bool:
    try:
        os.makedirs(os.path.dirname(full), exist_ok=True)
        Path(full).write_bytes(content)
    except OSError:
        return False
    return True


def write_file(params: dict[str, Any], stream: Chunk | None = None) -> dict[str, Any]:
    path = required(params, "path", str)
    content = required(params, "content", str).encode("utf-8", "surrogatepass")
    if not _write(resolve(path, params.get("cwd", "")), content):
        return {"error": "failed to write file: " + path}
    return {"result": "file written successfully", "path": path, "bytes": len(content)}


def edit_file(params: dict[str, Any], stream: Chunk | None = None) -> dict[str, Any]:
    path = required(params, "path", str)
    if "edits" not in params:
        required(params, "edits", list)  # raises: the key is required
    edits_json = params["edits"]
    if not isinstance(edits_json, list) or not edits_json:
        return {"error": '"edits" must be a non-empty array'}
    edits: list[tuple[str, str]] = []
    for item in edits_json:
        if not isinstance(item, dict):
            raise ParamError(f"[json.exception.type_error.304] cannot use at() with {type_name(item)}")
        old, new = required(item, "old_text", str), required(item, "new_text", str)
        if not old:
            return {"error": f"edits[{len(edits)}].old_text must not be empty"}
        edits.append((old, new))
    full = resolve(path, params.get("cwd", ""))
    try:
        original = Path(full).read_bytes().decode("utf-8", "surrogateescape")
    except OSError:
        return {"error": "failed to open file: " + path}
    new_content, error = apply_edits(original, edits, path)
    if error:
        return {"error": error}
    if not _write(full, new_content.encode("utf-8", "surrogateescape")):
        return {"error": "failed to write file: " + path}
    return {"result": "file edited successfully", "path": path, "edits_applied": len(edits)}


def get_info(params: dict[str, Any], stream: Chunk | None = None) -> dict[str, Any]:
    res = run_process(["uname", "-a"], GET_INFO_MAX_OUTPUT, GET_INFO_TIMEOUT, params.get("cwd", ""))
    os_info = res.output.strip() if res.exit_code == 0 and not res.timed_out else "unknown"
    return {"os": os_info, "cwd": params.get("cwd") or os.getcwd()}


@dataclass(frozen=True)
class Tool:
    """One built-in tool: what ``GET /tools`` lists and what ``POST /tools`` runs."""

    name: str
    display_name: str
    definition: dict[str, Any]
    invoke: Callable[[dict[str, Any], Chunk | None], dict[str, Any] | None]
    permission_write: bool = False
    support_stream: bool = False
    uses_cwd: bool = True
    kind: str = "server"  # "mcp" for a tool of an MCP server (mcp_client.py)

    def to_json(self) -> dict[str, Any]:
        return {"display_name": self.display_name, "tool": self.name, "type": self.kind,
                "permissions": {"write": self.permission_write}, "uses_cwd": self.uses_cwd,
                "definition": self.definition}


_GLOB_DESCRIPTION = (
    "Recursively search for files matching a glob pattern under a directory. "
    "Automatically skips files ignored by .gitignore (when the directory is inside a git repo) "
    "and common junk directories (.git, node_modules, build, dist, etc.) otherwise. "
    "A pattern with no '/' (e.g. \"*.cpp\") matches the file's basename at any depth. "
    "A pattern containing '/' matches the full relative path; unless already anchored with "
    "\"**/\" or a leading '/', it is automatically prefixed with \"**/\". "
    "Use type=\"dir\" or \"all\" to also list directories; directory entries are suffixed with '/' in the output. "
    "Note: directory listings do not apply .gitignore filtering.")
_GREP_DESCRIPTION = (
    "Search for a pattern in files under a path. Returns matching lines with file paths "
    "(and, unless searching a single file, paths relative to the given directory). "
    "Automatically skips files ignored by .gitignore (when the directory is inside a git repo) "
    "and common junk directories (.git, node_modules, build, dist, etc.) otherwise. "
    "include/exclude: a pattern with no '/' matches the basename at any depth; a pattern "
    "containing '/' matches the full relative path (auto-anchored with \"**/\" unless already anchored).")
_EDIT_DESCRIPTION = (
    "Edit a file using exact text replacement. Each edits[].old_text must be unique in the file "
    "and is matched against the original content, not incrementally. Merge nearby changes into "
    "one edit instead of overlapping edits. Use write_file to replace the whole file.")

TOOLS: tuple[Tool, ...] = (
    Tool("read_file", "Read file", _function(
        "read_file",
        "Read the contents of a file. Optionally specify a 1-based line range. "
        "If append_loc is true, each line is prefixed with its line number (e.g. \"1\u2192...\").",
        {"path": _prop("string", "Path to the file"),
         "start_line": _prop("integer", "First line to read, 1-based (default: 1)"),
         "end_line": _prop("integer", "Last line to read, 1-based inclusive (default: end of file)"),
         "append_loc": _prop("boolean", "Prefix each line with its line number")}, ("path",)), read_file),
    Tool("file_glob_search", "File search", _function(
        "file_glob_search", _GLOB_DESCRIPTION,
        {"path": _prop("string", "Base directory to search in"),
         "include": _prop("string", "Glob pattern for files to include (e.g. \"*.cpp\" or \"src/**/*.cpp\"). Default: **"),
         "exclude": _prop("string", "Glob pattern for files to exclude"),
         "type": _prop("string", "Entry type to return: \"file\" (default), \"dir\" or \"all\""),
         "max_depth": _prop("integer", "Maximum depth to descend into subdirectories (default: 0 = unlimited; 1 = direct children only)"),
         "limit": _prop("integer", f"Maximum number of results to return, capped at {FILE_SEARCH_MAX_RESULTS} (default {FILE_SEARCH_MAX_RESULTS})")},
        ("path",)), file_glob_search),
    Tool("grep_search", "Grep search", _function(
        "grep_search", _GREP_DESCRIPTION,
        {"path": _prop("string", "File or directory to search in"),
         "pattern": _prop("string", "Pattern to search for (regular expression unless literal is true)"),
         "include": _prop("string", "Glob pattern to filter files (default: **)"),
         "exclude": _prop("string", "Glob pattern to exclude files"),
         "return_line_numbers": _prop("boolean", "If true, include line numbers in results"),
         "literal": _prop("boolean", "Treat pattern as a literal string instead of a regular expression (default: false)"),
         "ignore_case": _prop("boolean", "Case-insensitive search (default: false)"),
         "context_lines": _prop("integer", "Number of lines of context to show before and after each match (default: 0)")},
        ("path", "pattern")), grep_search),
    Tool("exec_shell_command", "Execute shell command", _function(
        "exec_shell_command", "Execute a shell command and return its output (stdout and stderr combined).",
        {"command": _prop("string", "Shell command to execute"),
         "timeout": _prop("integer", f"Timeout in seconds (default 10, max {EXEC_MAX_TIMEOUT})"),
         "max_output_size": _prop("integer", f"Maximum output size in bytes (default {EXEC_MAX_OUTPUT_SIZE})")},
        ("command",)), exec_shell_command, permission_write=True, support_stream=True),
    Tool("write_file", "Write file", _function(
        "write_file", "Write content to a file, creating it (including parent directories) if it does not exist. "
                      "May use with edit_file for more complex edits.",
        {"path": _prop("string", "Path of the file to write"), "content": _prop("string", "Content to write")},
        ("path", "content")), write_file, permission_write=True),
    Tool("edit_file", "Edit file", _function(
        "edit_file", _EDIT_DESCRIPTION,
        {"path": _prop("string", "Path to the file to edit"),
         "edits": {"type": "array", "description": "One or more exact text replacements to apply",
                   "items": {"type": "object", "properties": {
                       "old_text": _prop("string", "Exact text to find; must be unique in the file and must not overlap with other edits"),
                       "new_text": _prop("string", "Text to replace old_text with")},
                       "required": ["old_text", "new_text"]}}},
        ("path", "edits")), edit_file, permission_write=True),
    Tool("get_info", "Get Runtime Info", _function(
        "get_info", "Returns runtime info: the OS name/version and the current working directory", {}, None), get_info),
)
TOOL_NAMES = tuple(t.name for t in TOOLS)


def select_tools(names: tuple[str, ...] | list[str]) -> tuple[Tool, ...]:
    """The tools ``--tools`` names (``all`` = every one), in llama-server's order.

    Raises ``ValueError`` with llama-server's message for an unknown name."""
    for name in names:
        if name != "all" and name not in TOOL_NAMES:
            raise ValueError(f'unknown tool "{name}". available tools: {", ".join(TOOL_NAMES)}')
    return tuple(t for t in TOOLS if "all" in names or t.name in names)


def mcp_tools(manager: Any, taken: tuple[Tool, ...] = ()) -> tuple[Tool, ...]:
    """The tools ``manager`` (an ``McpManager``) discovered, named ``SERVER_TOOL``; a name that is
    already taken is skipped with a warning, as llama-server does."""
    seen = {t.name for t in taken}
    out = []
    for d in manager.tools:
        name = f"{d.server}_{d.name}"
        if name in seen:
            log.warning('MCP tool "%s" from server "%s" collides with an existing tool, skipping',
                                                name, d.server)
            continue
        seen.add(name)
        schema = d.input_schema if isinstance(d.input_schema, dict) else {}
        definition = {"type": "function", "function": {"name": name, "description": d.description, "parameters": schema}}
        out.append(Tool(name, name, definition, _mcp_invoke(manager, d.server, d.name), uses_cwd=False, kind="mcp"))
    return tuple(out)


def _mcp_invoke(manager: Any, server: str, tool: str) -> Callable[[dict[str, Any], Chunk | None], dict[str, Any]]:
    return lambda params, stream=None: manager.call_tool(server, tool, params)
