"""llama-server's built-in agent tools (``--tools``): their definitions, and the selection served.

The chat page lists them with ``GET /tools`` and runs one with ``POST /tools`` when the model
calls it. Names, JSON schemas, limits and result shapes are llama-server's (b11312,
``tools/server/server-tools.cpp``), read from its code and checked against its binary:

- a tool's own failure is a 200 with ``{"error": "..."}``, which the page hands to the model;
- a parameter it cannot read raises ``ParamError`` (a 400), and an optional one of the wrong
  type falls back to its default, as llama-server's JSON library does (``agent_params.py``).

Everything here is plain Python on a worker thread (subprocesses for the shell, ``uname`` and
``git ls-files``); nothing touches MLX or the event loop. The tools are as powerful as the user
running the server: that is why they are off by default and the log warns when they are on.
Paths resolve against ``X-Tool-Cwd`` or the server's working directory and are not confined to
it, as in llama-server (``agent_host.py``).

This module holds the table (:data:`TOOLS`), ``--tools``' selection and the MCP servers' tools
in the same shape; the tools themselves are in ``agent_files.py`` (read, search, write, edit)
and ``agent_shell.py`` (shell, runtime info), on ``agent_params.py`` (parameters) and
``agent_host.py`` (processes, paths, listings).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from mlxcel_compat.server.agent_files import (
    FILE_SEARCH_MAX_RESULTS,
    edit_file,
    file_glob_search,
    grep_search,
    read_file,
    write_file,
)
from mlxcel_compat.server.agent_params import Chunk
from mlxcel_compat.server.agent_shell import EXEC_MAX_OUTPUT_SIZE, EXEC_MAX_TIMEOUT, exec_shell_command, get_info

log = logging.getLogger(__name__)


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


def _function(name: str, description: str, properties: dict[str, Any], required_keys: tuple[str, ...] | None) -> dict[str, Any]:
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required_keys is not None:
        parameters["required"] = list(required_keys)
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def _prop(kind: str, description: str) -> dict[str, Any]:
    return {"type": kind, "description": description}


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
